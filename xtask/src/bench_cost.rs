//! `cargo xtask bench-cost`: what rsprof-bpf itself costs while it records system-wide, next
//! to `perf record -a -g` at the same frequency, in one run.
//!
//! Three scenarios, each at every frequency of `--freqs`, each with both tools in turn (or, with
//! `--together`, both recording the same window, which halves the wall time and exposes both to
//! exactly the same load):
//! 1. idle: whatever else runs on the host;
//! 2. busy: one busy loop per CPU (the "all CPUs busy": every sample has a user stack);
//! 3. busy + exec storm: the same plus a shell running `/bin/true` in a loop, the worst case
//!    for a profiler that tracks every process's mappings.
//!
//! Each tool is started, and measured once it samples (rsprof-bpf: its "sampling" line; perf: 1.5
//! s after start), so start-up is left out: its CPU time over `--seconds` (its threads' run time
//! in ns from schedstat: /proc/PID/stat's 10 ms ticks were most of the value at 999 Hz idle), its RSS every second (VmRSS), and its peak RSS (VmHWM, start-up included). Then
//! it gets SIGINT and writes its output. Forks per second on the host (from /proc/stat) show how
//! hard the exec storm ran.
//!
//! Also what each tool cost to give a profile one can read, from start to exit (wait4): rsprof-bpf
//! writes a symbolized Gecko profile as it exits; perf record post-processes its file as it exits
//! (build ids) and leaves the call stacks to `perf script`, which is run on its output and
//! measured too.

use std::{
    fmt::Write as _,
    fs,
    io::{BufRead as _, BufReader},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::{
    bench::{CpuReading, Reaper, busy_loops, online_cpus, profiler_binary, status_kib},
    bench_unwind::reap,
    display, step, workspace_root,
};

const SECTION_BEGIN: &str =
    "<!-- BEGIN cargo xtask bench-cost (generated; edits are overwritten) -->";
const SECTION_END: &str = "<!-- END cargo xtask bench-cost -->";

#[derive(clap::Args)]
pub struct BenchCostArgs {
    /// Measured seconds per tool and scenario.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Sampling frequencies of both tools, each measured in turn (e.g. `99,999`).
    #[arg(long = "freqs", alias = "freq", value_delimiter = ',', default_value = "99")]
    freqs: Vec<u64>,
    /// Both tools record the same window at once, each measured by its own utime + stime
    /// (instead of one after the other).
    #[arg(long)]
    together: bool,
    /// Use this rsprof-bpf binary instead of building target/release/rsprof-bpf.
    #[arg(long)]
    profiler: Option<PathBuf>,
    /// Only print the results; leave BENCHMARKS.md alone.
    #[arg(long)]
    no_write: bool,
    /// The long memory run instead: rsprof-bpf alone on the host as it is, RSS every 10 s for
    /// `--seconds` (e.g. 1800), with `--buffer-size` small enough that the sample buffer fills
    /// early, so the run shows whether memory stays flat once it recycles.
    #[arg(long)]
    long: bool,
    /// `--buffer-size` for the long run.
    #[arg(long, default_value = "4M")]
    buffer_size: String,
    /// Busy loops running during the long run, so samples with user stacks keep arriving and
    /// the sample buffer fills and recycles even on an otherwise idle host.
    #[arg(long, default_value_t = 1)]
    busy_loops: usize,
    /// The JIT scenario instead: Node.js with `--perf-basic-prof` running a JIT-heavy script
    /// (functions compiled all the time, so its perf map keeps growing), both tools naming its
    /// frames from the map; reports the map's growth too. Written to its own section.
    #[arg(long)]
    node_jit: bool,
}

struct Run {
    scenario: &'static str,
    freq: u64,
    tool: &'static str,
    window: f64,
    cpu: f64,
    rss_first_kib: u64,
    rss_last_kib: u64,
    rss_max_kib: u64,
    hwm_kib: u64,
    forks_per_s: f64,
    /// utime + stime from start to exit (start-up and writing the output included), and for
    /// perf its `perf script` run on the output.
    whole: f64,
    post: Option<f64>,
}

pub(crate) fn forks_since_boot() -> u64 {
    fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("processes ")?.trim().parse().ok()))
        .unwrap_or(0)
}

/// Starts `cmd` with stderr drained; returns once it samples.
fn start_tool(cmd: Command, rsprof: bool) -> anyhow::Result<Child> {
    start_tool_logged(cmd, rsprof).map(|(child, _)| child)
}

/// [`start_tool`], also returning the thread that drains the tool's stderr: joined once the
/// tool exited, it gives the lines after the "sampling" line (the exit summary among them).
fn start_tool_logged(
    mut cmd: Command,
    rsprof: bool,
) -> anyhow::Result<(Child, thread::JoinHandle<Vec<String>>)> {
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    let what = display(&cmd);
    let mut child = cmd.spawn().with_context(|| format!("start {what}"))?;
    let (tx, rx) = mpsc::channel();
    let err = child.stderr.take().unwrap();
    thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    if rsprof {
        let end = Instant::now() + Duration::from_secs(120);
        loop {
            match rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
                Ok(l) if l.contains("rsprof-bpf: sampling") => break,
                Ok(_) => {}
                Err(_) => {
                    let _ = child.kill();
                    bail!("{what} did not start sampling");
                }
            }
        }
    } else {
        thread::sleep(Duration::from_millis(1500));
    }
    // Keep draining so the tool never blocks on a full pipe.
    Ok((child, thread::spawn(move || rx.into_iter().collect())))
}

/// A running tool being measured.
struct Watch {
    tool: &'static str,
    child: Child,
    cpu0: CpuReading,
    rss: Vec<u64>,
}

/// Measures `tools` (already sampling) over the same `seconds`, then stops each with SIGINT.
/// Each tool comes with its output file.
fn measure(
    scenario: &'static str,
    freq: u64,
    tools: Vec<(&'static str, Child, PathBuf)>,
    seconds: u64,
) -> anyhow::Result<Vec<Run>> {
    let mut watches = Vec::new();
    let mut outputs = Vec::new();
    for (tool, child, output) in tools {
        outputs.push(output);
        let cpu0 = CpuReading::of(child.id()).with_context(|| format!("{tool} exited"))?;
        watches.push(Watch { tool, child, cpu0, rss: Vec::new() });
    }
    let (forks0, t0) = (forks_since_boot(), Instant::now());
    while t0.elapsed() < Duration::from_secs(seconds) {
        for w in &mut watches {
            let rss = status_kib(w.child.id(), "VmRSS:");
            w.rss.push(rss.with_context(|| format!("{} exited", w.tool))?);
        }
        thread::sleep(Duration::from_secs(1));
    }
    let cpu1: Vec<Option<CpuReading>> =
        watches.iter().map(|w| CpuReading::of(w.child.id())).collect();
    let window = t0.elapsed().as_secs_f64();
    let forks_per_s = (forks_since_boot() - forks0) as f64 / window;
    let mut runs = Vec::new();
    for ((w, cpu1), output) in watches.into_iter().zip(cpu1).zip(outputs) {
        let pid = w.child.id();
        let cpu1 = cpu1.with_context(|| format!("{} exited", w.tool))?;
        let hwm_kib = status_kib(pid, "VmHWM:").unwrap_or(0);
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid as i32, libc::SIGINT) };
        // perf ends by re-raising the SIGINT it got, which reap accepts.
        // wait4's CPU covers the whole life; reap's wall time is not used here.
        let whole =
            reap(pid as libc::pid_t, Instant::now()).with_context(|| w.tool.to_owned())?.cpu;
        drop(w.child); // reaped above
        let post = if w.tool == "perf" {
            let mut cmd = Command::new("perf");
            cmd.args(["script", "-i"]).arg(&output).stdout(Stdio::null()).stderr(Stdio::null());
            let child = cmd.spawn().context("start perf script")?;
            let u = reap(child.id() as libc::pid_t, Instant::now()).context("perf script")?;
            drop(child);
            Some(u.cpu)
        } else {
            None
        };
        runs.push(Run {
            whole,
            post,
            scenario,
            freq,
            tool: w.tool,
            window,
            cpu: cpu1.since(&w.cpu0),
            rss_first_kib: w.rss[0],
            rss_last_kib: *w.rss.last().unwrap(),
            rss_max_kib: *w.rss.iter().max().unwrap(),
            hwm_kib,
            forks_per_s,
        });
    }
    Ok(runs)
}

/// `loops` busy loops, plus an exec storm if asked; killed when dropped, also when a
/// measurement fails.
fn load(loops: usize, storm: bool) -> anyhow::Result<Vec<Reaper>> {
    let mut kids = busy_loops(loops)?;
    if storm {
        kids.push(Reaper(Command::new("sh").args(["-c", "while :; do /bin/true; done"]).spawn()?));
    }
    Ok(kids)
}

pub fn bench_cost(args: BenchCostArgs) -> anyhow::Result<()> {
    if !crate::is_root() {
        bail!("the benchmark must run as root (both tools sample every CPU)");
    }
    let rsprof = profiler_binary(args.profiler.as_deref())?;
    let dir = std::env::temp_dir().join(format!("rsprof-bench-cost-{}", std::process::id()));
    fs::create_dir_all(&dir)?;
    if args.long {
        let r = long_run(&args, &rsprof, &dir);
        let _ = fs::remove_dir_all(&dir);
        return r;
    }
    let mut runs = Vec::new();
    let scenarios: &[(&'static str, bool, bool)] = if args.node_jit {
        &[("node --perf-basic-prof", false, false)]
    } else {
        &[("idle", false, false), ("busy", true, false), ("busy + exec storm", true, true)]
    };
    let mut jit_note = String::new();
    for &(scenario, busy, storm) in scenarios {
        let _load = load(if busy { online_cpus() as usize } else { 0 }, storm)?;
        let node = if args.node_jit { Some(NodeJit::start(&dir)?) } else { None };
        for &freq in &args.freqs {
            let groups: Vec<Vec<&'static str>> = if args.together {
                vec![vec!["rsprof-bpf", "perf"]]
            } else {
                vec![vec!["rsprof-bpf"], vec!["perf"]]
            };
            for group in groups {
                step(&format!(
                    "bench-cost: {scenario}, {} -F {freq}, {} s",
                    group.join(" and "),
                    args.seconds
                ));
                let mut tools = Vec::new();
                for tool in group {
                    let f = freq.to_string();
                    let mut cmd;
                    let output;
                    if tool == "perf" {
                        output = dir.join(format!("perf-{freq}.data"));
                        cmd = Command::new("perf");
                        cmd.args(["record", "-a", "-g", "-q", "-F", &f, "-o"]).arg(&output);
                    } else {
                        output = dir.join(format!("cost-{freq}.json.gz"));
                        cmd = Command::new(&rsprof);
                        cmd.args(["-v", "--all", "-F", &f, "-o"]).arg(&output);
                    }
                    match start_tool(cmd, tool == "rsprof-bpf") {
                        Ok(child) => tools.push((tool, child, output)),
                        Err(e) => {
                            for (_, mut c, _) in tools {
                                let _ = c.kill();
                                let _ = c.wait();
                            }
                            return Err(e);
                        }
                    }
                }
                let map0 = node.as_ref().map_or(0, NodeJit::map_bytes);
                let t0 = Instant::now();
                runs.extend(measure(scenario, freq, tools, args.seconds)?);
                if let Some(n) = &node {
                    let grew = n.map_bytes().saturating_sub(map0);
                    let _ = writeln!(
                        jit_note,
                        "- -F {freq}: node's perf map grew {:.1} KiB in {:.0} s ({:.1} KiB/s; {} \
                         KiB in all); rsprof-bpf reads only what was appended, perf reads the \
                         whole map once, in `perf script`.",
                        grew as f64 / 1024.0,
                        t0.elapsed().as_secs_f64(),
                        grew as f64 / 1024.0 / t0.elapsed().as_secs_f64(),
                        n.map_bytes() / 1024
                    );
                }
            }
        }
    }
    let _ = fs::remove_dir_all(&dir);
    let mut table = render(&args, &runs);
    if !jit_note.is_empty() {
        table.push_str(&jit_note);
        table.push('\n');
    }
    print!("{table}");
    if !args.no_write {
        let path = workspace_root().join("BENCHMARKS.md");
        let (begin, end) =
            if args.node_jit { (JIT_BEGIN, JIT_END) } else { (SECTION_BEGIN, SECTION_END) };
        crate::bench::update_section(&path, begin, end, &table)?;
        step(&format!("bench-cost: updated {}", path.display()));
    }
    Ok(())
}

const JIT_BEGIN: &str =
    "<!-- BEGIN cargo xtask bench-cost --node-jit (generated; edits are overwritten) -->";
const JIT_END: &str = "<!-- END cargo xtask bench-cost --node-jit -->";

/// Node.js running `tests/fixtures/jit_churn.js` with `--perf-basic-prof`, killed (and its perf
/// map removed) when dropped.
struct NodeJit {
    child: Child,
    map: PathBuf,
}

impl NodeJit {
    fn start(dir: &std::path::Path) -> anyhow::Result<Self> {
        let script = workspace_root().join("tests/fixtures/jit_churn.js");
        let child = Command::new("node")
            .arg("--perf-basic-prof")
            .arg(&script)
            .arg("3600")
            .current_dir(dir)
            .stdout(Stdio::null())
            .spawn()
            .context("start node (cargo xtask setup installs it)")?;
        let map = PathBuf::from(format!("/tmp/perf-{}.map", child.id()));
        // Its start-up and first compilations are not what is measured.
        thread::sleep(Duration::from_secs(2));
        Ok(Self { child, map })
    }

    fn map_bytes(&self) -> u64 {
        fs::metadata(&self.map).map_or(0, |m| m.len())
    }
}

impl Drop for NodeJit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_file(&self.map);
    }
}

fn render(args: &BenchCostArgs, runs: &[Run]) -> String {
    let mib = |k: u64| k as f64 / 1024.0;
    let mut s = String::new();
    if args.node_jit {
        let _ =
            writeln!(s, "## JIT code named from perf maps: `cargo xtask bench-cost --node-jit`\n");
    } else {
        let _ = writeln!(s, "## Own cost while recording system-wide: `cargo xtask bench-cost`\n");
    }
    let mut cmd = "cargo xtask bench-cost".to_owned();
    if args.node_jit {
        cmd.push_str(" --node-jit");
    }
    if args.seconds != 30 {
        let _ = write!(cmd, " --seconds {}", args.seconds);
    }
    if args.freqs != [99] {
        let f: Vec<String> = args.freqs.iter().map(u64::to_string).collect();
        let _ = write!(cmd, " --freqs {}", f.join(","));
    }
    if args.together {
        cmd.push_str(" --together");
    }
    let _ = writeln!(
        s,
        "`{cmd}`, run {} on {} CPUs ({}). Each tool measured for {} s once it samples \
         (`rsprof-bpf --all -F HZ` vs `perf record -a -g -F HZ`), {}; busy = one busy loop per \
         CPU; exec storm = a shell running `/bin/true` in a loop as well. CPU = the run time \
         of the tool's threads over the window (schedstat, ns); RSS sampled every second; \
         peak = VmHWM (start-up included). To a profile = CPU from start to exit (wait4: start-up, and writing the output after SIGINT, \
         included), for perf plus `perf script` on its output (perf record leaves the call \
         stacks to it; rsprof-bpf has written a symbolized profile by then). The machine is \
         shared with other work: compare the two tools within a scenario.\n",
        crate::bench::utc_now(),
        online_cpus(),
        std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
        args.seconds,
        if args.together {
            "both recording the same window at once"
        } else {
            "one after the other"
        },
    );
    let _ = writeln!(
        s,
        "| scenario | Hz | tool | forks/s on the host | CPU s | % of one core | RSS first / last / max MiB | peak RSS MiB | to a profile: CPU s |"
    );
    let _ = writeln!(s, "|---|---:|---|---:|---:|---:|---:|---:|---:|");
    for r in runs {
        let whole = match r.post {
            Some(post) => format!("{:.2} + {post:.2} = {:.2}", r.whole, r.whole + post),
            None => format!("{:.2}", r.whole),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.0} | {:.3} | {:.3}% | {:.1} / {:.1} / {:.1} | {:.1} | {whole} |",
            r.scenario,
            r.freq,
            r.tool,
            r.forks_per_s,
            r.cpu,
            100.0 * r.cpu / r.window,
            mib(r.rss_first_kib),
            mib(r.rss_last_kib),
            mib(r.rss_max_kib),
            mib(r.hwm_kib)
        );
    }
    s.push('\n');
    s
}

const LONG_BEGIN: &str =
    "<!-- BEGIN cargo xtask bench-cost --long (generated; edits are overwritten) -->";
const LONG_END: &str = "<!-- END cargo xtask bench-cost --long -->";

/// RSS of rsprof-bpf every 10 s over a long recording whose sample buffer recycles.
fn long_run(
    args: &BenchCostArgs,
    rsprof: &std::path::Path,
    dir: &std::path::Path,
) -> anyhow::Result<()> {
    let freq = args.freqs[0].to_string();
    step(&format!(
        "bench-cost --long: rsprof-bpf --all -F {freq} --buffer-size {}, {} s",
        args.buffer_size, args.seconds
    ));
    let mut cmd = Command::new(rsprof);
    cmd.args(["-v", "--all", "-F", &freq, "--buffer-size", &args.buffer_size, "-o"])
        .arg(dir.join("long.json.gz"));
    let busy = load(args.busy_loops, false)?;
    let (mut child, lines) = start_tool_logged(cmd, true)?;
    let pid = child.id();
    let (cpu0, t0) = (CpuReading::of(pid).context("rsprof-bpf exited")?, Instant::now());
    // (seconds since sampling began, RSS KiB, CPU s so far)
    let mut series: Vec<(u64, u64, f64)> = Vec::new();
    let mut next = 0u64;
    while next <= args.seconds {
        let wait = Duration::from_secs(next).saturating_sub(t0.elapsed());
        thread::sleep(wait);
        let rss = status_kib(pid, "VmRSS:").context("rsprof-bpf exited")?;
        let cpu = CpuReading::of(pid).context("rsprof-bpf exited")?.since(&cpu0);
        series.push((next, rss, cpu));
        next += 10;
    }
    let hwm = status_kib(pid, "VmHWM:").unwrap_or(0);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid as i32, libc::SIGINT) };
    let status = child.wait()?;
    drop(busy);
    if !status.success() {
        bail!("rsprof-bpf exited with {status}");
    }
    // The drain thread ends with the pipe. The summary says whether the buffer filled and
    // recycled (the point of the run).
    let lines = lines.join().unwrap_or_default();
    let buffer_line =
        lines.iter().find(|l| l.trim_start().starts_with("buffer:")).map(|l| l.trim().to_string());
    let table = render_long(args, &series, hwm, buffer_line.as_deref());
    print!("{table}");
    if !args.no_write {
        let path = workspace_root().join("BENCHMARKS.md");
        crate::bench::update_section(&path, LONG_BEGIN, LONG_END, &table)?;
        step(&format!("bench-cost --long: updated {}", path.display()));
    }
    Ok(())
}

fn render_long(
    args: &BenchCostArgs,
    series: &[(u64, u64, f64)],
    hwm_kib: u64,
    buffer_line: Option<&str>,
) -> String {
    let mib = |k: u64| k as f64 / 1024.0;
    let mut s = String::new();
    let _ = writeln!(s, "## Memory over a long recording: `cargo xtask bench-cost --long`\n");
    let _ = writeln!(
        s,
        "`cargo xtask bench-cost --long --seconds {} --freq {} --buffer-size {} --busy-loops {}`, \
         run {} on {} CPUs: `rsprof-bpf --all -F {} --buffer-size {}` on the host as it was \
         (other work running) plus {} busy loop(s), RSS (VmRSS) every 10 s from its \
         \"sampling\" line; the small buffer makes the sample store recycle early, so the later \
         minutes show the steady state.\n",
        args.seconds,
        args.freqs[0],
        args.buffer_size,
        args.busy_loops,
        crate::bench::utc_now(),
        online_cpus(),
        args.freqs[0],
        args.buffer_size,
        args.busy_loops,
    );
    let _ = writeln!(
        s,
        "Its exit summary: `{}`\n",
        buffer_line.unwrap_or("no buffer line in the summary")
    );
    // Flatness over the second half of the run (the store recycles well before).
    let half: Vec<u64> = series.iter().filter(|r| r.0 >= args.seconds / 2).map(|r| r.1).collect();
    if let (Some(&lo), Some(&hi)) = (half.iter().min(), half.iter().max()) {
        let mut sorted = half.clone();
        sorted.sort_unstable();
        let median = sorted[sorted.len() / 2] as f64;
        let _ = writeln!(
            s,
            "Second half of the run: RSS {:.1}–{:.1} MiB, {:+.1}% / {:+.1}% around its median \
             {:.1} MiB; peak RSS (VmHWM, start-up included) {:.1} MiB; CPU {:.2}% of one core \
             over the whole run.\n",
            mib(lo),
            mib(hi),
            100.0 * (lo as f64 - median) / median,
            100.0 * (hi as f64 - median) / median,
            median / 1024.0,
            mib(hwm_kib),
            series.last().map_or(0.0, |r| 100.0 * r.2 / r.0.max(1) as f64),
        );
    }
    let _ = writeln!(s, "| minute | RSS MiB | CPU s so far |");
    let _ = writeln!(s, "|---:|---:|---:|");
    for r in series.iter().filter(|r| r.0 % 60 == 0) {
        let _ = writeln!(s, "| {} | {:.1} | {:.2} |", r.0 / 60, mib(r.1), r.2);
    }
    s.push('\n');
    s
}
