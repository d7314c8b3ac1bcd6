//! Off-CPU time the kernel still holds when a recording stops: a block still open (its thread
//! has not run again, so `sched_switch` never sent it) and short blocks summed but not sent
//! yet. Read from the `OFF_CPU` map once the programs are detached, as the records the kernel
//! would have sent had each thread run at the stop; without them a service waiting at the end
//! loses its last, often longest, wait.

use profiler_common::{
    EVENT_OFF_CPU, MAX_STACK_DEPTH, OFF_CPU_RECORD_FIXED, OFF_CPU_STACK_NOT_CAPTURED, OffCpuRecord,
    PY_MAX_FRAMES, TRACK_SUM_HAS_STACK, TRACK_WALKED,
};

/// What was still unsent at the stop, for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Unsent {
    /// Blocks open at the stop, cut there, and their time.
    pub open_blocks: u64,
    pub open_ns: u64,
    /// Sums of short blocks not sent yet, and their time.
    pub sums: u64,
    pub sum_ns: u64,
    /// Of both, records without their stack (it was not walked, or a later walk replaced it).
    pub without_stack: u64,
}

/// The records a thread's entry `e` still owes at `now_ns`, appended to `out`.
pub fn records(e: &OffCpuRecord, now_ns: u64, unsent: &mut Unsent, out: &mut Vec<Vec<u8>>) {
    let r = &e.off;
    // Never sent anything with a header: nothing is known of whose it is.
    if r.header.kind != EVENT_OFF_CPU {
        return;
    }
    let walked = e.track.flags & TRACK_WALKED != 0;
    if r.off_cpu != 0 {
        let d = now_ns.saturating_sub(r.header.time_ns);
        if d > 0 {
            let mut rec = *e;
            rec.off.weight_ns = d;
            rec.off.block_ns = d;
            rec.off.blocks = 1;
            unsent.open_blocks += 1;
            unsent.open_ns += d;
            out.push(bytes(&mut rec, walked, unsent));
        }
    }
    if r.pending_ns > 0 {
        let mut rec = *e;
        rec.off.weight_ns = r.pending_ns;
        rec.off.blocks = r.pending_blocks;
        unsent.sums += 1;
        unsent.sum_ns += r.pending_ns;
        // The frames hold the sum's stack only if no walk replaced it since (the kernel's own
        // rule when it sends a sum).
        out.push(bytes(&mut rec, e.track.flags & TRACK_SUM_HAS_STACK != 0, unsent));
    }
}

/// The record as the kernel sends it (header, then only the frames it holds); a record whose
/// stack is not its own is sent without one, flagged, as `sched_switch` does.
fn bytes(rec: &mut OffCpuRecord, has_stack: bool, unsent: &mut Unsent) -> Vec<u8> {
    let r = &mut rec.off;
    if !has_stack {
        r.kernel_frames = 0;
        r.user_frames = 0;
        r.py_frames = 0;
        r.flags = OFF_CPU_STACK_NOT_CAPTURED;
        unsent.without_stack += 1;
    }
    let native = (r.kernel_frames as usize + r.user_frames as usize).min(2 * MAX_STACK_DEPTH);
    let words = native + 2 * (r.py_frames as usize).min(PY_MAX_FRAMES);
    let len = OFF_CPU_RECORD_FIXED + words * 8;
    // SAFETY: `OffCpuRecord` is `#[repr(C)]` plain data at least `len` bytes long: the header
    // and `frames` come first.
    let all = unsafe { std::slice::from_raw_parts((rec as *const OffCpuRecord).cast::<u8>(), len) };
    all.to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> OffCpuRecord {
        // SAFETY: all-zero is a valid `OffCpuRecord` (integers only).
        let mut e: OffCpuRecord = unsafe { std::mem::zeroed() };
        e.off.header.kind = EVENT_OFF_CPU;
        e.off.header.time_ns = 1_000;
        e.off.kernel_frames = 2;
        e.off.user_frames = 1;
        e.frames[..3].copy_from_slice(&[1, 2, 3]);
        e
    }

    #[test]
    fn an_open_block_is_cut_at_the_stop_with_its_stack() {
        let mut e = entry();
        e.off.off_cpu = 1;
        e.track.flags = TRACK_WALKED;
        let (mut u, mut out) = (Unsent::default(), Vec::new());
        records(&e, 5_000, &mut u, &mut out);
        assert_eq!(u, Unsent { open_blocks: 1, open_ns: 4_000, ..Default::default() });
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].len(), OFF_CPU_RECORD_FIXED + 3 * 8);
        let mut s = rsprof_core::decode::Sample::default();
        assert!(rsprof_core::decode::decode_sample_into(&out[0], &mut s).expect("decodes"));
        assert_eq!(s.off_cpu.map(|o| (o.weight_ns, o.block_ns)), Some((4_000, 4_000)));
    }

    #[test]
    fn sums_and_unwalked_blocks_go_without_a_stack_not_another() {
        let mut e = entry();
        e.off.off_cpu = 1;
        e.off.pending_ns = 300;
        e.off.pending_blocks = 3;
        // This block was not walked: the frames are an older block's.
        e.track.flags = TRACK_SUM_HAS_STACK;
        let (mut u, mut out) = (Unsent::default(), Vec::new());
        records(&e, 2_000, &mut u, &mut out);
        assert_eq!((u.open_blocks, u.open_ns, u.sums, u.sum_ns), (1, 1_000, 1, 300));
        assert_eq!(u.without_stack, 1);
        assert_eq!(out[0].len(), OFF_CPU_RECORD_FIXED, "open block: no stack");
        assert_eq!(out[1].len(), OFF_CPU_RECORD_FIXED + 3 * 8, "the sum keeps its stack");
        // A thread that never blocked with a walk owes nothing.
        let mut fresh = entry();
        fresh.off.header.kind = 0;
        fresh.off.off_cpu = 1;
        let mut none = Vec::new();
        records(&fresh, 9_000, &mut u, &mut none);
        assert!(none.is_empty());
    }
}
