//! Turns decoded ring-buffer events into stored samples and process metadata. User addresses
//! are normalized here (`stack`) through each process's address space, which the kernel's
//! mapping records keep current (one ring, ordered by reservation across CPUs, so a mapping is
//! applied before any sample that runs code in it); /proc/PID/maps is read once, only for
//! processes that existed before the recording. What other parts must act on goes to the
//! `outbox`.

use crate::{
    collect::copied::CopiedStacks,
    collect::{
        facts::{LiveProc, ProcFacts},
        modules::{LoadedAt, Mapping, ModuleTable},
        outbox::{Forked, Outbox},
        processes::{ProcessInfo, ProcessTable, SpaceSource},
        stack::{self, kernel_frames, read_space_once},
        stack_cache::StackCache,
    },
    collect::{jitdump, perfmap::PerfMapStats},
    decode::{
        self, KernelEvent, LabelDepthEvent, MapEvent, MapKind, RecordError, Sample, TaskEvent,
        TaskKind,
    },
    model::{
        address::{FrameAddr, UserStackEnd},
        ids::{CgroupId, LabelId, Pid, StackId, ThreadKey, Tid},
        time::MonoNs,
    },
    store::{SampleSink, codec::StoredSample},
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
    /// User frames in no known mapping of their process (e.g. a mapping record was lost).
    pub unmapped_frames: u64,
    /// Reads of /proc/PID/maps that failed while the process still existed.
    pub maps_errors: u64,
    /// Reads of /proc/PID/maps (once per process that existed before the recording).
    pub maps_reads: u64,
    /// Of those, reads after the initial scan (a process first seen later: its fork record
    /// was lost, or it was forked while the probes were being attached).
    pub maps_reads_late: u64,
    /// Set by [`Collector::initial_scan_done`].
    pub started: bool,
    /// Executable mappings and removals received from the kernel.
    pub map_events: u64,
    /// Executables or interpreters whose code could not be placed (file unreadable).
    pub maps_unresolved: u64,
    pub first_sample: Option<MonoNs>,
    pub last_sample: Option<MonoNs>,
    /// Exited processes dropped from the process table once their last stored event was
    /// recycled.
    pub forgotten_processes: u64,
    /// Modules released: no known process maps them and no stored stack names them.
    pub released_modules: u64,
    /// Exited threads of live processes dropped from the thread table the same way.
    pub forgotten_threads: u64,
    /// Most threads the process table held at once (counted every
    /// `THREAD_CENSUS_INTERVAL_NS`, less often with a large table, and at the end).
    pub peak_threads: u64,
    /// Labels pushed before the kernel could walk the pusher's stack whose depth a copy of
    /// that stack gave, and those whose depth stayed unknown (shown above the leaf).
    pub label_depths_found: u64,
    pub label_depths_unknown: u64,
    /// Off-CPU records whose user stack was finished from a copy sent at the switch-out, and
    /// copies dropped because too many threads held one.
    pub off_cpu_copies_used: u64,
    pub off_cpu_copies_dropped: u64,
    /// What reading processes' perf maps did.
    pub perf_maps: PerfMapStats,
    /// What reading processes' jitdumps did.
    pub jitdumps: jitdump::JitDumpStats,
    /// CPU samples whose user stack was walked with tables, as the profile holds them (stack
    /// copies finished): (complete, walked) in the first second after the first sample, when
    /// tables are still landing, and after it.
    pub user_stacks_first_second: (u64, u64),
    pub user_stacks_after: (u64, u64),
    /// What reading Python frames did, for CPU samples and for off-CPU records.
    pub python: crate::collect::python::PyStats,
    pub python_off_cpu: crate::collect::python::PyStats,
}

/// How long after a process's first anonymous code drains follow each other closely.
const FIRST_CODE_FOLLOW_NS: u64 = 250_000_000;

/// Threads holding an off-CPU stack copy at once: each waits for its thread's off-CPU record
/// (sent when the thread wakes), so only threads blocked since the copy hold one.
const MAX_OFF_CPU_COPIES: usize = 4096;

pub struct Collector<S> {
    pub store: S,
    pub processes: ProcessTable,
    pub modules: ModuleTable,
    pub stats: CollectorStats,
    pub outbox: Outbox,
    /// Samples per (process, innermost label), for samples taken under `rsprof:label_push`.
    pub label_samples: std::collections::HashMap<(Pid, LabelId), u64>,
    /// Finishes user stack walks the kernel stopped for want of a table (stack copies).
    pub copies: CopiedStacks,
    /// Drains should follow each other closely until then (`Recorder::drain`).
    pub drain_soon_until: MonoNs,
    /// Which processes run CPython.
    pub python: crate::collect::python::tracker::PyTracker,
    /// The last sample that carried Python frames: a process that maps libpython without
    /// running it (perf, which embeds it for scripts) sends none.
    pub python_frames_at: Option<MonoNs>,
    /// Each blocked thread's latest off-CPU stack copy, for its off-CPU record to come.
    off_cpu_copies:
        std::collections::HashMap<Tid, decode::OffCpuCopyEvent, foldhash::fast::RandomState>,
    frames: Vec<FrameAddr>,
    /// Reused for every mapping record (see `on_map`).
    map_scratch: Vec<Mapping>,
    /// Reused for every sample record (see `handle_record`).
    sample: Sample,
    pub stack_cache: StackCache,
    /// Processes forgotten since the module table was last swept, and when that was.
    forgotten_since_sweep: u64,
    last_sweep: MonoNs,
    /// When `stats.peak_threads` is next updated.
    next_thread_census: MonoNs,
    /// Where processes that existed before the recording are read (see `facts`).
    facts: Box<dyn ProcFacts>,
    /// `facts.live()`.
    live: bool,
}

/// How long an exited process without stored events is kept while threads of it may still
/// run (its main thread can exit first): their records follow its exit record.
pub const EXIT_GRACE_NS: u64 = 1_000_000_000;
/// ...once every thread it had has exited. Records are in the ring in the order they were
/// reserved, each when its event happened (a sample in its NMI), so what can follow the exit
/// record is what the kernel did in the thread's last microseconds (the rest of do_exit).
/// A short grace frees the process's entries while they are still in the CPU's caches: under
/// an exec storm, freeing them a second later was 40% of the agent's time.
pub const LAST_THREAD_EXIT_GRACE_NS: u64 = 10_000_000;
/// How often the threads held are counted for `CollectorStats::peak_threads`.
pub const THREAD_CENSUS_INTERVAL_NS: u64 = 100_000_000;
/// A count visits every process (a cache miss or two each). An exec storm keeps some 20,000
/// exited processes held at once, and counting them ten times a second was a fifth of the
/// collector's time: counts are spaced by this much per process held, i.e. at most about
/// 10,000 processes visited a second.
pub const THREAD_CENSUS_NS_PER_PROCESS: u64 = 100_000;
/// Sweeps of the module table (a pass over the stored stacks) are at least this far apart.
pub const MODULE_SWEEP_INTERVAL_NS: u64 = 10_000_000_000;

impl<S: SampleSink> Collector<S> {
    pub fn new(store: S) -> Self {
        Self {
            store,
            processes: ProcessTable::default(),
            modules: ModuleTable::default(),
            stats: CollectorStats::default(),
            outbox: Outbox::default(),
            label_samples: Default::default(),
            copies: CopiedStacks::default(),
            off_cpu_copies: Default::default(),
            python: Default::default(),
            python_frames_at: None,
            drain_soon_until: MonoNs(0),
            frames: Vec::with_capacity(256),
            map_scratch: Vec::new(),
            sample: Sample::default(),
            stack_cache: StackCache::default(),
            forgotten_since_sweep: 0,
            last_sweep: MonoNs(0),
            next_thread_census: MonoNs(0),
            facts: Box::new(LiveProc),
            live: true,
        }
    }

    /// Reads processes that existed before the recording through `facts` (by default /proc).
    /// Not live facts (a replay) also turn off the reads by pid they cannot answer: perf
    /// maps, jitdumps, CPython's memory, /proc/PID/cgroup.
    pub fn set_facts(&mut self, facts: Box<dyn ProcFacts>) {
        self.live = facts.live();
        if !self.live {
            self.processes.cgroup_paths.go_offline();
        }
        self.facts = facts;
    }

    /// The stats, with `peak_threads` covering the threads held now.
    pub fn stats_now(&self) -> CollectorStats {
        let mut s = self.stats;
        s.peak_threads = s.peak_threads.max(self.processes.thread_count() as u64);
        s
    }

    /// Handles one raw ring-buffer record; a record that does not decode is counted.
    pub fn handle_record(&mut self, bytes: &[u8]) -> Result<(), RecordError> {
        // Samples, nearly every record, are decoded into one reused `Sample`.
        let mut s = std::mem::take(&mut self.sample);
        let r = match decode::decode_sample_into(bytes, &mut s) {
            Ok(true) => {
                self.on_sample(&mut s);
                Ok(())
            }
            Ok(false) => decode::decode(bytes).map(|ev| self.handle(ev)),
            Err(e) => Err(e),
        };
        self.sample = s;
        if r.is_err() {
            self.stats.decode_errors += 1;
        }
        r
    }

    pub fn handle(&mut self, ev: KernelEvent) {
        match ev {
            KernelEvent::Sample(mut s) => self.on_sample(&mut s),
            KernelEvent::Task(t) => self.on_task(t),
            KernelEvent::Usdt(u) => self.outbox.usdt_hit(u),
            KernelEvent::Map(m) => self.on_map(m),
            KernelEvent::LabelDepth(l) => self.on_label_depth(l),
            KernelEvent::OffCpuCopy(c) => self.on_off_cpu_copy(c),
        }
    }

    /// Looks for CPython in process `pid` (its mappings changed, or a sample carries Python
    /// frames of a process not looked at since they did).
    pub fn check_python(&mut self, pid: Pid) {
        let Some(p) = self.processes.processes.get_mut(&pid) else { return };
        if !self.live {
            return;
        }
        if self.python.check(pid, p, &self.modules, &mut self.stats.python) {
            let until = crate::collect::python::tracker::follow_until(MonoNs::now());
            self.drain_soon_until = self.drain_soon_until.max(until);
        }
    }

    /// Kept until the thread's off-CPU record for that block arrives (when it wakes), which
    /// continues its walk over the copy as a sample's would be.
    fn on_off_cpu_copy(&mut self, c: decode::OffCpuCopyEvent) {
        if self.off_cpu_copies.len() >= MAX_OFF_CPU_COPIES
            && !self.off_cpu_copies.contains_key(&c.tid)
        {
            self.stats.off_cpu_copies_dropped += 1;
            return;
        }
        self.off_cpu_copies.insert(c.tid, c);
    }

    /// Adds an already running process (e.g. `-p PID`) before any sample arrives.
    pub fn register_existing(&mut self, pid: Pid) {
        let p = self.processes.entry(pid);
        if p.space_source == SpaceSource::Unknown {
            first_sight(pid, p, &mut self.modules, &mut self.stats, &mut *self.facts);
        }
        self.outbox.maps_changed(pid);
    }

    /// Processes that existed at the start are registered: reads of /proc/PID/maps from now
    /// on are counted as late.
    pub fn initial_scan_done(&mut self) {
        self.stats.started = true;
    }

    /// The process, its address space read from /proc first if it is one that existed before
    /// the recording and was not seen yet.
    fn known(&mut self, pid: Pid) -> &mut ProcessInfo {
        let facts = &mut *self.facts;
        known(&mut self.processes, pid, &mut self.modules, &mut self.stats, &mut self.outbox, facts)
    }

    fn on_map(&mut self, m: MapEvent) {
        self.stats.map_events += 1;
        let anon_code = matches!(m.kind, MapKind::Anon);
        let live = self.live;
        // Reused: mapping records arrive by the thousand a second in an exec storm.
        let mut mappings = std::mem::take(&mut self.map_scratch);
        mappings.clear();
        let p = self.known(m.pid);
        if p.mm != m.mm {
            // A space read from /proc does not know its mm: the first record names it. Any
            // other change means the exec record of a new image was lost: start afresh.
            if p.mm != 0 {
                p.space = Default::default();
                p.anon_unmapped(0, u64::MAX);
            }
            p.mm = m.mm;
        }
        match &m.kind {
            MapKind::Unmap => {
                p.space.remove(m.start, m.end);
                p.anon_unmapped(m.start, m.end);
                self.map_scratch = mappings;
                return;
            }
            MapKind::Anon => {
                if !p.made_code {
                    // A runtime's first JIT code: drain often for a moment, so its first
                    // samples name it (and CPython's trampolines get their walker rule)
                    // within milliseconds, not at the next timed drain a second later.
                    p.made_code = true;
                    let until = MonoNs(m.time.0 + FIRST_CODE_FOLLOW_NS);
                    self.drain_soon_until = self.drain_soon_until.max(until);
                }
                let module = self.modules.anon();
                mappings.push(Mapping { start: m.start, end: m.end, file_offset: 0, module });
            }
            MapKind::File { offset, dev, inode, path } => {
                let ident = (*dev, *inode);
                if jitdump::is_dump_path(&path.path) && live {
                    // A JIT announcing its jitdump (it maps the file executable, as perf
                    // expects): followed from now on.
                    let (pid, range) = (m.pid, (m.start, m.end));
                    let dump = &mut p.jit_files().jit_dump;
                    dump.found(|| jitdump::open_mapped(pid, range, Some(ident), &path.path));
                    let found = dump.take_stats();
                    self.stats.jitdumps.add(&found);
                }
                let module =
                    self.modules.kernel_module(m.pid, (m.start, m.end), ident, path, false);
                mappings.push(Mapping { start: m.start, end: m.end, file_offset: *offset, module });
            }
            MapKind::ExeText { dev, inode, path } => {
                let ident = (*dev, *inode);
                let module = self.modules.kernel_module(m.pid, (m.start, m.end), ident, path, true);
                let p = self.processes.entry(m.pid);
                p.exe_module = Some(module);
                p.meta.exe.clone_from(&self.modules.get(module).path);
                self.modules.loaded_code(module, LoadedAt::LowestCode(m.start), &mut mappings);
            }
            MapKind::Interp { file } => {
                let module = match file {
                    Some((dev, inode, path)) => Some(self.modules.kernel_module(
                        m.pid,
                        (m.start, m.end),
                        (*dev, *inode),
                        path,
                        false,
                    )),
                    None => p.exe_module.and_then(|exe| self.modules.interpreter(m.pid, exe)),
                };
                if let Some(module) = module {
                    self.modules.loaded_code(module, LoadedAt::Base(m.start), &mut mappings);
                }
            }
        }
        if mappings.is_empty() {
            self.stats.maps_unresolved += 1;
        }
        let p = self.processes.entry(m.pid);
        for &mapping in &mappings {
            let (start, end) = (mapping.start, mapping.end);
            if anon_code {
                // Anonymous code over memory that held none is new code: what a jitdump
                // loaded there before cannot name it. Parts that held anonymous code already
                // (a change of protection, a mapping grown) keep their time.
                let mut at = start;
                let mut gaps = Vec::new();
                for held in p.space.mappings().iter().filter(|h| h.module == mapping.module) {
                    if held.end <= at || held.start >= end {
                        continue;
                    }
                    if held.start > at {
                        gaps.push((at, held.start));
                    }
                    at = at.max(held.end);
                }
                if at < end {
                    gaps.push((at, end));
                }
                for (s, e) in gaps {
                    p.anon_mapped(s, e, m.time.0);
                }
            } else {
                p.anon_unmapped(start, end);
            }
            p.space.insert(mapping);
        }
        if anon_code {
            p.anon_code_mapped(self.modules.anon());
        }
        p.space.saw_early(m.early_seq);
        self.outbox.maps_changed(m.pid);
        self.map_scratch = mappings;
    }

    /// A label pushed before the kernel had the tables to walk its pusher's stack: the walk
    /// continues here over the copy (as for samples), so the label goes under its pusher.
    fn on_label_depth(&mut self, l: LabelDepthEvent) {
        self.known(l.pid);
        let Some(p) = self.processes.processes.get_mut(&l.pid) else { return };
        let depth = self.copies.depth(l.frames, &l.copy, &p.space, &self.modules);
        if depth.is_some() {
            self.stats.label_depths_found += 1;
        } else {
            self.stats.label_depths_unknown += 1;
        }
        p.set_label_depth(l.tid, l.index, l.label, depth);
    }

    fn on_sample(&mut self, s: &mut Sample) {
        // How the kernel's walk ended, and where, before a stack copy's walk continues it.
        let kernel_walk = (s.user_stack_end(), s.user_stack.last().copied());
        if s.labels.iter().any(|l| l.depth == 0)
            && let Some(p) = self.processes.processes.get(&s.pid)
        {
            p.resolve_label_depths(s.tid, &mut s.labels);
        }
        if s.off_cpu.is_some()
            && s.stack_copy.is_none()
            && let Some(c) = self.off_cpu_copies.get(&s.tid)
            && c.time == s.stack_ns
            && c.pid == s.pid
            && c.frames as usize == s.user_stack.len()
        {
            // A sum of short blocks may carry the same block's stack again: the copy stays
            // until the thread blocks with another copy or exits.
            s.stack_copy = Some(Box::new(c.copy.clone()));
            self.stats.off_cpu_copies_used += 1;
        }
        if s.stack_copy.is_some() {
            // The mapping records sent before this sample are applied: the process's address
            // space is what the kernel's walk lacked.
            self.known(s.pid);
            if let Some(p) = self.processes.processes.get(&s.pid) {
                self.copies.complete(s, &p.space, &self.modules);
            }
        }
        if let Some(o) = s.off_cpu {
            self.stats.off_cpu_samples += 1;
            self.stats.off_cpu_ns += o.weight_ns;
            self.stats.off_cpu_blocks += u64::from(o.blocks);
        } else {
            self.stats.samples += 1;
            let first = *self.stats.first_sample.get_or_insert(s.time);
            self.stats.last_sample = Some(s.time);
            let end = s.user_stack_end();
            if end != UserStackEnd::NotWalked {
                let bucket = if s.time.0.saturating_sub(first.0) < 1_000_000_000 {
                    &mut self.stats.user_stacks_first_second
                } else {
                    &mut self.stats.user_stacks_after
                };
                bucket.0 += u64::from(end == UserStackEnd::Complete);
                bucket.1 += 1;
            }
            self.count_label(s);
        }
        let (key, cpu_delta_ns, stack) = match s.thread() {
            key @ ThreadKey::Idle { .. } => {
                // The idle tasks are no process; their runtime is idle time, not work.
                self.stats.idle_samples += 1;
                (key, 0, self.idle_stack(s))
            }
            key => {
                let (cpu_delta_ns, stack) = self.observe_task(s);
                if s.off_cpu.is_none() {
                    self.tables_wanted(s, kernel_walk);
                }
                (key, cpu_delta_ns, stack)
            }
        };
        let sample = StoredSample { time_ns: s.time.0, cpu_delta_ns, stack, off_cpu: s.off_cpu };
        self.store.push_sample(key, sample);
        let released = self.store.take_released_pids();
        if !released.is_empty() {
            self.forget(&released);
        }
        let released = self.store.take_released_threads();
        if !released.is_empty() {
            self.forget_threads(released);
        }
        self.prune(s.time);
    }

    fn forget(&mut self, pids: &[Pid]) {
        let n = self.processes.forget_exited(pids) as u64;
        self.stats.forgotten_processes += n;
        self.forgotten_since_sweep += n;
    }

    fn forget_threads(&mut self, threads: impl IntoIterator<Item = (Pid, Tid)>) {
        for (pid, tid) in threads {
            self.stats.forgotten_threads +=
                u64::from(self.processes.forget_exited_thread(pid, tid));
        }
    }

    /// Keeps the process and module tables bounded on a host where processes come and go:
    /// forgets exited processes that no stored event refers to, and now and then releases the
    /// modules nothing refers to any more.
    fn prune(&mut self, now: MonoNs) {
        for last_thread in [true, false] {
            let grace = if last_thread { LAST_THREAD_EXIT_GRACE_NS } else { EXIT_GRACE_NS };
            while let Some(&(exit, pid)) = self.processes.exit_queue(last_thread).front() {
                if now.0 < exit.0.saturating_add(grace) {
                    break;
                }
                self.processes.exit_queue(last_thread).pop_front();
                if self.outbox.usdt_hits_pending_for(pid) {
                    // Its hits are turned into markers after this drain (a drain can hold
                    // more than the short grace of records): held for the long grace.
                    self.processes.exit_queue(false).push_back((now, pid));
                    continue;
                }
                if !self.store.holds_pid(pid) {
                    self.forget(&[pid]);
                }
            }
        }
        // A pass over the processes: a few times a second, not per event.
        if now >= self.next_thread_census {
            let held = self.processes.thread_count() as u64;
            self.stats.peak_threads = self.stats.peak_threads.max(held);
            let spacing = (self.processes.processes.len() as u64)
                .saturating_mul(THREAD_CENSUS_NS_PER_PROCESS)
                .max(THREAD_CENSUS_INTERVAL_NS);
            self.next_thread_census = MonoNs(now.0.saturating_add(spacing));
        }
        let mut gone = Vec::new();
        while let Some(&(exit, pid, tid)) = self.processes.pending_thread_exits.front() {
            if now.0 < exit.0.saturating_add(EXIT_GRACE_NS) {
                break;
            }
            self.processes.pending_thread_exits.pop_front();
            if !self.store.holds_thread(pid, tid) {
                gone.push((pid, tid));
            }
        }
        if !gone.is_empty() {
            self.forget_threads(gone);
        }
        if self.forgotten_since_sweep > 0
            && now.0 >= self.last_sweep.0.saturating_add(MODULE_SWEEP_INTERVAL_NS)
        {
            self.sweep_modules();
            self.last_sweep = now;
        }
    }

    /// Releases the modules that no known process maps and no stored stack names.
    pub fn sweep_modules(&mut self) {
        let mut referenced = std::collections::HashSet::new();
        self.processes.referenced_modules(&mut referenced);
        self.store.referenced_modules(&mut referenced);
        self.stats.released_modules += self.modules.release_unreferenced(&referenced) as u64;
        self.forgotten_since_sweep = 0;
    }

    /// Tells the unwinder's loader that the kernel's walk of `s` stopped for want of a table
    /// (its file's), or of the process's entry (not written yet, or held back while it was
    /// young: `UnwindLoader::defer_young`), whatever a stack copy's walk made of it since.
    fn tables_wanted(&mut self, s: &Sample, (end, last_pc): (UserStackEnd, Option<u64>)) {
        use UserStackEnd as End;
        if matches!(end, End::NoTable | End::NoMapping | End::NoProcess) {
            self.outbox.table_wanted(s.pid);
        }
        // The walk stopped at its last frame, in the file whose table it wanted.
        if end == End::NoTable
            && let Some(p) = self.processes.processes.get(&s.pid)
            && let Some((module, _)) = last_pc.and_then(|pc| p.space.lookup(pc))
        {
            self.outbox.file_wanted(module, s.time);
        }
    }

    /// Updates what is known of a sampled task's process and thread, stores its stack, and
    /// returns its CPU time since its previous sample (0 for off-CPU time, which carries no
    /// CPU time reading) and its stack.
    fn observe_task(&mut self, s: &Sample) -> (u64, Option<StackId>) {
        let facts = &mut *self.facts;
        known(
            &mut self.processes,
            s.pid,
            &mut self.modules,
            &mut self.stats,
            &mut self.outbox,
            facts,
        );
        let anon = self.modules.anon();
        let main_thread = s.tid.0 == s.pid.0;
        let cgroup_paths = &mut self.processes.cgroup_paths;
        let p = self.processes.processes.get_mut(&s.pid).expect("just added");
        p.cgroup.observe(s.pid, main_thread, CgroupId(s.cgroup_id), cgroup_paths);
        p.meta.threads.entry(s.tid).or_default().observe_name(&s.comm);
        if main_thread && !s.comm.is_empty() {
            p.meta.name.clone_from(&s.comm);
        }
        let cpu_delta = if s.off_cpu.is_some() { 0 } else { p.cpu_delta(s.tid, s.cpu_time_ns) };
        // Stacks named from the perf map are cached until it names more. The jitdump is read
        // once a sample is later than its last read, so each sample is named knowing every
        // record written before it.
        if !self.live {
            p.jit_files().perf_map.refused.get_or_insert("replayed: the process is gone");
        }
        if let Some(j) = p.jit_files_if_any() {
            let dump_grew = j.jit_dump.refresh(s.time.0);
            if dump_grew {
                self.stats.jitdumps.add(&j.jit_dump.take_stats());
            }
            if (j.perf_map.poll(s.pid, s.time.0) | dump_grew) && p.perf_map_named_more(anon) {
                self.outbox.maps_changed(s.pid);
            }
        }
        // The kernel knew its interpreter before this process was looked at (`PY_FILES`).
        if s.flags & profiler_common::SAMPLE_PY_MASK != 0
            && !matches!(p.python, crate::collect::python::ProcessPython::Python(_))
            && p.python_checked != p.space.version()
        {
            self.check_python(s.pid);
        }
        let p = self.processes.processes.get_mut(&s.pid).expect("just added");
        // Label frames depend on more than the addresses (the labels, their depths), and so do
        // a CPython process's (its Python frames, and each sample's count).
        let python = matches!(p.python, crate::collect::python::ProcessPython::Python(_));
        let cacheable = s.labels.is_empty() && !python;
        let flags = u64::from(s.flags) | u64::from(s.off_cpu.is_some()) << 32;
        if cacheable
            && let Some((stack, unmapped)) = self.stack_cache.lookup(
                p.space.version(),
                flags,
                &s.kernel_stack,
                &s.user_stack,
                &mut self.store,
            )
        {
            self.stats.unmapped_frames += unmapped;
            return (cpu_delta, stack);
        }
        let r = stack::normalize(s, p, anon, &mut self.frames);
        self.stats.unmapped_frames += r.unmapped;
        if python {
            if !s.python.is_empty() {
                self.python_frames_at = Some(s.time);
            }
            let (on, off) = (&mut self.stats.python, &mut self.stats.python_off_cpu);
            crate::collect::python::merge::merge(&mut self.frames, s, p, on, off);
        }
        if r.jit_named + r.jit_unnamed > 0
            && let Some(j) = p.jit_files_if_any()
        {
            self.stats.perf_maps.add(&j.perf_map.take_stats());
        }
        if r.perf_map_grew && p.perf_map_named_more(anon) {
            self.outbox.maps_changed(s.pid);
        }
        if s.off_cpu.is_some()
            && s.flags & profiler_common::OFF_CPU_STACK_NOT_CAPTURED != 0
            && self.frames.is_empty()
        {
            self.frames.push(FrameAddr::OffCpuNotCaptured);
        }
        let stack = self.store.intern_stack(&self.frames);
        if cacheable && !r.time_bound {
            self.stack_cache.insert(stack, r.unmapped, self.store.stack_stamp());
        }
        (cpu_delta, stack)
    }

    /// An idle task's stack: kernel frames only, so cached under a space version no process
    /// has. On an idle host these are most samples, and a hit is one hash of the addresses
    /// where interning hashes and looks up each frame.
    fn idle_stack(&mut self, s: &Sample) -> Option<StackId> {
        const NO_SPACE: u64 = 0;
        if let Some((stack, _)) =
            self.stack_cache.lookup(NO_SPACE, 0, &s.kernel_stack, &[], &mut self.store)
        {
            return stack;
        }
        self.frames.clear();
        self.frames.extend(kernel_frames(&s.kernel_stack));
        let stack = self.store.intern_stack(&self.frames);
        self.stack_cache.insert(stack, 0, self.store.stack_stamp());
        stack
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
        if let TaskKind::Fork { parent_pid, mm, walker_copied, .. } = t.kind
            && t.pid.0 == t.tid.0
            && parent_pid != t.pid
        {
            let fork = Forked { child: t.pid, parent: parent_pid, time: t.time, walker_copied };
            self.outbox.forked(fork);
            // A new process starts as a copy of its parent's address space (a pre-existing
            // parent's is read now, once); the kernel's records follow it from here.
            let space = self.known(parent_pid).space.clone();
            let p = self.processes.entry(t.pid);
            if p.exited {
                // The pid was reused: this is another process.
                *p = Default::default();
            }
            p.space = space;
            // The parent's JIT code is named by the parent's map, the child's by its own.
            p.space.touch();
            p.space.forget_early();
            p.mm = mm;
            p.space_source = SpaceSource::Kernel;
        }
        let p = self.processes.processes.entry(t.pid).or_default();
        match t.kind {
            TaskKind::Fork { .. } => {
                if t.pid.0 == t.tid.0 {
                    p.meta.start = Some(t.time);
                    if p.meta.name.is_empty() {
                        set_str(&mut p.meta.name, &t.comm);
                    }
                }
                let th = p.meta.threads.entry(t.tid).or_default();
                th.start = Some(t.time);
                th.observe_name(&t.comm);
            }
            TaskKind::Exec { argv, truncated, mm, vdso } => {
                set_str(&mut p.meta.name, &t.comm);
                // Empty when the kernel could not read it: keep what was known.
                if !argv.is_empty() {
                    p.meta.argv = argv;
                    p.meta.argv_truncated = truncated;
                }
                p.meta.exe.clear();
                // A new image: the executable and interpreter the ELF loader mapped follow in
                // their own records, libraries in mmap records.
                p.space = Default::default();
                p.mm = mm;
                p.exe_module = None;
                p.forget_label_depths();
                p.made_code = false;
                p.take_jit_stats(&mut self.stats.perf_maps, &mut self.stats.jitdumps);
                p.forget_perf_map();
                p.python = Default::default();
                p.space_source = SpaceSource::Kernel;
                if vdso != 0
                    && let Some(len) = self.facts.vdso_len()
                {
                    let module = self.modules.vdso();
                    let m = Mapping { start: vdso, end: vdso + len, file_offset: 0, module };
                    p.space.insert(m);
                }
                self.outbox.maps_changed(t.pid);
                p.meta.threads.entry(t.tid).or_default().observe_name(&t.comm);
            }
            TaskKind::Exit => {
                if p.meta.name.is_empty() {
                    set_str(&mut p.meta.name, &t.comm);
                }
                p.meta.threads.entry(t.tid).or_default().end = Some(t.time);
                p.thread_exited(t.tid);
                self.outbox.thread_exited(t.tid);
                if !self.off_cpu_copies.is_empty() {
                    self.off_cpu_copies.remove(&t.tid);
                }
                if t.pid.0 != t.tid.0 {
                    self.processes.pending_thread_exits.push_back((t.time, t.pid, t.tid));
                }
                if t.pid.0 == t.tid.0 {
                    self.outbox.process_exited(t.pid);
                    // Lines and records written up to its exit, before its pid can be reused.
                    if self.live
                        && let Some(j) = p.jit_files_if_any()
                        && (j.perf_map.finish(t.pid, t.time.0) | j.jit_dump.finish())
                    {
                        p.space.touch();
                        p.name_late();
                    }
                    p.take_jit_stats(&mut self.stats.perf_maps, &mut self.stats.jitdumps);
                    p.meta.end = Some(t.time);
                    p.exited = true;
                    let last_thread = p.meta.threads.values().all(|t| t.end.is_some());
                    self.processes.exit_queue(last_thread).push_back((t.time, t.pid));
                }
            }
        }
        self.prune(t.time);
    }
}

/// `s = v`, in `s`'s buffer.
fn set_str(s: &mut String, v: &str) {
    s.clear();
    s.push_str(v);
}

/// The process, its address space read from /proc first if it is one that existed before the
/// recording and was not seen yet.
fn known<'a>(
    processes: &'a mut ProcessTable,
    pid: Pid,
    modules: &mut ModuleTable,
    stats: &mut CollectorStats,
    outbox: &mut Outbox,
    facts: &mut dyn ProcFacts,
) -> &'a mut ProcessInfo {
    let p = processes.processes.entry(pid).or_default();
    if p.space_source == SpaceSource::Unknown {
        first_sight(pid, p, modules, stats, facts);
        outbox.maps_changed(pid);
    }
    p
}

/// A process known from nothing but its pid: ask /proc for its name, argv and mappings.
fn first_sight(
    pid: Pid,
    p: &mut ProcessInfo,
    modules: &mut ModuleTable,
    stats: &mut CollectorStats,
    facts: &mut dyn ProcFacts,
) {
    if p.meta.name.is_empty() {
        let (comm, argv, exe) = facts.identity(pid);
        p.meta.name = comm;
        p.meta.argv = argv;
        p.meta.exe = exe.unwrap_or_default();
    }
    first_sight_space(pid, p, modules, stats, facts);
}

fn first_sight_space(
    pid: Pid,
    p: &mut ProcessInfo,
    modules: &mut ModuleTable,
    stats: &mut CollectorStats,
    facts: &mut dyn ProcFacts,
) {
    stats.maps_reads += 1;
    stats.maps_reads_late += u64::from(stats.started);
    stats.maps_errors += u64::from(read_space_once(pid, p, modules, facts.maps(pid)).is_err());
    if !facts.live() {
        return;
    }
    // A JIT already running maps its jitdump (read from /proc, with the rest of its space).
    let dump =
        p.space.mappings().iter().find(|m| jitdump::is_dump_path(&modules.get(m.module).path));
    if let Some(m) = dump {
        let (range, path) = ((m.start, m.end), modules.get(m.module).path.clone());
        let dump = &mut p.jit_files().jit_dump;
        dump.found(|| jitdump::open_mapped(pid, range, None, &path));
        stats.jitdumps.add(&dump.take_stats());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        decode::{LabelRef, MappedPath},
        model::ids::Tid,
        store::{ChunkedStore, chunks::ChunkedBuffer},
    };

    /// Pids above the kernel's `pid_max` limit (2^22): never a real process, so nothing is
    /// read from /proc for them.
    const PID_BASE: u32 = 1 << 23;
    const TEXT: u64 = 0x7f00_0000_0000;

    fn task(time: MonoNs, pid: u32, kind: TaskKind) -> KernelEvent {
        let (pid, tid) = (Pid(pid), Tid(pid));
        KernelEvent::Task(TaskEvent { time, pid, tid, comm: "short".into(), kind })
    }

    /// One short process: exec, a library of its own mapped, `samples` samples in it, exit.
    fn short_process(c: &mut Collector<ChunkedStore>, i: u32, time: MonoNs, samples: u32) {
        let pid = PID_BASE + i;
        let exec = TaskKind::Exec { argv: vec!["short".into()], truncated: false, mm: 1, vdso: 0 };
        c.handle(task(time, pid, exec));
        // lib{1000 + i}.so: even for even processes, as the test checks.
        map_lib(c, time.0, pid, 1000 + u64::from(i));
        let (pid, tid) = (Pid(pid), Tid(pid));
        for k in 0..samples {
            c.handle(KernelEvent::Sample(Sample {
                time: MonoNs(time.0 + u64::from(k)),
                cpu: 0,
                pid,
                tid,
                cgroup_id: 0,
                cpu_time_ns: u64::from(k) * 1000,
                comm: "short".into(),
                flags: profiler_common::SAMPLE_USER_MODE,
                kernel_stack: Vec::new(),
                user_stack: vec![TEXT + 0x10 + u64::from(k)],
                labels: Vec::new(),
                python: Vec::new(),
                off_cpu: None,
                stack_ns: MonoNs(0),
                stack_copy: None,
            }));
        }
        c.handle(task(MonoNs(time.0 + 5_000_000), pid.0, TaskKind::Exit));
    }

    fn sample(time: u64, pid: u32, user_stack: Vec<u64>, labels: Vec<LabelRef>) -> KernelEvent {
        KernelEvent::Sample(Sample {
            time: MonoNs(time),
            cpu: 0,
            pid: Pid(pid),
            tid: Tid(pid),
            cgroup_id: 0,
            cpu_time_ns: time,
            comm: "cached".into(),
            flags: profiler_common::SAMPLE_USER_MODE,
            kernel_stack: Vec::new(),
            user_stack,
            labels,
            python: Vec::new(),
            off_cpu: None,
            stack_ns: MonoNs(0),
            stack_copy: None,
        })
    }

    /// A collector over `store` past its initial scan, with process `pid` exec'd at time 1 and
    /// a library of inode `inode` mapped at `TEXT` at time 2.
    fn with_mapped_process(store: ChunkedStore, pid: u32, inode: u64) -> Collector<ChunkedStore> {
        let mut c = Collector::new(store);
        c.initial_scan_done();
        let exec = TaskKind::Exec { argv: vec!["cached".into()], truncated: false, mm: 1, vdso: 0 };
        c.handle(task(MonoNs(1), pid, exec));
        map_lib(&mut c, 2, pid, inode);
        c
    }

    fn map_lib(c: &mut Collector<ChunkedStore>, time: u64, pid: u32, inode: u64) {
        let path =
            MappedPath { path: format!("/nonexistent/rsprof/lib{inode}.so"), complete: true };
        let kind = MapKind::File { offset: 0, dev: 1, inode, path };
        let (pid, tid) = (Pid(pid), Tid(pid));
        let (start, end) = (TEXT, TEXT + 0x1000);
        c.handle(KernelEvent::Map(MapEvent {
            time: MonoNs(time),
            pid,
            tid,
            mm: 1,
            start,
            end,
            kind,
            early_seq: 0,
        }));
    }

    /// Every stored sample's time and frames, root first.
    fn stored_stacks(c: &Collector<ChunkedStore>) -> Vec<(u64, Vec<FrameAddr>)> {
        let snap = c.store.snapshot();
        let mut out = Vec::new();
        crate::store::snapshot::read_events(
            &snap,
            |e| {
                if let crate::store::codec::StoredEvent::Sample(_, s) = e {
                    let mut frames = Vec::new();
                    let mut cur = s.stack;
                    while let Some(id) = cur {
                        let (parent, frame) = snap.stacks[id.0 as usize].expect("live node");
                        frames.push(frame);
                        cur = parent;
                    }
                    frames.reverse();
                    out.push((s.time_ns, frames));
                }
            },
            |e| panic!("{e}"),
        );
        out
    }

    /// CPython maps a trampoline arena, then names its trampolines in its perf map; the map is
    /// read when samples are collected, so a sample collected ahead of the arena's record may
    /// read those names while the arena is not mapped yet. The arena still gets its walker
    /// rule when its record comes (once missed, it stayed without, a whole run unwalked).
    #[test]
    fn a_trampoline_arena_named_before_its_record_gets_its_rule() {
        let pid = PID_BASE + 3;
        let mut c = with_mapped_process(ChunkedStore::new(8 << 20), pid, 1);
        let arena = 0x7f10_0000_0000;
        let path = std::env::temp_dir().join(format!("rsprof-arena-{}.map", std::process::id()));
        std::fs::write(&path, format!("{arena:x} 10 py::f:/x.py\n")).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let p = c.processes.processes.get_mut(&Pid(pid)).unwrap();
        p.jit_files().perf_map = crate::collect::perfmap::ProcessPerfMap::following(file);
        // A frame in no mapping looks in the perf map, which names the arena already.
        c.handle(sample(10, pid, vec![TEXT + 0x10, 0x1234], Vec::new()));
        assert!(c.processes.processes[&Pid(pid)].py_trampoline_arenas.is_empty());
        c.handle(KernelEvent::Map(MapEvent {
            time: MonoNs(11),
            pid: Pid(pid),
            tid: Tid(pid),
            mm: 1,
            start: arena,
            end: arena + 0x10000,
            kind: MapKind::Anon,
            early_seq: 0,
        }));
        assert_eq!(c.processes.processes[&Pid(pid)].py_trampoline_arenas, [arena]);
    }

    /// A repeated raw stack is served from the stack cache with the id it was stored as; after
    /// the process maps another file over the same addresses, the same raw stack is
    /// normalized again and names the new file; samples under a label are never cached.
    #[test]
    fn repeated_stacks_are_cached_until_the_address_space_changes() {
        let pid = PID_BASE + 1;
        let mut c = with_mapped_process(ChunkedStore::new(8 << 20), pid, 1);
        let raw = vec![TEXT + 0x10, TEXT + 0x21];
        // Cached at its second sighting, served from the third.
        for t in 10..13 {
            c.handle(sample(t, pid, raw.clone(), Vec::new()));
        }
        assert_eq!(c.stack_cache.hits, 1, "the third sample reuses the first ones' stack");
        map_lib(&mut c, 13, pid, 2);
        for t in 14..17 {
            c.handle(sample(t, pid, raw.clone(), Vec::new()));
        }
        assert_eq!(c.stack_cache.hits, 2, "a changed address space is a miss");
        let label = LabelRef { addr: 0x5000, depth: 1 };
        for t in 17..20 {
            c.handle(sample(t, pid, raw.clone(), vec![label]));
        }
        assert_eq!(c.stack_cache.hits, 2, "labelled samples are not cached");
        let stacks: Vec<_> = stored_stacks(&c).into_iter().map(|(_, f)| f).collect();
        assert_eq!(stacks.len(), 9);
        let module_of = |frames: &[FrameAddr]| match frames[0] {
            FrameAddr::User { module, offset } => {
                assert_eq!(offset, 0x20, "a caller's return address minus one");
                c.modules.get(module).name.clone()
            }
            f => panic!("root frame {f:?}"),
        };
        assert!(stacks[..3].iter().all(|s| *s == stacks[0]));
        assert_eq!(module_of(&stacks[0]), "lib1.so");
        assert!(stacks[3..6].iter().all(|s| module_of(s) == "lib2.so" && s.len() == 2));
        assert!(matches!(stacks[8][1], FrameAddr::Label { .. }), "{:?}", stacks[8]);
    }

    /// Idle tasks' stacks go through the stack cache too (under a space version no process
    /// has), and a process whose raw stack has the same addresses never gets an idle stack.
    #[test]
    fn idle_stacks_are_cached_apart_from_processes() {
        let pid = PID_BASE + 2;
        let mut c = with_mapped_process(ChunkedStore::new(8 << 20), pid, 3);
        let kernel = vec![0xffff_ffff_8100_0010u64, 0xffff_ffff_8100_0020];
        let idle = |t: u64, kernel: &[u64]| {
            let KernelEvent::Sample(mut s) = sample(t, 0, Vec::new(), Vec::new()) else {
                unreachable!()
            };
            s.flags = 0;
            s.kernel_stack = kernel.to_vec();
            KernelEvent::Sample(s)
        };
        for t in 10..14 {
            c.handle(idle(t, &kernel));
        }
        assert_eq!(c.stack_cache.hits, 2, "cached at the second sighting, served from the third");
        c.handle(idle(14, &kernel[1..]));
        // A task sampled in the kernel at the same addresses: its own key, its own stack.
        let KernelEvent::Sample(mut task) = sample(15, pid, vec![TEXT + 0x10], Vec::new()) else {
            unreachable!()
        };
        task.kernel_stack = kernel.clone();
        c.handle(KernelEvent::Sample(task));
        assert_eq!(c.stats.idle_samples, 5);
        let stacks: Vec<_> = stored_stacks(&c).into_iter().map(|(_, f)| f).collect();
        let want: Vec<_> = kernel_frames(&kernel).collect();
        assert!(stacks[..4].iter().all(|s| *s == want), "{stacks:?}");
        assert_eq!(stacks[4], kernel_frames(&kernel[1..]).collect::<Vec<_>>());
        assert_eq!(stacks[5].len(), 3, "kernel frames under the task's user frame");
        assert_eq!(stacks[5][1..], want[..]);
    }

    /// A hot set of stacks stays cached while a stream of other stacks, each seen twice and
    /// so kept too, fills the cache again and again (an interpreter's loop: a few thousand
    /// stacks in constant use and a long tail). When the current generation fills, keys still
    /// in use come back from the older one; emptying the cache when full lost them all.
    #[test]
    fn a_hot_set_stays_cached_while_a_tail_fills_the_cache() {
        let pid = PID_BASE + 3;
        let mut c = with_mapped_process(ChunkedStore::new(64 << 20), pid, 4);
        let (hot, tail) = (3_000u64, 1_000u64);
        let mut t = 10;
        let mut want = Vec::new();
        for round in 0..20u64 {
            let before = c.stack_cache.hits;
            let mut push = |c: &mut Collector<ChunkedStore>, leaf: u64, root: u64| {
                c.handle(sample(t, pid, vec![TEXT + leaf, TEXT + root], Vec::new()));
                want.push([root - 1, leaf]);
                t += 1;
            };
            for i in 0..hot {
                push(&mut c, 0x10 + i % 1000, 0x800 + i / 1000);
            }
            for i in 0..2 * tail {
                // Each round's own tail stacks, each twice.
                push(&mut c, 0x10 + (i / 2) % 1000, 0x900 + round * 8 + (i / 2) / 1000);
            }
            let hits = c.stack_cache.hits - before;
            if round >= 12 {
                // The hot set, and the second sighting of none of the tail (kept at it). Not
                // all of it: the seen filter's hash has a random seed, and tail keys can wipe a
                // hot key's marks for a few rounds more (one key in some runs). Emptying the
                // cache when full served at most 1,151 of them in a round here, a one-slot
                // filter 1,438.
                assert!(hits >= hot * 98 / 100 && hits <= hot, "round {round}: {hits} hits");
            }
        }
        let bound = 2 * crate::collect::stack_cache::GENERATION_ENTRIES;
        assert!(c.stack_cache.len() <= bound, "bounded: {}", c.stack_cache.len());
        let got: Vec<Vec<u64>> = stored_stacks(&c)
            .into_iter()
            .map(|(_, frames)| {
                frames
                    .iter()
                    .map(|f| match f {
                        FrameAddr::User { offset, .. } => *offset,
                        f => panic!("{f:?}"),
                    })
                    .collect()
            })
            .collect();
        assert_eq!(got.len(), want.len());
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g[..], w[..], "sample {k}");
        }
    }

    /// Through chunk recycling that prunes stack nodes (and so may reuse their ids), a
    /// cached stack is never served stale: every stored sample has its own frames.
    #[test]
    fn cached_stacks_stay_right_while_the_store_prunes() {
        let store =
            ChunkedStore::with_buffer(ChunkedBuffer::with_chunk_size(16 << 10, 4 << 10), 1 << 30);
        let pid = PID_BASE + 2;
        let mut c = with_mapped_process(store, pid, 3);
        let n = 20_000u64;
        for t in 0..n {
            // Half the samples repeat one stack; the others are new each time, so chunks
            // fill, recycle and prune.
            let leaf = if t % 2 == 0 { 0x10 } else { 0x100 + t % 0xe00 };
            c.handle(sample(10 + t, pid, vec![TEXT + leaf, TEXT + 0x21], Vec::new()));
        }
        assert!(c.store.stats.pruned_stack_nodes > 0, "stack nodes were pruned");
        assert!(c.stack_cache.hits > n / 4, "{} hits", c.stack_cache.hits);
        let stacks = stored_stacks(&c);
        assert!(stacks.len() > 100);
        for (time, frames) in &stacks {
            let [FrameAddr::User { offset: root, .. }, FrameAddr::User { offset: leaf, .. }] =
                frames[..]
            else {
                panic!("{frames:?}")
            };
            let t = time - 10;
            assert_eq!(root, 0x20);
            assert_eq!(leaf, if t % 2 == 0 { 0x10 } else { 0x100 + t % 0xe00 }, "sample {t}");
        }
    }

    /// Processes come and go for 60 s (each with its own library, half of them never sampled):
    /// the process and module tables stay bounded by what the store still refers to plus the
    /// last seconds' processes, and every module a stored stack names is still the right one.
    #[test]
    fn tables_stay_bounded_as_processes_come_and_go() {
        let store =
            ChunkedStore::with_buffer(ChunkedBuffer::with_chunk_size(64 << 10, 8 << 10), 32 << 10);
        let mut c = Collector::new(store);
        c.initial_scan_done();
        let n = 6000;
        let mut peak = (0, 0);
        for i in 0..n {
            // 100 processes a second.
            let time = MonoNs(1_000_000_000 + u64::from(i) * 10_000_000);
            short_process(&mut c, i, time, if i % 2 == 0 { 3 } else { 0 });
            peak = (peak.0.max(c.processes.len()), peak.1.max(c.modules.live()));
        }
        eprintln!(
            "{n} processes: peak {} processes, {} modules held; {} forgotten, {} modules released, {} slots",
            peak.0,
            peak.1,
            c.stats.forgotten_processes,
            c.stats.released_modules,
            c.modules.len()
        );
        assert!(c.stats.forgotten_processes > u64::from(n) * 9 / 10);
        assert!(c.stats.released_modules > u64::from(n) * 8 / 10);
        // A 10 s sweep interval at 100 processes/s bounds the modules by ~1000 plus those the
        // store still names; the processes by the 1 s grace plus the stored ones.
        assert!(peak.0 < 600, "peak {} processes", peak.0);
        assert!(peak.1 < 1600, "peak {} modules", peak.1);
        assert!(c.modules.len() < 1600, "{} module slots", c.modules.len());
        // Nothing a stored stack refers to was released or reused for another file.
        let mut stored = std::collections::HashSet::new();
        c.store.referenced_modules(&mut stored);
        assert!(!stored.is_empty());
        let snap = c.store.snapshot();
        for node in snap.stacks.iter().flatten() {
            if let (_, FrameAddr::User { module, offset }) = node {
                let m = c.modules.get(*module);
                assert!(m.name.starts_with("lib"), "stored stack names released {module:?}");
                let i: u64 = m.name["lib".len()..m.name.len() - 3].parse().unwrap();
                assert_eq!(i % 2, 0, "only even processes were sampled");
                assert!(*offset >= 0x10 && *offset < 0x13, "offset {offset:#x}");
            }
        }
        // The last processes (within the grace period) are still known, with their argv.
        let last = c.processes.get(Pid(PID_BASE + n - 1)).expect("last process kept");
        assert_eq!(last.meta.argv, ["short"]);
    }

    /// One process starts and ends 5,000 threads over 5 s, every 50th sampled: threads
    /// nothing stored refers to are forgotten a second after their exit, the sampled ones
    /// stay while their samples do, and the main thread stays.
    #[test]
    fn exited_processes_are_forgotten_soon_unless_threads_of_theirs_may_run() {
        let mut c = Collector::new(ChunkedStore::new(8 << 20));
        c.initial_scan_done();
        let (alone, threaded) = (PID_BASE, PID_BASE + 1);
        let t0 = 1_000_000_000;
        let exec = || TaskKind::Exec { argv: vec!["x".into()], truncated: false, mm: 1, vdso: 0 };
        c.handle(task(MonoNs(t0), alone, exec()));
        c.handle(task(MonoNs(t0), threaded, exec()));
        // A second thread of `threaded` starts and is not seen to exit.
        let fork = TaskKind::Fork {
            parent_pid: Pid(threaded),
            parent_tid: Tid(threaded),
            mm: 1,
            walker_copied: false,
        };
        let (time, pid, tid, comm) = (MonoNs(t0), Pid(threaded), Tid(threaded + 1), "t".into());
        c.handle(KernelEvent::Task(TaskEvent { time, pid, tid, comm, kind: fork }));
        c.handle(task(MonoNs(t0 + 1), alone, TaskKind::Exit));
        c.handle(task(MonoNs(t0 + 1), threaded, TaskKind::Exit));
        // Any later event prunes: another process's exec.
        c.handle(unrelated_exec(t0 + LAST_THREAD_EXIT_GRACE_NS / 2));
        assert!(c.processes.get(Pid(alone)).is_some(), "kept for the short grace");
        c.handle(unrelated_exec(t0 + 1 + LAST_THREAD_EXIT_GRACE_NS));
        assert!(c.processes.get(Pid(alone)).is_none(), "its last thread exited");
        assert!(c.processes.get(Pid(threaded)).is_some(), "a thread of it may still run");
        c.handle(unrelated_exec(t0 + 1 + EXIT_GRACE_NS));
        assert!(c.processes.get(Pid(threaded)).is_none());
    }

    /// A process whose USDT hits wait in the outbox (they become markers after the drain,
    /// with its mappings and labels) stays known past the short grace, until they are taken
    /// and the long grace is over.
    #[test]
    fn exited_processes_with_usdt_hits_waiting_stay_until_the_hits_are_taken() {
        let mut c = Collector::new(ChunkedStore::new(8 << 20));
        c.initial_scan_done();
        let pid = PID_BASE;
        let t0 = 1_000_000_000;
        let exec = TaskKind::Exec { argv: vec!["x".into()], truncated: false, mm: 1, vdso: 0 };
        c.handle(task(MonoNs(t0), pid, exec));
        c.handle(KernelEvent::Usdt(decode::RawUsdtHit {
            time_ns: t0 + 1,
            cpu: 0,
            pid: Pid(pid),
            tid: Tid(pid),
            probe_id: 0,
            spec_id: 0,
            arg_errors: 0,
            args: Vec::new(),
            strs: Vec::new(),
        }));
        c.handle(task(MonoNs(t0 + 2), pid, TaskKind::Exit));
        // Past the short grace: requeued for the long one from here.
        let requeued = t0 + 2 + 2 * LAST_THREAD_EXIT_GRACE_NS;
        c.handle(unrelated_exec(requeued));
        assert!(c.processes.get(Pid(pid)).is_some(), "its hit is not taken yet");
        assert_eq!(c.outbox.take_usdt_hits().len(), 1);
        c.handle(unrelated_exec(requeued + EXIT_GRACE_NS / 2));
        assert!(c.processes.get(Pid(pid)).is_some(), "held for the long grace");
        c.handle(unrelated_exec(requeued + EXIT_GRACE_NS));
        assert!(c.processes.get(Pid(pid)).is_none());
    }

    /// An exec of an unrelated process at `ns`.
    fn unrelated_exec(ns: u64) -> KernelEvent {
        let exec = TaskKind::Exec { argv: vec!["y".into()], truncated: false, mm: 1, vdso: 0 };
        task(MonoNs(ns), PID_BASE + 100, exec)
    }

    #[test]
    fn exited_threads_of_a_live_process_are_forgotten() {
        let store = ChunkedStore::new(8 << 20);
        let mut c = Collector::new(store);
        c.initial_scan_done();
        let pid = PID_BASE;
        let exec = TaskKind::Exec { argv: vec!["churn".into()], truncated: false, mm: 1, vdso: 0 };
        c.handle(task(MonoNs(1_000_000_000), pid, exec));
        let n = 5000u32;
        let mut peak = 0;
        for i in 1..=n {
            let time = MonoNs(1_000_000_000 + u64::from(i) * 1_000_000);
            let tid = Tid(pid + i);
            let ev = |kind| {
                KernelEvent::Task(TaskEvent { time, pid: Pid(pid), tid, comm: "t".into(), kind })
            };
            let fork = TaskKind::Fork {
                parent_pid: Pid(pid),
                parent_tid: Tid(pid),
                mm: 1,
                walker_copied: false,
            };
            c.handle(ev(fork));
            if i % 50 == 0 {
                c.handle(KernelEvent::Sample(Sample {
                    time,
                    cpu: 0,
                    pid: Pid(pid),
                    tid,
                    cgroup_id: 0,
                    cpu_time_ns: 1000,
                    comm: "sampled".into(),
                    flags: 0,
                    kernel_stack: vec![0xffff_ffff_8100_0000],
                    user_stack: Vec::new(),
                    labels: Vec::new(),
                    python: Vec::new(),
                    off_cpu: None,
                    stack_ns: MonoNs(0),
                    stack_copy: None,
                }));
            }
            c.handle(ev(TaskKind::Exit));
            peak = peak.max(c.processes.thread_count());
        }
        let threads = &c.processes.get(Pid(pid)).unwrap().meta.threads;
        let sampled = threads.values().filter(|t| t.name == "sampled").count();
        eprintln!(
            "{n} threads: peak {peak} held, {} forgotten, {} held at the end ({sampled} sampled)",
            c.stats.forgotten_threads,
            threads.len()
        );
        // A thousand a second, kept a second each, plus the 100 sampled.
        assert!(peak < 1200, "peak {peak} threads");
        // Counted ten times a second: at most the peak seen here, and near it.
        let counted = c.stats_now().peak_threads;
        assert!(counted <= peak as u64 && counted * 10 >= peak as u64 * 9, "{counted} of {peak}");
        assert!(c.stats.forgotten_threads >= u64::from(n) * 3 / 4);
        assert_eq!(sampled, (n / 50) as usize, "sampled threads are kept with their names");
        assert!(threads.contains_key(&Tid(pid)), "the main thread stays");
    }
}
