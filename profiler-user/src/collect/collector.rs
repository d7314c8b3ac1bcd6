//! Turns decoded ring-buffer events into stored samples and process metadata. User addresses
//! are normalized here (`stack`), while the process is still alive to be asked for its
//! mappings; what other parts must act on goes to the `outbox`.

use crate::{
    bpf::decode::{self, KernelEvent, RecordError, Sample, TaskEvent, TaskKind},
    collect::{
        modules::ModuleTable,
        outbox::Outbox,
        processes::{ProcessInfo, ProcessTable},
        stack::{self, kernel_frames, refresh_space},
    },
    model::{
        address::FrameAddr,
        ids::{CgroupId, LabelId, Pid, ThreadKey},
        time::MonoNs,
    },
    store::{SampleSink, codec::StoredSample},
    system::procfs,
};

/// Distinct (process, label) sample counts kept for the summary.
const MAX_LABEL_COUNTS: usize = 65536;

#[derive(Clone, Copy, Debug, Default)]
pub struct CollectorStats {
    pub samples: u64,
    pub idle_samples: u64,
    /// Off-CPU records (not in `samples`) and the off-CPU time and blocks they carry.
    pub off_cpu_samples: u64,
    pub off_cpu_ns: u64,
    pub off_cpu_blocks: u64,
    pub task_events: u64,
    pub decode_errors: u64,
    /// User frames in no mapping of their process (e.g. it exited before we read its maps).
    pub unmapped_frames: u64,
    /// Reads of /proc/PID/maps that failed while the process still existed.
    pub maps_errors: u64,
    pub first_sample: Option<MonoNs>,
    pub last_sample: Option<MonoNs>,
    /// Exited processes dropped from the process table once their last stored event was
    /// recycled.
    pub forgotten_processes: u64,
}

pub struct Collector<S> {
    pub store: S,
    pub processes: ProcessTable,
    pub modules: ModuleTable,
    pub stats: CollectorStats,
    pub outbox: Outbox,
    /// Samples per (process, innermost label), for samples taken under `rsprof:label_push`.
    pub label_samples: std::collections::HashMap<(Pid, LabelId), u64>,
    frames: Vec<FrameAddr>,
}

impl<S: SampleSink> Collector<S> {
    pub fn new(store: S) -> Self {
        Self {
            store,
            processes: ProcessTable::default(),
            modules: ModuleTable::default(),
            stats: CollectorStats::default(),
            outbox: Outbox::default(),
            label_samples: Default::default(),
            frames: Vec::with_capacity(256),
        }
    }

    /// Handles one raw ring-buffer record; a record that does not decode is counted.
    pub fn handle_record(&mut self, bytes: &[u8]) -> Result<(), RecordError> {
        match decode::decode(bytes) {
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

    pub fn handle(&mut self, ev: KernelEvent) {
        match ev {
            KernelEvent::Sample(s) => self.on_sample(s),
            KernelEvent::Task(t) => self.on_task(t),
            KernelEvent::Usdt(u) => self.outbox.usdt_hit(u),
        }
    }

    /// Adds an already running process (e.g. `-p PID`) before any sample arrives.
    pub fn register_existing(&mut self, pid: Pid) {
        let p = self.processes.entry(pid);
        self.stats.maps_errors += u64::from(first_sight(pid, p, &mut self.modules).is_err());
        self.outbox.maps_changed(pid);
    }

    fn on_sample(&mut self, s: Sample) {
        if let Some(o) = s.off_cpu {
            self.stats.off_cpu_samples += 1;
            self.stats.off_cpu_ns += o.weight_ns;
            self.stats.off_cpu_blocks += u64::from(o.blocks);
        } else {
            self.stats.samples += 1;
            self.stats.first_sample.get_or_insert(s.time);
            self.stats.last_sample = Some(s.time);
            self.count_label(&s);
        }
        let (key, cpu_delta_ns) = match s.thread() {
            key @ ThreadKey::Idle { .. } => {
                // The idle tasks are no process; their runtime is idle time, not work.
                self.stats.idle_samples += 1;
                self.frames.clear();
                self.frames.extend(kernel_frames(&s.kernel_stack));
                (key, 0)
            }
            key => (key, self.observe_task(&s)),
        };
        let stack = self.store.intern_stack(&self.frames);
        let sample = StoredSample { time_ns: s.time.0, cpu_delta_ns, stack, off_cpu: s.off_cpu };
        self.store.push_sample(key, sample);
        let released = self.store.take_released_pids();
        if !released.is_empty() {
            self.stats.forgotten_processes += self.processes.forget_exited(&released) as u64;
        }
    }

    /// Updates what is known of a sampled task's process and thread, normalizes its stack
    /// into `frames`, and returns its CPU time since its previous sample (0 for off-CPU time,
    /// which carries no CPU time reading).
    fn observe_task(&mut self, s: &Sample) -> u64 {
        let p = self.processes.processes.entry(s.pid).or_default();
        if p.meta.name.is_empty() && p.space_read_at.is_none() {
            self.stats.maps_errors += u64::from(first_sight(s.pid, p, &mut self.modules).is_err());
            self.outbox.maps_changed(s.pid);
        }
        let main_thread = s.tid.0 == s.pid.0;
        let cgroup_paths = &mut self.processes.cgroup_paths;
        p.cgroup.observe(s.pid, main_thread, CgroupId(s.cgroup_id), cgroup_paths);
        p.meta.threads.entry(s.tid).or_default().observe_name(&s.comm);
        if main_thread && !s.comm.is_empty() {
            p.meta.name.clone_from(&s.comm);
        }
        let cpu_delta = if s.off_cpu.is_some() { 0 } else { p.cpu_delta(s.tid, s.cpu_time_ns) };
        let r = stack::normalize(s, p, &mut self.modules, &mut self.outbox, &mut self.frames);
        self.stats.unmapped_frames += r.unmapped;
        self.stats.maps_errors += r.maps_errors;
        cpu_delta
    }

    /// Only for the summary's top labels: a program pushing computed strings must not grow
    /// the counts without bound.
    fn count_label(&mut self, s: &Sample) {
        if let Some(label) = s.labels.last() {
            let key = (s.pid, LabelId(label.addr));
            if self.label_samples.len() < MAX_LABEL_COUNTS || self.label_samples.contains_key(&key)
            {
                *self.label_samples.entry(key).or_default() += 1;
            }
        }
    }

    fn on_task(&mut self, t: TaskEvent) {
        self.stats.task_events += 1;
        let p = self.processes.processes.entry(t.pid).or_default();
        match t.kind {
            TaskKind::Fork { .. } => {
                if t.pid.0 == t.tid.0 {
                    p.meta.start = Some(t.time);
                    if p.meta.name.is_empty() {
                        p.meta.name.clone_from(&t.comm);
                    }
                    // The child shares the parent's image until it execs; its own maps are
                    // read lazily on its first sample.
                }
                let th = p.meta.threads.entry(t.tid).or_default();
                th.start = Some(t.time);
                th.observe_name(&t.comm);
            }
            TaskKind::Exec { argv, .. } => {
                p.meta.name.clone_from(&t.comm);
                if !argv.is_empty() {
                    p.meta.argv = argv;
                }
                // New image: mappings of the old one no longer apply. Shared libraries are
                // not mapped yet, so the first unknown address re-reads the maps at once
                // (no rate limit); reading now keeps the binary if the process dies early.
                p.space = Default::default();
                self.stats.maps_errors +=
                    u64::from(refresh_space(t.pid, p, &mut self.modules).is_err());
                self.outbox.maps_changed(t.pid);
                p.space_read_at = None;
                p.meta.threads.entry(t.tid).or_default().observe_name(&t.comm);
            }
            TaskKind::Exit => {
                if p.meta.name.is_empty() {
                    p.meta.name.clone_from(&t.comm);
                }
                p.meta.threads.entry(t.tid).or_default().end = Some(t.time);
                self.outbox.thread_exited(t.tid);
                if t.pid.0 == t.tid.0 {
                    self.outbox.process_exited(t.pid);
                    p.meta.end = Some(t.time);
                    p.exited = true;
                }
            }
        }
    }
}

/// A process known from nothing but its pid: ask /proc for its name, argv and mappings.
fn first_sight(
    pid: Pid,
    p: &mut ProcessInfo,
    modules: &mut ModuleTable,
) -> Result<(), procfs::ProcError> {
    let (comm, argv) = procfs::read_identity(pid);
    p.meta.name = comm;
    p.meta.argv = argv;
    refresh_space(pid, p, modules)
}
