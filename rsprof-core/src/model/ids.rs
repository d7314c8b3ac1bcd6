//! Typed ids for values that cross module lines.

use std::fmt;

/// A process id (the kernel's thread-group id), in the initial pid namespace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Pid(pub u32);

/// A thread id (the kernel's task pid), in the initial pid namespace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tid(pub u32);

impl fmt::Display for Pid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for Tid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A thread as it appears in a profile. The kernel's idle tasks all have pid and tid 0, so
/// they are told apart by CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ThreadKey {
    /// The idle task (`swapper/N`) of one CPU.
    Idle {
        cpu: u32,
    },
    Task {
        pid: Pid,
        tid: Tid,
    },
}

impl ThreadKey {
    pub fn is_idle(&self) -> bool {
        matches!(self, ThreadKey::Idle { .. })
    }

    /// The process the thread belongs to; None for the idle tasks.
    pub fn pid(&self) -> Option<Pid> {
        match *self {
            ThreadKey::Idle { .. } => None,
            ThreadKey::Task { pid, .. } => Some(pid),
        }
    }
}

/// A node of the stored stack prefix tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StackId(pub u32);

/// A string interned beside the stored events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StringId(pub u32);

/// A mapped file (executable or library), one per (device, inode) across all processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModuleId(pub u32);

/// An `rsprof:label_push` label: the user address of its text in the pushing process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LabelId(pub u64);

/// A JIT function a process's perf map named, by its index in that process's
/// `ProcessMeta::jit_symbols`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JitSymbolId(pub u32);

/// A cgroup v2 id (the inode number of its directory; `bpf_get_current_cgroup_id`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CgroupId(pub u64);
