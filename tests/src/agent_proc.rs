//! A running `rsprof-bpf agent` for tests: its stderr read line by line on a thread, killed and
//! reaped when dropped (also when the test fails).

use std::{
    io::{BufRead as _, BufReader},
    process::{Child, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Result, bail};

use crate::{fixtures, harness::command};

/// Debian packages the agent's operation tests use: `systemd-analyze` (systemd) and `setpriv`
/// (util-linux).
pub const DEBIAN_PACKAGES: &[&str] = &["systemd", "util-linux"];

pub struct AgentProc {
    pub child: Child,
    lines: mpsc::Receiver<String>,
    pub seen: Vec<String>,
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl AgentProc {
    /// Starts `rsprof-bpf agent ARGS` and waits for its "sampling" line.
    pub fn start(args: &[&str]) -> Result<Self> {
        Self::start_wrapped(&[], args)
    }

    /// Starts `WRAPPER... rsprof-bpf agent ARGS` (e.g. `setpriv --bounding-set=...`).
    pub fn start_wrapped(wrapper: &[String], args: &[&str]) -> Result<Self> {
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                fixtures::require_root()?;
                let mut c = std::process::Command::new(first);
                c.args(rest).arg(fixtures::rsprof_bin()?);
                c
            }
            None => command()?,
        };
        let mut child = cmd
            .arg("agent")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for l in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut a = Self { child, lines, seen: Vec::new() };
        a.wait_for("rsprof-bpf: sampling", Duration::from_secs(60))?;
        Ok(a)
    }

    /// The first line (from now on, or already seen) containing `needle`.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> Result<String> {
        if let Some(l) = self.seen.iter().find(|l| l.contains(needle)) {
            return Ok(l.clone());
        }
        let end = Instant::now() + timeout;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.contains(needle) {
                        return Ok(l);
                    }
                }
                Err(_) => bail!("no {needle:?} within {timeout:?}:\n{}", self.seen.join("\n")),
            }
        }
    }

    /// `IP:PORT` of its metrics, from its "metrics on http://ADDR/metrics" line.
    pub fn metrics_addr(&mut self) -> Result<String> {
        let l = self.wait_for("metrics on http://", Duration::from_secs(10))?;
        let rest = l.split("http://").nth(1).unwrap_or_default();
        Ok(rest.trim_end_matches("/metrics").to_owned())
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}
