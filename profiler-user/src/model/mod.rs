//! Writer-neutral vocabulary shared across the pipeline: typed ids, symbolized frames and
//! stacks, process and thread metadata. Nothing here knows a file format.

pub mod ids;
pub mod stacks;
