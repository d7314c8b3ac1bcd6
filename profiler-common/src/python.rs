//! CPython frames read in the kernel (profiler-ebpf's python.rs): per process, where the
//! interpreter keeps the thread's state and how its frames are laid out ([`PyProc`], written
//! by userspace to `PY_PROCS` when it finds CPython mapped); per sample, the Python frames
//! found, two words each, after the sample's labels.

/// Python frames sent per sample; deeper ones are cut and the sample flagged
/// (`SAMPLE_PY_TRUNCATED`). Frames are walked in a `bpf_loop`, so the bound is the record's
/// room, not the verifier's.
pub const PY_MAX_FRAMES: usize = 128;

/// Bytes of a frame read at once: every field the walker needs is within them on 3.8–3.13
/// (`PyProc::frame_len` says how many a version needs).
pub const PY_FRAME_READ: usize = 112;

/// 3.11+: bytes of the thread state read at once, from its frame (or `cframe`) pointer to
/// `datastack_top` (the offsets table's test checks they fit). A power of two.
pub const PY_TSTATE_READ: usize = 256;

/// 3.11+: at most this many bytes of the top of a thread's data stack are read in one piece
/// (never below the chunk's first frame, so a shallow stack copies little; CPython's first
/// chunk is 16 KiB, so most walks take one read). Frames within them are parsed from the
/// copy, the others read one by one. A power of two.
pub const PY_STACK_WINDOW: usize = 16384;

/// A field the version lacks.
pub const PY_NO_FIELD: u32 = u32::MAX;

/// How the kernel finds one process's Python frames. Offsets are bytes, from the per-version
/// table (profiler-user's `python::offsets`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyProc {
    /// Address of the pthread key (`Py_tss_t._key`, a u32) in `_PyRuntime` of this process:
    /// the thread's `PyThreadState` is its value for the thread (3.8–3.13 alike, and set while
    /// the thread has released the GIL, unlike 3.12+'s `_Py_tss_tstate`).
    pub tss_key: u64,
    /// glibc: offset from the thread pointer of `struct pthread`'s `specific_1stblock`, whose
    /// 16-byte entries hold (sequence, value) for keys 0–31; the second-level block pointers
    /// (`specific[]`) follow its 32 entries.
    pub tls_specific: u32,
    /// CPython minor version (3.`minor`).
    pub minor: u32,
    /// `PyThreadState` → frame pointer (3.8–3.10 `frame`, 3.13 `current_frame`), or to the
    /// `_PyCFrame` pointer (3.11, 3.12 `cframe`) when `cframe_frame` is set.
    pub tstate_frame: u32,
    /// `_PyCFrame` → `current_frame`, or `PY_NO_FIELD`.
    pub cframe_frame: u32,
    /// 3.11+: `PyThreadState` → `datastack_chunk`, with `datastack_top` 8 bytes on; the
    /// frames of the chunk's data (from `PY_STACK_CHUNK_DATA`) below the top are read at once.
    /// `PY_NO_FIELD` before 3.11.
    pub tstate_datastack: u32,
    /// Bytes from a frame's start that hold every field below (≤ `PY_FRAME_READ`).
    pub frame_len: u32,
    /// The code object's fields its identity is made of (`py_code_ident`): `code_len`
    /// (≤ `PY_CODE_READ`) bytes from `code_lo` hold them; each field's offset is from the
    /// object's start (`code_qualname` `PY_NO_FIELD` before 3.11: 0 in the identity).
    pub code_lo: u32,
    pub code_len: u32,
    pub code_firstlineno: u32,
    pub code_filename: u32,
    pub code_name: u32,
    pub code_qualname: u32,
    pub code_linetable: u32,
    /// Frame → previous (older) frame, code object, and the instruction (3.8–3.10: `f_lasti`,
    /// an int; 3.11+: a pointer into the code's bytecode).
    pub frame_back: u32,
    pub frame_code: u32,
    pub frame_ip: u32,
    /// 3.11+: `owner` (a byte; `PY_OWNED_BY_CSTACK` marks the C loop's shim frame), else
    /// `PY_NO_FIELD`.
    pub frame_owner: u32,
    /// 3.11: `is_entry` (a byte: the frame its C activation of the eval loop began with), else
    /// `PY_NO_FIELD`.
    pub frame_is_entry: u32,
    pub _pad: u32,
    /// Kernel-side: 0 until the process's first sample with Python frames, which wakes
    /// userspace (`SAMPLE_PY_FIRST`) so that its code objects are read while it lives.
    pub announced: u32,
}

/// `_PyStackChunk.data`: where a data stack chunk's frames begin (3.11–3.13).
pub const PY_STACK_CHUNK_DATA: u64 = 24;

/// `_PyInterpreterFrame.owner` of the shim frame the eval loop pushes on 3.12+.
pub const PY_OWNED_BY_CSTACK: u8 = 3;

/// Bytes of a code object read for its identity (a power of two).
pub const PY_CODE_READ: usize = 128;

/// The identity of a code object as the sampler saw it, 24 bits made of the fields its name,
/// file and lines come from: (`co_filename`, `co_name`, `co_qualname`, `co_linetable`
/// pointers, `co_firstlineno`). Userspace reads the object later and names the frame only if
/// the object it finds has the same identity: a code object freed and its memory reused
/// before the read is then not named as the new one.
#[inline(always)]
pub const fn py_code_ident(fields: [u64; 5]) -> u64 {
    let mut h: u64 = 0x243f_6a88_85a3_08d3;
    let mut i = 0;
    while i < 5 {
        h = (h ^ fields[i]).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^= h >> 29;
        i += 1;
    }
    h >> 40
}

/// Second word of a Python frame: the instruction in the low 32 bits (3.8–3.10 `f_lasti`;
/// 3.11+ the instruction pointer less the code object's address), the code object's identity
/// (`py_code_ident`) in bits 32–55, and flags from bit 56.
pub const PY_FRAME_FLAGS_SHIFT: u32 = 56;
pub const PY_FRAME_INSTR_MASK: u64 = 0xffff_ffff;
pub const PY_FRAME_IDENT_SHIFT: u32 = 32;
pub const PY_FRAME_IDENT_MASK: u64 = 0xff_ffff;
/// The sampler could not read the code object (no identity: the frame is not named).
pub const PY_FRAME_NO_IDENT: u64 = 1 << 59;
/// The first (outermost) frame of one C activation of the eval loop (3.11 `is_entry`; 3.12+
/// the frame above a shim). Frames of one activation stand for one native
/// `_PyEval_EvalFrameDefault` frame.
pub const PY_FRAME_ENTRY: u64 = 1 << 56;
/// `owner` of the frame (3.11+), in bits 57–58; 3.8–3.10 frames are owned by their objects.
pub const PY_FRAME_OWNER_SHIFT: u32 = 57;

/// How the Python walk of a sample went, in bits `SAMPLE_PY_SHIFT..` of the sample flags.
/// `NONE`: the process is not known to run CPython (or `--no-python`).
pub const PY_WALK_NONE: u32 = 0;
/// Frames found.
pub const PY_WALK_FRAMES: u32 = 1;
/// The thread has no `PyThreadState` (a thread that never ran Python, or not yet).
pub const PY_WALK_NO_THREAD_STATE: u32 = 2;
/// The thread state has no current frame (the interpreter between frames: start-up, exit).
pub const PY_WALK_NO_FRAME: u32 = 3;
/// Reading the thread pointer, the key, the thread state or a frame failed.
pub const PY_WALK_READ_FAULT: u32 = 4;
pub const SAMPLE_PY_SHIFT: u32 = 16;
pub const SAMPLE_PY_MASK: u32 = 0x7 << SAMPLE_PY_SHIFT;
/// More than `PY_MAX_FRAMES` Python frames: the outermost are missing.
pub const SAMPLE_PY_TRUNCATED: u32 = 1 << 19;
/// The process's first sample with Python frames (the sampler wakes userspace for it).
pub const SAMPLE_PY_FIRST: u32 = 1 << 20;

/// A known interpreter file (`PY_FILES`): a process that maps it gets its `PY_PROCS` entry in
/// the kernel at once (exec of a `python3.X`, mmap of `libpython3.X.so`), before userspace has
/// seen the mapping, so a script's first milliseconds are walked too. `proc_.tss_key` is the
/// key's file virtual address; the load bias is added per process.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyFile {
    pub proc_: PyProc,
    /// Lowest `p_vaddr` of the executable segments: an executable's `mm->start_code` less its
    /// load bias.
    pub text_vaddr: u64,
    /// The executable segment's page-aligned file offset and virtual address: a library's
    /// mapping of it at `start` has bias `start - exec_vaddr`.
    pub exec_offset: u64,
    pub exec_vaddr: u64,
}

#[cfg(feature = "user")]
// SAFETY: plain `#[repr(C)]` integers, no padding (8 + 20 * 4 bytes).
unsafe impl aya::Pod for PyProc {}
#[cfg(feature = "user")]
// SAFETY: plain `#[repr(C)]` integers and a Pod struct, no padding.
unsafe impl aya::Pod for PyFile {}
