//! Rows of a compiled unwind table (built by the `profiler-unwind` crate, read by BPF).
//!
//! A table is an array of [`UnwindRow`]s sorted by `pc`; a row's rule holds from its `pc`
//! up to the next row's `pc`. `pc` is a file-relative virtual address (the ELF `p_vaddr`
//! space, the addresses `.eh_frame` speaks in): the walker subtracts the mapping's load bias
//! (runtime address − `p_vaddr`, computed by userspace from `/proc/PID/maps` and the
//! `PT_LOAD` headers) from a runtime PC before searching.

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
    pub cfa_offset: u16,
    /// `UNWIND_RBP_CFA_OFFSET`: the rbp save slot relative to the CFA in 8-byte units.
    /// `UNWIND_CFA_PLT`: the `rip & 15` threshold. 0 otherwise.
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

    /// The rbp save slot relative to the CFA in bytes (`UNWIND_RBP_CFA_OFFSET` rows).
    pub const fn rbp_offset(&self) -> i64 {
        self.aux as i64 * 8
    }

    /// Same rule (ignoring `pc`): adjacent rows with the same rule are merged.
    pub const fn same_rule(&self, other: &UnwindRow) -> bool {
        self.cfa_offset == other.cfa_offset && self.aux == other.aux && self.kinds == other.kinds
    }
}

#[cfg(feature = "user")]
// SAFETY: plain `#[repr(C)]` integers, no padding (4 + 2 + 1 + 1 bytes).
unsafe impl aya::Pod for UnwindRow {}
