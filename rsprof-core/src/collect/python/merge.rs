//! Puts the Python frames the kernel read into a sample's native stack. Each native
//! `_PyEval_EvalFrameDefault` frame is **replaced** by the Python frames that C activation of
//! the loop was running (py-spy `--native` does the same; the OpenTelemetry profiler keeps
//! the loop frame under them): the loop frame says nothing a Python developer can use, and
//! where the loop called into C (an extension, a builtin) those native frames stay, under the
//! Python frame that called them. Activations pair with loop frames from the leaf: the
//! innermost activation runs in the innermost loop frame.

use profiler_common::{
    PY_FRAME_ENTRY, PY_FRAME_IDENT_MASK, PY_FRAME_IDENT_SHIFT, PY_FRAME_INSTR_MASK,
    PY_FRAME_NO_IDENT, PY_FRAME_OWNER_SHIFT, PY_WALK_FRAMES, PY_WALK_NO_FRAME,
    PY_WALK_NO_THREAD_STATE, PY_WALK_NONE, SAMPLE_PY_MASK, SAMPLE_PY_SHIFT, SAMPLE_PY_TRUNCATED,
};

use super::{CodeEntry, MAX_CODES, ProcessPython, PyProcess, PyStats, code};
use crate::{
    collect::processes::{MAX_JIT_SYMBOLS, ProcessInfo},
    decode::Sample,
    model::{address::FrameAddr, ids::Pid, process::JitSymbol, stacks::JitLanguage},
};

/// Name of a frame whose code object could not be read (the process exited first).
pub const UNREADABLE: &str = "py::[unreadable code object]";
/// Name of a frame whose code object was gone when read: freed and its memory reused (or never
/// a code object), so what is there now is not what the sample saw.
pub const GONE: &str = "py::[code object gone before it was read]";

/// Replaces the eval-loop frames of `frames` (root first, as `collect::stack::normalize`
/// left them) by the Python frames of `s`, a sample of `p`, and counts how that went.
/// `stats` counts CPU samples, `off_cpu` off-CPU records.
pub fn merge(
    frames: &mut Vec<FrameAddr>,
    s: &Sample,
    p: &mut ProcessInfo,
    stats: &mut PyStats,
    off_cpu: &mut PyStats,
) {
    let ProcessPython::Python(py) = &mut p.python else { return };
    let stats = if s.off_cpu.is_some() { off_cpu } else { stats };
    if s.flags & SAMPLE_PY_TRUNCATED != 0 {
        stats.truncated += 1;
    }
    match (s.flags & SAMPLE_PY_MASK) >> SAMPLE_PY_SHIFT {
        PY_WALK_FRAMES => {}
        PY_WALK_NONE => return stats.not_loaded += 1,
        PY_WALK_NO_THREAD_STATE => return stats.no_thread_state += 1,
        PY_WALK_NO_FRAME => return stats.no_frame += 1,
        _ => return stats.read_fault += 1,
    }
    // Activations innermost first, each's frames innermost first.
    let mut groups: Vec<Vec<FrameAddr>> = Vec::new();
    let mut cur = Vec::new();
    for &(code, word) in &s.python {
        if let Some(f) = py.frame(s.pid, s.time.0, code, word, &mut p.meta.jit_symbols, stats) {
            cur.push(f);
        }
        if word & PY_FRAME_ENTRY != 0 {
            groups.push(std::mem::take(&mut cur));
        }
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    let evals: Vec<usize> = frames
        .iter()
        .enumerate()
        .filter(|(_, f)| matches!(**f, FrameAddr::User { module, offset } if py.is_eval(module, offset)))
        .map(|(i, _)| i)
        .collect();
    if evals.is_empty() {
        // A native walk cut before it reached the innermost loop frame (a table not loaded
        // yet): what it has are callees of that activation, so every Python frame goes
        // between the truncation marker and them. The native frames between activations are
        // unknown there, as the marker says.
        if matches!(frames.first(), Some(FrameAddr::Truncated { .. })) {
            stats.samples_with += 1;
            stats.above_cut += 1;
            let py_frames = groups.iter().rev().flat_map(|g| g.iter().rev().copied());
            frames.splice(1..1, py_frames.collect::<Vec<_>>());
            return;
        }
        return stats.unplaced += 1;
    }
    if evals.len() != groups.len() {
        stats.mismatched += 1;
    }
    stats.samples_with += 1;
    let paired = evals.len().min(groups.len());
    // Loop frame (index in `frames`) → its activation; the outermost paired one also takes the
    // activations beyond the pairs (its callers, whose loop frames the native walk lacked).
    let mut replace: Vec<(usize, Vec<FrameAddr>)> = Vec::with_capacity(paired);
    for k in 0..paired {
        let at = evals[evals.len() - 1 - k];
        let mut py_frames: Vec<FrameAddr> = Vec::new();
        if k + 1 == paired {
            for g in groups[paired..].iter().rev() {
                py_frames.extend(g.iter().rev());
            }
        }
        py_frames.extend(groups[k].iter().rev());
        replace.push((at, py_frames));
    }
    replace.sort_unstable_by_key(|r| r.0);
    let mut out = Vec::with_capacity(frames.len() + s.python.len());
    let mut next = replace.into_iter().peekable();
    for (i, f) in frames.drain(..).enumerate() {
        match next.peek() {
            Some((at, _)) if *at == i => out.extend(next.next().expect("peeked").1),
            _ => out.push(f),
        }
    }
    *frames = out;
}

impl PyProcess {
    /// The frame of code object `code` at instruction word `word` (with the object's identity
    /// as the sampler saw it), named through the cache; None for a frame not shown (still
    /// setting up) or past the symbol bound.
    fn frame(
        &mut self,
        pid: Pid,
        sample_ns: u64,
        code: u64,
        word: u64,
        symbols: &mut Vec<JitSymbol>,
        stats: &mut PyStats,
    ) -> Option<FrameAddr> {
        if word & PY_FRAME_NO_IDENT != 0 {
            // The sampler could not read it: no identity to name it by.
            stats.code_unreadable += 1;
            return self.placeholder(pid, false, symbols);
        }
        let want = (word >> PY_FRAME_IDENT_SHIFT) & PY_FRAME_IDENT_MASK;
        let matches = |e: &CodeEntry| e.info.as_ref().is_ok_and(|i| i.ident() == want);
        let stale = self.codes.get(&code).is_none_or(|e| !matches(e) && e.read_for_ns < sample_ns);
        if stale {
            // Not read yet, or what was read is not the object this later sample saw: read
            // what is there now.
            if self.codes.len() >= MAX_CODES {
                self.codes.clear();
            }
            let info = code::read_code(pid.0, code, self.offsets, self.code_type);
            match &info {
                Ok(_) => stats.code_objects += 1,
                Err(code::CodeError::Unreadable) => stats.code_unreadable += 1,
                Err(code::CodeError::NotCode) => stats.not_code += 1,
            }
            let ident = info.as_ref().ok().map(code::CodeInfo::ident);
            let entry = CodeEntry { info, read_for_ns: sample_ns, lines: Default::default() };
            let old = self.codes.insert(code, entry);
            if old.is_some_and(|old| old.info.is_ok_and(|i| Some(i.ident()) != ident)) {
                // Another object than the one read before.
                stats.code_reused += 1;
            }
        }
        let e = self.codes.get_mut(&code).expect("inserted");
        let info = match &e.info {
            Ok(info) if info.ident() == want => info,
            Err(code::CodeError::Unreadable) => {
                return self.placeholder(pid, false, symbols);
            }
            // Another object (or none) is there now: the sampled one was freed first.
            _ => {
                stats.code_gone += 1;
                return self.placeholder(pid, true, symbols);
            }
        };
        let minor = self.minor;
        // 3.11+: the instruction pointer came less the code object's address.
        let instr = word & PY_FRAME_INSTR_MASK;
        let ip =
            if minor >= 11 { code.wrapping_add(instr as u32 as i32 as i64 as u64) } else { instr };
        let at = info.instr_offset(minor, ip);
        if info.incomplete(minor, at, (word >> PY_FRAME_OWNER_SHIFT) & 3) {
            stats.incomplete += 1;
            return None;
        }
        let line = info.line(minor, at);
        if let Some(&symbol) = e.lines.get(&line) {
            return Some(FrameAddr::Jit { pid, symbol });
        }
        let symbol =
            new_symbol(symbols, format!("py::{}", info.name), Some(info.file.clone()), line)?;
        e.lines.insert(line, symbol);
        Some(FrameAddr::Jit { pid, symbol })
    }

    /// The frame standing for a code object that cannot be named: `GONE` (`gone`) or
    /// `UNREADABLE`, one symbol of each per process.
    fn placeholder(
        &mut self,
        pid: Pid,
        gone: bool,
        symbols: &mut Vec<JitSymbol>,
    ) -> Option<FrameAddr> {
        let (cached, name) = if gone { (self.gone, GONE) } else { (self.unreadable, UNREADABLE) };
        let symbol = match cached {
            Some(s) => s,
            None => {
                let s = new_symbol(symbols, name.to_owned(), None, None)?;
                if gone {
                    self.gone = Some(s)
                } else {
                    self.unreadable = Some(s)
                }
                s
            }
        };
        Some(FrameAddr::Jit { pid, symbol })
    }
}

/// A new Python frame symbol; None past the process's bound.
fn new_symbol(
    symbols: &mut Vec<JitSymbol>,
    name: String,
    file: Option<String>,
    line: Option<u32>,
) -> Option<crate::model::ids::JitSymbolId> {
    if symbols.len() >= MAX_JIT_SYMBOLS {
        return None;
    }
    let symbol = crate::model::ids::JitSymbolId(symbols.len() as u32);
    symbols.push(JitSymbol {
        name,
        language: JitLanguage::Python,
        file,
        line,
        from_dump: false,
        interpreter: true,
    });
    Some(symbol)
}
