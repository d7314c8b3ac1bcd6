//! `cargo xtask bench`: overhead of rsprof-bpf next to `perf record`, in one run.
//!
//! A CPU-bound fixture (`tests/fixtures/bench_work.c`, one thread per online CPU, a fixed
//! number of hash iterations per thread) runs in three configurations, interleaved, each
//! repeated `--runs` times (median reported):
//!
//! 1. alone;
//! 2. under `rsprof-bpf --all -F 999 -o <tmp>/bench.json.gz`;
//! 3. under `perf record -a -g -F 999 -o <tmp>/perf.data`.
//!
//! A profiler is started first; the fixture starts once the profiler has been running for
//! 1.5 s (and, for rsprof-bpf, has printed its "sampling ..." line), and the profiler gets
//! SIGINT as soon as the fixture exits. rsprof-bpf runs without `-q` because `-q` also
//! suppresses the exit summary the sample counts are read from; its stderr is a pipe, so it
//! prints no status line while recording.
//!
//! For the profilers it reports their own CPU time (user+sys) and peak RSS (from `wait4`),
//! samples recorded against 999 × CPUs × recording seconds, and samples lost. The table goes
//! to stdout and into a section of BENCHMARKS.md.

use std::fmt::Write as _;
use std::fs;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, bail};

use crate::{build, display, step, workspace_root};

const FREQ: u64 = 999;
/// How long a profiler runs before the fixture starts (at least).
const STARTUP: Duration = Duration::from_millis(1500);
/// How long rsprof-bpf may take to print its "sampling" line (BPF load and attach).
const ATTACH_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a profiler gets to write its output after SIGINT.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(180);
const SECTION_BEGIN: &str = "<!-- BEGIN cargo xtask bench (generated; edits are overwritten) -->";
const SECTION_END: &str = "<!-- END cargo xtask bench -->";

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Approximate wall time of the fixture alone; sets the (then fixed) amount of work.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Fixed iterations per fixture thread instead of calibrating from --seconds.
    #[arg(long)]
    iterations: Option<u64>,
    /// Repetitions of each configuration; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Use this rsprof-bpf binary instead of building target/release/rsprof-bpf.
    #[arg(long)]
    profiler: Option<PathBuf>,
    /// Only print the results; leave BENCHMARKS.md alone.
    #[arg(long)]
    no_write: bool,
}

impl BenchArgs {
    /// The command line that reproduces this run.
    fn command_line(&self) -> String {
        let mut s = "cargo xtask bench".to_owned();
        if self.seconds != 5.0 {
            write!(s, " --seconds {}", self.seconds).unwrap();
        }
        if let Some(i) = self.iterations {
            write!(s, " --iterations {i}").unwrap();
        }
        if self.runs != 3 {
            write!(s, " --runs {}", self.runs).unwrap();
        }
        if let Some(p) = &self.profiler {
            write!(s, " --profiler {}", p.display()).unwrap();
        }
        s
    }
}

/// One run of the fixture under a profiler.
#[derive(Clone, Debug)]
struct ToolRun {
    fixture_wall: Duration,
    /// Recording seconds: the profiler's own figure from its summary, else start to SIGINT.
    window: Duration,
    cpu: Duration,
    max_rss_kib: u64,
    recorded: Option<u64>,
    lost: Option<u64>,
}

/// All runs of one configuration.
#[derive(Default)]
struct Config {
    runs: Vec<ToolRun>,
    /// Why the configuration did not produce results.
    error: Option<String>,
}

struct Tool {
    label: &'static str,
    kind: ToolKind,
}

/// Wall times of the workload alone, and each profiler's runs.
type Measured = (Vec<Duration>, Vec<(Tool, Config)>);

#[derive(Clone, Copy, PartialEq)]
enum ToolKind {
    Rsprof,
    Perf,
}

pub fn bench(args: BenchArgs) -> anyhow::Result<()> {
    if !crate::is_root() {
        bail!("the benchmark must run as root (rsprof-bpf and `perf record -a` sample every CPU)");
    }
    anyhow::ensure!(args.runs >= 1, "--runs must be at least 1");
    anyhow::ensure!(args.seconds > 0.0, "--seconds must be positive");

    let profiler = profiler_binary(args.profiler.as_deref())?;
    let fixture = build_fixture()?;
    let cpus = online_cpus();
    let perf_version = stdout_of(Command::new("perf").arg("--version"))
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty());

    let iterations = match args.iterations {
        Some(i) => i,
        None => calibrate(&fixture, cpus, args.seconds)?,
    };
    println!("fixture: {} {iterations} {cpus}", fixture.display());

    let tmp = std::env::temp_dir().join(format!("rsprof-bench-{}", std::process::id()));
    fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let result =
        measure(&args, &profiler, &fixture, iterations, cpus, perf_version.is_some(), &tmp);
    let _ = fs::remove_dir_all(&tmp);
    let (alone, tools) = result?;

    let machine = machine_description(cpus, perf_version.as_deref());
    let table = render(&args, &alone, &tools, cpus, iterations, &fixture, &machine);
    println!("\n{table}");

    let failed: Vec<String> = tools
        .iter()
        .filter_map(|(t, c)| c.error.as_ref().map(|e| format!("{}: {e}", t.label)))
        .collect();
    if !failed.is_empty() {
        bail!("some configurations failed, BENCHMARKS.md not updated:\n  {}", failed.join("\n  "));
    }
    if args.no_write {
        println!("--no-write: BENCHMARKS.md not updated");
    } else {
        let path = workspace_root().join("BENCHMARKS.md");
        update_benchmarks_md(&path, &table)?;
        println!("updated {}", path.display());
    }
    Ok(())
}

fn measure(
    args: &BenchArgs,
    profiler: &Path,
    fixture: &Path,
    iterations: u64,
    cpus: u64,
    have_perf: bool,
    tmp: &Path,
) -> anyhow::Result<Measured> {
    let mut alone = Vec::new();
    let mut tools = vec![
        (Tool { label: "rsprof-bpf --all -F 999", kind: ToolKind::Rsprof }, Config::default()),
        (Tool { label: "perf record -a -g -F 999", kind: ToolKind::Perf }, Config::default()),
    ];
    if !have_perf {
        tools[1].1.error = Some("perf is not installed (`cargo xtask setup`)".to_owned());
    }

    for round in 1..=args.runs {
        step(&format!("bench round {round}/{}", args.runs));
        let wall = run_fixture(fixture, iterations, cpus)?;
        println!("alone: fixture {:.3} s", wall.as_secs_f64());
        alone.push(wall);

        for (tool, config) in &mut tools {
            if config.error.is_some() {
                continue;
            }
            let result = match tool.kind {
                ToolKind::Rsprof => {
                    let out = tmp.join("bench.json.gz");
                    let _ = fs::remove_file(&out);
                    let mut cmd = Command::new(profiler);
                    cmd.args(["-v", "--all", "-F", "999", "-o"]).arg(&out);
                    run_under(&mut cmd, Some("sampling"), &out, fixture, iterations, cpus)
                }
                ToolKind::Perf => {
                    let out = tmp.join("perf.data");
                    let _ = fs::remove_file(&out);
                    let mut cmd = Command::new("perf");
                    cmd.args(["record", "-a", "-g", "-F", "999", "-o"]).arg(&out);
                    run_under(&mut cmd, None, &out, fixture, iterations, cpus).map(|mut r| {
                        r.lost = perf_lost(&out);
                        r
                    })
                }
            };
            match result {
                Ok(run) => {
                    println!(
                        "{}: fixture {:.3} s, tool cpu {:.3} s, rss {} KiB, samples {} / lost {}",
                        tool.label,
                        run.fixture_wall.as_secs_f64(),
                        run.cpu.as_secs_f64(),
                        run.max_rss_kib,
                        opt(run.recorded),
                        opt(run.lost)
                    );
                    config.runs.push(run);
                }
                Err(e) => {
                    eprintln!("{}: FAILED: {e:#}", tool.label);
                    config.error = Some(format!("{e:#}"));
                }
            }
        }
    }
    Ok((alone, tools))
}

fn build_fixture() -> anyhow::Result<PathBuf> {
    step("bench: building fixture tests/fixtures/bench_work.c");
    // Same compiler and flags as the integration tests' fixtures.
    ::tests::fixtures::build("bench_work.c")
}

/// Kills and reaps a child on drop: load processes and tools never outlive a benchmark,
/// also when a measurement fails.
pub(crate) struct Reaper(pub(crate) std::process::Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `n` shell busy loops (`while :; do :; done`), killed when dropped.
pub(crate) fn busy_loops(n: usize) -> anyhow::Result<Vec<Reaper>> {
    (0..n)
        .map(|_| {
            let loop_ = Command::new("sh").args(["-c", "while :; do :; done"]).spawn();
            Ok(Reaper(loop_.context("start busy loop")?))
        })
        .collect()
}

pub fn online_cpus() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 { n as u64 } else { 1 }
}

pub fn stdout_of(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn fixture_command(fixture: &Path, iterations: u64, cpus: u64) -> Command {
    let mut cmd = Command::new(fixture);
    cmd.arg(iterations.to_string())
        .arg(cpus.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    cmd
}

/// Runs the fixture to completion; returns its wall time.
fn run_fixture(fixture: &Path, iterations: u64, cpus: u64) -> anyhow::Result<Duration> {
    let mut cmd = fixture_command(fixture, iterations, cpus);
    let start = Instant::now();
    let status = cmd.status().with_context(|| format!("running {}", display(&cmd)))?;
    let wall = start.elapsed();
    if !status.success() {
        bail!("`{}` failed: {status}", display(&cmd));
    }
    Ok(wall)
}

/// Finds the iteration count that makes the fixture run about `seconds` alone.
fn calibrate(fixture: &Path, cpus: u64, seconds: f64) -> anyhow::Result<u64> {
    step(&format!("bench: calibrating the fixture to ~{seconds} s alone"));
    let mut iterations: u64 = 20_000_000;
    loop {
        let wall = run_fixture(fixture, iterations, cpus)?.as_secs_f64();
        if wall >= 0.5 || iterations >= 1 << 40 {
            let scaled = (iterations as f64 * seconds / wall.max(1e-3)) as u64;
            // Round to a million so the number is easy to pass to --iterations.
            let rounded = (scaled / 1_000_000).max(1) * 1_000_000;
            println!("{iterations} iterations took {wall:.3} s -> {rounded} iterations per thread");
            return Ok(rounded);
        }
        iterations *= 4;
    }
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "n/a".to_owned(), |v| v.to_string())
}

/// Reads a child's pipe to the end on a thread; the first line containing `marker` (if any)
/// is announced on `ready`.
fn drain<R: std::io::Read + Send + 'static>(
    pipe: Option<R>,
    marker: Option<&'static str>,
    ready: mpsc::Sender<()>,
) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut text = String::new();
        let Some(pipe) = pipe else {
            return text;
        };
        let mut reader = BufReader::new(pipe);
        let mut line = Vec::new();
        let mut marker = marker;
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let l = String::from_utf8_lossy(&line);
                    if marker.is_some_and(|m| l.contains(m)) {
                        marker = None;
                        let _ = ready.send(());
                    }
                    text.push_str(&l);
                }
            }
        }
        text
    })
}

pub(crate) struct Reaped {
    pub(crate) status: libc::c_int,
    pub(crate) usage: libc::rusage,
}

/// wait4 on `pid`; with `nohang`, None while it still runs.
fn wait4(pid: libc::pid_t, nohang: bool) -> anyhow::Result<Option<Reaped>> {
    let mut status: libc::c_int = 0;
    // SAFETY: an all-zero rusage is a valid value; wait4 fills it in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        let flags = if nohang { libc::WNOHANG } else { 0 };
        // SAFETY: valid pointers to locals.
        let r = unsafe { libc::wait4(pid, &mut status, flags, &mut usage) };
        if r == pid {
            return Ok(Some(Reaped { status, usage }));
        }
        if r == 0 {
            return Ok(None);
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err).context("wait4");
        }
    }
}

/// Waits up to `timeout` for `pid` (our child), calling `poll` every 20 ms while it lives,
/// then SIGKILLs it.
pub(crate) fn wait_with_timeout(
    pid: libc::pid_t,
    timeout: Duration,
    mut poll: impl FnMut(),
) -> anyhow::Result<Reaped> {
    let deadline = Instant::now() + timeout;
    loop {
        poll();
        if let Some(r) = wait4(pid, true)? {
            return Ok(r);
        }
        if Instant::now() >= deadline {
            // SAFETY: plain kill(2) of our own, not yet reaped child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            wait4(pid, false)?;
            bail!("did not exit within {} s; killed", timeout.as_secs());
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Exited 0, or by re-raising SIGINT after writing (as perf does): both are clean stops.
pub(crate) fn stopped_cleanly(status: libc::c_int) -> bool {
    (libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0)
        || (libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGINT)
}

/// A tool's output for an error message ("" when it printed nothing).
fn tool_output(text: &str) -> String {
    let text = text.trim_end();
    if text.is_empty() { String::new() } else { format!("; its output:\n{text}") }
}

fn describe_status(status: libc::c_int) -> String {
    if libc::WIFEXITED(status) {
        format!("exit code {}", libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        format!("killed by signal {}", libc::WTERMSIG(status))
    } else {
        format!("wait status {status:#x}")
    }
}

pub(crate) fn timeval(tv: libc::timeval) -> Duration {
    Duration::from_secs(tv.tv_sec.max(0) as u64) + Duration::from_micros(tv.tv_usec.max(0) as u64)
}

/// Starts `tool`, waits for it to attach, runs the fixture, stops the tool with SIGINT and
/// collects its resource usage and sample counts. `output` must exist afterwards.
fn run_under(
    tool: &mut Command,
    ready_marker: Option<&'static str>,
    output: &Path,
    fixture: &Path,
    iterations: u64,
    cpus: u64,
) -> anyhow::Result<ToolRun> {
    let what = display(tool);
    println!("$ {what}");
    let mut child = tool
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start `{what}`"))?;
    let started = Instant::now();
    let pid = child.id() as libc::pid_t;
    let (ready_tx, ready_rx) = mpsc::channel();
    let stdout = drain(child.stdout.take(), None, ready_tx.clone());
    let stderr = drain(child.stderr.take(), ready_marker, ready_tx);
    let output_text = |stdout: thread::JoinHandle<String>, stderr: thread::JoinHandle<String>| {
        let mut s = stdout.join().unwrap_or_default();
        s.push_str(&stderr.join().unwrap_or_default());
        s
    };

    if let Some(marker) = ready_marker {
        match ready_rx.recv_timeout(ATTACH_TIMEOUT) {
            // Attached; or the pipes closed because the tool exited, which is reported below.
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => {}
            Err(mpsc::RecvTimeoutError::Timeout) => eprintln!(
                "warning: `{what}` printed no line containing {marker:?} within {} s; \
                 starting the workload anyway",
                ATTACH_TIMEOUT.as_secs()
            ),
        }
    }
    thread::sleep(STARTUP.saturating_sub(started.elapsed()));
    if let Some(r) = wait4(pid, true)? {
        let text = output_text(stdout, stderr);
        bail!(
            "`{what}` exited during start-up ({}){}",
            describe_status(r.status),
            tool_output(&text)
        );
    }

    let fixture_result = run_fixture(fixture, iterations, cpus);
    let window = started.elapsed();
    // SAFETY: plain kill(2) of our own, not yet reaped child.
    unsafe { libc::kill(pid, libc::SIGINT) };
    let reaped = wait_with_timeout(pid, SHUTDOWN_TIMEOUT, || ()).with_context(|| what.clone())?;
    let text = output_text(stdout, stderr);
    let fixture_wall = fixture_result?;

    // The output file is the real check.
    if !stopped_cleanly(reaped.status) {
        bail!("`{what}` failed ({}){}", describe_status(reaped.status), tool_output(&text));
    }
    let size = fs::metadata(output).map(|m| m.len()).unwrap_or(0);
    if size == 0 {
        bail!("`{what}` wrote no output to {}{}", output.display(), tool_output(&text));
    }

    let (recorded, lost) = parse_samples(&text);
    Ok(ToolRun {
        fixture_wall,
        window: parse_recording_secs(&text).map(Duration::from_secs_f64).unwrap_or(window),
        cpu: timeval(reaped.usage.ru_utime) + timeval(reaped.usage.ru_stime),
        // Linux reports ru_maxrss in KiB.
        max_rss_kib: reaped.usage.ru_maxrss.max(0) as u64,
        recorded,
        lost,
    })
}

fn number(token: &str) -> Option<u64> {
    let t = token.trim_matches(|c: char| !c.is_ascii_digit());
    if t.is_empty() || !t.chars().all(|c| c.is_ascii_digit() || c == ',' || c == '_') {
        return None;
    }
    t.chars().filter(char::is_ascii_digit).collect::<String>().parse().ok()
}

/// Sample counts from a tool's summary, leniently: rsprof-bpf prints
/// `samples: <N> recorded, <M> lost` (also accepted: `samples: N` and `lost: M` on their own),
/// perf prints `... (<N> samples) ]`. Unparsable means None, never an error.
fn parse_samples(text: &str) -> (Option<u64>, Option<u64>) {
    // Values after a `samples:` / `lost:` label win over loose `N samples` / `N lost` phrases.
    let (mut recorded, mut lost) = (None, None);
    let (mut loose_recorded, mut loose_lost) = (None, None);
    for line in text.lines() {
        let tokens: Vec<&str> = line.split_whitespace().collect();
        for (i, raw) in tokens.iter().enumerate() {
            let word = raw.trim_matches(|c: char| !c.is_ascii_alphanumeric()).to_ascii_lowercase();
            let next = tokens.get(i + 1).and_then(|t| number(t));
            let prev = i.checked_sub(1).and_then(|j| number(tokens[j]));
            let labelled = raw.ends_with(':');
            match word.as_str() {
                "samples" if labelled => recorded = recorded.or(next),
                "lost" if labelled => lost = lost.or(next),
                "samples" | "recorded" => loose_recorded = loose_recorded.or(prev),
                "lost" => loose_lost = loose_lost.or(prev),
                _ => {}
            }
        }
    }
    (recorded.or(loose_recorded), lost.or(loose_lost))
}

/// Recording length from rsprof-bpf's summary line `rsprof-bpf: 7.3 s on 2 CPUs at 999 Hz, ...`.
fn parse_recording_secs(text: &str) -> Option<f64> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("rsprof-bpf:"))
        .find_map(|rest| {
            let mut tokens = rest.split_whitespace();
            let secs = tokens.next()?.parse::<f64>().ok()?;
            (tokens.next()? == "s" && tokens.next()? == "on").then_some(secs)
        })
        .filter(|s| s.is_finite() && *s > 0.0)
}

/// Lost samples in a perf.data file: the LOST / LOST_SAMPLES counts of `perf report --stats`.
fn perf_lost(data: &Path) -> Option<u64> {
    let out = stdout_of(
        Command::new("perf").args(["report", "--stats", "-i"]).arg(data).stderr(Stdio::null()),
    )?;
    let mut lost = 0;
    for line in out.lines() {
        let line = line.trim();
        if let Some(rest) =
            line.strip_prefix("LOST_SAMPLES events:").or_else(|| line.strip_prefix("LOST events:"))
        {
            lost += rest.split_whitespace().next().and_then(number)?;
        }
    }
    Some(lost)
}

const STATS_SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";

/// Turns on `kernel.bpf_stats_enabled` (BPF program run times) and restores it on drop.
pub struct StatsGuard(String);

impl StatsGuard {
    pub fn enable() -> anyhow::Result<Self> {
        let old = fs::read_to_string(STATS_SYSCTL).context("read kernel.bpf_stats_enabled")?;
        fs::write(STATS_SYSCTL, "1").context("enable kernel.bpf_stats_enabled")?;
        Ok(Self(old.trim().to_owned()))
    }
}

impl Drop for StatsGuard {
    fn drop(&mut self) {
        let _ = fs::write(STATS_SYSCTL, &self.0);
    }
}

/// The rsprof-bpf to measure: `--profiler PATH`, or target/release/rsprof-bpf built now.
pub fn profiler_binary(arg: Option<&Path>) -> anyhow::Result<PathBuf> {
    match arg {
        Some(p) => {
            anyhow::ensure!(p.is_file(), "{} does not exist", p.display());
            Ok(fs::canonicalize(p)?)
        }
        None => build(),
    }
}

/// The median (upper middle) of `v`; NaN when empty.
pub fn median_f64(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

fn median_duration(values: &[Duration]) -> Option<Duration> {
    let mut v = values.to_vec();
    v.sort();
    v.get(v.len() / 2).copied()
}

fn median_u64(values: impl Iterator<Item = Option<u64>>) -> Option<u64> {
    let mut v: Vec<u64> = values.collect::<Option<Vec<u64>>>()?;
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

fn render(
    args: &BenchArgs,
    alone: &[Duration],
    tools: &[(Tool, Config)],
    cpus: u64,
    iterations: u64,
    fixture: &Path,
    machine: &str,
) -> String {
    let alone_median = median_duration(alone);
    let mut s = String::new();
    let _ = writeln!(s, "## Overhead: `{}`\n", args.command_line());
    let _ = writeln!(s, "- Date: {}", utc_now());
    let _ = writeln!(s, "- Machine: {machine}");
    let _ = writeln!(
        s,
        "- Workload: `tests/fixtures/bench_work.c`, {cpus} threads × {iterations} hash iterations \
         (fixed work), built with `gcc {}`",
        ::tests::fixtures::C_FLAGS.join(" ")
    );
    let _ = writeln!(
        s,
        "- Each configuration ran {}, interleaved; medians shown. Profilers start at least \
         {:.1} s before the workload (rsprof-bpf: and after its \"sampling\" line) and get \
         SIGINT right after it exits.",
        if args.runs == 1 { "once".to_owned() } else { format!("{} times", args.runs) },
        STARTUP.as_secs_f64()
    );
    let _ = writeln!(
        s,
        "- Exact commands: `{} {iterations} {cpus}`; `rsprof-bpf --all -F 999 -o \
         <tmp>/bench.json.gz`; `perf record -a -g -F 999 -o <tmp>/perf.data`\n",
        fixture.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
    );
    let _ = writeln!(
        s,
        "| Configuration | Workload wall time | vs. alone | Profiler CPU (user+sys) | \
         Profiler peak RSS | Samples recorded | Expected (999 × {cpus} CPUs × s) | Recorded / \
         expected | Lost |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let _ = writeln!(
        s,
        "| workload alone | {} | 1.000 | – | – | – | – | – | – |",
        alone_median.map_or("n/a".into(), secs)
    );
    for (tool, config) in tools {
        if let Some(err) = &config.error {
            let first = err.lines().next().unwrap_or("");
            let _ = writeln!(
                s,
                "| `{}` | failed: {} | | | | | | | |",
                tool.label,
                first.replace('|', "\\|")
            );
            continue;
        }
        let walls: Vec<Duration> = config.runs.iter().map(|r| r.fixture_wall).collect();
        let wall = median_duration(&walls);
        let ratio = match (wall, alone_median) {
            (Some(w), Some(a)) if !a.is_zero() => {
                format!("{:.3}", w.as_secs_f64() / a.as_secs_f64())
            }
            _ => "n/a".into(),
        };
        let cpu = median_duration(&config.runs.iter().map(|r| r.cpu).collect::<Vec<_>>());
        let rss = median_u64(config.runs.iter().map(|r| Some(r.max_rss_kib)));
        let recorded = median_u64(config.runs.iter().map(|r| r.recorded));
        let expected =
            median_u64(config.runs.iter().map(|r| {
                Some((FREQ as f64 * cpus as f64 * r.window.as_secs_f64()).round() as u64)
            }));
        let fraction = match (recorded, expected) {
            (Some(r), Some(e)) if e > 0 => format!("{:.1} %", 100.0 * r as f64 / e as f64),
            _ => "n/a".into(),
        };
        let lost = median_u64(config.runs.iter().map(|r| r.lost));
        let _ = writeln!(
            s,
            "| `{}` | {} | {ratio} | {} | {} | {} | {} | {fraction} | {} |",
            tool.label,
            wall.map_or("n/a".into(), secs),
            cpu.map_or("n/a".into(), secs),
            rss.map_or("n/a".into(), |kib| format!("{:.1} MiB", kib as f64 / 1024.0)),
            opt(recorded),
            opt(expected),
            opt(lost),
        );
    }
    let _ = writeln!(
        s,
        "\nExpected samples = 999 Hz × online CPUs × recording seconds: for rsprof-bpf the \
         duration from its own summary, for perf the time from its start to SIGINT. That window \
         includes at least {:.1} s before the workload, while the CPUs are mostly idle, and a \
         CPU-clock sampling timer rarely fires on an idle (tickless) CPU, so both tools stay \
         below 100 % without losing anything. rsprof-bpf's recorded and lost counts come from its exit \
         summary (`samples: N recorded, M lost`), perf's from its `(N samples)` line and \
         `perf report --stats`. Profiler CPU time and peak RSS are the user-space process's \
         (from `wait4`); time spent in BPF programs and perf's kernel side shows up in the \
         workload's wall time instead.",
        STARTUP.as_secs_f64()
    );
    let _ = writeln!(s, "\nRaw workload wall times (s):\n");
    let raw = |v: &[Duration]| {
        v.iter().map(|d| format!("{:.3}", d.as_secs_f64())).collect::<Vec<_>>().join(", ")
    };
    let _ = writeln!(s, "- alone: {}", raw(alone));
    for (tool, config) in tools {
        let walls: Vec<Duration> = config.runs.iter().map(|r| r.fixture_wall).collect();
        let _ = writeln!(s, "- `{}`: {}", tool.label, raw(&walls));
    }
    s
}

fn machine_description(cpus: u64, perf_version: Option<&str>) -> String {
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into());
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_owned())
        .unwrap_or_else(|| "unknown CPU".into());
    let meminfo = fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|kib| kib.parse::<f64>().ok())
        .map(|kib| format!(", {:.1} GiB RAM", kib / 1024.0 / 1024.0))
        .unwrap_or_default();
    format!(
        "{cpus} online CPUs (nproc), {model}{mem}; kernel {kernel}; {}",
        perf_version.unwrap_or("perf not installed")
    )
}

/// Current UTC time as `YYYY-MM-DD HH:MM UTC`.
pub(crate) fn utc_now() -> String {
    let secs =
        SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02} UTC", rem / 3600, rem % 3600 / 60)
}

/// Proleptic Gregorian date of a count of days since 1970-01-01.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    // Shift the epoch to 0000-03-01 so leap days fall at the end of each year, then split into
    // 400-year eras of 146097 days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of era, 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // year of era, 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of (March-based) year
    let mp = (5 * doy + 2) / 153; // month index, March = 0
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Replaces this benchmark's generated section of BENCHMARKS.md (or appends it, or creates
/// the file).
fn update_benchmarks_md(path: &Path, table: &str) -> anyhow::Result<()> {
    update_section(path, SECTION_BEGIN, SECTION_END, table)
}

/// A `kB` field of `/proc/PID/status` (`key` with its colon, e.g. `"VmRSS:"`); None once the
/// process is gone or the field is missing.
/// utime + stime of `pid` from /proc/PID/stat, seconds: every thread, exited ones included, in
/// clock ticks (10 ms).
pub fn stat_cpu_seconds(pid: u32) -> Option<f64> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f: Vec<&str> = s.rsplit_once(')')?.1.split_whitespace().collect();
    // After the command: state is field 3, utime 14 and stime 15.
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: plain sysconf.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some(ticks as f64 / hz)
}

/// A process's CPU time read two ways: its live threads' run time in ns (the first field of
/// `/proc/PID/task/*/schedstat`) and utime + stime in 10 ms ticks. A tool costing tens of ms a
/// minute needs the first; only the second counts threads that exited in between.
pub struct CpuReading {
    threads_s: f64,
    tids: std::collections::BTreeSet<u32>,
    stat_s: f64,
}

impl CpuReading {
    pub fn of(pid: u32) -> Option<Self> {
        let mut threads_s = 0.0;
        let mut tids = std::collections::BTreeSet::new();
        for e in fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
            let Some(tid) = e.file_name().to_str().and_then(|t| t.parse().ok()) else { continue };
            // A thread that exits between the listing and the read is left out.
            let Ok(st) = fs::read_to_string(e.path().join("schedstat")) else { continue };
            let ns: u64 = st.split_whitespace().next()?.parse().ok()?;
            threads_s += ns as f64 / 1e9;
            tids.insert(tid);
        }
        Some(Self { threads_s, tids, stat_s: stat_cpu_seconds(pid)? })
    }

    /// CPU seconds from `earlier` to this reading: by the threads' run time when every thread
    /// of `earlier` is still there, else by the ticks.
    pub fn since(&self, earlier: &Self) -> f64 {
        if earlier.tids.is_subset(&self.tids) {
            self.threads_s - earlier.threads_s
        } else {
            self.stat_s - earlier.stat_s
        }
    }
}

pub fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Replaces the section between the `begin` and `end` marker lines of a generated file (or
/// appends it, or creates the file). Every `cargo xtask bench*` owns one section.
/// Prints a benchmark's section and, unless `no_write`, puts it in BENCHMARKS.md between
/// `begin` and `end`.
pub fn publish(table: &str, no_write: bool, begin: &str, end: &str) -> anyhow::Result<()> {
    println!("\n{table}");
    if no_write {
        println!("--no-write: BENCHMARKS.md not updated");
        return Ok(());
    }
    let path = workspace_root().join("BENCHMARKS.md");
    update_section(&path, begin, end, table)?;
    println!("updated {}", path.display());
    Ok(())
}

pub fn update_section(path: &Path, begin: &str, end: &str, table: &str) -> anyhow::Result<()> {
    let section = format!("{begin}\n{table}{end}\n");
    let old = match fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    // The end marker is searched after the begin marker: a stray end marker earlier in the
    // file must not make every run append another copy of the section.
    let found = old.find(begin).and_then(|b| old[b..].find(end).map(|e| (b, b + e)));
    let new = match found {
        Some((b, e)) => {
            let stop = e + end.len();
            let stop = if old[stop..].starts_with('\n') { stop + 1 } else { stop };
            format!("{}{section}{}", &old[..b], &old[stop..])
        }
        _ if old.trim().is_empty() => format!(
            "# Benchmarks\n\nProfiling overhead of rsprof-bpf, measured with `cargo xtask bench` \
             (see `xtask/src/bench.rs`). Re-run it to refresh the section below.\n\n{section}"
        ),
        _ => {
            let sep = if old.ends_with('\n') { "\n" } else { "\n\n" };
            format!("{old}{sep}{section}")
        }
    };
    fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn section_replaced_even_after_a_stray_end_marker() {
        let dir = std::env::temp_dir().join(format!("bench-md-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("B.md");
        fs::write(&path, "intro\nEND\nold tail\nBEGIN\nold\nEND\nafter\n").unwrap();
        update_section(&path, "BEGIN", "END", "new\n").unwrap();
        let got = fs::read_to_string(&path).unwrap();
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(got, "intro\nEND\nold tail\nBEGIN\nnew\nEND\nafter\n");
    }

    #[test]
    fn parses_rsprof_summary() {
        assert_eq!(
            parse_samples("wrote x.json.gz\nsamples: 14,210 recorded, 3 lost\n"),
            (Some(14210), Some(3))
        );
        assert_eq!(parse_samples("samples: 12\nlost: 0\n"), (Some(12), Some(0)));
        assert_eq!(parse_samples("nothing here"), (None, None));
        assert_eq!(
            parse_samples("pid 7: 40 samples\nsamples: 900 recorded, 0 lost\n"),
            (Some(900), Some(0))
        );
    }

    #[test]
    fn parses_perf_summary() {
        let text = "[ perf record: Woken up 2 times to write data ]\n\
                    [ perf record: Captured and wrote 0.368 MB /tmp/pa.data (2985 samples) ]\n";
        assert_eq!(parse_samples(text), (Some(2985), None));
    }

    #[test]
    fn parses_recording_secs() {
        let text = "rsprof-bpf: sampling all processes on 2 CPUs at 999 Hz; Ctrl-C to stop\n\
                    rsprof-bpf: 7.3 s on 2 CPUs at 999 Hz, stopped by Ctrl-C\n\
                    samples: 14000 recorded, 0 lost\n";
        assert_eq!(parse_recording_secs(text), Some(7.3));
        assert_eq!(parse_samples(text), (Some(14000), Some(0)));
        assert_eq!(parse_recording_secs("rsprof-bpf: error: x"), None);
    }

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        assert_eq!(civil_from_days(20_454), (2026, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }

    #[test]
    fn medians() {
        let d = |ms| Duration::from_millis(ms);
        assert_eq!(median_duration(&[d(3), d(1), d(2)]), Some(d(2)));
        assert_eq!(median_duration(&[]), None);
        assert_eq!(median_u64([Some(5), None].into_iter()), None);
        assert_eq!(median_u64([Some(5), Some(1), Some(9)].into_iter()), Some(5));
    }

    #[test]
    fn section_is_replaced() {
        let dir = std::env::temp_dir().join(format!("xtask-bench-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("BENCHMARKS.md");
        update_benchmarks_md(&path, "first\n").unwrap();
        let once = fs::read_to_string(&path).unwrap();
        assert!(once.starts_with("# Benchmarks"));
        fs::write(&path, format!("{once}\n## Notes\nkept\n")).unwrap();
        update_benchmarks_md(&path, "second\n").unwrap();
        let twice = fs::read_to_string(&path).unwrap();
        assert!(twice.contains("second\n") && !twice.contains("first\n"));
        assert!(twice.ends_with("## Notes\nkept\n"));
        assert_eq!(twice.matches(SECTION_BEGIN).count(), 1);
        fs::remove_dir_all(&dir).unwrap();
    }
}
