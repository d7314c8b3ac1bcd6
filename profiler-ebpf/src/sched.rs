//! The `sched_switch` hook: remembers, per CPU, which task was switched in, when, and its CPU
//! time then, so the sampler can report CPU time that is current at the sample; and, with
//! off-CPU recording on, notes when a thread blocks (taking its stacks when they may be used,
//! see `profiler_common::OffCpuTrack`) and sends its off-CPU time when it is switched in again
//! (see `profiler_common::OffCpuHeader`).
//!
//! Why: the kernel adds to `se.sum_exec_runtime` only in `update_curr` (scheduler ticks,
//! context switches), so a busy thread reads 0, 0, 0, then a tick's worth (4 ms at HZ=250)
//! at 1 kHz sampling. `se.exec_start` cannot fix that: it is on the runqueue's `clock_task`
//! (sched_clock minus irq/steal time, itself only advanced at ticks/switches), not on
//! `bpf_ktime_get_ns`'s clock. At a switch the incoming task's `sum_exec_runtime` is exact:
//! it was brought up to date when the task last stopped running and has not moved since.
//! While it keeps running, its CPU time grows with wall time, so at a sample
//! `runtime_at_switch_in + (now - ktime_at_switch_in)` is current. That slightly overstates
//! only time the kernel charges to nobody (steal time with PARAVIRT_TIME_ACCOUNTING, irq time
//! with IRQ_TIME_ACCOUNTING) until the next switch resets the base.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns,
        generated::{
            bpf_get_current_cgroup_id, bpf_get_current_task, bpf_get_current_task_btf,
            bpf_get_smp_processor_id, bpf_task_pt_regs,
        },
    },
    macros::{map, raw_tracepoint},
    maps::{HashMap, PerCpuArray},
    programs::RawTracePointContext,
};
use profiler_common::{
    Config, EVENT_OFF_CPU, EVENT_OFF_CPU_COPY, EventHeader, MAX_STACK_DEPTH,
    OFF_CPU_COPY_RECORD_FIXED, OFF_CPU_LONG_SITES, OFF_CPU_NONE, OFF_CPU_RECORD_FIXED,
    OFF_CPU_SEEN_SITES, OFF_CPU_STACK_NOT_CAPTURED, OFF_CPU_WALL, OffCpuCopyHeader,
    OffCpuCopyScratch, OffCpuRecord, PY_MAX_FRAMES, SAMPLE_KERNEL_STACK_ERROR,
    SAMPLE_USER_STACK_ERROR, TRACK_PREV_LONG, TRACK_SUM_HAS_STACK, TRACK_WALKED, counter,
};

use crate::{CONFIG, cgroup, config, count, output, read_kernel_u32, read_kernel_u64, selected};

/// Threads tracked off-CPU at once (every selected thread that has blocked and not exited).
const OFF_CPU_MAX_THREADS: u32 = 65536;
/// `TASK_DEAD`: the final switch-out of an exiting task, which never runs again.
const TASK_DEAD: u32 = 0x80;

/// The task last switched in on a CPU.
#[repr(C)]
#[derive(Clone, Copy)]
struct SwitchIn {
    /// `struct task_struct *` (not the tid: a non-leader exec changes the tid of a running
    /// task; 0 before the first switch seen on this CPU).
    task: u64,
    /// `bpf_ktime_get_ns()` at the switch.
    ktime_ns: u64,
    /// The task's `se.sum_exec_runtime` at the switch.
    runtime_ns: u64,
}

#[map]
static SWITCH_IN: PerCpuArray<SwitchIn> = PerCpuArray::with_max_entries(1, 0);

/// Per tracked thread (by tid): its last switch-out, built in place as the record to send.
/// Not preallocated: a ~4 KiB value per thread (2 KiB of it room for Python frames) is
/// allocated only for threads that block.
#[map]
static OFF_CPU: HashMap<u32, OffCpuRecord> =
    HashMap::with_max_entries(OFF_CPU_MAX_THREADS, BPF_F_NO_PREALLOC);

/// Scratch for an `EVENT_OFF_CPU_COPY` record and its stack copy.
#[map]
static OFF_CPU_COPY_SCRATCH: PerCpuArray<OffCpuCopyScratch> = PerCpuArray::with_max_entries(1, 0);

/// Never written: the zeroed value a new thread's entry starts from (too big for the stack).
#[map]
static OFF_CPU_ZERO: PerCpuArray<OffCpuRecord> = PerCpuArray::with_max_entries(1, 0);

/// `sched_switch(bool preempt, struct task_struct *prev, struct task_struct *next,
/// unsigned int prev_state)`; runs on the CPU that switches, in `prev`'s context, with
/// interrupts off, so a sample on this CPU never sees the entry half-written.
#[raw_tracepoint(tracepoint = "sched_switch")]
pub fn on_sched_switch(ctx: RawTracePointContext) -> i32 {
    let next: u64 = ctx.arg(2);
    // Field by field: a volatile read of the whole config copies all of it on every switch.
    // SAFETY: read-only globals patched by the loader.
    let (off_cpu, runtime_off) = unsafe {
        (
            core::ptr::read_volatile(core::ptr::addr_of!(CONFIG.off_cpu)),
            core::ptr::read_volatile(core::ptr::addr_of!(CONFIG.task_sum_exec_runtime)),
        )
    };
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    if off_cpu != OFF_CPU_NONE {
        let cfg = config();
        let preempt: u64 = ctx.arg(0);
        let prev_state: u64 = ctx.arg(3);
        // SAFETY: runs in the tracepoint with its context.
        unsafe {
            switch_out(&ctx, &cfg, now, preempt & 0xff != 0, prev_state as u32);
            switch_in(&cfg, now, next);
        }
    }
    let Some(e) = SWITCH_IN.get_ptr_mut(0) else { return 0 };
    // SAFETY: `e` is this CPU's slot; `next` is the tracepoint's task pointer, read
    // fault-checked.
    unsafe {
        match read_kernel_u64(next + runtime_off as u64) {
            Some(runtime) => {
                (*e).task = next;
                (*e).ktime_ns = now;
                (*e).runtime_ns = runtime;
            }
            // Unreadable: let the sampler fall back to the raw counter for this task.
            None => (*e).task = 0,
        }
    }
    0
}

/// Starts a block for the task leaving the CPU (the current one) when it blocks: not when it
/// was preempted or its state is still `TASK_RUNNING` (a yield, or a sleep cut short by a
/// signal), both runnable, unless `OFF_CPU_WALL` asks for waits for a CPU too. Takes its
/// stacks only when they may be used (see `profiler_common::OffCpuTrack`).
#[inline(always)]
unsafe fn switch_out(
    ctx: &RawTracePointContext,
    cfg: &Config,
    now: u64,
    preempt: bool,
    state: u32,
) {
    if state & TASK_DEAD != 0 {
        return;
    }
    let blocking = !preempt && state != 0;
    if !blocking && cfg.off_cpu != OFF_CPU_WALL {
        return;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((pid_tgid >> 32) as u32, pid_tgid as u32);
    if tid == 0 || !selected(cfg, tgid) || !cgroup::selected() {
        return;
    }
    let mut fresh = false;
    let e = match OFF_CPU.get_ptr_mut(tid) {
        Some(e) => e,
        None => {
            let Some(zero) = OFF_CPU_ZERO.get_ptr(0) else { return };
            // SAFETY: a per-CPU value nobody writes.
            if OFF_CPU.insert(tid, unsafe { &*zero }, 0).is_err() {
                count(counter::OFF_CPU_LOST_MAP_FULL);
                return;
            }
            let Some(e) = OFF_CPU.get_ptr_mut(tid) else {
                count(counter::OFF_CPU_LOST_MAP_FULL);
                return;
            };
            fresh = true;
            e
        }
    };
    // SAFETY: `e` is this thread's entry; only this thread's switches (serialized: it runs on
    // one CPU at a time) and its exit touch it.
    unsafe {
        let r = &mut (*e).off;
        let t = &mut (*e).track;
        r.header.time_ns = now;
        r.state = if blocking { state } else { 0 };
        r.off_cpu = 1;
        let site = user_site(cfg);
        t.site = site;
        // Only blocking sites: a preempted thread's "site" is wherever it was running.
        let new_site = blocking && site != 0 && !t.seen_sites.contains(&site);
        if new_site {
            let i = t.next_seen_site as usize % OFF_CPU_SEEN_SITES;
            t.seen_sites[i] = site;
            t.next_seen_site = (i as u32 + 1) % OFF_CPU_SEEN_SITES as u32;
        }
        let walk = fresh
            || new_site
            || t.flags & TRACK_PREV_LONG != 0
            || r.pending_ns.saturating_add(t.short_max_ns) >= cfg.off_cpu_min_ns
            || (site != 0 && t.long_sites.contains(&site));
        if !walk {
            t.flags &= !TRACK_WALKED;
            return;
        }
        // The frames are about to hold this block's stack.
        t.flags = (t.flags | TRACK_WALKED) & !TRACK_SUM_HAS_STACK;
        count(counter::OFF_CPU_WALKS);
        // What the sent record says of the thread, refreshed with each stack (a record without
        // a stack keeps those of the last walk).
        r.header.kind = EVENT_OFF_CPU;
        r.header.cpu = bpf_get_smp_processor_id();
        r.header.pid = tgid;
        r.header.tid = tid;
        r.cgroup_id = bpf_get_current_cgroup_id();
        r.comm = bpf_get_current_comm().unwrap_or([0; 16]);
        let frames = (*e).frames.as_mut_ptr();
        // Skips this program's frame and the tracepoint's `bpf_trace_run4`: the stack starts
        // at `__schedule`, like the thread's own view of where it blocked.
        let w = crate::stack::walk(ctx, frames, 2, None, crate::stack::SLOT_OFF_CPU);
        r.flags = w.errors;
        if w.errors & SAMPLE_KERNEL_STACK_ERROR != 0 {
            count(counter::OFF_CPU_STACK_ERRORS);
        }
        if w.errors & SAMPLE_USER_STACK_ERROR != 0 {
            count(counter::OFF_CPU_STACK_ERRORS);
        }
        r.kernel_frames = w.kernel_frames;
        r.user_frames = w.user_frames;
        // Bound for the verifier: the Python frames go after the user frames.
        let before_py = w.kernel_frames as usize + w.user_frames as usize;
        let before_py =
            if before_py > 2 * MAX_STACK_DEPTH { 2 * MAX_STACK_DEPTH } else { before_py };
        let (py, py_flags) = crate::python::walk(
            tgid,
            bpf_get_current_task(),
            cfg.task_fsbase,
            frames.add(before_py),
            crate::python::SLOT_OFF_CPU,
        );
        r.py_frames = py;
        r.flags |= py_flags;
        r.stack_ns = now;
        let end = w.user_end();
        if crate::stack::wants_copy(end) {
            if send_copy(cfg, now, tgid, tid, w.user_frames) {
                count(counter::OFF_CPU_COPIES);
            } else {
                count(counter::OFF_CPU_COPY_LOST);
            }
        }
    }
}

/// Sends where the off-CPU walk stopped for want of a table and a copy of the stack from there
/// (`EVENT_OFF_CPU_COPY`, keyed by the switch-out time `now`), within the off-CPU copy budget;
/// false when nothing was sent. The thread is switching out, so its user stack is this
/// context's: after the switch it could no longer be read from here.
#[inline(always)]
unsafe fn send_copy(cfg: &Config, now: u64, tgid: u32, tid: u32, frames: u16) -> bool {
    let Some(rec) = OFF_CPU_COPY_SCRATCH.get_ptr_mut(0) else { return false };
    // SAFETY: this CPU's scratch; sched_switch runs with interrupts off, so nothing on this
    // CPU takes it meanwhile.
    unsafe {
        (*rec).rec = OffCpuCopyHeader {
            header: EventHeader {
                kind: EVENT_OFF_CPU_COPY,
                cpu: bpf_get_smp_processor_id(),
                time_ns: now,
                pid: tgid,
                tid,
            },
            frames: u32::from(frames),
            _pad: 0,
        };
        let at = (*rec).copy.as_mut_ptr().cast::<u64>();
        let slot = crate::stack::SLOT_OFF_CPU;
        let Ok(n) = crate::write_stack_copy(at, slot, crate::BUDGET_OFF_CPU, now, cfg) else {
            return false;
        };
        output(rec, OFF_CPU_COPY_RECORD_FIXED as u64 + n, false)
    }
}

/// Where the current task blocked, cheaply: the user address its system call returns to (0
/// for a kernel thread or when unreadable). Tells a thread's blocking places apart well enough
/// to predict which blocks are long.
#[inline(always)]
unsafe fn user_site(cfg: &Config) -> u64 {
    // SAFETY: helpers on the current task; the read is fault-checked.
    unsafe {
        let regs = bpf_task_pt_regs(bpf_get_current_task_btf());
        if regs == 0 {
            return 0;
        }
        read_kernel_u64(regs as u64 + cfg.pt_regs_ip as u64).unwrap_or(0)
    }
}

/// The task coming on the CPU: if it is tracked off-CPU, its block ends now.
#[inline(always)]
unsafe fn switch_in(cfg: &Config, now: u64, next: u64) {
    // SAFETY: the tracepoint's task pointer, read fault-checked.
    let Some(tid) = (unsafe { read_kernel_u32(next + cfg.task_pid as u64) }) else { return };
    if tid == 0 {
        return;
    }
    let Some(e) = OFF_CPU.get_ptr_mut(tid) else { return };
    // SAFETY: this thread's entry (see `switch_out`).
    unsafe {
        let r = &mut (*e).off;
        let t = &mut (*e).track;
        if r.off_cpu == 0 {
            return;
        }
        r.off_cpu = 0;
        let d = now.saturating_sub(r.header.time_ns);
        r.block_ns = d;
        let walked = t.flags & TRACK_WALKED != 0;
        if d >= cfg.off_cpu_min_ns {
            t.flags |= TRACK_PREV_LONG;
            let site = t.site;
            if site != 0 && !t.long_sites.contains(&site) {
                let i = t.next_long_site as usize % OFF_CPU_LONG_SITES;
                t.long_sites[i] = site;
                t.next_long_site = (i as u32 + 1) % OFF_CPU_LONG_SITES as u32;
            }
            r.weight_ns = d;
            r.blocks = 1;
            if !walked {
                // Never another block's stack: none, flagged.
                r.kernel_frames = 0;
                r.user_frames = 0;
                r.py_frames = 0;
                r.flags = OFF_CPU_STACK_NOT_CAPTURED;
            }
            if !send(e) {
                count(counter::OFF_CPU_LOST_RINGBUF_FULL);
            } else if walked {
                count(counter::OFF_CPU_SENT);
            } else {
                count(counter::OFF_CPU_NOT_CAPTURED);
            }
            return;
        }
        count(counter::OFF_CPU_SUMMED);
        t.flags &= !TRACK_PREV_LONG;
        // A site stays in the list while its last block was long: one long block among many
        // short ones there (a ping-pong thread preempted for a while) must not make every
        // later block at that site pay for a walk.
        if t.site != 0 {
            for i in 0..OFF_CPU_LONG_SITES {
                if t.long_sites[i] == t.site {
                    t.long_sites[i] = 0;
                }
            }
        }
        let decayed = t.short_max_ns - t.short_max_ns / 8;
        t.short_max_ns = if d > decayed { d } else { decayed };
        r.pending_ns += d;
        r.pending_blocks += 1;
        if walked {
            t.flags |= TRACK_SUM_HAS_STACK;
            if r.pending_ns >= cfg.off_cpu_min_ns {
                send_pending(e);
            }
        }
        // Not walked: stays pending, and the next block is walked to carry it.
    }
}

/// Sends the thread's pending sum with its last walked block's stack; kept pending if it does
/// not fit in the ring buffer.
#[inline(always)]
unsafe fn send_pending(e: *mut OffCpuRecord) {
    unsafe {
        let r = &mut (*e).off;
        r.weight_ns = r.pending_ns;
        r.blocks = r.pending_blocks;
        if send(e) {
            r.pending_ns = 0;
            r.pending_blocks = 0;
            (*e).track.flags &= !TRACK_SUM_HAS_STACK;
            count(counter::OFF_CPU_SUMS_SENT);
        } else {
            count(counter::OFF_CPU_SUMS_DEFERRED);
        }
    }
}

#[inline(always)]
unsafe fn send(e: *mut OffCpuRecord) -> bool {
    unsafe {
        let n = (*e).off.kernel_frames as u64 + (*e).off.user_frames as u64;
        let n = if n > 2 * MAX_STACK_DEPTH as u64 { 2 * MAX_STACK_DEPTH as u64 } else { n };
        let py = (*e).off.py_frames as u64;
        let n = n + 2 * if py > PY_MAX_FRAMES as u64 { PY_MAX_FRAMES as u64 } else { py };
        output(e, OFF_CPU_RECORD_FIXED as u64 + n * 8, false)
    }
}

/// A thread exits: sends what it has pending and forgets it.
#[inline(always)]
pub fn thread_exit(tid: u32) {
    let cfg = config();
    if cfg.off_cpu == OFF_CPU_NONE {
        return;
    }
    let Some(e) = OFF_CPU.get_ptr_mut(tid) else { return };
    // SAFETY: the exiting thread's own entry.
    unsafe {
        if (*e).off.pending_ns > 0 {
            (*e).off.block_ns = 0;
            // With the stack of a block in the sum if the frames hold one, else none.
            if (*e).track.flags & TRACK_SUM_HAS_STACK == 0 {
                (*e).off.kernel_frames = 0;
                (*e).off.user_frames = 0;
                (*e).off.py_frames = 0;
                (*e).off.flags = OFF_CPU_STACK_NOT_CAPTURED;
            }
            send_pending(e);
        }
    }
    let _ = OFF_CPU.remove(tid);
}

/// CPU time of the current task at `now` (a `bpf_ktime_get_ns` value): its runtime at this
/// CPU's last switch-in plus the time since, when that switch-in was the current task, else
/// `raw` (its `sum_exec_runtime` as of the last tick). Returns (cpu time, is current).
///
/// The slot not naming the current task happens before the first switch on a CPU after
/// attaching, and, rarely, for a switch-in the slot missed (seen: a spinning thread whose
/// slot named another task for 88 ms, cause not found; every sample then carried the
/// tick-updated counter, 0 or 4 ms per 1 ms sample). The slot is then taken over from
/// `raw` here: later samples count the time that passes, and the next switch-in corrects
/// the tick's lag (one delta up to a tick too large, instead of every sample wrong).
#[inline(always)]
pub fn current_cpu_time(now: u64, raw: u64) -> (u64, bool) {
    let Some(slot) = SWITCH_IN.get_ptr_mut(0) else { return (raw, false) };
    // SAFETY: this CPU's slot; sched_switch on this CPU (interrupts off) cannot run while
    // we do, and we run from the sampler's interrupt, not nested in it.
    let e = unsafe { *slot };
    let task = unsafe { bpf_get_current_task() };
    if task == 0 {
        return (raw, false);
    }
    if e.task != task || now < e.ktime_ns {
        // SAFETY: as above.
        unsafe { *slot = SwitchIn { task, ktime_ns: now, runtime_ns: raw } };
        return (raw, false);
    }
    // No floor at `raw`: it advances on the scheduler's clock, which on a VM can run faster
    // than `bpf_ktime_get_ns`'s; taking it whenever it is ahead brings back the tick-sized
    // steps this is here to remove (seen: 1 run in 6 of a spinning thread drawn at 70%).
    (e.runtime_ns + (now - e.ktime_ns), true)
}
