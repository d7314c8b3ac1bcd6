//! The command line: clap structs (`args`), validated once into plans (`plan`).

pub mod args;
pub mod plan;
