//! rsprof-bpf kernel side: a CPU-clock sampler plus fork/exec/exit tracepoints, all writing
//! variable-length records into one ring buffer so userspace sees them in one ordered stream,
//! and a sched_switch hook (sched.rs) that keeps the samples' CPU time current.
#![no_std]
#![no_main]

mod cgroup;
mod ksym;
mod maptrack;
mod python;
mod sched;
mod stack;
mod usdt;

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, BPF_RB_RING_SIZE},
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_kernel,
        bpf_probe_read_user_buf,
        generated::{bpf_get_current_cgroup_id, bpf_get_current_task, bpf_get_smp_processor_id},
    },
    macros::{map, perf_event, raw_tracepoint},
    maps::{Array, LruHashMap, PerCpuArray, RingBuf},
    programs::{PerfEventContext, RawTracePointContext},
};
use profiler_common::{
    CMDLINE_MAX, Config, EVENT_EXEC, EVENT_EXIT, EVENT_FORK, EVENT_SAMPLE, EventHeader, FILTER_ALL,
    SAMPLE_CPU_TIME_ERROR, SAMPLE_KERNEL_STACK_ERROR, SAMPLE_RECORD_FIXED, SAMPLE_STACK_COPY,
    SAMPLE_USER_STACK_ERROR, STACK_COPY_HEADER_SIZE, SampleScratch, StackCopyHeader,
    TASK_RECORD_FIXED, TASK_WALKER_COPIED, TIMING_ENTRIES, TIMING_RING_BYTES, TIMING_SAMPLES,
    TIMING_USER_FRAMES, TaskRecord, UNWIND_MODE_FP, WAKE_GAP_NS, counter, timing_bucket,
};

#[unsafe(no_mangle)]
pub(crate) static CONFIG: Config = Config::ZERO;

/// Size is set by the loader (`--ring-buffer-size`).
#[map]
pub(crate) static EVENTS: RingBuf = RingBuf::with_byte_size(16 << 20, 0);

/// When a record last forced a wakeup (`bpf_ktime_get_ns`), shared by every CPU: records
/// that ask for one wake userspace at most every `WAKE_GAP_NS` (races between CPUs only add
/// a wakeup).
#[map]
static LAST_WAKE: Array<u64> = Array::with_max_entries(1, 0);

#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);

/// Scratch space for building a sample: too big for the 512-byte BPF stack.
#[map]
static SAMPLE_SCRATCH: PerCpuArray<SampleScratch> = PerCpuArray::with_max_entries(1, 0);
#[map]
static TASK_SCRATCH: PerCpuArray<TaskRecord> = PerCpuArray::with_max_entries(1, 0);

/// Per CPU: start of the current 100 ms window and the stack-copy bytes sent in it.
#[map]
static COPY_BUDGET: PerCpuArray<[u64; 2]> = PerCpuArray::with_max_entries(3, 0);

/// `COPY_BUDGET` slots: the sampler's, label pushes' and off-CPU switch-outs' (each of the
/// last two a quarter of the sampler's bytes), so that none starves another while a process
/// starts.
pub(crate) const BUDGET_SAMPLER: u32 = 0;
pub(crate) const BUDGET_LABELS: u32 = 1;
pub(crate) const BUDGET_OFF_CPU: u32 = 2;

/// `--bpf-timing`: the sampler's run time per sample (see `profiler_common::TIMING_BUCKETS`).
#[map]
static SAMPLER_TIMING: PerCpuArray<u64> = PerCpuArray::with_max_entries(TIMING_ENTRIES, 0);

/// Thread-group ids selected by `-p` / `-- CMD` (value unused). LRU so that a long `-- CMD`
/// session forking many children cannot fill it; evictions only hit long-dead processes.
#[map]
static TARGETS: LruHashMap<u32, u8> = LruHashMap::with_max_entries(65536, 0);

/// A `bpf_loop` step: called with the iteration index and the context; 0 goes on, 1 stops.
pub(crate) type LoopStep = extern "C" fn(u64, *mut core::ffi::c_void) -> i64;

/// Runs `step` up to `n` times over `ctx` with `bpf_loop` (Linux 5.17): the verifier checks
/// the step once, where a loop in the program was checked once per unrolled iteration.
/// Returns the iterations run, or a negative errno.
#[inline(always)]
pub(crate) fn run_loop<T>(n: u32, step: LoopStep, ctx: &mut T) -> i64 {
    // SAFETY: `step` is a BPF subprogram with the callback signature, and `ctx`, borrowed for
    // the call, outlives it.
    unsafe {
        aya_ebpf::helpers::generated::bpf_loop(
            n,
            step as *mut core::ffi::c_void,
            (ctx as *mut T).cast(),
            0,
        )
    }
}

#[inline(always)]
pub(crate) fn config() -> Config {
    // SAFETY: CONFIG is a read-only global patched by the loader; volatile keeps the compiler
    // from folding in the defaults above.
    unsafe { core::ptr::read_volatile(&CONFIG) }
}

/// One field of `CONFIG`: `config()` copies all of it (volatile: every field loaded and
/// stored), which in a callback the verifier walks many times was thousands of instructions.
macro_rules! config_field {
    ($field:ident) => {
        // SAFETY: as in `config()`.
        unsafe { core::ptr::read_volatile(core::ptr::addr_of!($crate::CONFIG.$field)) }
    };
}
pub(crate) use config_field;

#[inline(always)]
pub(crate) fn count(index: u32) {
    if let Some(c) = COUNTERS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, and BPF programs on one CPU do not preempt each other here.
        unsafe { *c += 1 };
    }
}

#[inline(always)]
pub(crate) fn selected(cfg: &Config, tgid: u32) -> bool {
    cfg.filter_mode == FILTER_ALL || unsafe { TARGETS.get(&tgid) }.is_some()
}

#[inline(always)]
pub(crate) unsafe fn read_kernel_u64(addr: u64) -> Option<u64> {
    unsafe { bpf_probe_read_kernel(addr as *const u64) }.ok()
}

#[inline(always)]
pub(crate) unsafe fn read_kernel_u32(addr: u64) -> Option<u32> {
    unsafe { bpf_probe_read_kernel(addr as *const u32) }.ok()
}

#[perf_event]
pub fn on_cpu_clock(ctx: PerfEventContext) -> u32 {
    let cfg = config();
    // Off (the default) this costs one branch on a read-only global.
    // SAFETY: a helper without arguments.
    let start = if cfg.bpf_timing != 0 { unsafe { bpf_ktime_get_ns() } } else { 0 };
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if !selected(&cfg, tgid) || (cfg.filter_mode != FILTER_ALL && tgid == 0) || !cgroup::selected()
    {
        count(counter::SAMPLES_FILTERED);
        return 0;
    }
    let Some(scratch) = SAMPLE_SCRATCH.get_ptr_mut(0) else {
        count(counter::LOST_NO_SCRATCH);
        return 0;
    };
    // SAFETY: this CPU's scratch value.
    let rec = unsafe { core::ptr::addr_of_mut!((*scratch).rec) };
    // SAFETY: `rec` points at this CPU's scratch record, valid for the whole program run.
    unsafe {
        let s = &mut (*rec).sample;
        s.header = EventHeader {
            kind: EVENT_SAMPLE,
            cpu: bpf_get_smp_processor_id(),
            time_ns: bpf_ktime_get_ns(),
            pid: tgid,
            tid: pid_tgid as u32,
        };
        s.cgroup_id = bpf_get_current_cgroup_id();
        s.flags = 0;
        let task = bpf_get_current_task();
        match read_kernel_u64(task + cfg.task_sum_exec_runtime as u64) {
            Some(raw) => {
                let (t, current) = sched::current_cpu_time(s.header.time_ns, raw);
                s.cpu_time_ns = t;
                if !current {
                    count(counter::CPU_TIME_STALE);
                }
            }
            None => {
                s.cpu_time_ns = 0;
                s.flags |= SAMPLE_CPU_TIME_ERROR;
                count(counter::CPU_TIME_ERRORS);
            }
        }
        s.comm = bpf_get_current_comm().unwrap_or([0; 16]);

        let frames = (*rec).frames.as_mut_ptr();
        let regs = stack::perf_user_regs(ctx.as_ptr());
        if regs.is_some() {
            s.flags |= profiler_common::SAMPLE_USER_MODE;
        }
        let w = stack::walk(&ctx, frames, 0, regs, stack::SLOT_SAMPLER);
        s.flags |= w.errors;
        if w.errors & SAMPLE_KERNEL_STACK_ERROR != 0 {
            count(counter::KERNEL_STACK_ERRORS);
        }
        if w.errors & SAMPLE_USER_STACK_ERROR != 0 {
            count(counter::USER_STACK_ERRORS);
        }
        let (kframes, uframes) = (w.kernel_frames as u64, w.user_frames as u64);
        s.kernel_frames = w.kernel_frames;
        s.user_frames = w.user_frames;
        let labels = usdt::copy_labels(pid_tgid as u32, frames, kframes + uframes);
        s.label_count = labels as u32;
        if labels > 0 {
            count(counter::SAMPLES_WITH_LABELS);
        }
        // Bound for the verifier: the Python frames go after the labels.
        const MAX_BEFORE_PY: u64 =
            (2 * profiler_common::MAX_STACK_DEPTH + profiler_common::LABEL_MAX_DEPTH) as u64;
        let before_py = kframes + uframes + labels;
        let before_py = if before_py > MAX_BEFORE_PY { MAX_BEFORE_PY } else { before_py };
        let (py, py_flags) = python::walk(
            tgid,
            task,
            cfg.task_fsbase,
            frames.add(before_py as usize),
            python::SLOT_SAMPLER,
        );
        s.py_frames = py;
        s.flags |= py_flags;

        let used = before_py + 2 * py as u64;
        let mut len = SAMPLE_RECORD_FIXED as u64 + used * 8;
        let end = w.user_end();
        let mut copy_len = 0;
        if stack::wants_copy(end) {
            copy_len = attach_stack_copy(frames, used, &mut s.flags, s.header.time_ns, &cfg);
            len += copy_len;
        }
        // A process's first Python sample: its code objects are best read while it lives.
        let sent = output(scratch, len, py_flags & profiler_common::SAMPLE_PY_FIRST != 0);
        if sent {
            count(counter::SAMPLES_SENT);
            // Counted once sent: a sample lost to a full ring counts as lost, copy or not.
            if copy_len > 0 {
                count(counter::STACK_COPIES);
                count_add(counter::STACK_COPY_BYTES, copy_len - STACK_COPY_HEADER_SIZE as u64);
            }
        } else {
            count(counter::LOST_RINGBUF_FULL);
        }
        if cfg.bpf_timing != 0 {
            add_timing(timing_bucket(bpf_ktime_get_ns().wrapping_sub(start)), 1);
            add_timing(TIMING_SAMPLES, 1);
            add_timing(TIMING_USER_FRAMES, uframes);
            let clamped = if len > size_of::<SampleScratch>() as u64 {
                size_of::<SampleScratch>() as u64
            } else {
                len
            };
            add_timing(TIMING_RING_BYTES, if sent { ((clamped + 7) & !7) + 8 } else { 0 });
        }
    }
    0
}

/// Appends the stopped walk's registers and a copy of the user stack from its rsp after the
/// sample's `used` frames and labels; returns the bytes added (0 when nothing was readable).
///
/// # Safety
/// `frames` must be the `frames` array of this CPU's `SampleScratch` value.
#[inline(always)]
unsafe fn attach_stack_copy(
    frames: *mut u64,
    used: u64,
    flags: &mut u32,
    now: u64,
    cfg: &Config,
) -> u64 {
    const MAX_USED: u64 = (2 * profiler_common::MAX_STACK_DEPTH
        + profiler_common::LABEL_MAX_DEPTH
        + 2 * profiler_common::PY_MAX_FRAMES) as u64;
    // Bound for the verifier: the header and the copy fit after any number of used frames.
    let used = if used > MAX_USED { MAX_USED } else { used };
    // SAFETY: `frames + used` is within the scratch value, with room for the header (4
    // slots) and `STACK_COPY_MAX` bytes after it.
    let at = unsafe { frames.add(used as usize) };
    // SAFETY: as above.
    match unsafe { write_stack_copy(at, stack::SLOT_SAMPLER, BUDGET_SAMPLER, now, cfg) } {
        Ok(n) => {
            *flags |= SAMPLE_STACK_COPY;
            n
        }
        Err(c) => {
            count(c);
            0
        }
    }
}

/// Writes where the last table walk of `slot` stopped (a [`StackCopyHeader`]) and a copy of
/// the user stack from its rsp at `at`, within this CPU's copy budget `budget`; returns the
/// bytes written, or the counter saying why nothing was (`STACK_COPY_OVER_BUDGET`,
/// `STACK_COPY_FAILED`).
///
/// # Safety
/// `at` must point to `STACK_COPY_HEADER_SIZE + STACK_COPY_MAX` writable bytes of a map value.
#[inline(always)]
pub(crate) unsafe fn write_stack_copy(
    at: *mut u64,
    slot: u32,
    budget: u32,
    now: u64,
    cfg: &Config,
) -> Result<u64, u32> {
    let limit = if budget == BUDGET_SAMPLER {
        u64::from(cfg.stack_copy_budget)
    } else {
        u64::from(cfg.stack_copy_budget / 4)
    };
    let Some(budget) = COPY_BUDGET.get_ptr_mut(budget) else {
        return Err(counter::STACK_COPY_FAILED);
    };
    // SAFETY: this CPU's budget slot; its users do not nest on one CPU.
    let budget = unsafe { &mut *budget };
    if now.wrapping_sub(budget[0]) >= 100_000_000 {
        budget[0] = now;
        budget[1] = 0;
    }
    if budget[1] >= limit {
        return Err(counter::STACK_COPY_OVER_BUDGET);
    }
    let Some(mut hdr) = stack::stopped_at(slot) else { return Err(counter::STACK_COPY_FAILED) };
    // SAFETY: `at` has room for the header (4 slots) and `STACK_COPY_MAX` bytes after it.
    let copied = unsafe {
        let n = stack::copy_stack(at.add(STACK_COPY_HEADER_SIZE / 8).cast(), hdr.sp);
        if n == 0 {
            return Err(counter::STACK_COPY_FAILED);
        }
        hdr.len = n;
        core::ptr::write_unaligned(at.cast::<StackCopyHeader>(), hdr);
        n
    };
    budget[1] += (STACK_COPY_HEADER_SIZE as u64) + u64::from(copied);
    Ok((STACK_COPY_HEADER_SIZE as u64) + u64::from(copied))
}

#[inline(always)]
pub(crate) fn count_add(index: u32, n: u64) {
    if let Some(c) = COUNTERS.get_ptr_mut(index) {
        // SAFETY: as in `count`.
        unsafe { *c += n };
    }
}

#[inline(always)]
fn add_timing(index: u32, n: u64) {
    if let Some(c) = SAMPLER_TIMING.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, as in `count`.
        unsafe { *c += n };
    }
}

/// Copies the first `len` bytes of `*rec` (at most its size, as the verifier needs) to the
/// ring buffer; false when it is full. Nothing wakes userspace by default: it drains on a
/// timer whose period the ring holds at least twice over at the worst-case sample rate (see
/// `session::drain_interval`), so an idle host costs a few wakeups a second. `wake` records
/// (those the DWARF unwinder's table loader waits for) wake it at once, and so does any record
/// written while a quarter of the ring is pending: a burst of USDT hits, off-CPU records or
/// task events is drained long before the ring fills.
#[inline(always)]
pub(crate) unsafe fn output<T>(rec: *const T, len: u64, wake: bool) -> bool {
    let size = core::mem::size_of::<T>() as u64;
    let len = if len > size { size } else { len };
    let flags = if EVENTS.query(BPF_RB_AVAIL_DATA as u64) >= wake_threshold() || wake && wake_due()
    {
        BPF_RB_FORCE_WAKEUP as u64
    } else {
        BPF_RB_NO_WAKEUP as u64
    };
    // SAFETY: `rec` points to at least `size` readable bytes (a scratch map value).
    let ret = unsafe {
        aya_ebpf::helpers::generated::bpf_ringbuf_output(
            core::ptr::addr_of!(EVENTS).cast_mut().cast(),
            rec.cast_mut().cast(),
            len,
            flags,
        )
    };
    ret >= 0
}

/// Pending bytes past which every record wakes userspace: a quarter of the ring.
#[inline(always)]
fn wake_threshold() -> u64 {
    EVENTS.query(BPF_RB_RING_SIZE as u64) / 4
}

/// Whether a record that asks for a wakeup gets one: the first after `WAKE_GAP_NS`. Every
/// forced wakeup leads to a drain that sees its record, and a drain that sees such records
/// drains again `WAKE_GAP_NS` later (session::Recorder), which picks up the ones held back
/// here; an exec storm wakes the loop 100 times a second instead of once per record.
#[inline(always)]
fn wake_due() -> bool {
    let Some(last) = LAST_WAKE.get_ptr_mut(0) else { return true };
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: a map value; a torn read across CPUs only changes whether this one wakes.
    unsafe {
        if now.wrapping_sub(*last) < WAKE_GAP_NS {
            return false;
        }
        *last = now;
    }
    true
}

/// Records the DWARF unwinder's table loader needs soon (a new image, an executable mapping)
/// wake userspace, unless the loader said not to (`Config::wake_for_tables`); with frame
/// pointers nothing waits for them.
#[inline(always)]
pub(crate) fn wake_for_unwinder(cfg: &Config) -> bool {
    cfg.unwind_mode != UNWIND_MODE_FP && cfg.wake_for_tables != 0
}

/// Sends the first `len` bytes of this CPU's task scratch record.
#[inline(always)]
unsafe fn send_task(rec: *mut TaskRecord, len: u64, wake: bool) {
    if !unsafe { output(rec, len, wake) } {
        count(counter::LOST_TASK_EVENTS);
    }
}

/// The current task's (tgid, tid) and this CPU's task scratch record, when the filter
/// selects the task.
#[inline(always)]
fn current_task_record(cfg: &Config) -> Option<(u32, u32, *mut TaskRecord)> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if !selected(cfg, tgid) || !cgroup::selected() {
        return None;
    }
    Some((tgid, pid_tgid as u32, TASK_SCRATCH.get_ptr_mut(0)?))
}

#[inline(always)]
unsafe fn task_header(kind: u32, rec: *mut TaskRecord, pid: u32, tid: u32) {
    unsafe {
        (*rec).parent_pid = 0;
        (*rec).parent_tid = 0;
        (*rec).mm = 0;
        (*rec).vdso = 0;
        (*rec).header = EventHeader {
            kind,
            cpu: bpf_get_smp_processor_id(),
            time_ns: bpf_ktime_get_ns(),
            pid,
            tid,
        };
        (*rec).comm = bpf_get_current_comm().unwrap_or([0; 16]);
        (*rec).cmdline_len = 0;
        (*rec).cmdline_truncated = 0;
        (*rec).flags = 0;
        (*rec)._pad = 0;
    }
}

/// `sched_process_fork(struct task_struct *parent, struct task_struct *child)`; runs in the
/// parent. Fires for new threads too; the child's tgid tells them apart.
#[raw_tracepoint(tracepoint = "sched_process_fork")]
pub fn on_fork(ctx: RawTracePointContext) -> i32 {
    let cfg = config();
    let pid_tgid = bpf_get_current_pid_tgid();
    let parent_tgid = (pid_tgid >> 32) as u32;
    if !selected(&cfg, parent_tgid) {
        return 0;
    }
    let child: u64 = ctx.arg(1);
    // SAFETY: `child` is the tracepoint's task pointer; reads are fault-checked.
    let (Some(child_pid), Some(child_tgid)) = (unsafe {
        (
            read_kernel_u32(child + cfg.task_pid as u64),
            read_kernel_u32(child + cfg.task_tgid as u64),
        )
    }) else {
        return 0;
    };
    if cfg.filter_mode != FILTER_ALL && child_tgid != parent_tgid {
        if cfg.follow_children == 0 {
            return 0;
        }
        if TARGETS.insert(&child_tgid, &1, 0).is_err() {
            count(counter::TARGETS_FULL);
        }
    }
    // After following children: a `-- CMD` child may move into the selected cgroup later.
    if !cgroup::selected() {
        return 0;
    }
    if child_tgid != parent_tgid {
        python::inherit(parent_tgid, child_tgid);
    }
    // A new process, not a thread: its walker entry is its parent's from this moment on.
    let copied = child_tgid != parent_tgid
        && cfg.unwind_mode != UNWIND_MODE_FP
        && stack::inherit_walker(parent_tgid, child_tgid);
    let Some(rec) = TASK_SCRATCH.get_ptr_mut(0) else { return 0 };
    unsafe {
        task_header(EVENT_FORK, rec, child_tgid, child_pid);
        (*rec).flags = if copied { TASK_WALKER_COPIED } else { 0 };
        (*rec).parent_pid = parent_tgid;
        (*rec).parent_tid = pid_tgid as u32;
        // The child's own address space (a copy of the parent's, or the parent's with
        // CLONE_VM): userspace starts it from the parent's mappings.
        (*rec).mm = read_kernel_u64(child + cfg.task_mm as u64).unwrap_or(0);
        send_task(rec, TASK_RECORD_FIXED as u64, false);
    }
    0
}

/// `sched_process_exec(struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)`;
/// runs in the new image, so argv is already on its stack.
#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn on_exec(ctx: RawTracePointContext) -> i32 {
    let cfg = config();
    usdt::forget_thread(bpf_get_current_pid_tgid() as u32);
    // A non-leader thread that execs takes the leader's tid: drop its old tid's labels too.
    let old_pid: u64 = ctx.arg(1);
    usdt::forget_thread(old_pid as u32);
    let Some((tgid, tid, rec)) = current_task_record(&cfg) else { return 0 };
    maptrack::forget_code_of(tgid);
    python::forget(tgid);
    if cfg.unwind_mode != UNWIND_MODE_FP {
        stack::clear_walker(tgid);
    }
    unsafe {
        task_header(EVENT_EXEC, rec, tgid, tid);
        let task = bpf_get_current_task();
        let mut len: u64 = 0;
        if let Some(mm) = read_kernel_u64(task + cfg.task_mm as u64) {
            // The ELF loader's mappings (binary, interpreter) follow this record
            // (send_exec_mappings), tagged with this mm; the vDSO is no mapping of a file, so
            // its address goes here.
            (*rec).mm = mm;
            if cfg.mm_vdso != 0 {
                (*rec).vdso = read_kernel_u64(mm + cfg.mm_vdso as u64).unwrap_or(0);
            }
            if let (Some(start), Some(end)) = (
                read_kernel_u64(mm + cfg.mm_arg_start as u64),
                read_kernel_u64(mm + cfg.mm_arg_end as u64),
            ) {
                let want = end.saturating_sub(start);
                len = if want > CMDLINE_MAX as u64 {
                    (*rec).cmdline_truncated = 1;
                    CMDLINE_MAX as u64
                } else {
                    want
                };
                // bpf_probe_read_user is all-or-nothing; on failure send no argv rather than
                // garbage and let userspace fall back to /proc or comm.
                let buf = &mut (*rec).cmdline;
                if len > 0
                    && bpf_probe_read_user_buf(start as *const u8, &mut buf[..len as usize])
                        .is_err()
                {
                    len = 0;
                }
            }
        }
        (*rec).cmdline_len = len as u32;
        send_task(rec, TASK_RECORD_FIXED as u64 + len, wake_for_unwinder(&cfg));
        let mm = (*rec).mm;
        if mm != 0 {
            maptrack::send_exec_mappings(&cfg, tgid, tid, mm);
        }
    }
    0
}

/// `sched_process_exit(struct task_struct *p, ...)`; runs in the exiting thread.
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn on_exit(_ctx: RawTracePointContext) -> i32 {
    let cfg = config();
    usdt::forget_thread(bpf_get_current_pid_tgid() as u32);
    sched::thread_exit(bpf_get_current_pid_tgid() as u32);
    let pid_tgid = bpf_get_current_pid_tgid();
    // The leader's exit ends the process for userspace too (`TaskKind::Exit`).
    if cfg.unwind_mode != UNWIND_MODE_FP && pid_tgid as u32 == (pid_tgid >> 32) as u32 {
        stack::forget_walker((pid_tgid >> 32) as u32);
    }
    let Some((tgid, tid, rec)) = current_task_record(&cfg) else { return 0 };
    unsafe {
        task_header(EVENT_EXIT, rec, tgid, tid);
        send_task(rec, TASK_RECORD_FIXED as u64, false);
    }
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
