//! The command line: clap structs (`args`), validated once into plans (`plan`); one syntax
//! for times (`duration`).

pub mod args;
pub mod duration;
pub mod plan;
