//! Record layouts shared by the BPF programs (`profiler-ebpf`) and the loader (`profiler-user`).
//!
//! Every record sent through the ring buffer starts with [`EventHeader`]; `kind` says which
//! struct follows. Records are written with `bpf_ringbuf_output` at their used length, so a
//! sample with a 10-frame stack costs ~170 bytes of ring space, not the full array.
#![no_std]

/// Deepest stack `bpf_get_stack` returns (the kernel's default `perf_event_max_stack`).
pub const MAX_STACK_DEPTH: usize = 127;
pub const TASK_COMM_LEN: usize = 16;
/// Bytes of `argv` copied at exec time; longer command lines are cut and flagged.
pub const CMDLINE_MAX: usize = 256;

pub const EVENT_SAMPLE: u32 = 1;
pub const EVENT_FORK: u32 = 2;
pub const EVENT_EXEC: u32 = 3;
pub const EVENT_EXIT: u32 = 4;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventHeader {
    pub kind: u32,
    pub cpu: u32,
    /// CLOCK_MONOTONIC nanoseconds (`bpf_ktime_get_ns`).
    pub time_ns: u64,
    /// Thread-group id (the process id users see).
    pub pid: u32,
    /// Kernel task id (the thread id).
    pub tid: u32,
}

/// Sample flags.
pub const SAMPLE_KERNEL_STACK_ERROR: u32 = 1 << 0;
pub const SAMPLE_USER_STACK_ERROR: u32 = 1 << 1;
/// The interrupted instruction was in user mode (the kernel stack is then empty).
pub const SAMPLE_USER_MODE: u32 = 1 << 2;
pub const SAMPLE_CPU_TIME_ERROR: u32 = 1 << 3;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SampleHeader {
    pub header: EventHeader,
    /// cgroup v2 id (inode of the cgroup directory) of the sampled task.
    pub cgroup_id: u64,
    /// The task's `se.sum_exec_runtime` at sample time: its real CPU time so far.
    pub cpu_time_ns: u64,
    pub comm: [u8; TASK_COMM_LEN],
    pub kernel_frames: u16,
    pub user_frames: u16,
    pub flags: u32,
}

/// A CPU-clock sample. `frames` holds `kernel_frames` kernel addresses (leaf first) followed by
/// `user_frames` user addresses (leaf first); only that prefix is sent.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SampleRecord {
    pub sample: SampleHeader,
    pub frames: [u64; 2 * MAX_STACK_DEPTH],
}

/// Process/thread lifecycle: fork (the new task is `header.pid/tid`, its creator is
/// `parent_pid/tid`), exec (argv in `cmdline`), exit (of the thread `header.tid`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TaskRecord {
    pub header: EventHeader,
    pub parent_pid: u32,
    pub parent_tid: u32,
    pub comm: [u8; TASK_COMM_LEN],
    /// Bytes of `cmdline` that follow (exec only); NUL-separated argv.
    pub cmdline_len: u32,
    /// 1 when argv was longer than `CMDLINE_MAX` and was cut.
    pub cmdline_truncated: u32,
    pub cmdline: [u8; CMDLINE_MAX],
}

/// Size of a `TaskRecord` without its trailing `cmdline`.
pub const TASK_RECORD_FIXED: usize = core::mem::size_of::<TaskRecord>() - CMDLINE_MAX;
pub const SAMPLE_RECORD_FIXED: usize = core::mem::size_of::<SampleHeader>();

/// Filter modes for [`Config::filter_mode`].
pub const FILTER_ALL: u32 = 0;
/// Only tasks whose thread-group id is in the `TARGETS` map.
pub const FILTER_TARGETS: u32 = 1;

/// Set by the loader before the programs are loaded (a `.rodata` global).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Config {
    pub filter_mode: u32,
    /// Add processes forked by a target to the targets (for `-- CMD`).
    pub follow_children: u32,
    /// Byte offsets into kernel structs, read from the running kernel's BTF.
    pub task_sum_exec_runtime: u32,
    pub task_pid: u32,
    pub task_tgid: u32,
    pub task_mm: u32,
    pub mm_arg_start: u32,
    pub mm_arg_end: u32,
}

/// Deepest cgroup level the cgroup filter can select (levels are bits of a u64).
pub const MAX_CGROUP_LEVEL: u32 = 63;
/// Most cgroups `--cgroup`/`--container` can select at once.
pub const MAX_SELECTED_CGROUPS: u32 = 1024;

/// The cgroup filter (`--cgroup`, `--container`): a second `.rodata` global, `CGROUP_FILTER`,
/// next to [`Config`]. A task is selected when its cgroup or one of its ancestors is in the
/// `SELECTED_CGROUPS` map; only the ancestor levels set in `levels` are looked up.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CgroupFilter {
    pub enabled: u32,
    pub _pad: u32,
    /// Bit L set: some selected cgroup is at level L (root = 0). All bits when unknown.
    pub levels: u64,
}

/// Indices into the per-CPU `COUNTERS` array. Every sample the perf event delivers lands in
/// exactly one of the first four; the rest are per-cause details.
pub mod counter {
    /// Sample written to the ring buffer.
    pub const SAMPLES_SENT: u32 = 0;
    /// Sample of a task the filter does not select (not a loss).
    pub const SAMPLES_FILTERED: u32 = 1;
    /// Ring buffer full: the sample was lost.
    pub const LOST_RINGBUF_FULL: u32 = 2;
    /// Per-CPU scratch buffer unavailable: the sample was lost.
    pub const LOST_NO_SCRATCH: u32 = 3;
    /// Sample sent, but `bpf_get_stack` failed for its kernel stack.
    pub const KERNEL_STACK_ERRORS: u32 = 4;
    /// Sample sent, but `bpf_get_stack` failed for its user stack.
    pub const USER_STACK_ERRORS: u32 = 5;
    /// Lifecycle record lost because the ring buffer was full.
    pub const LOST_TASK_EVENTS: u32 = 6;
    /// Reading the task's CPU time failed.
    pub const CPU_TIME_ERRORS: u32 = 7;
    /// Target set full: a child of `-- CMD` could not be followed.
    pub const TARGETS_FULL: u32 = 8;
    pub const COUNT: u32 = 9;
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: plain `#[repr(C)]` data with no padding-dependent invariants.
    unsafe impl aya::Pod for super::Config {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::CgroupFilter {}
}
