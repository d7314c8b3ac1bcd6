//! Rows of a compiled unwind table (built by the `profiler-unwind` crate, read by BPF).
//!
//! A table is an array of [`UnwindRow`]s sorted by `pc`; a row's rule holds from its `pc`
//! up to the next row's `pc`. `pc` is a file-relative virtual address (the ELF `p_vaddr`
//! space, the addresses `.eh_frame` speaks in): the walker subtracts the mapping's load bias
//! (runtime address − `p_vaddr`, computed by userspace from `/proc/PID/maps` and the
//! `PT_LOAD` headers) from a runtime PC before searching.
//!
//! In the kernel's rows array a table is followed by its page index: one entry per
//! `1 << UNWIND_PAGE_SHIFT` bytes of addresses, from the page of the first row's `pc` to the
//! page of the last's, holding (in `pc`) the index of the row in force at the page's start,
//! and a last entry holding the last row's index. The walker reads the entry of its
//! address's page and searches only the rows between it and the next entry: at most `UNWIND_PAGE_STEPS` halvings, where a search of the
//! whole table took up to 24. Fewer steps are fewer dependent loads per frame, and a shorter
//! loop for the verifier to follow (its time in the sampler was mostly this loop).

/// Bytes of addresses per page index entry.
pub const UNWIND_PAGE_SHIFT: u32 = 10;
/// Halvings that find a row within one page. A search covers the row in force at the page's
/// start through the one in force at the next page's start. Rows have distinct `pc`s, so that
/// is at most 1,025 rows: one at the page's start, 1,023 inside, one at the next page's
/// start, which is then never the answer. 10 halvings leave two candidates only on the path
/// that always moves up, which ends on the one below that last row: the answer.
pub const UNWIND_PAGE_STEPS: u32 = 10;

/// No unwind information covers this address (a gap between functions, or past the end).
pub const UNWIND_CFA_NONE: u8 = 0;
/// CFA = rsp + `cfa_offset`.
pub const UNWIND_CFA_RSP: u8 = 1;
/// CFA = rbp + `cfa_offset`.
pub const UNWIND_CFA_RBP: u8 = 2;
/// PLT stub: CFA = rsp + `cfa_offset` + ((rip & 15) >= `aux` ? 8 : 0).
pub const UNWIND_CFA_PLT: u8 = 3;
/// Signal trampoline (`__restore_rt`): the interrupted registers are in the `ucontext` on
/// the stack, not reachable through a CFA rule.
pub const UNWIND_CFA_SIGNAL: u8 = 4;
/// The return address is undefined: the outermost frame (e.g. `_start`); the walk ends.
pub const UNWIND_CFA_END: u8 = 5;
/// CFI exists but has a form the table cannot express (other registers, other
/// expressions, return address not at CFA-8, offset out of range). Counted by the walker.
pub const UNWIND_CFA_UNSUPPORTED: u8 = 6;
/// CFA = rsp + 8 * (`cfa_offset` | (`aux` & 15) << 16): a frame of 64 KiB to 8 MiB (rustc's
/// `run_compiler` closure has one of 527 KiB, and every rustc stack passes through it). The
/// rbp save slot is then in `aux`'s high nibble (see [`UnwindRow::rbp_offset`]).
pub const UNWIND_CFA_RSP_LARGE: u8 = 7;
/// Largest CFA offset an `UNWIND_CFA_RSP_LARGE` row holds (in bytes, a multiple of 8).
pub const UNWIND_LARGE_CFA_MAX: u64 = 8 * ((1 << 20) - 1);

/// rbp holds the caller's value.
pub const UNWIND_RBP_UNCHANGED: u8 = 0;
/// The caller's rbp is saved at CFA + 8 * `aux`.
pub const UNWIND_RBP_CFA_OFFSET: u8 = 1;
/// Any other rbp rule: the caller's rbp is unknown after this frame.
pub const UNWIND_RBP_UNSUPPORTED: u8 = 2;

/// One table row, 8 bytes. Return addresses are always at CFA - 8 (rows where they are not
/// are `UNWIND_CFA_UNSUPPORTED`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UnwindRow {
    /// First address (file-relative virtual address) the row applies to.
    pub pc: u32,
    /// Offset added to the CFA base register (`UNWIND_CFA_RSP`, `_RBP`, `_PLT`); the CFA is
    /// never below its base on x86-64, and frames of 32 to 64 KiB exist (glibc has one).
    /// `UNWIND_CFA_RSP_LARGE`: the low 16 bits of the offset in 8-byte units.
    pub cfa_offset: u16,
    /// `UNWIND_RBP_CFA_OFFSET`: the rbp save slot relative to the CFA in 8-byte units.
    /// `UNWIND_CFA_PLT`: the `rip & 15` threshold. `UNWIND_CFA_RSP_LARGE`: the offset's
    /// high 4 bits (of 20, in 8-byte units) in the low nibble, the rbp slot (signed, 8-byte
    /// units: -64 to +56 bytes) in the high nibble. 0 otherwise.
    pub aux: i8,
    /// CFA kind (`UNWIND_CFA_*`) in the low 4 bits, rbp kind (`UNWIND_RBP_*`) in the high 4.
    pub kinds: u8,
}

impl UnwindRow {
    pub const fn new(pc: u32, cfa_kind: u8, cfa_offset: u16, rbp_kind: u8, aux: i8) -> Self {
        UnwindRow { pc, cfa_offset, aux, kinds: (cfa_kind & 0xf) | (rbp_kind << 4) }
    }

    pub const fn cfa_kind(&self) -> u8 {
        self.kinds & 0xf
    }

    pub const fn rbp_kind(&self) -> u8 {
        self.kinds >> 4
    }

    /// A row for CFA = rsp + `offset` (a multiple of 8, at most `UNWIND_LARGE_CFA_MAX`), the
    /// caller's rbp unchanged or saved at CFA + 8 * `rbp_slot` (-8 to 7).
    pub const fn large(pc: u32, offset: u64, rbp_kind: u8, rbp_slot: i8) -> Self {
        let units = offset / 8;
        let aux = ((units >> 16) as u8 & 0xf) | ((rbp_slot as u8) << 4);
        UnwindRow::new(pc, UNWIND_CFA_RSP_LARGE, units as u16, rbp_kind, aux as i8)
    }

    /// The CFA's offset from rsp in bytes (`UNWIND_CFA_RSP_LARGE` rows).
    pub const fn large_cfa_offset(&self) -> u64 {
        8 * (self.cfa_offset as u64 | ((self.aux as u8 as u64 & 0xf) << 16))
    }

    /// The rbp save slot relative to the CFA in bytes (`UNWIND_RBP_CFA_OFFSET` rows).
    pub const fn rbp_offset(&self) -> i64 {
        if self.cfa_kind() == UNWIND_CFA_RSP_LARGE {
            // Arithmetic shift: the slot is the signed high nibble.
            (self.aux >> 4) as i64 * 8
        } else {
            self.aux as i64 * 8
        }
    }

    /// Same rule (ignoring `pc`): adjacent rows with the same rule are merged.
    pub const fn same_rule(&self, other: &UnwindRow) -> bool {
        self.cfa_offset == other.cfa_offset && self.aux == other.aux && self.kinds == other.kinds
    }
}

#[cfg(feature = "user")]
// SAFETY: plain `#[repr(C)]` integers, no padding (4 + 2 + 1 + 1 bytes).
unsafe impl aya::Pod for UnwindRow {}

/// Executable mappings kept per process for the walker ([`UnwindProcess`]); more are counted
/// by userspace and their frames end the walk as "no mapping".
pub const UNWIND_MAX_MAPPINGS: usize = 256;

/// [`UnwindMapping::flags`]: the file has no usable CFI (none, or it failed to compile).
pub const UNWIND_MAPPING_NO_CFI: u32 = 1 << 0;
/// The file's table is not in the rows array (not compiled yet, or the array was full).
pub const UNWIND_MAPPING_NOT_LOADED: u32 = 1 << 1;
/// Anonymous executable memory (JIT code): no file, no CFI.
pub const UNWIND_MAPPING_ANON: u32 = 1 << 2;
// 1 << 3 was `NO_COPY` (files too large for a copy's walk): every file is walkable now.
/// With `ANON`: CPython 3.12+'s perf trampoline arena (`-X perf`; its perf map names the code
/// `py::…`). Each trampoline is `sub $8,%rsp; call *%rcx; add $8,%rsp; ret`, with no CFI and
/// no frame pointer, so the walker steps over it by that shape: in the call, the return
/// address to its caller is 16 bytes above rsp and rbp is untouched.
pub const UNWIND_MAPPING_PY_TRAMPOLINES: u32 = 1 << 4;

/// One executable mapping of a process as the walker sees it: `start..end` at runtime, the
/// load bias to subtract from a PC to get the file-relative address the rows use, the
/// file's rows `first..first + count` in `UNWIND_ROWS` (count 0: no table, see `flags`), and
/// their page index right after them: `pages` entries, the first for page `page_base` (see
/// `UNWIND_PAGE_SHIFT`), and one more holding the last row's index.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindMapping {
    pub start: u64,
    pub end: u64,
    pub bias: u64,
    pub first: u32,
    pub count: u32,
    /// `UNWIND_MAPPING_*`.
    pub flags: u32,
    /// Userspace's module id of the file, echoed in nothing; for debugging map dumps.
    pub module: u32,
    /// Page (address >> `UNWIND_PAGE_SHIFT`) of the first row's `pc`.
    pub page_base: u32,
    /// Pages the index covers (at least 1 when `count` is not 0).
    pub pages: u32,
}

/// Value of `UNWIND_PROCS` (keyed by thread-group id): the process's executable mappings
/// sorted by `start`, non-overlapping; only the first `count` are valid. One value per
/// process, rewritten whole when its mappings change, so the walker never sees half an
/// update of the order it binary-searches.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UnwindProcess {
    pub count: u32,
    /// The process's [`UnwindEarly`] mappings numbered up to this are in `mappings` (or were
    /// unmapped before the entry was written): the walker looks only at later ones.
    pub early_seen: u32,
    pub mappings: [UnwindMapping; UNWIND_MAX_MAPPINGS],
}

/// A file by the identity the kernel's mapping records carry (keys `UNWIND_FILES` and the
/// Python walker's `PY_FILES`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FileKey {
    pub inode: u64,
    /// Kernel `dev_t` (major << 20 | minor).
    pub dev: u32,
    pub _pad: u32,
}

/// Executable segments an [`UnwindFile`] keeps (more are rare; their mappings wait for
/// userspace).
pub const UNWIND_FILE_SEGMENTS: usize = 4;

/// One executable `PT_LOAD`: its `p_vaddr`, `p_memsz` and `p_offset`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindSegment {
    pub vaddr: u64,
    pub memsz: u64,
    pub offset: u64,
}

/// Value of `UNWIND_FILES`: a file whose table is in the rows array and named by some
/// process's entry (userspace removes it before the table can be evicted). With it the
/// kernel walks a new mapping of the file at once ([`UnwindEarly`]), before userspace has
/// read the mapping's record and rewritten the process's entry: a new process, or a
/// `dlopen`, is walked from its first instruction when its files' tables are already loaded.
/// `size` and `mtime_*` are checked against the mapped inode (a file rewritten in place
/// keeps its inode).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindFile {
    pub size: u64,
    pub mtime_sec: u64,
    pub mtime_nsec: u32,
    /// The table as an [`UnwindMapping`] has it.
    pub first: u32,
    pub count: u32,
    pub page_base: u32,
    pub pages: u32,
    /// Valid entries of `segments`, by ascending `vaddr`.
    pub segment_count: u32,
    pub segments: [UnwindSegment; UNWIND_FILE_SEGMENTS],
}

/// Early mappings kept per process ([`UnwindEarly`]).
pub const UNWIND_EARLY_SLOTS: usize = 16;

/// A mapping the kernel added itself ([`UnwindEarly`]); `seq` 0: empty or removed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindEarlySlot {
    pub seq: u32,
    pub _pad: u32,
    pub start: u64,
    pub end: u64,
    pub bias: u64,
    pub file: FileKey,
}

/// Value of `UNWIND_EARLY` (by thread-group id): the process's code mappings of files in
/// `UNWIND_FILES` made since its exec, numbered from 1 (`seq`; slot `(seq - 1) %
/// UNWIND_EARLY_SLOTS`). The mapping's record carries its number (`MapRecord::early_seq`);
/// once userspace writes an entry holding it, the entry's `early_seen` says so and the walker
/// no longer looks here for it. The walker takes an early mapping before the entry's: it is
/// newer.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UnwindEarly {
    /// Numbers handed out.
    pub next: u32,
    pub _pad: u32,
    pub slots: [UnwindEarlySlot; UNWIND_EARLY_SLOTS],
}

#[cfg(feature = "user")]
// SAFETY: plain `#[repr(C)]` integers, no padding.
unsafe impl aya::Pod for FileKey {}
#[cfg(feature = "user")]
// SAFETY: plain `#[repr(C)]` integers and Pod structs, no padding (8 + 8 + 4 * 6 + 4 * 24).
unsafe impl aya::Pod for UnwindFile {}

/// How a sample's user stack walk ended, in bits `SAMPLE_UNWIND_SHIFT..` of the sample flags.
/// `NONE`: no walk (frame-pointer mode, whose end is unknown, or no user stack: a kernel
/// thread).
pub const UNWIND_END_NONE: u32 = 0;
/// Reached the outermost frame (CFI says the return address is undefined, or it is 0).
pub const UNWIND_END_COMPLETE: u32 = 1;
/// Stopped at `MAX_STACK_DEPTH` frames: the root side is missing.
pub const UNWIND_END_DEPTH: u32 = 2;
/// The process has no mapping table in the kernel yet (just started, or not loaded).
pub const UNWIND_END_NO_PROCESS: u32 = 3;
/// A PC in no executable mapping the walker knows.
pub const UNWIND_END_NO_MAPPING: u32 = 4;
/// A PC in a file whose table is not loaded (not compiled yet, or the rows array is full).
pub const UNWIND_END_NO_TABLE: u32 = 5;
/// A PC in a file without CFI, or in a gap its CFI does not cover (and no frame-pointer
/// fallback was asked for).
pub const UNWIND_END_NO_CFI: u32 = 6;
/// A CFI rule the table cannot express (`UNWIND_CFA_UNSUPPORTED`, or a CFA based on an rbp
/// whose value was lost).
pub const UNWIND_END_UNSUPPORTED: u32 = 7;
/// Reading the stack (return address, saved rbp, signal frame) faulted.
pub const UNWIND_END_READ_FAULT: u32 = 8;
/// The frame-pointer fallback ended the walk (rbp chain ended or went astray): the root is
/// probably but not certainly reached.
pub const UNWIND_END_FRAME_POINTER: u32 = 9;
/// Number of `UNWIND_END_*` values.
pub const UNWIND_END_COUNT: u32 = 10;
/// Bits of the sample flags holding the `UNWIND_END_*` value.
pub const SAMPLE_UNWIND_SHIFT: u32 = 8;
pub const SAMPLE_UNWIND_MASK: u32 = 0xf << SAMPLE_UNWIND_SHIFT;
/// Some frames of the walk were found by following frame pointers (code without a table).
pub const SAMPLE_UNWIND_USED_FP: u32 = 1 << 12;
/// The sample carries a [`StackCopyHeader`] and a copy of the user stack after its frames and
/// labels: its table walk stopped for want of a table (`UNWIND_END_NO_PROCESS`, `_NO_MAPPING`,
/// `_NO_TABLE`), and userspace continues it over the copy once the tables are there.
pub const SAMPLE_STACK_COPY: u32 = 1 << 13;

/// Most bytes of user stack copied per sample (from the stopped frame's rsp up). Enough for
/// the callers of most start-up and library code; a power of two for the verifier's bounds.
pub const STACK_COPY_MAX: usize = 8 << 10;

/// [`StackCopyHeader::flags`]: the stopped frame's rbp is known (see the walker's `bp_known`).
pub const STACK_COPY_BP_KNOWN: u32 = 1 << 0;
/// `pc` is a return address (a caller's frame): its rule is looked up at `pc - 1`.
pub const STACK_COPY_PC_IS_RETURN: u32 = 1 << 1;

/// Where the table walk stopped and how much stack follows: `len` bytes of user memory from
/// `sp` up. The stopped frame is also the last user frame of the sample.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackCopyHeader {
    pub pc: u64,
    pub sp: u64,
    pub bp: u64,
    pub len: u32,
    /// `STACK_COPY_*`.
    pub flags: u32,
}

pub const STACK_COPY_HEADER_SIZE: usize = core::mem::size_of::<StackCopyHeader>();

#[cfg(feature = "user")]
// SAFETY: plain `#[repr(C)]` integers, no padding (3 * 8 + 6 * 4 bytes).
unsafe impl aya::Pod for UnwindMapping {}
#[cfg(feature = "user")]
// SAFETY: plain `#[repr(C)]` integers and an array of Pod structs, no padding.
unsafe impl aya::Pod for UnwindProcess {}
