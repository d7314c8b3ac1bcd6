//! Compiles the call frame information (CFI) of an x86-64 ELF file into a compact unwind
//! table that a BPF program can binary-search while walking a user stack without frame
//! pointers.
//!
//! # Table format
//!
//! A table is a `Vec<`[`UnwindRow`]`>` (8 bytes a row, `#[repr(C)]`, defined in
//! `profiler-common` so the BPF crate reads the same layout), sorted by strictly increasing
//! `pc`. A row's rule holds from its `pc` up to the next row's `pc`; the last row is always
//! `UNWIND_CFA_NONE`. Adjacent rows with the same rule are merged, and every address range
//! that no FDE covers starts with an `UNWIND_CFA_NONE` row, so a gap between two functions
//! is never taken for the end of the previous one.
//!
//! `pc` is a *file-relative virtual address*: the address space of the ELF program headers
//! (`p_vaddr`) and of the CFI itself. One table therefore serves every process that maps
//! the file, whatever its load address. Addresses must fit in 32 bits (files whose code
//! lies above 4 GiB are rejected with [`Error::AddressTooLarge`]).
//!
//! Rules (`cfa_kind` in the low nibble of `kinds`, see `profiler_common::UNWIND_CFA_*`):
//! - `RSP` / `RBP`: CFA = rsp / rbp + `cfa_offset`;
//! - `RSP_LARGE`: CFA = rsp + an offset over 64 KiB (a multiple of 8, up to 8 MiB) split over
//!   `cfa_offset` and `aux` ([`UnwindRow::large_cfa_offset`]), the rbp slot in `aux`'s high
//!   nibble;
//! - `PLT`: the binutils PLT expression, CFA = rsp + `cfa_offset` + ((rip & 15) >= `aux` ?
//!   8 : 0);
//! - `SIGNAL`: an FDE marked as a signal trampoline (augmentation `S`, e.g. glibc's
//!   `__restore_rt`); the walker restores rip/rsp/rbp from the `ucontext` on the stack;
//! - `END`: the return address is undefined (`_start`, `clone`): the stack ends here;
//! - `UNSUPPORTED`: CFI exists but is none of the above; the walker stops and counts it;
//! - `NONE`: no CFI covers the address.
//!
//! The rbp rule (high nibble): `UNCHANGED`, `CFA_OFFSET` (saved at CFA +
//! [`UnwindRow::rbp_offset`], 8 * `aux` but for `RSP_LARGE`), or
//! `UNSUPPORTED`. The return address is always at CFA - 8: a row whose CFI says otherwise is
//! `UNSUPPORTED`.
//!
//! # BPF lookup contract
//!
//! For a runtime PC in a mapping of the file, userspace provides the mapping's load bias
//! (`bias = map_start + (p_offset - map_offset) - p_vaddr` for the `PT_LOAD` segment the
//! mapping holds). The walker computes `addr = pc - bias` (for frames above the leaf, the
//! return address minus one, so a call at the very end of a function finds that function's
//! row), gives up if `addr` does not fit in `u32`, and binary-searches the last row with
//! `row.pc <= addr`. No such row, or `UNWIND_CFA_NONE`, means "no unwind info".
//! [`UnwindTable::lookup`] is the reference implementation of that search, and
//! [`PageIndex::lookup`] of the one the walker does through the page index the kernel's copy
//! of a table carries ([`UnwindTable::page_index`]). Otherwise:
//! `cfa = base + cfa_offset`; `ra = *(cfa - 8)`; `rbp = *(cfa + rbp_offset)` if the rbp
//! rule is `CFA_OFFSET`; `rsp = cfa`.
//!
//! CFI comes from `.eh_frame` (FDEs enumerated through the sorted `.eh_frame_hdr` table
//! when present, which also finds `.eh_frame` in files without section headers through
//! `PT_GNU_EH_FRAME`) and from `.debug_frame` for the addresses `.eh_frame` does not cover.

mod compile;
mod elf;
mod lazy;
pub mod walk;

pub use elf::{DebugLinks, debug_links};
pub use lazy::rule_at;

use std::fmt;

pub use profiler_common::UnwindRow;
use profiler_common::{UNWIND_CFA_END, UNWIND_CFA_NONE, UNWIND_PAGE_SHIFT, UNWIND_PAGE_STEPS};

/// Why a file could not be compiled.
#[derive(Debug)]
pub enum Error {
    /// The bytes are not a readable ELF file.
    Elf(object::Error),
    /// A valid object file, but not 64-bit ELF (e.g. 32-bit ELF, PE, Mach-O).
    UnsupportedFormat(&'static str),
    /// Not x86-64 (`e_machine` value).
    UnsupportedMachine(u16),
    /// The ELF structure is inconsistent.
    Malformed(&'static str),
    /// No `.eh_frame` (also not via `PT_GNU_EH_FRAME`) and no `.debug_frame`.
    NoCfi,
    /// `.eh_frame_hdr` points to an `.eh_frame` outside the file's loaded segments.
    EhFrameNotFound(u64),
    /// Malformed CFI section.
    Cfi { section: &'static str, error: gimli::Error },
    /// Covered addresses do not fit the rows' 32-bit `pc`.
    AddressTooLarge(u64),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Elf(e) => write!(f, "not a readable ELF file: {e}"),
            Error::UnsupportedFormat(what) => write!(f, "unsupported object format: {what}"),
            Error::UnsupportedMachine(m) => {
                write!(f, "unsupported machine {m} (e_machine); only x86-64 (62) is supported")
            }
            Error::Malformed(what) => write!(f, "malformed ELF file: {what}"),
            Error::NoCfi => write!(f, "no call frame information (.eh_frame or .debug_frame)"),
            Error::EhFrameNotFound(addr) => write!(
                f,
                ".eh_frame_hdr points to .eh_frame at {addr:#x}, outside the loaded segments"
            ),
            Error::Cfi { section, error } => write!(f, "malformed {section}: {error}"),
            Error::AddressTooLarge(addr) => {
                write!(f, "CFI covers address {addr:#x}, beyond the table's 32-bit addresses")
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Elf(e) => Some(e),
            Error::Cfi { error, .. } => Some(error),
            _ => None,
        }
    }
}

impl From<object::Error> for Error {
    fn from(e: object::Error) -> Self {
        Error::Elf(e)
    }
}

/// CFI rows (before merging) whose rule the table cannot express, by cause.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Unsupported {
    /// CFA based on a register other than rsp and rbp.
    pub cfa_register: usize,
    /// CFA given by an expression other than the PLT form.
    pub cfa_expression: usize,
    /// CFA offset (or PLT parameters) outside the row's fields.
    pub cfa_offset_range: usize,
    /// Return address not at CFA - 8 (nor undefined), or not in register 16.
    pub return_address: usize,
    /// rbp rule other than unchanged or "saved at CFA + 8n": the row keeps its CFA rule.
    pub rbp: usize,
    /// FDEs whose instructions could not be evaluated: their whole range is unsupported.
    pub fde_errors: usize,
}

/// What a compilation produced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Rows in the table (after merging) and their size in bytes.
    pub rows: usize,
    pub bytes: usize,
    /// FDEs compiled, by section. A `.debug_frame` FDE only fills the addresses `.eh_frame`
    /// does not cover (and a separate debug file's those the file's own CFI does not): those
    /// that add nothing are not counted.
    pub eh_frame_fdes: usize,
    pub debug_frame_fdes: usize,
    pub separate_debug_frame_fdes: usize,
    /// Rows of the CFI (one per address range with its own rule), before merging.
    pub cfi_rows: usize,
    /// Signal-trampoline FDEs.
    pub signal_fdes: usize,
    /// CFI rows using the PLT expression.
    pub plt_rows: usize,
    /// CFI rows whose return address is undefined (end of stack).
    pub end_rows: usize,
    /// CFI rows of frames over 64 KiB (`UNWIND_CFA_RSP_LARGE`).
    pub large_frame_rows: usize,
    pub unsupported: Unsupported,
    /// Bytes of executable sections (executable `PT_LOAD` segments in files without section
    /// headers), and how many of them no row covers: code a separate debug file may describe.
    /// Only set by [`UnwindTable::from_elf`] and [`UnwindTable::from_elf_with_debug_frame`].
    pub code_bytes: u64,
    pub code_bytes_without_cfi: u64,
}

impl Stats {
    pub fn fdes(&self) -> usize {
        self.eh_frame_fdes + self.debug_frame_fdes + self.separate_debug_frame_fdes
    }
}

/// The raw CFI of one file: section contents and the virtual addresses they are loaded at.
#[derive(Clone, Copy, Debug, Default)]
pub struct CfiSections<'a> {
    /// `.eh_frame` at its address. May extend past the section's end when only
    /// `.eh_frame_hdr` locates it; FDEs are then reached through the hdr table.
    pub eh_frame: Option<(u64, &'a [u8])>,
    pub eh_frame_hdr: Option<(u64, &'a [u8])>,
    pub debug_frame: Option<&'a [u8]>,
    /// `.debug_frame` of the file's separate debug file (found by build-id or
    /// `.gnu_debuglink`): same link-time addresses; fills what the file's own CFI leaves.
    pub separate_debug_frame: Option<&'a [u8]>,
    /// Bases for `DW_EH_PE_textrel` / `DW_EH_PE_datarel` pointers, when known.
    pub text_address: Option<u64>,
    pub got_address: Option<u64>,
}

/// A compiled unwind table for one file.
#[derive(Clone, Debug)]
pub struct UnwindTable {
    rows: Vec<UnwindRow>,
    stats: Stats,
}

impl UnwindTable {
    /// Compiles the CFI of an x86-64 ELF file (its complete bytes).
    pub fn from_elf(data: &[u8]) -> Result<UnwindTable, Error> {
        UnwindTable::from_elf_with_debug_frame(data, None)
    }

    /// Compiles the CFI of an x86-64 ELF file plus the `.debug_frame` of its separate debug
    /// file (read by the caller, which knows where debug files are installed), which only fills the addresses the file's own CFI does
    /// not cover.
    pub fn from_elf_with_debug_frame(
        data: &[u8],
        separate_debug_frame: Option<&[u8]>,
    ) -> Result<UnwindTable, Error> {
        let sections = elf::cfi_sections(data)?;
        let mut table =
            UnwindTable::from_sections(&CfiSections { separate_debug_frame, ..sections })?;
        let code = elf::code_ranges(data)?;
        table.stats.code_bytes = code.iter().map(|(s, e)| e - s).sum();
        table.stats.code_bytes_without_cfi = table.uncovered(&code);
        // e_entry of an ELF64 header.
        if let Some(entry) = data.get(24..32).and_then(|b| b.try_into().ok()) {
            table.mark_entry(u64::from_le_bytes(entry));
        }
        Ok(table)
    }

    /// Control enters a program at its ELF entry point with no caller, so code there without
    /// CFI is the outermost frame: ld.so's `_start` and the `_dl_start_user` after it (hand-
    /// written, no CFI) are where every dynamically linked process's first samples are, and
    /// their stacks end there complete. The CFI gap from the entry point on becomes an
    /// end-of-stack row; an entry point that CFI covers (crt1's `_start` marks its return
    /// address undefined) is left as it is.
    fn mark_entry(&mut self, entry: u64) {
        let Ok(entry) = u32::try_from(entry) else { return };
        if entry == 0 {
            return;
        }
        let after = self.rows.partition_point(|row| row.pc <= entry);
        let end = UnwindRow::new(entry, UNWIND_CFA_END, 0, 0, 0);
        match after.checked_sub(1).map(|i| (i, self.rows[i])) {
            Some((_, row)) if row.cfa_kind() != UNWIND_CFA_NONE => return,
            Some((i, row)) if row.pc == entry => self.rows[i] = end,
            _ => {
                self.rows.insert(after, end);
                if after + 1 == self.rows.len() {
                    // Nothing after it: the gap is bounded by a guess at the entry code's size.
                    self.rows.push(UnwindRow::new(
                        entry.saturating_add(256),
                        UNWIND_CFA_NONE,
                        0,
                        0,
                        0,
                    ));
                }
            }
        }
        self.stats.rows = self.rows.len();
        self.stats.bytes = std::mem::size_of_val(self.rows.as_slice());
    }

    /// Compiles already located CFI sections (x86-64, little-endian).
    pub fn from_sections(sections: &CfiSections<'_>) -> Result<UnwindTable, Error> {
        if sections.eh_frame.is_none()
            && sections.debug_frame.is_none()
            && sections.separate_debug_frame.is_none()
        {
            return Err(Error::NoCfi);
        }
        let (rows, mut stats) = compile::compile(sections)?;
        stats.rows = rows.len();
        stats.bytes = std::mem::size_of_val(rows.as_slice());
        Ok(UnwindTable { rows, stats })
    }

    /// The rows, sorted by `pc`; the form the BPF maps receive.
    pub fn rows(&self) -> &[UnwindRow] {
        &self.rows
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Bytes of `ranges` (sorted, disjoint) that no row with a rule covers.
    fn uncovered(&self, ranges: &[(u64, u64)]) -> u64 {
        let mut total = 0;
        for &(start, end) in ranges {
            let mut at = start;
            while at < end {
                // The row in force at `at`, and where the next one starts.
                let next = self.rows.partition_point(|row| u64::from(row.pc) <= at);
                let until = self.rows.get(next).map_or(end, |row| u64::from(row.pc).min(end));
                let covered = next > 0 && self.rows[next - 1].cfa_kind() != UNWIND_CFA_NONE;
                if !covered {
                    total += until - at;
                }
                at = until;
            }
        }
        total
    }

    /// The page index the kernel's copy of the table carries after its rows (see
    /// `profiler_common::UNWIND_PAGE_SHIFT`): for each page from the first row's to the last
    /// row's, the index of the row in force at the page's start (0 before the first row),
    /// then the last row's index.
    pub fn page_index(&self) -> PageIndex {
        PageIndex::of(&self.rows)
    }

    /// The row whose rule applies at the file-relative virtual address `addr`, or `None`
    /// when no CFI covers it. Reference for the BPF binary search.
    pub fn lookup(&self, addr: u64) -> Option<UnwindRow> {
        let addr = u32::try_from(addr).ok()?;
        // Index of the first row with pc > addr; the row before it applies.
        let after = self.rows.partition_point(|row| row.pc <= addr);
        let row = *self.rows.get(after.checked_sub(1)?)?;
        (row.cfa_kind() != UNWIND_CFA_NONE).then_some(row)
    }
}

/// A table's page index, as the kernel's rows array holds it after the table's rows: entry
/// `p` (in its `pc`) is the index of the row in force at the start of page `base + p`; one
/// more entry at the end holds the last row's index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageIndex {
    pub base: u32,
    pub entries: Vec<UnwindRow>,
}

impl PageIndex {
    /// The index of `rows` (sorted by strictly increasing `pc`).
    pub fn of(rows: &[UnwindRow]) -> PageIndex {
        let (Some(first), Some(last)) = (rows.first(), rows.last()) else {
            return PageIndex { base: 0, entries: Vec::new() };
        };
        let base = first.pc >> UNWIND_PAGE_SHIFT;
        let pages = (last.pc >> UNWIND_PAGE_SHIFT) - base + 1;
        let mut entries = Vec::with_capacity(pages as usize);
        let mut row = 0usize;
        for p in 0..pages {
            let start = (base + p) << UNWIND_PAGE_SHIFT;
            while row + 1 < rows.len() && rows[row + 1].pc <= start {
                row += 1;
            }
            entries.push(UnwindRow { pc: row as u32, ..UnwindRow::default() });
        }
        // The end of the last page's rows: the last row.
        entries.push(UnwindRow { pc: rows.len() as u32 - 1, ..UnwindRow::default() });
        PageIndex { base, entries }
    }

    /// The search the BPF walker does (`find_row` in profiler-ebpf), step for step, with its
    /// bounded number of halvings: the row in force at `addr`, gaps included
    /// (`UNWIND_CFA_NONE` rows are returned), `None` before the first row.
    pub fn lookup(&self, rows: &[UnwindRow], addr: u32) -> Option<UnwindRow> {
        let page = addr >> UNWIND_PAGE_SHIFT;
        let pages = self.entries.len().checked_sub(1)?;
        let p = (page.checked_sub(self.base)? as usize).min(pages.checked_sub(1)?);
        let (mut lo, hi) = (self.entries[p].pc, self.entries[p + 1].pc);
        let mut n = hi.wrapping_sub(lo).wrapping_add(1);
        for _ in 0..UNWIND_PAGE_STEPS {
            if n <= 1 {
                break;
            }
            let half = n / 2;
            if rows.get(lo.wrapping_add(half) as usize)?.pc <= addr {
                lo += half;
                n -= half;
            } else {
                n = half;
            }
        }
        let row = *rows.get(lo as usize)?;
        (row.pc <= addr).then_some(row)
    }
}
