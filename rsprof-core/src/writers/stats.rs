//! What the written profile holds, tallied from the events export reads ([`SummaryCounts`]);
//! the session's summary reports it next to the kernel and collector counters.

use std::collections::{HashMap, HashSet};

use crate::{
    model::{
        Sample,
        ids::{Pid, StackId, ThreadKey},
        markers::Marker,
        stacks::{FrameIndex, FrameKind, SymbolizedStacks},
    },
    symbolize::{ANON_MODULE, JITDUMP_MODULE, PYTHON_MODULE},
    writers::{EventSink, ProfileContext},
};

/// What the written profile holds, for the summary.
#[derive(Clone, Debug, Default)]
pub struct ProfileStats {
    pub processes: usize,
    pub threads: usize,
    pub samples: u64,
    pub idle_samples: u64,
    pub markers: u64,
    /// Off-CPU records written (as samples spread over their time; not in `samples`).
    pub off_cpu_records: u64,
    /// Self samples per leaf function ("name (in module)"), most first; idle excluded.
    pub top_functions: Vec<(String, u64)>,
    /// Time range (ms since start) recycled away to stay within the buffer size.
    pub dropped_ms: Option<(f64, f64)>,
    pub dropped_events: u64,
    /// Corrupt chunks or blocks found while reading storage (skipped).
    pub corrupt: Vec<String>,
    /// Frames of samples named from perf maps, from jitdumps, frames in anonymous executable
    /// memory left unnamed, and the processes with such frames.
    pub jit_named_frames: u64,
    pub jit_dump_frames: u64,
    pub jit_unnamed_frames: u64,
    pub jit_unnamed_processes: usize,
    /// On-CPU samples of busy threads (idle excluded): with no stack at all, and with a stack
    /// cut short (its root a `[truncated: …]` frame).
    pub busy_no_stack: u64,
    pub busy_truncated: u64,
}

/// Tallies a recording's events for the summary.
pub struct SummaryCounts<'a> {
    stacks: &'a SymbolizedStacks,
    stats: ProfileStats,
    threads: HashSet<ThreadKey>,
    processes: HashSet<Option<Pid>>,
    leaves: HashMap<FrameIndex, u64>,
    /// (JIT frames named from perf maps, from jitdumps, anonymous frames unnamed) of each
    /// stack, root to leaf.
    jit: HashMap<StackId, (u32, u32, u32)>,
    jit_unnamed_processes: HashSet<Pid>,
    /// Whether each stack's root is a truncation marker.
    cut: HashMap<StackId, bool>,
}

impl<'a> SummaryCounts<'a> {
    pub fn new(stacks: &'a SymbolizedStacks) -> Self {
        Self {
            stacks,
            stats: ProfileStats::default(),
            threads: HashSet::new(),
            processes: HashSet::new(),
            leaves: HashMap::new(),
            jit: HashMap::new(),
            jit_unnamed_processes: HashSet::new(),
            cut: HashMap::new(),
        }
    }

    /// JIT frames named (from perf maps, from jitdumps) and anonymous frames left unnamed on
    /// stack `id`, each node counted once.
    fn jit_frames(&mut self, id: StackId) -> (u32, u32, u32) {
        let mut path = Vec::new();
        let mut cur = Some(id);
        let mut base = (0, 0, 0);
        while let Some(i) = cur {
            if let Some(&known) = self.jit.get(&i) {
                base = known;
                break;
            }
            let Some((parent, _)) = self.stacks.node(i) else { break };
            path.push(i);
            cur = parent;
        }
        for &i in path.iter().rev() {
            for &f in self.stacks.node(i).map(|n| n.1).unwrap_or_default() {
                match self.stacks.frame(f) {
                    // Python frames read from the interpreter have their own line.
                    Some(f) if matches!(f.kind, FrameKind::Jit(_)) && f.module != PYTHON_MODULE => {
                        if f.module == JITDUMP_MODULE {
                            base.1 += 1;
                        } else {
                            base.0 += 1;
                        }
                    }
                    Some(f) if f.kind == FrameKind::User && f.module == ANON_MODULE => base.2 += 1,
                    _ => {}
                }
            }
            self.jit.insert(i, base);
        }
        base
    }

    /// Whether stack `id` was cut short: the walk marks it with a `Truncated` root frame.
    fn truncated(&mut self, id: StackId) -> bool {
        let mut path = Vec::new();
        let mut cur = Some(id);
        let mut cut = false;
        while let Some(i) = cur {
            if let Some(&known) = self.cut.get(&i) {
                cut = known;
                break;
            }
            let Some((parent, frames)) = self.stacks.node(i) else { break };
            path.push(i);
            if parent.is_none() {
                let root = frames.first().and_then(|&f| self.stacks.frame(f));
                cut = root.is_some_and(|f| f.kind == FrameKind::Truncated);
            }
            cur = parent;
        }
        for i in path {
            self.cut.insert(i, cut);
        }
        cut
    }

    fn thread(&mut self, t: ThreadKey) {
        if self.threads.insert(t) {
            self.processes.insert(t.pid());
        }
    }

    pub fn finish(self, ctx: &ProfileContext, corrupt: &[String]) -> ProfileStats {
        let mut stats = self.stats;
        stats.threads = self.threads.len();
        stats.processes = self.processes.len();
        stats.top_functions = top_functions(self.stacks, self.leaves, 10);
        let r = ctx.recycled;
        if let Some((first, last)) = r.range {
            stats.dropped_ms = Some((ctx.info.ms(first), ctx.info.ms(last)));
            stats.dropped_events = r.events;
        }
        stats.corrupt = corrupt.to_vec();
        stats.jit_unnamed_processes = self.jit_unnamed_processes.len();
        stats
    }
}

impl EventSink for SummaryCounts<'_> {
    fn sample(&mut self, thread: ThreadKey, s: &Sample) {
        self.thread(thread);
        if s.off_cpu.is_some() {
            self.stats.off_cpu_records += 1;
            return;
        }
        self.stats.samples += 1;
        if thread.is_idle() {
            self.stats.idle_samples += 1;
        } else {
            match s.stack {
                None => self.stats.busy_no_stack += 1,
                Some(id) if self.truncated(id) => self.stats.busy_truncated += 1,
                Some(_) => {}
            }
            if let Some(leaf) = s.stack.and_then(|id| self.stacks.leaf(id)) {
                *self.leaves.entry(leaf).or_default() += 1;
            }
        }
        if let Some(id) = s.stack {
            let (named, from_dump, unnamed) = self.jit_frames(id);
            self.stats.jit_named_frames += u64::from(named);
            self.stats.jit_dump_frames += u64::from(from_dump);
            self.stats.jit_unnamed_frames += u64::from(unnamed);
            if let (true, Some(pid)) = (unnamed > 0, thread.pid()) {
                self.jit_unnamed_processes.insert(pid);
            }
        }
    }

    fn marker(&mut self, thread: ThreadKey, _: &Marker) {
        self.thread(thread);
        self.stats.markers += 1;
    }
}

fn top_functions(
    tree: &SymbolizedStacks,
    leaves: HashMap<FrameIndex, u64>,
    n: usize,
) -> Vec<(String, u64)> {
    // Inlined frames of one address share a leaf; merge by name so a function counts once.
    let mut by_name: HashMap<String, u64> = HashMap::new();
    for (f, c) in leaves {
        if let Some(fr) = tree.frame(f) {
            *by_name.entry(format!("{} (in {})", fr.function, fr.module)).or_default() += c;
        }
    }
    let mut v: Vec<_> = by_name.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    v.truncate(n);
    v
}
