//! Writer-neutral vocabulary shared across the pipeline: typed ids and times, normalized
//! addresses, symbolized frames and stacks, process and thread metadata, markers and their
//! schemas, recording info. Nothing here knows a file format.

pub mod address;
pub mod container;
pub mod ids;
pub mod markers;
pub mod process;
pub mod recording;
pub mod stacks;
pub mod time;

use ids::StackId;
use time::MonoNs;

/// A CPU sample of a thread, as writers see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    pub time: MonoNs,
    /// CPU time the thread used since its previous sample (0 for its first).
    pub cpu_delta_ns: u64,
    /// None for a sample without any frame.
    pub stack: Option<StackId>,
}
