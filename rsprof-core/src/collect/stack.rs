//! Stack normalization: a sample's raw addresses become [`FrameAddr`]s, root first — user
//! frames (turned into (module, file offset) through the process's address space as the
//! kernel's mapping records left it at the sample) with label frames placed under the frames
//! that pushed them, then kernel frames.

use crate::{
    collect::jitdump::At,
    collect::{
        modules::{ModuleTable, parse_maps},
        processes::{ProcessInfo, SpaceSource},
    },
    decode::{LabelRef, Sample},
    model::{
        address::FrameAddr,
        ids::{LabelId, ModuleId, Pid},
    },
    system::procfs::ProcError,
};

/// What normalizing one stack ran into.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Normalized {
    /// User frames in no mapping of their process.
    pub unmapped: u64,
    /// The user stack walk did not reach the root (a `Truncated` root frame was added).
    pub truncated: bool,
    /// Frames in anonymous executable memory or in no mapping that the process's jitdump or
    /// perf map named, and those they did not (kept as addresses).
    pub jit_named: u64,
    pub jit_unnamed: u64,
    /// The perf map was read on the way and named more code.
    pub perf_map_grew: bool,
    /// The stack holds for this sample's time only (its jitdump names code at an address
    /// that held other code later, or leaves an address unnamed whose samples' times name it
    /// later): not to be served to other samples from the stack cache.
    pub time_bound: bool,
}

/// Fills `frames` (cleared first) with the normalized stack of `s`, a sample of process `p`.
/// An address outside every known mapping is counted and kept as an address: the mappings
/// come from the kernel as they are made, so /proc would not know better (and by now may
/// describe another image or nothing). Such an address, and one in anonymous memory (module
/// `anon`), is looked up in the process's jitdump at the sample's time, else in its perf map:
/// JIT code either names becomes a `FrameAddr::Jit`.
pub fn normalize(
    s: &Sample,
    p: &mut ProcessInfo,
    anon: ModuleId,
    frames: &mut Vec<FrameAddr>,
) -> Normalized {
    frames.clear();
    let mut out = Normalized::default();
    let n = s.user_stack.len();
    let places = label_places(&s.labels, n);
    let label = |l: &LabelRef| FrameAddr::Label { pid: s.pid, label: LabelId(l.addr) };
    let mut next_label = 0;
    for (i, &addr) in s.user_stack.iter().enumerate().rev() {
        let root_pos = n - 1 - i;
        while next_label < places.len() && places[next_label] <= root_pos {
            frames.push(label(&s.labels[next_label]));
            next_label += 1;
        }
        // A return address of 0 ends the frame-pointer chain (e.g. under ld.so's _start):
        // not a frame.
        if addr == 0 {
            continue;
        }
        // Callers' entries are return addresses; look up the call instruction.
        let lookup = if i == 0 { addr } else { addr.saturating_sub(1) };
        let found = p.space.lookup(lookup);
        if found.is_none_or(|(m, _)| m == anon) {
            let t = s.time.0;
            let since = if found.is_some() { p.anon_since_at(lookup) } else { 0 };
            let from_dump = match p.jit_dump_at(lookup, t, since) {
                At::NotCovered => None,
                At::Unknown => Some(None),
                At::Named { code, superseded } => {
                    out.time_bound |= superseded;
                    let code = code.clone();
                    Some(p.jit_dump_symbol(&code, lookup))
                }
            };
            if let Some(symbol) = from_dump {
                if let Some(symbol) = symbol {
                    out.jit_named += 1;
                    frames.push(FrameAddr::Jit { pid: s.pid, symbol });
                    continue;
                }
                out.jit_unnamed += 1;
                out.time_bound = true;
                if found.is_some() {
                    p.unnamed_jit(lookup, t, since);
                    frames.push(FrameAddr::Anon { pid: s.pid, addr: lookup });
                } else {
                    out.unmapped += 1;
                    frames.push(FrameAddr::Unmapped(addr));
                }
                continue;
            }
            let name = p.jit_files().perf_map.name(s.pid, lookup, t, &mut out.perf_map_grew);
            if let Some(symbol) = name.and_then(|n| p.jit_symbol(&n)) {
                out.jit_named += 1;
                frames.push(FrameAddr::Jit { pid: s.pid, symbol });
                continue;
            }
            out.jit_unnamed += 1;
            // A process with a jitdump may still name the address, for these samples' times.
            out.time_bound |= p.jit_dump_open();
            if found.is_some() {
                p.unnamed_jit(lookup, t, since);
                frames.push(FrameAddr::Anon { pid: s.pid, addr: lookup });
                continue;
            }
        }
        frames.push(match found {
            Some((module, offset)) => FrameAddr::User { module, offset },
            None => {
                out.unmapped += 1;
                FrameAddr::Unmapped(addr)
            }
        });
    }
    frames.extend(s.labels[next_label..].iter().map(label));
    frames.extend(kernel_frames(&s.kernel_stack));
    let end = s.user_stack_end();
    if end.is_truncated() {
        // The file the walk stopped in: that of its outermost frame.
        let module = s.user_stack.last().and_then(|&a| {
            let a = if n > 1 { a.saturating_sub(1) } else { a };
            p.space.lookup(a).map(|(m, _)| m)
        });
        frames.insert(0, FrameAddr::Truncated { end, module });
        out.truncated = true;
    }
    out
}

/// Kernel frames root first; callers' return addresses minus one (the call instruction).
pub fn kernel_frames(leaf_first: &[u64]) -> impl Iterator<Item = FrameAddr> + '_ {
    leaf_first
        .iter()
        .enumerate()
        .rev()
        .map(|(i, &addr)| FrameAddr::Kernel(if i == 0 { addr } else { addr - 1 }))
}

/// Sets the address space of `pid` from what reading its /proc/PID/maps gave (`maps`): done
/// once, for a process that existed before the recording began (or whose exec raced the
/// attach). A process that is gone is marked exited; any other failure is returned for the
/// caller to count.
pub fn read_space_once(
    pid: Pid,
    p: &mut ProcessInfo,
    modules: &mut ModuleTable,
    maps: Result<String, ProcError>,
) -> Result<(), ProcError> {
    p.space_source = SpaceSource::Proc;
    match maps {
        Ok(text) => {
            p.space = parse_maps(pid, &text, modules);
            Ok(())
        }
        Err(ProcError::Gone) => {
            p.exited = true;
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Where each label (outermost first) goes among `n` user frames listed root first: before
/// frame `place`, i.e. right under the `depth` frames that were on the stack when it was
/// pushed. An unknown depth (0, `LABEL_DEPTH_UNKNOWN`), one deeper than this stack, or a
/// stack cut at the walk's limit (it keeps the leaf end, so counting from the root is off)
/// puts the label just above the leaf; places never decrease, so labels keep their push order.
fn label_places(labels: &[LabelRef], n: usize) -> Vec<usize> {
    if n >= profiler_common::MAX_STACK_DEPTH {
        return vec![n; labels.len()];
    }
    let mut prev = 0;
    labels
        .iter()
        .map(|l| {
            let d = l.depth as usize;
            let place = if d == 0 || d > n { n } else { d };
            prev = place.max(prev);
            prev
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_go_under_their_pusher() {
        let l = |depth| LabelRef { addr: 0x1000, depth };
        // main → work (pushed at depth 2) → hot: the label sits between work and hot.
        assert_eq!(label_places(&[l(2)], 3), vec![2]);
        // Nested pushes in the same frame keep their order; an inner frame's push goes deeper.
        assert_eq!(label_places(&[l(2), l(2), l(3)], 4), vec![2, 2, 3]);
        // Unknown or too deep (truncated stack): just above the leaf.
        assert_eq!(label_places(&[l(0), l(9)], 3), vec![3, 3]);
        // An inner label never goes above an outer one.
        assert_eq!(label_places(&[l(3), l(1)], 4), vec![3, 3]);
        // A walk cut at its limit: the root side is missing.
        let n = profiler_common::MAX_STACK_DEPTH;
        assert_eq!(label_places(&[l(2)], n), vec![n]);
    }
}
