//! The collapsed ("folded") stack writer: one `process;thread;frame;...;leaf count` line per
//! distinct stack, root first, the count being samples, as `flamegraph.pl` and inferno read
//! them.
//!
//! - The process is `name-pid` (with `[runtime shortid]` for a container), the thread
//!   `name-tid`, as `stackcollapse-perf.pl --pid --tid` names them; the idle tasks are process
//!   `[idle]`, threads `swapper/N`, so they stay visible but apart (filter with
//!   `grep -v '^\[idle\];'`).
//! - Inlined functions are frames of their own, outermost first; kernel frames end in `_[k]`
//!   (flamegraph.pl's and inferno's kernel colouring); a function that could not be named is
//!   `module+0xoffset`.
//! - `;` inside a name becomes `:` (as `stackcollapse-perf.pl` does), line breaks become spaces:
//!   the format has no escaping.
//! - Off-CPU time (`--off-cpu`, `--mode wall`) is under an `[off-cpu]` frame right below the
//!   thread, counted in sampling periods (rounded per line), so a flame graph shows it beside
//!   CPU samples in one unit.
//! - Lines are sorted, so a recording always gives the same file. Markers are left out.

use std::{
    collections::{BTreeMap, HashMap},
    io::{self, Write},
};

use crate::{
    model::{
        Sample,
        ids::{StackId, ThreadKey},
        markers::Marker,
        process::display_names,
        stacks::{Frame, FrameKind},
    },
    writers::{EventSink, ProfileContext, ProfileWriter},
};

pub struct CollapsedWriter<'a> {
    ctx: &'a ProfileContext<'a>,
    /// CPU samples by thread and stack.
    counts: HashMap<(ThreadKey, Option<StackId>), u64>,
    /// Off-CPU ns by thread and stack.
    off_cpu: HashMap<(ThreadKey, Option<StackId>), u64>,
}

impl<'a> CollapsedWriter<'a> {
    pub fn new(ctx: &'a ProfileContext<'a>) -> Self {
        Self { ctx, counts: HashMap::new(), off_cpu: HashMap::new() }
    }
}

impl EventSink for CollapsedWriter<'_> {
    fn sample(&mut self, thread: ThreadKey, s: &Sample) {
        match s.off_cpu {
            Some(o) => *self.off_cpu.entry((thread, s.stack)).or_default() += o.weight_ns,
            None => *self.counts.entry((thread, s.stack)).or_default() += 1,
        }
    }

    fn marker(&mut self, _: ThreadKey, _: &Marker) {}
}

impl ProfileWriter for CollapsedWriter<'_> {
    fn is_empty(&self) -> bool {
        self.counts.is_empty() && self.off_cpu.is_empty()
    }

    fn write(self: Box<Self>, _corrupt: &[String], out: &mut dyn Write) -> io::Result<()> {
        let ctx = self.ctx;
        let mut roots: HashMap<ThreadKey, String> = HashMap::new();
        // Different stack nodes can print the same (e.g. two call sites of one line).
        let mut lines: BTreeMap<String, u64> = BTreeMap::new();
        let period_ns = (1e9 / ctx.info.frequency.max(1) as f64).max(1.0);
        let off_cpu = self
            .off_cpu
            .into_iter()
            .map(|(key, ns)| (key, (ns as f64 / period_ns).round() as u64, true));
        let cpu = self.counts.into_iter().map(|(key, n)| (key, n, false));
        for ((thread, stack), n, off) in cpu.chain(off_cpu) {
            if n == 0 {
                continue;
            }
            let root = roots.entry(thread).or_insert_with(|| thread_root(ctx, thread));
            let mut line = root.clone();
            if off {
                line.push_str(";[off-cpu]");
            }
            for f in stack.map(|s| frames_root_first(ctx, s)).unwrap_or_default() {
                line.push(';');
                line.push_str(&frame_text(f));
            }
            *lines.entry(line).or_default() += n;
        }
        for (line, n) in lines {
            writeln!(out, "{line} {n}")?;
        }
        Ok(())
    }
}

/// `process;thread`.
fn thread_root(ctx: &ProfileContext, thread: ThreadKey) -> String {
    let (process, name) = display_names(ctx.processes, thread);
    match thread {
        ThreadKey::Idle { .. } => format!("{};{}", clean(&process), clean(&name)),
        ThreadKey::Task { pid, tid } => {
            let label = ctx.processes.get(&pid).and_then(|p| p.container.as_ref()?.process_label());
            let process = match label {
                Some(l) => format!("{process}-{pid} {l}"),
                None => format!("{process}-{pid}"),
            };
            format!("{};{}-{tid}", clean(&process), clean(&name))
        }
    }
}

fn frames_root_first<'c>(ctx: &'c ProfileContext, leaf: StackId) -> Vec<&'c Frame> {
    let mut nodes = Vec::new();
    let mut cur = Some(leaf);
    while let Some((parent, frames)) = cur.and_then(|id| ctx.stacks.node(id)) {
        nodes.push(frames);
        cur = parent;
    }
    nodes.iter().rev().flat_map(|fs| fs.iter().filter_map(|&f| ctx.stacks.frame(f))).collect()
}

fn frame_text(f: &Frame) -> String {
    let unnamed = f
        .function
        .strip_prefix("0x")
        .is_some_and(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit()));
    let text = if unnamed { format!("{}+{}", f.module, f.function) } else { f.function.clone() };
    match f.kind {
        FrameKind::Kernel => format!("{}_[k]", clean(&text)),
        // FlameGraph's own mark for JIT frames (its `--color=java` paints them apart).
        FrameKind::Jit(_) => format!("{}_[j]", clean(&text)),
        FrameKind::User | FrameKind::Label | FrameKind::Truncated => clean(&text),
    }
}

/// A name made safe for one frame of a line.
fn clean(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            ';' => ':',
            '\n' | '\r' => ' ',
            c => c,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::writers::{Format, testdata::*};

    fn lines(events: &[(crate::model::ids::ThreadKey, crate::model::Sample)]) -> Vec<String> {
        let out = String::from_utf8(write(Format::Collapsed, events)).unwrap();
        assert!(out.is_empty() || out.ends_with('\n'));
        out.lines().map(str::to_owned).collect()
    }

    #[test]
    fn off_cpu_time_is_counted_in_periods_under_its_own_frame() {
        use crate::writers::testdata::*;
        let mut blocked = sample(4, 0, Some(S_MAIN));
        let o =
            crate::model::OffCpu { weight_ns: 2_600_000, block_ns: 2_600_000, blocks: 1, state: 1 };
        blocked.off_cpu = Some(o);
        let l = lines(&[(MAIN, sample(1, 0, Some(S_MAIN))), (MAIN, blocked)]);
        assert_eq!(l.len(), 2, "{l:?}");
        assert!(l.iter().any(|l| l.ends_with(";main 1") && !l.contains("[off-cpu]")), "{l:?}");
        // 2.6 ms at 1000 Hz: 3 periods.
        assert!(l.iter().any(|l| l.contains(";[off-cpu];main 3")), "{l:?}");
    }

    #[test]
    fn one_sorted_line_per_stack_root_first() {
        let l = lines(&[
            (MAIN, sample(1, 0, Some(S_HOT))),
            (MAIN, sample(2, 0, Some(S_HOT))),
            (MAIN, sample(3, 0, Some(S_SYSCALL))),
            (WORKER, sample(1, 0, Some(S_LABEL))),
            (WORKER, sample(2, 0, Some(S_UNNAMED))),
            (STRANGER, sample(1, 0, None)),
            (IDLE, sample(1, 0, None)),
        ]);
        assert_eq!(
            l,
            [
                "7-7;8-8 1",
                "[idle];swapper/1 1",
                "app-100 [docker 3f2a9c1b];app-100;main;work;inl;hot 2",
                "app-100 [docker 3f2a9c1b];app-100;main;work;inl;hot;do_syscall_64_[k] 1",
                "app-100 [docker 3f2a9c1b];worker:1-101;main;a:b;phase 1 1",
                "app-100 [docker 3f2a9c1b];worker:1-101;main;libc.so.6+0x1234 1",
            ]
        );
        for line in &l {
            let (stack, n) = line.rsplit_once(' ').unwrap();
            assert!(n.parse::<u64>().unwrap() > 0 && !stack.is_empty());
        }
    }

    #[test]
    fn jit_frames_carry_flamegraphs_jit_mark() {
        use crate::model::stacks::{Frame, FrameKind, JitLanguage};
        let f = Frame {
            kind: FrameKind::Jit(JitLanguage::JavaScript),
            function: "JS:*jsHotAlpha /x.js:3:20".into(),
            module: "[jit]".into(),
            file: None,
            line: None,
            column: None,
            inlined: false,
            elf: None,
        };
        assert_eq!(super::frame_text(&f), "JS:*jsHotAlpha /x.js:3:20_[j]");
    }

    #[test]
    fn nothing_recorded_is_an_empty_file() {
        assert!(lines(&[]).is_empty());
    }
}
