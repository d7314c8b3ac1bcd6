//! What the collector reads of processes outside the kernel's records — the name, command
//! line, executable and /proc/PID/maps of a process that existed before the recording, and
//! the vDSO's size — behind one trait: /proc when recording ([`LiveProc`]), /proc with a
//! copy into the raw stream with `--save-raw` ([`TeeProc`]), the stream when replaying
//! ([`ReplayProc`]).

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
};

use crate::{
    collect::raw::{self, Entry, MapsRead, RawWriter},
    model::ids::Pid,
    system::procfs::{self, ProcError},
};

/// A raw stream shared by the event loop (ring records) and the collector (facts).
pub type SharedRaw = Arc<Mutex<RawWriter>>;

pub trait ProcFacts: Send {
    /// `comm`, argv and executable path; empty values for what cannot be read.
    fn identity(&mut self, pid: Pid) -> (String, Vec<String>, Option<String>);
    /// The text of /proc/PID/maps.
    fn maps(&mut self, pid: Pid) -> Result<String, ProcError>;
    /// The vDSO image's size (the same in every process).
    fn vdso_len(&mut self) -> Option<u64>;
    /// Whether the processes are the live ones: other reads by pid (perf maps, jitdumps,
    /// CPython's memory, /proc/PID/cgroup) are made only then — after the recording, a pid
    /// may name another process.
    fn live(&self) -> bool;
}

/// The processes' /proc, now.
#[derive(Clone, Copy, Debug, Default)]
pub struct LiveProc;

impl ProcFacts for LiveProc {
    fn identity(&mut self, pid: Pid) -> (String, Vec<String>, Option<String>) {
        let (comm, argv) = procfs::read_identity(pid);
        (comm, argv, procfs::read_exe(pid))
    }

    fn maps(&mut self, pid: Pid) -> Result<String, ProcError> {
        procfs::read_maps_text(pid)
    }

    fn vdso_len(&mut self) -> Option<u64> {
        static LEN: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
        *LEN.get_or_init(|| procfs::self_vdso().map(|l| l.end - l.start))
    }

    fn live(&self) -> bool {
        true
    }
}

/// /proc, each answer also written to the raw stream (before the record that needed it, so
/// a replay has it at hand).
pub struct TeeProc {
    pub raw: SharedRaw,
}

impl TeeProc {
    fn put(&self, e: &Entry) {
        self.raw.lock().unwrap_or_else(|e| e.into_inner()).write(e);
    }
}

impl ProcFacts for TeeProc {
    fn identity(&mut self, pid: Pid) -> (String, Vec<String>, Option<String>) {
        let (comm, argv, exe) = LiveProc.identity(pid);
        let fact = raw::Identity { pid: pid.0, comm, argv, exe };
        self.put(&Entry::Identity(fact.clone()));
        (fact.comm, fact.argv, fact.exe)
    }

    fn maps(&mut self, pid: Pid) -> Result<String, ProcError> {
        let r = LiveProc.maps(pid);
        let read = match &r {
            Ok(text) => MapsRead::Text(text.clone()),
            Err(ProcError::Gone) => MapsRead::Gone,
            Err(ProcError::Io(e)) => MapsRead::Failed(e.to_string()),
        };
        self.put(&Entry::Maps(raw::Maps { pid: pid.0, read }));
        r
    }

    fn vdso_len(&mut self) -> Option<u64> {
        // In the stream's start entry.
        LiveProc.vdso_len()
    }

    fn live(&self) -> bool {
        true
    }
}

/// The facts a raw stream holds, given to the collector in the order they were read. A
/// clone shares them: the replay adds what it reads while the collector holds one.
#[derive(Clone, Debug, Default)]
pub struct ReplayProc(Arc<Mutex<Recorded>>);

#[derive(Debug, Default)]
struct Recorded {
    identities: HashMap<Pid, VecDeque<raw::Identity>>,
    maps: HashMap<Pid, VecDeque<MapsRead>>,
    vdso_len: Option<u64>,
    /// Reads the stream had no answer for (a stream not written by a recording).
    missing: u64,
}

impl ReplayProc {
    fn lock(&self) -> std::sync::MutexGuard<'_, Recorded> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps a fact for the collector's read to come (other entries are not facts).
    pub fn add(&self, e: Entry) {
        let mut r = self.lock();
        match e {
            Entry::Identity(i) => r.identities.entry(Pid(i.pid)).or_default().push_back(i),
            Entry::Maps(m) => r.maps.entry(Pid(m.pid)).or_default().push_back(m.read),
            _ => {}
        }
    }

    pub fn set_vdso_len(&self, len: Option<u64>) {
        self.lock().vdso_len = len;
    }

    /// Reads the stream did not answer.
    pub fn missing(&self) -> u64 {
        self.lock().missing
    }
}

impl ProcFacts for ReplayProc {
    fn identity(&mut self, pid: Pid) -> (String, Vec<String>, Option<String>) {
        let mut r = self.lock();
        match r.identities.get_mut(&pid).and_then(VecDeque::pop_front) {
            Some(i) => (i.comm, i.argv, i.exe),
            None => {
                r.missing += 1;
                Default::default()
            }
        }
    }

    fn maps(&mut self, pid: Pid) -> Result<String, ProcError> {
        let mut r = self.lock();
        match r.maps.get_mut(&pid).and_then(VecDeque::pop_front) {
            Some(MapsRead::Text(t)) => Ok(t),
            Some(MapsRead::Gone) => Err(ProcError::Gone),
            Some(MapsRead::Failed(e)) => Err(ProcError::Io(std::io::Error::other(e))),
            None => {
                r.missing += 1;
                Err(ProcError::Gone)
            }
        }
    }

    fn vdso_len(&mut self) -> Option<u64> {
        self.lock().vdso_len
    }

    fn live(&self) -> bool {
        false
    }
}
