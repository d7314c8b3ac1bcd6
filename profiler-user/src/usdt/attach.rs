//! The recording's USDT session: which files of which processes were scanned for SDT notes,
//! which probe sites are attached (`uprobe`), and, after each drain, the hits turned into
//! markers and label names. Uprobe events are system-wide (every process mapping the file);
//! the BPF program drops hits of processes the pid filter does not select.

use std::{
    collections::{HashMap, HashSet},
    io::Write as _,
    os::{fd::OwnedFd, unix::fs::MetadataExt as _},
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::maps::{Array, MapData};
use profiler_common::{
    USDT_MAX_ARGS, USDT_MAX_SPECS, USDT_ROLE_LABEL_POP, USDT_ROLE_LABEL_PUSH, USDT_ROLE_SEND,
    USDT_STR_IS_TRUNCATED, USDT_STR_IS_UNREADABLE, USDT_STR_MAX, UsdtArgSpec, UsdtSpec,
};

use super::{
    ProbeId, ProbeInfo, ProbeRegistry, ProbeRequest, ProbeRole, SiteInfo, UsdtArg, UsdtHit, args,
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
    system::procfs::{self, MapsLine},
};

/// A file by (st_dev, st_ino), as `stat` reports it.
type FileKey = (u64, u64);

/// Reads the C string at `addr` in `pid` if it lies in a read-only file mapping; returns
/// its bytes (at most `USDT_STR_MAX - 1`) and whether it was cut.
fn read_readonly_str(pid: Pid, addr: u64) -> Option<(Vec<u8>, bool)> {
    use std::os::unix::fs::FileExt as _;
    let end = procfs::read_maps(pid).ok()?.into_iter().find_map(|m| {
        let readonly = m.readable && !m.writable;
        (m.start <= addr && addr < m.end && readonly && m.inode != 0).then_some(m.end)
    })?;
    let want = ((end - addr) as usize).min(USDT_STR_MAX);
    let mut buf = vec![0u8; want];
    let n = std::fs::File::open(format!("/proc/{pid}/mem")).ok()?.read_at(&mut buf, addr).ok()?;
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

pub struct UsdtSession {
    /// The USDT program and its spec array; `None` when it could not be loaded and nothing
    /// was asked for explicitly (then `rsprof` probes are not recorded, with a warning).
    kernel: Option<(OwnedFd, Array<MapData, UsdtSpec>)>,
    pmu_type: Option<u32>,
    ref_ctr_ok: Option<bool>,
    requests: Vec<(ProbeRequest, Option<FileKey>)>,
    found: Vec<bool>,
    files: HashMap<FileKey, ScannedFile>,
    /// `/proc/PID/maps` (device, inode) pairs already scanned, to skip the stat.
    maps_seen: HashSet<(u64, u64)>,
    attached: HashSet<(FileKey, u64)>,
    probe_ids: HashMap<(FileKey, String, String), ProbeId>,
    registry: ProbeRegistry,
    links: Vec<Attachment>,
    warnings: Vec<String>,
    self_pid: u32,
    detached: bool,
    recovered: u64,
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

impl UsdtSession {
    /// Loads the USDT program and checks the requests; `--usdt …@PATH` probes are attached
    /// now (a missing file or probe is an error).
    pub fn new(
        sampler: &mut BpfObject,
        requests: Vec<ProbeRequest>,
        intervals: Vec<String>,
        dump: Option<&Path>,
    ) -> Result<Self> {
        let mut warnings = Vec::new();
        let kernel = match sampler.usdt_program() {
            Ok(k) => Some(k),
            Err(e) if requests.is_empty() => {
                warnings.push(format!("USDT probes are not recorded: {e:#}"));
                None
            }
            Err(e) => return Err(e),
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
        let mut s = Self {
            kernel,
            pmu_type: None,
            ref_ctr_ok: None,
            found: vec![false; reqs.len()],
            requests: reqs,
            files: HashMap::new(),
            maps_seen: HashSet::new(),
            attached: HashSet::new(),
            probe_ids: HashMap::new(),
            registry: ProbeRegistry { intervals, ..Default::default() },
            links: Vec::new(),
            warnings,
            self_pid: std::process::id(),
            detached: false,
            recovered: 0,
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
        };
        let explicit: Vec<(PathBuf, String)> = s
            .requests
            .iter()
            .filter_map(|(r, _)| Some((r.path.clone()?, format!("{}:{}", r.provider, r.name))))
            .collect();
        for (path, probe) in explicit {
            s.scan_file(&path, &path.display().to_string(), true)?;
            let found = s.requests.iter().zip(&s.found).any(|((r, _), &f)| {
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
        Ok(s)
    }

    /// Scans every process (for `--all`).
    pub fn scan_all_processes(&mut self) {
        for pid in procfs::all_pids() {
            self.scan_pid(pid);
        }
    }

    /// Scans the files `pid` has mapped executable; attaches requested and `rsprof` probes
    /// found in files not seen before. A process that is gone is skipped.
    pub fn scan_pid(&mut self, pid: Pid) {
        if self.detached || self.kernel.is_none() || pid.0 == 0 || pid.0 == self.self_pid {
            return;
        }
        let maps = match procfs::read_maps(pid) {
            Ok(m) => m,
            Err(procfs::ProcError::Gone) => return,
            Err(e) => {
                self.warnings.push(format!("read the mappings of pid {pid}: {e}"));
                return;
            }
        };
        for m in maps.iter().filter(|m| m.exec && m.is_file()) {
            self.scan_mapping(pid, m);
        }
    }

    fn scan_mapping(&mut self, pid: Pid, m: &MapsLine) {
        if !self.maps_seen.insert((m.dev, m.inode)) {
            return;
        }
        // map_files reaches the mapped file itself, even if deleted or in another mount
        // namespace; the kernel resolves it to the same inode when attaching.
        let open = PathBuf::from(format!("/proc/{pid}/map_files/{}", m.range_name()));
        if !open.exists() {
            // The process exited or unmapped it meanwhile; let a later mapping retry.
            self.maps_seen.remove(&(m.dev, m.inode));
            return;
        }
        if let Err(e) = self.scan_file(&open, &m.path, false) {
            self.warnings.push(format!("{}: {e:#}", m.path));
        }
    }

    /// Re-reads the maps of every profiled process still alive, for libraries loaded
    /// (dlopen) but not yet seen in a sample.
    pub fn rescan_live<S>(&mut self, collector: &Collector<S>) {
        for pid in collector.processes.live_pids() {
            self.scan_pid(pid);
        }
    }

    /// After each drain: scans newly (re)mapped processes, recovers unreadable strings, and
    /// turns the drained hits into markers and label names.
    pub fn after_drain<S: SampleSink>(&mut self, collector: &mut Collector<S>) {
        self.on_maps_changed(collector);
        self.recover_strings(collector);
        let raw = collector.outbox.take_usdt_hits();
        for h in &raw {
            self.consume(h, collector);
        }
        collector.outbox.reuse_hits(raw);
        // After this drain's hits: a thread's hits all precede its exit.
        let exits = collector.outbox.take_exits();
        self.markers.exited(&self.registry, &mut collector.store, &exits.processes, &exits.threads);
    }

    fn consume<S: SampleSink>(&mut self, raw: &RawUsdtHit, collector: &mut Collector<S>) {
        let Some(hit) = self.registry.resolve(raw) else {
            self.unresolved += 1;
            return;
        };
        self.hits += 1;
        *self.hit_counts.entry(hit.probe).or_default() += 1;
        if let Some((_, w)) = &mut self.dump {
            let _ = dump_hit(w, &self.registry, &hit);
        }
        let role = self.registry.probes[hit.probe.0 as usize].role;
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
        self.markers.hit(&self.registry, &hit, &mut collector.store);
    }

    /// Intervals begun and not ended yet, for a snapshot.
    pub fn open_markers(&self) -> Vec<(ThreadKey, Marker)> {
        self.markers.open_markers(&self.registry)
    }

    /// Schemas of the markers of the probes attached so far.
    pub fn marker_schemas(&self) -> Vec<MarkerSchema> {
        markers::schemas(&self.registry)
    }

    /// A string the kernel could not copy because its page was not resident yet (a freshly
    /// loaded library's `.rodata`: BPF cannot fault pages in) is read from the process now,
    /// but only from a read-only file mapping, whose bytes cannot have changed since the hit.
    pub fn recover_strings<S>(&mut self, collector: &mut Collector<S>) {
        for h in collector.outbox.usdt_hits_mut() {
            let Some(site) = self.registry.sites.get(h.spec_id as usize) else { continue };
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
                if let Some((bytes, truncated)) = read_readonly_str(h.pid, addr) {
                    s.bytes = bytes;
                    s.flags = if truncated { USDT_STR_IS_TRUNCATED } else { 0 };
                    self.recovered += 1;
                }
            }
        }
    }

    /// Scans newly (re)mapped processes the collector noticed.
    pub fn on_maps_changed<S>(&mut self, collector: &mut Collector<S>) {
        for pid in collector.outbox.take_maps_changed() {
            self.scan_pid(pid);
        }
    }

    /// Reads `open` (shown as `display`) once and attaches its probes that are requested.
    /// `strict`: attach failures are errors rather than warnings.
    pub fn scan_file(&mut self, open: &Path, display: &str, strict: bool) -> Result<()> {
        if self.detached || self.kernel.is_none() {
            return Ok(());
        }
        let key = file_key(open).with_context(|| format!("stat {}", open.display()))?;
        let probes = match self.files.get(&key) {
            Some(f) => match &f.probes {
                Some(p) => p.clone(),
                None => return Ok(()),
            },
            None => {
                let probes = match notes::read_probes(open) {
                    Ok(p) => (!p.notes.is_empty()).then(|| Arc::new(p)),
                    Err(e) => {
                        self.warnings.push(format!("{display}: USDT notes not read: {e:#}"));
                        None
                    }
                };
                self.files.insert(key, ScannedFile { probes: probes.clone() });
                match probes {
                    Some(p) => p,
                    None => return Ok(()),
                }
            }
        };
        for note in &probes.notes {
            let Some(role) = self.role_for(key, note) else { continue };
            if self.attached.contains(&(key, note.pc_offset)) {
                continue;
            }
            match self.attach_site(key, open, display, note, &probes.symbols, role) {
                Ok(()) => {}
                Err(e) if strict => return Err(e),
                Err(e) => self.warnings.push(format!("{e:#}")),
            }
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
            self.warnings.push(format!(
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

    pub fn sites(&self) -> usize {
        self.links.len()
    }

    /// Detaches every probe (semaphores drop back); hits already sent stay in the ring.
    pub fn detach(&mut self) {
        self.links.clear();
        self.detached = true;
    }

    /// Detaches, stores the intervals still open as incomplete markers and sums up. Call
    /// after the last drain.
    pub fn finish<S: SampleSink>(
        mut self,
        collector: &mut Collector<S>,
        counters: Counters,
    ) -> Result<UsdtReport> {
        self.detach();
        self.markers.finish(&self.registry, &mut collector.store);
        if let Some((path, mut w)) = self.dump.take() {
            w.flush().with_context(|| format!("write {}", path.display()))?;
        }
        let mut not_found = Vec::new();
        for (i, (r, _)) in self.requests.iter().enumerate() {
            if !self.found[i] {
                not_found.push(format!("{}:{}", r.provider, r.name));
            }
        }
        not_found.dedup();
        let mut hit_counts: Vec<(String, u64)> = self
            .hit_counts
            .iter()
            .map(|(p, &n)| (self.registry.probes[p.0 as usize].full_name(), n))
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
            sites: self.registry.sites.len(),
            registry: self.registry,
            hits: self.hits,
            hit_counts,
            unresolved: self.unresolved,
            markers: self.markers.stats,
            label_samples,
            labels_over_limit: self.labels_over_limit,
            counters,
            warnings: self.warnings,
            not_found,
            strings_recovered: self.recovered,
        })
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
