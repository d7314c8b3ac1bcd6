//! `cargo xtask bench-agent --churn`: the agent under process churn, side by side with
//! `perf record -a -g` at the same rate, in one run per phase:
//! 1. a shell running `/bin/true` in a loop, the pattern of CI runners and `make -j`: paced at
//!    `--churn-execs` a second (the shell reads a line before each exec, and the bench writes
//!    the lines on a schedule), or as fast as it goes;
//! 2. 100 execs a second of `curl --version`, which maps a dozen libraries (ld.so maps each
//!    one: many mapping records per exec, and tables wanted for all of them).
//!
//! Per phase, after `--warmup` under the load: each tool's CPU (utime+stime; the agent's BPF
//! programs' run time separately, from their `run_time_ns` with `kernel.bpf_stats_enabled`,
//! per exec), RSS every 10 s, and the agent's spool files per window.

use std::{
    fmt::Write as _,
    fs,
    path::Path,
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use super::{bpf_seconds, cpu_seconds, mib, rss_kib, start_agent, stop_agent};
use crate::{
    bench::{Reaper, status_kib},
    display, step,
};

/// The agent's window (s): spool files per window are counted over whole windows.
const WINDOW: u64 = 10;

struct Phase {
    name: String,
    execs_per_s: f64,
    agent_cpu_pct: f64,
    agent_bpf_pct: f64,
    bpf_ns_per_exec: f64,
    perf_cpu_pct: f64,
    agent_rss: Vec<u64>,
    perf_rss: Vec<u64>,
    files_per_window: f64,
}

/// Runs `curl --version` every 10 ms until `stop`.
fn paced_execs(stop: Arc<AtomicBool>) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let mut next = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            let _ = Command::new("curl")
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            next += Duration::from_millis(10);
            thread::sleep(next.saturating_duration_since(Instant::now()));
        }
    })
}

/// Feeds the shell loop one line per exec, `per_s` a second in batches every 10 ms, until
/// `stop`; a shell behind schedule finds the lines waiting in the pipe.
fn paced_lines(
    mut to_shell: std::process::ChildStdin,
    per_s: u32,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<()> {
    use std::io::Write as _;
    thread::spawn(move || {
        let (start, mut sent) = (Instant::now(), 0u64);
        while !stop.load(Ordering::Relaxed) {
            thread::sleep(Duration::from_millis(10));
            let due = (start.elapsed().as_secs_f64() * f64::from(per_s)) as u64;
            let batch = vec![b'\n'; due.saturating_sub(sent) as usize];
            if to_shell.write_all(&batch).is_err() {
                return;
            }
            sent = due;
        }
    })
}

/// What a phase runs.
#[derive(Clone, Copy)]
enum Load {
    /// `/bin/true` in a shell loop, this many a second (0: as fast as the shell goes).
    Shell(u32),
    /// `curl --version`, 100 a second.
    Curl,
}

impl Load {
    fn name(self) -> String {
        match self {
            Load::Shell(0) => "/bin/true in a shell loop, as fast as it goes".to_owned(),
            Load::Shell(n) => format!("/bin/true in a shell loop, {n} a second"),
            Load::Curl => "curl --version, 100 a second".to_owned(),
        }
    }
}

fn phase(
    profiler: &Path,
    load: Load,
    rate: u32,
    secs: u64,
    warmup: u64,
    dir: &Path,
) -> anyhow::Result<Phase> {
    let name = load.name();
    step(&format!("bench-agent --churn: {name}, agent and perf record at {rate} Hz, {secs} s"));
    let spool = dir.join(if matches!(load, Load::Curl) { "spool-curl" } else { "spool-shell" });
    let _ = fs::remove_dir_all(&spool);
    fs::create_dir_all(&spool)?;
    let window = WINDOW.to_string();
    let (mut agent, lines) = start_agent(profiler, rate, &spool, &["--window".into(), window])?;
    let perf_out = dir.join("churn-perf.data");
    let mut perf = Command::new("perf");
    perf.args(["record", "-a", "-g", "-q", "-F", &rate.to_string(), "-o"])
        .arg(&perf_out)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    println!("$ {}", display(&perf));
    let perf = Reaper(perf.spawn().context("start perf record (linux-perf)")?);
    let stop = Arc::new(AtomicBool::new(false));
    let (_shell, pacer) = match load {
        Load::Shell(0) => {
            let sh = Command::new("sh").args(["-c", "while :; do /bin/true; done"]).spawn()?;
            (Some(Reaper(sh)), None)
        }
        Load::Shell(per_s) => {
            let mut sh = Command::new("sh")
                .args(["-c", "while read -r _; do /bin/true; done"])
                .stdin(Stdio::piped())
                .spawn()?;
            let lines = sh.stdin.take().context("the shell's stdin")?;
            (Some(Reaper(sh)), Some(paced_lines(lines, per_s, stop.clone())))
        }
        Load::Curl => {
            anyhow::ensure!(
                Command::new("curl").arg("--version").stdout(Stdio::null()).status().is_ok(),
                "the second phase runs curl --version: install curl"
            );
            (None, Some(paced_execs(stop.clone())))
        }
    };
    thread::sleep(Duration::from_secs(warmup));
    let (a, p) = (agent.0.id(), perf.0.id());
    // Profiles (one `.pb.gz` per service and window; each has a metadata file beside it).
    let files = |d: &Path| super::dir_bytes(d).1;
    let (a_cpu0, a_bpf0, p_cpu0) = (cpu_seconds(a)?, bpf_seconds(a)?, cpu_seconds(p)?);
    let (execs0, files0, t0) =
        (crate::bench_cost::forks_since_boot(), files(&spool), Instant::now());
    let (mut agent_rss, mut perf_rss) =
        (vec![rss_kib(a)?], vec![status_kib(p, "VmRSS:").unwrap_or(0)]);
    while t0.elapsed() < Duration::from_secs(secs) {
        thread::sleep(Duration::from_secs(10).min(Duration::from_secs(secs) - t0.elapsed()));
        agent_rss.push(rss_kib(a)?);
        perf_rss.push(status_kib(p, "VmRSS:").unwrap_or(0));
    }
    let wall = t0.elapsed().as_secs_f64();
    let execs = crate::bench_cost::forks_since_boot().saturating_sub(execs0);
    let (a_cpu, a_bpf) = (cpu_seconds(a)? - a_cpu0, bpf_seconds(a)? - a_bpf0);
    let p_cpu = cpu_seconds(p)? - p_cpu0;
    let files_per_window = (files(&spool) - files0) as f64 / (wall / WINDOW as f64);
    stop.store(true, Ordering::Relaxed);
    if let Some(t) = pacer {
        let _ = t.join();
    }
    drop(_shell);
    stop_agent(&mut agent, &lines)?;
    // SAFETY: plain kill(2) on our child.
    unsafe { libc::kill(p as i32, libc::SIGINT) };
    drop(perf);
    let _ = fs::remove_file(&perf_out);
    Ok(Phase {
        name,
        execs_per_s: execs as f64 / wall,
        agent_cpu_pct: 100.0 * a_cpu / wall,
        agent_bpf_pct: 100.0 * a_bpf / wall,
        bpf_ns_per_exec: a_bpf * 1e9 / execs.max(1) as f64,
        perf_cpu_pct: 100.0 * p_cpu / wall,
        agent_rss,
        perf_rss,
        files_per_window,
    })
}

/// Both phases; returns the BENCHMARKS.md section.
pub fn run(
    profiler: &Path,
    rate: u32,
    execs_per_s: u32,
    secs: u64,
    warmup: u64,
) -> anyhow::Result<String> {
    let dir = super::tempfile_dir()?.join("churn");
    fs::create_dir_all(&dir)?;
    let mut phases = Vec::new();
    for load in [Load::Shell(execs_per_s), Load::Curl] {
        phases.push(phase(profiler, load, rate, secs, warmup, &dir)?);
    }
    let _ = fs::remove_dir_all(&dir);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Command: `cargo xtask bench-agent --churn --churn-rate {rate} --churn-execs \
         {execs_per_s} --secs {secs} --warmup {warmup}` ({}; {} CPUs). The agent (`--window {WINDOW} --spool`) and `perf record -a \
         -g` at the same rate record the same phase side by side; measured for {secs} s after \
         {warmup} s under the load.\n",
        crate::bench::utc_now(),
        crate::bench::online_cpus()
    );
    s.push_str(
        "| phase | execs/s | agent CPU (% of a core) | agent BPF (% of a core) | BPF ns per exec | \
         perf record CPU | agent RSS first → last (max) | perf RSS last | profiles per \
         window |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for p in &phases {
        let _ = writeln!(
            s,
            "| {} | {:.0} | {:.2}% | {:.2}% | {:.0} | {:.2}% | {} → {} ({}) | {} | {:.1} |",
            p.name,
            p.execs_per_s,
            p.agent_cpu_pct,
            p.agent_bpf_pct,
            p.bpf_ns_per_exec,
            p.perf_cpu_pct,
            mib(p.agent_rss[0]),
            mib(*p.agent_rss.last().unwrap()),
            mib(*p.agent_rss.iter().max().unwrap()),
            mib(*p.perf_rss.last().unwrap()),
            p.files_per_window,
        );
    }
    for p in &phases {
        // Read every 10 s: one reading a minute shows whether it levels off.
        let each_minute: Vec<String> = p.agent_rss.iter().step_by(6).map(|&k| mib(k)).collect();
        let _ = writeln!(s, "\nAgent RSS each minute, {}: {}.", p.name, each_minute.join(", "));
    }
    s.push_str(
        "\nBPF time runs in the profiled processes' context (their exec, mmap and exit \
         tracepoints, and the sampler); the agent's own CPU is its userspace. Profiles per window: \
         the spool's `.pb.gz` files (one per service and window, each with a metadata file) \
         over the measured windows.\n",
    );
    Ok(s)
}
