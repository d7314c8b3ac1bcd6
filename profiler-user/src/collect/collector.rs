//! Turns decoded ring-buffer events into stored samples and process metadata. User addresses
//! are normalized here, while the process is still alive to be asked for its mappings.

use std::time::{Duration, Instant};

use crate::{
    bpf::decode::{DecodeError, Event, LabelRef, RawUsdtHit, Sample, TaskEvent, TaskKind},
    collect::modules::{ModuleTable, read_address_space},
    collect::processes::{ProcessInfo, ProcessTable, read_proc_identity},
    model::ids::{Pid, Tid},
    store::codec::{StoredSample, ThreadKey},
    store::{FrameAddr, SampleSink},
};

/// Distinct (process, label) sample counts kept for the summary.
const MAX_LABEL_COUNTS: usize = 65536;

/// Re-read /proc/PID/maps for an unknown address at most this often per process.
const MAPS_REFRESH_INTERVAL: Duration = Duration::from_millis(20);

#[derive(Clone, Copy, Debug, Default)]
pub struct CollectorStats {
    pub samples: u64,
    pub idle_samples: u64,
    pub task_events: u64,
    pub decode_errors: u64,
    /// User frames in no mapping of their process (e.g. it exited before we read its maps).
    pub unmapped_frames: u64,
    pub first_sample_ns: Option<u64>,
    /// Exited processes dropped from the process table once their last stored event was
    /// recycled.
    pub forgotten_processes: u64,
    pub last_sample_ns: Option<u64>,
}

pub struct Collector<S> {
    pub store: S,
    pub processes: ProcessTable,
    pub modules: ModuleTable,
    pub stats: CollectorStats,
    frames: Vec<FrameAddr>,
    /// USDT hits in arrival order, for `usdt::UsdtSession` to resolve.
    pub usdt_hits: Vec<RawUsdtHit>,
    /// Samples per (process, innermost label id), for samples taken under `rsprof:label_push`.
    pub label_samples: std::collections::HashMap<(Pid, u64), u64>,
    /// Processes whose mappings were (re)read since the USDT attacher last looked: they may
    /// have mapped new files with probes.
    pub maps_changed: Vec<Pid>,
    /// Threads and processes that exited since the USDT session last looked: their open
    /// intervals can no longer end.
    pub exited_threads: Vec<Tid>,
    pub exited_processes: Vec<Pid>,
}

impl<S: SampleSink> Collector<S> {
    pub fn new(store: S) -> Self {
        Self {
            store,
            processes: ProcessTable::default(),
            modules: ModuleTable::default(),
            stats: CollectorStats::default(),
            frames: Vec::with_capacity(256),
            usdt_hits: Vec::new(),
            label_samples: Default::default(),
            maps_changed: Vec::new(),
            exited_threads: Vec::new(),
            exited_processes: Vec::new(),
        }
    }

    /// Handles one raw ring-buffer record.
    pub fn handle_record(&mut self, bytes: &[u8]) -> Result<(), DecodeError> {
        match crate::bpf::decode::decode(bytes) {
            Ok(ev) => {
                self.handle(ev);
                Ok(())
            }
            Err(e) => {
                self.stats.decode_errors += 1;
                Err(e)
            }
        }
    }

    pub fn handle(&mut self, ev: Event) {
        match ev {
            Event::Sample(s) => self.on_sample(s),
            Event::Task(t) => self.on_task(t),
            Event::Usdt(u) => self.usdt_hits.push(u),
        }
    }

    /// Adds an already running process (e.g. `-p PID`) before any sample arrives.
    pub fn register_existing(&mut self, pid: Pid) {
        let p = self.processes.processes.entry(pid).or_default();
        first_sight(pid, p, &mut self.modules);
        self.maps_changed.push(pid);
    }

    fn on_sample(&mut self, s: Sample) {
        self.stats.samples += 1;
        if let Some(label) = s.labels.last() {
            let key = (s.pid, label.addr);
            // Only for the summary's top labels: a program pushing computed strings must not
            // grow it without bound.
            if self.label_samples.len() < MAX_LABEL_COUNTS || self.label_samples.contains_key(&key)
            {
                *self.label_samples.entry(key).or_default() += 1;
            }
        }
        self.stats.first_sample_ns.get_or_insert(s.time_ns);
        self.stats.last_sample_ns = Some(s.time_ns);
        let idle = s.pid.0 == 0;
        let key = if idle {
            self.stats.idle_samples += 1;
            ThreadKey::idle(s.cpu)
        } else {
            ThreadKey { pid: s.pid, tid: s.tid }
        };

        self.frames.clear();
        let mut unmapped = 0;
        {
            let modules = &mut self.modules;
            let p = self.processes.processes.entry(s.pid).or_default();
            if p.name.is_empty() && p.space_read_at.is_none() && !idle {
                first_sight(s.pid, p, modules);
                self.maps_changed.push(s.pid);
            }
            if !idle {
                let cache = &mut self.processes.cgroup_paths;
                p.cgroup.observe(s.pid, s.tid.0 == s.pid.0, s.cgroup_id, cache);
            }
            if idle && p.name.is_empty() {
                p.name = "[idle]".into();
            }
            let t = p.threads.entry(key.tid).or_default();
            t.observe_name(&if idle { format!("swapper/{}", s.cpu) } else { s.comm.clone() });
            let cpu_delta = t.cpu_delta(s.cpu_time_ns);
            if s.tid.0 == s.pid.0 && !idle && !s.comm.is_empty() {
                p.name.clone_from(&s.comm);
            }

            // Root first: user frames outermost..leaf with label frames placed under the
            // frames that pushed them, then kernel frames entry..leaf.
            let n = s.user_stack.len();
            let places = label_places(&s.labels, n);
            let mut next_label = 0;
            for (i, &addr) in s.user_stack.iter().enumerate().rev() {
                let root_pos = n - 1 - i;
                while next_label < places.len() && places[next_label] <= root_pos {
                    let addr = s.labels[next_label].addr;
                    self.frames.push(FrameAddr::Label { pid: s.pid, addr });
                    next_label += 1;
                }
                // Callers' entries are return addresses; look up the call instruction.
                let lookup = if i == 0 { addr } else { addr.saturating_sub(1) };
                let mut hit = p.space.lookup(lookup);
                if hit.is_none() && !p.exited && stale(p) {
                    refresh_space(s.pid, p, modules);
                    self.maps_changed.push(s.pid);
                    hit = p.space.lookup(lookup);
                }
                self.frames.push(match hit {
                    Some((module, offset)) => FrameAddr::User { module, offset },
                    None => {
                        unmapped += 1;
                        FrameAddr::Unmapped(addr)
                    }
                });
            }
            for l in &s.labels[next_label..] {
                self.frames.push(FrameAddr::Label { pid: s.pid, addr: l.addr });
            }
            for (i, &addr) in s.kernel_stack.iter().enumerate().rev() {
                self.frames.push(FrameAddr::Kernel(if i == 0 { addr } else { addr - 1 }));
            }
            let stack = self.store.intern_stack(&self.frames);
            self.store.push_sample(
                key,
                StoredSample { time_ns: s.time_ns, cpu_delta_ns: cpu_delta, stack },
            );
        }
        self.stats.unmapped_frames += unmapped;
        let released = self.store.take_released_pids();
        if !released.is_empty() {
            self.stats.forgotten_processes += self.processes.forget_exited(&released) as u64;
        }
    }

    fn on_task(&mut self, t: TaskEvent) {
        self.stats.task_events += 1;
        match t.kind {
            TaskKind::Fork { .. } => {
                let new_process = t.pid.0 == t.tid.0;
                let p = self.processes.processes.entry(t.pid).or_default();
                if new_process {
                    p.start_ns = Some(t.time_ns);
                    if p.name.is_empty() {
                        p.name.clone_from(&t.comm);
                    }
                    // The child shares the parent's image until it execs; its own maps are
                    // read lazily on its first sample.
                }
                let th = p.threads.entry(t.tid).or_default();
                th.start_ns = Some(t.time_ns);
                th.observe_name(&t.comm);
            }
            TaskKind::Exec { argv, .. } => {
                let modules = &mut self.modules;
                let p = self.processes.processes.entry(t.pid).or_default();
                p.name.clone_from(&t.comm);
                if !argv.is_empty() {
                    p.argv = argv;
                }
                // New image: mappings of the old one no longer apply. Shared libraries are
                // not mapped yet, so the first unknown address re-reads the maps at once
                // (no rate limit); reading now keeps the binary if the process dies early.
                p.space = Default::default();
                refresh_space(t.pid, p, modules);
                self.maps_changed.push(t.pid);
                p.space_read_at = None;
                p.threads.entry(t.tid).or_default().observe_name(&t.comm);
            }
            TaskKind::Exit => {
                let p = self.processes.processes.entry(t.pid).or_default();
                if p.name.is_empty() {
                    p.name.clone_from(&t.comm);
                }
                p.threads.entry(t.tid).or_default().end_ns = Some(t.time_ns);
                self.exited_threads.push(t.tid);
                if t.pid.0 == t.tid.0 {
                    self.exited_processes.push(t.pid);
                    p.end_ns = Some(t.time_ns);
                    p.exited = true;
                }
            }
        }
    }
}

/// Where each label (outermost first) goes among `n` user frames listed root first: before
/// frame `place`, i.e. right under the `depth` frames that were on the stack when it was
/// pushed. An unknown depth (0), one deeper than this stack, or a stack cut at the walk's
/// limit (it keeps the leaf end, so counting from the root is off) puts the label just above
/// the leaf; places never decrease, so labels keep their push order.
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

/// A process known from nothing but its pid: ask /proc for its name, argv and mappings.
fn first_sight(pid: Pid, p: &mut ProcessInfo, modules: &mut ModuleTable) {
    let (comm, argv) = read_proc_identity(pid);
    p.name = comm;
    p.argv = argv;
    refresh_space(pid, p, modules);
}

fn stale(p: &ProcessInfo) -> bool {
    p.space_read_at.is_none_or(|t| t.elapsed() >= MAPS_REFRESH_INTERVAL)
}

fn refresh_space(pid: Pid, p: &mut ProcessInfo, modules: &mut ModuleTable) {
    p.space_read_at = Some(Instant::now());
    match read_address_space(pid, modules) {
        Ok(space) => p.space = space,
        Err(_) => p.exited = true,
    }
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
