//! Starting `-- CMD` so that it is profiled from its first instruction: the child is forked
//! and held at a gate until the loader has put its pid in the kernel filter and attached.

use std::{
    ffi::CString,
    io::{self, Read as _, Write as _},
    os::fd::{FromRawFd as _, OwnedFd},
};

use anyhow::{Context as _, Result, bail};

use crate::model::ids::Pid;

pub struct GatedChild {
    pub pid: Pid,
    gate: std::fs::File,
    exec_error: std::fs::File,
    program: String,
}

fn pipe(flags: libc::c_int) -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid 2-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), flags) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two fresh descriptors we now own.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Forks `argv`, stopped before exec. Must be called while the process has one thread.
/// `stdout_to_stderr`: the profile goes to our standard output (`-o -`), so the command's
/// output goes to stderr instead of into the profile.
pub fn spawn_gated(argv: &[String], stdout_to_stderr: bool) -> Result<GatedChild> {
    use std::os::fd::AsRawFd as _;
    let c_args: Vec<CString> = argv
        .iter()
        .map(|a| CString::new(a.as_str()))
        .collect::<Result<_, _>>()
        .context("command argument contains a NUL byte")?;
    let mut ptrs: Vec<*const libc::c_char> = c_args.iter().map(|a| a.as_ptr()).collect();
    ptrs.push(std::ptr::null());
    let (gate_r, gate_w) = pipe(libc::O_CLOEXEC)?;
    let (err_r, err_w) = pipe(libc::O_CLOEXEC)?;

    // SAFETY: the child only calls async-signal-safe functions (read, write, dup2, execvp, _exit)
    // on memory prepared before the fork.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error()).context("fork");
    }
    if pid == 0 {
        unsafe {
            // Our copy of the write end would keep the gate open if the loader died.
            libc::close(gate_w.as_raw_fd());
            let mut b = 0u8;
            if libc::read(gate_r.as_raw_fd(), (&raw mut b).cast(), 1) != 1 {
                libc::_exit(1); // loader gave up before releasing us
            }
            if stdout_to_stderr {
                libc::dup2(libc::STDERR_FILENO, libc::STDOUT_FILENO);
            }
            libc::execvp(ptrs[0], ptrs.as_ptr());
            let errno = *libc::__errno_location();
            libc::write(err_w.as_raw_fd(), (&raw const errno).cast(), 4);
            libc::_exit(127);
        }
    }
    drop(gate_r);
    drop(err_w);
    Ok(GatedChild {
        pid: Pid(pid as u32),
        gate: std::fs::File::from(gate_w),
        exec_error: std::fs::File::from(err_r),
        program: argv[0].clone(),
    })
}

impl GatedChild {
    /// Lets the child exec; fails if exec did.
    pub fn release(mut self) -> Result<Pid> {
        self.gate.write_all(&[1]).context("release command")?;
        let mut errno = [0u8; 4];
        match self.exec_error.read(&mut errno) {
            Ok(4) => {
                let e = io::Error::from_raw_os_error(i32::from_ne_bytes(errno));
                // SAFETY: reaping our own child.
                unsafe { libc::waitpid(self.pid.0 as i32, std::ptr::null_mut(), 0) };
                bail!("cannot run '{}': {e}", self.program)
            }
            _ => Ok(self.pid),
        }
    }
}

/// Blocks until `pid` exits; returns its exit code (128+signal when killed).
pub fn wait_exit(pid: Pid) -> i32 {
    let mut status = 0;
    loop {
        // SAFETY: waiting on our own child with a valid status pointer.
        let r = unsafe { libc::waitpid(pid.0 as i32, &mut status, 0) };
        if r == pid.0 as i32 {
            break;
        }
        if r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return -1;
        }
    }
    if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { 128 + libc::WTERMSIG(status) }
}

/// The `-p` processes' pidfds (Linux 5.3), opened as the recording starts, so that a pid
/// reused by another process while the BPF programs load is not watched instead; the
/// recording stops once all have exited, as perf's does. A pidfd polls readable at exit:
/// no thread and no /proc polling.
pub struct ExitWatch {
    fds: Vec<OwnedFd>,
    /// Some process could not be watched: the watch never reports.
    blind: bool,
}

impl ExitWatch {
    /// Opens a pidfd per pid; a pid already gone counts as exited. Returns the pids that
    /// could not be watched, with why (a thread id, a kernel without pidfd_open).
    pub fn open(pids: &[Pid]) -> (Self, Vec<(Pid, io::Error)>) {
        let mut fds = Vec::new();
        let mut failed = Vec::new();
        for &pid in pids {
            // SAFETY: a plain syscall; a returned fd is owned below.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.0 as libc::pid_t, 0) };
            if fd >= 0 {
                // SAFETY: `fd` was just returned by pidfd_open and nothing else owns it.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd as i32) });
                continue;
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                failed.push((pid, e));
            }
        }
        let blind = !failed.is_empty();
        (Self { fds, blind }, failed)
    }

    /// Resolves once every watched process has exited (never, if one could not be watched).
    pub async fn all_exited(self) {
        use tokio::io::{Interest, unix::AsyncFd};
        if self.blind {
            return std::future::pending().await;
        }
        // One at a time: a pidfd stays readable once its process exited.
        for fd in self.fds {
            // SAFETY: the AsyncFd owns the fd, which stays open as long as it does.
            match unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) } {
                Ok(watch) => drop(watch.readable().await),
                Err(_) => return std::future::pending().await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    #[test]
    fn exit_watch_reports_once_every_process_exited() {
        let mut short = std::process::Command::new("sleep").arg("0.2").spawn().unwrap();
        let mut long = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pids = [Pid(short.id()), Pid(long.id())];
        let (watch, failed) = ExitWatch::open(&pids);
        assert!(failed.is_empty(), "{failed:?}");
        let rt = rt();
        let mut all = Box::pin(watch.all_exited());
        // The first exits (a zombie until reaped: exited all the same), the second runs on.
        let waited =
            rt.block_on(async { tokio::time::timeout(Duration::from_secs(1), &mut all).await });
        assert!(waited.is_err(), "reported while pid {} runs", long.id());
        short.wait().unwrap();
        long.kill().unwrap();
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), all).await })
            .expect("reported");
        long.wait().unwrap();
    }

    #[test]
    fn exit_watch_of_a_thread_id_never_reports() {
        // A thread that is not a process leader has no pidfd (without PIDFD_THREAD).
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            // SAFETY: plain syscall.
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            std::thread::sleep(Duration::from_millis(300));
        });
        let tid = Pid(rx.recv().unwrap());
        let (watch, failed) = ExitWatch::open(&[tid]);
        assert_eq!(failed.len(), 1, "pidfd_open of a thread id failed");
        t.join().unwrap();
        let r = rt().block_on(async {
            tokio::time::timeout(Duration::from_millis(200), watch.all_exited()).await
        });
        assert!(r.is_err(), "a watch that cannot see a process never reports");
    }
}
