//! Unwind tables for the BPF stack walker (profiler-ebpf's stack.rs): each mapped file's CFI
//! compiled once per file identity (`profiler-unwind`) by worker threads (worker.rs) into the
//! one `UNWIND_ROWS` array, which is mapped into this process (rows.rs), and each profiled
//! process's executable mappings (runtime range, load bias, rows of its file) written to
//! `UNWIND_PROCS` whenever the collector says its mappings changed, or a table it waited for
//! landed. A process is published at once: files whose table is still being compiled are
//! `NOT_LOADED` (their frames end the walk as "no table", counted) until it lands. A table no
//! published process names stays loaded (a program run again reuses it) but is evictable:
//! when the array has no room for a new table, the least recently released ones are evicted
//! (counted) and their files forgotten; a full array with nothing evictable is counted too.

mod alloc;
mod disk;
pub mod kernel_maps;
mod launch;
pub use rsprof_core::debugfile::{
    build_id_path, debug_root, find_path as find_debug_file, inflate_zlib,
};
mod rows;
mod worker;

// Stack copies are unwound in userspace by the core's collector.
pub use rsprof_core::collect::copied;

use std::{
    collections::{HashMap, HashSet},
    fmt::Write as _,
    sync::{Arc, mpsc},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use aya::maps::MapData;
use kernel_maps::{ProcessSink, RowSink};
use profiler_common::{
    UNWIND_MAPPING_ANON, UNWIND_MAPPING_NO_CFI, UNWIND_MAPPING_NOT_LOADED,
    UNWIND_MAPPING_PY_TRAMPOLINES, UNWIND_MAX_MAPPINGS, UnwindFile, UnwindMapping, UnwindProcess,
    UnwindRow, UnwindSegment,
};

use crate::{
    collect::{
        collector::Collector,
        modules::{ElfLayout, ModuleTable},
        outbox::Forked,
    },
    model::{
        ids::{ModuleId, Pid},
        time::MonoNs,
    },
    store::SampleSink,
};

pub(crate) use crate::collect::modules::{FileIdentity, file_identity, kernel_file_key};

/// What became of a file's table.
#[derive(Clone, Copy, Debug)]
enum FileTable {
    Loaded {
        /// Entries of the rows array it holds: its rows, then their page index.
        first: u32,
        count: u32,
        /// Of them, rows; the page index's first entry is for page `page_base`.
        rows: u32,
        page_base: u32,
        /// Which load of the file (one evicted and loaded again is a new load).
        serial: u64,
    },
    /// No CFI, not x86-64 ELF, or CFI that failed to compile.
    NoCfi,
    /// The rows array had no room.
    Full,
}

/// A file's table as the loop knows it.
#[derive(Clone)]
enum FileState {
    /// Queued or being compiled.
    Pending,
    Done(FileTable, Option<Arc<ElfLayout>>),
}

/// What loading did, for the summary.
#[derive(Clone, Debug, Default)]
pub struct UnwindStats {
    pub tables_loaded: u64,
    pub rows_loaded: u64,
    pub rows_capacity: u64,
    /// Files without usable CFI, and the errors of the first few.
    pub files_without_cfi: u64,
    pub cfi_errors: Vec<(String, String)>,
    /// Tables evicted to make room for others (their files unmapped everywhere), and their
    /// rows.
    pub tables_evicted: u64,
    pub rows_evicted: u64,
    /// Released tables a worker had evicted by the time a process mapping the file again was
    /// published (the file was queued again).
    pub evicted_before_claim: u64,
    /// Files whose table did not fit in the rows array even after evicting every table no
    /// process names, and their rows.
    pub tables_not_loaded_full: u64,
    pub rows_not_loaded_full: u64,
    /// The first few of them, with their rows.
    pub full_files: Vec<(String, u32)>,
    /// Files that could not be read (their mappings have no table).
    pub files_unreadable: u64,
    /// Files whose own CFI left some code undescribed, so their separate debug file was
    /// looked for; those whose debug file's `.debug_frame` filled some of it (by how it was
    /// found); found with nothing to add; found but rejected (build-id or CRC mismatch, too
    /// large, not compiling), with the first few reasons.
    pub debug_lookups: u64,
    pub debug_used_build_id: u64,
    pub debug_used_debuglink: u64,
    pub debug_no_new_cfi: u64,
    /// Functions (FDEs) the used debug files described.
    pub debug_fdes: u64,
    pub debug_rejected: u64,
    pub debug_errors: Vec<String>,
    /// The disk cache (`disk`): tables read from it, stored in it, least recently used ones
    /// it deleted to stay in bounds, cached files found bad (deleted and compiled again, with
    /// the first reason), stores that failed (with the first error).
    pub disk_read: u64,
    pub disk_stored: u64,
    pub disk_evicted: u64,
    pub disk_rejected: u64,
    pub disk_errors: u64,
    pub disk_first_error: Option<String>,
    /// Worker time reading and compiling, and copying rows into the mapped array.
    pub compile_time: Duration,
    pub load_time: Duration,
    /// Writes of a process's mapping table, and processes removed (exit or exec).
    pub process_updates: u64,
    pub processes_removed: u64,
    /// Processes whose entry `defer_young` held back until they exited: writes saved.
    pub held_until_exit: u64,
    /// Rewrites of a process's table because a table it waited for landed.
    pub republished: u64,
    /// Mappings beyond `UNWIND_MAX_MAPPINGS` in one process (their frames end the walk).
    pub mappings_over_limit: u64,
    /// Process table writes the kernel refused (map full).
    pub process_update_errors: u64,
    /// New processes whose walker entry the kernel copied from the parent at fork, taken as
    /// is (no write); and forks written here because the copy was missing or stale.
    pub forks_adopted: u64,
    pub forks_written: u64,
    /// The loader's work on the event loop: in all, and its longest pass.
    pub loop_time: Duration,
    pub loop_max: Duration,
    /// Loaded files written to `UNWIND_FILES` (the kernel walks new mappings of them early).
    pub early_files: u64,
    /// `record -- CMD`: the files its launch list named, those loaded before it started, and
    /// the time that took.
    pub launch_list: Option<(usize, usize, Duration)>,
    /// Files queued when sampling began, and how long after it the last of them landed.
    pub startup_files: u64,
    pub startup_loaded_after: Option<Duration>,
}

/// A loaded table's users.
struct Refs {
    table: worker::Evicted,
    pids: HashSet<Pid>,
    /// Handed to the workers as evictable (`Shared::release`); must be claimed back before an
    /// entry naming it is published.
    released: bool,
    /// Written to `UNWIND_FILES` (while not released), so the kernel maps it early.
    in_kernel: bool,
}

/// How long the agent waits before writing a new process's walker entry unless one of its
/// samples wants it (`UnwindLoader::defer_young`): under churn most processes live less (a
/// `/bin/true` about 1 ms), and a process that lives on is written within a drain of this.
pub const DEFER_YOUNG: Duration = Duration::from_millis(200);

/// How long launch-list tables stay loaded though no process names them.
const PIN_FOR: Duration = Duration::from_secs(2);

/// Files whose first-sample wait is timed (`UnwindLoader::first_wanted`): the summary's
/// figure, not something to grow without bound in an agent.
const MAX_TIMED_FILES: usize = 4096;

pub struct UnwindLoader {
    procs: Box<dyn ProcessSink>,
    shared: Arc<worker::Shared>,
    done: mpsc::Receiver<worker::Done>,
    by_identity: HashMap<FileIdentity, FileState>,
    /// A module's file identity (None: unreadable), with the path it was resolved for (module
    /// ids are reused after release).
    by_module: HashMap<ModuleId, (String, Option<FileIdentity>)>,
    /// Processes published with a file pending, to republish when its table lands.
    waiting: HashMap<FileIdentity, HashSet<Pid>>,
    /// `defer_young`'s age, and the processes it holds back.
    defer_young: Option<Duration>,
    held: HashSet<Pid>,
    /// Processes this loader wrote an entry for (forked children walk with their parent's
    /// until they get one).
    written: HashSet<Pid>,
    /// Loaded tables: which published processes' entries name them.
    refs: HashMap<FileIdentity, Refs>,
    /// The loaded files each published process's entry names.
    names: HashMap<Pid, Vec<FileIdentity>>,
    /// When each published process's entry was last written (a forked child's: its
    /// parent's), to tell whether a fork copied the entry `names` describes.
    written_at: HashMap<Pid, MonoNs>,
    /// Tables that may have lost their last process this pass (released at its end).
    unreferenced: HashSet<FileIdentity>,
    /// Files queued this pass, handed to the workers at its end, after its releases: the
    /// files of a program that replaced one that exited find that one's tables evictable,
    /// even when this loop is descheduled mid-pass while a worker compiles.
    to_push: HashMap<FileIdentity, worker::Job>,
    /// When sampling began, and the start-up files not landed yet.
    startup: Option<(Instant, HashSet<FileIdentity>)>,
    /// Where each queued file was read from, kept only for the launch list (`launch`).
    paths: HashMap<FileIdentity, std::path::PathBuf>,
    /// Files loaded ahead of a command from its launch list: kept loaded and in
    /// `UNWIND_FILES` whether or not a process names them yet.
    pinned: HashSet<FileIdentity>,
    /// When `pinned` goes (see `load_launch_list`).
    unpin_at: Option<Instant>,
    /// See `keep_launch_list`.
    launch_list: bool,
    /// When a sample first stopped for want of each file's table (and the file's name), and
    /// when each table landed in the kernel: how long the first sample waited (`render`).
    /// At most `MAX_TIMED_FILES` each.
    first_wanted: HashMap<FileIdentity, (MonoNs, String)>,
    landed_at: HashMap<FileIdentity, MonoNs>,
    scratch: Box<UnwindProcess>,
    pub stats: UnwindStats,
}

impl UnwindLoader {
    /// Starts two compile threads: one for any file, one only for files samples wait for
    /// (see `worker::Lane`). They start working at `mark_startup`.
    pub fn new(rows: MapData, procs: kernel_maps::WalkerEntries) -> Result<Self> {
        Self::with_maps(Box::new(rows::RowsMmap::new(rows)?), Box::new(procs))
    }

    /// A loader writing to `rows` and `procs` (the kernel's maps, or a test's `Recorded`).
    pub fn with_maps(rows: Box<dyn RowSink>, procs: Box<dyn ProcessSink>) -> Result<Self> {
        let capacity = rows.capacity();
        let shared = worker::Shared::new(rows);
        let (tx, done) = mpsc::channel();
        for lane in [worker::Lane::General, worker::Lane::Urgent] {
            worker::spawn(shared.clone(), tx.clone(), lane).context("start unwind table worker")?;
        }
        Ok(Self {
            procs,
            shared,
            done,
            by_identity: HashMap::new(),
            by_module: HashMap::new(),
            waiting: HashMap::new(),
            written: Default::default(),
            defer_young: None,
            held: Default::default(),
            refs: HashMap::new(),
            names: HashMap::new(),
            written_at: HashMap::new(),
            unreferenced: HashSet::new(),
            to_push: HashMap::new(),
            startup: None,
            paths: HashMap::new(),
            pinned: HashSet::new(),
            unpin_at: None,
            launch_list: false,
            first_wanted: HashMap::new(),
            landed_at: HashMap::new(),
            scratch: Box::new(UnwindProcess {
                count: 0,
                early_seen: 0,
                mappings: [UnwindMapping::default(); UNWIND_MAX_MAPPINGS],
            }),
            stats: UnwindStats { rows_capacity: u64::from(capacity), ..Default::default() },
        })
    }

    /// Call when sampling begins: the files queued now are the start-up tables whose load
    /// time the summary reports.
    pub fn mark_startup(&mut self) {
        let pending: HashSet<FileIdentity> = self
            .by_identity
            .iter()
            .filter(|(_, s)| matches!(s, FileState::Pending))
            .map(|(&id, _)| id)
            .collect();
        self.stats.startup_files = pending.len() as u64;
        self.shared.resume();
        if pending.is_empty() {
            self.stats.startup_loaded_after = Some(Duration::ZERO);
        } else {
            self.startup = Some((Instant::now(), pending));
        }
    }

    /// After each drain (before the USDT session takes the mailboxes): takes the tables the
    /// workers finished, rewrites the mapping table of every process whose mappings changed
    /// or that waited for one of them (queueing files it maps for the first time), and
    /// forgets processes that exited.
    pub fn after_drain<S: SampleSink>(&mut self, collector: &mut Collector<S>) {
        let started = Instant::now();
        let mut pids: HashSet<Pid> = collector.outbox.take_maps_changed().into_iter().collect();
        while let Ok(d) = self.done.try_recv() {
            self.landed(d, &mut pids);
        }
        for fork in collector.outbox.take_forks() {
            self.forked(fork, &mut pids);
        }
        let wanted = collector.outbox.take_tables_wanted();
        // Sampled while the walker had no entry of its own for it (a forked child whose
        // parent's entry went with the parent, or one held back while young): write it now.
        for pid in &wanted {
            let live = collector.processes.processes.get(pid).is_some_and(|p| !p.exited);
            if live && !self.written.contains(pid) {
                pids.insert(*pid);
            }
        }
        if let Some(young) = self.defer_young {
            self.hold_young(collector, young, &wanted, &mut pids);
        }
        for (module, time) in collector.outbox.take_files_wanted() {
            let Some((name, Some(id))) = self.by_module.get(&module) else { continue };
            if self.first_wanted.len() < MAX_TIMED_FILES || self.first_wanted.contains_key(id) {
                let first = self.first_wanted.entry(*id).or_insert((time, name.clone()));
                first.0 = first.0.min(time);
            }
        }
        let mut pids: Vec<Pid> = pids.into_iter().collect();
        pids.sort_unstable();
        for pid in pids {
            self.sync(collector, pid);
        }
        let exited: Vec<Pid> = collector.outbox.pending_process_exits().to_vec();
        for pid in exited {
            // A pid that exited and was reused by a new process in this same drain keeps the
            // new process's entry.
            if collector.processes.processes.get(&pid).is_some_and(|p| !p.exited) {
                continue;
            }
            self.remove(pid);
        }
        self.unpin_when_due();
        self.release_unreferenced();
        if !self.to_push.is_empty() {
            self.shared.push(self.to_push.drain());
        }
        self.prioritize(wanted);
        let took = started.elapsed();
        self.stats.loop_time += took;
        self.stats.loop_max = self.stats.loop_max.max(took);
    }

    /// Waits to write the entries of processes younger than `young` until one of their
    /// samples wants it (`wanted`) or they have lived that long: most such processes exit
    /// first, and cost no write at all. Their samples meanwhile continue over stack copies.
    fn hold_young<S: SampleSink>(
        &mut self,
        collector: &Collector<S>,
        young: Duration,
        wanted: &[Pid],
        pids: &mut HashSet<Pid>,
    ) {
        let wanted: HashSet<&Pid> = wanted.iter().collect();
        let held: HashSet<Pid> = std::mem::take(&mut self.held);
        pids.extend(held.iter().copied());
        let now = MonoNs::now().0;
        pids.retain(|pid| {
            let Some(p) = collector.processes.processes.get(pid) else { return true };
            if p.exited {
                if held.contains(pid) {
                    self.stats.held_until_exit += 1;
                }
                return true;
            }
            let born = p.meta.start.map_or(0, |s| s.0);
            if wanted.contains(pid) || now.saturating_sub(born) >= young.as_nanos() as u64 {
                return true;
            }
            self.held.insert(*pid);
            false
        });
    }

    /// Writes new processes' entries only once they are sampled or have lived `young`.
    pub fn defer_young(&mut self, young: Duration) {
        self.defer_young = Some(young);
    }

    /// Files of processes whose samples ended without a table go first.
    fn prioritize(&mut self, wanted: Vec<Pid>) {
        if wanted.is_empty() {
            return;
        }
        let mut per_pid: HashMap<Pid, u64> = HashMap::new();
        for pid in wanted {
            *per_pid.entry(pid).or_default() += 1;
        }
        let files: Vec<(FileIdentity, u64)> = self
            .waiting
            .iter()
            .map(|(&id, pids)| (id, pids.iter().filter_map(|p| per_pid.get(p)).sum()))
            .filter(|&(_, n)| n > 0)
            .collect();
        if !files.is_empty() {
            self.shared.wanted(&files);
        }
    }

    /// A new process forked without exec. The kernel gave it a copy of its parent's entry at
    /// the fork (`walker_copied`): when that copy is the entry `names` describes (written
    /// before the fork, not due for a rewrite in this pass), the child is adopted as is — no
    /// write, and its samples unwound from the fork on. Otherwise it is written like any
    /// process whose mappings changed.
    fn forked(&mut self, f: Forked, pids: &mut HashSet<Pid>) {
        if pids.contains(&f.child) {
            return;
        }
        let current = f.walker_copied
            && !pids.contains(&f.parent)
            && self.names.contains_key(&f.parent)
            && self.written_at.get(&f.parent).is_some_and(|&w| w < f.time);
        if current {
            self.adopt(f.parent, f.child);
        } else {
            self.stats.forks_written += 1;
            pids.insert(f.child);
        }
    }

    /// Books `child` as published with `parent`'s entry, which the kernel copied.
    fn adopt(&mut self, parent: Pid, child: Pid) {
        let names = self.names.get(&parent).cloned().unwrap_or_default();
        for id in &names {
            if let Some(r) = self.refs.get_mut(id) {
                r.pids.insert(child);
            }
        }
        if let Some(old) = self.names.insert(child, names) {
            self.unref(child, old);
        }
        // Its entry names the same pending files: rewritten when they land, like the parent.
        for waiting in self.waiting.values_mut() {
            if waiting.contains(&parent) {
                waiting.insert(child);
            }
        }
        if let Some(&w) = self.written_at.get(&parent) {
            self.written_at.insert(child, w);
        }
        self.stats.forks_adopted += 1;
    }

    /// Notified each time a worker finishes a table (see `worker::Shared::done_notify`).
    pub fn table_done(&self) -> Arc<tokio::sync::Notify> {
        self.shared.done_notify.clone()
    }

    /// Whether some process was published with a file whose table is still being compiled.
    pub fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }

    fn landed(&mut self, d: worker::Done, republish: &mut HashSet<Pid>) {
        self.stats.compile_time += d.compile;
        self.stats.load_time += d.copy;
        self.debug_used(d.debug);
        let s = &mut self.stats;
        s.disk_read += u64::from(d.disk.read);
        s.disk_stored += u64::from(d.disk.stored);
        s.disk_evicted += d.disk.evicted;
        let failed = d.disk.rejected.is_some() as u64 + d.disk.store_error.is_some() as u64;
        s.disk_rejected += u64::from(d.disk.rejected.is_some());
        s.disk_errors += u64::from(d.disk.store_error.is_some());
        if failed > 0 && s.disk_first_error.is_none() {
            s.disk_first_error = d.disk.rejected.or(d.disk.store_error);
        }
        for e in &d.evicted {
            self.stats.tables_evicted += 1;
            self.stats.rows_evicted += u64::from(e.count);
            // Forgotten unless `claim` found it gone first and queued the file again.
            if self.refs.get(&e.identity).is_some_and(|r| r.table.serial == e.serial) {
                self.refs.remove(&e.identity);
                self.by_identity.remove(&e.identity);
            }
        }
        match d.table {
            FileTable::Loaded { first, count, serial, .. } => {
                self.stats.tables_loaded += 1;
                if self.landed_at.len() < MAX_TIMED_FILES {
                    self.landed_at.entry(d.identity).or_insert_with(MonoNs::now);
                }
                self.stats.rows_loaded += u64::from(d.rows);
                let table = worker::Evicted { identity: d.identity, serial, first, count };
                self.refs.insert(
                    d.identity,
                    Refs { table, pids: HashSet::new(), released: false, in_kernel: false },
                );
                // Released at the end of this pass unless a waiting process names it.
                self.unreferenced.insert(d.identity);
            }
            FileTable::NoCfi => {
                self.stats.files_without_cfi += 1;
                if self.stats.cfi_errors.len() < 8 {
                    let err = d.error.unwrap_or_default();
                    self.stats.cfi_errors.push((d.name.clone(), err));
                }
            }
            FileTable::Full => {
                self.stats.tables_not_loaded_full += 1;
                self.stats.rows_not_loaded_full += u64::from(d.rows);
                if self.stats.full_files.len() < 8 {
                    self.stats.full_files.push((d.name.clone(), d.rows));
                }
            }
        }
        self.by_identity.insert(d.identity, FileState::Done(d.table, d.layout));
        if self.pinned.contains(&d.identity) {
            self.file_to_kernel(&d.identity);
        }
        if let Some(pids) = self.waiting.remove(&d.identity) {
            self.stats.republished += pids.len() as u64;
            republish.extend(pids);
        }
        if let Some((since, left)) = &mut self.startup {
            left.remove(&d.identity);
            if left.is_empty() {
                self.stats.startup_loaded_after = Some(since.elapsed());
                self.startup = None;
            }
        }
    }

    fn debug_used(&mut self, debug: worker::DebugUse) {
        use worker::DebugUse;
        let s = &mut self.stats;
        let reject = |s: &mut UnwindStats, why: Vec<String>| {
            s.debug_rejected += !why.is_empty() as u64;
            for w in why {
                if s.debug_errors.len() < 8 {
                    s.debug_errors.push(w);
                }
            }
        };
        match debug {
            DebugUse::NotNeeded => return,
            DebugUse::NotFound { rejected } => reject(s, rejected),
            DebugUse::NoNewCfi => s.debug_no_new_cfi += 1,
            DebugUse::Used { how, fdes } => {
                s.debug_fdes += fdes as u64;
                match how {
                    rsprof_core::debugfile::How::BuildId => s.debug_used_build_id += 1,
                    rsprof_core::debugfile::How::DebugLink => s.debug_used_debuglink += 1,
                }
            }
            DebugUse::Failed(why) => reject(s, vec![why]),
        }
        s.debug_lookups += 1;
    }

    /// Writes `pid`'s executable mappings to the kernel.
    pub fn sync<S: SampleSink>(&mut self, collector: &mut Collector<S>, pid: Pid) {
        let Some(p) = collector.processes.processes.get(&pid) else { return };
        if p.exited {
            self.remove(pid);
            if self.launch_list {
                for m in p.space.mappings() {
                    self.queue_for_later(&collector.modules, m.module);
                }
            }
            return;
        }
        let mappings = p.space.mappings().to_vec();
        let arenas = p.py_trampoline_arenas.clone();
        let mut n = 0usize;
        let mut names = Vec::new();
        for m in &mappings {
            if n == UNWIND_MAX_MAPPINGS {
                self.stats.mappings_over_limit += 1;
                continue;
            }
            let (mut entry, loaded) =
                self.entry(&collector.modules, pid, m.module, m.start, m.end, m.file_offset);
            if entry.flags & UNWIND_MAPPING_ANON != 0 && arenas.binary_search(&m.start).is_ok() {
                entry.flags |= UNWIND_MAPPING_PY_TRAMPOLINES;
            }
            self.scratch.mappings[n] = entry;
            names.extend(loaded);
            n += 1;
        }
        self.scratch.count = n as u32;
        self.scratch.early_seen = p.space.early_seen();
        self.stats.process_updates += 1;
        if self.procs.insert(pid.0, self.scratch.as_ref()).is_err() {
            self.stats.process_update_errors += 1;
            // The old entry (if any) stands; what this one claimed is released at the end of
            // the pass unless another process names it.
            self.unreferenced.extend(names);
            return;
        }
        self.written.insert(pid);
        // Read after the write: a fork stamped later certainly copied this entry.
        self.written_at.insert(pid, MonoNs::now());
        for id in &names {
            let Some(r) = self.refs.get_mut(id) else { continue };
            r.pids.insert(pid);
            self.file_to_kernel(id);
        }
        if let Some(old) = self.names.insert(pid, names) {
            self.unref(pid, old);
        }
    }

    /// Writes loaded file `id` to `UNWIND_FILES` (`Refs::in_kernel`) unless it is there or
    /// released (evictable).
    fn file_to_kernel(&mut self, id: &FileIdentity) {
        if self.refs.get(id).is_none_or(|r| r.in_kernel || r.released) {
            return;
        }
        let Some(FileState::Done(FileTable::Loaded { first, count, rows, page_base, .. }, layout)) =
            self.by_identity.get(id)
        else {
            return;
        };
        let Some(layout) = layout else { return };
        let mut file = UnwindFile {
            size: id.3,
            mtime_sec: id.2.div_euclid(1_000_000_000) as u64,
            mtime_nsec: id.2.rem_euclid(1_000_000_000) as u32,
            first: *first,
            count: *rows,
            page_base: *page_base,
            pages: count - rows - 1,
            ..Default::default()
        };
        for (seg, &(vaddr, memsz, offset)) in file.segments.iter_mut().zip(&layout.code) {
            *seg = UnwindSegment { vaddr, memsz, offset };
            file.segment_count += 1;
        }
        if self.procs.insert_file(kernel_file_key(id), &file).is_ok() {
            self.stats.early_files += 1;
            self.refs.get_mut(id).expect("looked up above").in_kernel = true;
        }
    }

    pub fn remove(&mut self, pid: Pid) {
        // The kernel deleted the entry at the exit, but this loader may have written it again
        // after that (from records read before the exit's).
        if self.written.remove(&pid) {
            self.procs.remove(pid.0);
            self.stats.processes_removed += 1;
        }
        self.written_at.remove(&pid);
        if let Some(old) = self.names.remove(&pid) {
            self.unref(pid, old);
        }
    }

    /// `pid`'s entry no longer names the tables `old` unless its new one does.
    fn unref(&mut self, pid: Pid, old: Vec<FileIdentity>) {
        let now = self.names.get(&pid);
        for id in old {
            if now.is_some_and(|n| n.contains(&id)) {
                continue;
            }
            if let Some(r) = self.refs.get_mut(&id) {
                r.pids.remove(&pid);
                self.unreferenced.insert(id);
            }
        }
    }

    /// Hands the tables no published entry names to the workers as evictable. At the end of
    /// a pass, after every rewrite and removal, so the UNWIND_PROCS entries that named them
    /// are already gone from the kernel.
    fn release_unreferenced(&mut self) {
        for id in std::mem::take(&mut self.unreferenced) {
            if let Some(r) = self.refs.get_mut(&id)
                && r.pids.is_empty()
                && !r.released
                && !self.pinned.contains(&id)
            {
                // No new early mapping may name rows the workers can now evict.
                if r.in_kernel {
                    self.procs.remove_file(kernel_file_key(&id));
                    r.in_kernel = false;
                }
                r.released = true;
                self.shared.release(r.table);
            }
        }
    }

    /// The walker's view of one mapping of `module` at `start..end` (file offset `offset`) in
    /// `pid`, and the loaded table it names (claimed back if it was released).
    fn entry(
        &mut self,
        modules: &ModuleTable,
        pid: Pid,
        module: ModuleId,
        start: u64,
        end: u64,
        offset: u64,
    ) -> (UnwindMapping, Option<FileIdentity>) {
        let mut e = UnwindMapping { start, end, module: module.0, ..Default::default() };
        let m = modules.get(module);
        if m.path == "[anon]" {
            e.flags = UNWIND_MAPPING_ANON | UNWIND_MAPPING_NO_CFI;
            return (e, None);
        }
        // Kernel pseudo mappings other than the vDSO (`[vsyscall]`): no file, no CFI.
        if m.path.starts_with('[') && m.path != "[vdso]" {
            e.flags = UNWIND_MAPPING_NO_CFI;
            return (e, None);
        }
        let Some(identity) = self.identity(modules, module) else {
            e.flags = UNWIND_MAPPING_NO_CFI;
            return (e, None);
        };
        // A released table is claimed back under the workers' lock before any entry names it;
        // one already evicted is loaded again.
        if let Some(r) = self.refs.get_mut(&identity)
            && r.released
        {
            if self.shared.claim(r.table.serial) {
                r.released = false;
                // Released again at the end of the pass if the entry is not published.
                self.unreferenced.insert(identity);
            } else {
                self.stats.evicted_before_claim += 1;
                self.refs.remove(&identity);
                self.by_identity.remove(&identity);
            }
        }
        let state = match self.by_identity.get(&identity) {
            Some(s) => s.clone(),
            None => {
                self.enqueue(modules, module, identity);
                self.by_identity[&identity].clone()
            }
        };
        let (table, layout) = match state {
            FileState::Pending => {
                if self.waiting.entry(identity).or_default().insert(pid) {
                    match self.to_push.get_mut(&identity) {
                        Some(job) => job.weight += 1,
                        None => self.shared.shared_by_one_more(&identity),
                    }
                }
                e.flags = UNWIND_MAPPING_NOT_LOADED;
                return (e, None);
            }
            FileState::Done(t, l) => (t, l),
        };
        match table {
            FileTable::Loaded { first, count, rows, page_base, .. } => {
                // The executable segment holding this mapping's file offset gives the bias.
                // The kernel maps from the page holding p_offset, which lld does not align
                // (Rust's default linker: p_offset 0x17130 mapped from offset 0x17000).
                let seg = layout.as_ref().and_then(|l| {
                    l.code
                        .iter()
                        .find(|&&(_, memsz, off)| off & !0xfff <= offset && offset < off + memsz)
                });
                match seg {
                    Some(&(vaddr, _, off)) => {
                        e.bias = start.wrapping_sub(vaddr.wrapping_add(offset).wrapping_sub(off));
                        e.first = first;
                        e.count = rows;
                        e.page_base = page_base;
                        // The index's last entry ends the last page's rows.
                        e.pages = count - rows - 1;
                        return (e, Some(identity));
                    }
                    None => e.flags = UNWIND_MAPPING_NO_CFI,
                }
            }
            FileTable::NoCfi => e.flags = UNWIND_MAPPING_NO_CFI,
            FileTable::Full => e.flags = UNWIND_MAPPING_NOT_LOADED,
        }
        (e, None)
    }

    /// Queues `module`'s file if it is new, though no entry names it now (its process exited):
    /// for the launch list.
    fn queue_for_later(&mut self, modules: &ModuleTable, module: ModuleId) {
        let m = modules.get(module);
        if m.path.starts_with('[') {
            return;
        }
        if let Some(identity) = self.identity(modules, module)
            && !self.by_identity.contains_key(&identity)
        {
            self.enqueue(modules, module, identity);
        }
    }

    /// `record -- CMD`: files' paths are kept for the command's launch list, and files of
    /// processes that exited before their entry was written are queued too, so that the list
    /// holds them (a compiler's linker can live 20 ms).
    pub fn keep_launch_list(&mut self) {
        self.launch_list = true;
    }

    /// The identity of a module's file (one stat, once per module).
    fn identity(&mut self, modules: &ModuleTable, module: ModuleId) -> Option<FileIdentity> {
        let m = modules.get(module);
        if let Some((path, id)) = self.by_module.get(&module)
            && *path == m.path
        {
            return *id;
        }
        let meta = m.readable_path().and_then(|p| std::fs::metadata(p).ok());
        let id = meta.as_ref().map(file_identity);
        if id.is_none() {
            self.stats.files_unreadable += 1;
        }
        self.by_module.insert(module, (m.path.clone(), id));
        id
    }

    fn enqueue(&mut self, modules: &ModuleTable, module: ModuleId, identity: FileIdentity) {
        let m = modules.get(module);
        let Some(path) = m.readable_path() else {
            // Gone since `identity` looked (a race): no table.
            self.stats.files_unreadable += 1;
            self.by_identity.insert(identity, FileState::Done(FileTable::NoCfi, None));
            return;
        };
        self.by_identity.insert(identity, FileState::Pending);
        if self.launch_list {
            self.paths.insert(identity, std::path::PathBuf::from(&m.path));
        }
        let job = worker::Job {
            path,
            hold: m.hold(),
            name: m.path.clone(),
            weight: 0,
            wanted: 0,
            size: identity.3,
        };
        self.to_push.insert(identity, job);
    }

    /// How long the first sample that stopped for want of each file's table waited for it to
    /// land: median and p99 over the files, the largest files' own, and the files whose
    /// table never came.
    fn render_waits(&self) -> Option<String> {
        if self.first_wanted.is_empty() {
            return None;
        }
        let mut waited = Vec::new(); // (size, ms, name)
        let (mut never, mut already) = (0, 0);
        for (id, (first, name)) in &self.first_wanted {
            match self.landed_at.get(id) {
                None => never += 1,
                Some(landed) if landed.0 <= first.0 => already += 1,
                Some(landed) => waited.push((id.3, (landed.0 - first.0) as f64 / 1e6, name)),
            }
        }
        let mut ms: Vec<f64> = waited.iter().map(|w| w.1).collect();
        ms.sort_by(f64::total_cmp);
        // Nearest rank.
        let at = |q: f64| ms[((ms.len() as f64 * q).ceil() as usize).clamp(1, ms.len()) - 1];
        let mut line = format!("first sample to table in the kernel: {} files", ms.len());
        if !ms.is_empty() {
            let _ = write!(line, ", median {:.0} ms, p99 {:.0} ms", at(0.5), at(0.99));
            waited.sort_by_key(|w| std::cmp::Reverse(w.0));
            let largest: Vec<String> = waited
                .iter()
                .take(3)
                .map(|(size, ms, name)| {
                    let file = name.rsplit('/').next().unwrap_or(name);
                    format!("{file} ({:.0} MiB) {ms:.0} ms", *size as f64 / 1048576.0)
                })
                .collect();
            let _ = write!(line, "; largest: {}", largest.join(", "));
        }
        let _ = write!(
            line,
            "; {never} never loaded; {already} first sampled after their table landed (the \
             process's entry not written yet)"
        );
        Some(line)
    }

    /// The summary block.
    pub fn render(&self) -> String {
        let s = &self.stats;
        let mut out = String::new();
        let row = std::mem::size_of::<UnwindRow>() as u64;
        let mib = |rows: u64| (rows * row) as f64 / 1048576.0;
        let _ = writeln!(
            out,
            "unwind tables: {} files loaded, {} rows with their page indexes ({:.1} MiB in use at the end of {:.1} MiB, \
             --unwind-table-mb); {} evicted when full ({} rows, {:.1} MiB; files no process \
             mapped any more; {} just before a process mapped the file again); {} files without CFI, {} \
             not loaded (table full, nothing evictable: {:.1} MiB more needed), {} unreadable, \
             {} still queued at the end; compiled in {:.0} ms, copied in {:.0} ms (off the \
             event loop); separate debug files: {} used ({} by build-id, {} by \
             .gnu_debuglink; {} functions) of {} looked for (files with code lacking CFI), {} \
             found with no new CFI, {} rejected",
            s.tables_loaded,
            s.rows_loaded,
            mib(s.rows_loaded - s.rows_evicted),
            mib(s.rows_capacity),
            s.tables_evicted,
            s.rows_evicted,
            mib(s.rows_evicted),
            s.evicted_before_claim,
            s.files_without_cfi,
            s.tables_not_loaded_full,
            mib(s.rows_not_loaded_full),
            s.files_unreadable,
            self.pending(),
            s.compile_time.as_secs_f64() * 1e3,
            s.load_time.as_secs_f64() * 1e3,
            s.debug_used_build_id + s.debug_used_debuglink,
            s.debug_used_build_id,
            s.debug_used_debuglink,
            s.debug_fdes,
            s.debug_lookups,
            s.debug_no_new_cfi,
            s.debug_rejected
        );
        let startup = match s.startup_loaded_after {
            Some(d) => format!("all loaded {:.0} ms after sampling began", d.as_secs_f64() * 1e3),
            None => "not all loaded by the end".to_owned(),
        };
        let _ = writeln!(
            out,
            "  start-up tables: {} files, {startup}; event loop: {:.0} ms in all, longest pass \
             {:.1} ms",
            s.startup_files,
            s.loop_time.as_secs_f64() * 1e3,
            s.loop_max.as_secs_f64() * 1e3
        );
        if let Some(line) = self.render_waits() {
            let _ = writeln!(out, "  {line}");
        }
        if s.early_files > 0 || s.launch_list.is_some() {
            let launch = s.launch_list.map_or(String::new(), |(listed, loaded, took)| {
                format!(
                    "; launch list: {loaded} of {listed} tables loaded in {:.0} ms before the \
                     command started",
                    took.as_secs_f64() * 1e3
                )
            });
            let _ = writeln!(
                out,
                "  files mapped early: {} loaded files the kernel maps itself at mmap/exec{launch}",
                s.early_files
            );
        }
        if s.disk_read + s.disk_stored + s.disk_rejected + s.disk_errors > 0 {
            let _ = writeln!(
                out,
                "  disk cache: {} tables read, {} stored ({} least recently used deleted), {} \
                 found bad and compiled again, {} stores failed{}",
                s.disk_read,
                s.disk_stored,
                s.disk_evicted,
                s.disk_rejected,
                s.disk_errors,
                s.disk_first_error.as_ref().map_or(String::new(), |e| format!(" (first: {e})"))
            );
        }
        let _ = writeln!(
            out,
            "  process tables: {} writes ({} refused, {} when a table landed), {} removed, {} \
             mappings over the {} limit; forks: {} took their parent's entry as copied at the \
             fork, {} written; {} young processes exited before their write was due",
            s.process_updates,
            s.process_update_errors,
            s.republished,
            s.processes_removed,
            s.mappings_over_limit,
            UNWIND_MAX_MAPPINGS,
            s.forks_adopted,
            s.forks_written,
            s.held_until_exit
        );
        for (name, rows) in &s.full_files {
            let _ = writeln!(out, "  table full: {name}: {rows} rows");
        }
        for (name, err) in &s.cfi_errors {
            let _ = writeln!(out, "  no CFI: {name}: {err}");
        }
        for err in &s.debug_errors {
            let _ = writeln!(out, "  debug file rejected: {err}");
        }
        out
    }

    /// Loads the tables the last recorded run of the command line `argv` loaded (its launch
    /// list, `launch`), waiting at most `limit` for them: called before the command is let go,
    /// so that the kernel walks its first instructions. They stay pinned for `PIN_FOR` after
    /// (the command's processes name what they use by then). Returns the files listed, those
    /// loaded in time, and how long it waited; None without a list.
    pub fn load_launch_list(
        &mut self,
        argv: &[String],
        limit: Duration,
    ) -> Option<(usize, usize, Duration)> {
        let started = Instant::now();
        let name = launch::list_name(argv)?;
        let files = launch::read(self.shared.disk()?.dir(), &name);
        if files.is_empty() {
            return None;
        }
        let mut jobs = Vec::new();
        for (identity, path) in &files {
            self.pinned.insert(*identity);
            match self.by_identity.get(identity) {
                // Queued already (the command's image before its exec is this program's):
                // waited for too, and written to the kernel when it lands.
                Some(FileState::Pending) => continue,
                Some(FileState::Done(..)) => {
                    self.file_to_kernel(identity);
                    continue;
                }
                None => {}
            }
            self.by_identity.insert(*identity, FileState::Pending);
            self.paths.insert(*identity, path.clone());
            let job = worker::Job {
                path: path.clone(),
                hold: None,
                name: path.display().to_string(),
                weight: 0,
                // Both workers take them.
                wanted: 1,
                size: identity.3,
            };
            jobs.push((*identity, job));
        }
        self.shared.push(jobs);
        let end = started + limit;
        let pending = |l: &Self| {
            l.pinned.iter().any(|id| matches!(l.by_identity.get(id), Some(FileState::Pending)))
        };
        while pending(self) {
            let left = end.saturating_duration_since(Instant::now());
            let Ok(d) = self.done.recv_timeout(left) else { break };
            // Only the command, not exec'd yet, is known: nothing to publish again.
            self.landed(d, &mut HashSet::new());
        }
        let loaded =
            self.pinned.iter().filter(|id| self.refs.get(id).is_some_and(|r| r.in_kernel)).count();
        self.stats.launch_list = Some((files.len(), loaded, started.elapsed()));
        self.unpin_at = Some(Instant::now() + PIN_FOR);
        self.stats.launch_list
    }

    /// Launch-list tables no process named within `PIN_FOR` become evictable like others.
    fn unpin_when_due(&mut self) {
        if self.unpin_at.is_some_and(|at| Instant::now() >= at) {
            self.unpin_at = None;
            self.unreferenced.extend(self.pinned.drain());
        }
    }

    /// Writes the command's launch list: every file whose table this recording loaded.
    pub fn save_launch_list(&self, argv: &[String]) {
        let (Some(name), Some(disk)) = (launch::list_name(argv), self.shared.disk()) else {
            return;
        };
        // The command's image before its exec was this program's.
        let own = std::env::current_exe().ok().and_then(|p| launch::identity_of(&p));
        let mut files: Vec<(FileIdentity, &std::path::Path)> = self
            .by_identity
            .iter()
            .filter(|(id, _)| Some(**id) != own)
            .filter(|(_, s)| matches!(s, FileState::Done(FileTable::Loaded { .. }, _)))
            .filter_map(|(id, _)| Some((*id, self.paths.get(id)?.as_path())))
            // Not `[vdso]`: no file to read.
            .filter(|(_, path)| path.is_absolute())
            .collect();
        files.sort_by_key(|(id, _)| std::cmp::Reverse(id.3));
        let _ = launch::write(disk.dir(), &name, &files);
    }

    /// Waits, at most `limit`, for the files still queued to be compiled, so that their
    /// tables reach the disk cache and the next run of the same programs starts warm (a short
    /// command's big libraries are often still queued when it exits). Nothing to wait for
    /// without the disk cache.
    pub fn finish_for_disk(&mut self, limit: Duration) {
        if !self.shared.has_disk() {
            return;
        }
        let end = Instant::now() + limit;
        while self.pending() > 0 {
            let left = end.saturating_duration_since(Instant::now());
            let Ok(d) = self.done.recv_timeout(left) else { break };
            self.landed(d, &mut HashSet::new());
        }
    }

    /// Files queued or being compiled.
    pub fn pending(&self) -> usize {
        self.by_identity.values().filter(|s| matches!(s, FileState::Pending)).count()
    }
}

impl Drop for UnwindLoader {
    fn drop(&mut self) {
        // A worker mid-file finishes it and stops; it is not waited for.
        self.shared.close();
    }
}

/// Takes the walker's maps from the loaded object and starts the table workers.
pub fn maps(bpf: &mut crate::bpf::object::BpfObject) -> Result<UnwindLoader> {
    let (rows, procs, files) = bpf.take_unwind_maps().context("unwind maps")?;
    UnwindLoader::new(rows, kernel_maps::WalkerEntries { procs, files })
}
