//! `cargo xtask bench-cgroup`: what the kernel cgroup filter costs and saves.
//!
//! N cgroups named like containerd containers (`<v2 mount>/rsprof-bench-<pid>/kubepods.slice/
//! kubepods-pod<uid>.slice/cri-containerd-<id>.scope`) each run one busy `split` fixture
//! process. rsprof-bpf records `--seconds` with `-d` in three configurations, interleaved,
//! `--runs` times each (medians reported):
//!
//! 1. `--all`: every sample is sent;
//! 2. `--cgroup <one of the N>`: samples of the other N-1 cgroups are filtered out;
//! 3. `--cgroup <an empty cgroup>`: every sample is filtered out, so the sampler's average
//!    run time is the cost of a filtered-out sample (the filter's lookup and return).
//!
//! Kernel-side time comes from BPF run-time statistics (`kernel.bpf_stats_enabled=1` for the
//! duration, then restored), which rsprof-bpf prints in its summary (`BPF sampler: R runs,
//! X ns per run`). Profiler CPU is the user+sys time of the rsprof-bpf process (`wait4`).

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ::tests::cgroups::CgroupTree;
use anyhow::{Context as _, bail};

use crate::{
    bench::{StatsGuard, median_f64, profiler_binary},
    display, step, workspace_root,
};

const SECTION_BEGIN: &str =
    "<!-- BEGIN cargo xtask bench-cgroup (generated; edits are overwritten) -->";
const SECTION_END: &str = "<!-- END cargo xtask bench-cgroup -->";

#[derive(clap::Args)]
pub struct BenchCgroupArgs {
    /// Busy cgroups (one busy process each).
    #[arg(long, default_value_t = 4)]
    cgroups: usize,
    /// Recording length of each run.
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
    sent: u64,
    filtered: u64,
    bpf_runs: u64,
    bpf_ns_per_run: f64,
    bpf_total_s: f64,
    profiler_cpu_s: f64,
}

/// Number after `key` in `text`, e.g. `num("5 sent", " sent")` style lookups.
fn number_before(text: &str, suffix: &str) -> Option<f64> {
    let i = text.find(suffix)?;
    text[..i].rsplit(|c: char| c.is_whitespace() || c == ',').next()?.parse().ok()
}

fn parse_summary(text: &str) -> anyhow::Result<Run> {
    let kernel = text.lines().find(|l| l.contains("kernel: ") && l.contains(" sent"));
    let bpf = text.lines().find(|l| l.starts_with("BPF sampler"));
    let (Some(kernel), Some(bpf)) = (kernel, bpf) else {
        bail!("no kernel counters or BPF run statistics in rsprof-bpf's output:\n{text}");
    };
    let get =
        |l: &str, s: &str| number_before(l, s).with_context(|| format!("no '{s}' number in '{l}'"));
    Ok(Run {
        sent: get(kernel, " sent")? as u64,
        filtered: get(kernel, " filtered out")? as u64,
        bpf_runs: get(bpf, " runs")? as u64,
        bpf_ns_per_run: get(bpf, " ns per run")?,
        bpf_total_s: get(bpf, " s in all")?,
        profiler_cpu_s: 0.0,
    })
}

fn cpu_seconds(ru: &libc::rusage) -> f64 {
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Runs rsprof-bpf to completion and returns its summary numbers and CPU time.
fn record(profiler: &Path, filter: &[String], secs: f64, out: &Path) -> anyhow::Result<Run> {
    let mut cmd = Command::new(profiler);
    cmd.args(filter).args(["-v", "-F", "999", "-d", &secs.to_string(), "-o"]).arg(out);
    println!("$ {}", display(&cmd));
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("start rsprof-bpf")?;
    let pid = child.id() as libc::pid_t;
    // Read stderr to the end before reaping, so the pipe never blocks the profiler.
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.unwrap(), &mut stderr)?;
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it in.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers to locals; `pid` is our unreaped child.
    if unsafe { libc::wait4(pid, &mut status, 0, &mut ru) } != pid {
        bail!("wait4: {}", std::io::Error::last_os_error());
    }
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        bail!("rsprof-bpf failed ({status:#x}):\n{stderr}");
    }
    let mut run = parse_summary(&stderr)?;
    run.profiler_cpu_s = cpu_seconds(&ru);
    Ok(run)
}

/// Starts one busy `split` in each cgroup directory, for `secs`.
fn start_workers(dirs: &[PathBuf], split: &Path, secs: f64) -> anyhow::Result<Vec<Child>> {
    dirs.iter()
        .map(|d| {
            Command::new("/bin/sh")
                .args(["-c", r#"echo $$ > "$1/cgroup.procs" && exec "$2" "$3""#, "worker"])
                .arg(d)
                .arg(split)
                .arg(secs.to_string())
                .stdout(Stdio::null())
                .spawn()
                .context("start a worker")
        })
        .collect()
}

pub fn bench_cgroup(args: BenchCgroupArgs) -> anyhow::Result<()> {
    if !crate::is_root() {
        bail!("the cgroup benchmark must run as root");
    }
    anyhow::ensure!(args.cgroups >= 2, "--cgroups must be at least 2");
    anyhow::ensure!(args.runs >= 1 && args.seconds > 0.0, "--runs >= 1 and --seconds > 0");
    let profiler = profiler_binary(args.profiler.as_deref())?;
    let split = ::tests::fixtures::build("split.c")?;
    let tree = CgroupTree::create("bench")?;
    let pod = "kubepods.slice/kubepods-pod0125ec2f_b64a_4868_8f5b_94b56cbab864.slice";
    let dirs: Vec<PathBuf> = (0..args.cgroups)
        .map(|i| tree.mkdir(&format!("{pod}/cri-containerd-{i:064x}.scope")))
        .collect::<anyhow::Result<_>>()?;
    let empty = tree.mkdir(&format!("{pod}/cri-containerd-{:064x}.scope", 0xeeee))?;
    let tmp = std::env::temp_dir().join(format!("rsprof-bench-cgroup-{}", std::process::id()));
    fs::create_dir_all(&tmp)?;
    let _stats = StatsGuard::enable()?;

    let configs: [(&str, Vec<String>); 3] = [
        ("--all", vec!["--all".into()]),
        ("--cgroup <1 of N busy>", vec!["--cgroup".into(), dirs[0].display().to_string()]),
        ("--cgroup <empty>", vec!["--cgroup".into(), empty.display().to_string()]),
    ];
    let mut results: Vec<Vec<Run>> = vec![Vec::new(); configs.len()];
    for round in 1..=args.runs {
        step(&format!("bench-cgroup round {round}/{}", args.runs));
        for (i, (label, filter)) in configs.iter().enumerate() {
            // Workers outlive the recording by a margin, so every run sees N busy cgroups.
            let mut workers = start_workers(&dirs, &split, args.seconds + 3.0)?;
            std::thread::sleep(Duration::from_millis(300));
            let r = record(&profiler, filter, args.seconds, &tmp.join("bench-cgroup.json.gz"));
            for w in &mut workers {
                let _ = w.kill();
                let _ = w.wait();
            }
            let r = r?;
            println!(
                "{label}: sent {} filtered {} | BPF {} runs, {:.0} ns/run, {:.3} s | profiler \
                 CPU {:.3} s",
                r.sent, r.filtered, r.bpf_runs, r.bpf_ns_per_run, r.bpf_total_s, r.profiler_cpu_s
            );
            results[i].push(r);
        }
    }
    let _ = fs::remove_dir_all(&tmp);

    let table = render(&args, &configs.map(|c| c.0), &results);
    println!("\n{table}");
    if args.no_write {
        println!("--no-write: BENCHMARKS.md not updated");
    } else {
        let path = workspace_root().join("BENCHMARKS.md");
        update_section(&path, &table)?;
        println!("updated {}", path.display());
    }
    Ok(())
}

fn render(args: &BenchCgroupArgs, labels: &[&str; 3], results: &[Vec<Run>]) -> String {
    let m = |i: usize, f: fn(&Run) -> f64| median_f64(results[i].iter().map(f).collect());
    let mut s = String::new();
    let mut cmd = "cargo xtask bench-cgroup".to_owned();
    if args.cgroups != 4 {
        write!(cmd, " --cgroups {}", args.cgroups).unwrap();
    }
    if args.seconds != 5.0 {
        write!(cmd, " --seconds {}", args.seconds).unwrap();
    }
    if args.runs != 3 {
        write!(cmd, " --runs {}", args.runs).unwrap();
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    writeln!(s, "## Cgroup filter: `{cmd}`\n").unwrap();
    writeln!(
        s,
        "- {} busy cgroups (one `split` fixture process each) on {cpus} CPUs, kernel {}; each \
         configuration recorded {} s at 999 Hz, runs interleaved ({} each), medians shown.",
        args.cgroups,
        kernel.trim(),
        args.seconds,
        args.runs
    )
    .unwrap();
    writeln!(
        s,
        "- BPF time: the `on_cpu_clock` program's run time and count from BPF statistics \
         (`kernel.bpf_stats_enabled=1`). Profiler CPU: user+sys of the rsprof-bpf process.\n"
    )
    .unwrap();
    writeln!(
        s,
        "| Configuration | Samples sent | Filtered out | BPF runs | BPF ns per run | BPF time \
         total | Profiler CPU (user+sys) |"
    )
    .unwrap();
    writeln!(s, "|---|---:|---:|---:|---:|---:|---:|").unwrap();
    for (i, label) in labels.iter().enumerate() {
        writeln!(
            s,
            "| `rsprof-bpf {label}` | {:.0} | {:.0} | {:.0} | {:.0} | {:.3} s | {:.2} s |",
            m(i, |r| r.sent as f64),
            m(i, |r| r.filtered as f64),
            m(i, |r| r.bpf_runs as f64),
            m(i, |r| r.bpf_ns_per_run),
            m(i, |r| r.bpf_total_s),
            m(i, |r| r.profiler_cpu_s),
        )
        .unwrap();
    }
    let (all_ns, filt_ns) = (m(0, |r| r.bpf_ns_per_run), m(2, |r| r.bpf_ns_per_run));
    writeln!(
        s,
        "\nA filtered-out sample costs about {filt_ns:.0} ns in the kernel (config 3, where every \
         sample is filtered), against {all_ns:.0} ns for a sample that is sent with both stacks \
         (config 1). With 1 of {} busy cgroups selected the kernel spends {:.0} % and the \
         profiler process {:.0} % of what profiling everything costs.",
        args.cgroups,
        100.0 * m(1, |r| r.bpf_total_s) / m(0, |r| r.bpf_total_s),
        100.0 * m(1, |r| r.profiler_cpu_s) / m(0, |r| r.profiler_cpu_s),
    )
    .unwrap();
    s
}

fn update_section(path: &Path, table: &str) -> anyhow::Result<()> {
    crate::bench::update_section(path, SECTION_BEGIN, SECTION_END, table)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rsprof_summary() {
        let text = "samples: 10 recorded, 0 lost\n  kernel: 9990 sent, 20010 filtered out; \
                    expected about 30000 system-wide\nBPF sampler (kernel.bpf_stats_enabled): \
                    30000 runs, 812 ns per run, 0.024 s in all\n";
        let r = parse_summary(text).unwrap();
        assert_eq!((r.sent, r.filtered, r.bpf_runs), (9990, 20010, 30000));
        assert_eq!((r.bpf_ns_per_run, r.bpf_total_s), (812.0, 0.024));
        assert!(parse_summary("nothing").is_err());
    }
}
