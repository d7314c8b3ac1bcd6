//! USDT probes: one uprobe program serves every probe site. The site's BPF cookie is the index
//! of its [`UsdtSpec`] in `USDT_SPECS`, which says where each argument lives (register,
//! memory, constant) and which arguments are C strings to copy. `rsprof:label_push/pop` also
//! maintain a per-thread label stack that the sampler copies into every sample.

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_NO_PREALLOC, BPF_F_USER_STACK, BPF_NOEXIST},
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns,
        generated::{
            bpf_get_attach_cookie, bpf_get_current_task, bpf_get_smp_processor_id, bpf_get_stack,
            bpf_probe_read_kernel, bpf_probe_read_user, bpf_probe_read_user_str,
        },
    },
    macros::{map, uprobe},
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
    programs::ProbeContext,
};
use profiler_common::{
    EVENT_LABEL_DEPTH, EVENT_USDT, EventHeader, LABEL_DEPTH_RECORD_FIXED, LABEL_DEPTH_UNKNOWN,
    LABEL_MAX_DEPTH, LabelDepthHeader, LabelDepthScratch, LabelSeenKey, LabelStack,
    MAX_STACK_DEPTH, USDT_ARG_CONST, USDT_ARG_DEREF, USDT_ARG_REG, USDT_ARG_SIB, USDT_MAX_ARGS,
    USDT_MAX_SPECS, USDT_MAX_STRS, USDT_RECORD_FIXED, USDT_ROLE_LABEL_POP, USDT_ROLE_LABEL_PUSH,
    USDT_STR_IS_NULL, USDT_STR_IS_TRUNCATED, USDT_STR_IS_UNREADABLE, USDT_STR_MAX, UsdtArgSpec,
    UsdtRecord, UsdtString, counter, label_entry,
};

use crate::{config, count, output, read_kernel_u64, run_loop, selected};

#[map]
static USDT_SPECS: Array<profiler_common::UsdtSpec> = Array::with_max_entries(USDT_MAX_SPECS, 0);

#[map]
static USDT_SCRATCH: PerCpuArray<UsdtRecord> = PerCpuArray::with_max_entries(1, 0);

/// The tid filling this CPU's `USDT_SCRATCH`, 0 when free. Uprobe programs run with
/// migration disabled but may be preempted, so another task's hit on the same CPU could
/// overwrite a record half-built. A hit that finds the scratch taken is dropped and counted,
/// and so is one whose owner mark was replaced by the time it is sent. (The BPF target has
/// no atomic exchange: a preemption exactly between the check and the mark is not caught.)
#[map]
static USDT_BUSY: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Label stacks by tid. Only the thread itself pushes and pops, and the sampler reads it on
/// the CPU the thread runs on, so no locking is needed. Not preallocated: only threads that
/// push labels take an entry, and preallocating all 32 Ki took 11 MB of kernel memory (and
/// its zeroing) at every start-up, labels or not.
#[map]
static LABELS: HashMap<u32, LabelStack> = HashMap::with_max_entries(32768, BPF_F_NO_PREALLOC);

/// Never written: the zeroed value a thread's first push inserts (too big for the stack).
#[map]
static LABEL_ZERO: PerCpuArray<LabelStack> = PerCpuArray::with_max_entries(1, 0);

/// Scratch for the user stack walked at a label push (only its length is kept).
#[map]
static PUSH_STACK: PerCpuArray<[u64; MAX_STACK_DEPTH]> = PerCpuArray::with_max_entries(1, 0);

/// Scratch for an `EVENT_LABEL_DEPTH` record and its stack copy.
#[map]
static LABEL_DEPTH_SCRATCH: PerCpuArray<LabelDepthScratch> = PerCpuArray::with_max_entries(1, 0);

/// Labels whose text was already sent for an address space: later pushes send nothing.
#[map]
static LABEL_SEEN: LruHashMap<LabelSeenKey, u8> = LruHashMap::with_max_entries(65536, 0);

/// What the `bpf_loop` callbacks over a hit's arguments share with `record_hit` (on its stack).
#[repr(C)]
struct ArgWalk {
    /// Address of the probe's `pt_regs`.
    regs: u64,
    spec_id: u32,
    nargs: u32,
    /// Highest string slot filled.
    nstr: u32,
}

/// `bpf_loop` callback: evaluates argument `i` into this CPU's scratch record.
#[inline(never)]
extern "C" fn arg_step(i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    // SAFETY: `ctx` is record_hit's `ArgWalk`.
    let w = unsafe { &*(ctx as *const ArgWalk) };
    let i = i as usize;
    let (Some(spec), Some(rec)) = (USDT_SPECS.get(w.spec_id), USDT_SCRATCH.get_ptr_mut(0)) else {
        return 1;
    };
    let Some(a) = spec.args.get(i) else { return 1 };
    // SAFETY: this CPU's scratch record; get_mut keeps the index in bounds.
    unsafe {
        let Some(v) = (*rec).args.get_mut(i) else { return 1 };
        match eval_arg(w.regs, a) {
            Ok(x) => *v = x,
            Err(()) => {
                (*rec).arg_errors |= 1 << i;
                count(counter::USDT_ARG_ERRORS);
            }
        }
    }
    0
}

/// `bpf_loop` callback: copies the string argument `i` points to, if it is one.
#[inline(never)]
extern "C" fn str_step(i: u64, ctx: *mut core::ffi::c_void) -> i64 {
    // SAFETY: `ctx` is record_hit's `ArgWalk`.
    let w = unsafe { &mut *(ctx as *mut ArgWalk) };
    let i = i as usize;
    let (Some(spec), Some(rec)) = (USDT_SPECS.get(w.spec_id), USDT_SCRATCH.get_ptr_mut(0)) else {
        return 1;
    };
    let Some(a) = spec.args.get(i) else { return 1 };
    let slot = a.str_slot as u32;
    if slot == 0 || slot > USDT_MAX_STRS as u32 {
        return 0;
    }
    // SAFETY: this CPU's scratch record; get/get_mut keep both indexes in bounds.
    unsafe {
        let Some(&ptr) = (*rec).args.get(i) else { return 1 };
        if let Some(s) = (*rec).strs.get_mut((slot - 1) as usize) {
            read_str(s, ptr);
        }
    }
    if slot > w.nstr {
        w.nstr = slot;
    }
    0
}

/// Highest `pt_regs` offset a spec may name (`ss`).
const PT_REGS_LAST: u64 = 160;

#[inline(always)]
unsafe fn reg(regs: u64, off: u8) -> Result<u64, ()> {
    let off = off as u64;
    if off > PT_REGS_LAST || !off.is_multiple_of(8) {
        return Err(());
    }
    let mut v: u64 = 0;
    let ret = unsafe {
        bpf_probe_read_kernel(
            (&mut v as *mut u64).cast(),
            8,
            (regs + off) as *const core::ffi::c_void,
        )
    };
    if ret < 0 { Err(()) } else { Ok(v) }
}

/// Reads an argument of `64 - bitshift` bits at `addr`: exactly its size, so an argument at
/// the very end of a mapping is still readable.
#[inline(always)]
unsafe fn read_user_sized(addr: u64, bitshift: u8) -> Result<u64, ()> {
    let mut size = (64 - (bitshift as u32 & 63)) / 8;
    if size == 0 || size > 8 {
        size = 8;
    }
    let mut v: u64 = 0;
    let ret = unsafe { bpf_probe_read_user((&mut v as *mut u64).cast(), size, addr as *const _) };
    if ret < 0 { Err(()) } else { Ok(v) }
}

#[inline(always)]
unsafe fn eval_arg(regs: u64, a: &UsdtArgSpec) -> Result<u64, ()> {
    let v = match a.kind {
        USDT_ARG_CONST => a.val_off as u64,
        USDT_ARG_REG => unsafe { reg(regs, a.reg_off)? }.wrapping_add(a.val_off as u64),
        USDT_ARG_DEREF => {
            let base = unsafe { reg(regs, a.reg_off)? };
            unsafe { read_user_sized(base.wrapping_add(a.val_off as u64), a.bitshift)? }
        }
        USDT_ARG_SIB => {
            let base = unsafe { reg(regs, a.reg_off)? };
            let idx = unsafe { reg(regs, a.idx_reg_off)? };
            let addr = base.wrapping_add(idx << (a.scale_shift & 3)).wrapping_add(a.val_off as u64);
            unsafe { read_user_sized(addr, a.bitshift)? }
        }
        _ => 0,
    };
    let sh = (a.bitshift & 63) as u64;
    Ok(if a.signed != 0 { (((v << sh) as i64) >> sh) as u64 } else { (v << sh) >> sh })
}

/// Copies the C string at `ptr`, at most `USDT_STR_MAX - 1` bytes, flagging NULL, unreadable
/// and cut strings (a NULL or unmapped label/marker name must never abort the hit).
#[inline(always)]
unsafe fn read_str(s: *mut UsdtString, ptr: u64) {
    unsafe {
        (*s).len = 0;
        (*s).flags = 0;
        (*s).bytes[0] = 0;
        if ptr == 0 {
            (*s).flags = USDT_STR_IS_NULL;
            count(counter::USDT_STR_NULL);
            return;
        }
        let ret = bpf_probe_read_user_str(
            (*s).bytes.as_mut_ptr().cast(),
            USDT_STR_MAX as u32,
            ptr as *const _,
        );
        if ret <= 0 {
            (*s).flags = USDT_STR_IS_UNREADABLE;
            count(counter::USDT_STR_UNREADABLE);
            return;
        }
        let n = ret as u64;
        (*s).len = (n - 1) as u16;
        if n == USDT_STR_MAX as u64 {
            // The buffer filled: the string was cut unless its byte at MAX-1 was its NUL.
            let mut next: u8 = 0;
            let r = bpf_probe_read_user(
                (&mut next as *mut u8).cast(),
                1,
                (ptr + USDT_STR_MAX as u64 - 1) as *const _,
            );
            if r < 0 || next != 0 {
                (*s).flags = USDT_STR_IS_TRUNCATED;
                count(counter::USDT_STR_TRUNCATED);
            }
        }
    }
}

#[inline(always)]
fn label_push(ctx: &ProbeContext, tgid: u32, tid: u32, addr: u64, busy: *mut u32) {
    count(counter::LABEL_PUSHES);
    let (mut depth, walked) = user_depth(ctx);
    let st = match LABELS.get_ptr_mut(tid) {
        Some(p) => p,
        None => {
            let Some(zero) = LABEL_ZERO.get(0) else { return };
            if LABELS.insert(tid, zero, BPF_NOEXIST as u64).is_err() {
                count(counter::LABEL_MAP_FULL);
                return;
            }
            match LABELS.get_ptr_mut(tid) {
                Some(p) => p,
                None => return,
            }
        }
    };
    // SAFETY: map value pointer; only this thread writes its entry.
    let index = unsafe { (*st).depth };
    if let Some(frames) = walked {
        // Depth 0 asks userspace for the depth its record gives; with no record sent, the
        // depth of an earlier push at this index must not be taken for this one's.
        let sent = (index as usize) < LABEL_MAX_DEPTH
            && send_label_depth(tgid, tid, addr, index, frames, busy);
        if !sent {
            count(counter::LABEL_DEPTH_LOST);
            depth = LABEL_DEPTH_UNKNOWN;
        }
    }
    let id = label_entry(addr, depth);
    // SAFETY: as above.
    unsafe {
        if (index as usize) < LABEL_MAX_DEPTH {
            (*st).ids[index as usize] = id;
        } else {
            count(counter::LABEL_OVERFLOWS);
        }
        (*st).depth = index.saturating_add(1);
    }
}

/// User frames at the probe (the pushing function and its callers), walked as the sampler
/// walks them, so the label lands right under the pusher in sampled stacks. A table walk
/// that stopped for want of a table (a process that just started) gives depth 0 and the
/// frames it walked: the depth is then found in userspace from a copy of the stack.
#[inline(always)]
fn user_depth(ctx: &ProbeContext) -> (u64, Option<u64>) {
    let Some(buf) = PUSH_STACK.get_ptr_mut(0) else { return (LABEL_DEPTH_UNKNOWN, None) };
    if crate::config_field!(unwind_mode) != profiler_common::UNWIND_MODE_FP {
        let regs = ctx.as_ptr() as *const aya_ebpf::bindings::pt_regs;
        // SAFETY: a uprobe's context is the user registers, read directly; `buf` has room
        // for MAX_STACK_DEPTH frames.
        let (n, end, _) = unsafe {
            let r = crate::stack::UserRegs { pc: (*regs).rip, sp: (*regs).rsp, bp: (*regs).rbp };
            crate::stack::walk_tables(buf.cast(), Some(r), crate::stack::SLOT_USDT)
        };
        if crate::stack::wants_copy(end) {
            // Counting the frames walked so far would put the label near the root.
            return (0, Some(n));
        }
        return (n, None);
    }
    let size = (MAX_STACK_DEPTH * 8) as u32;
    // SAFETY: `buf` is this CPU's scratch of exactly `size` bytes.
    let n = unsafe { bpf_get_stack(ctx.as_ptr(), buf.cast(), size, BPF_F_USER_STACK as u64) };
    if n <= 0 { (LABEL_DEPTH_UNKNOWN, None) } else { (n as u64 / 8, None) }
}

/// Sends the pusher's stack from where the kernel's walk stopped (`EVENT_LABEL_DEPTH`), within
/// the label pushes' copy budget; false when nothing was sent.
#[inline(always)]
fn send_label_depth(
    tgid: u32,
    tid: u32,
    label: u64,
    index: u32,
    frames: u64,
    busy: *mut u32,
) -> bool {
    let Some(rec) = LABEL_DEPTH_SCRATCH.get_ptr_mut(0) else { return false };
    let cfg = crate::config();
    // SAFETY: this CPU's scratch value, held by this hit (`USDT_BUSY`).
    unsafe {
        let now = bpf_ktime_get_ns();
        (*rec).rec = LabelDepthHeader {
            header: EventHeader {
                kind: EVENT_LABEL_DEPTH,
                cpu: bpf_get_smp_processor_id(),
                time_ns: now,
                pid: tgid,
                tid,
            },
            label,
            index,
            frames: frames as u32,
        };
        let at = (*rec).copy.as_mut_ptr().cast::<u64>();
        let budget = crate::BUDGET_LABELS;
        let Ok(n) = crate::write_stack_copy(at, crate::stack::SLOT_USDT, budget, now, &cfg) else {
            return false;
        };
        // Another hit took the scratch while this one was preempted: the record is mixed.
        if busy.read_volatile() != tid {
            return false;
        }
        if !output(rec, LABEL_DEPTH_RECORD_FIXED as u64 + n, false) {
            return false;
        }
        count(counter::LABEL_DEPTH_RECORDS);
        true
    }
}

#[inline(always)]
fn label_pop(tid: u32) {
    count(counter::LABEL_POPS);
    match LABELS.get_ptr_mut(tid) {
        // SAFETY: as in label_push.
        Some(st) if unsafe { (*st).depth } > 0 => unsafe { (*st).depth -= 1 },
        _ => count(counter::LABEL_UNDERFLOWS),
    }
}

/// Drops a thread's label stack (at exit and exec: labels never outlive the code that
/// pushed them).
#[inline(always)]
pub fn forget_thread(tid: u32) {
    let _ = LABELS.remove(tid);
}

/// Copies the current thread's stored labels (outermost first) to `dst[off..]`; returns how
/// many. One hash lookup when the thread has none.
#[inline(always)]
pub unsafe fn copy_labels(tid: u32, dst: *mut u64, off: u64) -> u64 {
    let Some(st) = LABELS.get_ptr(tid) else { return 0 };
    let mut n = unsafe { (*st).depth } as u64;
    if n > LABEL_MAX_DEPTH as u64 {
        n = LABEL_MAX_DEPTH as u64;
    }
    if n == 0 || off > 2 * MAX_STACK_DEPTH as u64 {
        return 0;
    }
    let ret = unsafe {
        bpf_probe_read_kernel(
            dst.add(off as usize).cast(),
            (n * 8) as u32,
            (*st).ids.as_ptr().cast(),
        )
    };
    if ret < 0 { 0 } else { n }
}

#[uprobe]
pub fn on_usdt(ctx: ProbeContext) -> u32 {
    let cfg = config();
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let tid = pid_tgid as u32;
    // Uprobes fire in every process that maps the file; keep only the selected ones.
    if !selected(&cfg, tgid) {
        return 0;
    }
    // SAFETY: uprobe context; the cookie was set at attach (0 if none).
    let spec_id = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    let Some(spec) = USDT_SPECS.get(spec_id) else {
        count(counter::USDT_LOST_OTHER);
        return 0;
    };
    if spec.role == USDT_ROLE_LABEL_POP {
        label_pop(tid);
        return 0;
    }
    let Some(busy) = USDT_BUSY.get_ptr_mut(0) else {
        count(counter::USDT_LOST_OTHER);
        return 0;
    };
    // SAFETY: `busy` is this CPU's map value, valid for the whole run; volatile so each
    // access really happens where written.
    unsafe {
        if busy.read_volatile() != 0 {
            count(counter::USDT_LOST_OTHER);
            return 0;
        }
        busy.write_volatile(tid);
    }
    record_hit(&ctx, &cfg, spec, spec_id, tgid, tid, busy);
    // SAFETY: as above.
    unsafe {
        if busy.read_volatile() == tid {
            busy.write_volatile(0);
        }
    }
    0
}

/// Builds the hit's record in this CPU's scratch and sends it; the caller holds `USDT_BUSY`.
#[inline(always)]
fn record_hit(
    ctx: &ProbeContext,
    cfg: &profiler_common::Config,
    spec: &profiler_common::UsdtSpec,
    spec_id: u32,
    tgid: u32,
    tid: u32,
    busy: *mut u32,
) {
    let Some(rec) = USDT_SCRATCH.get_ptr_mut(0) else {
        count(counter::USDT_LOST_OTHER);
        return;
    };
    let nargs = if (spec.arg_count as usize) > USDT_MAX_ARGS {
        USDT_MAX_ARGS
    } else {
        spec.arg_count as usize
    };
    // SAFETY: `rec` is this CPU's scratch record for the whole run.
    unsafe {
        (*rec).header = EventHeader {
            kind: EVENT_USDT,
            cpu: bpf_get_smp_processor_id(),
            time_ns: bpf_ktime_get_ns(),
            pid: tgid,
            tid,
        };
        (*rec).probe_id = spec.probe_id;
        (*rec).spec_id = spec_id;
        (*rec).arg_count = nargs as u16;
        (*rec).str_count = 0;
        (*rec).arg_errors = 0;
        (*rec).args = [0; USDT_MAX_ARGS];
        // One callback per argument: as a loop, the verifier went through every argument with
        // every kind of location (140 k instructions at each start-up).
        let mut walk = ArgWalk { regs: ctx.as_ptr() as u64, spec_id, nargs: nargs as u32, nstr: 0 };
        run_loop(nargs as u32, arg_step, &mut walk);
    }
    let mut seen_key = None;
    if spec.role == USDT_ROLE_LABEL_PUSH {
        // SAFETY: as above.
        let label = unsafe { (*rec).args[0] };
        label_push(ctx, tgid, tid, label, busy);
        // SAFETY: fault-checked kernel read of current->mm.
        let mm = unsafe { read_kernel_u64(bpf_get_current_task() + cfg.task_mm as u64) };
        let key = LabelSeenKey { mm: mm.unwrap_or(0), label, tgid, _pad: 0 };
        // SAFETY: plain lookup.
        if unsafe { LABEL_SEEN.get(key) }.is_some() {
            return;
        }
        seen_key = Some(key);
    }
    let mut walk = ArgWalk { regs: 0, spec_id, nargs: nargs as u32, nstr: 0 };
    // The callback only touches this CPU's scratch record.
    run_loop(nargs as u32, str_step, &mut walk);
    let nstr = walk.nstr as u64;
    let len = USDT_RECORD_FIXED as u64 + nstr * core::mem::size_of::<UsdtString>() as u64;
    // SAFETY: `rec` is this CPU's scratch record.
    // SAFETY: this CPU's map value.
    if unsafe { busy.read_volatile() } != tid {
        // Another hit took the scratch while this one was preempted: the record is mixed.
        count(counter::USDT_LOST_OTHER);
        return;
    }
    // SAFETY: `rec` is this CPU's scratch record.
    let sent = unsafe {
        (*rec).str_count = nstr as u16;
        output(rec, len, false)
    };
    if !sent {
        count(counter::USDT_LOST_RINGBUF_FULL);
        return;
    }
    count(counter::USDT_SENT);
    // Only once the text is on its way, and readable: a lost record or a page not yet
    // resident leaves the label to be named by a later push.
    // SAFETY: `rec` is this CPU's scratch record.
    let unreadable = unsafe { (*rec).strs[0].flags } & USDT_STR_IS_UNREADABLE != 0;
    if let (Some(key), false) = (seen_key, unreadable) {
        let _ = LABEL_SEEN.insert(key, 1, 0);
    }
}
