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
//! Trade-offs, reported in the summary (`gate:` line):
//! - The first exec of each new file waits for the scan and the uprobe attaches, and for this
//!   thread to be scheduled and to get the attacher's lock (the summary reports the holds'
//!   average and longest time). No signal is sent and the process is never stopped: its
//!   parent, job control and ptrace see an ordinary, slower execve.
//! - If rsprof-bpf dies, the kernel closes the group and lets every waiting exec proceed. If it
//!   is frozen (SIGSTOP, a debugger), first execs of new files wait until it resumes.
//! - Covered: files on filesystems mounted when the recording starts, in our mount namespace
//!   (containers on other superblocks, e.g. overlayfs roots, are not). Libraries are not
//!   exec-opened: one first loaded by a process started during the recording is attached when
//!   its mapping record is drained, and counted as attached late.
//! - Each ignore mark pins its inode in kernel memory: at most `MAX_IGNORE_MARKS`; files beyond
//!   that are answered from the scan cache on every exec.

use std::{
    ffi::CString,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
        unix::ffi::OsStrExt as _,
    },
    path::PathBuf,
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::Instant,
};

use anyhow::{Context as _, Result, bail};

use super::attach::{Attacher, lock_attacher};

/// Ignore marks placed at most (each pins an inode).
const MAX_IGNORE_MARKS: u64 = 4096;

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
    /// Of those, execs held while their file was scanned (first exec of a file not known yet).
    pub held: u64,
    /// Time from reading a held exec's event to answering it.
    pub hold_ns_total: u64,
    pub hold_ns_max: u64,
    /// Files whose later execs skip the gate.
    pub ignore_marks: u64,
    /// Events or answers that failed (an exec is never left waiting: the kernel lets it go
    /// when the group closes at the latest).
    pub errors: u64,
}

pub struct ExecGate {
    stop: OwnedFd,
    thread: JoinHandle<()>,
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
        let fan = unsafe { OwnedFd::from_raw_fd(fan) };
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
        {
            let mut a = lock_attacher(&shared);
            a.stats.gate.filesystems = ok;
            a.stats.gate.filesystems_failed = failed;
        }
        // SAFETY: plain syscall.
        let stop = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if stop < 0 {
            return Err(last_error("eventfd"));
        }
        // SAFETY: fresh descriptor.
        let stop = unsafe { OwnedFd::from_raw_fd(stop) };
        let stop_rx = stop.try_clone()?;
        let thread = std::thread::Builder::new()
            .name("usdt-exec-gate".into())
            .spawn(move || run(fan, stop_rx, shared))?;
        Ok(Self { stop, thread })
    }

    /// Stops answering; closing the group lets any exec still waiting proceed.
    pub fn stop(self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), (&raw const one).cast(), 8) };
        let _ = self.thread.join();
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

/// Answers "allow" for one permission event when dropped, whatever happened before.
struct Allow {
    fan: RawFd,
    fd: RawFd,
}

impl Drop for Allow {
    fn drop(&mut self) {
        let r = libc::fanotify_response { fd: self.fd, response: libc::FAN_ALLOW };
        // SAFETY: writes the response struct to the fanotify fd.
        unsafe {
            libc::write(self.fan, (&raw const r).cast(), size_of::<libc::fanotify_response>())
        };
    }
}

fn run(fan: OwnedFd, stop: OwnedFd, shared: Arc<Mutex<Attacher>>) {
    let mut buf = vec![0u64; 4096 / 8];
    loop {
        let mut fds = [
            libc::pollfd { fd: fan.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: two valid pollfds.
        if unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) } < 0 {
            continue; // EINTR
        }
        if fds[1].revents != 0 {
            return;
        }
        // SAFETY: reads into our buffer of that size.
        let n = unsafe { libc::read(fan.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len() * 8) };
        if n <= 0 {
            continue; // EAGAIN (another reader got it) or EINTR
        }
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
            if ev.fd >= 0 {
                handle(fan.as_raw_fd(), ev.fd, &shared);
            }
        }
    }
}

fn handle(fan: RawFd, fd: RawFd, shared: &Mutex<Attacher>) {
    let start = Instant::now();
    // SAFETY: the event's descriptor is ours to close (after the answer, below).
    let file = unsafe { OwnedFd::from_raw_fd(fd) };
    let allow = Allow { fan, fd };
    // SAFETY: fstat into a zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        drop(allow);
        lock_attacher(shared).stats.gate.errors += 1;
        return;
    }
    let key = (st.st_dev, st.st_ino);
    let open = PathBuf::from(format!("/proc/self/fd/{fd}"));
    let mut a = lock_attacher(shared);
    let held = !a.known(key) && {
        let display = std::fs::read_link(&open)
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| open.display().to_string());
        a.scan_exec(key, &open, &display)
    };
    let mark = a.known(key) && a.stats.gate.ignore_marks < MAX_IGNORE_MARKS;
    drop(allow);
    let g = &mut a.stats.gate;
    g.execs += 1;
    if held {
        let ns = start.elapsed().as_nanos() as u64;
        g.held += 1;
        g.hold_ns_total += ns;
        g.hold_ns_max = g.hold_ns_max.max(ns);
    }
    if mark {
        if ignore(fan, &file) {
            g.ignore_marks += 1;
        } else {
            g.errors += 1;
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
