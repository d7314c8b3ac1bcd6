//! Table compilation off the event loop: worker threads take the most wanted file from a
//! shared queue, read its program headers, compile its CFI (`profiler-unwind`), copy the rows
//! into the mapped `UNWIND_ROWS` array and report back; the loop then publishes the process
//! entries that name the rows (so the walker never sees a table before its rows).

use std::{
    collections::{BTreeMap, HashMap},
    fs::File,
    path::PathBuf,
    sync::{Arc, Condvar, Mutex, mpsc},
    time::{Duration, Instant},
};

use profiler_unwind::{PageIndex, UnwindTable};

use super::{FileIdentity, FileTable, alloc::RowAllocator, disk, kernel_maps::RowSink};
use crate::collect::copied;
use crate::collect::modules::{ElfLayout, fd_path};
pub use rsprof_core::debugfile::{DebugUse, with_debug_file};

/// The walker's binary search does at most 24 halvings.
const MAX_TABLE_ROWS: usize = 1 << 24;

/// One file to compile.
pub struct Job {
    pub path: PathBuf,
    /// The mapped file, read through this handle when present (see `compile`).
    pub hold: Option<Arc<File>>,
    pub name: String,
    /// Processes mapping the file: most shared first (libc).
    pub weight: u64,
    /// Samples of processes mapping the file that ended without a table: the urgent worker
    /// takes only these, the general one ranks them above any sharing.
    pub wanted: u64,
    /// File size: among equal ranks, cheaper files first (more processes covered sooner).
    pub size: u64,
}

impl Job {
    /// Where to read the file: through the handle held on the mapped file when there is one.
    /// The path named that file when the job was queued, but it may have been deleted or
    /// replaced since (a program removed while it runs, a library upgraded in place), and
    /// the table must be the mapped file's.
    fn source(&self) -> PathBuf {
        match &self.hold {
            Some(f) => fd_path(f),
            None => self.path.clone(),
        }
    }

    fn rank(&self, lane: Lane) -> (u64, u64, std::cmp::Reverse<u64>) {
        match lane {
            // Most shared, then smallest.
            Lane::General => (self.weight, 0, std::cmp::Reverse(self.size)),
            // Waiting samples per compile cost (roughly the file's size): a small program's
            // binary is not held up behind a 150 MB library that more samples wait for.
            Lane::Urgent => {
                let per_mib = self.wanted.saturating_mul(1 << 20) / (self.size + (64 << 10));
                (per_mib, self.wanted, std::cmp::Reverse(self.size))
            }
        }
    }
}

/// The urgent lane leaves larger files (150 MB compiler libraries: seconds to compile) to the
/// general one, so it is never stuck on one while a small program's samples wait.
pub(super) const URGENT_MAX_BYTES: u64 = copied::COMPILE_WHILE_DRAINING_MAX_BYTES;

/// Which jobs a worker takes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Any, best ranked first.
    General,
    /// Only files samples are waiting for, so one large file being compiled does not hold
    /// up the tables the profile needs now.
    Urgent,
}

/// What became of a job.
pub struct Done {
    pub identity: FileIdentity,
    pub table: FileTable,
    /// Tables evicted to make room for this one (their rows now hold other tables).
    pub evicted: Vec<Evicted>,
    pub layout: Option<Arc<ElfLayout>>,
    /// Entries of the rows array the table takes (or would take): rows and page index.
    pub rows: u32,
    pub compile: Duration,
    pub copy: Duration,
    /// Why the file has no table (`FileTable::NoCfi`).
    pub error: Option<String>,
    pub name: String,
    pub debug: DebugUse,
    pub disk: DiskUse,
}

/// A file's rows: compiled now, or read from the disk cache.
enum Rows {
    Compiled(UnwindTable),
    Read(Vec<profiler_common::UnwindRow>),
}

impl Rows {
    fn rows(&self) -> &[profiler_common::UnwindRow] {
        match self {
            Self::Compiled(t) => t.rows(),
            Self::Read(r) => r,
        }
    }
}

/// What the disk cache did for a file (`disk`).
#[derive(Debug, Default)]
pub struct DiskUse {
    /// Its table was read from the cache (with this many separate-debug-file FDEs in it).
    pub read: bool,
    pub debug_fdes: u64,
    /// A cached table found bad (deleted), and why.
    pub rejected: Option<String>,
    /// Its compiled table was stored, deleting this many least recently used ones.
    pub stored: bool,
    pub evicted: u64,
    pub store_error: Option<String>,
}

#[derive(Default)]
struct Queue {
    jobs: HashMap<FileIdentity, Job>,
    /// Until the start-up files are all queued (so the first taken is the best ranked).
    paused: bool,
    closed: bool,
}

/// A loaded table no published process names: its rows may be given to another table.
#[derive(Clone, Copy, Debug)]
pub struct Evicted {
    pub identity: FileIdentity,
    /// Which load of the file (a file evicted and loaded again is a new load).
    pub serial: u64,
    pub first: u32,
    pub count: u32,
}

/// Rows handed out, and the tables that may be evicted.
struct Tables {
    free: RowAllocator,
    next_serial: u64,
    /// Evictable tables by serial, with when they became so and their key in `order`.
    evictable: HashMap<u64, (Evicted, Instant, u64)>,
    /// Their serials, least recently unreferenced first.
    order: BTreeMap<u64, u64>,
    next_order: u64,
}

enum Alloc {
    Rows {
        first: u32,
        serial: u64,
        evicted: Vec<Evicted>,
    },
    /// Room only by evicting a table released less than `EVICT_GRACE` ago.
    Wait(Duration),
    /// No room even with every released table evicted (none is).
    Full,
}

impl Tables {
    fn new(capacity: u32) -> Self {
        Self {
            free: RowAllocator::new(capacity),
            next_serial: 0,
            evictable: HashMap::new(),
            order: BTreeMap::new(),
            next_order: 0,
        }
    }

    fn release(&mut self, table: Evicted, now: Instant) {
        let order = self.next_order;
        self.next_order += 1;
        self.order.insert(order, table.serial);
        self.evictable.insert(table.serial, (table, now, order));
    }

    fn claim(&mut self, serial: u64) -> bool {
        let Some((_, _, order)) = self.evictable.remove(&serial) else { return false };
        self.order.remove(&order);
        true
    }

    /// `count` rows, evicting released tables (least recently released first) while the free
    /// ranges have none that long.
    fn alloc(&mut self, count: u32, now: Instant) -> Alloc {
        // Tried on a copy of the free ranges: nothing is evicted unless it makes room.
        let mut trial = self.free.clone();
        let mut victims: Vec<u64> = Vec::new();
        let mut youngest = None;
        let mut fits = trial.alloc(count).is_some();
        for serial in self.order.values() {
            if fits {
                break;
            }
            let (e, at, _) = self.evictable[serial];
            trial.free(e.first, e.count);
            victims.push(*serial);
            youngest = youngest.max(Some(at));
            fits = trial.alloc(count).is_some();
        }
        if !fits {
            return Alloc::Full;
        }
        if let Some(at) = youngest
            && now.saturating_duration_since(at) < EVICT_GRACE
        {
            return Alloc::Wait(EVICT_GRACE - now.saturating_duration_since(at));
        }
        let mut evicted = Vec::with_capacity(victims.len());
        for serial in victims {
            let (e, _, order) = self.evictable.remove(&serial).expect("victim is evictable");
            self.order.remove(&order);
            self.free.free(e.first, e.count);
            evicted.push(e);
        }
        let first = self.free.alloc(count).expect("fitted in the trial");
        let serial = self.next_serial;
        self.next_serial += 1;
        Alloc::Rows { first, serial, evicted }
    }
}

/// How long a released table is kept before its rows are reused: a walk that read the
/// process entry naming it just before the entry was rewritten is a BPF program run (a perf
/// event or sched_switch handler, not preemptible, bounded by `bpf_loop`: microseconds), so
/// it is over long before this.
const EVICT_GRACE: Duration = Duration::from_millis(5);

pub struct Shared {
    /// Where separate debug files are installed (`/usr/lib/debug`).
    debug_root: PathBuf,
    queue: Mutex<Queue>,
    ready: Condvar,
    rows: Box<dyn RowSink>,
    /// The one lock for row allocation, eviction and claiming a table back (`claim`).
    tables: Mutex<Tables>,
    /// Compiled tables kept across runs.
    disk: Option<disk::DiskTables>,
    /// Told when a table is done: the event loop drains and publishes it at once, not at its
    /// next timed drain (up to a second later, while a short command's samples wait for it).
    pub done_notify: Arc<tokio::sync::Notify>,
}

impl Shared {
    pub fn new(rows: Box<dyn RowSink>) -> Arc<Self> {
        Arc::new(Self {
            debug_root: rsprof_core::debugfile::debug_root(),
            queue: Mutex::new(Queue { paused: true, ..Default::default() }),
            ready: Condvar::new(),
            tables: Mutex::new(Tables::new(rows.capacity())),
            rows,
            disk: disk::DiskTables::from_env(),
            done_notify: Arc::default(),
        })
    }

    pub fn push(&self, jobs: impl IntoIterator<Item = (FileIdentity, Job)>) {
        self.queue.lock().unwrap().jobs.extend(jobs);
        // Both workers: with notify_one the urgent one could take the wakeup, find the job
        // not wanted and sleep again, leaving it queued (a program exec'd under `--all` went
        // its whole life without its table; stack copies hid it).
        self.ready.notify_all();
    }

    /// One more process maps a queued file.
    pub fn shared_by_one_more(&self, identity: &FileIdentity) {
        if let Some(j) = self.queue.lock().unwrap().jobs.get_mut(identity) {
            j.weight += 1;
        }
    }

    /// `samples` samples waited for queued files (processes' files, each with its count).
    pub fn wanted(&self, files: &[(FileIdentity, u64)]) {
        let mut q = self.queue.lock().unwrap();
        for (id, samples) in files {
            if let Some(j) = q.jobs.get_mut(id) {
                j.wanted += samples;
            }
        }
        drop(q);
        self.ready.notify_all();
    }

    /// Lets the workers start.
    pub fn resume(&self) {
        self.queue.lock().unwrap().paused = false;
        self.ready.notify_all();
    }

    /// Stops the workers after their current file (queued files are dropped).
    /// Whether compiled tables are kept on disk.
    pub fn has_disk(&self) -> bool {
        self.disk.is_some()
    }

    pub fn disk(&self) -> Option<&disk::DiskTables> {
        self.disk.as_ref()
    }

    pub fn close(&self) {
        let mut q = self.queue.lock().unwrap();
        q.closed = true;
        q.jobs.clear();
        drop(q);
        self.ready.notify_all();
    }

    /// A loaded table that no published process names any more (the loader removed or
    /// rewrote every `UNWIND_PROCS` entry naming it): evictable from now, the least recently
    /// released first. It stays loaded until a worker needs its rows.
    pub fn release(&self, table: Evicted) {
        self.tables.lock().unwrap().release(table, Instant::now());
    }

    /// Takes a released table back before a process entry naming it is published: false if a
    /// worker evicted it meanwhile (its `Done` says so; the file must be loaded again).
    pub fn claim(&self, serial: u64) -> bool {
        self.tables.lock().unwrap().claim(serial)
    }

    /// Reserves `count` rows (see `Tables::alloc`), waiting out the grace of tables released
    /// a moment ago.
    fn alloc(&self, count: u32) -> Option<(u32, u64, Vec<Evicted>)> {
        loop {
            match self.tables.lock().unwrap().alloc(count, Instant::now()) {
                Alloc::Rows { first, serial, evicted } => return Some((first, serial, evicted)),
                Alloc::Full => return None,
                // Decided again after the wait: the loader may claim some back meanwhile.
                Alloc::Wait(d) => std::thread::sleep(d),
            }
        }
    }

    fn next(&self, lane: Lane) -> Option<(FileIdentity, Job)> {
        let mut q = self.queue.lock().unwrap();
        loop {
            if q.closed {
                return None;
            }
            let best = q
                .jobs
                .iter()
                .filter(|(_, j)| {
                    !q.paused
                        && (lane == Lane::General || (j.wanted > 0 && j.size <= URGENT_MAX_BYTES))
                })
                .max_by_key(|(_, j)| j.rank(lane));
            if let Some((&id, _)) = best {
                let job = q.jobs.remove(&id).expect("just found");
                return Some((id, job));
            }
            q = self.ready.wait(q).unwrap();
        }
    }
}

/// Runs a worker until the queue is closed or the loop is gone.
pub fn spawn(shared: Arc<Shared>, done: mpsc::Sender<Done>, lane: Lane) -> std::io::Result<()> {
    let name = match lane {
        Lane::General => "unwind-tables",
        Lane::Urgent => "unwind-urgent",
    };
    std::thread::Builder::new().name(name.into()).spawn(move || {
        while let Some((identity, job)) = shared.next(lane) {
            if done.send(compile(&shared, identity, job)).is_err() {
                return;
            }
            shared.done_notify.notify_one();
        }
    })?;
    Ok(())
}

fn compile(shared: &Shared, identity: FileIdentity, job: Job) -> Done {
    let started = Instant::now();
    let path = job.source();
    let layout = ElfLayout::read(&path).map(Arc::new);
    let mut disk = DiskUse::default();
    let cached = match shared.disk.as_ref().map(|d| d.load(&identity)) {
        Some(disk::Loaded::Hit(c)) => Some(c),
        Some(disk::Loaded::Rejected(why)) => {
            disk.rejected = Some(why);
            None
        }
        _ => None,
    };
    let (compiled, debug) = match cached {
        Some(c) => {
            disk.read = true;
            disk.debug_fdes = c.debug_fdes;
            (Ok(Rows::Read(c.rows)), DebugUse::NotNeeded)
        }
        None => {
            // Mapped, not read: a 150 MB library would otherwise be 150 MB more of our RSS.
            let compiled = File::open(&path)
                // SAFETY: a read-only private mapping of a file the process maps as code; a
                // file truncated meanwhile would fault (SIGBUS), as it would in the processes
                // using it.
                .and_then(|f| unsafe { memmap2::Mmap::map(&f) })
                .map_err(|e| e.to_string())
                .map(|data| with_debug_file(&data, &job.name, &shared.debug_root));
            match compiled {
                Ok((table, debug)) => (table.map(Rows::Compiled), debug),
                Err(e) => (Err(e), DebugUse::NotNeeded),
            }
        }
    };
    drop(job.hold);
    let compile = started.elapsed();
    let mut done = Done {
        identity,
        table: FileTable::NoCfi,
        layout,
        rows: 0,
        evicted: Vec::new(),
        compile,
        copy: Duration::ZERO,
        error: None,
        name: job.name,
        debug,
        disk,
    };
    let table = match compiled {
        Ok(t) if !t.rows().is_empty() && t.rows().len() < MAX_TABLE_ROWS => t,
        Ok(_) => {
            done.error = Some("no rows (or more than 2^24)".into());
            return done;
        }
        Err(e) => {
            done.error = Some(e);
            return done;
        }
    };
    // A small file's table compiles in well under a millisecond: caching it would save
    // nothing and fill the directory with one-off files (memfds, a build's fresh binaries).
    let worth_keeping = identity.3 >= disk::MIN_FILE_BYTES;
    if let (Rows::Compiled(t), Some(d), true) = (&table, &shared.disk, worth_keeping) {
        let fdes = t.stats().separate_debug_frame_fdes as u64;
        match d.store(&identity, t.rows(), fdes) {
            Ok(evicted) => (done.disk.stored, done.disk.evicted) = (true, evicted),
            Err(e) => done.disk.store_error = Some(e.to_string()),
        }
    }
    // The rows, then their page index (see `profiler_common::UNWIND_PAGE_SHIFT`).
    let rows = table.rows();
    let index = PageIndex::of(rows);
    let count = (rows.len() + index.entries.len()) as u32;
    done.rows = count;
    let Some((first, serial, evicted)) = shared.alloc(count) else {
        done.table = FileTable::Full;
        return done;
    };
    let started = Instant::now();
    // No process entry names the evicted rows (see `Shared::release`): overwriting is safe.
    done.evicted = evicted;
    let written = shared
        .rows
        .write(first, rows)
        .and_then(|()| shared.rows.write(first + rows.len() as u32, &index.entries));
    if let Err(e) = written {
        shared.tables.lock().unwrap().free.free(first, count);
        done.error = Some(format!("{e:#}"));
        return done;
    }
    done.copy = started.elapsed();
    done.table =
        FileTable::Loaded { first, count, rows: rows.len() as u32, page_base: index.base, serial };
    done
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{Alloc, EVICT_GRACE, Evicted, Job, Tables};

    #[test]
    fn job_reads_the_mapped_file_after_its_path_is_gone() {
        let dir = std::env::temp_dir().join(format!("rsprof-job-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("prog");
        std::fs::copy("/bin/true", &path).unwrap();
        let hold = std::sync::Arc::new(std::fs::File::open(&path).unwrap());
        let job = Job {
            path: path.clone(),
            hold: Some(hold),
            name: path.display().to_string(),
            weight: 0,
            wanted: 0,
            size: 0,
        };
        std::fs::remove_file(&path).unwrap();
        std::fs::remove_dir(&dir).unwrap();
        assert!(crate::collect::modules::ElfLayout::read(&job.path).is_none(), "path gone");
        let layout = crate::collect::modules::ElfLayout::read(&job.source());
        assert!(layout.is_some_and(|l| !l.code.is_empty()), "read through the held file");
        let data = std::fs::read(job.source()).unwrap();
        assert_eq!(data, std::fs::read("/bin/true").unwrap());
    }

    fn rows(a: Alloc) -> (u32, u64, Vec<u64>) {
        match a {
            Alloc::Rows { first, serial, evicted } => {
                (first, serial, evicted.iter().map(|e| e.serial).collect())
            }
            Alloc::Wait(d) => panic!("wait {d:?}"),
            Alloc::Full => panic!("full"),
        }
    }

    fn table(first: u32, count: u32, serial: u64) -> Evicted {
        Evicted { identity: (1, serial, 0, 0), serial, first, count }
    }

    #[test]
    fn evicts_least_recently_released_only_as_needed() {
        let t0 = Instant::now();
        let later = t0 + EVICT_GRACE * 2;
        let mut t = Tables::new(100);
        let (a, b, c) = (rows(t.alloc(40, t0)), rows(t.alloc(40, t0)), rows(t.alloc(20, t0)));
        assert_eq!((a.0, b.0, c.0), (0, 40, 80));
        assert!(matches!(t.alloc(1, t0), Alloc::Full), "nothing released");
        // b released before a: b goes first; a stays loaded.
        t.release(table(40, 40, b.1), t0);
        t.release(table(0, 40, a.1), t0);
        let d = rows(t.alloc(30, later));
        assert_eq!((d.0, d.2.clone()), (40, vec![b.1]));
        // 50 rows: a's 40 and the 10 after d are not adjacent, so no room: a is kept.
        assert!(matches!(t.alloc(50, later), Alloc::Full));
        assert!(t.claim(a.1), "a is still there to claim");
        assert!(!t.claim(b.1), "b was evicted");
        assert!(matches!(t.alloc(11, later), Alloc::Full), "a claimed back is not evictable");
    }

    #[test]
    fn evicted_neighbours_merge_for_a_larger_table() {
        let t0 = Instant::now();
        let mut t = Tables::new(90);
        let ids: Vec<_> = (0..3).map(|_| rows(t.alloc(30, t0))).collect();
        for (i, r) in ids.iter().enumerate() {
            t.release(table(r.0, 30, r.1), t0);
            assert_eq!(r.0, 30 * i as u32);
        }
        let big = rows(t.alloc(60, t0 + EVICT_GRACE));
        assert_eq!(big.0, 0);
        assert_eq!(big.2, vec![ids[0].1, ids[1].1], "two oldest, merged");
        assert!(t.claim(ids[2].1));
    }

    #[test]
    fn a_table_released_a_moment_ago_waits_out_the_grace() {
        let t0 = Instant::now();
        let mut t = Tables::new(10);
        let a = rows(t.alloc(10, t0));
        t.release(table(0, 10, a.1), t0);
        match t.alloc(10, t0 + Duration::from_millis(1)) {
            Alloc::Wait(d) => assert_eq!(d, EVICT_GRACE - Duration::from_millis(1)),
            _ => panic!("evicted inside the grace"),
        }
        // Claimed back during the wait: no room any more.
        assert!(t.claim(a.1));
        assert!(matches!(t.alloc(10, t0 + EVICT_GRACE), Alloc::Full));
    }
}
