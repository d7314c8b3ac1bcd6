//! CFI rows -> table rows.

use gimli::{
    BaseAddresses, CfaRule, CieOrFde, DebugFrame, EhFrame, EhFrameHdr, EndianSlice, Expression,
    LittleEndian, Operation, Register, RegisterRule, UnwindContext, UnwindExpression,
    UnwindSection, UnwindTableRow, X86_64,
};
use profiler_common::{
    UNWIND_CFA_END, UNWIND_CFA_NONE, UNWIND_CFA_PLT, UNWIND_CFA_RBP, UNWIND_CFA_RSP,
    UNWIND_CFA_SIGNAL, UNWIND_CFA_UNSUPPORTED, UNWIND_LARGE_CFA_MAX, UNWIND_RBP_CFA_OFFSET,
    UNWIND_RBP_UNCHANGED, UNWIND_RBP_UNSUPPORTED, UnwindRow,
};

use crate::{CfiSections, Error, Stats};

pub(crate) type Slice<'a> = EndianSlice<'a, LittleEndian>;
type Fde<'a> = gimli::FrameDescriptionEntry<Slice<'a>>;

/// DWARF register 16 on x86-64: the return address column, which is also rip.
pub(crate) const RIP: Register = X86_64::RA;

/// One CFI rule over `[start, end)`; `rule.pc` is unused until merging.
struct Span {
    start: u64,
    end: u64,
    rule: UnwindRow,
}

pub(crate) const UNSUPPORTED: UnwindRow =
    UnwindRow::new(0, UNWIND_CFA_UNSUPPORTED, 0, UNWIND_RBP_UNCHANGED, 0);

pub(crate) fn compile(sections: &CfiSections<'_>) -> Result<(Vec<UnwindRow>, Stats), Error> {
    let mut stats = Stats::default();
    let mut spans = Vec::new();
    let mut ctx = Box::new(UnwindContext::new());

    // Address ranges already described, sorted and coalesced: `.eh_frame` first (what the
    // loader and debuggers trust), then the file's own `.debug_frame`, then a separate debug
    // file's. Each later section only fills what the earlier ones leave uncovered.
    let mut covered: Vec<(u64, u64)> = Vec::new();
    if let Some((eh_addr, eh_bytes)) = sections.eh_frame {
        let mut eh = EhFrame::new(eh_bytes, LittleEndian);
        eh.set_address_size(8);
        let mut bases = BaseAddresses::default().set_eh_frame(eh_addr);
        if let Some((hdr_addr, _)) = sections.eh_frame_hdr {
            bases = bases.set_eh_frame_hdr(hdr_addr);
        }
        if let Some(text) = sections.text_address {
            bases = bases.set_text(text);
        }
        if let Some(got) = sections.got_address {
            bases = bases.set_got(got);
        }
        let fdes = eh_frame_fdes(&eh, &bases, sections.eh_frame_hdr)?;
        for fde in &fdes {
            stats.eh_frame_fdes += 1;
            covered.push((fde.initial_address(), fde.end_address()));
            fde_spans(&eh, &bases, &mut ctx, fde, &mut stats, &mut spans);
        }
    }
    coalesce(&mut covered);

    for (bytes, separate) in [(sections.debug_frame, false), (sections.separate_debug_frame, true)]
    {
        let Some(bytes) = bytes else { continue };
        let section = if separate { "separate .debug_frame" } else { ".debug_frame" };
        let mut debug = DebugFrame::new(bytes, LittleEndian);
        debug.set_address_size(8);
        let bases = BaseAddresses::default();
        let fdes = all_fdes(&debug, &bases).map_err(|error| Error::Cfi { section, error })?;
        let mut added = Vec::new();
        for fde in &fdes {
            let mut fde_rows = Vec::new();
            fde_spans(&debug, &bases, &mut ctx, fde, &mut stats, &mut fde_rows);
            let before = spans.len();
            for span in fde_rows {
                clip(&covered, span, &mut spans);
            }
            if spans.len() > before {
                added.push((fde.initial_address(), fde.end_address()));
                if separate {
                    stats.separate_debug_frame_fdes += 1;
                } else {
                    stats.debug_frame_fdes += 1;
                }
            }
        }
        covered.extend(added);
        coalesce(&mut covered);
    }
    Ok((merge(spans)?, stats))
}

/// Sorts address ranges and merges those that overlap or touch.
fn coalesce(ranges: &mut Vec<(u64, u64)>) {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for &(start, end) in ranges.iter() {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    *ranges = out;
}

/// Appends the parts of `span` that no range of `covered` (sorted, coalesced) holds.
fn clip(covered: &[(u64, u64)], span: Span, out: &mut Vec<Span>) {
    let mut start = span.start;
    let first = covered.partition_point(|&(_, end)| end <= start);
    for &(c_start, c_end) in &covered[first..] {
        if c_start >= span.end {
            break;
        }
        if c_start > start {
            out.push(Span { start, end: c_start, rule: span.rule });
        }
        start = start.max(c_end);
        if start >= span.end {
            return;
        }
    }
    if start < span.end {
        out.push(Span { start, end: span.end, rule: span.rule });
    }
}

/// `.eh_frame` FDEs, through the `.eh_frame_hdr` table when there is one (it lists every
/// FDE and does not need the length of `.eh_frame`).
fn eh_frame_fdes<'a>(
    eh: &EhFrame<Slice<'a>>,
    bases: &BaseAddresses,
    hdr: Option<(u64, &'a [u8])>,
) -> Result<Vec<Fde<'a>>, Error> {
    let hdr_error = |error| Error::Cfi { section: ".eh_frame_hdr", error };
    if let Some((_, hdr_bytes)) = hdr {
        let parsed = EhFrameHdr::new(hdr_bytes, LittleEndian).parse(bases, 8).map_err(hdr_error)?;
        if let Some(table) = parsed.table() {
            let mut fdes = Vec::new();
            let mut iter = table.iter(bases);
            while let Some((_, fde_ptr)) = iter.next().map_err(hdr_error)? {
                let offset = table.pointer_to_offset(fde_ptr).map_err(hdr_error)?;
                let fde = eh
                    .partial_fde_from_offset(bases, offset)
                    .and_then(|partial| partial.parse(EhFrame::cie_from_offset))
                    .map_err(|error| Error::Cfi { section: ".eh_frame", error })?;
                fdes.push(fde);
            }
            return Ok(fdes);
        }
    }
    all_fdes(eh, bases).map_err(|error| Error::Cfi { section: ".eh_frame", error })
}

/// Every FDE of a section, in section order.
fn all_fdes<'a, S: UnwindSection<Slice<'a>>>(
    section: &S,
    bases: &BaseAddresses,
) -> gimli::Result<Vec<Fde<'a>>> {
    let mut fdes = Vec::new();
    let mut entries = section.entries(bases);
    while let Some(entry) = entries.next()? {
        if let CieOrFde::Fde(partial) = entry {
            fdes.push(partial.parse(S::cie_from_offset)?);
        }
    }
    Ok(fdes)
}

/// Appends the spans of one FDE. An FDE whose instructions cannot be evaluated becomes one
/// unsupported span (the rest of the file still compiles).
fn fde_spans<'a, S: UnwindSection<Slice<'a>>>(
    section: &S,
    bases: &BaseAddresses,
    ctx: &mut UnwindContext<usize>,
    fde: &Fde<'a>,
    stats: &mut Stats,
    spans: &mut Vec<Span>,
) {
    let (start, end) = (fde.initial_address(), fde.end_address());
    if start >= end {
        return;
    }
    let whole = |rule| Span { start, end, rule };
    if fde.is_signal_trampoline() {
        stats.signal_fdes += 1;
        spans.push(whole(UnwindRow::new(0, UNWIND_CFA_SIGNAL, 0, UNWIND_RBP_UNCHANGED, 0)));
        return;
    }
    if fde.cie().return_address_register() != RIP {
        stats.unsupported.return_address += 1;
        spans.push(whole(UNSUPPORTED));
        return;
    }
    let encoding = fde.cie().encoding();
    let (saved_stats, mark) = (*stats, spans.len());
    let result = (|| -> gimli::Result<()> {
        let mut table = fde.rows(section, bases, ctx)?;
        while let Some(row) = table.next_row()? {
            if row.start_address() >= row.end_address() {
                continue;
            }
            stats.cfi_rows += 1;
            let rule = row_rule(section, encoding, row, stats);
            spans.push(Span { start: row.start_address(), end: row.end_address(), rule });
        }
        Ok(())
    })();
    if result.is_err() {
        *stats = saved_stats;
        spans.truncate(mark);
        stats.unsupported.fde_errors += 1;
        spans.push(whole(UNSUPPORTED));
    }
}

pub(crate) fn row_rule<'a, S: UnwindSection<Slice<'a>>>(
    section: &S,
    encoding: gimli::Encoding,
    row: &UnwindTableRow<usize>,
    stats: &mut Stats,
) -> UnwindRow {
    match row.register(RIP) {
        Some(RegisterRule::Offset(-8)) => {}
        Some(RegisterRule::Undefined) => {
            stats.end_rows += 1;
            return UnwindRow::new(0, UNWIND_CFA_END, 0, UNWIND_RBP_UNCHANGED, 0);
        }
        _ => {
            stats.unsupported.return_address += 1;
            return UNSUPPORTED;
        }
    }
    let (cfa_kind, offset, aux) = match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } => match *register {
            X86_64::RSP => (UNWIND_CFA_RSP, *offset, 0),
            X86_64::RBP => (UNWIND_CFA_RBP, *offset, 0),
            _ => {
                stats.unsupported.cfa_register += 1;
                return UNSUPPORTED;
            }
        },
        CfaRule::Expression(expr) => match plt_expression(section, encoding, expr) {
            Some((offset, threshold)) => match i8::try_from(threshold) {
                Ok(threshold) => (UNWIND_CFA_PLT, offset, threshold),
                Err(_) => {
                    stats.unsupported.cfa_offset_range += 1;
                    return UNSUPPORTED;
                }
            },
            None => {
                stats.unsupported.cfa_expression += 1;
                return UNSUPPORTED;
            }
        },
    };
    let rbp = match row.register(X86_64::RBP) {
        None | Some(RegisterRule::SameValue) => Some((UNWIND_RBP_UNCHANGED, 0)),
        Some(RegisterRule::Offset(n)) if n % 8 == 0 => {
            i8::try_from(n / 8).ok().map(|slot| (UNWIND_RBP_CFA_OFFSET, slot))
        }
        _ => None,
    };
    let Ok(cfa_offset) = u16::try_from(offset) else {
        return large_row(cfa_kind, offset, rbp, stats);
    };
    match (cfa_kind, rbp) {
        (UNWIND_CFA_PLT, Some((UNWIND_RBP_UNCHANGED, _))) => {
            stats.plt_rows += 1;
            UnwindRow::new(0, UNWIND_CFA_PLT, cfa_offset, UNWIND_RBP_UNCHANGED, aux)
        }
        // `aux` holds the PLT threshold, so a PLT row cannot also carry an rbp slot.
        (UNWIND_CFA_PLT, _) => {
            stats.unsupported.rbp += 1;
            UNSUPPORTED
        }
        (_, Some((rbp_kind, slot))) => UnwindRow::new(0, cfa_kind, cfa_offset, rbp_kind, slot),
        (_, None) => {
            stats.unsupported.rbp += 1;
            UnwindRow::new(0, cfa_kind, cfa_offset, UNWIND_RBP_UNSUPPORTED, 0)
        }
    }
}

/// A frame over 64 KiB: CFA = rsp + `offset` as an `UNWIND_CFA_RSP_LARGE` row, whose rbp slot
/// has 4 bits (-64 to +56 bytes from the CFA, where pushes put it).
fn large_row(cfa_kind: u8, offset: i64, rbp: Option<(u8, i8)>, stats: &mut Stats) -> UnwindRow {
    let fits = cfa_kind == UNWIND_CFA_RSP
        && offset % 8 == 0
        && u64::try_from(offset).is_ok_and(|o| o <= UNWIND_LARGE_CFA_MAX);
    if !fits {
        stats.unsupported.cfa_offset_range += 1;
        return UNSUPPORTED;
    }
    stats.large_frame_rows += 1;
    let offset = offset as u64;
    match rbp {
        Some((UNWIND_RBP_UNCHANGED, _)) => UnwindRow::large(0, offset, UNWIND_RBP_UNCHANGED, 0),
        Some((kind, slot)) if (-8..=7).contains(&slot) => UnwindRow::large(0, offset, kind, slot),
        _ => {
            stats.unsupported.rbp += 1;
            UnwindRow::large(0, offset, UNWIND_RBP_UNSUPPORTED, 0)
        }
    }
}

/// Recognizes the CFA expression binutils emits for PLT stubs,
/// `DW_OP_breg7 (rsp) N; DW_OP_breg16 (rip) 0; DW_OP_lit15; DW_OP_and; DW_OP_litK; DW_OP_ge;
/// DW_OP_lit3; DW_OP_shl; DW_OP_plus` (CFA = rsp + N + ((rip & 15) >= K ? 8 : 0): the stub's
/// `push` has run once rip is past it), and returns (N, K).
fn plt_expression<'a, S: UnwindSection<Slice<'a>>>(
    section: &S,
    encoding: gimli::Encoding,
    expr: &UnwindExpression<usize>,
) -> Option<(i64, u64)> {
    let Expression(mut bytes) = expr.get(section).ok()?;
    let mut ops = Vec::with_capacity(9);
    while !bytes.is_empty() {
        if ops.len() == 9 {
            return None;
        }
        ops.push(Operation::parse(&mut bytes, encoding).ok()?);
    }
    match ops.as_slice() {
        [
            Operation::RegisterOffset { register: X86_64::RSP, offset, base_type: rsp_type },
            Operation::RegisterOffset { register: RIP, offset: 0, base_type: rip_type },
            Operation::UnsignedConstant { value: 15 },
            Operation::And,
            Operation::UnsignedConstant { value: threshold },
            Operation::Ge,
            Operation::UnsignedConstant { value: 3 },
            Operation::Shl,
            Operation::Plus,
        ] if rsp_type.0 == 0 && rip_type.0 == 0 => Some((*offset, *threshold)),
        _ => None,
    }
}

/// Sorts the spans and turns them into rows: a `NONE` row where a gap starts, one row per
/// change of rule. Where FDEs overlap, the one starting later wins from its start.
fn merge(mut spans: Vec<Span>) -> Result<Vec<UnwindRow>, Error> {
    // Stable: the rows of one FDE keep their order.
    spans.sort_by_key(|span| span.start);
    let none = UnwindRow::new(0, UNWIND_CFA_NONE, 0, UNWIND_RBP_UNCHANGED, 0);
    let mut rows: Vec<UnwindRow> = Vec::with_capacity(spans.len() + 1);
    let mut covered_to: Option<u32> = None;
    let push = |rows: &mut Vec<UnwindRow>, pc: u32, rule: UnwindRow| {
        while rows.last().is_some_and(|last| last.pc >= pc) {
            rows.pop();
        }
        if !rows.last().is_some_and(|last| last.same_rule(&rule)) {
            rows.push(UnwindRow { pc, ..rule });
        }
    };
    for span in spans {
        let start = u32::try_from(span.start).map_err(|_| Error::AddressTooLarge(span.start))?;
        let end = u32::try_from(span.end).map_err(|_| Error::AddressTooLarge(span.end))?;
        if let Some(prev_end) = covered_to.filter(|&prev_end| prev_end < start) {
            push(&mut rows, prev_end, none);
        }
        push(&mut rows, start, span.rule);
        covered_to = Some(end);
    }
    if let Some(end) = covered_to {
        push(&mut rows, end, none);
    }
    Ok(rows)
}
