//! The symbolized profile handed to writers: what was recorded, with every frame named.
//! Writers (Gecko today) read only this; they never see BPF records or addresses to resolve.

use crate::ids::{Pid, Tid};

/// Which part of the system a frame ran in; picks its Gecko category.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrameKind {
    User,
    Kernel,
}

/// One symbolized frame. An address whose function could not be named keeps its module and
/// offset in `function` (e.g. `0x1234`) so it never disappears.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Frame {
    pub kind: FrameKind,
    /// Demangled function name, or `0x<offset>` when unknown.
    pub function: String,
    /// Module file name (`libc.so.6`, `[kernel.kallsyms]`, `[unknown]`).
    pub module: String,
    pub file: Option<String>,
    pub line: Option<u32>,
    pub column: Option<u32>,
    /// True for a frame of a function inlined into the next-outer frame (same address).
    pub inlined: bool,
}

/// Index into [`Profile::frames`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FrameIndex(pub u32);

/// Index into [`Profile::stacks`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StackIndex(pub u32);

#[derive(Clone, Debug)]
pub struct Sample {
    /// Milliseconds since [`Profile::start_time_ms`].
    pub time_ms: f64,
    /// CPU time the thread used since its previous sample, in ns (first sample: 0).
    pub cpu_delta_ns: Option<u64>,
    /// None = a sample with no stack (both stack reads failed).
    pub stack: Option<StackIndex>,
    /// The sampled task was the CPU's idle task.
    pub idle: bool,
}

#[derive(Clone, Debug)]
pub struct Thread {
    pub tid: Tid,
    /// Last name the thread had (its `comm`).
    pub name: String,
    /// Earlier names, oldest first, when the thread renamed itself.
    pub previous_names: Vec<String>,
    /// The process's main thread (tid == pid).
    pub is_main: bool,
    /// ms since profile start; first sight (fork, exec or first sample).
    pub register_time_ms: f64,
    /// ms since profile start, if the thread exited during the recording.
    pub unregister_time_ms: Option<f64>,
    /// Sorted by time.
    pub samples: Vec<Sample>,
}

#[derive(Clone, Debug)]
pub struct Process {
    pub pid: Pid,
    /// Executable name (`comm` of the main thread after exec).
    pub name: String,
    /// argv joined with spaces; empty when unknown.
    pub command_line: String,
    pub start_time_ms: f64,
    pub end_time_ms: Option<f64>,
    /// Per-CPU idle tasks are shown as one process of `swapper/N` threads.
    pub is_idle: bool,
    /// The container or systemd service it runs in (from its cgroup), if any.
    pub container: Option<crate::container::Identity>,
    pub threads: Vec<Thread>,
}

#[derive(Clone, Debug, Default)]
pub struct Profile {
    /// Wall-clock time of the profile's zero, ms since the Unix epoch.
    pub start_time_ms: f64,
    /// Sampling interval, ms (1000 / frequency).
    pub interval_ms: f64,
    /// End of recording, ms since start.
    pub end_time_ms: f64,
    pub logical_cpus: u32,
    pub physical_cpus: u32,
    /// e.g. `rsprof-bpf 0.1.0 --all -F 999`.
    pub product: String,
    /// `uname -sr`-like string.
    pub oscpu: String,
    pub frames: Vec<Frame>,
    /// Each stack is a list of frames, root (outermost, e.g. `_start`) first, leaf last.
    pub stacks: Vec<Vec<FrameIndex>>,
    pub processes: Vec<Process>,
}
