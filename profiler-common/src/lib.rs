//! Record layouts shared by the BPF programs (`profiler-ebpf`) and the loader (`profiler-user`).
//!
//! Every record sent through the ring buffer starts with [`EventHeader`]; `kind` says which
//! struct follows. Records are written with `bpf_ringbuf_output` at their used length, so a
//! sample with a 10-frame stack costs ~170 bytes of ring space, not the full array.
#![no_std]

mod python;
mod unwind;
pub use python::*;
pub use unwind::*;

/// Deepest stack `bpf_get_stack` returns (the kernel's default `perf_event_max_stack`).
pub const MAX_STACK_DEPTH: usize = 127;
pub const TASK_COMM_LEN: usize = 16;
/// Bytes of `argv` copied at exec time; longer command lines are cut and flagged.
pub const CMDLINE_MAX: usize = 256;

pub const EVENT_SAMPLE: u32 = 1;
pub const EVENT_FORK: u32 = 2;
pub const EVENT_EXEC: u32 = 3;
pub const EVENT_EXIT: u32 = 4;
/// A USDT probe hit ([`UsdtRecord`]).
pub const EVENT_USDT: u32 = 5;
/// Off-CPU time of a thread ([`OffCpuRecord`]).
pub const EVENT_OFF_CPU: u32 = 6;
/// An executable mapping was made ([`MapRecord`]).
pub const EVENT_MMAP: u32 = 7;
/// An executable mapping was removed, or a range was remapped non-executable
/// ([`MapRecord`] with only the range set).
pub const EVENT_MUNMAP: u32 = 8;
/// A label pushed where the kernel could not yet walk the pusher's stack, with a copy of it
/// ([`LabelDepthHeader`]).
pub const EVENT_LABEL_DEPTH: u32 = 9;
/// A thread blocked where the kernel could not yet walk its user stack (a file's table not
/// loaded): a copy of it, sent at the switch-out ([`OffCpuCopyHeader`]), for the off-CPU record
/// that carries that block's stack.
pub const EVENT_OFF_CPU_COPY: u32 = 10;

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
/// Off-CPU record of a long block whose stacks were not walked (see [`OffCpuTrack`]): it has
/// no frames, and is flagged so that it shows as not captured rather than under no stack.
pub const OFF_CPU_STACK_NOT_CAPTURED: u32 = 1 << 4;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SampleHeader {
    pub header: EventHeader,
    /// cgroup v2 id (inode of the cgroup directory) of the sampled task.
    pub cgroup_id: u64,
    /// The task's CPU time so far, current at the sample: its `se.sum_exec_runtime` at its
    /// last switch-in plus the time it has run since (see profiler-ebpf's sched.rs).
    pub cpu_time_ns: u64,
    pub comm: [u8; TASK_COMM_LEN],
    pub kernel_frames: u16,
    pub user_frames: u16,
    pub flags: u32,
    /// Label ids (see [`LabelStack`]) following the user frames, outermost first.
    pub label_count: u32,
    /// Python frames (two words each, innermost first) following the labels.
    pub py_frames: u32,
}

/// A CPU-clock sample. `frames` holds `kernel_frames` kernel addresses (leaf first), then
/// `user_frames` user addresses (leaf first), then `label_count` label ids of the thread's
/// `rsprof:label_push` stack (outermost first), then `py_frames` Python frames (code object,
/// instruction; innermost first, see [`PY_FRAME_ENTRY`]); only that prefix is sent.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SampleRecord {
    pub sample: SampleHeader,
    pub frames: [u64; 2 * MAX_STACK_DEPTH + LABEL_MAX_DEPTH + 2 * PY_MAX_FRAMES],
}

/// The sampler's per-CPU scratch value: a sample plus room for a [`StackCopyHeader`] and
/// `STACK_COPY_MAX` stack bytes, written right after the sample's used frames and labels (a
/// sample with a copy is one record, sent at its used length).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SampleScratch {
    pub rec: SampleRecord,
    pub copy: [u8; STACK_COPY_HEADER_SIZE + STACK_COPY_MAX],
}

/// Process/thread lifecycle: fork (the new task is `header.pid/tid`, its creator is
/// `parent_pid/tid`), exec (argv in `cmdline`), exit (of the thread `header.tid`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TaskRecord {
    pub header: EventHeader,
    pub parent_pid: u32,
    pub parent_tid: u32,
    /// The task's `mm_struct` (fork: the child's; exec: the new image's): which address
    /// space later [`MapRecord`]s of the process belong to. 0 if unreadable.
    pub mm: u64,
    /// Exec only: start of the vDSO in the new image (`mm->context.vdso`), 0 if unknown.
    pub vdso: u64,
    pub comm: [u8; TASK_COMM_LEN],
    /// Bytes of `cmdline` that follow (exec only); NUL-separated argv.
    pub cmdline_len: u32,
    /// 1 when argv was longer than `CMDLINE_MAX` and was cut.
    pub cmdline_truncated: u32,
    /// `TASK_*` flags.
    pub flags: u32,
    pub _pad: u32,
    pub cmdline: [u8; CMDLINE_MAX],
}

/// [`TaskRecord::flags`] of a fork: the kernel copied the parent's walker entry
/// (`UNWIND_PROCS`) to the new process, which userspace then only has to adopt.
pub const TASK_WALKER_COPIED: u32 = 1 << 0;

/// Size of a `TaskRecord` without its trailing `cmdline`.
pub const TASK_RECORD_FIXED: usize = core::mem::size_of::<TaskRecord>() - CMDLINE_MAX;

/// Bytes of a mapped file's path components kept (see [`MapRecord::path`]).
pub const MAP_PATH_MAX: usize = 256;
/// Longest single path component read; longer names are cut (and the path flagged).
pub const MAP_NAME_MAX: usize = 64;
/// Deepest path walked (components plus mount crossings).
pub const MAP_PATH_DEPTH: u32 = 24;

/// Records that ask to wake userspace (a new image or executable mapping, which the DWARF
/// unwinder's loader wants soon) wake it at most this often; userspace drains again this
/// long after a drain that saw any, so none waits longer.
pub const WAKE_GAP_NS: u64 = 10_000_000;

/// [`MapRecord::flags`].
pub const MAP_ANON: u32 = 1 << 0;
/// The path walk reached the root of the mount tree: `path` is absolute.
pub const MAP_PATH_COMPLETE: u32 = 1 << 1;
/// Sent at exec for the new image's executable: `start..start+len` is its code
/// (`mm->start_code..end_code`, the lowest executable segment's `p_vaddr` plus the load bias);
/// `offset` is unknown (userspace takes it from the file's program headers).
pub const MAP_EXE_TEXT: u32 = 1 << 2;
/// Sent at exec for the ELF interpreter (ld.so): `start` is its load base (`AT_BASE`); the
/// file identity and path are those of the mapping at the base (`len` its length), or, when
/// that could not be looked up, absent (`inode` 0: userspace takes the interpreter from the
/// executable's `PT_INTERP`).
pub const MAP_INTERP: u32 = 1 << 3;

/// An executable mapping made (mmap(2) with PROT_EXEC; at exec, the executable and the
/// interpreter) or a range unmapped (munmap(2)).
/// `path` holds the file's path components leaf first, each NUL-terminated (`libc.so.6\0
/// x86_64-linux-gnu\0lib\0usr\0`), walked from the dentry across mounts; only `path_len`
/// bytes are sent.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MapRecord {
    pub header: EventHeader,
    pub start: u64,
    pub len: u64,
    /// File offset of `start`, in bytes.
    pub offset: u64,
    /// The address space (`mm_struct`) the mapping is in.
    pub mm: u64,
    pub inode: u64,
    /// Kernel `dev_t` of the file's superblock (major << 20 | minor).
    pub dev: u32,
    pub flags: u32,
    pub path_len: u32,
    /// The mapping's number among the process's early mappings (`UnwindEarly`), 0 if the
    /// kernel did not add it there.
    pub early_seq: u32,
    /// Room for one more component read past `MAP_PATH_MAX`, which the verifier needs.
    pub path: [u8; MAP_PATH_MAX + MAP_NAME_MAX],
}

/// mmap(2) arguments kept from syscall entry to exit (map `MMAP_PENDING`, keyed by tid).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PendingMmap {
    pub len: u64,
    pub flags: u64,
    pub fd: u64,
    pub off: u64,
}

/// mprotect(2) or mremap(2) arguments kept from syscall entry to exit (map `RANGE_PENDING`,
/// keyed by tid): the range, for mremap the new length, and whether the range held code at
/// entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PendingRange {
    pub start: u64,
    pub len: u64,
    pub new_len: u64,
    pub was_exec: u64,
}

/// Slots of the program array `CODE_RANGE_PROGS`: the VMA walks the mprotect/mremap hooks
/// tail-call, filled by userspace with the programs of the same names.
pub mod code_range {
    pub const CHECK_CODE_RANGE: u32 = 0;
    pub const SEND_CODE_RANGE: u32 = 1;
}

pub const MAP_RECORD_FIXED: usize =
    core::mem::size_of::<MapRecord>() - (MAP_PATH_MAX + MAP_NAME_MAX);
pub const SAMPLE_RECORD_FIXED: usize = core::mem::size_of::<SampleHeader>();

/// Off-CPU time of one thread, sent when it runs again. Either one block (a switch-out in a
/// blocking state, `blocks == 1`, at least `Config::off_cpu_min_ns` long) or the sum of the
/// thread's shorter blocks since its last such sum (`blocks > 1` or shorter), sent by the
/// block that brought the sum to `off_cpu_min_ns`: its stack stands for all of them, so each
/// stack is picked in proportion to its share of the short blocks' time on average, while the
/// thread's off-CPU total stays exact. `header.time_ns` is when the (last) block began.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct OffCpuHeader {
    pub header: EventHeader,
    pub cgroup_id: u64,
    /// Off-CPU time this record stands for.
    pub weight_ns: u64,
    /// Length of the block whose stack is sent (the last one).
    pub block_ns: u64,
    /// Blocks summed in `weight_ns`.
    pub blocks: u32,
    /// The task state at the switch (`TASK_INTERRUPTIBLE` = 1, `TASK_UNINTERRUPTIBLE` = 2,
    /// ...); 0: preempted while runnable (only with `OFF_CPU_WALL`).
    pub state: u32,
    pub comm: [u8; TASK_COMM_LEN],
    pub kernel_frames: u16,
    pub user_frames: u16,
    /// `SAMPLE_*_STACK_ERROR`.
    pub flags: u32,
    /// Kernel-side bookkeeping, sent as is and ignored: the thread's blocks not yet sent.
    pub pending_ns: u64,
    pub pending_blocks: u32,
    /// Kernel-side: 1 from the switch-out until the switch-in.
    pub off_cpu: u32,
    /// When the block whose stack this record carries began (its switch-out): the key of the
    /// [`OffCpuCopyHeader`] sent then, if the walk wanted one.
    pub stack_ns: u64,
    /// Python frames (two words each, see [`SampleHeader::py_frames`]) after the user frames.
    pub py_frames: u32,
    pub _pad: u32,
}

/// [`OffCpuHeader`] plus `kernel_frames` kernel then `user_frames` user addresses, leaf first,
/// then `py_frames` Python frames, taken at the switch-out; only that prefix is sent (`track`
/// never is).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct OffCpuRecord {
    pub off: OffCpuHeader,
    pub frames: [u64; 2 * MAX_STACK_DEPTH + 2 * PY_MAX_FRAMES],
    pub track: OffCpuTrack,
}

/// Sent at a switch-out whose user stack walk stopped for want of a table (a process or
/// library that just started): where the walk stopped and a copy of the stack from there (a
/// [`StackCopyHeader`] and its bytes follow). Userspace continues the walk over it when the
/// thread's off-CPU record with `stack_ns` equal to this header's time arrives. Off-CPU
/// stacks are taken once per block, so without it a thread that blocks in its first
/// milliseconds would keep a cut stack for as long as it sleeps.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct OffCpuCopyHeader {
    pub header: EventHeader,
    /// User frames the kernel walked; the last is where it stopped (the copy's `pc`).
    pub frames: u32,
    pub _pad: u32,
}

pub const OFF_CPU_COPY_RECORD_FIXED: usize = core::mem::size_of::<OffCpuCopyHeader>();

/// `sched_switch`'s per-CPU scratch for an [`OffCpuCopyHeader`] record and its copy.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct OffCpuCopyScratch {
    pub rec: OffCpuCopyHeader,
    pub copy: [u8; STACK_COPY_HEADER_SIZE + STACK_COPY_MAX],
}

/// Kernel-side state deciding whether a thread's next block gets its stacks walked (about
/// 2 µs for both, most of what off-CPU recording costs a switch). A block's stack is used
/// only if it is long (sent alone) or it brings the pending short-block sum to
/// `off_cpu_min_ns` (it carries the sum: one stack per `off_cpu_min_ns` off-CPU, as CPU
/// sampling takes one per interval). So the walk is taken when the thread is new, its last
/// block was long (long blocks come in runs), the last block at this blocking site (the user
/// address the syscall returns to) was long, the thread has not blocked at this site
/// recently, or the sum is within the recent short blocks' length of the threshold. A long block that was not walked is sent with no stack
/// and `OFF_CPU_STACK_NOT_CAPTURED` (never another block's stack), and its site is remembered.
/// A sum that reached the threshold in a block that was not walked stays pending: the next
/// block is walked and carries it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct OffCpuTrack {
    /// Decaying maximum of the thread's recent short blocks.
    pub short_max_ns: u64,
    /// The current block's site (0: unknown).
    pub site: u64,
    /// Sites whose last block was long (0: free), replaced round-robin.
    pub long_sites: [u64; OFF_CPU_LONG_SITES],
    pub next_long_site: u32,
    /// `TRACK_*`.
    pub flags: u32,
    /// Sites the thread blocked at recently (0: free), replaced round-robin: a block at a site
    /// not among them is walked, so a thread's first long block somewhere new (a reader's
    /// first `read` after a short lock wait) is not sent without its stack.
    pub seen_sites: [u64; OFF_CPU_SEEN_SITES],
    pub next_seen_site: u32,
    pub _pad: u32,
}

pub const OFF_CPU_LONG_SITES: usize = 4;
pub const OFF_CPU_SEEN_SITES: usize = 8;
/// [`OffCpuTrack::flags`]: the current block's stacks were walked.
pub const TRACK_WALKED: u32 = 1 << 0;
/// The thread's last ended block was long.
pub const TRACK_PREV_LONG: u32 = 1 << 1;
/// The frames hold the stack of a block in the pending sum (what a sum sent at the thread's
/// exit carries; without it, the sum goes without a stack).
pub const TRACK_SUM_HAS_STACK: u32 = 1 << 2;

pub const OFF_CPU_RECORD_FIXED: usize = core::mem::size_of::<OffCpuHeader>();

/// [`Config::off_cpu`]: not recorded.
pub const OFF_CPU_NONE: u32 = 0;
/// Time blocked (switch-outs in a sleeping state; a preempted runnable thread is not off-CPU).
pub const OFF_CPU_BLOCKED: u32 = 1;
/// Every switch-out, preemptions included, so on-CPU plus off-CPU time is the wall time.
pub const OFF_CPU_WALL: u32 = 2;

/// Filter modes for [`Config::filter_mode`].
pub const FILTER_ALL: u32 = 0;
/// Only tasks whose thread-group id is in the `TARGETS` map.
pub const FILTER_TARGETS: u32 = 1;

/// Set by the loader before the programs are loaded (a `.rodata` global).
/// [`Config::ZERO`] is the placeholder the loader overwrites.
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
    /// For mapping tracking (see profiler-ebpf's maptrack.rs); 0 where absent.
    pub mm_vdso: u32,
    pub file_inode: u32,
    pub file_path_mnt: u32,
    pub file_path_dentry: u32,
    pub inode_ino: u32,
    pub inode_sb: u32,
    pub sb_dev: u32,
    pub dentry_parent: u32,
    pub dentry_name: u32,
    pub vfsmount_root: u32,
    /// Offset of the `struct vfsmount` embedded in `struct mount`.
    pub mount_mnt: u32,
    pub mount_parent: u32,
    pub mount_mountpoint: u32,
    pub mm_start_code: u32,
    pub mm_end_code: u32,
    pub mm_exe_file: u32,
    pub mm_saved_auxv: u32,
    pub task_files: u32,
    pub files_fdt: u32,
    pub fdtable_fd: u32,
    pub fdtable_max_fds: u32,
    /// `OFF_CPU_*`.
    pub off_cpu: u32,
    /// Blocks shorter than this are summed per thread (see [`OffCpuHeader`]); 8-aligned after
    /// an even number of u32 fields.
    pub off_cpu_min_ns: u64,
    /// Offset of the user instruction pointer in `struct pt_regs` (an off-CPU block's site).
    pub pt_regs_ip: u32,
    /// `UNWIND_MODE_*`: how user stacks are walked.
    pub unwind_mode: u32,
    /// Stack-copy bytes each CPU may send per 100 ms (see `SAMPLE_STACK_COPY`): keeps a burst
    /// of copies (every process new to the tables at start-up) from filling the ring buffer,
    /// which is sized for samples without copies. Set by the loader from the ring's size.
    pub stack_copy_budget: u32,
    /// Nonzero (hidden `--bpf-timing`): the sampler times each sample into `SAMPLER_TIMING`.
    pub bpf_timing: u32,
    /// `struct vm_area_struct` fields, for mprotect(2) and mremap(2) of code (maptrack.rs).
    pub vma_start: u32,
    pub vma_end: u32,
    pub vma_pgoff: u32,
    pub vma_file: u32,
    pub vma_flags: u32,
    /// `task_struct.thread.fsbase`: a thread's TLS pointer, where CPython's thread state is
    /// found (see [`PyProc`])..
    pub task_fsbase: u32,
    /// Nonzero: a new image or executable mapping wakes userspace (soon, within
    /// `WAKE_GAP_NS`), so the DWARF walker gets the process's entry within milliseconds. The
    /// agent leaves it 0: at its rate a process is rarely sampled before the timed drain, and a
    /// wakeup per exec is most of what an exec storm costs it (a sampled process's stack is
    /// still continued over a stack copy).
    pub wake_for_tables: u32,
    /// `struct inode` fields that tell a file rewritten in place (same inode) from the one
    /// whose table `UNWIND_FILES` holds; 0: not found, no early mappings.
    pub inode_size: u32,
    pub inode_mtime_sec: u32,
    pub inode_mtime_nsec: u32,
    /// Nonzero: code mappings of loaded files are given to the walker at mmap/exec
    /// (`UnwindEarly`). `record` sets it; the agent leaves it 0: it writes a process's entry
    /// only once sampled anyway, and the lookups cost an exec storm about 1.5 µs a mapping.
    pub early_mappings: u32,
    /// Keeps the size a multiple of 8 with no implicit padding (the loader copies it as bytes).
    pub _pad: u32,
}

/// [`Config::unwind_mode`]: frame pointers (`bpf_get_stack`).
pub const UNWIND_MODE_FP: u32 = 0;
/// Unwind tables (`UNWIND_ROWS`); a frame without a table ends the walk.
pub const UNWIND_MODE_DWARF: u32 = 1;
/// Unwind tables, following frame pointers through code without one (flagged).
pub const UNWIND_MODE_DWARF_FP: u32 = 2;

impl Config {
    pub const ZERO: Config = Config {
        filter_mode: FILTER_ALL,
        follow_children: 0,
        task_sum_exec_runtime: 0,
        task_pid: 0,
        task_tgid: 0,
        task_mm: 0,
        mm_arg_start: 0,
        mm_arg_end: 0,
        mm_vdso: 0,
        file_inode: 0,
        file_path_mnt: 0,
        file_path_dentry: 0,
        inode_ino: 0,
        inode_sb: 0,
        sb_dev: 0,
        dentry_parent: 0,
        dentry_name: 0,
        vfsmount_root: 0,
        mount_mnt: 0,
        mount_parent: 0,
        mount_mountpoint: 0,
        mm_start_code: 0,
        mm_end_code: 0,
        mm_exe_file: 0,
        mm_saved_auxv: 0,
        task_files: 0,
        files_fdt: 0,
        fdtable_fd: 0,
        fdtable_max_fds: 0,
        off_cpu: 0,
        off_cpu_min_ns: 0,
        pt_regs_ip: 0,
        unwind_mode: UNWIND_MODE_FP,
        stack_copy_budget: 0,
        bpf_timing: 0,
        vma_start: 0,
        vma_end: 0,
        vma_pgoff: 0,
        vma_file: 0,
        vma_flags: 0,
        task_fsbase: 0,
        wake_for_tables: 0,
        inode_size: 0,
        inode_mtime_sec: 0,
        inode_mtime_nsec: 0,
        early_mappings: 0,
        _pad: 0,
    };
}

/// `SAMPLER_TIMING` (per-CPU u64 array, `--bpf-timing`): a log-linear histogram of the
/// sampler's run time per sample that passed the filter, in ns, measured with
/// `bpf_ktime_get_ns` from program entry to the ring buffer output; then the number of timed
/// samples, the sum of their user frames and the ring buffer bytes they took (record rounded
/// up to 8 plus the ring's 8-byte record header). Buckets: values below 8 exactly, then 8 buckets
/// per power of two (12.5 % wide).
pub const TIMING_BUCKETS: u32 = 496;
pub const TIMING_SAMPLES: u32 = TIMING_BUCKETS;
pub const TIMING_USER_FRAMES: u32 = TIMING_BUCKETS + 1;
pub const TIMING_RING_BYTES: u32 = TIMING_BUCKETS + 2;
pub const TIMING_ENTRIES: u32 = TIMING_BUCKETS + 3;

/// Histogram bucket of `ns` (see [`TIMING_BUCKETS`]).
#[inline(always)]
pub const fn timing_bucket(ns: u64) -> u32 {
    if ns < 8 {
        return ns as u32;
    }
    // Index of the highest set bit, without a count-leading-zeros instruction (BPF has none).
    let (mut m, mut v) = (0u32, ns);
    if v >> 32 != 0 {
        v >>= 32;
        m += 32;
    }
    if v >> 16 != 0 {
        v >>= 16;
        m += 16;
    }
    if v >> 8 != 0 {
        v >>= 8;
        m += 8;
    }
    if v >> 4 != 0 {
        v >>= 4;
        m += 4;
    }
    if v >> 2 != 0 {
        v >>= 2;
        m += 2;
    }
    if v >> 1 != 0 {
        m += 1;
    }
    let sub = ((ns >> (m - 3)) & 7) as u32;
    8 * (m - 2) + sub
}

/// Smallest value of histogram bucket `i`.
pub const fn timing_bucket_low(i: u32) -> u64 {
    if i < 8 {
        return i as u64;
    }
    let (m, sub) = (i / 8 + 2, (i % 8) as u64);
    (8 + sub) << (m - 3)
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
    /// USDT hit written to the ring buffer.
    pub const USDT_SENT: u32 = 9;
    /// USDT hit lost: ring buffer full.
    pub const USDT_LOST_RINGBUF_FULL: u32 = 10;
    /// USDT hit lost: no scratch buffer, or its spec id is not in `USDT_SPECS`.
    pub const USDT_LOST_OTHER: u32 = 11;
    /// A USDT argument read from user memory (deref) failed; the value is sent as 0 and
    /// flagged in [`super::UsdtRecord::arg_errors`].
    pub const USDT_ARG_ERRORS: u32 = 12;
    /// String arguments that were NULL, unreadable or cut at `USDT_STR_MAX`.
    pub const USDT_STR_NULL: u32 = 13;
    pub const USDT_STR_UNREADABLE: u32 = 14;
    pub const USDT_STR_TRUNCATED: u32 = 15;
    /// `rsprof:label_push` / `rsprof:label_pop` hits.
    pub const LABEL_PUSHES: u32 = 16;
    pub const LABEL_POPS: u32 = 17;
    /// Push beyond `LABEL_MAX_DEPTH`: counted in the depth but not stored.
    pub const LABEL_OVERFLOWS: u32 = 18;
    /// Pop with an empty stack (e.g. the push happened before recording started): ignored.
    pub const LABEL_UNDERFLOWS: u32 = 19;
    /// Thread label-stack map full: the push was not recorded.
    pub const LABEL_MAP_FULL: u32 = 20;
    /// Samples that carried at least one label.
    pub const SAMPLES_WITH_LABELS: u32 = 21;
    /// Sample sent with its task's CPU time as of the last scheduler tick (no context switch
    /// seen on its CPU since attaching), not current at the sample.
    pub const CPU_TIME_STALE: u32 = 22;
    // Off-CPU: every switch-out the off-CPU tracker takes (a selected task blocking, or with
    // `OFF_CPU_WALL` any switch-out) ends, once the task runs again, in exactly one of
    // `OFF_CPU_SENT`, `OFF_CPU_SUMMED`, `OFF_CPU_LOST_RINGBUF_FULL`, `OFF_CPU_LOST_MAP_FULL`
    // and `OFF_CPU_NOT_CAPTURED`; a task that never runs again before the end ends in none.
    /// A block at least `off_cpu_min_ns` long, sent as its own record.
    pub const OFF_CPU_SENT: u32 = 23;
    /// A shorter block, added to its thread's pending sum (sent by a later record).
    pub const OFF_CPU_SUMMED: u32 = 24;
    /// A long block lost: ring buffer full.
    pub const OFF_CPU_LOST_RINGBUF_FULL: u32 = 25;
    /// Switch-out not tracked: the off-CPU thread map is full.
    pub const OFF_CPU_LOST_MAP_FULL: u32 = 26;
    /// Records carrying a thread's summed short blocks (sent when the sum reaches
    /// `off_cpu_min_ns`, or when the thread exits).
    pub const OFF_CPU_SUMS_SENT: u32 = 27;
    /// A sum's record did not fit in the ring buffer; the sum stays pending (not lost).
    pub const OFF_CPU_SUMS_DEFERRED: u32 = 28;
    /// Off-CPU stacks (kernel or user) that could not be read.
    pub const OFF_CPU_STACK_ERRORS: u32 = 29;
    /// Executable mappings and removals written to the ring buffer.
    pub const MAP_EVENTS_SENT: u32 = 30;
    /// Mapping records lost: ring buffer full, or too many mmap calls in flight (frames in
    /// those mappings show as unmapped).
    pub const MAP_EVENTS_LOST: u32 = 31;
    /// Mapped files whose path could not be walked to the root (cut, too deep, unreadable).
    pub const MAP_PATH_INCOMPLETE: u32 = 32;
    /// A long block whose stacks were not walked (see `OffCpuTrack`), sent with no stack.
    pub const OFF_CPU_NOT_CAPTURED: u32 = 33;
    /// Off-CPU switch-outs whose stacks were walked (not a block count: a cost).
    pub const OFF_CPU_WALKS: u32 = 34;
    // DWARF unwinding (`Config::unwind_mode` not `UNWIND_MODE_FP`): every CPU sample of a
    // task with a user address space (sent or not) lands in exactly one of the next nine, by
    // how its user stack walk ended (`UNWIND_END_*`, in order from `UNWIND_END_COMPLETE`).
    // Off-CPU and USDT walks are not counted here.
    pub const UNWIND_COMPLETE: u32 = 35;
    pub const UNWIND_DEPTH: u32 = 36;
    pub const UNWIND_NO_PROCESS: u32 = 37;
    pub const UNWIND_NO_MAPPING: u32 = 38;
    pub const UNWIND_NO_TABLE: u32 = 39;
    pub const UNWIND_NO_CFI: u32 = 40;
    pub const UNWIND_UNSUPPORTED: u32 = 41;
    pub const UNWIND_READ_FAULT: u32 = 42;
    pub const UNWIND_FRAME_POINTER: u32 = 43;
    /// Walks that followed frame pointers for some frames (code without a table).
    pub const UNWIND_USED_FP: u32 = 44;
    /// Samples sent (written to the ring) with a copy of their user stack (`SAMPLE_STACK_COPY`),
    /// for userspace to continue a walk that stopped for want of a table; and the stack bytes
    /// they carried.
    pub const STACK_COPIES: u32 = 45;
    pub const STACK_COPY_BYTES: u32 = 46;
    /// Such a walk whose stack could not be copied (unreadable): sent without a copy.
    pub const STACK_COPY_FAILED: u32 = 47;
    /// Such a walk on a CPU that used up its copy budget (`Config::stack_copy_budget`): sent
    /// without a copy.
    pub const STACK_COPY_OVER_BUDGET: u32 = 48;
    /// mprotect(2)/mremap(2) of code whose mappings could not be looked up (`bpf_find_vma`
    /// failed, e.g. the address space's lock was busy) or sent (more than one file's code, or
    /// more than 8 mappings, in one range): frames there may show as unmapped.
    pub const MAP_VMA_UNREAD: u32 = 49;
    /// `rsprof:label_push` hits whose stack the kernel could not walk for want of a table,
    /// sent with a copy of it for userspace to walk (`EVENT_LABEL_DEPTH`).
    pub const LABEL_DEPTH_RECORDS: u32 = 50;
    /// Such pushes that could not be sent (copy budget used up, stack unreadable, ring
    /// full): their depth is
    /// [`LABEL_DEPTH_UNKNOWN`](crate::LABEL_DEPTH_UNKNOWN) and the label shows above the leaf.
    pub const LABEL_DEPTH_LOST: u32 = 51;
    /// A new process (fork without exec) given its parent's walker entry (`UNWIND_PROCS`,
    /// by reference: `FORKED_FROM`) in the fork tracepoint, so its first samples unwind like its
    /// parent's; and those that could not be (the map full), which wait for userspace instead.
    pub const FORK_WALKER_COPIES: u32 = 52;
    pub const FORK_WALKER_COPY_FAILED: u32 = 53;
    /// Off-CPU switch-outs whose user stack walk stopped for want of a table, sent with a copy
    /// of the stack (`EVENT_OFF_CPU_COPY`); and those whose copy could not be sent (budget
    /// used up, stack unreadable, ring buffer full), whose stack stays cut and flagged.
    pub const OFF_CPU_COPIES: u32 = 54;
    pub const OFF_CPU_COPY_LOST: u32 = 55;
    /// Walker entries the kernel deleted at their process's exit (the leader's), and those it
    /// emptied at an exec (the old image's mappings; userspace writes the new ones): no stale
    /// entry for a reused pid, or between an exec and that write.
    pub const WALKER_EXIT_DELETES: u32 = 56;
    pub const WALKER_EXEC_CLEARS: u32 = 57;
    /// Code mappings the kernel gave the walker itself (`UnwindEarly`), before userspace read
    /// them; ones it removed (munmap/mprotect); ones skipped because another thread of the
    /// process was adding one; and mappings of a loaded file whose size or mtime no longer
    /// match its table's (rewritten in place).
    pub const EARLY_ADDED: u32 = 58;
    pub const EARLY_REMOVED: u32 = 59;
    pub const EARLY_BUSY: u32 = 60;
    pub const EARLY_FILE_CHANGED: u32 = 61;
    pub const COUNT: u32 = 62;

    /// The counter of a walk's `UNWIND_END_*` value (`UNWIND_END_NONE` has none).
    pub const fn unwind_end(end: u32) -> Option<u32> {
        if end == 0 || end >= super::UNWIND_END_COUNT {
            None
        } else {
            Some(UNWIND_COMPLETE + end - 1)
        }
    }
}

/// Size of the `USDT_SPECS` array: probe sites attached at once.
pub const USDT_MAX_SPECS: u32 = 4096;
/// Most arguments a USDT spec evaluates (sdt.h's limit; HotSpot has 8-argument probes).
pub const USDT_MAX_ARGS: usize = 12;
/// String arguments copied per hit.
pub const USDT_MAX_STRS: usize = 2;
/// Bytes of each string argument copied, including the NUL.
pub const USDT_STR_MAX: usize = 128;
/// Deepest `rsprof:label_push` stack kept per thread; deeper pushes are counted, not stored.
pub const LABEL_MAX_DEPTH: usize = 32;

/// Where an argument lives ([`UsdtArgSpec::kind`]).
pub const USDT_ARG_NONE: u8 = 0;
/// `val_off` itself.
pub const USDT_ARG_CONST: u8 = 1;
/// `reg + val_off` (`val_off` is 0 except for `$sym` immediates, which are rip-relative).
pub const USDT_ARG_REG: u8 = 2;
/// `*(reg + val_off)`.
pub const USDT_ARG_DEREF: u8 = 3;
/// `*(reg + (idx << scale_shift) + val_off)`.
pub const USDT_ARG_SIB: u8 = 4;

/// One argument of a probe site, evaluated from the uprobe's `pt_regs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsdtArgSpec {
    pub val_off: i64,
    pub kind: u8,
    /// Byte offsets into `struct pt_regs`.
    pub reg_off: u8,
    pub idx_reg_off: u8,
    pub scale_shift: u8,
    /// `64 - 8 * size`: the value is shifted left and back to truncate or sign-extend.
    pub bitshift: u8,
    pub signed: u8,
    /// Index into [`UsdtRecord::strs`] + 1 when the argument is a C string to copy; 0 if not.
    pub str_slot: u8,
    pub _pad: u8,
}

/// What the BPF program does with a hit besides sending it ([`UsdtSpec::role`]).
pub const USDT_ROLE_SEND: u8 = 0;
/// `rsprof:label_push(label)`: push arg 0 on the thread's label stack; send the hit (with the
/// label text) only the first time this address space shows this label address.
pub const USDT_ROLE_LABEL_PUSH: u8 = 1;
/// `rsprof:label_pop()`: pop; nothing is sent.
pub const USDT_ROLE_LABEL_POP: u8 = 2;

/// A probe site's argument layout, stored in `USDT_SPECS` at the index passed as the BPF
/// cookie of its uprobe.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsdtSpec {
    /// Userspace's probe id, echoed in every [`UsdtRecord`].
    pub probe_id: u32,
    pub arg_count: u8,
    pub role: u8,
    pub _pad: [u8; 2],
    pub args: [UsdtArgSpec; USDT_MAX_ARGS],
}

/// String slot flags ([`UsdtString::flags`]).
pub const USDT_STR_IS_NULL: u16 = 1 << 0;
/// The pointer could not be read (unmapped or not resident); the pointer value is in `args`.
pub const USDT_STR_IS_UNREADABLE: u16 = 1 << 1;
/// The string did not end within `USDT_STR_MAX - 1` bytes and was cut.
pub const USDT_STR_IS_TRUNCATED: u16 = 1 << 2;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UsdtString {
    /// Bytes in `bytes` before the NUL.
    pub len: u16,
    pub flags: u16,
    pub _pad: u32,
    pub bytes: [u8; USDT_STR_MAX],
}

/// A USDT hit: the probe, its evaluated arguments (raw 64-bit values, already truncated or
/// sign-extended to the argument size) and copies of its string arguments. Sent with only
/// `str_count` string slots.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UsdtRecord {
    pub header: EventHeader,
    pub probe_id: u32,
    /// The BPF cookie: index of the probe site's spec.
    pub spec_id: u32,
    pub arg_count: u16,
    /// String slots that follow `args` in the sent bytes.
    pub str_count: u16,
    /// Bit i set: argument i could not be read from user memory (its value is 0).
    pub arg_errors: u32,
    pub args: [u64; USDT_MAX_ARGS],
    pub strs: [UsdtString; USDT_MAX_STRS],
}

pub const USDT_RECORD_FIXED: usize =
    core::mem::size_of::<UsdtRecord>() - USDT_MAX_STRS * core::mem::size_of::<UsdtString>();

/// A thread's `rsprof:label_push` stack (map `LABELS`, keyed by tid). Entries are
/// [`label_entry`]s: the user address of the label string (which userspace names from the
/// first `rsprof:label_push` hit sent for that address in that process) and the pusher's user
/// stack depth, which places the label under the pushing frame in sampled stacks.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LabelStack {
    /// Logical depth; may exceed `LABEL_MAX_DEPTH` (those levels are not stored).
    pub depth: u32,
    pub _pad: u32,
    pub ids: [u64; LABEL_MAX_DEPTH],
}

/// Sent by `rsprof:label_push` when the table walk of the pusher's stack stopped for want of a
/// table (a process that just started, a library just mapped): the label entry is stored
/// with depth 0 and userspace finds the depth by continuing the walk over the copy that
/// follows this header (a [`StackCopyHeader`] and its bytes), then places the label in the
/// samples that carry that entry. A push whose copy cannot be made sends nothing and stores
/// [`LABEL_DEPTH_UNKNOWN`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LabelDepthHeader {
    pub header: EventHeader,
    /// The label's address, as in its entry.
    pub label: u64,
    /// The entry's index in the thread's label stack.
    pub index: u32,
    /// User frames the kernel walked; the last is where it stopped (the copy's `pc`).
    pub frames: u32,
}

pub const LABEL_DEPTH_RECORD_FIXED: usize = core::mem::size_of::<LabelDepthHeader>();

/// `rsprof:label_push`'s per-CPU scratch for a [`LabelDepthHeader`] record and its copy.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct LabelDepthScratch {
    pub rec: LabelDepthHeader,
    pub copy: [u8; STACK_COPY_HEADER_SIZE + STACK_COPY_MAX],
}

/// Bits of a label entry above the address: user addresses on x86-64 fit in 47 bits.
pub const LABEL_DEPTH_SHIFT: u32 = 48;

/// The depth of a label entry whose pusher's depth is not known and will not be (its record
/// could not be sent): past any stack, so the label goes above the leaf. Depth 0 is "found
/// from the push's `EVENT_LABEL_DEPTH` record".
pub const LABEL_DEPTH_UNKNOWN: u64 = 0xffff;

/// A label entry: `addr` plus the number of user frames at the push, capped (0 and
/// [`LABEL_DEPTH_UNKNOWN`]: see there).
pub const fn label_entry(addr: u64, depth: u64) -> u64 {
    let depth = if depth > 0xffff { 0xffff } else { depth };
    (addr & ((1 << LABEL_DEPTH_SHIFT) - 1)) | (depth << LABEL_DEPTH_SHIFT)
}

/// Splits a label entry into (address, pusher's user stack depth).
pub const fn split_label_entry(entry: u64) -> (u64, u32) {
    (entry & ((1 << LABEL_DEPTH_SHIFT) - 1), (entry >> LABEL_DEPTH_SHIFT) as u32)
}

/// Key of the "label already named" map: one address space (its `mm_struct` pointer, so an
/// exec starts afresh) and one label address.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LabelSeenKey {
    pub mm: u64,
    pub label: u64,
    /// The process too: a freed `mm_struct` is soon reused by another process.
    pub tgid: u32,
    pub _pad: u32,
}

/// Naming kernel addresses in the kernel (profiler-ebpf ksym.rs): userspace writes up to
/// `BATCH` addresses into the one `KsymBatch` of `KSYM_BATCH`, runs `name_kernel_addrs` with
/// BPF_PROG_TEST_RUN, and reads back each address formatted with `%pS`
/// (`function+0xoff/0xsize [module]`, or the bare hex address when nothing is there).
pub mod ksym {
    pub const BATCH: usize = 32;
    /// Room for a name with its offset, size and module (kallsyms names are at most 512
    /// bytes but rarely past 100); a longer one comes back cut, without its NUL.
    pub const NAME_BYTES: usize = 192;

    #[repr(C)]
    #[derive(Clone, Copy)]
    pub struct KsymBatch {
        /// 0 ends the batch.
        pub addrs: [u64; BATCH],
        /// NUL-terminated `%pS` text of each address.
        pub names: [[u8; NAME_BYTES]; BATCH],
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: plain `#[repr(C)]` data: u64s and bytes, no padding.
    unsafe impl aya::Pod for super::ksym::KsymBatch {}
    // SAFETY: plain `#[repr(C)]` data with no padding-dependent invariants.
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::UsdtSpec {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::CgroupFilter {}
    // SAFETY: `#[repr(C)]` u64s and u32s laid out without padding (read back at the stop).
    unsafe impl aya::Pod for super::OffCpuRecord {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_buckets_are_contiguous_and_cover_u64() {
        for ns in 0..100_000u64 {
            let b = timing_bucket(ns);
            assert!(timing_bucket_low(b) <= ns && ns < timing_bucket_low(b + 1), "{ns} in {b}");
        }
        assert_eq!(timing_bucket(u64::MAX), TIMING_BUCKETS - 1);
        for i in 1..TIMING_BUCKETS {
            assert!(timing_bucket_low(i) > timing_bucket_low(i - 1));
            assert_eq!(timing_bucket(timing_bucket_low(i)), i);
        }
    }
}
