//! Stack walking shared by the CPU sampler and the off-CPU tracker: the kernel stack
//! (`bpf_get_stack`), then the user stack right after it in the same buffer, walked either by
//! frame pointers (`bpf_get_stack`, `UNWIND_MODE_FP`) or with unwind tables (`UNWIND_MODE_DWARF*`).
//!
//! The table walk: userspace compiles each mapped file's CFI into [`UnwindRow`]s in the one
//! `UNWIND_ROWS` array and keeps, per process, its executable mappings sorted by address in
//! `UNWIND_PROCS` (one hash lookup, then a binary search inside one map value: no per-range
//! keys as an LPM trie would need for arbitrary ranges, and one value rewritten whole per
//! change, so a walk never sees a half-updated order). Each frame: find the PC's mapping,
//! binary-search its file's rows for `pc - bias`, compute the CFA, read the return address
//! (CFA - 8) and the saved rbp. Frames run in a `bpf_loop` callback, so the verifier checks
//! one frame, not 127; the state lives in a per-CPU map the callback looks up.

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_MMAPABLE, BPF_F_NO_PREALLOC, BPF_F_USER_STACK, BPF_NOEXIST, pt_regs},
    helpers::{
        bpf_probe_read_kernel, bpf_probe_read_user,
        generated::{
            bpf_get_current_task, bpf_get_current_task_btf, bpf_get_stack, bpf_task_pt_regs,
        },
    },
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
};
use profiler_common::{
    FileKey, MAP_EXE_TEXT, MAP_INTERP, MAX_STACK_DEPTH, SAMPLE_KERNEL_STACK_ERROR,
    SAMPLE_UNWIND_MASK, SAMPLE_UNWIND_SHIFT, SAMPLE_UNWIND_USED_FP, SAMPLE_USER_STACK_ERROR,
    STACK_COPY_BP_KNOWN, STACK_COPY_MAX, STACK_COPY_PC_IS_RETURN, StackCopyHeader, UNWIND_CFA_END,
    UNWIND_CFA_NONE, UNWIND_CFA_PLT, UNWIND_CFA_RBP, UNWIND_CFA_RSP, UNWIND_CFA_RSP_LARGE,
    UNWIND_CFA_SIGNAL, UNWIND_EARLY_SLOTS, UNWIND_END_COMPLETE, UNWIND_END_DEPTH,
    UNWIND_END_FRAME_POINTER, UNWIND_END_NO_CFI, UNWIND_END_NO_MAPPING, UNWIND_END_NO_PROCESS,
    UNWIND_END_NO_TABLE, UNWIND_END_NONE, UNWIND_END_READ_FAULT, UNWIND_END_UNSUPPORTED,
    UNWIND_MAPPING_NO_CFI, UNWIND_MAPPING_NOT_LOADED, UNWIND_MAPPING_PY_TRAMPOLINES,
    UNWIND_MAX_MAPPINGS, UNWIND_MODE_DWARF_FP, UNWIND_MODE_FP, UNWIND_PAGE_SHIFT,
    UNWIND_PAGE_STEPS, UNWIND_RBP_CFA_OFFSET, UNWIND_RBP_UNSUPPORTED, UnwindEarly, UnwindEarlySlot,
    UnwindFile, UnwindMapping, UnwindProcess, UnwindRow, counter,
};

use crate::{config, count, run_loop};

/// The compiled tables of every loaded file; sized by the loader (`--unwind-table-mb`).
/// Mmapable: userspace copies a table's rows in with memcpy instead of a syscall per row.
#[map]
static UNWIND_ROWS: Array<UnwindRow> = Array::with_max_entries(1, BPF_F_MMAPABLE);

/// Executable mappings per thread-group id. Not preallocated: a value is 12 KiB.
#[map]
static UNWIND_PROCS: HashMap<u32, UnwindProcess> =
    HashMap::with_max_entries(8192, BPF_F_NO_PREALLOC);

/// Files whose table is loaded and named by some entry (userspace writes it), so a new
/// mapping of one can be walked before userspace has read it: see [`UnwindFile`].
#[map]
static UNWIND_FILES: HashMap<FileKey, UnwindFile> = HashMap::with_max_entries(4096, 0);

/// Each process's early mappings ([`UnwindEarly`]): added at its mmap/exec, removed by
/// munmap/mprotect of the range, gone at exec and exit. LRU: a process that lost its own
/// walks through the records as before.
#[map]
static UNWIND_EARLY: LruHashMap<u32, UnwindEarly> = LruHashMap::with_max_entries(4096, 0);

/// A process whose early mappings one thread is adding to: another thread's add (mapping at
/// the same moment on another CPU) is skipped, not interleaved (counted; userspace still gets
/// the record). Inserted with `BPF_NOEXIST`, which succeeds for one.
#[map]
static EARLY_BUSY: HashMap<u32, u8> = HashMap::with_max_entries(1024, 0);

/// An [`UnwindEarly`] of zeros (never written), inserted as a process's first, and an
/// [`UnwindProcess`] of zeros, walked with when a process has early mappings but no entry.
#[map]
static EARLY_ZERO: Array<UnwindEarly> = Array::with_max_entries(1, 0);
#[map]
static EMPTY_PROCESS: Array<UnwindProcess> = Array::with_max_entries(1, 0);

/// A new process forked from one with a walker entry, and whose entry it walks with until it
/// has its own (written by userspace) or execs. Preallocated: a fork costs one small insert,
/// not a copy of the parent's 12 KiB entry that most children (fork then exec) never use.
#[map]
static FORKED_FROM: LruHashMap<u32, u32> = LruHashMap::with_max_entries(16384, 0);

/// Gives a new process (a fork without exec: a PostgreSQL backend, an nginx or gunicorn
/// worker) its parent's walker entry: it has its parent's address space, so its first samples
/// unwind at once instead of waiting for userspace (which adopts it, `unwind::adopt`). A child
/// of such a child walks with the same entry. Returns whether the child has one.
pub fn inherit_walker(parent_tgid: u32, child_tgid: u32) -> bool {
    let owner = if UNWIND_PROCS.get_ptr(&parent_tgid).is_some() {
        parent_tgid
    } else {
        // SAFETY: a plain read of a u32 map value.
        match unsafe { FORKED_FROM.get(&parent_tgid) } {
            Some(&o) => o,
            None => return false,
        }
    };
    if FORKED_FROM.insert(&child_tgid, &owner, 0).is_ok() {
        count(counter::FORK_WALKER_COPIES);
        true
    } else {
        count(counter::FORK_WALKER_COPY_FAILED);
        false
    }
}

/// The entry `tgid`'s walks use: its own, else that of the process it was forked from; and
/// the early mappings it has not seen (the process's own: a forked child's mappings since the
/// fork are its own).
#[inline(always)]
fn walker_entry(tgid: u32) -> Option<(*const UnwindProcess, *const UnwindEarly, u32)> {
    let own = UNWIND_PROCS.get_ptr(&tgid);
    // SAFETY: a map value pointer, valid for the program's run.
    let seen = own.map_or(0, |p| unsafe { core::ptr::read_volatile(&(*p).early_seen) });
    // Without early mappings (the agent) no lookup.
    let on = crate::config_field!(early_mappings) != 0;
    let early = match if on { UNWIND_EARLY.get_ptr(&tgid) } else { None } {
        // SAFETY: a map value pointer, valid for the program's run.
        Some(e) if unsafe { core::ptr::read_volatile(&(*e).next) } > seen => e,
        _ => core::ptr::null(),
    };
    let entry = match own {
        Some(p) => Some(p),
        // SAFETY: a plain read of a u32 map value.
        None => unsafe { FORKED_FROM.get(&tgid) }.and_then(|o| UNWIND_PROCS.get_ptr(o)),
    };
    match entry {
        Some(p) => Some((p, early, seen)),
        None if !early.is_null() => Some((EMPTY_PROCESS.get_ptr(0)?, early, seen)),
        None => None,
    }
}

/// A code mapping of `file` at `start..start + len` (file offset `offset`; `kind`:
/// `MAP_EXE_TEXT` or `MAP_INTERP` at exec, see their meanings, else 0) was made in `tgid`:
/// if the file's table is loaded, the walker gets the mapping now ([`UnwindEarly`]). Returns
/// its number for the mapping's record, 0 if not added.
#[inline(always)]
pub fn early_mapped(
    tgid: u32,
    file: FileKey,
    inode: u64,
    start: u64,
    len: u64,
    offset: u64,
    kind: u32,
) -> u32 {
    let cfg = config();
    if cfg.early_mappings == 0 || cfg.unwind_mode == UNWIND_MODE_FP || cfg.inode_size == 0 {
        return 0;
    }
    let Some(f) = UNWIND_FILES.get_ptr(&file) else { return 0 };
    // SAFETY: a map value pointer, valid for the program's run; kernel reads fault-checked.
    let (f, same) = unsafe {
        let f = &*f;
        let size = crate::read_kernel_u64(inode + cfg.inode_size as u64);
        let sec = crate::read_kernel_u64(inode + cfg.inode_mtime_sec as u64);
        let nsec = crate::read_kernel_u32(inode + cfg.inode_mtime_nsec as u64);
        (f, size == Some(f.size) && sec == Some(f.mtime_sec) && nsec == Some(f.mtime_nsec))
    };
    if !same {
        count(counter::EARLY_FILE_CHANGED);
        return 0;
    }
    if f.segment_count == 0 {
        return 0;
    }
    let seg = &f.segments[0];
    let (lo, hi, bias) = if kind & MAP_EXE_TEXT != 0 {
        // `start` is `mm->start_code`: the lowest executable segment's address.
        (start, start + len, start.wrapping_sub(seg.vaddr))
    } else if kind & MAP_INTERP != 0 {
        // `start` is the load base: the first executable segment is at base + its vaddr.
        let lo = start.wrapping_add(seg.vaddr);
        (lo, lo.wrapping_add(seg.memsz), start)
    } else {
        let mut found = None;
        for s in &f.segments {
            if s.memsz != 0 && s.offset & !0xfff <= offset && offset < s.offset + s.memsz {
                found = Some(s);
                break;
            }
        }
        let Some(s) = found else { return 0 };
        (
            start,
            start + len,
            start.wrapping_sub(s.vaddr.wrapping_add(offset).wrapping_sub(s.offset)),
        )
    };
    if EARLY_BUSY.insert(&tgid, &0, BPF_NOEXIST as u64).is_err() {
        count(counter::EARLY_BUSY);
        return 0;
    }
    let seq = add_early(tgid, UnwindEarlySlot { seq: 0, _pad: 0, start: lo, end: hi, bias, file });
    let _ = EARLY_BUSY.remove(&tgid);
    if seq != 0 {
        count(counter::EARLY_ADDED);
    }
    seq
}

/// Appends `slot` to `tgid`'s early mappings (the caller holds `EARLY_BUSY`); its number, or
/// 0. The slot's number is written last and cleared first, so a walk reading it meanwhile
/// sees two different numbers (or 0) around its fields and skips it.
#[inline(always)]
fn add_early(tgid: u32, slot: UnwindEarlySlot) -> u32 {
    let e = match UNWIND_EARLY.get_ptr_mut(&tgid) {
        Some(e) => e,
        None => {
            let Some(zero) = EARLY_ZERO.get(0) else { return 0 };
            if UNWIND_EARLY.insert(&tgid, zero, 0).is_err() {
                return 0;
            }
            match UNWIND_EARLY.get_ptr_mut(&tgid) {
                Some(e) => e,
                None => return 0,
            }
        }
    };
    // SAFETY: a map value pointer, valid for the program's run; writes to it are serialized by
    // `EARLY_BUSY`, and walks read it as described above.
    unsafe {
        let seq = (*e).next.wrapping_add(1);
        if seq == 0 {
            return 0;
        }
        let s = &mut (*e).slots[(seq as usize - 1) & (UNWIND_EARLY_SLOTS - 1)];
        core::ptr::write_volatile(&mut s.seq, 0);
        s.start = slot.start;
        s.end = slot.end;
        s.bias = slot.bias;
        s.file = slot.file;
        core::ptr::write_volatile(&mut s.seq, seq);
        core::ptr::write_volatile(&mut (*e).next, seq);
        seq
    }
}

/// `start..end` of `tgid` stopped being the code it was (munmap, mprotect, mremap): its early
/// mappings there go.
#[inline(always)]
pub fn early_unmapped(tgid: u32, start: u64, end: u64) {
    if crate::config_field!(early_mappings) == 0 {
        return;
    }
    let Some(e) = UNWIND_EARLY.get_ptr_mut(&tgid) else { return };
    for i in 0..UNWIND_EARLY_SLOTS {
        // SAFETY: a map value pointer, valid for the program's run; one store per slot.
        unsafe {
            let s = &mut (*e).slots[i];
            if s.seq != 0 && s.start < end && start < s.end {
                core::ptr::write_volatile(&mut s.seq, 0);
                count(counter::EARLY_REMOVED);
            }
        }
    }
}

/// The walker's view of `addr` among `e`'s mappings numbered after `seen` (the newest one
/// holding it), from its file's current `UNWIND_FILES` entry; None when none holds it or its
/// file's table is no longer there.
#[inline(always)]
fn early_mapping(e: &UnwindEarly, seen: u32, addr: u64) -> Option<UnwindMapping> {
    let mut best = UNWIND_EARLY_SLOTS;
    let mut best_seq = seen;
    for i in 0..UNWIND_EARLY_SLOTS {
        let s = &e.slots[i];
        // SAFETY: reads of a map value; see `add_early` for the number around the fields.
        let seq = unsafe { core::ptr::read_volatile(&s.seq) };
        if seq > best_seq && s.start <= addr && addr < s.end {
            best = i;
            best_seq = seq;
        }
    }
    let s = e.slots.get(best)?;
    let (start, end, bias, file) = (s.start, s.end, s.bias, s.file);
    // SAFETY: as above.
    if unsafe { core::ptr::read_volatile(&s.seq) } != best_seq {
        return None;
    }
    // SAFETY: a plain copy of a map value.
    let f = unsafe { UNWIND_FILES.get(&file) }?;
    Some(UnwindMapping {
        start,
        end,
        bias,
        first: f.first,
        count: f.count,
        flags: 0,
        module: 0,
        page_base: f.page_base,
        pages: f.pages,
    })
}

/// The process `tgid` ended (its leader exited): its entry goes now, so a pid reused later
/// never finds it, and userspace's own delete (for an entry it may have written after this)
/// finds nothing to free.
#[inline(always)]
pub fn forget_walker(tgid: u32) {
    let _ = FORKED_FROM.remove(&tgid);
    let _ = UNWIND_EARLY.remove(&tgid);
    if UNWIND_PROCS.remove(&tgid).is_ok() {
        count(counter::WALKER_EXIT_DELETES);
    }
}

/// `tgid` exec'd: its entry (or its parent's, which it walked with) describes the old image.
/// Its own is emptied in place (userspace rewrites it soon, and a delete and a new 12 KiB
/// element would cost more), so no walk uses stale mappings meanwhile.
#[inline(always)]
pub fn clear_walker(tgid: u32) {
    let _ = FORKED_FROM.remove(&tgid);
    // The new image's mappings are numbered from 1 again.
    let _ = UNWIND_EARLY.remove(&tgid);
    if let Some(p) = UNWIND_PROCS.get_ptr_mut(&tgid) {
        // SAFETY: a map value pointer, valid for the program's run; the walker reads `count`
        // first and only entries below it.
        unsafe {
            (*p).count = 0;
            (*p).early_seen = 0;
        }
        count(counter::WALKER_EXEC_CLEARS);
    }
}

/// Slot of `UNWIND_STATE` per walker, so the sampler and the off-CPU tracker never share one.
pub const SLOT_SAMPLER: u32 = 0;
pub const SLOT_OFF_CPU: u32 = 1;
pub const SLOT_USDT: u32 = 2;

/// A walk in progress (registers of the frame being unwound) and its output.
#[repr(C)]
pub struct WalkState {
    pc: u64,
    sp: u64,
    bp: u64,
    tgid: u32,
    n: u32,
    end: u32,
    /// `SAMPLE_UNWIND_USED_FP`.
    flags: u32,
    /// 0 once rbp's value is unknown (a frame whose rbp rule the table cannot express).
    bp_known: u32,
    /// `pc` is a return address (look up `pc - 1`, the call) rather than an interrupted PC.
    pc_is_return: u32,
    /// Index of the mapping the last frame was in: callers are mostly in the same file.
    last_mapping: u32,
    _pad: u32,
    /// User stack address `win` was copied from (0: empty), see `read_stack`.
    win_base: u64,
    win: [u64; STACK_WINDOW_WORDS],
    frames: [u64; MAX_STACK_DEPTH],
}

/// Words of user stack a walk copies at a time (a power of two).
const STACK_WINDOW_WORDS: usize = 64;

#[map]
static UNWIND_STATE: PerCpuArray<WalkState> = PerCpuArray::with_max_entries(3, 0);

/// What [`walk`] found.
pub struct Walked {
    pub kernel_frames: u16,
    pub user_frames: u16,
    /// `SAMPLE_KERNEL_STACK_ERROR` / `SAMPLE_USER_STACK_ERROR` for a walk that failed, plus
    /// the table walk's end (`UNWIND_END_* << SAMPLE_UNWIND_SHIFT`, `SAMPLE_UNWIND_USED_FP`).
    pub errors: u32,
}

impl Walked {
    /// How the user stack's table walk ended (`UNWIND_END_*`; `UNWIND_END_NONE` without one).
    #[inline(always)]
    pub fn user_end(&self) -> u32 {
        (self.errors & SAMPLE_UNWIND_MASK) >> SAMPLE_UNWIND_SHIFT
    }
}

/// Writes the kernel stack (skipping its innermost `skip` frames) to `frames`, then the user
/// stack after it. `user_regs`: the registers the event interrupted, when they are user
/// registers (a perf sample in user mode); otherwise the task's saved user registers
/// (`task_pt_regs`) are used, so syscall-time stacks still get the thread's user stack.
///
/// # Safety
/// `frames` must have room for `2 * MAX_STACK_DEPTH` entries.
#[inline(always)]
pub unsafe fn walk<C: EbpfContext>(
    ctx: &C,
    frames: *mut u64,
    skip: u64,
    user_regs: Option<UserRegs>,
    slot: u32,
) -> Walked {
    const STACK_BYTES: u32 = (MAX_STACK_DEPTH * 8) as u32;
    let mut errors = 0;
    let kret = unsafe { bpf_get_stack(ctx.as_ptr(), frames.cast(), STACK_BYTES, skip) };
    let mut kframes: u64 = 0;
    if kret < 0 {
        errors |= SAMPLE_KERNEL_STACK_ERROR;
    } else {
        kframes = (kret as u64) / 8;
    }
    // Bound for the verifier: the user stack goes right after the kernel frames.
    if kframes > MAX_STACK_DEPTH as u64 {
        kframes = MAX_STACK_DEPTH as u64;
    }
    let user = unsafe { frames.add(kframes as usize) };
    let cfg = config();
    let mut uframes: u64 = 0;
    if cfg.unwind_mode != UNWIND_MODE_FP {
        let (n, end, flags) = unsafe { walk_tables(user, user_regs, slot) };
        uframes = n;
        errors |= (end << SAMPLE_UNWIND_SHIFT) | flags;
    } else {
        let uret = unsafe {
            bpf_get_stack(ctx.as_ptr(), user.cast(), STACK_BYTES, BPF_F_USER_STACK as u64)
        };
        if uret < 0 {
            errors |= SAMPLE_USER_STACK_ERROR;
        } else {
            uframes = (uret as u64) / 8;
        }
    }
    if uframes > MAX_STACK_DEPTH as u64 {
        uframes = MAX_STACK_DEPTH as u64;
    }
    Walked { kernel_frames: kframes as u16, user_frames: uframes as u16, errors }
}

/// The table walk of the current task's user stack into `out` (room for `MAX_STACK_DEPTH`):
/// (frames, `UNWIND_END_*`, flags). The sampler's walks are counted (one counter each).
#[inline(always)]
pub unsafe fn walk_tables(
    out: *mut u64,
    user_regs: Option<UserRegs>,
    slot: u32,
) -> (u64, u32, u32) {
    let r = unsafe { walk_tables_uncounted(out, user_regs, slot) };
    if slot == SLOT_SAMPLER {
        if let Some(c) = counter::unwind_end(r.1) {
            count(c);
        }
        if r.2 & SAMPLE_UNWIND_USED_FP != 0 {
            count(counter::UNWIND_USED_FP);
        }
    }
    r
}

#[inline(always)]
unsafe fn walk_tables_uncounted(
    out: *mut u64,
    user_regs: Option<UserRegs>,
    slot: u32,
) -> (u64, u32, u32) {
    let cfg = config();
    // SAFETY: returns the current task pointer.
    let task = unsafe { bpf_get_current_task() };
    // Kernel threads have no user stack.
    let mm = unsafe { crate::read_kernel_u64(task + cfg.task_mm as u64) }.unwrap_or(0);
    if mm == 0 {
        return (0, UNWIND_END_NONE, 0);
    }
    let UserRegs { pc, sp, bp } = match user_regs {
        Some(r) => r,
        None => {
            // SAFETY: the helper returns the current task's saved user registers; the reads
            // are fault-checked.
            let (pc, sp, bp) = unsafe {
                let regs = bpf_task_pt_regs(bpf_get_current_task_btf()) as *const pt_regs;
                (
                    bpf_probe_read_kernel(core::ptr::addr_of!((*regs).rip)),
                    bpf_probe_read_kernel(core::ptr::addr_of!((*regs).rsp)),
                    bpf_probe_read_kernel(core::ptr::addr_of!((*regs).rbp)),
                )
            };
            let (Ok(pc), Ok(sp), Ok(bp)) = (pc, sp, bp) else {
                return finish(0, UNWIND_END_READ_FAULT, 0);
            };
            UserRegs { pc, sp, bp }
        }
    };
    let Some(st) = UNWIND_STATE.get_ptr_mut(slot) else {
        return finish(0, UNWIND_END_READ_FAULT, 0);
    };
    // SAFETY: this CPU's state slot of this walker; BPF programs on one CPU do not nest
    // within one walker.
    let st = unsafe { &mut *st };
    st.pc = pc;
    st.sp = sp;
    st.bp = bp;
    st.tgid = (aya_ebpf::helpers::bpf_get_current_pid_tgid() >> 32) as u32;
    st.n = 0;
    st.end = UNWIND_END_DEPTH;
    st.flags = 0;
    st.bp_known = 1;
    st.pc_is_return = 0;
    st.last_mapping = 0;
    st.win_base = 0;
    let Some((proc_, early, seen)) = walker_entry(st.tgid) else {
        // The leaf alone still says where the sample was (and is where a stack copy
        // resumes the walk).
        // SAFETY: `out` has room for MAX_STACK_DEPTH frames.
        unsafe { *out = pc };
        return finish(1, UNWIND_END_NO_PROCESS, 0);
    };
    let mut step_ctx = StepCtx { slot, seen, proc_, early };
    run_loop(MAX_STACK_DEPTH as u32, step, &mut step_ctx);
    let n = if st.n as usize > MAX_STACK_DEPTH { MAX_STACK_DEPTH } else { st.n as usize };
    if n > 0 {
        // SAFETY: `out` has room for MAX_STACK_DEPTH frames; `n` is bounded by it.
        let dst = unsafe { core::slice::from_raw_parts_mut(out.cast::<u8>(), n * 8) };
        let _ =
            unsafe { aya_ebpf::helpers::bpf_probe_read_kernel_buf(st.frames.as_ptr().cast(), dst) };
    }
    let end = st.end;
    let flags = st.flags;
    finish(n as u64, end, flags)
}

/// Whether a walk that ended with `end` stopped for want of a table, which userspace can make
/// up for from a copy of the stack (the process or file is newer than its tables).
#[inline(always)]
pub fn wants_copy(end: u32) -> bool {
    end == UNWIND_END_NO_PROCESS || end == UNWIND_END_NO_MAPPING || end == UNWIND_END_NO_TABLE
}

/// Where the last table walk of `slot` stopped: the registers of its last frame. Only
/// meaningful right after a walk whose end [`wants_copy`] (its state was set up).
#[inline(always)]
pub fn stopped_at(slot: u32) -> Option<StackCopyHeader> {
    let st = UNWIND_STATE.get_ptr(slot)?;
    // SAFETY: this CPU's slot, written by the walk that just ran on this CPU.
    let st = unsafe { &*st };
    let mut flags = 0;
    if st.bp_known != 0 {
        flags |= STACK_COPY_BP_KNOWN;
    }
    if st.pc_is_return != 0 {
        flags |= STACK_COPY_PC_IS_RETURN;
    }
    Some(StackCopyHeader { pc: st.pc, sp: st.sp, bp: st.bp, len: 0, flags })
}

/// Copies the user stack from `sp` up into `dst` (room for `STACK_COPY_MAX` bytes): as much
/// as can be read, up to `STACK_COPY_MAX`. A read is all or nothing and fails at the stack's
/// top (or any hole), so shorter reads ending at page boundaries are tried in turn. Returns
/// the bytes copied (0: nothing readable).
///
/// # Safety
/// `dst` must point to `STACK_COPY_MAX` writable bytes of a map value.
#[inline(always)]
pub unsafe fn copy_stack(dst: *mut u8, sp: u64) -> u32 {
    const MAX: u64 = STACK_COPY_MAX as u64;
    // A main thread's stack ends at its argument strings (the frames are below them), so up to
    // there is what a walk can need and all of it is mapped; a copy cut at a page boundary
    // instead misses the callers of `main` in a process that just started.
    let cfg = config();
    // SAFETY: fault-checked kernel reads of the current task's mm.
    let top = unsafe {
        crate::read_kernel_u64(bpf_get_current_task() + cfg.task_mm as u64)
            .and_then(|mm| crate::read_kernel_u64(mm + cfg.mm_arg_start as u64))
    };
    if let Some(top) = top
        && top > sp
    {
        let len = top - sp;
        if len <= MAX {
            let len = len & (2 * MAX - 1);
            // SAFETY: fault-checked read of `len <= STACK_COPY_MAX` bytes of user memory.
            let ret = unsafe {
                aya_ebpf::helpers::generated::bpf_probe_read_user(
                    dst.cast(),
                    len as u32,
                    sp as *const core::ffi::c_void,
                )
            };
            if ret == 0 && len > 0 {
                return len as u32;
            }
        }
    }
    for span in [MAX, MAX / 2, MAX / 4, 4096] {
        let mut len = (sp.wrapping_add(span) & !4095).wrapping_sub(sp);
        if span == 4096 {
            // The rest of rsp's own page.
            len = (sp | 4095).wrapping_add(1).wrapping_sub(sp);
        }
        // Bounds for the verifier.
        len &= 2 * MAX - 1;
        if len == 0 || len > MAX {
            continue;
        }
        // SAFETY: fault-checked read of user memory into `len <= STACK_COPY_MAX` bytes.
        let ret = unsafe {
            aya_ebpf::helpers::generated::bpf_probe_read_user(
                dst.cast(),
                len as u32,
                sp as *const core::ffi::c_void,
            )
        };
        if ret == 0 {
            return len as u32;
        }
    }
    0
}

#[inline(always)]
fn finish(n: u64, end: u32, flags: u32) -> (u64, u32, u32) {
    (n, end, flags)
}

/// What each step of a walk needs: its state's slot and the process's mappings, looked up
/// once per walk rather than once per frame (a hash lookup was a good part of a step). The
/// entry stays valid while the program runs (RCU), even if userspace replaces it meanwhile.
#[repr(C)]
struct StepCtx {
    slot: u32,
    /// Early mappings numbered up to this are in `proc_`.
    seen: u32,
    proc_: *const UnwindProcess,
    /// Null when the process has no early mapping after `seen`.
    early: *const UnwindEarly,
}

/// `bpf_loop` callback: records the current frame and unwinds one step. 0 continues, 1 stops.
#[inline(never)]
extern "C" fn step(_index: u64, ctx: *mut core::ffi::c_void) -> i64 {
    // SAFETY: `ctx` is the caller's `StepCtx`, whose `proc_` is a map value (non-null).
    let (slot, proc_, early, seen) = unsafe {
        let c = &*(ctx as *const StepCtx);
        (c.slot, &*c.proc_, c.early.as_ref(), c.seen)
    };
    let Some(st) = UNWIND_STATE.get_ptr_mut(slot) else { return 1 };
    // SAFETY: see `walk_tables`.
    let st = unsafe { &mut *st };
    let i = st.n as usize;
    if i >= MAX_STACK_DEPTH {
        st.end = UNWIND_END_DEPTH;
        return 1;
    }
    st.frames[i] = st.pc;
    st.n += 1;
    match unsafe { unwind_one(st, proc_, early, seen) } {
        Ok(()) => 0,
        Err(end) => {
            st.end = end;
            1
        }
    }
}

/// Moves `st` from its frame to the caller's; Err(`UNWIND_END_*`) when the walk ends.
#[inline(always)]
unsafe fn unwind_one(
    st: &mut WalkState,
    proc_: &UnwindProcess,
    early: Option<&UnwindEarly>,
    seen: u32,
) -> Result<(), u32> {
    let addr = if st.pc_is_return != 0 { st.pc.wrapping_sub(1) } else { st.pc };
    let found_early = early.and_then(|e| early_mapping(e, seen, addr));
    let m = match &found_early {
        Some(m) => m,
        None => match find_mapping(proc_, addr, &mut st.last_mapping) {
            Some(m) => m,
            None => return Err(UNWIND_END_NO_MAPPING),
        },
    };
    if m.count == 0 {
        if m.flags & UNWIND_MAPPING_PY_TRAMPOLINES != 0 {
            return unsafe { py_trampoline_step(st) };
        }
        let unloaded = m.flags & UNWIND_MAPPING_NOT_LOADED != 0;
        // A table not loaded yet ends the walk even with the frame-pointer fallback: the
        // sample (or off-CPU switch-out) then carries a stack copy that userspace walks with
        // the table. Frame pointers through code built without them would skip callers and
        // present a stack the thread never had.
        let fp = !unloaded && crate::config_field!(unwind_mode) == UNWIND_MODE_DWARF_FP;
        if fp {
            return unsafe { frame_pointer_step(st) };
        }
        return Err(if m.flags & UNWIND_MAPPING_NOT_LOADED != 0 {
            UNWIND_END_NO_TABLE
        } else if m.flags & UNWIND_MAPPING_NO_CFI != 0 {
            UNWIND_END_NO_CFI
        } else {
            UNWIND_END_NO_TABLE
        });
    }
    let file_addr = addr.wrapping_sub(m.bias);
    if file_addr > u32::MAX as u64 {
        return Err(UNWIND_END_NO_CFI);
    }
    let Some(row) = find_row(m, file_addr as u32) else {
        if crate::config_field!(unwind_mode) == UNWIND_MODE_DWARF_FP {
            return unsafe { frame_pointer_step(st) };
        }
        return Err(UNWIND_END_NO_CFI);
    };
    let cfa = match row.cfa_kind() {
        UNWIND_CFA_RSP => st.sp.wrapping_add(row.cfa_offset as u64),
        UNWIND_CFA_RSP_LARGE => st.sp.wrapping_add(row.large_cfa_offset()),
        UNWIND_CFA_RBP => {
            if st.bp_known == 0 {
                return Err(UNWIND_END_UNSUPPORTED);
            }
            st.bp.wrapping_add(row.cfa_offset as u64)
        }
        UNWIND_CFA_PLT => {
            let extra = if (st.pc & 15) as i64 >= row.aux as i64 { 8 } else { 0 };
            st.sp.wrapping_add(row.cfa_offset as u64 + extra)
        }
        UNWIND_CFA_END => return Err(UNWIND_END_COMPLETE),
        UNWIND_CFA_SIGNAL => return unsafe { signal_step(st) },
        UNWIND_CFA_NONE => {
            if crate::config_field!(unwind_mode) == UNWIND_MODE_DWARF_FP {
                return unsafe { frame_pointer_step(st) };
            }
            return Err(UNWIND_END_NO_CFI);
        }
        _ => return Err(UNWIND_END_UNSUPPORTED),
    };
    let ra = read_stack(st, cfa.wrapping_sub(8))?;
    match row.rbp_kind() {
        UNWIND_RBP_CFA_OFFSET => {
            st.bp = read_stack(st, cfa.wrapping_add(row.rbp_offset() as u64))?;
            st.bp_known = 1;
        }
        UNWIND_RBP_UNSUPPORTED => st.bp_known = 0,
        _ => {}
    }
    if ra == 0 {
        return Err(UNWIND_END_COMPLETE);
    }
    st.pc = ra;
    st.sp = cfa;
    st.pc_is_return = 1;
    Ok(())
}

/// A CPython perf trampoline (see `UNWIND_MAPPING_PY_TRAMPOLINES`) that called the frame
/// below: CFA = rsp + 16, the return address just under it, rbp untouched. Sampled in the
/// trampoline itself (a leaf at one of its four instructions) the rule depends on the
/// instruction, which the arena does not tell: that ends the walk as unsupported.
#[inline(always)]
unsafe fn py_trampoline_step(st: &mut WalkState) -> Result<(), u32> {
    if st.pc_is_return == 0 {
        return Err(UNWIND_END_UNSUPPORTED);
    }
    let cfa = st.sp.wrapping_add(16);
    let ra = read_stack(st, cfa.wrapping_sub(8))?;
    if ra == 0 {
        return Err(UNWIND_END_NO_CFI);
    }
    st.pc = ra;
    st.sp = cfa;
    Ok(())
}

/// Code without a table (`UNWIND_MODE_DWARF_FP`): the caller's frame by the rbp chain.
#[inline(always)]
unsafe fn frame_pointer_step(st: &mut WalkState) -> Result<(), u32> {
    st.flags |= SAMPLE_UNWIND_USED_FP;
    // An rbp below the stack pointer is no frame pointer of this stack.
    if st.bp_known == 0 || st.bp < st.sp || st.bp == 0 {
        return Err(UNWIND_END_FRAME_POINTER);
    }
    let bp = st.bp;
    let Ok(ra) = read_stack(st, bp.wrapping_add(8)) else {
        return Err(UNWIND_END_FRAME_POINTER);
    };
    let Ok(next_bp) = read_stack(st, bp) else { return Err(UNWIND_END_FRAME_POINTER) };
    if ra == 0 {
        return Err(UNWIND_END_FRAME_POINTER);
    }
    st.pc = ra;
    st.sp = st.bp.wrapping_add(16);
    st.bp = next_bp;
    st.pc_is_return = 1;
    Ok(())
}

/// A signal trampoline (`__restore_rt`): rsp points at the `ucontext` the kernel pushed; the
/// interrupted rip/rsp/rbp are in its `sigcontext` (x86-64 layout: `uc_mcontext` at 40; rbp,
/// rsp, rip at 0x78, 0xa0, 0xa8 of the ucontext).
#[inline(always)]
unsafe fn signal_step(st: &mut WalkState) -> Result<(), u32> {
    let uc = st.sp;
    st.bp = read_user(uc + 0x78)?;
    st.sp = read_user(uc + 0xa0)?;
    st.pc = read_user(uc + 0xa8)?;
    st.bp_known = 1;
    // The interrupted instruction itself, not a return address.
    st.pc_is_return = 0;
    Ok(())
}

/// A word of the user stack, served from `st`'s window when it holds it: a walk reads a word
/// or two per frame, upwards through the stack, and one helper call copying a window costs
/// about what one copying a word does (the fault-checked user access is the cost).
#[inline(always)]
fn read_stack(st: &mut WalkState, addr: u64) -> Result<u64, u32> {
    if addr & 7 != 0 {
        return read_user(addr);
    }
    let idx = addr.wrapping_sub(st.win_base) >> 3;
    if st.win_base != 0 && idx < STACK_WINDOW_WORDS as u64 {
        return Ok(st.win[idx as usize & (STACK_WINDOW_WORDS - 1)]);
    }
    // SAFETY: fault-checked read of user memory into the window (a map value).
    let ret = unsafe {
        aya_ebpf::helpers::generated::bpf_probe_read_user(
            st.win.as_mut_ptr().cast(),
            (STACK_WINDOW_WORDS * 8) as u32,
            addr as *const core::ffi::c_void,
        )
    };
    if ret == 0 {
        st.win_base = addr;
        return Ok(st.win[0]);
    }
    // The window ran past the end of the stack's mapping: word by word from here.
    st.win_base = 0;
    read_user(addr)
}

#[inline(always)]
fn read_user(addr: u64) -> Result<u64, u32> {
    // SAFETY: fault-checked read of user memory.
    unsafe { bpf_probe_read_user(addr as *const u64) }.map_err(|_| UNWIND_END_READ_FAULT)
}

/// The mapping of `proc_` holding `addr`: the one at `*last` if it holds it, else a binary
/// search over its sorted mappings (`*last` then becomes the one found).
#[inline(always)]
fn find_mapping<'p>(
    proc_: &'p UnwindProcess,
    addr: u64,
    last: &mut u32,
) -> Option<&'p UnwindMapping> {
    const MASK: usize = UNWIND_MAX_MAPPINGS - 1;
    let count = proc_.count as usize;
    if count == 0 || count > UNWIND_MAX_MAPPINGS {
        return None;
    }
    let cached = &proc_.mappings[*last as usize & MASK];
    if (*last as usize) < count && cached.start <= addr && addr < cached.end {
        return Some(cached);
    }
    // Last mapping with start <= addr, in [lo, lo + n).
    let (mut lo, mut n) = (0usize, count);
    for _ in 0..9 {
        if n <= 1 {
            break;
        }
        let half = n / 2;
        let mid = (lo + half) & MASK;
        if proc_.mappings[mid].start <= addr {
            lo = mid;
            n -= half;
        } else {
            n = half;
        }
    }
    let m = &proc_.mappings[lo & MASK];
    *last = (lo & MASK) as u32;
    (m.start <= addr && addr < m.end).then_some(m)
}

/// The row of `m`'s table covering `addr` (the last with `pc <= addr`), if it is not a gap
/// (`UNWIND_CFA_NONE` is returned as a row; the caller tells it apart). The page index
/// narrows the search to the rows of `addr`'s page (see `UNWIND_PAGE_SHIFT`).
#[inline(always)]
fn find_row(m: &UnwindMapping, addr: u32) -> Option<UnwindRow> {
    let (first, count) = (m.first, m.count);
    let page = addr >> UNWIND_PAGE_SHIFT;
    if page < m.page_base {
        return None;
    }
    // Past the last page the last row is in force: its page's search finds it.
    let p = (page - m.page_base).min(m.pages.wrapping_sub(1));
    // Rows `lo..=hi` hold the answer: the one in force at the page's start up to the one in
    // force at the next page's start (the index ends with an entry holding the last row).
    let index = first.wrapping_add(count).wrapping_add(p);
    let mut lo = UNWIND_ROWS.get(index)?.pc;
    let hi = UNWIND_ROWS.get(index.wrapping_add(1))?.pc;
    let mut n = hi.wrapping_sub(lo).wrapping_add(1);
    for _ in 0..UNWIND_PAGE_STEPS {
        if n <= 1 {
            break;
        }
        let half = n / 2;
        let mid = lo.wrapping_add(half);
        let row = UNWIND_ROWS.get(first.wrapping_add(mid))?;
        if row.pc <= addr {
            lo = mid;
            n -= half;
        } else {
            n = half;
        }
    }
    let row = *UNWIND_ROWS.get(first.wrapping_add(lo))?;
    (row.pc <= addr).then_some(row)
}

/// The registers a user stack walk starts from.
#[derive(Clone, Copy)]
pub struct UserRegs {
    pub pc: u64,
    pub sp: u64,
    pub bp: u64,
}

/// The user registers of a perf sample, when it interrupted user mode (CPL 3).
///
/// # Safety
/// `ctx` must be a perf_event program context (`bpf_perf_event_data`, registers first).
#[inline(always)]
pub unsafe fn perf_user_regs(ctx: *mut core::ffi::c_void) -> Option<UserRegs> {
    let regs = ctx as *const pt_regs;
    // SAFETY: the context starts with the interrupted registers, read directly (ctx access).
    unsafe {
        if (*regs).cs & 3 != 3 {
            return None;
        }
        Some(UserRegs { pc: (*regs).rip, sp: (*regs).rsp, bp: (*regs).rbp })
    }
}
