//! One address's rule computed from its FDE alone, found through `.eh_frame_hdr`'s sorted
//! table in O(log n): what a stack copy's walk needs from a file whose whole table is not
//! built yet (a 150 MB library's takes over a second), instead of waiting for all of it.
//! The rule is the one the compiled table would give (`compile::row_rule`), so a walk does
//! not depend on which of the two served it.

use gimli::{BaseAddresses, EhFrame, EhFrameHdr, LittleEndian, UnwindContext, UnwindSection as _};
use profiler_common::{UNWIND_CFA_END, UNWIND_CFA_SIGNAL, UNWIND_RBP_UNCHANGED, UnwindRow};

use crate::{
    Error, Stats,
    compile::{RIP, UNSUPPORTED, row_rule},
    elf,
};

/// How far past the ELF entry point code without CFI counts as the entry code (as
/// `UnwindTable::mark_entry` guesses when nothing follows it).
const ENTRY_CODE_BYTES: u64 = 256;

/// The rule at file-relative virtual address `addr` of the ELF file `data` (its complete
/// bytes, typically mapped), from `.eh_frame` through `.eh_frame_hdr`: `None` when no FDE
/// covers it (a gap); the entry point's code without CFI is the outermost frame. Files
/// without `.eh_frame_hdr`'s table are an error: the caller compiles them whole.
pub fn rule_at(data: &[u8], addr: u64) -> Result<Option<UnwindRow>, Error> {
    let sections = elf::cfi_sections(data)?;
    let (Some((eh_addr, eh_bytes)), Some((hdr_addr, hdr_bytes))) =
        (sections.eh_frame, sections.eh_frame_hdr)
    else {
        return Err(Error::NoCfi);
    };
    let mut eh = EhFrame::new(eh_bytes, LittleEndian);
    eh.set_address_size(8);
    let mut bases = BaseAddresses::default().set_eh_frame(eh_addr).set_eh_frame_hdr(hdr_addr);
    if let Some(text) = sections.text_address {
        bases = bases.set_text(text);
    }
    if let Some(got) = sections.got_address {
        bases = bases.set_got(got);
    }
    let hdr_error = |error| Error::Cfi { section: ".eh_frame_hdr", error };
    let hdr = EhFrameHdr::new(hdr_bytes, LittleEndian).parse(&bases, 8).map_err(hdr_error)?;
    let table = hdr.table().ok_or(Error::NoCfi)?;
    let fde = match table.fde_for_address(&eh, &bases, addr, EhFrame::cie_from_offset) {
        Ok(fde) => fde,
        Err(gimli::Error::NoUnwindInfoForAddress) => return Ok(entry_row(data, addr)),
        Err(error) => return Err(Error::Cfi { section: ".eh_frame", error }),
    };
    if fde.is_signal_trampoline() {
        return Ok(Some(UnwindRow::new(0, UNWIND_CFA_SIGNAL, 0, UNWIND_RBP_UNCHANGED, 0)));
    }
    if fde.cie().return_address_register() != RIP {
        return Ok(Some(UNSUPPORTED));
    }
    let mut ctx = Box::new(UnwindContext::new());
    let row = match fde.unwind_info_for_address(&eh, &bases, &mut ctx, addr) {
        Ok(row) => row,
        Err(gimli::Error::NoUnwindInfoForAddress) => return Ok(None),
        // As the compiler does: an FDE it cannot evaluate is unsupported throughout.
        Err(_) => return Ok(Some(UNSUPPORTED)),
    };
    Ok(Some(row_rule(&eh, fde.cie().encoding(), row, &mut Stats::default())))
}

/// The end-of-stack rule for code without CFI at the ELF entry point.
fn entry_row(data: &[u8], addr: u64) -> Option<UnwindRow> {
    let entry = u64::from_le_bytes(data.get(24..32)?.try_into().ok()?);
    (entry != 0 && (entry..entry + ENTRY_CODE_BYTES).contains(&addr))
        .then(|| UnwindRow::new(0, UNWIND_CFA_END, 0, 0, 0))
}

#[cfg(test)]
mod tests {
    use profiler_common::UNWIND_CFA_NONE;

    use super::*;
    use crate::UnwindTable;

    /// Every address of a real library's code: the FDE's own rule is the whole table's.
    #[test]
    fn each_address_gets_the_compiled_tables_rule() {
        for path in ["/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6"] {
            let data = std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"));
            let table = UnwindTable::from_elf(&data).unwrap();
            let rows = table.rows();
            let (mut checked, mut gaps) = (0, 0);
            // Each row's first address, one inside it, and its last.
            for (i, row) in rows.iter().enumerate().step_by(7) {
                let end = rows.get(i + 1).map_or(row.pc + 1, |n| n.pc);
                for addr in [row.pc, row.pc + (end - row.pc) / 2, end - 1] {
                    let lazy = rule_at(&data, u64::from(addr)).unwrap();
                    let whole = table.lookup(u64::from(addr));
                    match (lazy, whole) {
                        (Some(a), Some(b)) => {
                            assert!(a.same_rule(&b), "{path} {addr:#x}: {a:?} vs {b:?}")
                        }
                        (None, None) => gaps += 1,
                        (a, b) => panic!("{path} {addr:#x}: lazy {a:?}, whole {b:?}"),
                    }
                    checked += 1;
                }
            }
            assert!(
                checked > 1_000 && gaps < checked / 4,
                "{path}: {checked} checked, {gaps} gaps"
            );
            assert!(rows.last().is_some_and(|r| r.cfa_kind() == UNWIND_CFA_NONE));
        }
    }

    #[test]
    fn files_without_a_hdr_table_or_cfi_are_errors() {
        assert!(rule_at(b"not an elf", 0).is_err());
    }
}
