//! Rare CFI rules, written with gimli's write API and compiled from the bytes.

use gimli::write::{
    Address, CallFrameInstruction as Cfi, CommonInformationEntry, DebugFrame, EhFrame, EndianVec,
    Expression, FrameDescriptionEntry, FrameTable,
};
use gimli::{Encoding, Format, LittleEndian, Register, X86_64};
use profiler_common::*;
use profiler_unwind::{CfiSections, UnwindTable};

const RSP: Register = X86_64::RSP;
const RBP: Register = X86_64::RBP;
const RA: Register = X86_64::RA;

fn cie(version: u16) -> CommonInformationEntry {
    let encoding = Encoding { format: Format::Dwarf32, version, address_size: 8 };
    let mut cie = CommonInformationEntry::new(encoding, 1, -8, RA);
    cie.add_instruction(Cfi::Cfa(RSP, 8));
    cie.add_instruction(Cfi::Offset(RA, -8));
    cie
}

/// `DW_OP_breg7 (rsp) 8; DW_OP_breg16 (rip) 0; DW_OP_lit15; DW_OP_and; DW_OP_lit11;
/// DW_OP_ge; DW_OP_lit3; DW_OP_shl; DW_OP_plus`, as binutils writes it for `.plt`.
fn plt_expression(threshold: u8) -> Expression {
    let mut e = Expression::new();
    e.op_breg(RSP, 8);
    e.op_breg(RA, 0);
    e.op(gimli::DW_OP_lit15);
    e.op(gimli::DW_OP_and);
    e.op(gimli::DwOp(gimli::DW_OP_lit0.0 + threshold));
    e.op(gimli::DW_OP_ge);
    e.op(gimli::DW_OP_lit3);
    e.op(gimli::DW_OP_shl);
    e.op(gimli::DW_OP_plus);
    e
}

/// The test functions, by address:
/// - 0x1000..0x1020 `push rbp; mov rbp, rsp; ...; leave; ret` (rbp-based CFA);
/// - gap until 0x2000;
/// - 0x2000..0x2040 a PLT (PLT0 then 3 stubs);
/// - 0x3000..0x3010 a signal trampoline;
/// - 0x4000..0x4010 CFA = *(rsp + 160) (an expression the table cannot express);
/// - 0x5000..0x5010 CFA = r10 + 0;
/// - 0x6000..0x6010 return address undefined (like `_start`);
/// - 0x7000..0x7010 rbp in rbx (register rule).
fn frame_table(version: u16) -> FrameTable {
    let mut table = FrameTable::default();
    let normal = table.add_cie(cie(version));
    let mut signal_cie = cie(version);
    signal_cie.signal_trampoline = true;
    let signal = table.add_cie(signal_cie);

    let mut f = FrameDescriptionEntry::new(Address::Constant(0x1000), 0x20);
    f.add_instruction(1, Cfi::CfaOffset(16));
    f.add_instruction(1, Cfi::Offset(RBP, -16));
    f.add_instruction(4, Cfi::CfaRegister(RBP));
    f.add_instruction(0x1e, Cfi::Cfa(RSP, 8));
    table.add_fde(normal, f);

    let mut plt = FrameDescriptionEntry::new(Address::Constant(0x2000), 0x40);
    plt.add_instruction(0, Cfi::CfaOffset(16));
    plt.add_instruction(6, Cfi::CfaOffset(24));
    plt.add_instruction(16, Cfi::CfaExpression(plt_expression(11)));
    table.add_fde(normal, plt);

    table.add_fde(signal, FrameDescriptionEntry::new(Address::Constant(0x3000), 0x10));

    let mut deref = Expression::new();
    deref.op_breg(RSP, 160);
    deref.op_deref();
    let mut f = FrameDescriptionEntry::new(Address::Constant(0x4000), 0x10);
    f.add_instruction(2, Cfi::CfaExpression(deref));
    table.add_fde(normal, f);

    let mut f = FrameDescriptionEntry::new(Address::Constant(0x5000), 0x10);
    f.add_instruction(2, Cfi::Cfa(X86_64::R10, 0));
    table.add_fde(normal, f);

    let mut f = FrameDescriptionEntry::new(Address::Constant(0x6000), 0x10);
    f.add_instruction(0, Cfi::Undefined(RA));
    table.add_fde(normal, f);

    let mut f = FrameDescriptionEntry::new(Address::Constant(0x7000), 0x10);
    f.add_instruction(3, Cfi::Register(RBP, X86_64::RBX));
    table.add_fde(normal, f);
    table
}

fn eh_frame_bytes(table: &FrameTable) -> Vec<u8> {
    let mut eh = EhFrame(EndianVec::new(LittleEndian));
    table.write_eh_frame(&mut eh).unwrap();
    eh.0.into_vec()
}

fn from_eh_frame(bytes: &[u8]) -> UnwindTable {
    UnwindTable::from_sections(&CfiSections {
        eh_frame: Some((0x10_0000, bytes)),
        ..Default::default()
    })
    .unwrap()
}

fn kind(table: &UnwindTable, addr: u64) -> Option<(u8, u16, u8, i64)> {
    table.lookup(addr).map(|r| (r.cfa_kind(), r.cfa_offset, r.rbp_kind(), r.rbp_offset()))
}

fn check(table: &UnwindTable) {
    let unchanged = UNWIND_RBP_UNCHANGED;
    let saved = UNWIND_RBP_CFA_OFFSET;
    assert_eq!(kind(table, 0xfff), None, "before the first FDE");
    assert_eq!(kind(table, 0x1000), Some((UNWIND_CFA_RSP, 8, unchanged, 0)));
    assert_eq!(kind(table, 0x1001), Some((UNWIND_CFA_RSP, 16, saved, -16)));
    assert_eq!(kind(table, 0x1003), Some((UNWIND_CFA_RSP, 16, saved, -16)));
    assert_eq!(kind(table, 0x1004), Some((UNWIND_CFA_RBP, 16, saved, -16)));
    assert_eq!(kind(table, 0x101d), Some((UNWIND_CFA_RBP, 16, saved, -16)));
    assert_eq!(kind(table, 0x101e), Some((UNWIND_CFA_RSP, 8, saved, -16)));
    assert_eq!(kind(table, 0x1020), None, "gap after a function is not that function");
    assert_eq!(kind(table, 0x1fff), None);

    assert_eq!(kind(table, 0x2000), Some((UNWIND_CFA_RSP, 16, unchanged, 0)));
    assert_eq!(kind(table, 0x2006), Some((UNWIND_CFA_RSP, 24, unchanged, 0)));
    for addr in [0x2010, 0x201b, 0x203f] {
        let r = table.lookup(addr).unwrap();
        assert_eq!((r.cfa_kind(), r.cfa_offset, r.aux), (UNWIND_CFA_PLT, 8, 11), "{addr:#x}");
    }
    assert_eq!(kind(table, 0x2040), None);

    assert_eq!(kind(table, 0x3000).unwrap().0, UNWIND_CFA_SIGNAL);
    assert_eq!(kind(table, 0x300f).unwrap().0, UNWIND_CFA_SIGNAL);
    assert_eq!(kind(table, 0x4001).unwrap().0, UNWIND_CFA_RSP);
    assert_eq!(kind(table, 0x4002).unwrap().0, UNWIND_CFA_UNSUPPORTED);
    assert_eq!(kind(table, 0x5002).unwrap().0, UNWIND_CFA_UNSUPPORTED);
    assert_eq!(kind(table, 0x6000).unwrap().0, UNWIND_CFA_END);
    assert_eq!(kind(table, 0x7002), Some((UNWIND_CFA_RSP, 8, unchanged, 0)));
    assert_eq!(kind(table, 0x7003), Some((UNWIND_CFA_RSP, 8, UNWIND_RBP_UNSUPPORTED, 0)));
    assert_eq!(kind(table, 0x7010), None);

    let stats = table.stats();
    assert_eq!(stats.signal_fdes, 1);
    assert_eq!(stats.plt_rows, 1);
    assert_eq!(stats.end_rows, 1);
    assert_eq!(stats.unsupported.cfa_expression, 1);
    assert_eq!(stats.unsupported.cfa_register, 1);
    assert_eq!(stats.unsupported.rbp, 1);
    assert_eq!(stats.unsupported.return_address, 0);
    assert_eq!(stats.unsupported.fde_errors, 0);
    assert_eq!(stats.bytes, 8 * stats.rows);
}

#[test]
fn eh_frame_rules() {
    let table = from_eh_frame(&eh_frame_bytes(&frame_table(1)));
    assert_eq!(table.stats().eh_frame_fdes, 7);
    check(&table);
}

#[test]
fn debug_frame_rules() {
    let mut debug = DebugFrame(EndianVec::new(LittleEndian));
    frame_table(4).write_debug_frame(&mut debug).unwrap();
    let bytes = debug.0.into_vec();
    let table = UnwindTable::from_sections(&CfiSections {
        debug_frame: Some(&bytes),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(table.stats().debug_frame_fdes, 7);
    check(&table);
}

/// `.debug_frame` only fills what `.eh_frame` leaves uncovered.
#[test]
fn debug_frame_fills_gaps_only() {
    let mut eh_table = FrameTable::default();
    let c = eh_table.add_cie(cie(1));
    eh_table.add_fde(c, FrameDescriptionEntry::new(Address::Constant(0x1000), 0x10));
    let eh = eh_frame_bytes(&eh_table);

    let mut debug_table = FrameTable::default();
    let c = debug_table.add_cie(cie(4));
    let mut overlapping = FrameDescriptionEntry::new(Address::Constant(0x1000), 0x10);
    overlapping.add_instruction(0, Cfi::CfaOffset(64));
    debug_table.add_fde(c, overlapping);
    let mut other = FrameDescriptionEntry::new(Address::Constant(0x1010), 0x10);
    other.add_instruction(0, Cfi::CfaOffset(32));
    debug_table.add_fde(c, other);
    let mut debug = DebugFrame(EndianVec::new(LittleEndian));
    debug_table.write_debug_frame(&mut debug).unwrap();
    let debug = debug.0.into_vec();

    let table = UnwindTable::from_sections(&CfiSections {
        eh_frame: Some((0x10_0000, &eh)),
        debug_frame: Some(&debug),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(kind(&table, 0x1000), Some((UNWIND_CFA_RSP, 8, UNWIND_RBP_UNCHANGED, 0)));
    assert_eq!(kind(&table, 0x1010), Some((UNWIND_CFA_RSP, 32, UNWIND_RBP_UNCHANGED, 0)));
    assert_eq!((table.stats().eh_frame_fdes, table.stats().debug_frame_fdes), (1, 1));
}

/// Only the exact PLT form is the PLT rule: another threshold keeps its value, another
/// operation is unsupported.
#[test]
fn plt_expression_variants() {
    let mut t = FrameTable::default();
    let c = t.add_cie(cie(1));
    let mut f = FrameDescriptionEntry::new(Address::Constant(0x1000), 0x10);
    f.add_instruction(0, Cfi::CfaExpression(plt_expression(10)));
    t.add_fde(c, f);
    let mut wrong = plt_expression(11);
    wrong.op(gimli::DW_OP_deref);
    let mut f = FrameDescriptionEntry::new(Address::Constant(0x2000), 0x10);
    f.add_instruction(0, Cfi::CfaExpression(wrong));
    t.add_fde(c, f);
    let table = from_eh_frame(&eh_frame_bytes(&t));
    let r = table.lookup(0x1000).unwrap();
    assert_eq!((r.cfa_kind(), r.cfa_offset, r.aux), (UNWIND_CFA_PLT, 8, 10));
    assert_eq!(table.lookup(0x2000).unwrap().cfa_kind(), UNWIND_CFA_UNSUPPORTED);
}

#[test]
fn no_cfi_and_corrupt_cfi_are_errors() {
    let err = UnwindTable::from_sections(&CfiSections::default()).unwrap_err();
    assert!(err.to_string().contains("no call frame information"), "{err}");

    let mut bytes = eh_frame_bytes(&frame_table(1));
    bytes.truncate(bytes.len() - 7);
    let err = UnwindTable::from_sections(&CfiSections {
        eh_frame: Some((0x10_0000, &bytes)),
        ..Default::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains(".eh_frame"), "{err}");
}

#[test]
fn addresses_beyond_32_bits_are_rejected() {
    let mut t = FrameTable::default();
    let c = t.add_cie(cie(1));
    t.add_fde(c, FrameDescriptionEntry::new(Address::Constant(0x1_0000_0000), 0x10));
    let err = UnwindTable::from_sections(&CfiSections {
        eh_frame: Some((0x10_0000, &eh_frame_bytes(&t))),
        ..Default::default()
    })
    .unwrap_err();
    assert!(matches!(err, profiler_unwind::Error::AddressTooLarge(0x1_0000_0000)), "{err}");
}

/// Overlapping FDEs (broken linkers, hand-written asm): the one starting later wins from its
/// start to its end; the earlier one's rest is not trusted after that.
#[test]
fn overlapping_fdes() {
    let mut t = FrameTable::default();
    let c = t.add_cie(cie(1));
    let mut outer = FrameDescriptionEntry::new(Address::Constant(0x1000), 0x100);
    outer.add_instruction(0x80, Cfi::CfaOffset(16));
    t.add_fde(c, outer);
    let mut inner = FrameDescriptionEntry::new(Address::Constant(0x1040), 0x10);
    inner.add_instruction(0, Cfi::CfaOffset(48));
    t.add_fde(c, inner);
    let table = from_eh_frame(&eh_frame_bytes(&t));
    let rsp = |off| Some((UNWIND_CFA_RSP, off, UNWIND_RBP_UNCHANGED, 0));
    assert_eq!(kind(&table, 0x103f), rsp(8));
    assert_eq!(kind(&table, 0x1040), rsp(48));
    assert_eq!(kind(&table, 0x1050), None);
    assert_eq!(kind(&table, 0x1080), rsp(16));
    assert_eq!(kind(&table, 0x1100), None);
}

fn one_fde_table(start: u64, len: u32, instructions: &[(u32, Cfi)]) -> UnwindTable {
    let mut t = FrameTable::default();
    let c = t.add_cie(cie(1));
    let mut f = FrameDescriptionEntry::new(Address::Constant(start), len);
    for (offset, instruction) in instructions {
        f.add_instruction(*offset, instruction.clone());
    }
    t.add_fde(c, f);
    from_eh_frame(&eh_frame_bytes(&t))
}

/// An early return inside a function (`remember_state` before its epilogue, `restore_state`
/// after the `ret`): the code after the `ret` gets the body's rule back, rbp slot included.
#[test]
fn remember_and_restore_state() {
    let table = one_fde_table(
        0x8000,
        0x20,
        &[
            (1, Cfi::CfaOffset(16)),
            (1, Cfi::Offset(RBP, -16)),
            (4, Cfi::CfaOffset(48)),
            (10, Cfi::RememberState),
            (10, Cfi::CfaOffset(16)),
            (11, Cfi::Restore(RBP)),
            (11, Cfi::CfaOffset(8)),
            (12, Cfi::RestoreState),
            (0x1e, Cfi::CfaOffset(16)),
        ],
    );
    let saved = UNWIND_RBP_CFA_OFFSET;
    let unchanged = UNWIND_RBP_UNCHANGED;
    assert_eq!(kind(&table, 0x8000), Some((UNWIND_CFA_RSP, 8, unchanged, 0)));
    assert_eq!(kind(&table, 0x8001), Some((UNWIND_CFA_RSP, 16, saved, -16)));
    assert_eq!(kind(&table, 0x8009), Some((UNWIND_CFA_RSP, 48, saved, -16)));
    assert_eq!(kind(&table, 0x800a), Some((UNWIND_CFA_RSP, 16, saved, -16)));
    assert_eq!(kind(&table, 0x800b), Some((UNWIND_CFA_RSP, 8, unchanged, 0)));
    assert_eq!(kind(&table, 0x800c), Some((UNWIND_CFA_RSP, 48, saved, -16)), "restored");
    assert_eq!(kind(&table, 0x801d), Some((UNWIND_CFA_RSP, 48, saved, -16)));
    assert_eq!(kind(&table, 0x801e), Some((UNWIND_CFA_RSP, 16, saved, -16)));
    assert_eq!(kind(&table, 0x8020), None);
    assert_eq!(table.stats().cfi_rows, 7);
    assert_eq!(table.stats().unsupported, Default::default());
}

/// Offsets at and past the limits of the row's fields: the CFA offset is a u16, the rbp slot
/// an i8 count of 8-byte words.
#[test]
fn large_offsets() {
    let table = one_fde_table(
        0x9000,
        0x60,
        &[
            (0x10, Cfi::CfaOffset(65535)),
            (0x20, Cfi::CfaOffset(65536)),
            (0x30, Cfi::CfaOffset(64)),
            (0x30, Cfi::Offset(RBP, -1024)),
            (0x40, Cfi::Offset(RBP, -1032)),
        ],
    );
    let unchanged = UNWIND_RBP_UNCHANGED;
    assert_eq!(kind(&table, 0x9010), Some((UNWIND_CFA_RSP, 65535, unchanged, 0)));
    let r = table.lookup(0x9020).unwrap();
    assert_eq!((r.cfa_kind(), r.large_cfa_offset()), (UNWIND_CFA_RSP_LARGE, 65536), "> u16");
    assert_eq!(kind(&table, 0x9030), Some((UNWIND_CFA_RSP, 64, UNWIND_RBP_CFA_OFFSET, -1024)));
    // The CFA is still known: the walker can go on while rbp is lost.
    assert_eq!(kind(&table, 0x9040), Some((UNWIND_CFA_RSP, 64, UNWIND_RBP_UNSUPPORTED, 0)));
    let u = table.stats().unsupported;
    assert_eq!((u.cfa_offset_range, u.rbp), (0, 1), "{u:?}");
    assert_eq!(table.stats().large_frame_rows, 1);

    // rbp saved at CFA - 12: not a whole slot (needs a CIE whose data alignment allows it).
    let mut t = FrameTable::default();
    let encoding = Encoding { format: Format::Dwarf32, version: 1, address_size: 8 };
    let mut fine = CommonInformationEntry::new(encoding, 1, -4, RA);
    fine.add_instruction(Cfi::Cfa(RSP, 8));
    fine.add_instruction(Cfi::Offset(RA, -8));
    let c = t.add_cie(fine);
    let mut f = FrameDescriptionEntry::new(Address::Constant(0x9100), 0x10);
    f.add_instruction(4, Cfi::Offset(RBP, -12));
    t.add_fde(c, f);
    let table = from_eh_frame(&eh_frame_bytes(&t));
    assert_eq!(kind(&table, 0x9100), Some((UNWIND_CFA_RSP, 8, unchanged, 0)));
    assert_eq!(kind(&table, 0x9104), Some((UNWIND_CFA_RSP, 8, UNWIND_RBP_UNSUPPORTED, 0)));
    assert_eq!(table.stats().unsupported.rbp, 1);

    // An rbp-based CFA far from rbp, and a negative one (below its base: never on x86-64).
    let table =
        one_fde_table(0xa000, 0x30, &[(0x10, Cfi::Cfa(RBP, 100_000)), (0x20, Cfi::Cfa(RBP, -16))]);
    assert_eq!(kind(&table, 0xa010).unwrap().0, UNWIND_CFA_UNSUPPORTED);
    assert_eq!(kind(&table, 0xa020).unwrap().0, UNWIND_CFA_UNSUPPORTED);
    assert_eq!(table.stats().unsupported.cfa_offset_range, 2);
}

/// Frames over 64 KiB (rustc's `run_compiler` closure: CFA = rsp + 540,080, rbp at CFA - 16)
/// are `RSP_LARGE` rows up to 8 MiB in 8-byte steps, with an rbp slot of -64..=+56 bytes;
/// beyond that they stay unsupported, counted.
#[test]
fn frames_over_64_kib() {
    let table = one_fde_table(
        0xd000,
        0x70,
        &[
            (0x01, Cfi::CfaOffset(16)),
            (0x01, Cfi::Offset(RBP, -16)),
            (0x10, Cfi::CfaOffset(540_080)),
            (0x20, Cfi::CfaOffset(8 * ((1 << 20) - 1))),
            (0x30, Cfi::CfaOffset(540_084)),
            (0x40, Cfi::CfaOffset(8 << 20)),
            (0x50, Cfi::CfaOffset(540_080)),
            (0x50, Cfi::Offset(RBP, -72)),
            (0x60, Cfi::Offset(RBP, 56)),
        ],
    );
    let large = |addr| {
        let r = table.lookup(addr).unwrap();
        (r.cfa_kind(), r.large_cfa_offset(), r.rbp_kind(), r.rbp_offset())
    };
    let saved = UNWIND_RBP_CFA_OFFSET;
    assert_eq!(kind(&table, 0xd001), Some((UNWIND_CFA_RSP, 16, saved, -16)));
    assert_eq!(large(0xd010), (UNWIND_CFA_RSP_LARGE, 540_080, saved, -16));
    assert_eq!(large(0xd020), (UNWIND_CFA_RSP_LARGE, UNWIND_LARGE_CFA_MAX, saved, -16));
    assert_eq!(kind(&table, 0xd030).unwrap().0, UNWIND_CFA_UNSUPPORTED, "not 8-byte steps");
    assert_eq!(kind(&table, 0xd040).unwrap().0, UNWIND_CFA_UNSUPPORTED, "over 8 MiB");
    // rbp 72 bytes below the CFA: out of the 4-bit slot; the CFA is still followed.
    assert_eq!(large(0xd050), (UNWIND_CFA_RSP_LARGE, 540_080, UNWIND_RBP_UNSUPPORTED, 0));
    assert_eq!(large(0xd060), (UNWIND_CFA_RSP_LARGE, 540_080, saved, 56));
    let stats = table.stats();
    assert_eq!(stats.large_frame_rows, 4);
    assert_eq!((stats.unsupported.cfa_offset_range, stats.unsupported.rbp), (2, 1));

    // An rbp-based CFA never gets the large form: rbp frames are small.
    let table = one_fde_table(0xe000, 0x10, &[(0, Cfi::Cfa(RBP, 540_080))]);
    assert_eq!(kind(&table, 0xe000).unwrap().0, UNWIND_CFA_UNSUPPORTED);
}

/// The return address somewhere other than CFA - 8 (a register, another slot) cannot be
/// followed; neither can a CIE naming another return address column.
#[test]
fn other_return_address_rules_are_unsupported() {
    let table = one_fde_table(
        0xb000,
        0x30,
        &[
            (0x10, Cfi::Offset(RA, -16)),
            (0x20, Cfi::Register(RA, X86_64::RBX)),
            (0x28, Cfi::Offset(RA, -8)),
        ],
    );
    assert_eq!(kind(&table, 0xb000), Some((UNWIND_CFA_RSP, 8, UNWIND_RBP_UNCHANGED, 0)));
    assert_eq!(kind(&table, 0xb010).unwrap().0, UNWIND_CFA_UNSUPPORTED);
    assert_eq!(kind(&table, 0xb020).unwrap().0, UNWIND_CFA_UNSUPPORTED);
    assert_eq!(kind(&table, 0xb028), Some((UNWIND_CFA_RSP, 8, UNWIND_RBP_UNCHANGED, 0)));
    assert_eq!(table.stats().unsupported.return_address, 2);

    let mut t = FrameTable::default();
    let encoding = Encoding { format: Format::Dwarf32, version: 1, address_size: 8 };
    let mut odd = CommonInformationEntry::new(encoding, 1, -8, X86_64::RBX);
    odd.add_instruction(Cfi::Cfa(RSP, 8));
    let c = t.add_cie(odd);
    t.add_fde(c, FrameDescriptionEntry::new(Address::Constant(0xc000), 0x10));
    let table = from_eh_frame(&eh_frame_bytes(&t));
    assert_eq!(kind(&table, 0xc000).unwrap().0, UNWIND_CFA_UNSUPPORTED);
    assert_eq!(kind(&table, 0xc00f).unwrap().0, UNWIND_CFA_UNSUPPORTED);
    assert_eq!(table.stats().unsupported.return_address, 1);
}

/// A signal frame is one rule over the whole FDE, whatever rows its instructions describe
/// (glibc's `__restore_rt` describes the `ucontext` with expressions for every register).
#[test]
fn signal_fde_with_instructions_is_one_signal_rule() {
    let mut t = FrameTable::default();
    let mut signal = cie(1);
    signal.signal_trampoline = true;
    let c = t.add_cie(signal);
    let mut deref = Expression::new();
    deref.op_breg(RSP, 160);
    deref.op_deref();
    let mut f = FrameDescriptionEntry::new(Address::Constant(0xd000), 0x10);
    f.add_instruction(0, Cfi::CfaExpression(deref));
    f.add_instruction(4, Cfi::Offset(RBP, -40));
    t.add_fde(c, f);
    let table = from_eh_frame(&eh_frame_bytes(&t));
    for addr in [0xd000, 0xd004, 0xd00f] {
        assert_eq!(kind(&table, addr).unwrap().0, UNWIND_CFA_SIGNAL, "{addr:#x}");
    }
    assert_eq!(kind(&table, 0xd010), None);
    let stats = table.stats();
    assert_eq!((stats.signal_fdes, stats.unsupported.cfa_expression), (1, 0));
}

/// The PLT rule keeps the expression's own offset and threshold (binutils' `.plt.sec` and
/// IBT PLTs use other thresholds), but a PLT row cannot also say where rbp is.
#[test]
fn plt_offsets_thresholds_and_rbp() {
    let mut expr = Expression::new();
    expr.op_breg(RSP, 24);
    expr.op_breg(RA, 0);
    expr.op(gimli::DW_OP_lit15);
    expr.op(gimli::DW_OP_and);
    expr.op(gimli::DW_OP_lit10);
    expr.op(gimli::DW_OP_ge);
    expr.op(gimli::DW_OP_lit3);
    expr.op(gimli::DW_OP_shl);
    expr.op(gimli::DW_OP_plus);
    let table = one_fde_table(
        0xe000,
        0x40,
        &[
            (0x10, Cfi::CfaExpression(expr)),
            (0x20, Cfi::CfaExpression(plt_expression(11))),
            (0x20, Cfi::Offset(RBP, -16)),
        ],
    );
    let r = table.lookup(0xe010).unwrap();
    assert_eq!((r.cfa_kind(), r.cfa_offset, r.aux), (UNWIND_CFA_PLT, 24, 10));
    assert_eq!(kind(&table, 0xe020).unwrap().0, UNWIND_CFA_UNSUPPORTED);
    assert_eq!((table.stats().plt_rows, table.stats().unsupported.rbp), (1, 1));
}

/// A separate debug file's `.debug_frame` fills only what the file's own CFI leaves: an FDE
/// that half overlaps `.eh_frame` keeps its other half, and the file's own `.debug_frame`
/// wins over the separate one.
#[test]
fn separate_debug_frame_fills_the_rest_of_partly_covered_ranges() {
    let mut eh_table = FrameTable::default();
    let c = eh_table.add_cie(cie(1));
    eh_table.add_fde(c, FrameDescriptionEntry::new(Address::Constant(0x1000), 0x10));
    let eh = eh_frame_bytes(&eh_table);

    let debug_bytes = |fdes: &[(u64, u32, i32)]| {
        let mut t = FrameTable::default();
        let c = t.add_cie(cie(4));
        for &(start, len, offset) in fdes {
            let mut f = FrameDescriptionEntry::new(Address::Constant(start), len);
            f.add_instruction(0, Cfi::CfaOffset(offset));
            t.add_fde(c, f);
        }
        let mut out = DebugFrame(EndianVec::new(LittleEndian));
        t.write_debug_frame(&mut out).unwrap();
        out.0.into_vec()
    };
    let own = debug_bytes(&[(0x1020, 0x10, 48)]);
    let separate = debug_bytes(&[(0x1008, 0x18, 32), (0x1020, 0x10, 64), (0x1040, 0x10, 16)]);
    let table = UnwindTable::from_sections(&CfiSections {
        eh_frame: Some((0x10_0000, &eh)),
        debug_frame: Some(&own),
        separate_debug_frame: Some(&separate),
        ..Default::default()
    })
    .unwrap();
    let rsp = |offset| Some((UNWIND_CFA_RSP, offset, UNWIND_RBP_UNCHANGED, 0));
    assert_eq!(kind(&table, 0x1008), rsp(8), ".eh_frame wins where it covers");
    assert_eq!(kind(&table, 0x1010), rsp(32), "the rest of the overlapping FDE");
    assert_eq!(kind(&table, 0x1020), rsp(48), "the file's own .debug_frame wins");
    assert_eq!(kind(&table, 0x1040), rsp(16));
    assert_eq!(kind(&table, 0x1030), None);
    let s = table.stats();
    assert_eq!((s.eh_frame_fdes, s.debug_frame_fdes, s.separate_debug_frame_fdes), (1, 1, 2));
}
