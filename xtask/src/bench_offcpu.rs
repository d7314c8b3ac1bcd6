//! `cargo xtask bench-offcpu`: what off-CPU recording costs a context-switch-heavy program.
//!
//! Two workloads from the `offcpu` fixture, each run alone and while a profiler records the
//! whole machine, in turn, `--runs` times (configurations interleaved; each run's slowdown is
//! against that run's unprofiled measurement, the median and the range reported):
//!
//! * `pingpong SECONDS`: two threads passing a byte over two pipes as fast as they can, every
//!   read a block and a wakeup (the maximum rate); slowdown = 1 − rate / rate alone.
//! * `pingwork ROUND_TRIPS ITERS`: the same with ITERS iterations of work by each side before
//!   passing the byte on, ITERS calibrated first so that it runs at about `--paced-rate`
//!   blocking reads per second alone, ROUND_TRIPS so that it takes `--seconds` alone;
//!   slowdown = completion time / completion time alone − 1.
//!
//! Configurations:
//! 1. no profiler;
//! 2. `rsprof-bpf -a` (CPU samples; its sched_switch hook only keeps CPU time current);
//! 3. `rsprof-bpf -a --off-cpu`;
//! 4. `perf record -a -g -e sched:sched_switch`, perf's way to get blocking stacks without
//!    `perf record --off-cpu` (which needs a perf built with BUILD_BPF_SKEL=1; Debian's is not:
//!    the option is ignored with a warning, checked at run time and said in the table).
//!
//! Profiler CPU is the user+sys time of the profiler process (`wait4`) over the fixture's run;
//! BPF time is charged to the switching tasks, so it shows in the slowdown.

use std::fmt::Write as _;
use std::fs;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, bail};

use crate::{
    bench::{median_f64, profiler_binary, utc_now},
    display, step, workspace_root,
};

const SECTION_BEGIN: &str =
    "<!-- BEGIN cargo xtask bench-offcpu (generated; edits are overwritten) -->";
const SECTION_END: &str = "<!-- END cargo xtask bench-offcpu -->";

#[derive(clap::Args)]
pub struct BenchOffCpuArgs {
    /// Length of each ping-pong run (alone, for the paced one).
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Blocking reads per second of the paced ping-pong alone.
    #[arg(long, default_value_t = 100_000.0)]
    paced_rate: f64,
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

#[derive(Clone, Copy, Debug, Default)]
struct Run {
    /// Blocking reads per second.
    rate: f64,
    profiler_cpu_s: f64,
    fixture_s: f64,
    /// The fixture's own user+sys time (other load on the machine adds little to it).
    fixture_cpu_s: f64,
    /// Run time of all the profiler's BPF programs over the fixture's run, per blocking read
    /// (rsprof-bpf only).
    bpf_ns_per_read: Option<f64>,
}

/// What the fixture printed and used.
struct Done {
    rate: f64,
    seconds: f64,
    reads: f64,
    cpu_s: f64,
}

/// What the fixture runs.
#[derive(Clone, Copy, Debug)]
enum Workload {
    /// `pingpong SECONDS`.
    MaxRate(f64),
    /// `pingwork ROUND_TRIPS ITERS`.
    Paced { round_trips: u64, iters: u64 },
}

/// Runs the fixture pinned to the last CPU: both threads on one CPU make every pass a direct
/// switch between them, and spare the runs the wakeup latency of an idle (virtual) CPU, which
/// otherwise dominates and varies with what else keeps the CPUs awake (a profiler's timer
/// included: unpinned, the ping-pong ran faster under a profiler than alone).
fn pingpong(fixture: &Path, w: Workload) -> anyhow::Result<Done> {
    use std::os::unix::process::CommandExt as _;
    let mut cmd = Command::new(fixture);
    match w {
        Workload::MaxRate(secs) => cmd.args(["pingpong", &secs.to_string()]),
        Workload::Paced { round_trips, iters } => {
            cmd.args(["pingwork", &round_trips.to_string(), &iters.to_string()])
        }
    };
    let cpu = std::thread::available_parallelism().map_or(0, |n| n.get() - 1);
    // SAFETY: only sched_setaffinity, async-signal-safe, between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("run the pingpong fixture")?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().expect("piped"), &mut text)?;
    let (status, ru) = wait4(&mut child)?;
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!("pingpong fixture failed ({status:#x})");
    }
    let get = |key: &str| -> anyhow::Result<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
            .with_context(|| format!("no {key:?} in the fixture's output {text:?}"))
    };
    let (n, s) = (get("switches")?, get("seconds")?);
    Ok(Done { rate: n / s, seconds: s, reads: n, cpu_s: cpu_seconds(&ru) })
}

/// Reaps `child`, returning its wait status and resource usage.
fn wait4(child: &mut Child) -> anyhow::Result<(i32, libc::rusage)> {
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it in.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers to locals; `pid` is our unreaped child.
    if unsafe { libc::wait4(pid, &mut status, 0, &mut ru) } != pid {
        bail!("wait4: {}", std::io::Error::last_os_error());
    }
    let _ = child.try_wait();
    Ok((status, ru))
}

/// Sum of `run_time_ns` over the BPF programs `pid` holds (from /proc/PID/fdinfo; counted
/// while BPF run-time statistics are on).
fn bpf_run_time_ns(pid: u32) -> u64 {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/fdinfo")) else { return 0 };
    let mut seen = std::collections::HashSet::new();
    let mut total = 0;
    for e in dir.flatten() {
        let Ok(info) = fs::read_to_string(e.path()) else { continue };
        let field =
            |k: &str| info.lines().find_map(|l| l.strip_prefix(k)?.trim().parse::<u64>().ok());
        if let (Some(id), Some(ns)) = (field("prog_id:"), field("run_time_ns:"))
            && seen.insert(id)
        {
            total += ns;
        }
    }
    total
}

/// Holds BPF run-time statistics on while alive (`BPF_ENABLE_STATS`: reference-counted, so it
/// neither needs nor disturbs the `kernel.bpf_stats_enabled` sysctl).
struct BpfStats {
    _fd: std::os::fd::OwnedFd,
}

impl BpfStats {
    fn enable() -> anyhow::Result<Self> {
        use std::os::fd::FromRawFd as _;
        const BPF_ENABLE_STATS: libc::c_long = 32;
        const BPF_STATS_RUN_TIME: u32 = 0;
        // union bpf_attr's enable_stats: { __u32 type; }, zero-padded.
        let mut attr = [0u8; 128];
        attr[..4].copy_from_slice(&BPF_STATS_RUN_TIME.to_ne_bytes());
        // SAFETY: the bpf syscall reads `attr` (valid, 128 bytes) and returns a new fd.
        let fd = unsafe {
            libc::syscall(libc::SYS_bpf, BPF_ENABLE_STATS, attr.as_ptr(), attr.len() as u32)
        };
        if fd < 0 {
            bail!("BPF_ENABLE_STATS: {}", std::io::Error::last_os_error());
        }
        // SAFETY: a new fd we own.
        Ok(Self { _fd: unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) } })
    }
}

/// The paced workload: work per pass so that it runs at `rate` blocking reads per second
/// alone on an otherwise idle CPU, from the fixture's CPU time per pass (one CPU: a pass's
/// wall time when nothing else runs there) measured with and without work, the best of 3
/// each; CPU time, as wall time on a shared machine varies with the other load.
fn calibrate(fixture: &Path, rate: f64, secs: f64) -> anyhow::Result<Workload> {
    const PROBE_ITERS: u64 = 4000;
    let pass = |iters: u64| -> anyhow::Result<f64> {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let d = pingpong(fixture, Workload::Paced { round_trips: 20_000, iters })?;
            best = best.min(d.cpu_s / d.reads.max(1.0));
        }
        Ok(best)
    };
    let (bare, worked) = (pass(0)?, pass(PROBE_ITERS)?);
    let per_iter = (worked - bare) / PROBE_ITERS as f64;
    if per_iter <= 0.0 || 1.0 / rate <= bare {
        bail!(
            "cannot pace the ping-pong to {rate:.0}/s: a pass takes {:.2} us bare, {:.2} us with {PROBE_ITERS} iterations",
            bare * 1e6,
            worked * 1e6
        );
    }
    let iters = ((1.0 / rate - bare) / per_iter).round() as u64;
    Ok(Workload::Paced { round_trips: (rate * secs / 2.0) as u64, iters })
}

fn cpu_seconds(ru: &libc::rusage) -> f64 {
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Stops `child` with SIGINT and returns its stderr and CPU seconds.
fn stop(mut child: Child, mut stderr: impl std::io::Read) -> anyhow::Result<(String, f64)> {
    let pid = child.id() as libc::pid_t;
    // SAFETY: signalling our own unreaped child.
    unsafe { libc::kill(pid, libc::SIGINT) };
    let mut text = String::new();
    stderr.read_to_string(&mut text)?;
    let (status, ru) = wait4(&mut child)?;
    // perf re-raises the SIGINT it stopped on.
    let interrupted = libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGINT;
    if !(interrupted || libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        bail!("profiler failed ({status:#x}):\n{text}");
    }
    Ok((text, cpu_seconds(&ru)))
}

/// rsprof-bpf recording the whole machine while the fixture runs.
fn under_rsprof(
    profiler: &Path,
    extra: &[&str],
    fixture: &Path,
    w: Workload,
    out: &Path,
) -> anyhow::Result<Run> {
    let mut cmd = Command::new(profiler);
    cmd.args(["-v", "-a", "-F", "999"]).args(extra).arg("-o").arg(out);
    println!("$ {}", display(&cmd));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("start rsprof-bpf")?;
    let mut lines = BufReader::new(child.stderr.take().expect("piped stderr"));
    let mut line = String::new();
    // The fixture starts once the profiler samples.
    loop {
        line.clear();
        if lines.read_line(&mut line)? == 0 {
            bail!("rsprof-bpf exited before sampling");
        }
        if line.contains("rsprof-bpf: sampling") {
            break;
        }
    }
    let bpf0 = bpf_run_time_ns(child.id());
    let d = pingpong(fixture, w)?;
    let bpf_ns = bpf_run_time_ns(child.id()).saturating_sub(bpf0);
    let (text, cpu) = stop(child, lines)?;
    for l in text.lines().filter(|l| l.contains("off-CPU: ") || l.contains("stacks walked")) {
        println!("  {}", l.trim());
    }
    Ok(Run {
        rate: d.rate,
        profiler_cpu_s: cpu,
        fixture_s: d.seconds,
        fixture_cpu_s: d.cpu_s,
        bpf_ns_per_read: Some(bpf_ns as f64 / d.reads.max(1.0)),
    })
}

/// Whether this perf honours `--off-cpu` (built with BPF skeletons).
fn perf_has_off_cpu(dir: &Path) -> bool {
    let out = Command::new("perf")
        .args(["record", "--off-cpu", "-o"])
        .arg(dir.join("probe.data"))
        .args(["--", "true"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .output();
    match out {
        Ok(o) => o.status.success() && !String::from_utf8_lossy(&o.stderr).contains("ignored"),
        Err(_) => false,
    }
}

fn under_perf(args: &[&str], fixture: &Path, w: Workload, out: &Path) -> anyhow::Result<Run> {
    let mut cmd = Command::new("perf");
    cmd.arg("record").args(args).arg("-o").arg(out);
    println!("$ {}", display(&cmd));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("start perf record")?;
    let stderr = child.stderr.take().expect("piped stderr");
    // perf says nothing when it starts recording; give it a moment to set up its events.
    std::thread::sleep(Duration::from_secs(1));
    let d = pingpong(fixture, w)?;
    let (_, cpu) = stop(child, stderr)?;
    // perf.data is hundreds of MB here: written back now, not during the next measurement.
    let _ = fs::remove_file(out);
    // SAFETY: plain syscall.
    unsafe { libc::sync() };
    Ok(Run {
        rate: d.rate,
        profiler_cpu_s: cpu,
        fixture_s: d.seconds,
        fixture_cpu_s: d.cpu_s,
        bpf_ns_per_read: None,
    })
}

pub fn bench_offcpu(args: BenchOffCpuArgs) -> anyhow::Result<()> {
    if !crate::is_root() {
        bail!("the benchmark must run as root (rsprof-bpf loads BPF programs)");
    }
    if args.runs == 0 || args.seconds.is_nan() || args.seconds <= 0.0 {
        bail!("--runs and --seconds must be positive");
    }
    let profiler = profiler_binary(args.profiler.as_deref())?;
    step("bench-offcpu: building tests/fixtures/offcpu.c");
    let fixture = ::tests::fixtures::build("offcpu.c")?;
    let tmp = std::env::temp_dir().join(format!("rsprof-bench-offcpu-{}", std::process::id()));
    fs::create_dir_all(&tmp)?;
    let perf_off_cpu = perf_has_off_cpu(&tmp);
    let mut perf_args = vec!["-a", "-g", "-e", "sched:sched_switch"];
    if perf_off_cpu {
        perf_args = vec!["-a", "-g", "--off-cpu"];
    }
    let out = tmp.join("bench.json");
    let data = tmp.join("perf.data");
    step(&format!("bench-offcpu: pacing the ping-pong to {:.0} blocking reads/s", args.paced_rate));
    let paced = calibrate(&fixture, args.paced_rate, args.seconds)?;
    let _stats = BpfStats::enable()?;
    println!("  {paced:?}");
    let workloads = [Workload::MaxRate(args.seconds), paced];
    // results[workload][configuration]
    let mut results: Vec<Vec<Vec<Run>>> = vec![vec![Vec::new(); 4]; 2];
    for run in 0..args.runs {
        step(&format!("bench-offcpu: run {}/{}", run + 1, args.runs));
        for (wi, &w) in workloads.iter().enumerate() {
            let r = &mut results[wi];
            let d = pingpong(&fixture, w)?;
            println!("  {w:?} alone: {:.0} blocking reads/s, {:.3} s", d.rate, d.seconds);
            r[0].push(Run {
                rate: d.rate,
                fixture_s: d.seconds,
                fixture_cpu_s: d.cpu_s,
                ..Run::default()
            });
            let x = under_rsprof(&profiler, &[], &fixture, w, &out)?;
            println!(
                "  rsprof-bpf -a: {:.0}/s, {:.3} s, profiler CPU {:.2} s",
                x.rate, x.fixture_s, x.profiler_cpu_s
            );
            r[1].push(x);
            let x = under_rsprof(&profiler, &["--off-cpu"], &fixture, w, &out)?;
            println!(
                "  rsprof-bpf -a --off-cpu: {:.0}/s, {:.3} s, profiler CPU {:.2} s",
                x.rate, x.fixture_s, x.profiler_cpu_s
            );
            r[2].push(x);
            let x = under_perf(&perf_args, &fixture, w, &data)?;
            println!(
                "  perf: {:.0}/s, {:.3} s, perf CPU {:.2} s",
                x.rate, x.fixture_s, x.profiler_cpu_s
            );
            r[3].push(x);
        }
    }
    let _ = fs::remove_dir_all(&tmp);
    let table = render(&args, &perf_args, perf_off_cpu, paced, &results);
    println!("{table}");
    if !args.no_write {
        crate::bench::update_section(
            &workspace_root().join("BENCHMARKS.md"),
            SECTION_BEGIN,
            SECTION_END,
            &table,
        )?;
        println!("updated BENCHMARKS.md");
    }
    Ok(())
}

/// Median and range of `v`.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let (lo, hi) = (v.first().copied().unwrap_or(f64::NAN), v.last().copied().unwrap_or(f64::NAN));
    (median_f64(v), lo, hi)
}

fn render(
    args: &BenchOffCpuArgs,
    perf_args: &[&str],
    perf_off_cpu: bool,
    paced: Workload,
    results: &[Vec<Vec<Run>>],
) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "## Off-CPU recording under a context-switch storm: `cargo xtask bench-offcpu`\n"
    );
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let _ = writeln!(t, "- Date: {}; {cpus} CPUs; kernel {}", utc_now(), kernel.trim());
    let mut cmd = "cargo xtask bench-offcpu".to_owned();
    if args.seconds != 3.0 {
        let _ = write!(cmd, " --seconds {}", args.seconds);
    }
    if args.paced_rate != 100_000.0 {
        let _ = write!(cmd, " --paced-rate {}", args.paced_rate);
    }
    if args.runs != 3 {
        let _ = write!(cmd, " --runs {}", args.runs);
    }
    let Workload::Paced { round_trips, iters } = paced else { unreachable!() };
    let _ = writeln!(
        t,
        "- Command: `{cmd}`; {} runs, configurations interleaved; slowdowns are per run against that run's unprofiled measurement, shown as median (min – max)",
        args.runs
    );
    let _ = writeln!(
        t,
        "- Workloads (`tests/fixtures/offcpu.c`): **max rate** `pingpong {}` (two threads passing a byte over two pipes as fast as they can; every read blocks), slowdown = 1 − rate / rate alone; **paced** `pingwork {round_trips} {iters}` (the same with {iters} iterations of work by each side per pass, calibrated to ~{:.0} blocking reads/s alone), slowdown = completion time / time alone − 1",
        args.seconds, args.paced_rate
    );
    let _ = writeln!(
        t,
        "- perf: `perf record {}`{}",
        perf_args.join(" "),
        if perf_off_cpu {
            ""
        } else {
            " — this perf ignores `--off-cpu` (\"no BUILD_BPF_SKEL=1\", Debian's build), so perf's off-CPU stacks come from recording every sched_switch with its call graph"
        }
    );
    let _ = writeln!(
        t,
        "- The fixture runs pinned to one CPU (both threads: every pass is a switch between them). Fixture CPU per read = its user+sys / blocking reads (change against alone): little affected by other load on the machine, unlike the wall-clock slowdown. BPF time per read = `run_time_ns` of all rsprof-bpf's BPF programs (BPF run-time statistics on for the whole benchmark, which adds ~20–40 ns to every program run) / the fixture's blocking reads, machine-wide during its run. Profiler CPU = user+sys of the profiler process / run length (median); BPF time is charged to the switching tasks, not to it.\n"
    );
    let names = [
        "no profiler".to_owned(),
        "`rsprof-bpf -a -F 999`".to_owned(),
        "`rsprof-bpf -a -F 999 --off-cpu`".to_owned(),
        format!("`perf record {}`", perf_args.join(" ")),
    ];
    let titles = [
        "Max rate (`pingpong`): slowdown = 1 − rate / rate alone",
        "Paced to ~100k blocking reads/s (`pingwork`): slowdown = completion time / time alone − 1",
    ];
    for (wi, runs) in results.iter().enumerate() {
        let _ = writeln!(t, "{}\n", titles[wi]);
        let _ = writeln!(
            t,
            "| Configuration | Blocking reads/s | Slowdown | Fixture CPU per read | BPF time per read | Profiler CPU |"
        );
        let _ = writeln!(t, "|---|---:|---:|---:|---:|---:|");
        let cpu_per_read = |r: &Run| r.fixture_cpu_s / (r.rate * r.fixture_s).max(1.0);
        for (i, name) in names.iter().enumerate() {
            let rate = median_f64(runs[i].iter().map(|r| r.rate).collect());
            if i == 0 {
                let c = median_f64(runs[0].iter().map(cpu_per_read).collect());
                let _ = writeln!(t, "| {name} | {rate:.0} | – | {:.2} µs | – | – |", c * 1e6);
                continue;
            }
            let pct = |v: Vec<f64>| {
                let (m, lo, hi) = spread(v);
                format!("{:+.1}% ({:+.1} – {:+.1})", 100.0 * m, 100.0 * lo, 100.0 * hi)
            };
            let pairs = || runs[i].iter().zip(&runs[0]);
            let slow = pct(pairs()
                .map(|(r, alone)| {
                    if wi == 0 {
                        1.0 - r.rate / alone.rate
                    } else {
                        r.fixture_s / alone.fixture_s - 1.0
                    }
                })
                .collect());
            let cpu = pct(pairs()
                .map(|(r, alone)| cpu_per_read(r) / cpu_per_read(alone) - 1.0)
                .collect());
            let bpf = if runs[i].iter().all(|r| r.bpf_ns_per_read.is_some()) {
                let (m, lo, hi) =
                    spread(runs[i].iter().filter_map(|r| r.bpf_ns_per_read).collect());
                format!("{m:.0} ns ({lo:.0} – {hi:.0})")
            } else {
                "n/a".to_owned()
            };
            let prof = median_f64(
                runs[i].iter().map(|r| r.profiler_cpu_s / r.fixture_s.max(1e-9)).collect(),
            );
            let _ = writeln!(
                t,
                "| {name} | {rate:.0} | {slow} | {cpu} | {bpf} | {:.1}% |",
                100.0 * prof
            );
        }
        let _ = writeln!(t);
    }
    t
}
