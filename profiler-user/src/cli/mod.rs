//! Command-line arguments (`args`, clap structs only).

pub mod args;
