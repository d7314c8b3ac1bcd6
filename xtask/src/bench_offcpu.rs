//! `cargo xtask bench-offcpu`: what off-CPU recording costs a context-switch-heavy program.
//!
//! The `offcpu pingpong SECONDS` fixture (two threads passing a byte over two pipes, every
//! pass a block and a wakeup) prints how many blocking reads it did and how long it took; its
//! rate is measured alone and while a profiler records the whole machine, in turn, `--runs`
//! times each (medians reported):
//!
//! 1. no profiler;
//! 2. `rsprof-bpf -a` (CPU samples; its sched_switch hook only keeps CPU time current);
//! 3. `rsprof-bpf -a --off-cpu`;
//! 4. `perf record -a -g -e sched:sched_switch`, perf's way to get blocking stacks without
//!    `perf record --off-cpu` (which needs a perf built with BUILD_BPF_SKEL=1; Debian's is not:
//!    the option is ignored with a warning, checked at run time and said in the table).
//!
//! Slowdown = 1 − rate / rate alone. Profiler CPU is the user+sys time of the profiler process
//! (`wait4`) over the fixture's run; BPF time is charged to the switching tasks, so it shows
//! in the slowdown.

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
    /// Length of each ping-pong run.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
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

/// (blocking reads per second, seconds) printed by the fixture.
fn pingpong(fixture: &Path, secs: f64) -> anyhow::Result<(f64, f64)> {
    let out = Command::new(fixture)
        .args(["pingpong", &secs.to_string()])
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
    secs: f64,
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
    let (rate, fixture_s) = pingpong(fixture, secs)?;
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

fn under_perf(args: &[&str], fixture: &Path, secs: f64, out: &Path) -> anyhow::Result<Run> {
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
    let (rate, fixture_s) = pingpong(fixture, secs)?;
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
    let secs = args.seconds;
    let mut results: Vec<Vec<Run>> = vec![Vec::new(); 4];
    for run in 0..args.runs {
        step(&format!("bench-offcpu: run {}/{}", run + 1, args.runs));
        let (rate, fixture_s) = pingpong(&fixture, secs)?;
        println!("  alone: {rate:.0} blocking reads/s");
        results[0].push(Run { rate, fixture_s, ..Run::default() });
        let r = under_rsprof(&profiler, &[], &fixture, secs, &out)?;
        println!("  rsprof-bpf -a: {:.0}/s, profiler CPU {:.2} s", r.rate, r.profiler_cpu_s);
        results[1].push(r);
        let r = under_rsprof(&profiler, &["--off-cpu"], &fixture, secs, &out)?;
        println!(
            "  rsprof-bpf -a --off-cpu: {:.0}/s, profiler CPU {:.2} s",
            r.rate, r.profiler_cpu_s
        );
        results[2].push(r);
        let r = under_perf(&perf_args, &fixture, secs, &data)?;
        println!("  perf: {:.0}/s, perf CPU {:.2} s", r.rate, r.profiler_cpu_s);
        results[3].push(r);
    }
    let _ = fs::remove_dir_all(&tmp);
    let table = render(&args, &perf_args, perf_off_cpu, &results);
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

fn render(
    args: &BenchOffCpuArgs,
    perf_args: &[&str],
    perf_off_cpu: bool,
    results: &[Vec<Run>],
) -> String {
    let med = |i: usize, f: fn(&Run) -> f64| median_f64(results[i].iter().map(f).collect());
    let base = med(0, |r| r.rate);
    let mut t = String::new();
    let _ = writeln!(
        t,
        "## Off-CPU recording under a context-switch storm: `cargo xtask bench-offcpu`\n"
    );
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let _ = writeln!(t, "- Date: {}; {cpus} CPUs; kernel {}", utc_now(), kernel.trim());
    let mut cmd = "cargo xtask bench-offcpu".to_owned();
    if args.seconds != 5.0 {
        let _ = write!(cmd, " --seconds {}", args.seconds);
    }
    if args.runs != 3 {
        let _ = write!(cmd, " --runs {}", args.runs);
    }
    let _ = writeln!(
        t,
        "- Command: `{cmd}`; workload `tests/fixtures/offcpu.c pingpong {}` (two threads passing a byte over two pipes; every read blocks), medians of {} runs, configurations interleaved",
        args.seconds, args.runs
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
        "- Slowdown = 1 − rate / rate alone ({base:.0} blocking reads/s alone). Profiler CPU = user+sys of the profiler process / run length; BPF time is charged to the switching tasks (it is in the slowdown).\n"
    );
    let _ = writeln!(t, "| Configuration | Blocking reads/s | Slowdown | Profiler CPU |");
    let _ = writeln!(t, "|---|---:|---:|---:|");
    let names = [
        "no profiler".to_owned(),
        "`rsprof-bpf -a -F 999`".to_owned(),
        "`rsprof-bpf -a -F 999 --off-cpu`".to_owned(),
        format!("`perf record {}`", perf_args.join(" ")),
    ];
    for (i, name) in names.iter().enumerate() {
        let rate = med(i, |r| r.rate);
        let cpu = med(i, |r| r.profiler_cpu_s / r.fixture_s.max(1e-9));
        let (slow, cpu) = if i == 0 {
            ("–".to_owned(), "–".to_owned())
        } else {
            (format!("{:.1}%", 100.0 * (1.0 - rate / base)), format!("{:.1}%", 100.0 * cpu))
        };
        let _ = writeln!(t, "| {name} | {rate:.0} | {slow} | {cpu} |");
    }
    t
}
