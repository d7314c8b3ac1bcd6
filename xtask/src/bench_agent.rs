//! `cargo xtask bench-agent`: what `rsprof-bpf agent` costs when it runs all day.
//!
//! Every configuration (rate × load × sink) runs the agent for `--secs` (default 5 minutes)
//! and samples, every 10 s, the agent's CPU time (user+sys from /proc/PID/stat), the run time
//! of its BPF programs (`run_time_ns` in the fdinfo of its program fds, with
//! `kernel.bpf_stats_enabled=1` for the duration: BPF time is spent in the profiled tasks'
//! context, so /proc/PID/stat alone would miss it) and its RSS. The first minute is left out
//! of the CPU figure (start-up: BTF, /proc scan, symbolizer caches) and reported separately.
//! Bytes written per host-hour come from the spool directory, and for the ClickHouse sink
//! (a real clickhouse-server from the tests crate's harness, the agent given `--clickhouse`)
//! from `system.parts` (`bytes_on_disk` of the rsprof tables' active parts, merged first as a
//! long-running server would), with the sink's delivery time per window from the agent's
//! exit summary.
//!
//! The query benchmark loads a synthetic fleet into ClickHouse through the agent's own
//! delivery path: the windows of one 10 s window of a short real agent run (every process
//! with samples, `bench_work` busy), copied into a spool as 10 hosts × 360 consecutive windows
//! (one hour), which an agent started with `--clickhouse` delivers as it would a backlog; then
//! `rsprof-bpf query --clickhouse URL --from … --to … -o fleet.json.gz` is timed (target ≤ 5 s)
//! and its output must load in the Firefox Profiler's importer (`tests::gecko_schema::load`).
//!
//! Loads: "idle" is the machine as it is; "busy" runs `bench_work` on every CPU, whose
//! samples all have a 4-deep stack (the agent symbolizes and writes them every window).
//!
//! `--together` runs the configurations side by side instead of one after the other (2 ×
//! `--secs` plus a warm-up, not 8 × `--secs`): see `together.rs`.

use std::fmt::Write as _;
use std::fs;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

mod churn;
mod together;

use crate::{
    bench::{Reaper, StatsGuard, online_cpus, profiler_binary, update_section},
    display, step, workspace_root,
};

const SECTION_BEGIN: &str =
    "<!-- BEGIN cargo xtask bench-agent (generated; edits are overwritten) -->";
const SECTION_END: &str = "<!-- END cargo xtask bench-agent -->";
const TICK: Duration = Duration::from_secs(10);

#[derive(clap::Args)]
pub struct BenchAgentArgs {
    /// Length of each configuration's run, in seconds (the issue asks for at least 300).
    #[arg(long, default_value_t = 300)]
    secs: u64,
    /// Seconds at the start of each run (with `--together`: of each phase, under its load) left
    /// out of the steady-state figures (start-up: BTF, /proc scan, symbolizer caches; a new
    /// load's code to name); shorter for a quick comparison.
    #[arg(long, default_value_t = 60)]
    warmup: u64,
    /// Sampling rates to measure (the agent's default is 19 Hz).
    #[arg(long, value_delimiter = ',', default_value = "19,99")]
    rates: Vec<u32>,
    /// Use this rsprof-bpf binary instead of building target/release/rsprof-bpf.
    #[arg(long)]
    profiler: Option<PathBuf>,
    /// Only print the results; leave BENCHMARKS.md alone.
    #[arg(long)]
    no_write: bool,
    /// Sinks to measure: spool (the spool alone), clickhouse (a local ClickHouse server).
    #[arg(long, value_delimiter = ',', default_value = "spool,clickhouse")]
    sinks: Vec<SinkKind>,
    /// Skip the query benchmark (synthetic 10-host × 1-hour fleet in ClickHouse).
    #[arg(long)]
    no_query: bool,
    /// Processes per window of the synthetic fleet, the busiest first (0: every process of
    /// the source window; fewer makes a quicker smoke run).
    #[arg(long, default_value_t = 0)]
    query_processes: usize,
    /// Only the query benchmark.
    #[arg(long, conflicts_with = "no_query")]
    query_only: bool,
    /// Run every sink × rate at once (each agent with its own spool, metrics port and
    /// ClickHouse database), measured over the same `--secs` idle, then the same `--secs` busy,
    /// each after `--warmup` under its load: 2 × (`--warmup` + `--secs`) instead of 8 runs.
    #[arg(long, conflicts_with = "query_only")]
    together: bool,
    /// The churn benchmark instead (its own section): the agent and `perf record -a -g` side
    /// by side under a `/bin/true` loop, then 100 execs a second of a program mapping a dozen
    /// libraries; see `churn.rs`.
    #[arg(long, conflicts_with_all = ["query_only", "together"])]
    churn: bool,
    /// The churn benchmark's sampling rate (the agent's default).
    #[arg(long, default_value_t = 19)]
    churn_rate: u32,
    /// The `/bin/true` loop's pace, execs a second (issue 38's target is stated at 1,000);
    /// 0: as fast as the shell goes.
    #[arg(long, default_value_t = 1000)]
    churn_execs: u32,
}

const CHURN_BEGIN: &str =
    "<!-- BEGIN cargo xtask bench-agent --churn (generated; edits are overwritten) -->";
const CHURN_END: &str = "<!-- END cargo xtask bench-agent --churn -->";

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SinkKind {
    Spool,
    Clickhouse,
}

impl SinkKind {
    fn name(self) -> &'static str {
        match self {
            SinkKind::Spool => "spool",
            SinkKind::Clickhouse => "ClickHouse",
        }
    }
}

/// The synthetic fleet of the query benchmark.
const QUERY_HOSTS: u64 = 10;
const QUERY_WINDOW_MS: u64 = 10_000;
const QUERY_WINDOWS: u64 = 3600 * 1000 / QUERY_WINDOW_MS;
/// The target for `query` over the fleet.
const QUERY_TARGET: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Load {
    Idle,
    Busy,
}

impl Load {
    fn name(self) -> &'static str {
        match self {
            Load::Idle => "idle",
            Load::Busy => "2 CPUs busy",
        }
    }
}

#[derive(Default, Clone)]
struct Measured {
    /// Agent user+sys and BPF seconds over the steady part (after `--warmup`).
    steady_cpu_s: f64,
    steady_bpf_s: f64,
    steady_wall_s: f64,
    /// Same over the whole run, start-up included.
    total_cpu_s: f64,
    total_bpf_s: f64,
    rss_after_warmup_kib: u64,
    rss_end_kib: u64,
    rss_max_kib: u64,
    spool_bytes: u64,
    windows: u64,
    /// ClickHouse sink only.
    clickhouse: Option<ClickHouseMeasured>,
}

#[derive(Default, Clone)]
struct ClickHouseMeasured {
    /// `bytes_on_disk` of the rsprof tables after the run.
    bytes: u64,
    /// From the agent's exit summary.
    delivered: u64,
    batches: u64,
    mean_batch_ms: f64,
}

impl ClickHouseMeasured {
    fn per_window_ms(&self) -> f64 {
        self.mean_batch_ms * self.batches as f64 / self.delivered.max(1) as f64
    }
}

impl Measured {
    fn steady_pct(&self) -> f64 {
        100.0 * (self.steady_cpu_s + self.steady_bpf_s) / self.steady_wall_s.max(1e-9)
    }
}

/// user+sys seconds of `pid` (all its threads, exited ones included).
pub(crate) fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    crate::bench::stat_cpu_seconds(pid).with_context(|| format!("no /proc/{pid}/stat"))
}

pub(crate) fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    crate::bench::status_kib(pid, "VmRSS:").with_context(|| format!("no VmRSS for pid {pid}"))
}

/// `run_time_ns` of each BPF program `pid` holds open, by program id: a program held by two
/// fds counts once, and agents running side by side each hold their own programs (their ids
/// are disjoint, see `together`).
pub(crate) fn bpf_programs(pid: u32) -> anyhow::Result<std::collections::BTreeMap<u32, u64>> {
    let mut progs = std::collections::BTreeMap::new();
    for e in fs::read_dir(format!("/proc/{pid}/fdinfo"))? {
        let Ok(text) = fs::read_to_string(e?.path()) else { continue };
        if !text.contains("prog_type:") {
            continue;
        }
        let field = |name: &str| -> Option<u64> {
            let l = text.lines().find(|l| l.starts_with(name))?;
            l.split_whitespace().nth(1)?.parse().ok()
        };
        if let Some(id) = field("prog_id:") {
            progs.insert(id as u32, field("run_time_ns:").unwrap_or(0));
        }
    }
    Ok(progs)
}

/// Sum of `run_time_ns` over the BPF programs `pid` holds open.
pub(crate) fn bpf_seconds(pid: u32) -> anyhow::Result<f64> {
    Ok(bpf_programs(pid)?.values().sum::<u64>() as f64 / 1e9)
}

fn dir_bytes(dir: &Path) -> (u64, u64) {
    let (mut bytes, mut windows) = (0, 0);
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if let Ok(m) = e.metadata() {
                bytes += m.len();
            }
            if e.file_name().to_string_lossy().ends_with(".pb.gz") {
                windows += 1;
            }
        }
    }
    (bytes, windows)
}

/// Starts the agent and returns once it printed its "sampling" line, with its stderr lines.
pub(crate) fn start_agent(
    profiler: &Path,
    rate: u32,
    spool: &Path,
    extra: &[String],
) -> anyhow::Result<(Reaper, mpsc::Receiver<String>)> {
    let mut cmd = Command::new(profiler);
    // Metrics served as by default, on a free port: another agent may hold 9749.
    cmd.args(["agent", "--metrics", "127.0.0.1:0", "-F", &rate.to_string(), "--spool"])
        .arg(spool)
        .args(["--spool-size", "4G"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    println!("$ {}", display(&cmd));
    let mut child = cmd.spawn().with_context(|| format!("start {}", display(&cmd)))?;
    let stderr = child.stderr.take().context("no stderr")?;
    let (tx, rx) = mpsc::channel();
    let (line_tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if !sent && line.contains("sampling") {
                let _ = tx.send(());
                sent = true;
            }
            let _ = line_tx.send(line);
        }
    });
    let reaper = Reaper(child);
    rx.recv_timeout(Duration::from_secs(120))
        .context("the agent did not print its \"sampling\" line within 120 s")?;
    Ok((reaper, lines))
}

/// SIGTERM (the agent flushes its last window and delivers what it can), then waits for the
/// exit; returns its stderr.
fn stop_agent(agent: &mut Reaper, lines: &mpsc::Receiver<String>) -> anyhow::Result<String> {
    // SAFETY: plain kill(2) on our child.
    unsafe { libc::kill(agent.0.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(60);
    while agent.0.try_wait()?.is_none() {
        if Instant::now() > deadline {
            bail!("the agent did not exit within 60 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut text = String::new();
    // The reader thread ends at EOF, after the exit.
    while let Ok(l) = lines.recv_timeout(Duration::from_secs(5)) {
        text.push_str(&l);
        text.push('\n');
    }
    Ok(text)
}

/// The number before `after` in the line containing `line`.
fn summary_number(stderr: &str, line: &str, after: &str) -> Option<f64> {
    let l = stderr.lines().find(|l| l.contains(line))?;
    l.split(after).next()?.rsplit([' ', ':', '(']).next()?.parse().ok()
}

/// The ClickHouse sink's line of the agent's exit summary.
fn delivery_stats(stderr: &str) -> anyhow::Result<ClickHouseMeasured> {
    let line = "sink clickhouse:";
    let delivered = summary_number(stderr, line, " windows delivered")
        .with_context(|| format!("no ClickHouse delivery summary in:\n{stderr}"))?;
    // Agents before batched delivery: one window per request.
    let batches = summary_number(stderr, line, " batches").unwrap_or(delivered);
    let mean: Option<f64> = (stderr.lines().find(|l| l.contains(line)))
        .and_then(|l| l.rsplit("mean ").next()?.trim().trim_end_matches(" ms").parse().ok());
    Ok(ClickHouseMeasured {
        bytes: 0,
        delivered: delivered as u64,
        batches: batches as u64,
        mean_batch_ms: mean.unwrap_or(f64::NAN),
    })
}

/// `bytes_on_disk` of the rsprof tables' active parts in `database` (the server's default:
/// `None`), merged first; 0 before the agent created them.
pub(crate) fn clickhouse_bytes(
    server: &::tests::clickhouse::Server,
    database: Option<&str>,
) -> anyhow::Result<u64> {
    let db = database.map_or("currentDatabase()".to_owned(), |d| format!("'{d}'"));
    let tables = server.query(&format!(
        "SELECT name FROM system.tables WHERE database = {db} AND name LIKE 'rsprof_%'"
    ))?;
    let prefix = database.map(|d| format!("{d}.")).unwrap_or_default();
    for t in tables.lines().filter(|t| !t.is_empty()) {
        server.query(&format!("OPTIMIZE TABLE {prefix}{t} FINAL"))?;
    }
    let n = server.query(&format!(
        "SELECT sum(bytes_on_disk) FROM system.parts WHERE active AND database = {db} AND \
         table LIKE 'rsprof_%'"
    ))?;
    n.trim().parse().with_context(|| format!("bad system.parts answer '{}'", n.trim()))
}

fn measure(
    profiler: &Path,
    rate: u32,
    load: Load,
    secs: u64,
    warmup: u64,
    sink: SinkKind,
) -> anyhow::Result<Measured> {
    let tmp = tempfile_dir()?;
    let server = match sink {
        SinkKind::Spool => None,
        SinkKind::Clickhouse => Some(::tests::clickhouse::Server::start()?),
    };
    let extra: Vec<String> = server.iter().flat_map(|s| ["--clickhouse".into(), s.url()]).collect();
    let spool = tmp.join("spool");
    let _busy = match load {
        Load::Idle => Vec::new(),
        Load::Busy => {
            let fixture = ::tests::fixtures::build("bench_work.c")?;
            // Far more work than the run lasts; killed when done.
            vec![Reaper(
                Command::new(&fixture)
                    .args(["1000000000000", &online_cpus().to_string()])
                    .stdout(Stdio::null())
                    .spawn()
                    .context("start bench_work")?,
            )]
        }
    };
    let (mut agent, lines) = start_agent(profiler, rate, &spool, &extra)?;
    let pid = agent.0.id();
    let start = Instant::now();
    let (cpu0, bpf0) = (cpu_seconds(pid)?, bpf_seconds(pid)?);
    let mut m = Measured::default();
    let mut warm: Option<(Instant, f64, f64)> = None;
    while start.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(TICK);
        if let Some(status) = agent.0.try_wait()? {
            bail!("the agent exited early: {status}");
        }
        let rss = rss_kib(pid)?;
        m.rss_max_kib = m.rss_max_kib.max(rss);
        if warm.is_none() && start.elapsed() >= Duration::from_secs(warmup) {
            warm = Some((Instant::now(), cpu_seconds(pid)?, bpf_seconds(pid)?));
            m.rss_after_warmup_kib = rss;
        }
    }
    let (cpu1, bpf1) = (cpu_seconds(pid)?, bpf_seconds(pid)?);
    m.rss_end_kib = rss_kib(pid)?;
    let (t, c, b) = warm.context("--secs must exceed --warmup")?;
    m.steady_wall_s = t.elapsed().as_secs_f64();
    m.steady_cpu_s = cpu1 - c;
    m.steady_bpf_s = bpf1 - b;
    m.total_cpu_s = cpu1 - cpu0;
    m.total_bpf_s = bpf1 - bpf0;
    // SIGTERM flushes the last window; the spool then holds the whole run.
    let stderr = stop_agent(&mut agent, &lines)?;
    (m.spool_bytes, m.windows) = dir_bytes(&spool);
    if let Some(server) = &server {
        let mut ch = delivery_stats(&stderr)?;
        ch.bytes = clickhouse_bytes(server, None)?;
        m.clickhouse = Some(ch);
    }
    let _ = fs::remove_dir_all(&tmp);
    Ok(m)
}

struct QueryMeasured {
    processes: usize,
    windows: u64,
    sample_rows: u64,
    load_s: f64,
    query_s: f64,
    output_bytes: u64,
    /// Why the Firefox Profiler's importer did not load the output, if it did not: reported
    /// (and failing the benchmark after the results are written), not losing the run.
    import_error: Option<String>,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// `ms` since the epoch as RFC 3339 UTC (`query --from/--to`).
fn rfc3339(ms: u64) -> String {
    let (days, rem) = ((ms / 1000 / 86_400) as i64, ms / 1000 % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem / 60 % 60, rem % 60)
}

/// The query benchmark (see the module docs).
fn bench_query(profiler: &Path, processes: usize) -> anyhow::Result<QueryMeasured> {
    let tmp = tempfile_dir()?.join("query");
    let (source, fleet) = (tmp.join("source"), tmp.join("fleet"));
    fs::create_dir_all(&fleet)?;
    // Real windows: every process with samples in one 10 s window of a busy host.
    {
        let fixture = ::tests::fixtures::build("bench_work.c")?;
        let _busy = Reaper(
            Command::new(&fixture)
                .args(["1000000000000", &online_cpus().to_string()])
                .stdout(Stdio::null())
                .spawn()
                .context("start bench_work")?,
        );
        let window = ["--window".to_owned(), (QUERY_WINDOW_MS / 1000).to_string()];
        let (mut agent, lines) = start_agent(profiler, 99, &source, &window)?;
        std::thread::sleep(Duration::from_millis(2 * QUERY_WINDOW_MS + 5_000));
        stop_agent(&mut agent, &lines)?;
    }
    // Window stems start with the window's start time: group by it, take the fullest window.
    let mut groups: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for e in fs::read_dir(&source)? {
        let name = e?.file_name().to_string_lossy().into_owned();
        if let Some(stem) = name.strip_suffix(".json") {
            groups.entry(stem[..13.min(stem.len())].to_owned()).or_default().push(stem.to_owned());
        }
    }
    let stems = groups.into_values().max_by_key(Vec::len).context("the agent spooled nothing")?;
    let mut windows = Vec::new();
    for stem in &stems {
        let meta: serde_json::Value =
            serde_json::from_slice(&fs::read(source.join(format!("{stem}.json")))?)?;
        let profile = fs::read(source.join(format!("{stem}.pb.gz")))?;
        windows.push((meta, profile));
    }
    windows.sort_by_key(|(m, _)| std::cmp::Reverse(m["samples"].as_u64().unwrap_or(0)));
    if processes > 0 {
        windows.truncate(processes);
    }
    // One hour ending two hours ago: clear of the windows the loading agent writes itself.
    let base = (now_ms() - 3 * 3_600_000) / QUERY_WINDOW_MS * QUERY_WINDOW_MS;
    let mut count = 0u64;
    for h in 0..QUERY_HOSTS {
        let host = format!("bench-host-{h:02}");
        for i in 0..QUERY_WINDOWS {
            let start = base + i * QUERY_WINDOW_MS;
            for (meta, profile) in &windows {
                let mut meta = meta.clone();
                let id = meta["window_id"].as_str().context("no window_id")?;
                // START_MS-PID-HASH, unique per host; the host number keeps stems apart in
                // this one spool.
                let rest = id.split_once('-').context("bad window_id")?.1;
                let stem = format!("{start:013}-{rest}{h:02x}");
                meta["window_id"] = stem.clone().into();
                meta["start_ms"] = start.into();
                meta["end_ms"] = (start + QUERY_WINDOW_MS).into();
                meta["host"] = host.clone().into();
                fs::write(fleet.join(format!("{stem}.pb.gz")), profile)?;
                fs::write(fleet.join(format!("{stem}.json")), serde_json::to_vec(&meta)?)?;
                count += 1;
            }
        }
    }
    println!("{count} windows spooled ({} processes per window)", windows.len());
    // The agent delivers the spooled fleet as a backlog; it samples at 1 Hz in one long window
    // meanwhile (its own windows fall outside the queried hour).
    let server = ::tests::clickhouse::Server::start()?;
    let extra = ["--window".into(), "3600".into(), "--clickhouse".into(), server.url()];
    let t = Instant::now();
    let (mut agent, lines) = start_agent(profiler, 1, &fleet, &extra)?;
    let stored = || -> anyhow::Result<u64> {
        let n = server.query("SELECT count() FROM rsprof_windows")?;
        n.trim().parse().with_context(|| format!("bad count '{}'", n.trim()))
    };
    let (mut last, mut progress) = (0, Instant::now());
    loop {
        std::thread::sleep(Duration::from_secs(1));
        if let Some(status) = agent.0.try_wait()? {
            bail!("the loading agent exited early: {status}");
        }
        let n = stored().unwrap_or(0);
        if n >= count {
            break;
        }
        if n > last {
            (last, progress) = (n, Instant::now());
        } else if progress.elapsed() > Duration::from_secs(180) {
            bail!("ClickHouse stuck at {n} of {count} windows for 180 s:\n{}", server.log());
        }
    }
    let load_s = t.elapsed().as_secs_f64();
    let stderr = stop_agent(&mut agent, &lines)?;
    let ch = delivery_stats(&stderr)?;
    println!(
        "loaded in {load_s:.0} s: {} windows in {} batches, {:.1} ms per batch",
        ch.delivered, ch.batches, ch.mean_batch_ms
    );
    let sample_rows: u64 =
        server.query("SELECT count() FROM rsprof_samples")?.trim().parse().context("count")?;

    let out = tmp.join("fleet.json.gz");
    let mut cmd = Command::new(profiler);
    cmd.args(["query", "--clickhouse", &server.url(), "--from", &rfc3339(base), "--to"])
        .arg(rfc3339(base + QUERY_WINDOWS * QUERY_WINDOW_MS))
        .arg("-o")
        .arg(&out)
        .stdin(Stdio::null());
    println!("$ {}", display(&cmd));
    let t = Instant::now();
    let status = cmd.status().with_context(|| format!("run {}", display(&cmd)))?;
    let query_s = t.elapsed().as_secs_f64();
    anyhow::ensure!(status.success(), "{} failed: {status}", display(&cmd));
    let output_bytes = fs::metadata(&out)?.len();
    println!("query: {query_s:.2} s, {output_bytes} bytes");
    let import_error = match ::tests::gecko_schema::load(&out) {
        Ok(profile) => {
            let text = profile.to_string();
            (0..QUERY_HOSTS)
                .map(|h| format!("bench-host-{h:02}"))
                .find(|host| !text.contains(host))
                .map(|host| format!("the imported fleet profile has no track of {host}"))
        }
        Err(e) => Some(format!("{e:#}").lines().take(3).collect::<Vec<_>>().join(" ")),
    };
    let _ = fs::remove_dir_all(&tmp);
    Ok(QueryMeasured {
        processes: windows.len(),
        windows: count,
        sample_rows,
        load_s,
        query_s,
        output_bytes,
        import_error,
    })
}

pub(crate) fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("rsprof-bench-agent-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    Ok(dir)
}

pub(crate) fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

pub fn bench_agent(args: BenchAgentArgs) -> anyhow::Result<()> {
    if args.churn {
        let profiler = profiler_binary(args.profiler.as_deref())?;
        let _stats = StatsGuard::enable()?;
        let md = churn::run(&profiler, args.churn_rate, args.churn_execs, args.secs, args.warmup)?;
        println!("\n{md}");
        if !args.no_write {
            let path = workspace_root().join("BENCHMARKS.md");
            update_section(&path, CHURN_BEGIN, CHURN_END, &md)?;
            println!("updated BENCHMARKS.md");
        }
        return Ok(());
    }
    if args.together {
        // The warm-up comes before the measured windows.
        anyhow::ensure!(args.secs >= 2 * TICK.as_secs(), "--secs must be at least 20");
    } else {
        anyhow::ensure!(
            args.secs > args.warmup + TICK.as_secs(),
            "--secs must be above --warmup + {} s",
            TICK.as_secs()
        );
    }
    let profiler = profiler_binary(args.profiler.as_deref())?;
    let _stats = StatsGuard::enable()?;
    let mut rows = Vec::new();
    let sinks = if args.query_only || args.together { &[][..] } else { &args.sinks[..] };
    let together = match args.together {
        true => Some(together::run(&profiler, &args.sinks, &args.rates, args.secs, args.warmup)?),
        false => None,
    };
    for &sink in sinks {
        for &rate in &args.rates {
            for load in [Load::Idle, Load::Busy] {
                step(&format!(
                    "bench-agent: {} sink, {rate} Hz, {}, {} s",
                    sink.name(),
                    load.name(),
                    args.secs
                ));
                let m = measure(&profiler, rate, load, args.secs, args.warmup, sink)?;
                println!(
                    "steady {:.3}% of a core (agent {:.2} s + BPF {:.2} s over {:.0} s); RSS {} → \
                     {}",
                    m.steady_pct(),
                    m.steady_cpu_s,
                    m.steady_bpf_s,
                    m.steady_wall_s,
                    mib(m.rss_after_warmup_kib),
                    mib(m.rss_end_kib)
                );
                if let Some(ch) = &m.clickhouse {
                    println!(
                        "ClickHouse: {} windows in {} batches, {:.1} ms per batch, {:.2} ms per \
                         window; {} bytes on disk",
                        ch.delivered,
                        ch.batches,
                        ch.mean_batch_ms,
                        ch.per_window_ms(),
                        ch.bytes
                    );
                }
                rows.push((sink, rate, load, m));
            }
        }
    }
    let query = if args.no_query {
        None
    } else {
        step("bench-agent: query over a synthetic 10-host × 1-hour fleet in ClickHouse");
        let q = bench_query(&profiler, args.query_processes)?;
        println!(
            "query: {:.2} s for {} windows ({} sample rows, {} hosts); loaded by the agent in \
             {:.0} s ({:.0} windows/s); output {} bytes",
            q.query_s,
            q.windows,
            q.sample_rows,
            QUERY_HOSTS,
            q.load_s,
            q.windows as f64 / q.load_s,
            q.output_bytes
        );
        Some(q)
    };
    let mut md = String::new();
    let _ = writeln!(md, "## Agent cost: `cargo xtask bench-agent`\n");
    let _ = writeln!(
        md,
        "- Command: `cargo xtask bench-agent --secs {}{}{}`; {} online CPUs; kernel {}",
        args.secs,
        if args.together { " --together" } else { "" },
        if args.warmup == 60 { String::new() } else { format!(" --warmup {}", args.warmup) },
        online_cpus(),
        fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim()
    );
    if let Some(phases) = &together {
        md.push('\n');
        md.push_str(&together::table(phases, args.secs, args.warmup));
    }
    if !rows.is_empty() {
        let _ = writeln!(
            md,
            "- CPU = the agent's user+sys (/proc/PID/stat) + its BPF programs' run time \
             (fdinfo `run_time_ns`, `kernel.bpf_stats_enabled=1`), after a {} s warm-up, as a \
             share of one core. Bytes per host-hour = spool size at exit scaled to one hour; for \
             ClickHouse, `bytes_on_disk` of the rsprof tables' active parts (after `OPTIMIZE … \
             FINAL`) scaled to one hour, and the sink's mean delivery time per window (batch \
             latency × batches / windows, from the agent's exit summary).\n",
            args.warmup
        );
        let _ = writeln!(
            md,
            "| Sink | Rate | Load | CPU, steady | agent / BPF s (steady) | CPU incl. start-up | RSS after warm-up | RSS at end | RSS max | Windows | Spool bytes per host-hour | ClickHouse bytes per host-hour | Delivery per window (batches) |"
        );
        let _ = writeln!(md, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    }
    for (sink, rate, load, m) in &rows {
        let total_pct = 100.0 * (m.total_cpu_s + m.total_bpf_s) / args.secs as f64;
        let per_hour = |bytes: u64| bytes as f64 * 3600.0 / args.secs as f64 / (1024.0 * 1024.0);
        let (ch_bytes, ch_delivery) = match &m.clickhouse {
            Some(ch) => (
                format!("{:.1} MiB", per_hour(ch.bytes)),
                format!("{:.1} ms ({})", ch.per_window_ms(), ch.batches),
            ),
            None => ("–".into(), "–".into()),
        };
        let _ = writeln!(
            md,
            "| {} | {rate} Hz | {} | {:.3} % | {:.2} / {:.2} | {:.3} % | {} | {} | {} | {} | {:.1} MiB | {ch_bytes} | {ch_delivery} |",
            sink.name(),
            load.name(),
            m.steady_pct(),
            m.steady_cpu_s,
            m.steady_bpf_s,
            total_pct,
            mib(m.rss_after_warmup_kib),
            mib(m.rss_end_kib),
            mib(m.rss_max_kib),
            m.windows,
            per_hour(m.spool_bytes)
        );
    }
    if let Some(q) = &query {
        let _ = writeln!(
            md,
            "\n`rsprof-bpf query --clickhouse URL --from … --to … -o fleet.json.gz` over a \
             synthetic fleet: {QUERY_HOSTS} hosts × {QUERY_WINDOWS} windows of {} s (the {} \
             processes of one real window, with `bench_work` busy, copied per host and time): {} \
             windows, {} sample rows, delivered by the agent in {:.0} s ({:.0} windows/s). \
             **Query: {:.2} s** (target ≤ {} s); output {:.1} MiB, {}.",
            QUERY_WINDOW_MS / 1000,
            q.processes,
            q.windows,
            q.sample_rows,
            q.load_s,
            q.windows as f64 / q.load_s,
            q.query_s,
            QUERY_TARGET.as_secs(),
            q.output_bytes as f64 / (1024.0 * 1024.0),
            match &q.import_error {
                None => "loaded by the Firefox Profiler's importer".to_string(),
                Some(e) => format!("**not** loaded by the Firefox Profiler's importer ({e})"),
            }
        );
    }
    println!("\n{md}");
    if !args.no_write {
        update_section(&workspace_root().join("BENCHMARKS.md"), SECTION_BEGIN, SECTION_END, &md)?;
        println!("updated BENCHMARKS.md");
    }
    if let Some(q) = &query {
        if let Some(e) = &q.import_error {
            anyhow::bail!(
                "the query's output did not load in the Firefox Profiler's importer: {e}"
            );
        }
        anyhow::ensure!(
            q.query_s <= QUERY_TARGET.as_secs_f64(),
            "query took {:.2} s, above the {} s target",
            q.query_s,
            QUERY_TARGET.as_secs()
        );
    }
    Ok(())
}
