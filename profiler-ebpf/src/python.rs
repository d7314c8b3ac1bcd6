//! CPython frames of the sampled thread, read from the interpreter's own structures: the
//! thread's `PyThreadState` is the value of CPython's pthread key for the thread (read from
//! glibc's thread block at the thread pointer, `task->thread.fsbase`), and its frame chain
//! is walked innermost first in a `bpf_loop`. Each frame sends its code object's address and
//! its instruction; userspace reads names and lines from the process (no strings here).
//! Where the process runs CPython and how its version lays the structures out comes from
//! userspace (`PY_PROCS`, see `profiler_common::PyProc`).

use aya_ebpf::{
    helpers::{bpf_probe_read_kernel_buf, bpf_probe_read_user},
    macros::map,
    maps::{HashMap, PerCpuArray},
};
use profiler_common::{
    FileKey, PY_CODE_READ, PY_FRAME_ENTRY, PY_FRAME_IDENT_MASK, PY_FRAME_IDENT_SHIFT,
    PY_FRAME_INSTR_MASK, PY_FRAME_NO_IDENT, PY_FRAME_OWNER_SHIFT, PY_FRAME_READ, PY_MAX_FRAMES,
    PY_NO_FIELD, PY_OWNED_BY_CSTACK, PY_STACK_CHUNK_DATA, PY_STACK_WINDOW, PY_TSTATE_READ,
    PY_WALK_FRAMES, PY_WALK_NO_FRAME, PY_WALK_NO_THREAD_STATE, PY_WALK_READ_FAULT, PyFile, PyProc,
    SAMPLE_PY_FIRST, SAMPLE_PY_SHIFT, SAMPLE_PY_TRUNCATED, py_code_ident,
};

use crate::run_loop;

/// Processes running CPython, by thread-group id.
#[map]
static PY_PROCS: HashMap<u32, PyProc> = HashMap::with_max_entries(16384, 0);

/// Interpreter files userspace has found (see `PyFile`).
#[map]
static PY_FILES: HashMap<FileKey, PyFile> = HashMap::with_max_entries(1024, 0);

/// A file was mapped executable by process `tgid` (at exec: its executable, `exe_text`, whose
/// code starts at `start`; else a mapping of file offset `offset` at `start`): if it is a
/// known interpreter, the process's walker config is written now.
#[inline(always)]
pub fn file_mapped(tgid: u32, dev: u32, inode: u64, start: u64, offset: u64, exe_text: bool) {
    let key = FileKey { inode, dev, _pad: 0 };
    // SAFETY: a map value, copied out at once.
    let Some(f) = (unsafe { PY_FILES.get(&key) }) else { return };
    let bias = if exe_text {
        start.wrapping_sub(f.text_vaddr)
    } else if offset == f.exec_offset {
        start.wrapping_sub(f.exec_vaddr)
    } else {
        return;
    };
    let mut p = f.proc_;
    p.tss_key = p.tss_key.wrapping_add(bias);
    let _ = PY_PROCS.insert(&tgid, &p, 0);
}

/// A new process (fork without exec) runs its parent's interpreter at the same addresses.
#[inline(always)]
pub fn inherit(parent: u32, child: u32) {
    // SAFETY: a map value, copied out at once.
    if let Some(p) = unsafe { PY_PROCS.get(&parent) } {
        let p = *p;
        let _ = PY_PROCS.insert(&child, &p, 0);
    }
}

/// A process execs: the old image's interpreter is gone.
#[inline(always)]
pub fn forget(tgid: u32) {
    let _ = PY_PROCS.remove(&tgid);
}

/// A walk in progress: the next frame, the frames found, and the bytes frames are parsed from.
#[repr(C)]
pub struct PyWalk {
    frame: u64,
    n: u32,
    truncated: u32,
    fault: u32,
    _pad: u32,
    /// 3.11+: where the thread's current data stack chunk holds frames, and the part of it
    /// copied to `window` (`win_len` 0: none yet).
    chunk_lo: u64,
    chunk_hi: u64,
    win_lo: u64,
    win_len: u64,
    /// The last code object read and its identity word (recursion repeats one: read once).
    last_code: u64,
    last_ident: u64,
    proc_: PyProc,
    out: [u64; 2 * PY_MAX_FRAMES],
    /// One frame read by itself (a frame outside the chunk: 3.8–3.10 frame objects,
    /// generators' frames, 3.12+'s shim frames on the C stack).
    buf: [u64; PY_FRAME_READ / 8],
    /// The copy of `[win_lo, win_lo + win_len)`; the slack keeps masked field reads in bounds.
    window: [u64; (PY_STACK_WINDOW + 256) / 8],
    /// The code object's bytes its identity is made of.
    code: [u64; PY_CODE_READ / 8],
}

/// Per CPU: one walk state for the sampler, one for the off-CPU tracker.
#[map]
static PY_STATE: PerCpuArray<PyWalk> = PerCpuArray::with_max_entries(2, 0);
pub const SLOT_SAMPLER: u32 = 0;
pub const SLOT_OFF_CPU: u32 = 1;

#[inline(always)]
fn read_user_u64(addr: u64) -> Option<u64> {
    // SAFETY: fault-checked read of user memory.
    unsafe { bpf_probe_read_user(addr as *const u64) }.ok()
}

/// Writes the current thread's Python frames (two words each, innermost first) to `dst`
/// when its process runs CPython; returns (frames, sample flags: `PY_WALK_*` and
/// `SAMPLE_PY_TRUNCATED`). `task` is the current task, `fsbase_off` the offset of its thread
/// pointer, `slot` the walker's state (`SLOT_*`).
///
/// # Safety
/// `dst` must have room for `2 * PY_MAX_FRAMES` words of a map value.
#[inline(always)]
pub unsafe fn walk(tgid: u32, task: u64, fsbase_off: u32, dst: *mut u64, slot: u32) -> (u32, u32) {
    // SAFETY: a map value pointer, valid for the program's run.
    let Some(proc_) = PY_PROCS.get_ptr_mut(&tgid) else { return (0, 0) };
    // SAFETY: a map value, valid for the program's run; `announced` is the only field written
    // here (a race between CPUs only wakes userspace twice).
    let proc_ = unsafe { &mut *proc_ };
    let status = |s: u32| (0, s << SAMPLE_PY_SHIFT);
    if fsbase_off == 0 {
        return status(PY_WALK_READ_FAULT);
    }
    // SAFETY: fault-checked kernel read of the current task.
    let Some(tp) = (unsafe { crate::read_kernel_u64(task + fsbase_off as u64) }) else {
        return status(PY_WALK_READ_FAULT);
    };
    // SAFETY: fault-checked read of user memory.
    let Ok(key) = (unsafe { bpf_probe_read_user(proc_.tss_key as *const u32) }) else {
        return status(PY_WALK_READ_FAULT);
    };
    let specific = tp.wrapping_add(proc_.tls_specific as u64);
    // glibc: keys 0–31 in the thread block itself, the others in blocks of 32 it points to.
    let value = if key < 32 {
        specific.wrapping_add(16 * key as u64 + 8)
    } else if key < 1024 {
        let Some(block) = read_user_u64(specific + 32 * 16 + 8 * (key / 32) as u64) else {
            return status(PY_WALK_READ_FAULT);
        };
        if block == 0 {
            return status(PY_WALK_NO_THREAD_STATE);
        }
        block.wrapping_add(16 * (key % 32) as u64 + 8)
    } else {
        return status(PY_WALK_READ_FAULT);
    };
    let Some(tstate) = read_user_u64(value) else { return status(PY_WALK_READ_FAULT) };
    if tstate == 0 {
        return status(PY_WALK_NO_THREAD_STATE);
    }
    let Some(st) = PY_STATE.get_ptr_mut(slot) else { return status(PY_WALK_READ_FAULT) };
    // SAFETY: this CPU's walk state; the sampler does not nest on one CPU.
    let st = unsafe { &mut *st };
    let (mut chunk_lo, mut chunk_hi) = (0u64, 0u64);
    let mut frame = if proc_.tstate_datastack != PY_NO_FIELD {
        // 3.11+: the frame (or `cframe`) pointer, `datastack_chunk` and `datastack_top` in one
        // read of the thread state, through the window's bytes (not in use yet).
        let (f, d) = (proc_.tstate_frame as u64, proc_.tstate_datastack as u64);
        let lo = if f < d { f } else { d };
        let hi = if f + 8 > d + 16 { f + 8 } else { d + 16 };
        let size = hi - lo;
        if size > PY_TSTATE_READ as u64 {
            return status(PY_WALK_READ_FAULT);
        }
        if !read_user_into(&mut st.window, size, tstate.wrapping_add(lo)) {
            return status(PY_WALK_READ_FAULT);
        }
        let chunk = u64_at(&st.window, (d - lo) as usize & (PY_TSTATE_READ - 1));
        let top = u64_at(&st.window, (d - lo + 8) as usize & (PY_TSTATE_READ - 1));
        let data = chunk.wrapping_add(PY_STACK_CHUNK_DATA);
        if chunk != 0 && top > data {
            (chunk_lo, chunk_hi) = (data, top);
        }
        u64_at(&st.window, (f - lo) as usize & (PY_TSTATE_READ - 1))
    } else {
        let Some(f) = read_user_u64(tstate.wrapping_add(proc_.tstate_frame as u64)) else {
            return status(PY_WALK_READ_FAULT);
        };
        f
    };
    if proc_.cframe_frame != PY_NO_FIELD && frame != 0 {
        let Some(f) = read_user_u64(frame.wrapping_add(proc_.cframe_frame as u64)) else {
            return status(PY_WALK_READ_FAULT);
        };
        frame = f;
    }
    if frame == 0 {
        return status(PY_WALK_NO_FRAME);
    }
    st.frame = frame;
    st.n = 0;
    st.truncated = 0;
    st.fault = 0;
    st.proc_ = *proc_;
    st.chunk_lo = chunk_lo;
    st.chunk_hi = chunk_hi;
    st.win_lo = 0;
    st.win_len = 0;
    st.last_code = 0;
    st.last_ident = 0;
    // A shim frame (3.12+) comes with each activation: twice the frames bounds the frames
    // visited, two a step.
    // The slot is the step's constant: each walker's loop reads its own state.
    let mut unused = 0u64;
    let steps = PY_MAX_FRAMES as u32 + 1;
    if slot == SLOT_SAMPLER {
        run_loop(steps, step::<SLOT_SAMPLER>, &mut unused);
    } else {
        run_loop(steps, step::<SLOT_OFF_CPU>, &mut unused);
    }
    if st.frame != 0 && st.fault == 0 {
        st.truncated = 1;
    }
    let n = if st.n as usize > PY_MAX_FRAMES { PY_MAX_FRAMES } else { st.n as usize };
    if n > 0 {
        // SAFETY: `dst` has room for 2 * PY_MAX_FRAMES words; `n` is bounded by it.
        let out = unsafe { core::slice::from_raw_parts_mut(dst.cast::<u8>(), n * 16) };
        if unsafe { bpf_probe_read_kernel_buf(st.out.as_ptr().cast(), out) }.is_err() {
            return status(PY_WALK_READ_FAULT);
        }
    }
    let mut flags = if st.truncated != 0 { SAMPLE_PY_TRUNCATED } else { 0 };
    if n > 0 && proc_.announced == 0 {
        proc_.announced = 1;
        flags |= SAMPLE_PY_FIRST;
    }
    flags |= if n > 0 {
        PY_WALK_FRAMES
    } else if st.fault != 0 {
        PY_WALK_READ_FAULT
    } else {
        PY_WALK_NO_FRAME
    } << SAMPLE_PY_SHIFT;
    (n as u32, flags)
}

/// Copies `size` bytes of user memory at `addr` to the start of `buf`; false when the read
/// faults or `size` is past `buf` (the check bounds it for the verifier).
#[inline(always)]
fn read_user_into<const N: usize>(buf: &mut [u64; N], size: u64, addr: u64) -> bool {
    if size > (N * 8) as u64 {
        return false;
    }
    // SAFETY: fault-checked read of user memory into `buf`, `size` bytes within it.
    let ret = unsafe {
        aya_ebpf::helpers::generated::bpf_probe_read_user(
            buf.as_mut_ptr().cast(),
            size as u32,
            addr as *const core::ffi::c_void,
        )
    };
    ret == 0
}

/// The u64 at byte `at` of `b` (0 past its end; the check bounds `at` for the verifier).
/// Frames, the window's start and the word fields are 8-aligned (the offsets table's test
/// checks the fields), so one aligned load does: an unaligned one is eight on BPF.
#[inline(always)]
fn u64_at<const N: usize>(b: &[u64; N], at: usize) -> u64 {
    let i = at >> 3;
    if i >= N {
        return 0;
    }
    b[i]
}

/// The u32 at byte `at` (4-aligned) of `b`, 0 past its end.
#[inline(always)]
fn u32_at<const N: usize>(b: &[u64; N], at: usize) -> u32 {
    let i = at >> 2;
    if i >= 2 * N {
        return 0;
    }
    // SAFETY: `i` is within `b`'s u32s.
    unsafe { *b.as_ptr().cast::<u32>().add(i) }
}

#[inline(always)]
fn u8_at<const N: usize>(b: &[u64; N], at: usize) -> u8 {
    if at >= N * 8 {
        return 0;
    }
    // SAFETY: `at` is within `b`'s bytes.
    unsafe { *b.as_ptr().cast::<u8>().add(at) }
}

/// Whether `[addr, addr + len)` lies within `[lo, hi)`.
#[inline(always)]
fn within(addr: u64, len: u64, lo: u64, hi: u64) -> bool {
    addr >= lo && hi >= len && addr <= hi - len
}

/// Copies the data stack below the end of the frame at `frame` (at most `PY_STACK_WINDOW`
/// bytes, not below the chunk's data) to the window; false when that read fails, after which
/// frames are read one by one.
#[inline(always)]
fn read_window(st: &mut PyWalk, frame: u64, len: u64) -> bool {
    let hi = frame + len;
    let lo = hi.saturating_sub(PY_STACK_WINDOW as u64).max(st.chunk_lo);
    let size = hi - lo;
    if size > PY_STACK_WINDOW as u64 {
        return false;
    }
    if !read_user_into(&mut st.window, size, lo) {
        st.chunk_hi = 0;
        st.win_len = 0;
        return false;
    }
    st.win_lo = lo;
    st.win_len = size;
    true
}

/// The identity word (`PY_FRAME_IDENT_*` bits, or `PY_FRAME_NO_IDENT`) of the code object at
/// `code`, read now: userspace names the frame only from an object with this identity.
#[inline(always)]
fn code_ident(st: &mut PyWalk, code: u64) -> u64 {
    if code == st.last_code && code != 0 {
        return st.last_ident;
    }
    let p = &st.proc_;
    let len = if p.code_len > PY_CODE_READ as u32 { PY_CODE_READ as u32 } else { p.code_len };
    let ident = if !read_user_into(&mut st.code, len as u64, code.wrapping_add(p.code_lo as u64)) {
        PY_FRAME_NO_IDENT
    } else {
        let at = |off: u32| (off.wrapping_sub(p.code_lo) as usize) & (PY_CODE_READ - 1);
        let word = |off: u32| u64_at(&st.code, at(off));
        let qualname = if p.code_qualname == PY_NO_FIELD { 0 } else { word(p.code_qualname) };
        let first = u32_at(&st.code, at(p.code_firstlineno)) as u64;
        let fields =
            [word(p.code_filename), word(p.code_name), qualname, word(p.code_linetable), first];
        (py_code_ident(fields) & PY_FRAME_IDENT_MASK) << PY_FRAME_IDENT_SHIFT
    };
    st.last_code = code;
    st.last_ident = ident;
    ident
}

/// `bpf_loop` callback: records the current frame and the one before it, moving on; two per
/// call halve the loop's per-frame overhead (the call, the state's lookup).
#[inline(never)]
extern "C" fn step<const SLOT: u32>(_index: u64, _ctx: *mut core::ffi::c_void) -> i64 {
    let Some(st) = PY_STATE.get_ptr_mut(SLOT) else { return 1 };
    // SAFETY: see `walk`.
    let st = unsafe { &mut *st };
    if one_frame(st) != 0 {
        return 1;
    }
    one_frame(st)
}

/// Records the current frame and moves to the previous one; 1 when the walk is over.
#[inline(always)]
fn one_frame(st: &mut PyWalk) -> i64 {
    let frame = st.frame;
    if frame == 0 {
        return 1;
    }
    let i = st.n as usize;
    if i >= PY_MAX_FRAMES {
        st.truncated = 1;
        return 1;
    }
    let len = st.proc_.frame_len as u64;
    // A frame on the data stack is parsed from the window (copied once for many frames);
    // any other frame is read by itself.
    let in_window = within(frame, len, st.win_lo, st.win_lo + st.win_len)
        || (within(frame, len, st.chunk_lo, st.chunk_hi) && read_window(st, frame, len));
    let base = if in_window {
        (frame - st.win_lo) as usize & (PY_STACK_WINDOW - 1)
    } else {
        let size = if len > PY_FRAME_READ as u64 { PY_FRAME_READ as u64 } else { len };
        if !read_user_into(&mut st.buf, size, frame) {
            st.fault = 1;
            return 1;
        }
        0
    };
    let p = &st.proc_;
    let word = |off: u32| {
        let at = base + (off as usize & 127);
        if in_window { u64_at(&st.window, at) } else { u64_at(&st.buf, at) }
    };
    let byte = |off: u32| {
        if off == PY_NO_FIELD {
            return 0;
        }
        let at = base + (off as usize & 127);
        if in_window { u8_at(&st.window, at) } else { u8_at(&st.buf, at) }
    };
    let code = word(p.frame_code);
    let back = word(p.frame_back);
    let owner = byte(p.frame_owner);
    // 3.8–3.10: f_lasti, an int (-1 before the first instruction); 3.11+: the instruction
    // pointer, sent less the code object's address (the object holds its bytecode).
    let instr = if p.minor <= 10 { word(p.frame_ip) } else { word(p.frame_ip).wrapping_sub(code) };
    // Each frame object of 3.8–3.10 is its own C activation.
    let entry = p.minor <= 10 || byte(p.frame_is_entry) != 0;
    let minor = p.minor;
    // A frame back to itself would only waste the loop.
    st.frame = if back == frame { 0 } else { back };
    if minor >= 12 && owner == PY_OWNED_BY_CSTACK {
        // The eval loop's shim: the frame sent before it began that C activation.
        if i > 0 {
            st.out[(2 * (i - 1) + 1) & (2 * PY_MAX_FRAMES - 1)] |= PY_FRAME_ENTRY;
        }
        return 0;
    }
    let mut w = (instr & PY_FRAME_INSTR_MASK)
        | code_ident(st, code)
        | ((owner as u64 & 3) << PY_FRAME_OWNER_SHIFT);
    if entry {
        w |= PY_FRAME_ENTRY;
    }
    st.out[(2 * i) & (2 * PY_MAX_FRAMES - 1)] = code;
    st.out[(2 * i + 1) & (2 * PY_MAX_FRAMES - 1)] = w;
    st.n += 1;
    0
}
