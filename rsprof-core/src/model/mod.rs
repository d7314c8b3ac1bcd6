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

/// A sample of a thread, as writers see it: a CPU sample, or off-CPU time (`off_cpu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// For off-CPU time, when its (last) block began.
    pub time: MonoNs,
    /// CPU time the thread used since its previous sample (0 for its first); 0 off-CPU.
    pub cpu_delta_ns: u64,
    /// None for a sample without any frame. Off-CPU: where the thread blocked.
    pub stack: Option<StackId>,
    pub off_cpu: Option<OffCpu>,
}

/// Time a thread spent off the CPU, with the stack it blocked in (see
/// `profiler_common::OffCpuHeader`): one block, or the sum of several short ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OffCpu {
    /// Off-CPU time this sample stands for.
    pub weight_ns: u64,
    /// Length of the block the stack was taken at (0: unknown).
    pub block_ns: u64,
    /// Blocks summed in `weight_ns`.
    pub blocks: u32,
    /// Kernel task state at the switch-out (1 sleeping, 2 uninterruptible, ...); 0 runnable
    /// (preempted, `--mode wall`).
    pub state: u32,
}

impl OffCpu {
    /// `ps`-style state letter and meaning.
    pub fn state_name(&self) -> &'static str {
        let s = self.state;
        if s == 0 {
            "R (runnable, waiting for a CPU)"
        } else if s & 1 != 0 {
            "S (sleeping)"
        } else if s & 0x402 == 0x402 {
            "I (idle)"
        } else if s & 2 != 0 {
            "D (uninterruptible)"
        } else if s & 0xc != 0 {
            "T (stopped or traced)"
        } else if s & 0x40 != 0 {
            "P (parked)"
        } else {
            "other"
        }
    }
}
