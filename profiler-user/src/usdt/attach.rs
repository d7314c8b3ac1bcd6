//! The recording's USDT session: which files were scanned for SDT notes, which probe sites
//! are attached (`uprobe`), and, after each drain, the hits turned into markers and label
//! names.
//!
//! Probes are attached per FILE, not per process: a uprobe event with pid -1 covers every
//! process mapping the file, now and later (the kernel also raises the probe's semaphore in
//! each of them), and the BPF program drops hits of processes the recording's pid/cgroup
//! filter does not select. So each file identity (dev, inode) is read once, and files are
//! found from the collector's module table — which learns them from /proc/PID/maps once per
//! process that existed at the start and from the kernel's exec and mmap records after —
//! without any /proc rescans. The exec gate (`gate`) attaches to executables before the
//! process that execs them can run.

use std::{
    collections::{HashMap, HashSet},
    io::Write as _,
    os::{fd::OwnedFd, unix::fs::MetadataExt as _},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard},
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::maps::{Array, MapData};
use profiler_common::{
    USDT_MAX_ARGS, USDT_MAX_SPECS, USDT_ROLE_LABEL_POP, USDT_ROLE_LABEL_PUSH, USDT_ROLE_SEND,
    USDT_STR_IS_TRUNCATED, USDT_STR_IS_UNREADABLE, USDT_STR_MAX, UsdtArgSpec, UsdtSpec,
};

use super::{
    ProbeId, ProbeInfo, ProbeRegistry, ProbeRequest, ProbeRole, SiteInfo, UsdtArg, UsdtHit, args,
    gate::{ExecGate, GateStats},
    markers::{self, MarkerMaker},
    notes,
    report::UsdtReport,
    uprobe::{link_create, open_uprobe, pmu_type, ref_ctr_supported},
};
use crate::{
    bpf::{counters::Counters, decode::RawUsdtHit, object::BpfObject},
    collect::{collector::Collector, processes::LabelNaming},
    model::{
        ids::{LabelId, Pid, ThreadKey},
        markers::{Marker, MarkerSchema},
    },
    store::SampleSink,
    system::procfs,
};

/// A file by (st_dev, st_ino), as `stat` reports it.
pub(crate) type FileKey = (u64, u64);

/// Files remembered as scanned. When full, files without probes are forgotten (they are read
/// again if seen again; counted), files with probes are kept as long as their probes are.
const MAX_SCANNED_FILES: usize = 65536;
/// Warnings kept for the summary; the rest are counted.
const MAX_WARNINGS: usize = 200;

/// Reads the C string at `addr` in `pid` if it lies in a read-only file mapping; returns
/// its bytes (at most `USDT_STR_MAX - 1`) and whether it was cut.
fn read_readonly_str(pid: Pid, addr: u64) -> Option<(Vec<u8>, bool)> {
    let end = procfs::read_maps(pid).ok()?.into_iter().find_map(|m| {
        let readonly = m.readable && !m.writable;
        (m.start <= addr && addr < m.end && readonly && m.inode != 0).then_some(m.end)
    })?;
    read_cstr(Path::new(&format!("/proc/{pid}/mem")), addr, end - addr)
}

/// The C string at `offset` of `file`, at most `limit` bytes away.
fn read_cstr(file: &Path, offset: u64, limit: u64) -> Option<(Vec<u8>, bool)> {
    use std::os::unix::fs::FileExt as _;
    let want = (limit as usize).min(USDT_STR_MAX);
    let mut buf = vec![0u8; want];
    let n = std::fs::File::open(file).ok()?.read_at(&mut buf, offset).ok()?;
    buf.truncate(n);
    match buf.iter().position(|&b| b == 0) {
        Some(nul) => {
            buf.truncate(nul);
            Some((buf, false))
        }
        None => {
            buf.truncate(USDT_STR_MAX - 1);
            Some((buf, true))
        }
    }
}

/// A file scanned for notes (kept so each file is read once).
struct ScannedFile {
    probes: Option<Arc<notes::ElfProbes>>,
}

struct Attachment {
    _link: OwnedFd,
    _perf: OwnedFd,
}

/// How probe-bearing files were found, for the summary.
#[derive(Clone, Copy, Debug, Default)]
pub struct DiscoveryStats {
    /// Files read for SDT notes (each file identity once while remembered).
    pub files_scanned: u64,
    /// Files with at least one probe attached.
    pub files_attached: u64,
    /// Files first seen in a mapping of a process started during the recording and found to
    /// carry probes: that process ran before they were attached, and hits before that are
    /// lost (a library loaded by a new process; executables go through the exec gate).
    pub attached_late: u64,
    /// Probe-less files forgotten because `MAX_SCANNED_FILES` were remembered.
    pub files_forgotten: u64,
    /// Warnings beyond `MAX_WARNINGS`, not kept.
    pub warnings_dropped: u64,
    pub gate: GateStats,
}

/// Scanned files and attached probes: shared by the drain loop (files the module table
/// learns of) and the exec gate's thread (files about to be exec'd), hence behind a mutex.
pub struct Attacher {
    /// The USDT program and its spec array; `None` when it could not be loaded and nothing
    /// was asked for explicitly (then `rsprof` probes are not recorded, with a warning).
    kernel: Option<(OwnedFd, Array<MapData, UsdtSpec>)>,
    /// The program is loaded only once a file with probes to attach is found (`-p`: most
    /// processes carry none, and verifying the program is a good part of start-up).
    deferred: bool,
    /// Files found with probes to attach while the program was deferred: (path to open,
    /// path shown).
    awaiting_program: Vec<(PathBuf, String)>,
    pmu_type: Option<u32>,
    ref_ctr_ok: Option<bool>,
    requests: Vec<(ProbeRequest, Option<FileKey>)>,
    found: Vec<bool>,
    files: HashMap<FileKey, ScannedFile>,
    attached: HashSet<(FileKey, u64)>,
    probe_ids: HashMap<(FileKey, String, String), ProbeId>,
    registry: ProbeRegistry,
    links: Vec<Attachment>,
    warnings: Vec<String>,
    detached: bool,
    pub stats: DiscoveryStats,
}

pub struct UsdtSession {
    shared: Arc<Mutex<Attacher>>,
    gate: Option<ExecGate>,
    /// Cursor into the collector's module creations (`ModuleTable::created_since`).
    next_module: u64,
    /// Set once the initial scan is done: files found later in mappings are late.
    started: bool,
    recovered: u64,
    /// /proc/PID/maps reads made to recover unreadable strings (never to find probes).
    string_maps_reads: u64,
    markers: MarkerMaker,
    hits: u64,
    hit_counts: HashMap<ProbeId, u64>,
    unresolved: u64,
    labels_over_limit: u64,
    /// `--usdt-dump`: one line per hit, written as hits arrive.
    dump: Option<(PathBuf, std::io::BufWriter<std::fs::File>)>,
}

fn file_key(path: &Path) -> std::io::Result<FileKey> {
    let m = std::fs::metadata(path)?;
    Ok((m.dev(), m.ino()))
}

/// Resolves a command name the way execvp would.
pub fn which(cmd: &str) -> Option<PathBuf> {
    if cmd.contains('/') {
        return Some(PathBuf::from(cmd));
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into());
    std::env::split_paths(&path).map(|d| d.join(cmd)).find(|p| p.is_file())
}

/// The attacher, also after a thread holding it panicked (its state stays consistent: every
/// change is a single insert or push).
pub(crate) fn lock_attacher(shared: &Mutex<Attacher>) -> MutexGuard<'_, Attacher> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

impl UsdtSession {
    /// Loads the USDT program and checks the requests; `--usdt …@PATH` probes are attached
    /// now (a missing file or probe is an error). `defer`: load the program only once a file
    /// with probes to attach is found ([`UsdtSession::load_deferred`]); not for a recording
    /// that must attach the probes of new programs before they run (the exec gate).
    pub fn new(
        sampler: &mut BpfObject,
        requests: Vec<ProbeRequest>,
        intervals: Vec<String>,
        dump: Option<&Path>,
        defer: bool,
    ) -> Result<Self> {
        let mut warnings = Vec::new();
        let defer = defer && requests.iter().all(|r| r.path.is_none());
        let kernel = if defer {
            None
        } else {
            match sampler.usdt_program() {
                Ok(k) => Some(k),
                Err(e) if requests.is_empty() => {
                    warnings.push(format!("USDT probes are not recorded: {e:#}"));
                    None
                }
                Err(e) => return Err(e),
            }
        };
        let mut reqs = Vec::new();
        for r in requests {
            let key = match &r.path {
                Some(p) => Some(file_key(p).with_context(|| {
                    format!("USDT probe {}:{}@{}", r.provider, r.name, p.display())
                })?),
                None => None,
            };
            reqs.push((r, key));
        }
        let mut a = Attacher {
            kernel,
            deferred: defer,
            awaiting_program: Vec::new(),
            pmu_type: None,
            ref_ctr_ok: None,
            found: vec![false; reqs.len()],
            requests: reqs,
            files: HashMap::new(),
            attached: HashSet::new(),
            probe_ids: HashMap::new(),
            registry: ProbeRegistry { intervals, ..Default::default() },
            links: Vec::new(),
            warnings,
            detached: false,
            stats: DiscoveryStats::default(),
        };
        let explicit: Vec<(PathBuf, String)> = a
            .requests
            .iter()
            .filter_map(|(r, _)| Some((r.path.clone()?, format!("{}:{}", r.provider, r.name))))
            .collect();
        for (path, probe) in explicit {
            a.scan_file(&path, &path.display().to_string(), true)?;
            let found = a.requests.iter().zip(&a.found).any(|((r, _), &f)| {
                f && r.path.as_deref() == Some(&path)
                    && format!("{}:{}", r.provider, r.name) == probe
            });
            if !found {
                bail!(
                    "no USDT probe {probe} in {} (see `rsprof-bpf list-usdt {}`)",
                    path.display(),
                    path.display()
                );
            }
        }
        Ok(Self {
            shared: Arc::new(Mutex::new(a)),
            gate: None,
            next_module: 0,
            started: false,
            recovered: 0,
            string_maps_reads: 0,
            markers: MarkerMaker::default(),
            hits: 0,
            hit_counts: HashMap::new(),
            unresolved: 0,
            labels_over_limit: 0,
            dump: match dump {
                Some(p) => Some((
                    p.to_owned(),
                    std::io::BufWriter::new(
                        std::fs::File::create(p)
                            .with_context(|| format!("create {}", p.display()))?,
                    ),
                )),
                None => None,
            },
        })
    }

    /// Whether probes can be attached at all (the USDT program loaded, or deferred).
    pub fn active(&self) -> bool {
        let a = lock_attacher(&self.shared);
        a.kernel.is_some() || a.deferred
    }

    /// With the program deferred and a file found with probes to attach: loads the program
    /// and attaches them. A program that fails to load is a warning (probes not recorded).
    pub fn load_deferred(&mut self, sampler: &mut BpfObject) {
        let mut a = lock_attacher(&self.shared);
        if !a.deferred || a.awaiting_program.is_empty() {
            return;
        }
        a.deferred = false;
        match sampler.usdt_program() {
            Ok(k) => a.kernel = Some(k),
            Err(e) => {
                a.awaiting_program.clear();
                a.warn(format!("USDT probes are not recorded: {e:#}"));
                return;
            }
        }
        for (open, display) in std::mem::take(&mut a.awaiting_program) {
            if let Err(e) = a.scan_file(&open, &display, false) {
                a.warn(format!("{display}: {e:#}"));
            }
        }
    }

    /// Starts the exec gate (see `gate`): executables are scanned and their probes attached
    /// before any process exec'ing them runs. A gate that cannot start is a warning.
    pub fn start_gate(&mut self) {
        if !self.active() || self.gate.is_some() {
            return;
        }
        match ExecGate::start(Arc::clone(&self.shared)) {
            Ok(g) => self.gate = Some(g),
            Err(e) => lock_attacher(&self.shared).warn(format!(
                "exec gate not started ({e:#}): probes of programs first run during the \
                 recording are attached only after they start, and their first hits can be lost"
            )),
        }
    }

    /// The exec gate's counters so far, if it runs (read without waiting for a scan).
    pub fn gate_stats(&self) -> Option<GateStats> {
        self.gate.as_ref().map(ExecGate::stats)
    }

    /// Reads `open` (shown as `display`) once and attaches its requested probes.
    pub fn scan_file(&mut self, open: &Path, display: &str, strict: bool) -> Result<()> {
        lock_attacher(&self.shared).scan_file(open, display, strict)
    }

    /// Scans the files the collector's module table learned of since the last call. Before
    /// [`UsdtSession::initial_scan_done`] these are the files of processes that existed at
    /// the start; after it, files mapped by new processes.
    pub fn scan_new_modules<S>(&mut self, collector: &Collector<S>) {
        let modules = &collector.modules;
        let (new, next) = modules.created_since(self.next_module);
        self.next_module = next;
        for id in new {
            let m = modules.get(id);
            // `[vdso]` and anonymous code carry no notes.
            if m.path.starts_with('[') || m.path.is_empty() {
                continue;
            }
            // Locked per file: the exec gate waits for the lock while it holds an exec.
            if let Some(open) = m.readable_path() {
                lock_attacher(&self.shared).scan_module(&open, &m.path, self.started);
            }
        }
    }

    /// Files found in mappings from now on were mapped by processes that started during the
    /// recording.
    pub fn initial_scan_done(&mut self) {
        self.started = true;
    }

    /// Intervals begun and not ended yet, for a snapshot.
    pub fn open_markers(&self) -> Vec<(ThreadKey, Marker)> {
        self.markers.open_markers(&lock_attacher(&self.shared).registry)
    }

    /// Schemas of the markers of the probes attached so far.
    pub fn marker_schemas(&self) -> Vec<MarkerSchema> {
        markers::schemas(&lock_attacher(&self.shared).registry)
    }

    /// After each drain: scans newly mapped files, recovers unreadable strings, and turns the
    /// drained hits into markers and label names.
    pub fn after_drain<S: SampleSink>(&mut self, collector: &mut Collector<S>) {
        self.scan_new_modules(collector);
        let shared = Arc::clone(&self.shared);
        let a = lock_attacher(&shared);
        self.recover_strings(&a.registry, collector);
        let raw = collector.outbox.take_usdt_hits();
        for h in &raw {
            self.consume(&a.registry, h, collector);
        }
        collector.outbox.reuse_hits(raw);
        // After this drain's hits: a thread's hits all precede its exit.
        let exits = collector.outbox.take_exits();
        self.markers.exited(&a.registry, &mut collector.store, &exits.processes, &exits.threads);
    }

    fn consume<S: SampleSink>(
        &mut self,
        registry: &ProbeRegistry,
        raw: &RawUsdtHit,
        collector: &mut Collector<S>,
    ) {
        let Some(hit) = registry.resolve(raw) else {
            self.unresolved += 1;
            return;
        };
        self.hits += 1;
        *self.hit_counts.entry(hit.probe).or_default() += 1;
        if let Some((_, w)) = &mut self.dump {
            let _ = dump_hit(w, registry, &hit);
        }
        let role = registry.probes[hit.probe.0 as usize].role;
        if role == ProbeRole::RsprofLabelPush
            && let (Some(&addr), Some(arg)) = (raw.args.first(), hit.args.first())
        {
            let text = match arg {
                UsdtArg::Str(Ok(s)) => s.text.clone(),
                other => other.to_string(),
            };
            let dump_line = format!("label {} {addr:#x} {text:?}", hit.pid);
            match collector.processes.name_label(hit.pid, LabelId(addr), text) {
                LabelNaming::Named => {
                    if let Some((_, w)) = &mut self.dump {
                        let _ = writeln!(w, "{dump_line}");
                    }
                }
                LabelNaming::AlreadyNamed => {}
                LabelNaming::OverLimit => self.labels_over_limit += 1,
            }
        }
        self.markers.hit(registry, &hit, &mut collector.store);
    }

    /// A string the kernel could not copy because its page was not resident yet (a fresh
    /// program's or library's `.rodata`: BPF cannot fault pages in) is read now, but only from
    /// a read-only segment, whose bytes cannot have changed since the hit: from the file, found
    /// through the process's known code mappings (also after it exited), else from the live
    /// process's read-only file mapping.
    fn recover_strings<S>(&mut self, registry: &ProbeRegistry, collector: &mut Collector<S>) {
        let Collector { outbox, modules, processes, .. } = collector;
        for h in outbox.usdt_hits_mut() {
            let Some(site) = registry.sites.get(h.spec_id as usize) else { continue };
            let mut slot = 0;
            for (i, &is_str) in site.strings.iter().enumerate() {
                if !is_str {
                    continue;
                }
                let (Some(s), Some(&addr)) = (h.strs.get_mut(slot), h.args.get(i)) else {
                    break;
                };
                slot += 1;
                if s.flags & USDT_STR_IS_UNREADABLE == 0 {
                    continue;
                }
                let from_file = processes.get(h.pid).and_then(|p| {
                    let (path, offset, limit) = modules.readonly_location(&p.space, addr)?;
                    read_cstr(&path, offset, limit)
                });
                let read = from_file.or_else(|| {
                    self.string_maps_reads += 1;
                    read_readonly_str(h.pid, addr)
                });
                if let Some((bytes, truncated)) = read {
                    s.bytes = bytes;
                    s.flags = if truncated { USDT_STR_IS_TRUNCATED } else { 0 };
                    self.recovered += 1;
                }
            }
        }
    }

    pub fn sites(&self) -> usize {
        lock_attacher(&self.shared).links.len()
    }

    /// Stops the exec gate (execs it holds proceed) and detaches every probe (semaphores drop
    /// back); hits already sent stay in the ring.
    pub fn detach(&mut self) {
        let gate = self.gate.take().map(ExecGate::stop);
        let mut a = lock_attacher(&self.shared);
        if let Some(g) = gate {
            a.stats.gate = g;
        }
        a.links.clear();
        a.detached = true;
    }

    /// Detaches, stores the intervals still open as incomplete markers and sums up. Call
    /// after the last drain.
    pub fn finish<S: SampleSink>(
        mut self,
        collector: &mut Collector<S>,
        counters: Counters,
    ) -> Result<UsdtReport> {
        self.detach();
        let mut a = lock_attacher(&self.shared);
        let registry = std::mem::take(&mut a.registry);
        self.markers.finish(&registry, &mut collector.store);
        if let Some((path, mut w)) = self.dump.take() {
            w.flush().with_context(|| format!("write {}", path.display()))?;
        }
        let mut not_found = Vec::new();
        for (i, (r, _)) in a.requests.iter().enumerate() {
            if !a.found[i] {
                not_found.push(format!("{}:{}", r.provider, r.name));
            }
        }
        not_found.dedup();
        let mut hit_counts: Vec<(String, u64)> = self
            .hit_counts
            .iter()
            .map(|(p, &n)| (registry.probes[p.0 as usize].full_name(), n))
            .collect();
        hit_counts.sort();
        let mut by_label: HashMap<String, u64> = HashMap::new();
        for (&(pid, label), &n) in &collector.label_samples {
            let name = collector
                .processes
                .get(pid)
                .and_then(|p| p.meta.labels.get(&label).cloned())
                .unwrap_or_else(|| format!("{:#x}", label.0));
            *by_label.entry(name).or_default() += n;
        }
        let mut label_samples: Vec<_> = by_label.into_iter().collect();
        label_samples.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        Ok(UsdtReport {
            sites: registry.sites.len(),
            registry,
            hits: self.hits,
            hit_counts,
            unresolved: self.unresolved,
            markers: self.markers.stats,
            label_samples,
            labels_over_limit: self.labels_over_limit,
            label_depths: (
                collector.stats.label_depths_found,
                collector.stats.label_depths_unknown
                    + counters.get(profiler_common::counter::LABEL_DEPTH_LOST),
            ),
            counters,
            warnings: std::mem::take(&mut a.warnings),
            not_found,
            strings_recovered: self.recovered,
            string_maps_reads: self.string_maps_reads,
            discovery: a.stats,
        })
    }
}

impl Attacher {
    fn warn(&mut self, w: String) {
        if self.warnings.len() < MAX_WARNINGS {
            self.warnings.push(w);
        } else {
            self.stats.warnings_dropped += 1;
        }
    }

    /// Whether `key` was scanned (and is still remembered).
    pub(crate) fn known(&self, key: FileKey) -> bool {
        self.files.contains_key(&key)
    }

    /// A file a module-table entry names: scanned unless known. `late`: mapped by a process
    /// started during the recording.
    fn scan_module(&mut self, open: &Path, display: &str, late: bool) {
        let Ok(key) = file_key(open) else { return };
        if self.known(key) {
            return;
        }
        let before = self.links.len();
        if let Err(e) = self.scan_file(open, display, false) {
            self.warn(format!("{display}: {e:#}"));
        }
        if late && self.links.len() > before {
            self.stats.attached_late += 1;
        }
    }

    /// A file a process is about to exec (the exec gate's thread): scanned unless known.
    /// Returns whether it was scanned now.
    pub(crate) fn scan_exec(&mut self, key: FileKey, open: &Path, display: &str) -> bool {
        if self.known(key) || self.detached {
            return false;
        }
        if let Err(e) = self.scan_file(open, display, false) {
            self.warn(format!("{display}: {e:#}"));
        }
        true
    }

    fn remember(&mut self, key: FileKey, file: ScannedFile) {
        if self.files.len() >= MAX_SCANNED_FILES {
            let before = self.files.len();
            self.files.retain(|_, f| f.probes.is_some());
            self.stats.files_forgotten += (before - self.files.len()) as u64;
        }
        if self.files.len() < MAX_SCANNED_FILES {
            self.files.insert(key, file);
        }
    }

    /// Reads `open` (shown as `display`) once and attaches its probes that are requested.
    /// `strict`: attach failures are errors rather than warnings.
    pub fn scan_file(&mut self, open: &Path, display: &str, strict: bool) -> Result<()> {
        if self.detached || (self.kernel.is_none() && !self.deferred) {
            return Ok(());
        }
        let key = file_key(open).with_context(|| format!("stat {}", open.display()))?;
        let probes = match self.files.get(&key) {
            Some(f) => match &f.probes {
                Some(p) => p.clone(),
                None => return Ok(()),
            },
            None => {
                self.stats.files_scanned += 1;
                let probes = match notes::read_probes_if_elf(open) {
                    Ok(p) => p.filter(|p| !p.notes.is_empty()).map(Arc::new),
                    Err(e) => {
                        self.warn(format!("{display}: USDT notes not read: {e:#}"));
                        None
                    }
                };
                self.remember(key, ScannedFile { probes: probes.clone() });
                match probes {
                    Some(p) => p,
                    None => return Ok(()),
                }
            }
        };
        if self.kernel.is_none() {
            // Deferred: the file is attached once the program is loaded, if it has probes
            // to attach (`role_for` also marks requests as found).
            let mut wanted = false;
            for note in &probes.notes {
                wanted |= self.role_for(key, note).is_some();
            }
            if wanted {
                self.awaiting_program.push((open.to_owned(), display.to_owned()));
            }
            return Ok(());
        }
        let before = self.links.len();
        for note in &probes.notes {
            let Some(role) = self.role_for(key, note) else { continue };
            if self.attached.contains(&(key, note.pc_offset)) {
                continue;
            }
            match self.attach_site(key, open, display, note, &probes.symbols, role) {
                Ok(()) => {}
                Err(e) if strict => return Err(e),
                Err(e) => self.warn(format!("{e:#}")),
            }
        }
        if self.links.len() > before {
            self.stats.files_attached += 1;
        }
        Ok(())
    }

    fn role_for(&mut self, key: FileKey, note: &notes::Note) -> Option<ProbeRole> {
        let mut role = None;
        for (i, (r, rkey)) in self.requests.iter().enumerate() {
            if r.provider == note.provider && r.name == note.name && rkey.is_none_or(|k| k == key) {
                self.found[i] = true;
                role.get_or_insert(r.role);
            }
        }
        if role.is_none() && note.provider == "rsprof" {
            role = ProbeRole::rsprof(&note.name);
        }
        role
    }

    fn pmu(&mut self, semaphore: bool) -> Result<u32> {
        if self.pmu_type.is_none() {
            self.pmu_type = Some(pmu_type()?);
        }
        if semaphore {
            let ok = *self.ref_ctr_ok.get_or_insert_with(ref_ctr_supported);
            if !ok {
                bail!(
                    "this kernel cannot maintain USDT semaphores (the uprobe PMU has no ref_ctr_offset; needs Linux 4.20+)"
                );
            }
        }
        Ok(self.pmu_type.unwrap())
    }

    fn attach_site(
        &mut self,
        key: FileKey,
        open: &Path,
        display: &str,
        note: &notes::Note,
        symbols: &HashMap<String, u64>,
        role: ProbeRole,
    ) -> Result<()> {
        let what = || format!("USDT {} in {display} at {:#x}", note.full_name(), note.pc);
        let parsed = args::parse_args(&note.args, note.pc, symbols)
            .map_err(|e| anyhow!("skipping {}: {e}", what()))?;
        let mut strings = vec![false; parsed.len()];
        if let Some(abi) = role.abi() {
            if parsed.len() < abi.len() {
                bail!(
                    "skipping {}: {} arguments, the rsprof ABI has {}",
                    what(),
                    parsed.len(),
                    abi.len()
                );
            }
            strings[..abi.len()].copy_from_slice(abi);
        }
        if self.registry.sites.len() >= USDT_MAX_SPECS as usize {
            bail!("skipping {}: more than {USDT_MAX_SPECS} probe sites", what());
        }
        let probe = *self
            .probe_ids
            .entry((key, note.provider.clone(), note.name.clone()))
            .or_insert_with(|| {
                self.registry.probes.push(ProbeInfo {
                    provider: note.provider.clone(),
                    name: note.name.clone(),
                    path: display.to_owned(),
                    role,
                });
                ProbeId(self.registry.probes.len() as u32 - 1)
            });
        let mut spec = UsdtSpec {
            probe_id: probe.0,
            arg_count: parsed.len() as u8,
            role: match role {
                ProbeRole::RsprofLabelPush => USDT_ROLE_LABEL_PUSH,
                ProbeRole::RsprofLabelPop => USDT_ROLE_LABEL_POP,
                _ => USDT_ROLE_SEND,
            },
            _pad: [0; 2],
            args: [UsdtArgSpec::default(); USDT_MAX_ARGS],
        };
        let mut slot = 0;
        for (i, a) in parsed.iter().enumerate() {
            spec.args[i] = a.spec;
            if strings[i] {
                slot += 1;
                spec.args[i].str_slot = slot;
            }
        }
        let spec_id = self.registry.sites.len() as u32;
        let pmu = self.pmu(note.semaphore != 0).with_context(what)?;
        let (prog, specs) = self.kernel.as_mut().context("USDT program not loaded")?;
        specs.set(spec_id, spec, 0).with_context(|| format!("store spec of {}", what()))?;
        let perf = open_uprobe(pmu, open, note.pc_offset, note.semaphore_offset)
            .with_context(|| format!("attach {}", what()))?;
        let link = link_create(prog, &perf, spec_id as u64)
            .with_context(|| format!("attach {}", what()))?;
        if note.semaphore_page_shared {
            self.warn(format!(
                "{}: its semaphore shares a file page with another segment; in processes started \
                 during the recording the kernel may not enable it",
                what()
            ));
        }
        self.registry.sites.push(SiteInfo {
            probe,
            file_offset: note.pc_offset,
            args: parsed,
            strings,
        });
        self.attached.insert((key, note.pc_offset));
        self.links.push(Attachment { _link: link, _perf: perf });
        Ok(())
    }
}

/// One `--usdt-dump` line: `TIME_NS PID TID CPU PROVIDER:NAME ARG…`, strings quoted.
fn dump_hit(w: &mut impl std::io::Write, reg: &ProbeRegistry, h: &UsdtHit) -> std::io::Result<()> {
    let p = &reg.probes[h.probe.0 as usize];
    write!(w, "{} {} {} {} {}", h.time_ns, h.pid, h.tid, h.cpu, p.full_name())?;
    for a in &h.args {
        match a {
            UsdtArg::Str(_) => write!(w, " {:?}", a.to_string())?,
            _ => write!(w, " {a}")?,
        }
    }
    writeln!(w)
}
