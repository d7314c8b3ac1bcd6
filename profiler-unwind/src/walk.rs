//! The table walk over a copy of a user stack: the same rules as the BPF walker
//! (profiler-ebpf's stack.rs) with memory reads served from the copy. Userspace uses it to
//! finish walks the kernel stopped for want of a table (a process or library newer than its
//! tables), once the tables are compiled.

use profiler_common::{
    UNWIND_CFA_END, UNWIND_CFA_NONE, UNWIND_CFA_PLT, UNWIND_CFA_RBP, UNWIND_CFA_RSP,
    UNWIND_CFA_RSP_LARGE, UNWIND_CFA_SIGNAL, UNWIND_END_COMPLETE, UNWIND_END_DEPTH,
    UNWIND_END_FRAME_POINTER, UNWIND_END_NO_CFI, UNWIND_END_NO_MAPPING, UNWIND_END_NO_TABLE,
    UNWIND_END_READ_FAULT, UNWIND_END_UNSUPPORTED, UNWIND_RBP_CFA_OFFSET, UNWIND_RBP_UNSUPPORTED,
    UnwindRow,
};

/// What covers a PC (the call instruction for return addresses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// The row of the PC's file covering it (an `UNWIND_CFA_NONE` row is a gap).
    Row(UnwindRow),
    /// The PC is in no executable mapping.
    NoMapping,
    /// The PC's file has a table that is not available (unreadable file).
    NoTable,
    /// The PC's file has no usable CFI, or no row covers the PC.
    NoCfi,
}

/// Where the walk starts: the registers of the frame the kernel's walk stopped at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Regs {
    pub pc: u64,
    pub sp: u64,
    pub bp: u64,
    /// rbp's value is known (a frame whose rbp rule the table cannot express loses it).
    pub bp_known: bool,
    /// `pc` is a return address: its rule is that of `pc - 1`, the call.
    pub pc_is_return: bool,
}

/// User memory copied from `base` up.
#[derive(Clone, Copy, Debug)]
pub struct StackCopy<'a> {
    pub base: u64,
    pub bytes: &'a [u8],
}

impl StackCopy<'_> {
    fn read(&self, addr: u64) -> Option<u64> {
        let off = usize::try_from(addr.checked_sub(self.base)?).ok()?;
        let b = self.bytes.get(off..off.checked_add(8)?)?;
        Some(u64::from_ne_bytes(b.try_into().ok()?))
    }
}

/// How the walk went.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Walk {
    /// The frames, starting with the start PC (leaf side first).
    pub frames: Vec<u64>,
    /// `UNWIND_END_*`.
    pub end: u32,
    /// Some frames were found by following frame pointers.
    pub used_fp: bool,
    /// The walk ended reading outside the copy (`end` is then `UNWIND_END_READ_FAULT`):
    /// the stack was deeper than what was copied.
    pub beyond_copy: bool,
}

/// Walks from `regs` over `stack`, recording at most `max_frames` frames. `fp_fallback`:
/// follow frame pointers through code without a table, as `--unwind dwarf-fp` does.
pub fn walk(
    regs: Regs,
    stack: StackCopy<'_>,
    max_frames: usize,
    fp_fallback: bool,
    mut lookup: impl FnMut(u64) -> Rule,
) -> Walk {
    let mut st = regs;
    let mut w = Walk { end: UNWIND_END_DEPTH, ..Default::default() };
    while w.frames.len() < max_frames {
        w.frames.push(st.pc);
        match step(&mut st, &stack, fp_fallback, &mut w.used_fp, &mut lookup) {
            Ok(()) => {}
            Err(Stop::End(end)) => {
                w.end = end;
                return w;
            }
            Err(Stop::BeyondCopy) => {
                w.end = UNWIND_END_READ_FAULT;
                w.beyond_copy = true;
                return w;
            }
        }
    }
    w
}

enum Stop {
    End(u32),
    BeyondCopy,
}

fn read(stack: &StackCopy<'_>, addr: u64) -> Result<u64, Stop> {
    stack.read(addr).ok_or(Stop::BeyondCopy)
}

/// One frame: `st` becomes the caller's registers, as the BPF walker's `unwind_one`.
fn step(
    st: &mut Regs,
    stack: &StackCopy<'_>,
    fp_fallback: bool,
    used_fp: &mut bool,
    lookup: &mut impl FnMut(u64) -> Rule,
) -> Result<(), Stop> {
    let addr = if st.pc_is_return { st.pc.wrapping_sub(1) } else { st.pc };
    let row = match lookup(addr) {
        // Userspace knows every mapping the kernel reported by now: code in none of them
        // (shared memory attached with SHM_EXEC) has no CFI either.
        Rule::NoMapping | Rule::NoTable | Rule::NoCfi if fp_fallback => {
            return frame_pointer_step(st, stack, used_fp);
        }
        Rule::NoMapping => return Err(Stop::End(UNWIND_END_NO_MAPPING)),
        Rule::NoTable => return Err(Stop::End(UNWIND_END_NO_TABLE)),
        Rule::NoCfi => return Err(Stop::End(UNWIND_END_NO_CFI)),
        Rule::Row(row) => row,
    };
    let cfa = match row.cfa_kind() {
        UNWIND_CFA_RSP => st.sp.wrapping_add(u64::from(row.cfa_offset)),
        UNWIND_CFA_RSP_LARGE => st.sp.wrapping_add(row.large_cfa_offset()),
        UNWIND_CFA_RBP => {
            if !st.bp_known {
                return Err(Stop::End(UNWIND_END_UNSUPPORTED));
            }
            st.bp.wrapping_add(u64::from(row.cfa_offset))
        }
        UNWIND_CFA_PLT => {
            let extra = if (st.pc & 15) as i64 >= i64::from(row.aux) { 8 } else { 0 };
            st.sp.wrapping_add(u64::from(row.cfa_offset) + extra)
        }
        UNWIND_CFA_END => return Err(Stop::End(UNWIND_END_COMPLETE)),
        UNWIND_CFA_SIGNAL => return signal_step(st, stack),
        UNWIND_CFA_NONE if fp_fallback => return frame_pointer_step(st, stack, used_fp),
        UNWIND_CFA_NONE => return Err(Stop::End(UNWIND_END_NO_CFI)),
        _ => return Err(Stop::End(UNWIND_END_UNSUPPORTED)),
    };
    let ra = read(stack, cfa.wrapping_sub(8))?;
    match row.rbp_kind() {
        UNWIND_RBP_CFA_OFFSET => {
            st.bp = read(stack, cfa.wrapping_add(row.rbp_offset() as u64))?;
            st.bp_known = true;
        }
        UNWIND_RBP_UNSUPPORTED => st.bp_known = false,
        _ => {}
    }
    if ra == 0 {
        return Err(Stop::End(UNWIND_END_COMPLETE));
    }
    st.pc = ra;
    st.sp = cfa;
    st.pc_is_return = true;
    Ok(())
}

/// The caller's frame by the rbp chain (code without a table, `fp_fallback`).
fn frame_pointer_step(
    st: &mut Regs,
    stack: &StackCopy<'_>,
    used_fp: &mut bool,
) -> Result<(), Stop> {
    *used_fp = true;
    let end = Stop::End(UNWIND_END_FRAME_POINTER);
    // An rbp below the stack pointer is no frame pointer of this stack.
    if !st.bp_known || st.bp < st.sp || st.bp == 0 {
        return Err(end);
    }
    // The kernel's walk ends the chain on an unreadable slot; here past the copy is also
    // the chain's end as far as can be told.
    let (Some(ra), Some(next_bp)) = (stack.read(st.bp.wrapping_add(8)), stack.read(st.bp)) else {
        return Err(end);
    };
    if ra == 0 {
        return Err(end);
    }
    st.pc = ra;
    st.sp = st.bp.wrapping_add(16);
    st.bp = next_bp;
    st.pc_is_return = true;
    Ok(())
}

/// A signal trampoline: the interrupted registers are in the `ucontext` at rsp (x86-64:
/// rbp, rsp, rip at 0x78, 0xa0, 0xa8).
fn signal_step(st: &mut Regs, stack: &StackCopy<'_>) -> Result<(), Stop> {
    let uc = st.sp;
    st.bp = read(stack, uc + 0x78)?;
    st.sp = read(stack, uc + 0xa0)?;
    st.pc = read(stack, uc + 0xa8)?;
    st.bp_known = true;
    st.pc_is_return = false;
    Ok(())
}

#[cfg(test)]
mod tests {
    use profiler_common::{UNWIND_CFA_UNSUPPORTED, UNWIND_RBP_UNCHANGED};

    use super::*;

    const BASE: u64 = 0x7ffd_0000_0000;

    /// A stack image: 8-byte slots from `BASE`.
    fn stack(slots: &[(u64, u64)], len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        for &(addr, v) in slots {
            let off = (addr - BASE) as usize;
            b[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        }
        b
    }

    /// Code at 0x1000.. : `leaf` (CFA rsp+8) at 0x1000, `mid` (CFA rsp+24, rbp saved at
    /// CFA-16) at 0x2000, `root` (END) at 0x3000; 0x4000.. has no CFI; 0x5000 is a PLT stub;
    /// 0x6000 a signal trampoline; 0x7000 an unsupported rule; nothing mapped at 0x9000+.
    fn lookup(addr: u64) -> Rule {
        let r = |cfa, off, rbp, aux| Rule::Row(UnwindRow::new(0, cfa, off, rbp, aux));
        match addr {
            0x1000..0x2000 => r(UNWIND_CFA_RSP, 8, UNWIND_RBP_UNCHANGED, 0),
            0x2000..0x3000 => r(UNWIND_CFA_RSP, 24, UNWIND_RBP_CFA_OFFSET, -2),
            0x3000..0x4000 => r(UNWIND_CFA_END, 0, UNWIND_RBP_UNCHANGED, 0),
            0x4000..0x5000 => Rule::NoCfi,
            0x5000..0x6000 => r(UNWIND_CFA_PLT, 8, UNWIND_RBP_UNCHANGED, 11),
            0x6000..0x7000 => r(UNWIND_CFA_SIGNAL, 0, UNWIND_RBP_UNCHANGED, 0),
            0x7000..0x8000 => r(UNWIND_CFA_UNSUPPORTED, 0, UNWIND_RBP_UNCHANGED, 0),
            0x8000..0x9000 => r(UNWIND_CFA_RBP, 16, UNWIND_RBP_CFA_OFFSET, -2),
            0xa000..0xb000 => Rule::Row(UnwindRow::large(0, 540_080, UNWIND_RBP_CFA_OFFSET, -2)),
            _ => Rule::NoMapping,
        }
    }

    fn regs(pc: u64, sp: u64, bp: u64) -> Regs {
        Regs { pc, sp, bp, bp_known: true, pc_is_return: false }
    }

    #[test]
    fn walks_leaf_mid_root_restoring_rbp() {
        // leaf: ra at sp. mid: frame of 24, rbp saved at CFA-16, ra at CFA-8.
        let b = stack(&[(BASE, 0x2010), (BASE + 16, 0xbeef), (BASE + 24, 0x3005)], 64);
        let w =
            walk(regs(0x1004, BASE, 1), StackCopy { base: BASE, bytes: &b }, 127, false, lookup);
        assert_eq!(w.frames, [0x1004, 0x2010, 0x3005]);
        assert_eq!(w.end, UNWIND_END_COMPLETE);
        assert!(!w.used_fp && !w.beyond_copy);
    }

    #[test]
    fn return_addresses_use_the_call_instruction() {
        // A return address at the first byte of `root` belongs to the call at its end in `mid`
        // (0x2fff), whose 24-byte frame is then unwound.
        let b = stack(&[(BASE + 16, 0x3010)], 64);
        let r = Regs { pc_is_return: true, ..regs(0x3000, BASE, 0) };
        let w = walk(r, StackCopy { base: BASE, bytes: &b }, 127, false, lookup);
        assert_eq!(w.frames, [0x3000, 0x3010]);
        assert_eq!(w.end, UNWIND_END_COMPLETE);
    }

    #[test]
    fn reads_beyond_the_copy_and_the_depth_limit_end_the_walk() {
        let b = stack(&[], 16);
        let w =
            walk(regs(0x2000, BASE, 0), StackCopy { base: BASE, bytes: &b }, 127, false, lookup);
        assert_eq!((w.end, w.beyond_copy), (UNWIND_END_READ_FAULT, true));
        assert_eq!(w.frames, [0x2000]);
        // leaf returning to itself forever: cut at the limit.
        let b = stack(&[(BASE, 0x1008), (BASE + 8, 0x1008), (BASE + 16, 0x1008)], 32);
        let w = walk(regs(0x1000, BASE, 0), StackCopy { base: BASE, bytes: &b }, 3, false, lookup);
        assert_eq!((w.end, w.frames.len()), (UNWIND_END_DEPTH, 3));
    }

    #[test]
    fn no_mapping_no_cfi_and_unsupported_end_the_walk() {
        let b = stack(&[(BASE, 0x9800)], 64);
        let copy = StackCopy { base: BASE, bytes: &b };
        let w = walk(regs(0x1000, BASE, 0), copy, 127, false, lookup);
        assert_eq!((w.end, w.frames.clone()), (UNWIND_END_NO_MAPPING, vec![0x1000, 0x9800]));
        let w = walk(regs(0x4000, BASE, 0), copy, 127, false, lookup);
        assert_eq!(w.end, UNWIND_END_NO_CFI);
        let w = walk(regs(0x7000, BASE, 0), copy, 127, false, lookup);
        assert_eq!(w.end, UNWIND_END_UNSUPPORTED);
        // A CFA on an rbp whose value was lost.
        let w = walk(Regs { bp_known: false, ..regs(0x8000, BASE, 0) }, copy, 127, false, lookup);
        assert_eq!(w.end, UNWIND_END_UNSUPPORTED);
        let no_table = |_| Rule::NoTable;
        let w = walk(regs(0x1000, BASE, 0), copy, 127, false, no_table);
        assert_eq!(w.end, UNWIND_END_NO_TABLE);
    }

    #[test]
    fn frame_pointer_fallback_through_code_without_cfi() {
        // 0x4000 has no CFI: rbp = BASE+32 → (saved rbp 0, ra 0x3001 in root).
        let b = stack(&[(BASE + 32, 0), (BASE + 40, 0x3001)], 64);
        let copy = StackCopy { base: BASE, bytes: &b };
        let w = walk(regs(0x4000, BASE, BASE + 32), copy, 127, true, lookup);
        assert_eq!(w.frames, [0x4000, 0x3001]);
        assert_eq!(w.end, UNWIND_END_COMPLETE);
        assert!(w.used_fp);
        // An rbp below rsp is no frame pointer.
        let w = walk(regs(0x4000, BASE + 8, BASE), copy, 127, true, lookup);
        assert_eq!(w.end, UNWIND_END_FRAME_POINTER);
        // Code in no known mapping too.
        let w = walk(regs(0x9000, BASE, BASE + 32), copy, 127, true, lookup);
        assert_eq!(
            (w.frames.clone(), w.end, w.used_fp),
            (vec![0x9000, 0x3001], UNWIND_END_COMPLETE, true)
        );
    }

    #[test]
    fn frames_over_64_kib() {
        // rustc's 540,080-byte frame: ra at rsp + 540,072, rbp at rsp + 540,064, then `mid`.
        let top = BASE + 540_080;
        let b = stack(
            &[(top - 16, 0xfeed), (top - 8, 0x2010), (top + 8, 0xbeef), (top + 16, 0x3005)],
            540_200,
        );
        let w =
            walk(regs(0xa000, BASE, 1), StackCopy { base: BASE, bytes: &b }, 127, false, lookup);
        assert_eq!(w.frames, [0xa000, 0x2010, 0x3005]);
        assert_eq!(w.end, UNWIND_END_COMPLETE);
        // A copy of the usual 8 KiB does not reach the return address: said, not guessed.
        let w = walk(
            regs(0xa000, BASE, 1),
            StackCopy { base: BASE, bytes: &b[..8192] },
            127,
            false,
            lookup,
        );
        assert_eq!((w.end, w.beyond_copy), (UNWIND_END_READ_FAULT, true));
    }

    #[test]
    fn plt_and_signal_frames() {
        // PLT at rip & 15 = 0xb >= 11: CFA = rsp + 16, ra at rsp + 8.
        let b = stack(&[(BASE + 8, 0x3001)], 64);
        let w =
            walk(regs(0x500b, BASE, 0), StackCopy { base: BASE, bytes: &b }, 127, false, lookup);
        assert_eq!(w.frames, [0x500b, 0x3001]);
        // rip & 15 = 0 < 11: CFA = rsp + 8.
        let b = stack(&[(BASE, 0x3001)], 64);
        let w =
            walk(regs(0x5000, BASE, 0), StackCopy { base: BASE, bytes: &b }, 127, false, lookup);
        assert_eq!(w.frames, [0x5000, 0x3001]);
        // The trampoline restores the interrupted leaf (pc not a return address) from the
        // ucontext: 0x1000 at rsp BASE+0x200, whose ra is root's.
        let b = stack(
            &[
                (BASE + 0x78, 7),
                (BASE + 0xa0, BASE + 0x200),
                (BASE + 0xa8, 0x1000),
                (BASE + 0x200, 0x3001),
            ],
            0x400,
        );
        let w =
            walk(regs(0x6000, BASE, 0), StackCopy { base: BASE, bytes: &b }, 127, false, lookup);
        assert_eq!(w.frames, [0x6000, 0x1000, 0x3001]);
        assert_eq!(w.end, UNWIND_END_COMPLETE);
    }
}
