//! `cargo xtask bench-unwind`: user stack unwinding without frame pointers, side by side in one
//! run: `rsprof-bpf --unwind dwarf`, `rsprof-bpf --unwind fp`, `perf record --call-graph dwarf`
//! (plus its `perf script`) and samply, on two workloads built without frame pointers:
//!
//! 1. `tests/fixtures/unwind_bench.c` built `-O2 -g -fomit-frame-pointer`: main → work →
//!    hot_a / hot_b;
//! 2. the same under 24 recursive `nest` frames (`unwind_bench 23`): 30 user frames per
//!    sample, the depth at which the issue sets the BPF time target;
//! 3. `/usr/bin/python3.11` (Debian's) running `tests/fixtures/unwind_bench.py`, a pure-Python
//!    loop.
//!
//! All run forever and print how many iterations they have done every 100 ms. For each
//! workload and tool a fresh workload process starts, the tool attaches to its pid and, once it
//! samples (rsprof-bpf: its "sampling" line; perf: started with events disabled and enabled
//! through its control fifo, acknowledged; samply: its "Recording process" line), the
//! workload's rate is measured over `--secs`; then the tool gets SIGINT and writes its output.
//!
//! A stack is complete when it reaches the executable's `_start` (whose CFI ends every walk,
//! after `main` and glibc's `__libc_start_call_main` / `__libc_start_main`): judged the same way
//! from each tool's own output (rsprof-bpf's collapsed stacks, `perf script`, samply's profile
//! JSON). rsprof-bpf's own count of walks that ended complete is shown next to it.

use std::{
    collections::HashMap,
    ffi::OsString,
    fmt::Write as _,
    fs,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex, mpsc},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

mod cold_start;

use crate::{
    bench::{StatsGuard, online_cpus, profiler_binary, utc_now},
    display, step, workspace_root,
};

const SECTION_BEGIN: &str =
    "<!-- BEGIN cargo xtask bench-unwind (generated; edits are overwritten) -->";
const SECTION_END: &str = "<!-- END cargo xtask bench-unwind -->";
const PYTHON: &str = "/usr/bin/python3.11";
/// Flags of the C workload: what distributions build with (no frame pointers).
const C_FLAGS: &[&str] = &["-O2", "-g", "-fomit-frame-pointer"];
/// How long rsprof-bpf may take to say "sampling" (BPF load, unwind tables compiled and loaded).
const ATTACH_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a tool gets to write its output after SIGINT (and perf script to run).
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(900);

#[derive(clap::Args)]
pub struct BenchUnwindArgs {
    /// Measured seconds per workload and tool.
    #[arg(long, default_value_t = 20)]
    secs: u64,
    /// Sampling frequency of every tool (Hz).
    #[arg(long, default_value_t = 999)]
    freq: u64,
    /// Use this rsprof-bpf binary instead of building target/release/rsprof-bpf.
    #[arg(long)]
    profiler: Option<PathBuf>,
    /// Only print the results; leave BENCHMARKS.md alone.
    #[arg(long)]
    no_write: bool,
    /// The cold-start workload instead (its own section): `record -- rustc -O` with an empty
    /// disk cache and again warm, against perf and samply on the same command.
    #[arg(long)]
    cold_start: bool,
}

impl BenchUnwindArgs {
    fn command_line(&self) -> String {
        let mut s = "cargo xtask bench-unwind".to_owned();
        if self.cold_start {
            s.push_str(" --cold-start");
        }
        if self.secs != 20 {
            let _ = write!(s, " --secs {}", self.secs);
        }
        if self.freq != 999 {
            let _ = write!(s, " --freq {}", self.freq);
        }
        if let Some(p) = &self.profiler {
            let _ = write!(s, " --profiler {}", p.display());
        }
        s
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tool {
    Alone,
    RsprofDwarf,
    RsprofFp,
    Perf,
    Samply,
}

const TOOLS: [Tool; 5] = [Tool::Alone, Tool::RsprofDwarf, Tool::RsprofFp, Tool::Perf, Tool::Samply];

impl Tool {
    fn label(self) -> &'static str {
        match self {
            Tool::Alone => "workload alone",
            Tool::RsprofDwarf => "rsprof-bpf --unwind dwarf",
            Tool::RsprofFp => "rsprof-bpf --unwind fp",
            Tool::Perf => "perf record --call-graph dwarf + perf script",
            Tool::Samply => "samply record",
        }
    }
}

pub(crate) struct Workload {
    pub(crate) name: &'static str,
    pub(crate) program: PathBuf,
    pub(crate) args: Vec<OsString>,
}

/// rsprof-bpf's `--bpf-timing` line.
#[derive(Default, Clone, Copy, Debug)]
pub(crate) struct BpfTiming {
    /// Middles of the histogram buckets holding the median and the 99th percentile, and the
    /// mean with every sample at its bucket's middle (NaN from a binary that does not print
    /// it).
    pub(crate) median_ns: f64,
    pub(crate) p99_ns: f64,
    pub(crate) mean_ns: f64,
    /// Timed samples, and their user frames and ring buffer bytes per sample.
    pub(crate) samples: u64,
    pub(crate) frames: f64,
    pub(crate) ring_bytes: f64,
}

/// What rsprof-bpf's report says about its sampler's run time: the `--bpf-timing` histogram
/// and the kernel's own run statistics (`kernel.bpf_stats_enabled`: runs and mean ns per run,
/// filtered-out runs included).
#[derive(Default, Clone, Copy, Debug)]
pub(crate) struct BpfReport {
    pub(crate) timing: Option<BpfTiming>,
    pub(crate) stats: Option<(u64, f64)>,
}

impl BpfReport {
    pub(crate) fn parse(text: &str) -> Self {
        let num =
            |s: &str| s.trim_matches(|c: char| !c.is_ascii_digit() && c != '.').parse::<f64>().ok();
        let mut r = Self::default();
        for line in text.lines() {
            let l = line.trim();
            // "BPF sampler per sample (--bpf-timing): N samples, median X ns, p99 Y ns, mean Z
            // ns; F user frames and B ring buffer bytes per sample"
            if let Some(i) = l.find("(--bpf-timing): ") {
                let rest = &l[i + "(--bpf-timing): ".len()..];
                let after = |key: &str| {
                    rest.split_once(key)
                        .and_then(|(_, r)| r.split_whitespace().next())
                        .and_then(num)
                };
                let before = |key: &str| {
                    rest.split_once(key)
                        .and_then(|(h, _)| h.split_whitespace().last())
                        .and_then(num)
                };
                if let (Some(m), Some(p)) = (after("median "), after("p99 ")) {
                    r.timing = Some(BpfTiming {
                        median_ns: m,
                        p99_ns: p,
                        mean_ns: after("mean ").unwrap_or(f64::NAN),
                        samples: rest.split_whitespace().next().and_then(num).unwrap_or(0.0) as u64,
                        frames: before(" user frames").unwrap_or(f64::NAN),
                        ring_bytes: before(" ring buffer bytes").unwrap_or(f64::NAN),
                    });
                }
            }
            // "BPF sampler (kernel.bpf_stats_enabled): R runs, X ns per run, …"
            if let Some(i) = l.find("BPF sampler (kernel.bpf_stats_enabled): ") {
                let rest = &l[i + "BPF sampler (kernel.bpf_stats_enabled): ".len()..];
                let runs = rest.split_whitespace().next().and_then(num);
                let mean = rest
                    .split(", ")
                    .find(|p| p.ends_with(" ns per run"))
                    .and_then(|p| p.split_whitespace().next())
                    .and_then(num);
                if let (Some(runs), Some(mean)) = (runs, mean) {
                    r.stats = Some((runs as u64, mean));
                }
            }
        }
        r
    }
}

/// One tool on one workload.
#[derive(Default)]
struct Outcome {
    /// Workload iterations per second over the window.
    rate: f64,
    samples: Option<u64>,
    /// Samples whose stack reaches `_start`, from the tool's output.
    complete: Option<u64>,
    /// rsprof-bpf: walks the kernel counted as complete, and all walks.
    walks: Option<(u64, u64)>,
    /// Record CPU (utime + stime), and the post-processing's (perf script) with its wall time.
    cpu: f64,
    post: Option<(f64, f64)>,
    rss_kib: u64,
    post_rss_kib: Option<u64>,
    bpf: Option<BpfTiming>,
    /// Mean ns per run from kernel.bpf_stats_enabled (every run, filtered ones too).
    bpf_mean_ns: Option<f64>,
    bytes_per_sample: Option<f64>,
    /// rsprof-bpf's "unwind tables: …" summary line.
    tables: Option<String>,
    table_mib: Option<f64>,
    error: Option<String>,
}

pub fn bench_unwind(args: BenchUnwindArgs) -> anyhow::Result<()> {
    if !crate::is_root() {
        bail!("the benchmark must run as root (BPF, perf and samply attach to other processes)");
    }
    anyhow::ensure!(args.secs > 0, "--secs must be positive");
    let profiler = profiler_binary(args.profiler.as_deref())?;
    if args.cold_start {
        return cold_start::cold_start(&args, &profiler);
    }
    let tmp = std::env::temp_dir().join(format!("rsprof-bench-unwind-{}", std::process::id()));
    fs::create_dir_all(&tmp)?;
    let fixture = build_fixture(&tmp)?;
    anyhow::ensure!(
        Path::new(PYTHON).is_file(),
        "{PYTHON} is missing (`cargo xtask setup` installs python3.11-minimal)"
    );
    let script = workspace_root().join("tests/fixtures/unwind_bench.py");
    let workloads = [
        Workload {
            name: "C fixture (`unwind_bench.c`, -O2 -fomit-frame-pointer)",
            program: fixture.clone(),
            args: Vec::new(),
        },
        Workload {
            name: "C fixture at 30 frames (`unwind_bench 23`: main → 24 × nest → work → hot_a)",
            program: fixture,
            args: vec!["23".into()],
        },
        Workload {
            name: "python3.11 (pure-Python loop, `unwind_bench.py`)",
            program: PYTHON.into(),
            args: vec![script.into()],
        },
    ];
    // samply: installed here when missing (`cargo install`, pinned; before anything is timed);
    // if that fails, its rows say why.
    let samply = crate::setup::samply().map_err(|e| format!("{e:#}"));
    let _stats = StatsGuard::enable()?;

    let mut results = Vec::new();
    for w in &workloads {
        let mut rows = Vec::new();
        for tool in TOOLS {
            step(&format!("bench-unwind: {} under {}, {} s", w.name, tool.label(), args.secs));
            let outcome = match (tool, &samply) {
                (Tool::Samply, Err(e)) => Outcome {
                    error: Some(format!("samply unavailable: {e}")),
                    ..Default::default()
                },
                _ => {
                    run_one(&args, &profiler, samply.as_deref().ok(), w, tool, &tmp).unwrap_or_else(
                        |e| Outcome { error: Some(format!("{e:#}")), ..Default::default() },
                    )
                }
            };
            print_outcome(tool, &outcome);
            rows.push((tool, outcome));
        }
        results.push((w, rows));
    }
    let _ = fs::remove_dir_all(&tmp);
    let table = render(&args, &results);
    crate::bench::publish(&table, args.no_write, SECTION_BEGIN, SECTION_END)
}

fn build_fixture(tmp: &Path) -> anyhow::Result<PathBuf> {
    let src = workspace_root().join("tests/fixtures/unwind_bench.c");
    let out = tmp.join("unwind_bench");
    let mut cmd = Command::new("gcc");
    cmd.args(C_FLAGS).arg("-o").arg(&out).arg(&src);
    crate::run_cmd(&mut cmd)?;
    Ok(out)
}

fn print_outcome(tool: Tool, o: &Outcome) {
    match &o.error {
        Some(e) => println!("{}: FAILED: {e}", tool.label()),
        None => println!(
            "{}: {:.0} it/s, samples {:?}, complete {:?}, cpu {:.2} s (+post {:?}), rss {} KiB, \
             bpf {:?} ns median, {:?} bytes/sample, tables {:?}",
            tool.label(),
            o.rate,
            o.samples,
            o.complete,
            o.cpu,
            o.post.map(|p| p.0),
            o.rss_kib,
            o.bpf.map(|b| b.median_ns),
            o.bytes_per_sample.map(|b| b.round()),
            o.tables
        ),
    }
}

/// A running workload and its latest progress line (iterations so far, when read).
pub(crate) struct Running {
    child: Child,
    latest: Arc<Mutex<Option<(u64, Instant)>>>,
}

impl Running {
    pub(crate) fn start(w: &Workload) -> anyhow::Result<Self> {
        let mut cmd = Command::new(&w.program);
        cmd.args(&w.args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = cmd.spawn().with_context(|| format!("start {}", display(&cmd)))?;
        let latest = Arc::new(Mutex::new(None));
        let out = child.stdout.take().expect("piped");
        let l = latest.clone();
        thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(n) = line.trim().parse::<u64>() {
                    *l.lock().unwrap() = Some((n, Instant::now()));
                }
            }
        });
        let r = Running { child, latest };
        let end = Instant::now() + Duration::from_secs(60);
        while r.progress().is_none() {
            if Instant::now() > end {
                bail!("{} printed no progress within 60 s", display(&cmd));
            }
            thread::sleep(Duration::from_millis(20));
        }
        Ok(r)
    }

    pub(crate) fn progress(&self) -> Option<(u64, Instant)> {
        *self.latest.lock().unwrap()
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A tool process with its stderr collected (and stdout, for rsprof-bpf's messages).
pub(crate) struct ToolProc {
    pub(crate) pid: libc::pid_t,
    pub(crate) what: String,
    pub(crate) text: Arc<Mutex<String>>,
    pub(crate) ready: mpsc::Receiver<()>,
    _child: Child,
}

pub(crate) fn spawn_tool(
    mut cmd: Command,
    marker: Option<&'static str>,
) -> anyhow::Result<ToolProc> {
    let what = display(&cmd);
    println!("$ {what}");
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("could not start `{what}`"))?;
    let text = Arc::new(Mutex::new(String::new()));
    let (tx, ready) = mpsc::channel();
    for pipe in [
        Box::new(child.stdout.take().expect("piped")) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().expect("piped")),
    ] {
        let (text, tx) = (text.clone(), tx.clone());
        thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if marker.is_some_and(|m| line.contains(m)) {
                    let _ = tx.send(());
                }
                let mut t = text.lock().unwrap();
                t.push_str(&line);
                t.push('\n');
            }
        });
    }
    Ok(ToolProc { pid: child.id() as libc::pid_t, what, text, ready, _child: child })
}

pub(crate) struct Usage {
    pub(crate) cpu: f64,
    pub(crate) rss_kib: u64,
    pub(crate) wall: f64,
}

/// Waits for `pid` (our child) with a timeout; its CPU time from wait4, its peak RSS from
/// `VmHWM`, read every 20 ms while it lives. Not wait4's `ru_maxrss`: Linux carries the
/// high-water mark of the address space a child had before exec (a copy of ours) into it, so
/// every tool started after this process grew showed our RSS instead of its own.
pub(crate) fn reap(pid: libc::pid_t, started: Instant) -> anyhow::Result<Usage> {
    let mut hwm_kib = 0;
    let r = crate::bench::wait_with_timeout(pid, SHUTDOWN_TIMEOUT, || {
        hwm_kib = hwm_kib.max(crate::bench::status_kib(pid as u32, "VmHWM:").unwrap_or(0));
    })?;
    if !crate::bench::stopped_cleanly(r.status) {
        bail!("exited with wait status {:#x}", r.status);
    }
    let cpu = crate::bench::timeval(r.usage.ru_utime) + crate::bench::timeval(r.usage.ru_stime);
    Ok(Usage {
        cpu: cpu.as_secs_f64(),
        // A tool gone within 20 ms of SIGINT was never read: wait4's (an upper bound).
        rss_kib: if hwm_kib > 0 { hwm_kib } else { r.usage.ru_maxrss.max(0) as u64 },
        wall: started.elapsed().as_secs_f64(),
    })
}

fn run_one(
    args: &BenchUnwindArgs,
    profiler: &Path,
    samply: Option<&Path>,
    w: &Workload,
    tool: Tool,
    tmp: &Path,
) -> anyhow::Result<Outcome> {
    let work = Running::start(w)?;
    let pid = work.pid().to_string();
    let freq = args.freq.to_string();
    let mut out = Outcome::default();
    let output = tmp.join(match tool {
        Tool::Alone => "none",
        Tool::RsprofDwarf => "dwarf.folded",
        Tool::RsprofFp => "fp.folded",
        Tool::Perf => "perf.data",
        Tool::Samply => "samply.json.gz",
    });
    let _ = fs::remove_file(&output);
    let mut perf_ctl = None;
    let mut paranoid = None;
    let proc = match tool {
        Tool::Alone => None,
        Tool::RsprofDwarf | Tool::RsprofFp => {
            let mut cmd = Command::new(profiler);
            let unwind = if tool == Tool::RsprofDwarf { "dwarf" } else { "fp" };
            // -v: the full report holds the `user stacks:` and BPF timing lines read below.
            cmd.args(["-v", "-p", &pid, "--unwind", unwind, "--bpf-timing", "-F", &freq, "-o"])
                .arg(&output);
            let p = spawn_tool(cmd, Some("rsprof-bpf: sampling"))?;
            if p.ready.recv_timeout(ATTACH_TIMEOUT).is_err() {
                bail!("no \"sampling\" line{}", tail(&p.text.lock().unwrap()));
            }
            Some(p)
        }
        Tool::Perf => {
            let (ctl, ack) = (tmp.join("perf-ctl"), tmp.join("perf-ack"));
            for f in [&ctl, &ack] {
                let _ = fs::remove_file(f);
                let c = std::ffi::CString::new(f.as_os_str().as_bytes())?;
                // SAFETY: a valid C string.
                if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
                    return Err(std::io::Error::last_os_error()).context("mkfifo");
                }
            }
            let mut cmd = Command::new("perf");
            cmd.args(["record", "-e", "cpu-clock", "-F", &freq, "--call-graph", "dwarf", "-p"])
                .arg(&pid)
                .args(["-D", "-1", "--control"])
                .arg(format!("fifo:{},{}", ctl.display(), ack.display()))
                .arg("-o")
                .arg(&output);
            let p = spawn_tool(cmd, None)?;
            // Opened read-write so neither open blocks on the other end.
            let rw = |f: &Path| fs::OpenOptions::new().read(true).write(true).open(f);
            let (mut c, mut a) = (rw(&ctl)?, rw(&ack)?);
            c.write_all(b"enable\n")?;
            let (tx, rx) = mpsc::channel();
            thread::spawn(move || {
                let mut buf = [0u8; 16];
                let n = a.read(&mut buf).unwrap_or(0);
                let _ = tx.send(String::from_utf8_lossy(&buf[..n]).into_owned());
            });
            match rx.recv_timeout(Duration::from_secs(120)) {
                Ok(s) if s.starts_with("ack") => {}
                other => bail!(
                    "perf did not acknowledge \"enable\" ({other:?}){}",
                    tail(&p.text.lock().unwrap())
                ),
            }
            perf_ctl = Some(c);
            Some(p)
        }
        Tool::Samply => {
            // samply refuses to start while kernel.perf_event_paranoid > 1, even as root.
            paranoid = Some(ParanoidGuard::at_most_1()?);
            let mut cmd = Command::new(samply.context("samply missing")?);
            cmd.args(["record", "--save-only", "-r", &freq, "-p", &pid, "-o"]).arg(&output);
            let p = spawn_tool(cmd, Some("Recording process with PID"))?;
            if p.ready.recv_timeout(ATTACH_TIMEOUT).is_err() {
                bail!("samply did not say it records{}", tail(&p.text.lock().unwrap()));
            }
            Some(p)
        }
    };
    let started = Instant::now();

    // The window: the workload's progress over --secs while the tool samples.
    let (c0, t0) = work.progress().context("workload stopped")?;
    thread::sleep(Duration::from_secs(args.secs));
    let (c1, t1) = work.progress().context("workload stopped")?;
    out.rate = (c1 - c0) as f64 / (t1 - t0).as_secs_f64().max(1e-3);
    let Some(p) = proc else {
        return Ok(out);
    };
    // SAFETY: our own child.
    unsafe { libc::kill(p.pid, libc::SIGINT) };
    let usage = reap(p.pid, started)
        .with_context(|| format!("`{}` failed{}", p.what, tail(&p.text.lock().unwrap())));
    drop(perf_ctl);
    drop(paranoid);
    drop(work);
    let usage = usage?;
    out.cpu = usage.cpu;
    out.rss_kib = usage.rss_kib;
    let text = p.text.lock().unwrap().clone();
    let size = fs::metadata(&output).map(|m| m.len()).unwrap_or(0);
    if size == 0 {
        bail!("`{}` wrote no output{}", p.what, tail(&text));
    }
    match tool {
        Tool::Alone => {}
        Tool::RsprofDwarf | Tool::RsprofFp => {
            let folded = fs::read_to_string(&output)?;
            let (samples, complete) = folded_complete(&folded);
            // The few incomplete stacks of a dwarf run are worth seeing in the log: each is
            // a rare case (the tables otherwise complete every stack).
            if tool == Tool::RsprofDwarf && complete < samples {
                let incomplete = folded.lines().filter(|l| {
                    l.rsplit_once(' ').is_some_and(|(stack, _)| !folded_stack_complete(stack))
                });
                for line in incomplete.take(5) {
                    println!("  incomplete: {line}");
                }
            }
            out.samples = Some(samples);
            out.complete = Some(complete);
            parse_rsprof_summary(&text, &mut out);
            out.bytes_per_sample = out.bpf.map(|b| b.ring_bytes);
        }
        Tool::Perf => {
            let script = tmp.join("perf.script");
            let file = fs::File::create(&script)?;
            let mut cmd = Command::new("perf");
            cmd.args(["script", "-i"]).arg(&output).stdout(file).stderr(Stdio::null());
            println!("$ {} > {}", display(&cmd), script.display());
            let t = Instant::now();
            let child = cmd.spawn().context("start perf script")?;
            let u = reap(child.id() as libc::pid_t, t).context("perf script")?;
            std::mem::forget(child); // reaped above
            out.post = Some((u.cpu, u.wall));
            out.post_rss_kib = Some(u.rss_kib);
            let text = fs::read_to_string(&script)?;
            let (samples, complete) = perf_script_complete(&text);
            out.samples = Some(samples);
            out.complete = Some(complete);
            out.bytes_per_sample = Some(size as f64 / samples.max(1) as f64);
            let _ = fs::remove_file(&script);
        }
        Tool::Samply => {
            let (samples, complete) = samply_complete(&output)?;
            out.samples = Some(samples);
            out.complete = Some(complete);
            out.bytes_per_sample = Some(size as f64 / samples.max(1) as f64);
        }
    }
    let _ = fs::remove_file(&output);
    Ok(out)
}

const PARANOID: &str = "/proc/sys/kernel/perf_event_paranoid";

/// Lowers kernel.perf_event_paranoid to 1 (if above) and restores it on drop.
struct ParanoidGuard(Option<String>);

impl ParanoidGuard {
    pub(super) fn at_most_1() -> anyhow::Result<Self> {
        let old = fs::read_to_string(PARANOID).context("read kernel.perf_event_paranoid")?;
        if old.trim().parse::<i32>().is_ok_and(|v| v <= 1) {
            return Ok(Self(None));
        }
        fs::write(PARANOID, "1").context("set kernel.perf_event_paranoid to 1")?;
        Ok(Self(Some(old.trim().to_owned())))
    }
}

impl Drop for ParanoidGuard {
    fn drop(&mut self) {
        if let Some(old) = &self.0 {
            let _ = fs::write(PARANOID, old);
        }
    }
}

/// The last lines of a tool's output, for an error message.
pub(crate) fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(8);
    if lines.is_empty() {
        String::new()
    } else {
        format!("; its output:\n{}", lines[start..].join("\n"))
    }
}

/// (samples, samples whose stack has a `_start` frame) of collapsed stacks.
fn folded_complete(text: &str) -> (u64, u64) {
    let (mut all, mut complete) = (0, 0);
    for line in text.lines() {
        let Some((stack, n)) = line.rsplit_once(' ') else { continue };
        let Ok(n) = n.parse::<u64>() else { continue };
        // Off-CPU time is not recorded here; the frames after process and thread.
        all += n;
        if folded_stack_complete(stack) {
            complete += n;
        }
    }
    (all, complete)
}

/// Whether a collapsed stack (without its count) reaches `_start`: a frame after the process
/// and thread.
fn folded_stack_complete(stack: &str) -> bool {
    stack.split(';').skip(2).any(|f| f == "_start")
}

/// (samples, samples whose call chain has a `_start` frame) of `perf script` output: a header
/// line per sample, then one indented `ADDR SYMBOL+OFF (DSO)` line per frame.
fn perf_script_complete(text: &str) -> (u64, u64) {
    let (mut all, mut complete, mut this) = (0, 0, false);
    for line in text.lines() {
        if line.trim().is_empty() {
            continue;
        }
        if !line.starts_with(char::is_whitespace) {
            all += 1;
            complete += u64::from(this);
            this = false;
            continue;
        }
        let mut t = line.split_whitespace();
        let _addr = t.next();
        if let Some(sym) = t.next() {
            let name = sym.split_once("+0x").map_or(sym, |(n, _)| n);
            this |= name == "_start";
        }
    }
    complete += u64::from(this);
    (all, complete)
}

/// rsprof-bpf's summary: walks ended complete, table memory, BPF timing and run stats.
fn parse_rsprof_summary(text: &str, out: &mut Outcome) {
    let num =
        |s: &str| s.trim_matches(|c: char| !c.is_ascii_digit() && c != '.').parse::<f64>().ok();
    for line in text.lines() {
        let l = line.trim();
        // "user stacks: W walked with unwind tables: complete C (x%), …"
        if let Some(rest) = l.strip_prefix("user stacks: ") {
            let walked = rest.split_whitespace().next().and_then(num);
            let complete = rest
                .split_once("complete ")
                .and_then(|(_, r)| r.split_whitespace().next())
                .and_then(num);
            if let (Some(w), Some(c)) = (walked, complete) {
                out.walks = Some((c as u64, w as u64));
            }
        }
        // "unwind tables: N files loaded, R rows (X MiB of Y MiB); …"
        if let Some(i) = l.find("unwind tables: ") {
            let rest = &l[i..];
            out.tables = Some(rest.split(';').next().unwrap_or(rest).to_owned());
            out.table_mib =
                rest.split_once('(').and_then(|(_, r)| r.split_whitespace().next()).and_then(num);
        }
    }
    let bpf = BpfReport::parse(text);
    out.bpf = bpf.timing;
    out.bpf_mean_ns = bpf.stats.map(|(_, mean)| mean);
}

/// (samples, samples whose stack reaches `_start`) of samply's profile (the processed
/// Firefox Profiler format). Its frames are unsymbolicated (addresses relative to their
/// library); `_start` is looked up in each library's ELF symbols.
fn samply_complete(path: &Path) -> anyhow::Result<(u64, u64)> {
    let mut json = String::new();
    flate2::read::GzDecoder::new(fs::File::open(path)?)
        .read_to_string(&mut json)
        .with_context(|| format!("reading {}", path.display()))?;
    let p: serde_json::Value = serde_json::from_str(&json).context("samply profile JSON")?;
    let libs = p["libs"].as_array().context("profile has no libs")?;
    // Per library: the relative address range of `_start`, if it has one.
    let starts: Vec<Option<(u64, u64)>> = libs
        .iter()
        .map(|l| l["path"].as_str().and_then(|path| start_range(Path::new(path))))
        .collect();
    let shared_strings = p["shared"]["stringArray"].as_array();
    let (mut all, mut complete) = (0u64, 0u64);
    for t in p["threads"].as_array().context("profile has no threads")? {
        let strings = t["stringArray"].as_array().or(shared_strings);
        let stack_prefix = column(&t["stackTable"], "prefix");
        let stack_frame = column(&t["stackTable"], "frame");
        let frame_addr = column(&t["frameTable"], "address");
        let frame_func = column(&t["frameTable"], "func");
        let func_res = column(&t["funcTable"], "resource");
        let func_name = column(&t["funcTable"], "name");
        let res_lib = column(&t["resourceTable"], "lib");
        let is_start = |frame: usize| -> bool {
            let func = frame_func.get(frame).copied().flatten();
            // Symbolicated names, if samply ever writes them.
            if let (Some(f), Some(s)) = (func, strings) {
                let name = func_name.get(f as usize).copied().flatten();
                if name.and_then(|n| s.get(n as usize)).and_then(|v| v.as_str()) == Some("_start") {
                    return true;
                }
            }
            let lib = func
                .and_then(|f| func_res.get(f as usize).copied().flatten())
                .and_then(|r| res_lib.get(r as usize).copied().flatten());
            let addr = frame_addr.get(frame).copied().flatten();
            match (lib, addr) {
                (Some(l), Some(a)) => starts
                    .get(l as usize)
                    .copied()
                    .flatten()
                    .is_some_and(|(lo, hi)| (lo..hi).contains(&a)),
                _ => false,
            }
        };
        let mut memo: HashMap<usize, bool> = HashMap::new();
        let samples = t["samples"]["stack"].as_array().context("thread has no samples")?;
        for s in samples {
            all += 1;
            let Some(mut stack) = s.as_u64().map(|v| v as usize) else { continue };
            let first = stack;
            if let Some(&c) = memo.get(&first) {
                complete += u64::from(c);
                continue;
            }
            let mut found = false;
            loop {
                if let Some(f) = stack_frame.get(stack).copied().flatten() {
                    found |= is_start(f as usize);
                }
                match stack_prefix.get(stack).copied().flatten() {
                    Some(prev) => stack = prev as usize,
                    None => break,
                }
            }
            memo.insert(first, found);
            complete += u64::from(found);
        }
    }
    Ok((all, complete))
}

/// A table column as optional integers (null and negative values are None).
pub(super) fn column(table: &serde_json::Value, name: &str) -> Vec<Option<u64>> {
    table[name]
        .as_array()
        .map(|a| a.iter().map(|v| v.as_i64().filter(|&x| x >= 0).map(|x| x as u64)).collect())
        .unwrap_or_default()
}

/// The range of `_start` in `path`, relative to its lowest loaded address (as samply's
/// relative addresses are: the image base of an ELF file is its first PT_LOAD's address).
fn start_range(path: &Path) -> Option<(u64, u64)> {
    use object::{Object as _, ObjectSegment as _, ObjectSymbol as _};
    let data = fs::read(path).ok()?;
    let file = object::File::parse(&*data).ok()?;
    let base = file.segments().map(|s| s.address()).min().unwrap_or(0);
    file.symbols()
        .chain(file.dynamic_symbols())
        .find(|s| s.name() == Ok("_start"))
        .map(|s| (s.address() - base, s.address() - base + s.size().max(1)))
}

fn render(args: &BenchUnwindArgs, results: &[(&Workload, Vec<(Tool, Outcome)>)]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "## Unwinding without frame pointers: `{}`\n", args.command_line());
    let perf = crate::bench::stdout_of(Command::new("perf").arg("--version"));
    let samply = crate::setup::samply_installed()
        .ok()
        .and_then(|p| crate::bench::stdout_of(Command::new(p).arg("--version")));
    let _ = writeln!(
        s,
        "Run {} on {} CPUs (kernel {}; {}; {}). One run. For each workload and tool a fresh \
         workload process; the tool attaches to its pid at {} Hz, and once it samples the \
         workload's rate is measured over {} s, then the tool gets SIGINT. Commands: \
         `rsprof-bpf -p PID --unwind dwarf|fp --bpf-timing -F {f} -o out.folded`; `perf record \
         -e cpu-clock -F {f} --call-graph dwarf -p PID -D -1 --control fifo:…` (enabled once \
         started) then `perf script -i perf.data`; `samply record --save-only -r {f} -p PID -o \
         out.json.gz`. Workloads: `tests/fixtures/unwind_bench.c` built `gcc {}` (alone, and \
         with argument 23: 24 recursive frames above `work`), and `{PYTHON} \
         tests/fixtures/unwind_bench.py`.\n",
        utc_now(),
        online_cpus(),
        fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
        perf.as_deref().map_or("perf missing", str::trim),
        samply.as_deref().map_or("samply missing", str::trim),
        args.freq,
        args.secs,
        C_FLAGS.join(" "),
        f = args.freq,
    );
    let _ = writeln!(
        s,
        "- Complete stacks: samples whose stack reaches the executable's `_start` (below `main` \
         and glibc's start frames), judged from each tool's own output (rsprof-bpf's collapsed \
         stacks, `perf script`, samply's profile JSON with `_start` looked up in the ELF \
         symbols); for `--unwind dwarf` also the walks the kernel counted as complete.\n\
         - Profiler CPU: utime + stime of the tool from start to exit (start-up, e.g. compiling \
         and loading unwind tables, and writing the output included); for perf plus `perf \
         script` (its wall time in brackets).\n\
         - BPF per sample: rsprof-bpf's hidden `--bpf-timing` (bpf_ktime_get_ns from the \
         sampler's entry to its ring buffer output, a log-linear histogram; 12.5 % buckets), \
         mean user frames per sample in brackets; after the slash the mean from \
         kernel.bpf_stats_enabled, over all runs including the cheap ones filtered out (other \
         processes), so lower.\n\
         - Bytes per sample: rsprof-bpf's ring buffer bytes (record + 8-byte header); perf's \
         perf.data size and samply's output size divided by their samples.\n\
         - Peak RSS: VmHWM, read every 20 ms until the tool exits (perf: record / script).\n"
    );
    for (w, rows) in results {
        let _ = writeln!(s, "### {}\n", w.name);
        let _ = writeln!(
            s,
            "| Tool | Samples | Complete stacks | Workload rate (vs alone) | Profiler CPU | BPF \
             ns per sample, median / p99 (frames) / mean | Bytes per sample | Unwind tables | \
             Peak RSS |"
        );
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---|---:|");
        let alone = rows.iter().find(|(t, _)| *t == Tool::Alone).map(|(_, o)| o.rate);
        for (tool, o) in rows {
            if let Some(e) = &o.error {
                let first = e.lines().next().unwrap_or("").replace('|', "\\|");
                let _ = writeln!(s, "| {} | failed: {first} | | | | | | | |", tool.label());
                continue;
            }
            let rate = match alone {
                Some(a) if a > 0.0 && *tool != Tool::Alone => {
                    format!("{:.0} it/s ({:.3})", o.rate, o.rate / a)
                }
                _ => format!("{:.0} it/s", o.rate),
            };
            if *tool == Tool::Alone {
                let _ = writeln!(s, "| {} | – | – | {rate} | – | – | – | – | – |", tool.label());
                continue;
            }
            let complete = match (o.samples, o.complete) {
                (Some(n), Some(c)) if n > 0 => {
                    let mut t = format!("{:.1} %", 100.0 * c as f64 / n as f64);
                    if let Some((c, w)) = o.walks.filter(|w| w.1 > 0) {
                        let _ = write!(
                            t,
                            " (kernel: {:.1} % of {w} walks)",
                            100.0 * c as f64 / w as f64
                        );
                    }
                    t
                }
                _ => "n/a".into(),
            };
            let cpu = match o.post {
                Some((c, wall)) => {
                    format!("{:.2} s + {c:.2} s = {:.2} s ({wall:.1} s)", o.cpu, o.cpu + c)
                }
                None => format!("{:.2} s", o.cpu),
            };
            let bpf = match o.bpf {
                Some(b) => format!(
                    "{:.0} / {:.0} ({:.1}) / {}",
                    b.median_ns,
                    b.p99_ns,
                    b.frames,
                    o.bpf_mean_ns.map_or("n/a".into(), |m| format!("{m:.0}"))
                ),
                None => "–".into(),
            };
            let rss = match o.post_rss_kib {
                Some(p) => {
                    format!("{:.1} / {:.1} MiB", o.rss_kib as f64 / 1024.0, p as f64 / 1024.0)
                }
                None => format!("{:.1} MiB", o.rss_kib as f64 / 1024.0),
            };
            let _ = writeln!(
                s,
                "| {} | {} | {complete} | {rate} | {cpu} | {bpf} | {} | {} | {rss} |",
                tool.label(),
                o.samples.map_or("n/a".into(), |n| n.to_string()),
                o.bytes_per_sample.map_or("n/a".into(), |b| format!("{b:.0}")),
                o.tables.as_deref().unwrap_or("–"),
            );
        }
        let _ = writeln!(s, "\nTargets (issue 12):\n");
        for line in targets(w, rows) {
            let _ = writeln!(s, "- {line}");
        }
        let _ = writeln!(s);
    }
    s
}

/// The issue's targets, each with the measured values and whether they were met.
fn targets(w: &Workload, rows: &[(Tool, Outcome)]) -> Vec<String> {
    let get = |t: Tool| rows.iter().find(|(x, o)| *x == t && o.error.is_none()).map(|(_, o)| o);
    let (dwarf, fp, perf) = (get(Tool::RsprofDwarf), get(Tool::RsprofFp), get(Tool::Perf));
    let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
    let pct = |o: &Outcome| match (o.samples, o.complete) {
        (Some(n), Some(c)) if n > 0 => Some(100.0 * c as f64 / n as f64),
        _ => None,
    };
    let mut v = Vec::new();
    // Counts beside the shares: 19951 of 19952 shows as 100.0 % and is still below perf's 100.
    let counts = |o: Option<&Outcome>| match o.map(|o| (o.complete, o.samples)) {
        Some((Some(c), Some(n))) => format!(" ({c} of {n})"),
        _ => String::new(),
    };
    match (dwarf.and_then(pct), perf.and_then(pct)) {
        (Some(d), Some(p)) => v.push(format!(
            "complete stacks ≥ perf's: {d:.1} %{} vs {p:.1} %{}: {}",
            counts(dwarf),
            counts(perf),
            verdict(d >= p)
        )),
        _ => v.push("complete stacks ≥ perf's: not measured (a tool failed)".into()),
    }
    match dwarf.and_then(|o| o.bpf) {
        // Shallower stacks cost less per sample: only a walk of about 30 frames judges it.
        Some(b) => v.push(format!(
            "BPF median ≤ 4 µs per sample at 30 frames: {:.0} ns at {:.1} user frames per \
             sample: {}",
            b.median_ns,
            b.frames,
            if b.frames >= 29.0 {
                verdict(b.median_ns <= 4000.0)
            } else {
                "not judged here (shallower than 30 frames)"
            }
        )),
        None => v.push("BPF median ≤ 4 µs: not measured".into()),
    }
    if let (Some(d), Some(f)) = (dwarf, fp) {
        v.push(format!(
            "CPU ≤ 1.5× frame-pointer mode: {:.2} s vs {:.2} s ({:.2}×): {}",
            d.cpu,
            f.cpu,
            d.cpu / f.cpu.max(1e-9),
            verdict(d.cpu <= 1.5 * f.cpu)
        ));
    }
    if let (Some(d), Some(p)) = (dwarf, perf) {
        let total = p.cpu + p.post.map_or(0.0, |x| x.0);
        v.push(format!(
            "CPU ≤ 1/3 of perf record + script: {:.2} s vs {total:.2} s ({:.2}×): {}",
            d.cpu,
            d.cpu / total.max(1e-9),
            verdict(3.0 * d.cpu <= total)
        ));
    }
    if w.program == Path::new(PYTHON) {
        match dwarf.and_then(|o| o.table_mib) {
            Some(m) => v.push(format!(
                "table memory for python3.11 + libc (every file the process maps) ≤ 8 MiB: \
                 {m:.1} MiB: {}",
                verdict(m <= 8.0)
            )),
            None => v.push("table memory ≤ 8 MiB: not measured".into()),
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_perf_script() {
        let text = "ub 1 1.0: 1001001 cpu-clock: \n\
                    \t124f hot_a+0x1f (/tmp/ub)\n\
                    \t1160 _start+0x20 (/tmp/ub)\n\n\
                    ub 1 1.1: 1001001 cpu-clock: \n\
                    \t124f hot_a+0x1f (/tmp/ub)\n\
                    \t12a9 [unknown] (/tmp/ub)\n\n\
                    ub 1 1.2: 1001001 cpu-clock: \n\
                    \t27249 __libc_start_call_main+0x79 (/usr/lib/libc.so.6)\n\
                    \t1160 _start+0x20 (/tmp/ub)\n";
        assert_eq!(perf_script_complete(text), (3, 2));
    }

    #[test]
    fn parses_folded() {
        let text = "ub-1;ub-1;_start;__libc_start_call_main;main;work;hot_a 30\n\
                    ub-1;ub-1;[truncated: no CFI];hot_b 5\n\
                    ub-1;ub-1;_start;main 1\n";
        assert_eq!(folded_complete(text), (36, 31));
    }

    #[test]
    fn parses_rsprof_summary() {
        let text = "rsprof-bpf: 5.0 s on 2 CPUs at 999 Hz, stopped by Ctrl-C\n\
            samples: 4990 recorded, 0 lost\n  user stacks: 4990 walked with unwind tables: \
            complete 4980 (99.8%), depth limit 0, …\n\
            unwind tables: 5 files loaded, 120000 rows (0.9 MiB of 64.0 MiB); 0 files without\n\
            BPF sampler per sample (--bpf-timing): 4990 samples, median 1800 ns, p99 5200 ns; \
            12.5 user frames and 232 ring buffer bytes per sample\n\
            BPF sampler (kernel.bpf_stats_enabled): 5000 runs, 1900 ns per run, 0.010 s in all\n";
        let mut o = Outcome::default();
        parse_rsprof_summary(text, &mut o);
        assert_eq!(o.walks, Some((4980, 4990)));
        assert_eq!(o.table_mib, Some(0.9));
        let b = o.bpf.unwrap();
        assert_eq!((b.median_ns, b.p99_ns, b.frames, b.ring_bytes), (1800.0, 5200.0, 12.5, 232.0));
        assert_eq!(o.bpf_mean_ns, Some(1900.0));
    }
}
