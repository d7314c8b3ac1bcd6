//! A running `rsprof-bpf agent` for the integration tests: its stderr lines, signals, exit.

use std::{
    io::{BufRead as _, BufReader},
    process::{Child, Stdio},
    sync::mpsc,
    thread,
    time::Duration,
};

use crate::harness::command;

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
    /// Starts `rsprof-bpf agent ARGS` and waits for "sampling".
    pub fn start(args: &[&str]) -> Agent {
        let mut child = command()
            .expect("rsprof-bpf")
            .arg("agent")
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
