//! Runs rsprof-bpf for real in integration tests: starts a recording, waits until sampling is
//! live, lets the test run its workload, stops it (SIGINT or its own duration) and loads the
//! profile.

use std::{
    io::{BufRead as _, BufReader},
    path::PathBuf,
    process::{Child, Command, ExitStatus, Stdio},
    sync::mpsc,
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;

use crate::fixtures;

pub struct Finished {
    pub status: ExitStatus,
    pub stderr: String,
    /// What rsprof-bpf and a `-- CMD` child printed (empty for a `Recording`).
    pub stdout: String,
    pub output: PathBuf,
}

impl Finished {
    pub fn profile(&self) -> Result<Value> {
        if !self.status.success() {
            bail!("rsprof-bpf failed ({}):\n{}", self.status, self.stderr);
        }
        crate::gecko_schema::load(&self.output)
    }
}

pub struct Recording {
    child: Child,
    stderr_lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    pub output: PathBuf,
    done: bool,
}

/// A test that panics mid-recording must not leave a system-wide profiler running.
impl Drop for Recording {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A fresh output path in a per-test temp dir.
pub fn output_path(test: &str, ext: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rsprof-it-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{test}.{ext}"))
}

/// rsprof-bpf, with the full end-of-recording report (`RSPROF_VERBOSE`, as `-v`): tests read
/// its counters. `summary_test` unsets it to see what a user sees.
pub fn command() -> Result<Command> {
    fixtures::require_root()?;
    let mut c = Command::new(fixtures::rsprof_bin()?);
    c.env("RSPROF_VERBOSE", "1");
    Ok(c)
}

impl Recording {
    /// Starts `rsprof-bpf ARGS -o OUTPUT` and waits for its "sampling" line.
    pub fn start(args: &[&str], output: PathBuf) -> Result<Self> {
        Self::start_with_env(args, output, &[])
    }

    /// `start`, with these environment variables set for rsprof-bpf (test hooks).
    pub fn start_with_env(args: &[&str], output: PathBuf, env: &[(&str, &str)]) -> Result<Self> {
        let mut child = command()?
            .envs(env.iter().copied())
            .args(args)
            .arg("-o")
            .arg(&output)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("start rsprof-bpf")?;
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut rec = Recording { child, stderr_lines: rx, seen: Vec::new(), output, done: false };
        loop {
            match rec.stderr_lines.recv_timeout(Duration::from_secs(60)) {
                Ok(line) => {
                    let ready = line.contains("rsprof-bpf: sampling");
                    rec.seen.push(line);
                    if ready {
                        return Ok(rec);
                    }
                }
                Err(_) => {
                    let _ = rec.child.kill();
                    let status = rec.child.wait()?;
                    rec.done = true;
                    bail!("rsprof-bpf did not start sampling ({status}):\n{}", rec.seen.join("\n"));
                }
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `sig` to rsprof-bpf.
    pub fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc_kill(self.child.id() as i32, sig) };
    }

    /// Waits for a stderr line containing `needle` and returns it.
    pub fn wait_for_line(&mut self, needle: &str, timeout: Duration) -> Result<String> {
        let end = std::time::Instant::now() + timeout;
        loop {
            let left = end.saturating_duration_since(std::time::Instant::now());
            match self.stderr_lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return Ok(line);
                    }
                }
                Err(_) => {
                    bail!("no line with {needle:?} within {timeout:?}:\n{}", self.seen.join("\n"))
                }
            }
        }
    }

    /// Sends SIGINT (as Ctrl-C would) and waits for the profile to be written.
    pub fn interrupt(self) -> Result<Finished> {
        // SAFETY: signalling our own child.
        unsafe { libc_kill(self.child.id() as i32, 2) };
        self.wait()
    }

    pub fn wait(mut self) -> Result<Finished> {
        let status = self.child.wait()?;
        self.done = true;
        // The reader thread ends at EOF, after the child exited.
        while let Ok(line) = self.stderr_lines.recv_timeout(Duration::from_secs(10)) {
            self.seen.push(line);
        }
        Ok(Finished {
            status,
            stderr: std::mem::take(&mut self.seen).join("\n"),
            stdout: String::new(),
            output: std::mem::take(&mut self.output),
        })
    }
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// Runs rsprof-bpf to completion (e.g. with `-d` or `-- CMD`).
/// Spawns `cmd`, whose program was just written. Another test thread forking while the file
/// was open for writing leaves a child holding that fd until it execs: the exec then fails
/// with ETXTBSY for a moment (the fork/exec race of multi-threaded programs), so it is retried.
pub fn spawn_fresh(cmd: &mut Command) -> Child {
    for _ in 0..100 {
        match cmd.spawn() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                thread::sleep(Duration::from_millis(10));
            }
            r => return r.unwrap(),
        }
    }
    panic!("{:?} stayed busy for a second", cmd.get_program());
}

pub fn run(args: &[&str]) -> Result<Finished> {
    let out = command()?.args(args).stdin(Stdio::null()).output().context("run rsprof-bpf")?;
    Ok(Finished {
        status: out.status,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        output: PathBuf::new(),
    })
}

/// A fixture running in the background, killed and reaped when dropped (also when the test
/// fails).
pub struct Background(pub Child);

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs a fixture to completion and returns its pid.
pub fn run_fixture(name: &str, args: &[&str]) -> Result<u32> {
    let exe = fixtures::build(name)?;
    let mut child = Command::new(&exe).args(args).stdout(Stdio::null()).spawn()?;
    let pid = child.id();
    let st = child.wait()?;
    if !st.success() {
        bail!("fixture {name} failed: {st}");
    }
    Ok(pid)
}
