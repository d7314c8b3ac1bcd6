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
}

/// What the fixture runs.
#[derive(Clone, Copy, Debug)]
enum Workload {
    /// `pingpong SECONDS`.
    MaxRate(f64),
    /// `pingwork ROUND_TRIPS ITERS`.
    Paced { round_trips: u64, iters: u64 },
}

/// (blocking reads per second, seconds) printed by the fixture.
fn pingpong(fixture: &Path, w: Workload) -> anyhow::Result<(f64, f64)> {
    let mut cmd = Command::new(fixture);
    match w {
        Workload::MaxRate(secs) => cmd.args(["pingpong", &secs.to_string()]),
        Workload::Paced { round_trips, iters } => {
            cmd.args(["pingwork", &round_trips.to_string(), &iters.to_string()])
        }
    };
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .context("run the pingpong fixture")?;
    if !out.status.success() {
        bail!("pingpong fixture failed: {}", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let get = |key: &str| -> anyhow::Result<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
            .with_context(|| format!("no {key:?} in the fixture's output {text:?}"))
    };
    let (n, s) = (get("switches")?, get("seconds")?);
    Ok((n / s, s))
}

/// The paced workload: work per pass so that it runs at `rate` blocking reads per second
/// alone, from the time per pass measured with and without work (the best of 3 each).
fn calibrate(fixture: &Path, rate: f64, secs: f64) -> anyhow::Result<Workload> {
    const PROBE_ITERS: u64 = 4000;
    let pass = |iters: u64| -> anyhow::Result<f64> {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let (r, _) = pingpong(fixture, Workload::Paced { round_trips: 20_000, iters })?;
            best = best.min(1.0 / r);
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
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it in.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers to locals; `pid` is our unreaped child.
    if unsafe { libc::wait4(pid, &mut status, 0, &mut ru) } != pid {
        bail!("wait4: {}", std::io::Error::last_os_error());
    }
    let _ = child.try_wait();
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
    cmd.args(["-a", "-F", "999"]).args(extra).arg("-o").arg(out);
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
    let (rate, fixture_s) = pingpong(fixture, w)?;
    let (text, cpu) = stop(child, lines)?;
    if let Some(l) = text.lines().find(|l| l.contains("off-CPU: ")) {
        println!("  {l}");
    }
    Ok(Run { rate, profiler_cpu_s: cpu, fixture_s })
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
    let (rate, fixture_s) = pingpong(fixture, w)?;
    let (_, cpu) = stop(child, stderr)?;
    Ok(Run { rate, profiler_cpu_s: cpu, fixture_s })
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
    println!("  {paced:?}");
    let workloads = [Workload::MaxRate(args.seconds), paced];
    // results[workload][configuration]
    let mut results: Vec<Vec<Vec<Run>>> = vec![vec![Vec::new(); 4]; 2];
    for run in 0..args.runs {
        step(&format!("bench-offcpu: run {}/{}", run + 1, args.runs));
        for (wi, &w) in workloads.iter().enumerate() {
            let r = &mut results[wi];
            let (rate, fixture_s) = pingpong(&fixture, w)?;
            println!("  {w:?} alone: {rate:.0} blocking reads/s, {fixture_s:.3} s");
            r[0].push(Run { rate, fixture_s, ..Run::default() });
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
        "- Profiler CPU = user+sys of the profiler process / run length (median); BPF time is charged to the switching tasks (it is in the slowdown).\n"
    );
    let names = [
        "no profiler".to_owned(),
        "`rsprof-bpf -a -F 999`".to_owned(),
        "`rsprof-bpf -a -F 999 --off-cpu`".to_owned(),
        format!("`perf record {}`", perf_args.join(" ")),
    ];
    let _ = writeln!(
        t,
        "| Configuration | Max rate: reads/s | Max rate: slowdown | Max rate: profiler CPU | Paced: reads/s | Paced: slowdown | Paced: profiler CPU |"
    );
    let _ = writeln!(t, "|---|---:|---:|---:|---:|---:|---:|");
    for (i, name) in names.iter().enumerate() {
        let _ = write!(t, "| {name} |");
        for (wi, runs) in results.iter().enumerate() {
            let rate = median_f64(runs[i].iter().map(|r| r.rate).collect());
            if i == 0 {
                let _ = write!(t, " {rate:.0} | – | – |");
                continue;
            }
            let slow: Vec<f64> = runs[i]
                .iter()
                .zip(&runs[0])
                .map(|(r, alone)| {
                    if wi == 0 {
                        1.0 - r.rate / alone.rate
                    } else {
                        r.fixture_s / alone.fixture_s - 1.0
                    }
                })
                .collect();
            let (m, lo, hi) = spread(slow);
            let cpu = median_f64(
                runs[i].iter().map(|r| r.profiler_cpu_s / r.fixture_s.max(1e-9)).collect(),
            );
            let _ = write!(
                t,
                " {rate:.0} | {:.1}% ({:.1} – {:.1}) | {:.1}% |",
                100.0 * m,
                100.0 * lo,
                100.0 * hi,
                100.0 * cpu
            );
        }
        let _ = writeln!(t);
    }
    t
}
