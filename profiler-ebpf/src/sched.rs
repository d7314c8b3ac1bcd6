//! The `sched_switch` hook: remembers, per CPU, which task was switched in, when, and its CPU
//! time then, so the sampler can report CPU time that is current at the sample.
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
    helpers::{bpf_ktime_get_ns, generated::bpf_get_current_task},
    macros::{map, raw_tracepoint},
    maps::PerCpuArray,
    programs::RawTracePointContext,
};

use crate::{config, read_kernel_u64};

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

/// `sched_switch(bool preempt, struct task_struct *prev, struct task_struct *next,
/// unsigned int prev_state)`; runs on the CPU that switches, with interrupts off, so a sample
/// on this CPU never sees the entry half-written.
#[raw_tracepoint(tracepoint = "sched_switch")]
pub fn on_sched_switch(ctx: RawTracePointContext) -> i32 {
    let next: u64 = ctx.arg(2);
    let Some(e) = SWITCH_IN.get_ptr_mut(0) else { return 0 };
    let off = config().task_sum_exec_runtime as u64;
    // SAFETY: `e` is this CPU's slot; `next` is the tracepoint's task pointer, read
    // fault-checked.
    unsafe {
        match read_kernel_u64(next + off) {
            Some(runtime) => {
                (*e).task = next;
                (*e).ktime_ns = bpf_ktime_get_ns();
                (*e).runtime_ns = runtime;
            }
            // Unreadable: let the sampler fall back to the raw counter for this task.
            None => (*e).task = 0,
        }
    }
    0
}

/// CPU time of the current task at `now` (a `bpf_ktime_get_ns` value): exact when this CPU's
/// last switch-in was the current task, else `raw` (its `sum_exec_runtime` as of the last
/// tick), which only happens until the first switch on this CPU after attaching. Returns
/// (cpu time, is current).
#[inline(always)]
pub fn current_cpu_time(now: u64, raw: u64) -> (u64, bool) {
    let Some(e) = SWITCH_IN.get_ptr(0) else { return (raw, false) };
    // SAFETY: this CPU's slot; sched_switch on this CPU cannot run while we do.
    let e = unsafe { *e };
    let task = unsafe { bpf_get_current_task() };
    if e.task != task || task == 0 || now < e.ktime_ns {
        return (raw, false);
    }
    let t = e.runtime_ns + (now - e.ktime_ns);
    // Never below what the kernel itself has counted (clock rates differ by a few ppm).
    (if t > raw { t } else { raw }, true)
}
