//! A running `rsprof-bpf agent` for the integration tests: its stderr lines, signals, exit.

use std::{
    fs,
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, Stdio},
    sync::mpsc,
    thread,
    time::Duration,
};

use serde_json::Value;

use crate::{
    fixtures,
    harness::{command, output_path},
};

/// Debian packages the agent's operation tests use: `systemd-analyze` (systemd) and `setpriv`
/// (util-linux).
pub const DEBIAN_PACKAGES: &[&str] = &["systemd", "util-linux"];

/// A fresh (emptied) spool directory for `test`.
pub fn spool_dir(test: &str) -> PathBuf {
    let d = output_path(test, "spool");
    let _ = fs::remove_dir_all(&d);
    d
}

/// (labels json, profile path) of every window in `dir` of service `service` (a process not
/// in a container or systemd unit is its own service, by name), oldest first.
pub fn windows_of(dir: &Path, service: &str) -> Vec<(Value, PathBuf)> {
    let mut v: Vec<(Value, PathBuf)> = fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            let name = p.file_name()?.to_str()?.to_owned();
            let stem = name.strip_suffix(".json")?;
            let meta: Value = serde_json::from_slice(&fs::read(&p).ok()?).ok()?;
            (meta["service_name"] == service).then(|| (meta, dir.join(format!("{stem}.pb.gz"))))
        })
        .collect();
    v.sort_by_key(|(m, _)| m["start_ms"].as_u64());
    v
}

/// A running agent; killed if the test fails.
pub struct Agent {
    pub child: Child,
    lines: mpsc::Receiver<String>,
    pub seen: Vec<String>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Agent {
    /// Starts `rsprof-bpf agent ARGS` and waits for "sampling". Metrics go to a free port
    /// unless ARGS say otherwise: the default port may be taken by another agent.
    pub fn start(args: &[&str]) -> Agent {
        Self::start_wrapped(&[], args)
    }

    /// Starts `WRAPPER... rsprof-bpf agent ARGS` (e.g. `setpriv --bounding-set=...`).
    pub fn start_wrapped(wrapper: &[String], args: &[&str]) -> Agent {
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                fixtures::require_root().expect("root");
                let mut c = std::process::Command::new(first);
                c.args(rest).arg(fixtures::rsprof_bin().expect("rsprof-bpf"));
                c
            }
            None => command().expect("rsprof-bpf"),
        };
        cmd.arg("agent");
        if !args.contains(&"--metrics") {
            cmd.args(["--metrics", "127.0.0.1:0"]);
        }
        let mut child = cmd
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start agent");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for l in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut a = Agent { child, lines, seen: Vec::new() };
        a.wait_for("rsprof-bpf: sampling", Duration::from_secs(60));
        a
    }

    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> String {
        let end = std::time::Instant::now() + timeout;
        loop {
            let left = end.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.contains(needle) {
                        return l;
                    }
                }
                Err(_) => panic!("no {needle:?} within {timeout:?}:\n{}", self.seen.join("\n")),
            }
        }
    }

    /// `IP:PORT` of its metrics, from its "metrics on http://ADDR/metrics" line.
    pub fn metrics_addr(&mut self) -> String {
        let l = match self.seen.iter().find(|l| l.contains("metrics on http://")) {
            Some(l) => l.clone(),
            None => self.wait_for("metrics on http://", Duration::from_secs(10)),
        };
        let rest = l.split("http://").nth(1).unwrap_or_default();
        rest.trim_end_matches("/metrics").to_owned()
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }

    /// Sends `sig`, waits for the exit (at most `limit`) and returns the exit status and stderr.
    pub fn stop(mut self, sig: i32, limit: Duration) -> (std::process::ExitStatus, String) {
        self.signal(sig);
        let start = std::time::Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(start.elapsed() < limit, "agent still running {limit:?} after signal {sig}");
            thread::sleep(Duration::from_millis(50));
        };
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.seen.push(l);
        }
        (status, std::mem::take(&mut self.seen).join("\n"))
    }
}
