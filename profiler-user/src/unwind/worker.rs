//! Table compilation off the event loop: worker threads take the most wanted file from a
//! shared queue, read its program headers, compile its CFI (`profiler-unwind`), copy the rows
//! into the mapped `UNWIND_ROWS` array and report back; the loop then publishes the process
//! entries that name the rows (so the walker never sees a table before its rows).

use std::{
    collections::HashMap,
    fs::File,
    path::PathBuf,
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicU32, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use profiler_unwind::UnwindTable;

use super::{FileIdentity, FileTable, debugfile, rows::RowsMmap};
use crate::collect::modules::ElfLayout;

/// The walker's binary search does at most 24 halvings.
const MAX_TABLE_ROWS: usize = 1 << 24;

/// One file to compile.
pub struct Job {
    pub path: PathBuf,
    /// Keeps `/proc/self/fd/N` paths valid until the worker has read the file.
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
pub(super) const URGENT_MAX_BYTES: u64 = 16 << 20;

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
    pub layout: Option<Arc<ElfLayout>>,
    pub rows: u32,
    pub compile: Duration,
    pub copy: Duration,
    /// Why the file has no table (`FileTable::NoCfi`).
    pub error: Option<String>,
    pub name: String,
    pub debug: DebugUse,
}

/// What a separate debug file did for a file.
#[derive(Debug, Default)]
pub enum DebugUse {
    /// The file's own CFI covers all its code (or it is not a readable ELF file).
    #[default]
    NotNeeded,
    /// Looked for, not found (with why candidates that exist were rejected).
    NotFound { rejected: Vec<String> },
    /// Found, but its `.debug_frame` is absent or adds nothing (e.g. libc's: its `.eh_frame`
    /// covers what it can).
    NoNewCfi,
    /// Its `.debug_frame` filled `fdes` functions of the table.
    Used { how: debugfile::How, fdes: usize },
    /// Found, but its `.debug_frame` does not compile.
    Failed(String),
}

#[derive(Default)]
struct Queue {
    jobs: HashMap<FileIdentity, Job>,
    /// Until the start-up files are all queued (so the first taken is the best ranked).
    paused: bool,
    closed: bool,
}

pub struct Shared {
    /// Where separate debug files are installed (`/usr/lib/debug`).
    debug_root: PathBuf,
    queue: Mutex<Queue>,
    ready: Condvar,
    rows: RowsMmap,
    next_row: AtomicU32,
}

impl Shared {
    pub fn new(rows: RowsMmap) -> Arc<Self> {
        Arc::new(Self {
            debug_root: debugfile::debug_root(),
            queue: Mutex::new(Queue { paused: true, ..Default::default() }),
            ready: Condvar::new(),
            rows,
            next_row: AtomicU32::new(0),
        })
    }

    pub fn push(&self, identity: FileIdentity, job: Job) {
        self.queue.lock().unwrap().jobs.insert(identity, job);
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
    pub fn close(&self) {
        let mut q = self.queue.lock().unwrap();
        q.closed = true;
        q.jobs.clear();
        drop(q);
        self.ready.notify_all();
    }

    /// Reserves `count` rows; None when the array has no room left.
    fn alloc(&self, count: u32) -> Option<u32> {
        let cap = self.rows.capacity();
        self.next_row
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                n.checked_add(count).filter(|&end| end <= cap)
            })
            .ok()
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
        }
    })?;
    Ok(())
}

fn compile(shared: &Shared, identity: FileIdentity, job: Job) -> Done {
    let started = Instant::now();
    let layout = ElfLayout::read(&job.path).map(Arc::new);
    // Mapped, not read: a 150 MB library would otherwise be 150 MB more of our RSS.
    let compiled = File::open(&job.path)
        // SAFETY: a read-only private mapping of a file the process maps as code; a file
        // truncated meanwhile would fault (SIGBUS), as it would in the processes using it.
        .and_then(|f| unsafe { memmap2::Mmap::map(&f) })
        .map_err(|e| e.to_string())
        .map(|data| with_debug_file(&data, &job.name, &shared.debug_root));
    let (compiled, debug) = match compiled {
        Ok((table, debug)) => (table, debug),
        Err(e) => (Err(e), DebugUse::NotNeeded),
    };
    drop(job.hold);
    let compile = started.elapsed();
    let mut done = Done {
        identity,
        table: FileTable::NoCfi,
        layout,
        rows: 0,
        compile,
        copy: Duration::ZERO,
        error: None,
        name: job.name,
        debug,
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
    let rows = table.rows();
    let count = rows.len() as u32;
    done.rows = count;
    let Some(first) = shared.alloc(count) else {
        done.table = FileTable::Full;
        return done;
    };
    let started = Instant::now();
    shared.rows.write(first, rows);
    done.copy = started.elapsed();
    done.table = FileTable::Loaded { first, count };
    done
}

/// Compiles a file's own CFI and, when that leaves some of its code undescribed, adds the
/// `.debug_frame` of its separate debug file if one is installed.
pub(super) fn with_debug_file(
    data: &[u8],
    mapped_path: &str,
    root: &std::path::Path,
) -> (Result<UnwindTable, String>, DebugUse) {
    let own = UnwindTable::from_elf(data);
    let lacks_cfi = match &own {
        Ok(t) => t.stats().code_bytes_without_cfi > 0,
        Err(profiler_unwind::Error::NoCfi) => true,
        Err(_) => false,
    };
    let own = own.map_err(|e| e.to_string());
    let Some(links) = lacks_cfi.then(|| profiler_unwind::debug_links(data).ok()).flatten() else {
        return (own, DebugUse::NotNeeded);
    };
    let lookup = debugfile::find(root, mapped_path, &links);
    let Some(found) = lookup.found else {
        return (own, DebugUse::NotFound { rejected: lookup.rejected });
    };
    let Some(frame) = found.debug_frame else {
        return (own, DebugUse::NoNewCfi);
    };
    match UnwindTable::from_elf_with_debug_frame(data, Some(&frame)) {
        Ok(t) if t.stats().separate_debug_frame_fdes > 0 => {
            let fdes = t.stats().separate_debug_frame_fdes;
            (Ok(t), DebugUse::Used { how: found.how, fdes })
        }
        Ok(_) => (own, DebugUse::NoNewCfi),
        Err(e) => (own, DebugUse::Failed(format!("{}: {e}", found.path.display()))),
    }
}
