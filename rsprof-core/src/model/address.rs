//! Normalized code addresses: what a stack frame is between collection and symbolization.

use std::hash::{Hash, Hasher};

use super::ids::{JitSymbolId, LabelId, ModuleId, Pid};

/// A return address or instruction pointer, normalized so it means the same thing after the
/// process that ran it is gone. Callers' return addresses are stored minus one (the call
/// instruction), so they symbolize to the calling line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
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
    /// JIT code its process's perf map named (at the sample's time: the map can name a reused
    /// address differently later).
    Jit {
        pid: Pid,
        symbol: JitSymbolId,
    },
    /// An address in anonymous executable memory that its process's perf map did not name
    /// when the sample was collected; a line read later may still name it (a map written at
    /// exit or on demand), else it shows as `0x… (in [anon])`.
    Anon {
        pid: Pid,
        addr: u64,
    },
    /// Stands for the stack of an off-CPU block whose stack the kernel did not take (see
    /// `profiler_common::OffCpuTrack`), so its time shows as such, never under no frame.
    OffCpuNotCaptured,
    /// A pseudo-frame at the root of a user stack whose walk did not reach the outermost
    /// frame, saying why (and in which file, when the walk stopped in one), so an incomplete
    /// stack is never taken for a complete one.
    Truncated {
        end: UserStackEnd,
        module: Option<ModuleId>,
    },
}

/// Every frame of a new stack is hashed (interning its prefix-tree node), so the two common
/// kinds write one word, where the derived hash wrote the variant and each field apart. Equal
/// frames still hash equal; kinds whose words coincide only share a bucket.
impl Hash for FrameAddr {
    fn hash<H: Hasher>(&self, state: &mut H) {
        match *self {
            FrameAddr::Kernel(addr) => state.write_u64(addr),
            // Offsets fit in 40 bits (a 1 TiB file), module ids in the remaining 24 for the
            // first 16 million files; beyond either, words may coincide, which is allowed.
            FrameAddr::User { module, offset } => {
                state.write_u64(offset ^ u64::from(module.0).rotate_right(24))
            }
            FrameAddr::Unmapped(addr) => {
                state.write_u8(2);
                state.write_u64(addr);
            }
            FrameAddr::Label { pid, label } => {
                state.write_u8(3);
                pid.hash(state);
                label.hash(state);
            }
            FrameAddr::Jit { pid, symbol } => {
                state.write_u8(6);
                pid.hash(state);
                symbol.hash(state);
            }
            FrameAddr::Anon { pid, addr } => {
                state.write_u8(7);
                pid.hash(state);
                state.write_u64(addr);
            }
            FrameAddr::OffCpuNotCaptured => state.write_u8(4),
            FrameAddr::Truncated { end, module } => {
                state.write_u8(5);
                end.hash(state);
                module.hash(state);
            }
        }
    }
}

/// How the walk of a sample's user stack ended (`profiler_common::UNWIND_END_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum UserStackEnd {
    /// Frame pointers (`--unwind fp`), whose end is unknown, or no user stack at all.
    NotWalked,
    Complete,
    DepthLimit,
    NoProcess,
    NoMapping,
    NoTable,
    NoCfi,
    Unsupported,
    ReadFault,
    FramePointer,
}

impl UserStackEnd {
    /// From a sample's flags (bits `SAMPLE_UNWIND_SHIFT..`).
    pub fn from_flags(flags: u32) -> Self {
        use profiler_common as c;
        match (flags & c::SAMPLE_UNWIND_MASK) >> c::SAMPLE_UNWIND_SHIFT {
            c::UNWIND_END_COMPLETE => Self::Complete,
            c::UNWIND_END_DEPTH => Self::DepthLimit,
            c::UNWIND_END_NO_PROCESS => Self::NoProcess,
            c::UNWIND_END_NO_MAPPING => Self::NoMapping,
            c::UNWIND_END_NO_TABLE => Self::NoTable,
            c::UNWIND_END_NO_CFI => Self::NoCfi,
            c::UNWIND_END_UNSUPPORTED => Self::Unsupported,
            c::UNWIND_END_READ_FAULT => Self::ReadFault,
            c::UNWIND_END_FRAME_POINTER => Self::FramePointer,
            _ => Self::NotWalked,
        }
    }

    /// Whether the stack misses its root side and gets a pseudo-frame saying so.
    pub fn is_truncated(self) -> bool {
        !matches!(self, Self::NotWalked | Self::Complete)
    }

    /// The pseudo-frame's name; `module`: the file the walk stopped in.
    pub fn describe(self, module: Option<&str>) -> String {
        let m = module.unwrap_or("?");
        let why = match self {
            Self::NotWalked => "not walked".to_owned(),
            Self::Complete => "complete".to_owned(),
            Self::DepthLimit => "depth limit".to_owned(),
            Self::NoProcess => "process not loaded yet".to_owned(),
            // The walker's copy of the process's mappings lacked the address; when userspace
            // knows the file, it was mapped too recently for the walker (not yet written).
            Self::NoMapping => match module {
                Some(m) => format!("{m} not yet known to the unwinder"),
                None => "address in no known mapping".to_owned(),
            },
            Self::NoTable => format!("no unwind table for {m}"),
            Self::NoCfi => format!("no CFI in {m}"),
            Self::Unsupported => format!("unsupported CFI rule in {m}"),
            Self::ReadFault => "stack unreadable".to_owned(),
            Self::FramePointer => format!("frame pointers ended in {m}"),
        };
        format!("[truncated: {why}]")
    }
}
