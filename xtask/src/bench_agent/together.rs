//! `cargo xtask bench-agent --together`: every configuration (sink × rate) at once, over the
//! same idle window and then the same busy window, instead of one after the other (8 runs of
//! `--secs` become 2).
//!
//! Each agent has its own spool directory, metrics port and, for the ClickHouse sink, its own
//! database on one shared server, so each figure is that agent's: its user+sys time, the run
//! time of the BPF programs it holds open (by program id; the ids of the agents are checked
//! to be disjoint), its RSS, the bytes it wrote to its spool (`rsprof_spool_written_bytes`
//! from its /metrics: evictions do not hide bytes) and the growth of its database's tables
//! (`bytes_on_disk` of the active parts, merged first), both scaled to an hour. Running
//! together, every agent also samples the others' processes and each one's BPF hooks fire for
//! every CPU's events as usual: the machine is busier than with one agent, which the output
//! says.

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::TcpStream,
    path::{Path, PathBuf},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::{
    Load, Reaper, SinkKind, bpf_programs, clickhouse_bytes, cpu_seconds, delivery_stats, mib,
    rss_kib, start_agent, stop_agent, tempfile_dir,
};
use crate::{bench::online_cpus, display};

/// One running agent.
struct Running {
    sink: SinkKind,
    rate: u32,
    agent: Reaper,
    lines: mpsc::Receiver<String>,
    pid: u32,
    spool: PathBuf,
    /// Its ClickHouse database.
    database: Option<String>,
    /// `host:port` of its /metrics.
    metrics: String,
}

/// One agent's counters at one time.
struct Snap {
    at: Instant,
    cpu_s: f64,
    bpf_s: f64,
    spool_written: u64,
    windows: u64,
    clickhouse_bytes: Option<u64>,
}

/// RSS is read every second. A window's symbolizing maps the files it reads (their pages are
/// page cache, shared with the programs running them) and lets them go within the second: one
/// reading can land in it (a 99 Hz agent next to ClickHouse read 48 MiB once, 19 MiB a second
/// later, its file-backed part 11 → 19 → 13 MiB). The RSS at a phase's start and end is the
/// median of its first and last 30 readings; the max keeps every reading.
const RSS_TICK: Duration = Duration::from_secs(1);
const LEVEL_READINGS: usize = 30;

fn level(readings: &[u64]) -> u64 {
    let mut v = readings.to_vec();
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// One agent over one phase.
pub(super) struct Phase {
    pub sink: SinkKind,
    pub rate: u32,
    pub load: Load,
    pub wall_s: f64,
    pub cpu_s: f64,
    pub bpf_s: f64,
    /// When the phase's load began, before its warm-up.
    pub rss_load_start_kib: u64,
    pub rss_start_kib: u64,
    pub rss_end_kib: u64,
    pub rss_max_kib: u64,
    pub windows: u64,
    pub spool_bytes: u64,
    pub clickhouse_bytes: Option<u64>,
}

impl Phase {
    pub fn pct(&self) -> f64 {
        100.0 * (self.cpu_s + self.bpf_s) / self.wall_s.max(1e-9)
    }

    /// `bytes` over the phase as per host-hour, in MiB.
    pub fn per_hour_mib(&self, bytes: u64) -> f64 {
        bytes as f64 * 3600.0 / self.wall_s.max(1e-9) / (1024.0 * 1024.0)
    }
}

/// GET /metrics of an agent.
fn scrape(addr: &str) -> anyhow::Result<String> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connect {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let (head, body) = text.split_once("\r\n\r\n").context("no HTTP header end")?;
    anyhow::ensure!(head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200"), "{head}");
    Ok(body.to_owned())
}

/// The value of metric `name` (any labels) in an exposition.
fn metric(text: &str, name: &str) -> anyhow::Result<u64> {
    (text.lines())
        .find_map(|l| {
            let rest = l.strip_prefix(name)?;
            let value = if rest.starts_with('{') { rest.rsplit_once('}')?.1 } else { rest };
            value.trim().parse::<f64>().ok()
        })
        .map(|v| v as u64)
        .with_context(|| format!("no {name} in the agent's metrics"))
}

fn snap(r: &Running) -> anyhow::Result<Snap> {
    let at = Instant::now();
    let cpu_s = cpu_seconds(r.pid)?;
    let bpf_s = bpf_programs(r.pid)?.values().sum::<u64>() as f64 / 1e9;
    let m = scrape(&r.metrics)?;
    Ok(Snap {
        at,
        cpu_s,
        bpf_s,
        spool_written: metric(&m, "rsprof_spool_written_bytes_total")?,
        windows: metric(&m, "rsprof_spool_windows_written_total")?,
        clickhouse_bytes: None,
    })
}

/// Every agent's counters now; the databases' bytes after (merging takes a while, the CPU
/// figures should not wait for it).
fn snap_all(
    runs: &[Running],
    server: Option<&::tests::clickhouse::Server>,
) -> anyhow::Result<Vec<Snap>> {
    let mut snaps = runs.iter().map(snap).collect::<anyhow::Result<Vec<_>>>()?;
    for (r, s) in runs.iter().zip(&mut snaps) {
        if let (Some(server), Some(db)) = (server, &r.database) {
            s.clickhouse_bytes = Some(clickhouse_bytes(server, Some(db))?);
        }
    }
    Ok(snaps)
}

/// The metrics address the agent printed (`metrics on http://ADDR/metrics`).
fn metrics_addr(lines: &mpsc::Receiver<String>) -> anyhow::Result<String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines.recv_timeout(left).context("no \"metrics on\" line from the agent")?;
        if let Some(rest) = line.split("metrics on http://").nth(1) {
            return Ok(rest.trim_end_matches("/metrics").to_owned());
        }
    }
}

/// Runs every sink × rate together: a warm-up, `secs` idle, `secs` with every CPU busy.
pub(super) fn run(
    profiler: &Path,
    sinks: &[SinkKind],
    rates: &[u32],
    secs: u64,
    warmup: u64,
) -> anyhow::Result<Vec<Phase>> {
    let warmup = std::time::Duration::from_secs(warmup);
    let tmp = tempfile_dir()?;
    let server = match sinks.contains(&SinkKind::Clickhouse) {
        true => Some(::tests::clickhouse::Server::start()?),
        false => None,
    };
    let mut runs = Vec::new();
    for &sink in sinks {
        for &rate in rates {
            let name = format!("{}_{rate}hz", sink.name().to_lowercase());
            let spool = tmp.join(&name);
            let mut extra = Vec::new();
            let database = match (&server, sink) {
                (Some(server), SinkKind::Clickhouse) => {
                    let db = format!("bench_{name}");
                    server.query(&format!("CREATE DATABASE IF NOT EXISTS {db}"))?;
                    extra = vec!["--clickhouse".into(), format!("{}?database={db}", server.url())];
                    Some(db)
                }
                _ => None,
            };
            let (agent, lines) = start_agent(profiler, rate, &spool, &extra)?;
            let metrics = metrics_addr(&lines)?;
            let pid = agent.0.id();
            runs.push(Running { sink, rate, agent, lines, pid, spool, database, metrics });
        }
    }
    // Each agent's BPF time is that of its own programs: no program counted twice.
    let mut owner: BTreeMap<u32, u32> = BTreeMap::new();
    for r in &runs {
        let ids: Vec<u32> = bpf_programs(r.pid)?.into_keys().collect();
        anyhow::ensure!(!ids.is_empty(), "agent {} holds no BPF program", r.pid);
        for id in &ids {
            if let Some(other) = owner.insert(*id, r.pid) {
                bail!("BPF program {id} is held by agents {other} and {}", r.pid);
            }
        }
        println!(
            "agent {} ({} sink, {} Hz): metrics {}, BPF programs {ids:?}",
            r.pid,
            r.sink.name(),
            r.rate,
            r.metrics
        );
    }
    println!("{} agents running together", runs.len());
    let mut phases = Vec::new();
    for load in [Load::Idle, Load::Busy] {
        crate::step(&format!(
            "bench-agent --together: {}, {} s warm-up then {secs} s measured",
            load.name(),
            warmup.as_secs()
        ));
        let _busy = match load {
            Load::Idle => None,
            Load::Busy => {
                let fixture = ::tests::fixtures::build("bench_work.c")?;
                let mut cmd = std::process::Command::new(&fixture);
                cmd.args(["1000000000000", &online_cpus().to_string()])
                    .stdout(std::process::Stdio::null());
                println!("$ {}", display(&cmd));
                Some(Reaper(cmd.spawn().context("start bench_work")?))
            }
        };
        // Each load gets its own warm-up: an agent meets new code when a load starts (a
        // workload's functions to name, its stacks to store), and the steady state is what is
        // measured. What that cost shows as the RSS when the load began.
        let rss_load_start: Vec<u64> =
            runs.iter().map(|r| rss_kib(r.pid)).collect::<Result<_, _>>()?;
        std::thread::sleep(warmup);
        for r in &mut runs {
            if let Some(status) = r.agent.0.try_wait()? {
                bail!("agent {} ({} Hz) exited during the warm-up: {status}", r.pid, r.rate);
            }
        }
        let start = snap_all(&runs, server.as_ref())?;
        let mut rss: Vec<Vec<u64>> =
            runs.iter().map(|r| rss_kib(r.pid).map(|k| vec![k])).collect::<Result<_, _>>()?;
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(secs) {
            std::thread::sleep(RSS_TICK.min(Duration::from_secs(secs).saturating_sub(t.elapsed())));
            for (r, v) in runs.iter_mut().zip(&mut rss) {
                if let Some(status) = r.agent.0.try_wait()? {
                    bail!("agent {} ({} Hz) exited early: {status}", r.pid, r.rate);
                }
                v.push(rss_kib(r.pid)?);
            }
        }
        let end = snap_all(&runs, server.as_ref())?;
        for ((((r, a), b), rss), &load_start) in
            runs.iter().zip(&start).zip(&end).zip(&rss).zip(&rss_load_start)
        {
            phases.push(Phase {
                sink: r.sink,
                rate: r.rate,
                load,
                wall_s: (b.at - a.at).as_secs_f64(),
                cpu_s: b.cpu_s - a.cpu_s,
                bpf_s: b.bpf_s - a.bpf_s,
                rss_load_start_kib: load_start,
                rss_start_kib: level(&rss[..rss.len().min(LEVEL_READINGS)]),
                rss_end_kib: level(&rss[rss.len().saturating_sub(LEVEL_READINGS)..]),
                rss_max_kib: rss.iter().copied().max().unwrap_or(0),
                windows: b.windows - a.windows,
                spool_bytes: b.spool_written - a.spool_written,
                clickhouse_bytes: match (a.clickhouse_bytes, b.clickhouse_bytes) {
                    (Some(a), Some(b)) => Some(b.saturating_sub(a)),
                    _ => None,
                },
            });
            let p = phases.last().expect("pushed");
            println!(
                "{} sink, {} Hz, {}: {:.3}% of a core (agent {:.2} s + BPF {:.2} s over {:.0} s); \
                 RSS {} at load start, {} → {} (max {}) measured; {} windows, spool {:.1} \
                 MiB/h{}",
                r.sink.name(),
                r.rate,
                load.name(),
                p.pct(),
                p.cpu_s,
                p.bpf_s,
                p.wall_s,
                mib(p.rss_load_start_kib),
                mib(p.rss_start_kib),
                mib(p.rss_end_kib),
                mib(p.rss_max_kib),
                p.windows,
                p.per_hour_mib(p.spool_bytes),
                p.clickhouse_bytes
                    .map(|b| format!(", ClickHouse {:.1} MiB/h", p.per_hour_mib(b)))
                    .unwrap_or_default()
            );
        }
    }
    for mut r in runs {
        let stderr = stop_agent(&mut r.agent, &r.lines)?;
        if r.sink == SinkKind::Clickhouse {
            let ch = delivery_stats(&stderr)?;
            anyhow::ensure!(ch.delivered > 0, "agent {} delivered nothing:\n{stderr}", r.pid);
            println!(
                "agent {} (ClickHouse, {} Hz): {} windows in {} batches, {:.1} ms per batch",
                r.pid, r.rate, ch.delivered, ch.batches, ch.mean_batch_ms
            );
        }
        let _ = std::fs::remove_dir_all(&r.spool);
    }
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(phases)
}

/// The results as markdown: the table of BENCHMARKS.md.
pub(super) fn table(phases: &[Phase], secs: u64, warmup: u64) -> String {
    let mut md = String::new();
    md.push_str(&format!(
        "**The {} agents ran concurrently** (`--together`: started at once, each with its own \
         spool, metrics port and ClickHouse database). Two phases, idle then every CPU busy, \
         each a {} s warm-up under its load and then the same {secs} s measured for all; \
         \"load start\" is the RSS (VmRSS) as the phase's load began, before its warm-up; \
         RSS is then read every second, start and end being the medians of the measured \
         window's first and last 30 readings (a window's symbolizing maps the files it reads \
         for under a second) and max the largest reading. Each also samples the \
         others' processes, so the machine is busier than under one agent. CPU = the agent's \
         user+sys (/proc/PID/stat) + the run time of its own BPF programs (fdinfo \
         `run_time_ns` by program id; the agents' ids are disjoint), as a share of one core. \
         Spool bytes = `rsprof_spool_written_bytes` growth from the agent's /metrics; \
         ClickHouse bytes = growth of `bytes_on_disk` of its database's active parts (after \
         `OPTIMIZE … FINAL`); both scaled to one hour.\n\n",
        phases.iter().filter(|p| p.load == Load::Idle).count(),
        warmup
    ));
    md.push_str(
        "| Sink | Rate | Load | CPU | agent / BPF s | RSS at load start | RSS start → end (max) \
         | Windows | Spool bytes per host-hour | ClickHouse bytes per host-hour |\n",
    );
    md.push_str("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for p in phases {
        let ch = p
            .clickhouse_bytes
            .map_or("–".to_owned(), |b| format!("{:.1} MiB", p.per_hour_mib(b)));
        md.push_str(&format!(
            "| {} | {} Hz | {} | {:.3} % | {:.2} / {:.2} | {} | {} → {} ({}) | {} | {:.1} MiB | \
             {ch} |\n",
            p.sink.name(),
            p.rate,
            p.load.name(),
            p.pct(),
            p.cpu_s,
            p.bpf_s,
            mib(p.rss_load_start_kib),
            mib(p.rss_start_kib),
            mib(p.rss_end_kib),
            mib(p.rss_max_kib),
            p.windows,
            p.per_hour_mib(p.spool_bytes),
        ));
    }
    md
}
