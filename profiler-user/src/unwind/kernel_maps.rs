//! Where the unwind loader's writes go: the `UNWIND_ROWS` array (rows, from the compile
//! threads), the `UNWIND_PROCS` hash (each process's mapping table, from the event loop) and
//! the `UNWIND_FILES` hash (loaded files, from the event loop).
//! The BPF maps in a recording; in tests, [`Recorded`], which keeps what was written so the
//! loader's decisions can be checked without root.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use anyhow::{Result, bail};
use aya::maps::{HashMap as BpfHashMap, MapData};
use profiler_common::{FileKey, UnwindFile, UnwindProcess, UnwindRow};

use super::rows::RowsMmap;

/// The rows array, shared by the compile threads (each writes the ranges its allocator gave).
pub trait RowSink: Send + Sync {
    fn capacity(&self) -> u32;
    /// Copies `rows` to `first..` (a range no process entry names yet).
    fn write(&self, first: u32, rows: &[UnwindRow]) -> Result<()>;
}

/// The per-process walker entries, and the loaded files the kernel may give a new mapping of
/// at once (`UnwindFile`).
pub trait ProcessSink: Send {
    fn insert(&mut self, pid: u32, entry: &UnwindProcess) -> Result<()>;
    fn remove(&mut self, pid: u32);
    fn insert_file(&mut self, key: FileKey, file: &UnwindFile) -> Result<()>;
    fn remove_file(&mut self, key: FileKey);
}

/// `UNWIND_PROCS` and `UNWIND_FILES`.
pub struct WalkerEntries {
    pub procs: BpfHashMap<MapData, u32, UnwindProcess>,
    pub files: BpfHashMap<MapData, FileKey, UnwindFile>,
}

impl RowSink for RowsMmap {
    fn capacity(&self) -> u32 {
        RowsMmap::capacity(self)
    }

    fn write(&self, first: u32, rows: &[UnwindRow]) -> Result<()> {
        RowsMmap::write(self, first, rows)
    }
}

impl ProcessSink for WalkerEntries {
    fn insert(&mut self, pid: u32, entry: &UnwindProcess) -> Result<()> {
        Ok(self.procs.insert(pid, entry, 0)?)
    }

    fn remove(&mut self, pid: u32) {
        // Gone already when the kernel deleted it at the exit.
        let _ = self.procs.remove(&pid);
    }

    fn insert_file(&mut self, key: FileKey, file: &UnwindFile) -> Result<()> {
        Ok(self.files.insert(key, file, 0)?)
    }

    fn remove_file(&mut self, key: FileKey) {
        let _ = self.files.remove(&key);
    }
}

/// A process entry written (pid, its mappings) or removed (pid, None).
pub type EntryWrite = (u32, Option<u32>);

/// Rows and entries kept in memory: what the kernel's maps would hold.
#[derive(Clone)]
pub struct Recorded {
    pub rows: Arc<Mutex<Vec<UnwindRow>>>,
    pub procs: Arc<Mutex<HashMap<u32, UnwindProcess>>>,
    pub files: Arc<Mutex<HashMap<FileKey, UnwindFile>>>,
    /// Every insert and removal, in order.
    pub log: Arc<Mutex<Vec<EntryWrite>>>,
}

impl Recorded {
    pub fn new(capacity: u32) -> Self {
        Self {
            rows: Arc::new(Mutex::new(vec![UnwindRow::default(); capacity as usize])),
            procs: Default::default(),
            files: Default::default(),
            log: Default::default(),
        }
    }
}

impl RowSink for Recorded {
    fn capacity(&self) -> u32 {
        self.rows.lock().unwrap().len() as u32
    }

    fn write(&self, first: u32, rows: &[UnwindRow]) -> Result<()> {
        let mut all = self.rows.lock().unwrap();
        let end = first as usize + rows.len();
        if end > all.len() {
            bail!("rows {first}..{end} beyond {}", all.len());
        }
        all[first as usize..end].copy_from_slice(rows);
        Ok(())
    }
}

impl ProcessSink for Recorded {
    fn insert(&mut self, pid: u32, entry: &UnwindProcess) -> Result<()> {
        self.procs.lock().unwrap().insert(pid, *entry);
        self.log.lock().unwrap().push((pid, Some(entry.count)));
        Ok(())
    }

    fn remove(&mut self, pid: u32) {
        self.procs.lock().unwrap().remove(&pid);
        self.log.lock().unwrap().push((pid, None));
    }

    fn insert_file(&mut self, key: FileKey, file: &UnwindFile) -> Result<()> {
        self.files.lock().unwrap().insert(key, *file);
        Ok(())
    }

    fn remove_file(&mut self, key: FileKey) {
        self.files.lock().unwrap().remove(&key);
    }
}

#[cfg(test)]
mod tests {
    use std::{
        process::{Command, Stdio},
        time::{Duration, Instant},
    };

    use profiler_common::{UNWIND_MAPPING_ANON, UNWIND_MAPPING_NO_CFI, UNWIND_MAPPING_NOT_LOADED};

    use super::*;
    use crate::{
        collect::collector::Collector, model::ids::Pid, store::ChunkedStore, unwind::UnwindLoader,
    };

    /// Waits for `cond`, failing after `limit`.
    fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
        let end = Instant::now() + limit;
        while !cond() {
            assert!(Instant::now() < end, "{what}: not within {limit:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The loader, driven as the event loop drives it, over a real process (`sleep`, with
    /// libc and the dynamic loader): the entry it writes for that process names every
    /// executable mapping in address order, each file's rows land where the entry says,
    /// sorted, before the entry names them, and the entry goes when the process does.
    #[test]
    fn the_loader_writes_a_process_entry_naming_its_rows() {
        let mut child = Command::new("sleep").arg("60").stdout(Stdio::null()).spawn().unwrap();
        let pid = Pid(child.id());
        // Until the exec, /proc shows this test's image; and /proc/PID/exe names `sleep` before
        // the kernel has mapped it: wait for the dynamic loader to have mapped libc's code.
        wait_until("sleep exec'd and libc mapped", Duration::from_secs(10), || {
            std::fs::read_link(format!("/proc/{pid}/exe"))
                .is_ok_and(|p| p.file_name().is_some_and(|n| n == "sleep"))
                && std::fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|m| {
                    m.lines().any(|l| l.contains(" r-xp ") && l.contains("/libc.so"))
                })
        });
        let fake = Recorded::new(4 << 20);
        let mut loader =
            UnwindLoader::with_maps(Box::new(fake.clone()), Box::new(fake.clone())).unwrap();
        let mut c = Collector::new(ChunkedStore::new(1 << 20));
        c.register_existing(pid);
        c.initial_scan_done();
        loader.after_drain(&mut c);
        loader.mark_startup();
        let published = |fake: &Recorded| fake.procs.lock().unwrap().get(&pid.0).copied();
        // The entry is written at once (files pending marked not loaded), then again as
        // tables land.
        assert!(published(&fake).is_some(), "written before its tables landed");
        wait_until("tables landed", Duration::from_secs(120), || {
            loader.after_drain(&mut c);
            !loader.has_waiting()
        });
        let entry = published(&fake).expect("entry");
        let space = &c.processes.get(pid).expect("known").space;
        let n = entry.count as usize;
        assert_eq!(n, space.len(), "one entry mapping per executable mapping");
        let rows = fake.rows.lock().unwrap();
        let mut with_rows = 0;
        for (m, held) in entry.mappings[..n].iter().zip(space.mappings()) {
            assert_eq!((m.start, m.end), (held.start, held.end), "in address order");
            if m.flags & (UNWIND_MAPPING_ANON | UNWIND_MAPPING_NO_CFI) != 0 {
                continue;
            }
            assert_eq!(m.flags & UNWIND_MAPPING_NOT_LOADED, 0, "{m:?} landed");
            let table = &rows[m.first as usize..(m.first + m.count) as usize];
            assert!(table.len() > 16, "{m:?}: a real table");
            assert!(table.iter().any(|r| r.pc != 0), "{m:?}: rows were written");
            assert!(table.windows(2).all(|w| w[0].pc <= w[1].pc), "{m:?}: rows sorted by pc");
            with_rows += 1;
        }
        assert!(with_rows >= 2, "sleep and libc at least: {with_rows}");
        assert!(loader.stats.tables_loaded >= 2);
        drop(rows);
        child.kill().unwrap();
        child.wait().unwrap();
        loader.remove(pid);
        assert!(published(&fake).is_none());
        let log = fake.log.lock().unwrap();
        assert_eq!(log.last(), Some(&(pid.0, None)), "removed last: {log:?}");
        assert!(log.iter().filter(|(p, n)| *p == pid.0 && n.is_some()).count() >= 2, "{log:?}");
    }
}
