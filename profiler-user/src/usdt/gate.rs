//! The exec gate: probes of a program first run during the recording attached before it runs.
//!
//! Reacting to the kernel's exec record races the dynamic loader: by the time userspace has
//! drained the record, scanned the file and attached, `main` has often run (the issue measured
//! 19 of 20 first markers lost). Instead, a fanotify group with `FAN_OPEN_EXEC_PERM` marks on
//! every mounted filesystem makes the kernel wait, inside execve(2) when it opens the file to
//! execute (the program, and its ELF interpreter), for this thread's answer. The thread scans
//! the file once per identity (dev, inode), attaches its probes (per file: they then cover the
//! process about to run, semaphores included) and answers "allow"; it never denies. A file
//! already scanned gets an ignore mark, so its later execs do not wait at all.
//!
//! Two threads, so that nothing can hold an exec longer than [`HOLD_DEADLINE`]:
//! - the answerer (`usdt-exec-gate`) only reads the group's events, hands them to the scanner
//!   and answers "allow" for any still unanswered at its deadline. It takes no lock the scanner
//!   or the drain loop holds, reads no file and allocates nothing per event beyond a queue slot,
//!   so a slow scan, a stuck attach or a drain loop waiting on memory cannot delay it;
//! - the scanner (`usdt-exec-scan`) scans, attaches, answers if the deadline has not, and
//!   places the ignore mark. Whoever answers first answers; the other does nothing.
//!
//! Trade-offs, reported in the summary (`exec gate:` line) and the agent's metrics:
//! - The first exec of each new file waits for the scan and the uprobe attaches, at most
//!   [`HOLD_DEADLINE`] (the summary reports the holds' average and longest time). A hold that
//!   reached it is counted as `expired`: that program may run before its probes are attached,
//!   and its first hits can be lost. No signal is sent and the process is never stopped: its
//!   parent, job control and ptrace see an ordinary, slower execve.
//! - If rsprof-bpf dies, the kernel closes the group and lets every waiting exec proceed. If it
//!   is frozen (SIGSTOP, a debugger), both threads are, and the deadline does not apply: first
//!   execs of new files wait until it resumes. The agent therefore runs without the gate unless
//!   asked (`--usdt-exec-gate`).
//! - Covered: files on filesystems mounted when the recording starts, in our mount namespace
//!   (containers on other superblocks, e.g. overlayfs roots, are not). Libraries are not
//!   exec-opened: one first loaded by a process started during the recording is attached when
//!   its mapping record is drained, and counted as attached late.
//! - Each ignore mark pins its inode in kernel memory: at most `MAX_IGNORE_MARKS`; files beyond
//!   that are answered from the scan cache on every exec.
//!
//! Test hook (hidden): `RSPROF_TEST_SLOW_SCAN=NAME:MS` makes the scan of files named NAME
//! (the last path component) take MS milliseconds longer, inside the attacher's lock as a
//! slow real scan would.

use std::{
    collections::VecDeque,
    ffi::CString,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
        unix::ffi::OsStrExt as _,
    },
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
        mpsc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use super::attach::{Attacher, lock_attacher};

/// Longest an exec is held. Measured on this project's 2-CPU VM (`record --all`, the summary's
/// `exec gate:` line): 259 holds (fresh copies of cargo (42 MB), python3.11, rsprof-bpf and
/// coreutils, and the other builds running) averaged 0.64 ms, the longest 9.3 ms; issue 38
/// measured 1.2 ms on average and 20.4 ms at most. 50 ms covers them with room for a busy
/// scheduler, and stays under the ~100 ms at which a pause starts to be noticed: a build or
/// test run that execs a few hundred new binaries loses at most seconds, not minutes,
/// even if every scan were slow. It bounds each exec open: a dynamically linked program's
/// execve opens two files (it and its ELF interpreter), so it can wait twice this while a scan
/// is stuck.
pub const HOLD_DEADLINE: Duration = Duration::from_millis(50);

/// Ignore marks placed at most (each pins an inode).
const MAX_IGNORE_MARKS: u64 = 4096;

/// Holds waiting for the scanner; beyond this (a scanner stuck for good) new execs are let go
/// at once, so open event descriptors stay bounded.
const MAX_QUEUED: u64 = 256;
/// Filesystems nothing is executed from.
const PSEUDO_FS: &[&str] = &[
    "proc",
    "sysfs",
    "cgroup",
    "cgroup2",
    "devpts",
    "securityfs",
    "debugfs",
    "tracefs",
    "bpf",
    "mqueue",
    "pstore",
    "configfs",
    "fusectl",
    "binfmt_misc",
    "autofs",
    "efivarfs",
    "rpc_pipefs",
    "nsfs",
];

#[derive(Clone, Copy, Debug, Default)]
pub struct GateStats {
    /// Filesystems watched, and those the kernel refused to mark.
    pub filesystems: u32,
    pub filesystems_failed: u32,
    /// Exec opens answered.
    pub execs: u64,
    /// Of those, execs held while their file was scanned (first exec of a file not known yet),
    /// or until the deadline.
    pub held: u64,
    /// Of the held, those answered at [`HOLD_DEADLINE`] before their scan was done: the
    /// program may have run before its probes were attached (a possibly late attach).
    pub expired: u64,
    /// Time from reading a held exec's event to answering it.
    pub hold_ns_total: u64,
    pub hold_ns_max: u64,
    /// Files whose later execs skip the gate.
    pub ignore_marks: u64,
    /// Events or answers that failed (an exec is never left waiting: the kernel lets it go
    /// when the group closes at the latest).
    pub errors: u64,
}

/// [`GateStats`] as both threads update it, readable at any time without the attacher's lock.
#[derive(Default)]
struct Counters {
    filesystems: u32,
    filesystems_failed: u32,
    execs: AtomicU64,
    held: AtomicU64,
    expired: AtomicU64,
    hold_ns_total: AtomicU64,
    hold_ns_max: AtomicU64,
    ignore_marks: AtomicU64,
    errors: AtomicU64,
    /// Holds handed to the scanner and not taken up by it yet.
    queued: AtomicU64,
}

impl Counters {
    fn held(&self, waited: Duration) {
        let ns = waited.as_nanos() as u64;
        self.held.fetch_add(1, Relaxed);
        self.hold_ns_total.fetch_add(ns, Relaxed);
        self.hold_ns_max.fetch_max(ns, Relaxed);
    }

    fn snapshot(&self) -> GateStats {
        GateStats {
            filesystems: self.filesystems,
            filesystems_failed: self.filesystems_failed,
            execs: self.execs.load(Relaxed),
            held: self.held.load(Relaxed),
            expired: self.expired.load(Relaxed),
            hold_ns_total: self.hold_ns_total.load(Relaxed),
            hold_ns_max: self.hold_ns_max.load(Relaxed),
            ignore_marks: self.ignore_marks.load(Relaxed),
            errors: self.errors.load(Relaxed),
        }
    }
}

/// One exec waiting in the kernel for our answer.
struct Hold {
    /// The event's descriptor: the answer names it, so it stays open (its number not reused)
    /// until both threads are done with the hold.
    file: OwnedFd,
    read_at: Instant,
    /// Taken to answer: the first to find it false answers and sets it.
    answered: Mutex<bool>,
}

impl Hold {
    /// Answers "allow" unless already answered; returns how long the exec waited if this call
    /// answered it.
    fn allow(&self, fan: RawFd) -> Option<Duration> {
        let mut answered = self.answered.lock().unwrap_or_else(|e| e.into_inner());
        if *answered {
            return None;
        }
        *answered = true;
        let r = libc::fanotify_response { fd: self.file.as_raw_fd(), response: libc::FAN_ALLOW };
        // SAFETY: writes the response struct to the fanotify fd.
        unsafe { libc::write(fan, (&raw const r).cast(), size_of::<libc::fanotify_response>()) };
        Some(self.read_at.elapsed())
    }
}

pub struct ExecGate {
    stop: OwnedFd,
    stopping: Arc<AtomicBool>,
    answerer: JoinHandle<()>,
    scanner: JoinHandle<()>,
    counters: Arc<Counters>,
}

fn last_error(what: &str) -> anyhow::Error {
    anyhow::Error::new(std::io::Error::last_os_error()).context(what.to_owned())
}

impl ExecGate {
    /// Watches every mounted filesystem and starts answering execs.
    pub fn start(shared: Arc<Mutex<Attacher>>) -> Result<Self> {
        use libc::{
            FAN_CLASS_CONTENT, FAN_CLOEXEC, FAN_MARK_ADD, FAN_MARK_FILESYSTEM, FAN_NONBLOCK,
            FAN_OPEN_EXEC_PERM, O_CLOEXEC, O_LARGEFILE, O_RDONLY,
        };
        // SAFETY: plain syscall; the descriptor is owned right after.
        let fan = unsafe {
            libc::fanotify_init(
                FAN_CLASS_CONTENT | FAN_CLOEXEC | FAN_NONBLOCK,
                (O_RDONLY | O_CLOEXEC | O_LARGEFILE) as u32,
            )
        };
        if fan < 0 {
            return Err(last_error("fanotify_init"));
        }
        // SAFETY: fresh descriptor.
        let fan = Arc::new(unsafe { OwnedFd::from_raw_fd(fan) });
        let (mut ok, mut failed) = (0, 0);
        for mount in filesystems()? {
            let path = CString::new(mount.as_os_str().as_bytes())?;
            // SAFETY: valid fd and C string.
            let r = unsafe {
                libc::fanotify_mark(
                    fan.as_raw_fd(),
                    FAN_MARK_ADD | FAN_MARK_FILESYSTEM,
                    FAN_OPEN_EXEC_PERM,
                    libc::AT_FDCWD,
                    path.as_ptr(),
                )
            };
            if r == 0 { ok += 1 } else { failed += 1 }
        }
        if ok == 0 {
            bail!("no filesystem could be watched for execs ({failed} refused)");
        }
        let counters = Arc::new(Counters {
            filesystems: ok,
            filesystems_failed: failed,
            ..Default::default()
        });
        // SAFETY: plain syscall.
        let stop = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if stop < 0 {
            return Err(last_error("eventfd"));
        }
        // SAFETY: fresh descriptor.
        let stop = unsafe { OwnedFd::from_raw_fd(stop) };
        let stop_rx = stop.try_clone()?;
        let stopping = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let scanner = Scanner {
            fan: fan.clone(),
            shared,
            counters: counters.clone(),
            stopping: stopping.clone(),
            slow: slow_scan_hook(),
        };
        let scanner =
            std::thread::Builder::new().name("usdt-exec-scan".into()).spawn(move || {
                for hold in rx {
                    scanner.handle(hold);
                }
            })?;
        let c = counters.clone();
        let answerer = std::thread::Builder::new()
            .name("usdt-exec-gate".into())
            .spawn(move || answer(&fan, stop_rx, tx, &c))?;
        Ok(Self { stop, stopping, answerer, scanner, counters })
    }

    /// The counters so far.
    pub fn stats(&self) -> GateStats {
        self.counters.snapshot()
    }

    /// Stops answering; execs still held are let go, and closing the group lets any exec
    /// still waiting in the kernel proceed. Returns the final counters.
    pub fn stop(self) -> GateStats {
        self.stopping.store(true, Relaxed);
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), (&raw const one).cast(), 8) };
        let _ = self.answerer.join();
        let _ = self.scanner.join();
        self.counters.snapshot()
    }
}

/// Mount points of the distinct filesystems of our mount namespace that programs can be
/// executed from.
fn filesystems() -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").context("read mountinfo")?;
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for line in text.lines() {
        // id parent major:minor root mountpoint options [optional…] - fstype source super
        let Some((left, right)) = line.split_once(" - ") else { continue };
        let f: Vec<&str> = left.split(' ').collect();
        let (Some(dev), Some(mount)) = (f.get(2), f.get(4)) else { continue };
        let fstype = right.split(' ').next().unwrap_or("");
        if PSEUDO_FS.contains(&fstype) || !seen.insert(dev.to_string()) {
            continue;
        }
        out.push(PathBuf::from(unescape(mount)));
    }
    Ok(out)
}

/// mountinfo writes space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let digits = b.get(i + 1..i + 4).filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        if b[i] == b'\\'
            && let Some(d) = digits
        {
            let v = d.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'));
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The answerer's loop: reads events, hands them to the scanner, and answers those still
/// waiting at their deadline. Holds are queued in arrival order, so their deadlines are in
/// order too.
fn answer(fan: &OwnedFd, stop: OwnedFd, scanner: mpsc::Sender<Arc<Hold>>, c: &Counters) {
    let mut buf = vec![0u64; 4096 / 8];
    let mut waiting: VecDeque<Arc<Hold>> = VecDeque::with_capacity(64);
    loop {
        // Expired or answered holds leave the front; the next deadline bounds the wait.
        let now = Instant::now();
        while let Some(h) = waiting.front() {
            let due = h.read_at + HOLD_DEADLINE;
            if due > now && !*h.answered.lock().unwrap_or_else(|e| e.into_inner()) {
                break;
            }
            if let Some(waited) = h.allow(fan.as_raw_fd()) {
                c.execs.fetch_add(1, Relaxed);
                c.expired.fetch_add(1, Relaxed);
                c.held(waited);
            }
            waiting.pop_front();
        }
        let timeout = waiting.front().map(|h| {
            let left = (h.read_at + HOLD_DEADLINE).saturating_duration_since(now);
            libc::timespec {
                tv_sec: left.as_secs() as libc::time_t,
                tv_nsec: left.subsec_nanos() as libc::c_long,
            }
        });
        let mut fds = [
            libc::pollfd { fd: fan.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        let ts = timeout.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: two valid pollfds; `ts` null or a live timespec.
        if unsafe { libc::ppoll(fds.as_mut_ptr(), 2, ts, std::ptr::null()) } <= 0 {
            continue; // the deadline, or EINTR
        }
        if fds[1].revents != 0 {
            for h in waiting {
                if h.allow(fan.as_raw_fd()).is_some() {
                    c.execs.fetch_add(1, Relaxed);
                }
            }
            return; // the scanner ends with the channel
        }
        // SAFETY: reads into our buffer of that size.
        let n = unsafe { libc::read(fan.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len() * 8) };
        if n <= 0 {
            continue; // EAGAIN or EINTR
        }
        let read_at = Instant::now();
        let bytes =
            // SAFETY: the kernel wrote n bytes into buf.
            unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), n as usize) };
        let mut off = 0;
        let meta_len = size_of::<libc::fanotify_event_metadata>();
        while off + meta_len <= bytes.len() {
            // SAFETY: in bounds; read_unaligned copes with any alignment.
            let ev: libc::fanotify_event_metadata =
                unsafe { std::ptr::read_unaligned(bytes[off..].as_ptr().cast()) };
            if (ev.event_len as usize) < meta_len {
                break;
            }
            off += ev.event_len as usize;
            if ev.fd < 0 {
                continue;
            }
            let hold = Arc::new(Hold {
                // SAFETY: the event's descriptor is ours to close (once both threads are done).
                file: unsafe { OwnedFd::from_raw_fd(ev.fd) },
                read_at,
                answered: Mutex::new(false),
            });
            // Counted before the send: the scanner takes it off as soon as it receives it.
            let behind = c.queued.fetch_add(1, Relaxed) >= MAX_QUEUED;
            if behind || scanner.send(hold.clone()).is_err() {
                // A scanner this far behind (or gone) is not waited for.
                c.queued.fetch_sub(1, Relaxed);
                if hold.allow(fan.as_raw_fd()).is_some() {
                    c.execs.fetch_add(1, Relaxed);
                }
                c.errors.fetch_add(1, Relaxed);
                continue;
            }
            waiting.push_back(hold);
        }
    }
}

/// `RSPROF_TEST_SLOW_SCAN=NAME:MS` (see the module doc).
fn slow_scan_hook() -> Option<(String, Duration)> {
    let v = std::env::var("RSPROF_TEST_SLOW_SCAN").ok()?;
    let (name, ms) = v.rsplit_once(':')?;
    Some((name.to_owned(), Duration::from_millis(ms.parse().ok()?)))
}

struct Scanner {
    fan: Arc<OwnedFd>,
    shared: Arc<Mutex<Attacher>>,
    counters: Arc<Counters>,
    stopping: Arc<AtomicBool>,
    slow: Option<(String, Duration)>,
}

impl Scanner {
    fn handle(&self, hold: Arc<Hold>) {
        let c = &*self.counters;
        c.queued.fetch_sub(1, Relaxed);
        let fan = self.fan.as_raw_fd();
        if self.stopping.load(Relaxed) {
            return; // the answerer let it go
        }
        let fd = hold.file.as_raw_fd();
        // SAFETY: fstat into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            if hold.allow(fan).is_some() {
                c.execs.fetch_add(1, Relaxed);
            }
            c.errors.fetch_add(1, Relaxed);
            return;
        }
        let key = (st.st_dev, st.st_ino);
        let open = PathBuf::from(format!("/proc/self/fd/{fd}"));
        let mut a = lock_attacher(&self.shared);
        let scanned = !a.known(key) && {
            let display = std::fs::read_link(&open)
                .map(|p| p.display().to_string())
                .unwrap_or_else(|_| open.display().to_string());
            if let Some((name, extra)) = &self.slow
                && display.rsplit('/').next() == Some(name.as_str())
            {
                std::thread::sleep(*extra);
            }
            a.scan_exec(key, &open, &display)
        };
        let mark = a.known(key) && c.ignore_marks.load(Relaxed) < MAX_IGNORE_MARKS;
        drop(a);
        if let Some(waited) = hold.allow(fan) {
            c.execs.fetch_add(1, Relaxed);
            if scanned {
                c.held(waited);
            }
        }
        if mark {
            if ignore(fan, &hold.file) {
                c.ignore_marks.fetch_add(1, Relaxed);
            } else {
                c.errors.fetch_add(1, Relaxed);
            }
        }
    }
}

/// Later exec opens of this file skip the gate (until it is modified).
fn ignore(fan: RawFd, file: &OwnedFd) -> bool {
    // SAFETY: marks the file `file` refers to (NULL path: dirfd itself).
    unsafe {
        libc::fanotify_mark(
            fan,
            libc::FAN_MARK_ADD | libc::FAN_MARK_IGNORED_MASK,
            libc::FAN_OPEN_EXEC_PERM,
            file.as_raw_fd(),
            std::ptr::null(),
        ) == 0
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape("/mnt/a\\040b"), "/mnt/a b");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape("/end\\"), "/end\\");
    }

    #[test]
    fn lists_the_root_filesystem() {
        assert!(filesystems().unwrap().iter().any(|p| p == Path::new("/")));
    }
}
