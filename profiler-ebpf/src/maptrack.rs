//! Executable mappings from the kernel, so userspace knows every address space without reading
//! /proc/PID/maps, also for a process that exited before its samples were drained.
//!
//! Where to hook: the probes this needs must load on every kernel we run on, including hosts
//! without kprobes (CONFIG_KPROBES=n) and where BPF trampolines (fentry/fexit, tp_btf) are
//! refused, as on the test machine; tracepoints always load. So:
//! - mmap(2) with PROT_EXEC: `syscalls:sys_enter_mmap` keeps the arguments per thread,
//!   `syscalls:sys_exit_mmap` sends the mapping at the address the kernel chose, with the
//!   file (looked up from the fd, which the new mapping now holds) — identity and path. The
//!   dynamic loader maps every library this way.
//! - munmap(2): `syscalls:sys_enter_munmap` sends the range (no PROT filter possible there;
//!   userspace cuts whatever executable mapping it knows in it).
//! - exec: the ELF loader maps the executable and the interpreter in the kernel, not through
//!   mmap(2); the exec tracepoint (main.rs) sends them from the new mm: the executable's code
//!   range (`start_code..end_code`) and file, and the interpreter's load base (`AT_BASE`).
//!
//! - mprotect(2) and mremap(2) of code: the syscall's arguments say only a range, so
//!   `sys_exit_mprotect`/`sys_exit_mremap` look up the mappings now there with `bpf_find_vma`
//!   (5.17+) and send each executable piece in the range as a mapping (file and offset from
//!   the VMA), and the pieces no longer executable, or the range mremap moved away from, as
//!   removals. Entry checks whether the range held code, so the many mprotect/mremap calls
//!   of ordinary data (malloc) send nothing. Where the helper is missing these programs do
//!   not load; the rest works without them. The two VMA walks (entry's check, exit's send)
//!   are programs of their own that the hooks tail-call: the verifier then goes through each
//!   walk once, not once per hook (in the hooks it took about 300 ms, most of start-up).
//!
//! All run in the task making the change, before it can execute code at the new address, and
//! write to the same ring buffer as the samples, whose records are ordered by reservation
//! across CPUs: a mapping record always precedes the samples that depend on it.

use aya_ebpf::{
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns,
        generated::{
            bpf_find_vma, bpf_get_current_task, bpf_get_current_task_btf, bpf_get_smp_processor_id,
            bpf_probe_read_kernel_str,
        },
    },
    macros::{map, tracepoint},
    maps::{HashMap, LruHashMap, PerCpuArray, ProgramArray},
    programs::TracePointContext,
};
use profiler_common::{
    Config, EVENT_MMAP, EVENT_MUNMAP, EventHeader, FileKey, MAP_ANON, MAP_EXE_TEXT, MAP_INTERP,
    MAP_NAME_MAX, MAP_PATH_COMPLETE, MAP_PATH_DEPTH, MAP_PATH_MAX, MAP_RECORD_FIXED, MapRecord,
    PendingMmap, PendingRange,
    code_range::{CHECK_CODE_RANGE, SEND_CODE_RANGE},
    counter,
};

use crate::{
    cgroup, config, config_field, count, output, read_kernel_u32, read_kernel_u64, run_loop,
    selected, stack,
};

const PROT_EXEC: u64 = 0x4;
const MAP_ANONYMOUS: u64 = 0x20;
const PAGE_SIZE: u64 = 4096;
const AT_BASE: u64 = 7;
/// Auxiliary vector entries looked at for `AT_BASE` (the kernel puts it ninth).
const AUXV_SCAN: u64 = 24;

// Field offsets of the syscall tracepoints' records (their format files are stable ABI).
const TP_ENTER_ARG0: usize = 16;
const TP_EXIT_RET: usize = 16;

#[map]
static MAP_SCRATCH: PerCpuArray<MapRecord> = PerCpuArray::with_max_entries(1, 0);

/// Executable mmap(2) calls between entry and exit, by thread.
#[map]
static MMAP_PENDING: HashMap<u32, PendingMmap> = HashMap::with_max_entries(8192, 0);

/// mprotect(2)/mremap(2) calls on code between entry and exit, by thread.
#[map]
static RANGE_PENDING: HashMap<u32, PendingRange> = HashMap::with_max_entries(8192, 0);

/// The shared VMA walks the mprotect/mremap hooks tail-call (userspace fills the slots before
/// it attaches the hooks).
#[map]
static CODE_RANGE_PROGS: ProgramArray = ProgramArray::with_max_entries(2, 0);

/// A hook's arguments for the walk it tail-calls. Per CPU: syscall tracepoint programs do not
/// nest on a CPU (the kernel skips one that would), so nothing runs between the hook's write
/// and the walk's read.
#[repr(C)]
#[derive(Clone, Copy)]
struct RangeArgs {
    start: u64,
    end: u64,
    /// check: keep `pending` even if the range holds no code (mprotect adding PROT_EXEC);
    /// send: also send the pieces that are not code as removals.
    flag: u64,
    /// check: what to keep for the exit, `was_exec` filled in by the walk.
    pending: PendingRange,
}

#[map]
static RANGE_ARGS: PerCpuArray<RangeArgs> = PerCpuArray::with_max_entries(1, 0);

/// Hands `args` to the walk in `slot`; returns only if the tail call failed (a slot not
/// filled: counted as a range not read).
#[inline(always)]
fn tail_call_walk(ctx: &TracePointContext, slot: u32, args: RangeArgs) {
    if let Some(a) = RANGE_ARGS.get_ptr_mut(0) {
        // SAFETY: per-CPU slot, see `RangeArgs`.
        unsafe {
            *a = args;
            CODE_RANGE_PROGS.tail_call(ctx, slot);
        }
    }
    count(counter::MAP_VMA_UNREAD);
}

/// The arguments a hook left for this walk.
#[inline(always)]
fn walk_args() -> Option<RangeArgs> {
    // SAFETY: copied out of the per-CPU slot.
    RANGE_ARGS.get(0).copied()
}

/// Tail-called at mprotect/mremap entry: keeps the call for its exit when its range holds
/// code (or `flag` says keep it anyway).
#[tracepoint]
pub fn check_code_range(_ctx: TracePointContext) -> u32 {
    let Some(a) = walk_args() else { return 0 };
    let was_exec = range_has_code(a.start, a.end);
    if a.flag != 0 || was_exec {
        keep_pending(&PendingRange { was_exec: was_exec as u64, ..a.pending });
    }
    0
}

/// Tail-called at mprotect/mremap exit: sends what the range now holds.
#[tracepoint]
pub fn send_code_range(_ctx: TracePointContext) -> u32 {
    if let Some(a) = walk_args() {
        send_range(a.start, a.end, a.flag);
    }
    0
}

/// The current task's (tgid, tid, mm) when the filters select it.
#[inline(always)]
fn current_selected(cfg: &Config) -> Option<(u32, u32, u64)> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if tgid == 0 || !selected(cfg, tgid) || !cgroup::selected() {
        return None;
    }
    let task = unsafe { bpf_get_current_task() };
    let mm = unsafe { read_kernel_u64(task + cfg.task_mm as u64) }?;
    Some((tgid, pid_tgid as u32, mm))
}

#[inline(always)]
unsafe fn start_record(kind: u32, tgid: u32, tid: u32, mm: u64) -> Option<*mut MapRecord> {
    let rec = MAP_SCRATCH.get_ptr_mut(0)?;
    unsafe {
        (*rec).header = EventHeader {
            kind,
            cpu: bpf_get_smp_processor_id(),
            time_ns: bpf_ktime_get_ns(),
            pid: tgid,
            tid,
        };
        (*rec).mm = mm;
        (*rec).start = 0;
        (*rec).len = 0;
        (*rec).offset = 0;
        (*rec).inode = 0;
        (*rec).dev = 0;
        (*rec).flags = 0;
        (*rec).path_len = 0;
        (*rec).early_seq = 0;
    }
    Some(rec)
}

#[inline(always)]
unsafe fn send(rec: *mut MapRecord, len: u64, wake: bool) {
    // No wakeup unless the unwinder waits for it: the record carries all userspace needs (no
    // /proc lookup racing the process's exit).
    if unsafe { output(rec, len, wake) } {
        count(counter::MAP_EVENTS_SENT);
    } else {
        count(counter::MAP_EVENTS_LOST);
    }
}

/// Fills in `file`'s identity and path and sends the record.
#[inline(always)]
unsafe fn send_file(cfg: &Config, rec: *mut MapRecord, file: u64) {
    unsafe {
        if let Some(inode) = read_kernel_u64(file + cfg.file_inode as u64) {
            (*rec).inode = read_kernel_u64(inode + cfg.inode_ino as u64).unwrap_or(0);
            if let Some(sb) = read_kernel_u64(inode + cfg.inode_sb as u64) {
                (*rec).dev = read_kernel_u32(sb + cfg.sb_dev as u64).unwrap_or(0);
            }
            let key = FileKey { inode: (*rec).inode, dev: (*rec).dev, _pad: 0 };
            let kind = (*rec).flags & (MAP_EXE_TEXT | MAP_INTERP);
            let (tgid, start, len, offset) =
                ((*rec).header.pid, (*rec).start, (*rec).len, (*rec).offset);
            (*rec).early_seq = stack::early_mapped(tgid, key, inode, start, len, offset, kind);
        }
        if (*rec).flags & MAP_INTERP == 0 {
            let exe_text = (*rec).flags & MAP_EXE_TEXT != 0;
            let (tgid, (start, offset)) = ((*rec).header.pid, ((*rec).start, (*rec).offset));
            crate::python::file_mapped(tgid, (*rec).dev, (*rec).inode, start, offset, exe_text);
        }
        let (len, complete) = walk_path(cfg, file);
        (*rec).path_len = len as u32;
        if complete {
            (*rec).flags |= MAP_PATH_COMPLETE;
        } else {
            count(counter::MAP_PATH_INCOMPLETE);
        }
        send(rec, MAP_RECORD_FIXED as u64 + len, crate::wake_for_unwinder(cfg));
    }
}

/// `struct file *` of the current task's descriptor `fd`.
#[inline(always)]
unsafe fn fd_file(cfg: &Config, fd: u64) -> Option<u64> {
    unsafe {
        let task = bpf_get_current_task();
        let files = read_kernel_u64(task + cfg.task_files as u64)?;
        let fdt = read_kernel_u64(files + cfg.files_fdt as u64)?;
        let max = read_kernel_u32(fdt + cfg.fdtable_max_fds as u64)?;
        if fd >= max as u64 {
            return None;
        }
        let fds = read_kernel_u64(fdt + cfg.fdtable_fd as u64)?;
        let file = read_kernel_u64(fds + fd * 8)?;
        (file != 0).then_some(file)
    }
}

/// `sys_enter_mmap(addr, len, prot, flags, fd, off)`.
#[tracepoint]
pub fn on_enter_mmap(ctx: TracePointContext) -> u32 {
    let arg = |i: usize| unsafe { ctx.read_at::<u64>(TP_ENTER_ARG0 + i * 8) }.unwrap_or(0);
    if arg(2) & PROT_EXEC == 0 {
        return 0;
    }
    let cfg = config();
    let Some((_, tid, _)) = current_selected(&cfg) else { return 0 };
    let pending = PendingMmap { len: arg(1), flags: arg(3), fd: arg(4), off: arg(5) };
    if MMAP_PENDING.insert(&tid, &pending, 0).is_err() {
        count(counter::MAP_EVENTS_LOST);
    }
    0
}

/// `sys_exit_mmap(ret)`: the address of the mapping or `-errno`.
#[tracepoint]
pub fn on_exit_mmap(ctx: TracePointContext) -> u32 {
    let tid = bpf_get_current_pid_tgid() as u32;
    // SAFETY: the value is copied out before the entry is removed.
    let Some(p) = (unsafe { MMAP_PENDING.get(&tid) }).copied() else { return 0 };
    let _ = MMAP_PENDING.remove(&tid);
    let ret: i64 = unsafe { ctx.read_at(TP_EXIT_RET) }.unwrap_or(-1);
    if ret < 0 {
        return 0;
    }
    let cfg = config();
    let Some((tgid, tid, mm)) = current_selected(&cfg) else { return 0 };
    // SAFETY: per-CPU scratch record; kernel reads are fault-checked.
    unsafe {
        let Some(rec) = start_record(EVENT_MMAP, tgid, tid, mm) else { return 0 };
        (*rec).start = ret as u64;
        (*rec).len = (p.len + PAGE_SIZE - 1) & !(PAGE_SIZE - 1);
        if p.flags & MAP_ANONYMOUS != 0 {
            (*rec).flags = MAP_ANON;
            send(rec, MAP_RECORD_FIXED as u64, first_code_of(tgid));
            return 0;
        }
        (*rec).offset = p.off;
        // The mapping holds a reference to the file, so it is alive; the descriptor still
        // names it unless another thread closed it meanwhile (then the path names the file).
        match fd_file(&cfg, p.fd) {
            Some(file) => send_file(&cfg, rec, file),
            None => send(rec, MAP_RECORD_FIXED as u64, false),
        }
    }
    0
}

/// `sys_enter_munmap(addr, len)`.
#[tracepoint]
pub fn on_enter_munmap(ctx: TracePointContext) -> u32 {
    let cfg = config();
    let Some((tgid, tid, mm)) = current_selected(&cfg) else { return 0 };
    // SAFETY: as above.
    unsafe {
        let (Ok(start), Ok(len)) =
            (ctx.read_at::<u64>(TP_ENTER_ARG0), ctx.read_at::<u64>(TP_ENTER_ARG0 + 8))
        else {
            return 0;
        };
        let len = (len + PAGE_SIZE - 1) & !(PAGE_SIZE - 1);
        stack::early_unmapped(tgid, start, start.wrapping_add(len));
        let Some(rec) = start_record(EVENT_MUNMAP, tgid, tid, mm) else { return 0 };
        (*rec).start = start;
        (*rec).len = len;
        send(rec, MAP_RECORD_FIXED as u64, false);
    }
    0
}

/// `VM_EXEC` of `vm_area_struct.vm_flags`.
const VM_EXEC: u64 = 0x4;
/// VMAs looked at per mprotect/mremap range (a range spanning more is cut there; counted).
const VMAS_PER_RANGE: u32 = 8;
const MREMAP_DONTUNMAP: u64 = 4;

/// What `bpf_find_vma`'s callback copies out of the VMA (it is only valid inside it).
#[repr(C)]
struct Vma {
    start: u64,
    end: u64,
    pgoff: u64,
    file: u64,
    flags: u64,
}

/// `bpf_find_vma` callback: copies the fields of `vma`. Fault-checked reads at the loader's
/// offsets (no CO-RE here).
#[inline(never)]
extern "C" fn copy_vma(
    _task: *mut core::ffi::c_void,
    vma: *mut core::ffi::c_void,
    ctx: *mut core::ffi::c_void,
) -> i64 {
    let v = vma as u64;
    let out = ctx.cast::<Vma>();
    let offsets = [
        config_field!(vma_start),
        config_field!(vma_end),
        config_field!(vma_pgoff),
        config_field!(vma_file),
        config_field!(vma_flags),
    ];
    // SAFETY: fault-checked kernel reads.
    let field = |i: usize| unsafe { read_kernel_u64(v + offsets[i] as u64) }.unwrap_or(0);
    // SAFETY: `ctx` is the caller's `Vma` on its stack.
    unsafe {
        (*out).start = field(0);
        (*out).end = field(1);
        (*out).pgoff = field(2);
        (*out).file = field(3);
        (*out).flags = field(4);
    }
    0
}

/// The current task's VMA holding `addr`, if any (`None` also when the lookup failed).
#[inline(always)]
fn find_vma(addr: u64) -> Option<Vma> {
    let mut v = Vma { start: 0, end: 0, pgoff: 0, file: 0, flags: 0 };
    // SAFETY: `copy_vma` is a BPF subprogram with the callback signature; its context is `v`
    // on this stack, which outlives the call.
    let ret = unsafe {
        bpf_find_vma(
            bpf_get_current_task_btf(),
            addr,
            copy_vma as *mut core::ffi::c_void,
            core::ptr::addr_of_mut!(v).cast(),
            0,
        )
    };
    // -ENOENT: nothing mapped at `addr`; anything else (-EBUSY: the mmap lock was taken) is
    // a lookup that failed.
    if ret != 0 && ret != -2 {
        count(counter::MAP_VMA_UNREAD);
    }
    (ret == 0 && v.end > v.start).then_some(v)
}

/// Whether any VMA in `start..end` is executable now (the first `VMAS_PER_RANGE`).
#[inline(always)]
fn range_has_code(start: u64, end: u64) -> bool {
    let mut scan = CodeScan { addr: start, end, found: 0 };
    // Unrolled, the lookups made each entry program 26-52 k instructions for the verifier.
    run_loop(VMAS_PER_RANGE, code_step, &mut scan);
    scan.found != 0
}

/// `range_has_code`'s scan, shared with `code_step` (on its stack).
#[repr(C)]
struct CodeScan {
    addr: u64,
    end: u64,
    found: u64,
}

/// `bpf_loop` callback: one VMA of the scan. 0 continues, 1 stops.
#[inline(never)]
extern "C" fn code_step(_index: u64, ctx: *mut core::ffi::c_void) -> i64 {
    // SAFETY: `ctx` is range_has_code's `CodeScan`.
    let s = unsafe { &mut *(ctx as *mut CodeScan) };
    if s.addr >= s.end {
        return 1;
    }
    let Some(v) = find_vma(s.addr) else { return 1 };
    if v.flags & VM_EXEC != 0 {
        s.found = 1;
        return 1;
    }
    s.addr = v.end;
    0
}

/// Sends what `start..end` of the current task now holds: each executable VMA piece as a
/// mapping (file, identity and offset from the VMA), and, with `drop_other`, every other
/// piece as a removal (code that stopped being code). One file-backed piece per call is sent
/// with its path: each path walk is verified separately, and a walk per loop iteration is
/// past the verifier's limit. Further file pieces in one range (rare: adjacent code of one
/// file is one VMA) are counted in `MAP_VMA_UNREAD`.
#[inline(always)]
fn send_range(start: u64, end: u64, drop_other: u64) {
    let cfg = config();
    let Some((tgid, tid, mm)) = current_selected(&cfg) else { return };
    // What the range held is sent again below, the code pieces added early again.
    stack::early_unmapped(tgid, start, end);
    let Some(slot) = RANGE_WALK.get_ptr_mut(0) else { return };
    // SAFETY: per-CPU slot; these programs do not nest on a CPU (see `RangeArgs`).
    let w = unsafe {
        *slot = RangeWalk {
            addr: start,
            end,
            drop_other,
            mm,
            tgid,
            tid,
            done: 0,
            file: 0,
            file_start: 0,
            file_end: 0,
            file_offset: 0,
        };
        // In a map, not on this stack: the verifier then knows nothing of the walk's fields
        // and checks `range_step` once (about 19 k instructions when it followed their values
        // from one step to the next).
        run_loop(VMAS_PER_RANGE, range_step, &mut 0u32);
        *slot
    };
    if w.done == 0 && w.addr < end {
        count(counter::MAP_VMA_UNREAD);
    }
    if w.file != 0 {
        // SAFETY: per-CPU scratch record; kernel reads are fault-checked.
        unsafe {
            let Some(rec) = start_record(EVENT_MMAP, tgid, tid, mm) else { return };
            (*rec).start = w.file_start;
            (*rec).len = w.file_end - w.file_start;
            (*rec).offset = w.file_offset;
            send_file(&cfg, rec, w.file);
        }
    }
}

/// `send_range`'s walk over the VMAs of its range, shared with `range_step` (in `RANGE_WALK`).
#[repr(C)]
#[derive(Clone, Copy)]
struct RangeWalk {
    addr: u64,
    end: u64,
    drop_other: u64,
    mm: u64,
    tgid: u32,
    tid: u32,
    /// Whether the walk reached the range's end (or unmapped space).
    done: u64,
    /// The first file-backed executable piece (`file` 0: none yet).
    file: u64,
    file_start: u64,
    file_end: u64,
    file_offset: u64,
}

#[map]
static RANGE_WALK: PerCpuArray<RangeWalk> = PerCpuArray::with_max_entries(1, 0);

/// Processes that made anonymous code (JIT) since their exec (value unused; forgotten at exec).
#[map]
static MADE_CODE: LruHashMap<u32, u8> = LruHashMap::with_max_entries(16384, 0);

/// Whether a record of anonymous code should wake userspace: only a process's first, so that
/// what names its JIT code (its perf map, and the walker's rule for CPython's trampolines,
/// which userspace sets from the map) is read within milliseconds, not at the next timed
/// drain a second later. Later ones do not wake: a JIT remaps code all the time.
#[inline(always)]
fn first_code_of(tgid: u32) -> bool {
    if MADE_CODE.get_ptr(&tgid).is_some() {
        return false;
    }
    let _ = MADE_CODE.insert(&tgid, &1, 0);
    crate::wake_for_unwinder(&config())
}

/// A new image: its anonymous code is new.
#[inline(always)]
pub fn forget_code_of(tgid: u32) {
    let _ = MADE_CODE.remove(&tgid);
}

/// `bpf_loop` callback: one VMA of the range. 0 continues, 1 stops.
#[inline(never)]
extern "C" fn range_step(_index: u64, _ctx: *mut core::ffi::c_void) -> i64 {
    let Some(w) = RANGE_WALK.get_ptr_mut(0) else { return 1 };
    // SAFETY: send_range's per-CPU walk.
    let w = unsafe { &mut *w };
    let addr = w.addr;
    if addr >= w.end {
        w.done = 1;
        return 1;
    }
    let Some(v) = find_vma(addr) else {
        w.done = 1;
        return 1;
    };
    let piece_end = if v.end < w.end { v.end } else { w.end };
    let exec = v.flags & VM_EXEC != 0;
    if exec && v.file != 0 {
        if w.file == 0 {
            w.file = v.file;
            w.file_start = addr;
            w.file_end = piece_end;
            w.file_offset = (v.pgoff << 12) + (addr - v.start);
        } else {
            count(counter::MAP_VMA_UNREAD);
        }
    } else if exec || w.drop_other != 0 {
        let (kind, flags) = if exec { (EVENT_MMAP, MAP_ANON) } else { (EVENT_MUNMAP, 0) };
        // SAFETY: per-CPU scratch record.
        unsafe {
            if let Some(rec) = start_record(kind, w.tgid, w.tid, w.mm) {
                (*rec).start = addr;
                (*rec).len = piece_end - addr;
                (*rec).flags = flags;
                send(rec, MAP_RECORD_FIXED as u64, exec && first_code_of(w.tgid));
            }
        }
    }
    w.addr = piece_end;
    0
}

/// Sends a removal of `start..start+len`.
#[inline(always)]
fn send_unmap(start: u64, len: u64) {
    let cfg = config();
    let Some((tgid, tid, mm)) = current_selected(&cfg) else { return };
    let len = (len + PAGE_SIZE - 1) & !(PAGE_SIZE - 1);
    stack::early_unmapped(tgid, start, start.wrapping_add(len));
    // SAFETY: per-CPU scratch record.
    unsafe {
        let Some(rec) = start_record(EVENT_MUNMAP, tgid, tid, mm) else { return };
        (*rec).start = start;
        (*rec).len = len;
        send(rec, MAP_RECORD_FIXED as u64, false);
    }
}

/// Keeps `p` for the syscall's exit.
#[inline(always)]
fn keep_pending(p: &PendingRange) {
    let tid = bpf_get_current_pid_tgid() as u32;
    if RANGE_PENDING.insert(&tid, p, 0).is_err() {
        count(counter::MAP_EVENTS_LOST);
    }
}

/// The arguments kept at entry of this thread's syscall, and its result.
#[inline(always)]
fn take_pending(ctx: &TracePointContext) -> Option<(PendingRange, i64)> {
    let tid = bpf_get_current_pid_tgid() as u32;
    // SAFETY: the value is copied out before the entry is removed.
    let p = unsafe { RANGE_PENDING.get(&tid) }.copied()?;
    let _ = RANGE_PENDING.remove(&tid);
    let ret: i64 = unsafe { ctx.read_at(TP_EXIT_RET) }.unwrap_or(-1);
    Some((p, ret))
}

/// `sys_enter_mprotect(start, len, prot)`: kept when it makes code, or changes a range
/// holding code (which may stop being code).
#[tracepoint]
pub fn on_enter_mprotect(ctx: TracePointContext) -> u32 {
    let arg = |i: usize| unsafe { ctx.read_at::<u64>(TP_ENTER_ARG0 + i * 8) }.unwrap_or(0);
    let (start, len, prot) = (arg(0), arg(1), arg(2));
    let cfg = config();
    if current_selected(&cfg).is_none() {
        return 0;
    }
    let len = (len + PAGE_SIZE - 1) & !(PAGE_SIZE - 1);
    let pending = PendingRange { start, len, new_len: len, was_exec: 0 };
    let flag = (prot & PROT_EXEC != 0) as u64;
    tail_call_walk(&ctx, CHECK_CODE_RANGE, RangeArgs { start, end: start + len, flag, pending });
    0
}

/// `sys_exit_mprotect(ret)`: the range's pieces as they are now.
#[tracepoint]
pub fn on_exit_mprotect(ctx: TracePointContext) -> u32 {
    // A failed mprotect may still have changed part of the range: look either way.
    let Some((p, _)) = take_pending(&ctx) else { return 0 };
    let args = RangeArgs { start: p.start, end: p.start + p.len, flag: p.was_exec, pending: p };
    tail_call_walk(&ctx, SEND_CODE_RANGE, args);
    0
}

/// `sys_enter_mremap(addr, old_len, new_len, flags, new_addr)`: kept when the range holds
/// code.
#[tracepoint]
pub fn on_enter_mremap(ctx: TracePointContext) -> u32 {
    let arg = |i: usize| unsafe { ctx.read_at::<u64>(TP_ENTER_ARG0 + i * 8) }.unwrap_or(0);
    let (start, old_len, new_len, flags) = (arg(0), arg(1), arg(2), arg(3));
    let cfg = config();
    if current_selected(&cfg).is_none() {
        return 0;
    }
    let old_len = (old_len + PAGE_SIZE - 1) & !(PAGE_SIZE - 1);
    // old_len 0 duplicates a shared mapping, MREMAP_DONTUNMAP leaves the old range mapped
    // (as empty anonymous memory): the old range is then not removed.
    let keep_old = old_len == 0 || flags & MREMAP_DONTUNMAP != 0;
    let len = if keep_old { 0 } else { old_len };
    let pending = PendingRange { start, len, new_len, was_exec: 0 };
    let end = start + if old_len == 0 { PAGE_SIZE } else { old_len };
    tail_call_walk(&ctx, CHECK_CODE_RANGE, RangeArgs { start, end, flag: 0, pending });
    0
}

/// `sys_exit_mremap(ret)`: the new address, or `-errno` (then nothing moved).
#[tracepoint]
pub fn on_exit_mremap(ctx: TracePointContext) -> u32 {
    let Some((p, ret)) = take_pending(&ctx) else { return 0 };
    if ret < 0 {
        return 0;
    }
    if p.len != 0 {
        send_unmap(p.start, p.len);
    }
    let new_len = (p.new_len + PAGE_SIZE - 1) & !(PAGE_SIZE - 1);
    let (start, end) = (ret as u64, ret as u64 + new_len);
    tail_call_walk(&ctx, SEND_CODE_RANGE, RangeArgs { start, end, flag: 0, pending: p });
    0
}

/// At exec, after the exec record: the new image's executable code and interpreter base, which
/// the ELF loader mapped in the kernel.
#[inline(always)]
pub(crate) unsafe fn send_exec_mappings(cfg: &Config, tgid: u32, tid: u32, mm: u64) {
    unsafe {
        let (Some(start), Some(end)) = (
            read_kernel_u64(mm + cfg.mm_start_code as u64),
            read_kernel_u64(mm + cfg.mm_end_code as u64),
        ) else {
            return;
        };
        if let Some(file) = read_kernel_u64(mm + cfg.mm_exe_file as u64)
            && file != 0
            && end > start
            && let Some(rec) = start_record(EVENT_MMAP, tgid, tid, mm)
        {
            (*rec).start = start;
            (*rec).len = end - start;
            (*rec).flags = MAP_EXE_TEXT;
            send_file(cfg, rec, file);
        }
        let auxv = mm + cfg.mm_saved_auxv as u64;
        for i in 0..AUXV_SCAN {
            let Some(key) = read_kernel_u64(auxv + i * 16) else { return };
            if key == 0 {
                return;
            }
            if key == AT_BASE {
                let Some(base) = read_kernel_u64(auxv + i * 16 + 8) else { return };
                if base != 0
                    && let Some(rec) = start_record(EVENT_MMAP, tgid, tid, mm)
                {
                    (*rec).start = base;
                    (*rec).flags = MAP_INTERP;
                    // The file at the base is the interpreter, named as its mapping is: without
                    // it userspace resolves PT_INTERP through /proc/PID/root, a path walk per
                    // exec (a fifth of its time in an exec storm).
                    match find_vma(base) {
                        Some(v) if v.file != 0 => {
                            (*rec).len = v.end - v.start;
                            (*rec).offset = v.pgoff * PAGE_SIZE;
                            send_file(cfg, rec, v.file);
                        }
                        _ => send(rec, MAP_RECORD_FIXED as u64, false),
                    }
                }
                return;
            }
        }
    }
}

/// Writes the path of `file` into `rec.path`, leaf component first, each NUL-terminated:
/// dentry names up to the mount's root, then across to the mountpoint in the parent mount,
/// until the root of the mount tree. Returns the bytes written and whether the root was
/// reached (not when a name or the whole path was too long, or the file's mount was detached,
/// e.g. lazily unmounted). Userspace checks the result against (dev, inode) before use.
/// The record is this CPU's `MAP_SCRATCH`, which every caller fills.
///
/// The components are walked in a `bpf_loop` callback: as a bounded loop the verifier went
/// through all MAP_PATH_DEPTH iterations in each of the four programs that name files (260 k
/// instructions each, about 2 s of start-up CPU); the callback is verified once.
#[inline(always)]
unsafe fn walk_path(cfg: &Config, file: u64) -> (u64, bool) {
    unsafe {
        let (Some(dentry), Some(vfsmnt)) = (
            read_kernel_u64(file + cfg.file_path_dentry as u64),
            read_kernel_u64(file + cfg.file_path_mnt as u64),
        ) else {
            return (0, false);
        };
        let Some(w) = PATH_WALK.get_ptr_mut(0) else { return (0, false) };
        *w = PathWalk { dentry, vfsmnt, off: 0, state: PATH_WALKING };
        run_loop(MAP_PATH_DEPTH, path_step, &mut 0u32);
        let off = (*w).off;
        (off, (*w).state == PATH_REACHED_ROOT)
    }
}

/// Where a path walk is between `bpf_loop` steps.
#[repr(C)]
#[derive(Clone, Copy)]
struct PathWalk {
    dentry: u64,
    vfsmnt: u64,
    off: u64,
    state: u64,
}

const PATH_WALKING: u64 = 0;
const PATH_REACHED_ROOT: u64 = 1;
const PATH_STOPPED: u64 = 2;

#[map]
static PATH_WALK: PerCpuArray<PathWalk> = PerCpuArray::with_max_entries(1, 0);

/// `bpf_loop` callback: one step up the path (a name, or a hop to the parent mount). 0
/// continues, 1 stops.
#[inline(never)]
extern "C" fn path_step(_index: u64, _ctx: *mut core::ffi::c_void) -> i64 {
    let (Some(w), Some(rec)) = (PATH_WALK.get_ptr_mut(0), MAP_SCRATCH.get_ptr_mut(0)) else {
        return 1;
    };
    let cfg = config();
    // SAFETY: per-CPU map values; kernel reads are fault-checked.
    unsafe {
        let w = &mut *w;
        let stop = |w: &mut PathWalk, state: u64| {
            w.state = state;
            1
        };
        let dentry = w.dentry;
        let vfsmnt = w.vfsmnt;
        let mnt = vfsmnt - cfg.mount_mnt as u64;
        let (Some(root), Some(parent)) = (
            read_kernel_u64(vfsmnt + cfg.vfsmount_root as u64),
            read_kernel_u64(dentry + cfg.dentry_parent as u64),
        ) else {
            return stop(w, PATH_STOPPED);
        };
        if dentry == root {
            let Some(mnt_parent) = read_kernel_u64(mnt + cfg.mount_parent as u64) else {
                return stop(w, PATH_STOPPED);
            };
            if mnt_parent == mnt {
                return stop(w, PATH_REACHED_ROOT);
            }
            let Some(mountpoint) = read_kernel_u64(mnt + cfg.mount_mountpoint as u64) else {
                return stop(w, PATH_STOPPED);
            };
            w.dentry = mountpoint;
            w.vfsmnt = mnt_parent + cfg.mount_mnt as u64;
            return 0;
        }
        let off = w.off;
        if dentry == parent || off >= MAP_PATH_MAX as u64 {
            return stop(w, PATH_STOPPED);
        }
        let Some(name) = read_kernel_u64(dentry + cfg.dentry_name as u64) else {
            return stop(w, PATH_STOPPED);
        };
        // The mask keeps the write inside `path` for the verifier: off < MAP_PATH_MAX here
        // and `path` has MAP_NAME_MAX bytes to spare.
        let dst = (*rec).path.as_mut_ptr().add((off & (MAP_PATH_MAX as u64 - 1)) as usize);
        let n = bpf_probe_read_kernel_str(dst.cast(), MAP_NAME_MAX as u32, name as *const _);
        if n <= 0 || n >= MAP_NAME_MAX as i64 {
            return stop(w, PATH_STOPPED);
        }
        w.off = off + n as u64;
        w.dentry = parent;
        0
    }
}
