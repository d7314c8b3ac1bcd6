//! Normalized code addresses: what a stack frame is between collection and symbolization.

use super::ids::{LabelId, ModuleId, Pid};

/// A return address or instruction pointer, normalized so it means the same thing after the
/// process that ran it is gone. Callers' return addresses are stored minus one (the call
/// instruction), so they symbolize to the calling line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FrameAddr {
    Kernel(u64),
    /// Offset into the module's file.
    User {
        module: ModuleId,
        offset: u64,
    },
    /// A user address in no known mapping.
    Unmapped(u64),
    /// An `rsprof:label_push` label of a process.
    Label {
        pid: Pid,
        label: LabelId,
    },
    /// Stands for the stack of an off-CPU block whose stack the kernel did not take (see
    /// `profiler_common::OffCpuTrack`), so its time shows as such, never under no frame.
    OffCpuNotCaptured,
}
