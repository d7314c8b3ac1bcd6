//! Waits on a condition with a deadline, where a fixed sleep would guess how long something
//! takes (and fail on a loaded machine, or waste time on an idle one): a process's CPU time
//! stands for "it has run long enough to be sampled N times", since samples follow CPU time,
//! not wall time.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};

/// Polls `cond` every 10 ms until it holds; fails naming `what` after `timeout`.
pub fn until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) -> Result<()> {
    let end = Instant::now() + timeout;
    while !cond() {
        if Instant::now() >= end {
            bail!("{what}: not within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// CPU time (user + system) of every thread of `pid` so far; None once it is gone.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces and parentheses): state is the
    // 3rd field of stat(5), utime and stime the 14th and 15th.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

/// Waits until `pid` has used `cpu` more CPU time than `since` (its `cpu_time` earlier, or
/// zero); fails if it exits first or takes longer than `timeout`.
pub fn until_cpu_time(pid: u32, since: Duration, cpu: Duration, timeout: Duration) -> Result<()> {
    let mut gone = false;
    until(&format!("pid {pid} using {cpu:?} of CPU"), timeout, || match cpu_time(pid) {
        Some(t) => t >= since + cpu,
        None => {
            gone = true;
            true
        }
    })?;
    if gone {
        bail!("pid {pid} exited before using {cpu:?} of CPU");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_follows_a_busy_process() {
        let mut busy =
            std::process::Command::new("sh").args(["-c", "while :; do :; done"]).spawn().unwrap();
        let pid = busy.id();
        let r = until_cpu_time(
            pid,
            Duration::ZERO,
            Duration::from_millis(100),
            Duration::from_secs(30),
        );
        let _ = (busy.kill(), busy.wait());
        r.unwrap();
        assert!(cpu_time(pid).is_none(), "reaped: gone");
        let err = until("never", Duration::from_millis(30), || false).unwrap_err();
        assert!(err.to_string().contains("never: not within"), "{err}");
    }
}
