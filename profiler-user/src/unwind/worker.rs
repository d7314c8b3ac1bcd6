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

use super::{FileIdentity, FileTable, rows::RowsMmap};
use crate::collect::modules::ElfLayout;

/// The walker's binary search does at most 24 halvings.
const MAX_TABLE_ROWS: usize = 1 << 24;

/// One file to compile.
pub struct Job {
    pub path: PathBuf,
    /// Keeps `/proc/self/fd/N` paths valid until the worker has read the file.
    pub hold: Option<Arc<File>>,
    pub name: String,
    /// Processes mapping the file plus samples that ended in it: most wanted first.
    pub weight: u64,
    /// Queue order among equal weights.
    pub seq: u64,
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
}

#[derive(Default)]
struct Queue {
    jobs: HashMap<FileIdentity, Job>,
    closed: bool,
}

pub struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
    rows: RowsMmap,
    next_row: AtomicU32,
}

impl Shared {
    pub fn new(rows: RowsMmap) -> Arc<Self> {
        Arc::new(Self {
            queue: Mutex::default(),
            ready: Condvar::new(),
            rows,
            next_row: AtomicU32::new(0),
        })
    }

    pub fn capacity(&self) -> u32 {
        self.rows.capacity()
    }

    pub fn push(&self, identity: FileIdentity, job: Job) {
        self.queue.lock().unwrap().jobs.insert(identity, job);
        self.ready.notify_one();
    }

    /// Raises a queued file's priority; false when it is no longer queued (being compiled).
    pub fn bump(&self, identity: &FileIdentity, by: u64) -> bool {
        match self.queue.lock().unwrap().jobs.get_mut(identity) {
            Some(j) => {
                j.weight += by;
                true
            }
            None => false,
        }
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

    fn next(&self) -> Option<(FileIdentity, Job)> {
        let mut q = self.queue.lock().unwrap();
        loop {
            if q.closed {
                return None;
            }
            let best = q.jobs.iter().max_by_key(|(_, j)| (j.weight, std::cmp::Reverse(j.seq)));
            if let Some((&id, _)) = best {
                let job = q.jobs.remove(&id).expect("just found");
                return Some((id, job));
            }
            q = self.ready.wait(q).unwrap();
        }
    }
}

/// Runs a worker until the queue is closed or the loop is gone.
pub fn spawn(shared: Arc<Shared>, done: mpsc::Sender<Done>, n: usize) -> std::io::Result<()> {
    std::thread::Builder::new().name(format!("unwind-tables-{n}")).spawn(move || {
        while let Some((identity, job)) = shared.next() {
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
    let compiled = std::fs::read(&job.path)
        .map_err(|e| e.to_string())
        .and_then(|data| UnwindTable::from_elf(&data).map_err(|e| e.to_string()));
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
