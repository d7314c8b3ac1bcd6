//! `cargo xtask bench-metrics`: what a Prometheus scrape of `rsprof-bpf agent` costs.
//!
//! The agent runs `--all -F 99` with windows long enough (600 s) that none is written during
//! the measurement. Phase 1 scrapes `/metrics` N times back to back and times each; phase 2
//! leaves the agent alone for as long as phase 1 took. The agent's CPU time (utime + stime
//! from /proc) in phase 1 minus phase 2, over N, is the CPU per scrape.

use std::{
    fmt::Write as _,
    io::{BufRead as _, BufReader},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::{build, step, workspace_root};

const SECTION_BEGIN: &str =
    "<!-- BEGIN cargo xtask bench-metrics (generated; edits are overwritten) -->";
const SECTION_END: &str = "<!-- END cargo xtask bench-metrics -->";

#[derive(clap::Args)]
pub struct BenchMetricsArgs {
    /// Scrapes in the measured phase.
    #[arg(long, default_value_t = 2000)]
    scrapes: u32,
    /// Only print the results; leave BENCHMARKS.md alone.
    #[arg(long)]
    no_write: bool,
}

/// utime + stime of `pid`, seconds.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    crate::bench::stat_cpu_seconds(pid).context("no /proc/PID/stat")
}

pub fn bench_metrics(args: BenchMetricsArgs) -> anyhow::Result<()> {
    let bin = build()?;
    step("bench-metrics: agent --all -F 99 --window 600, scrapes, then as long idle");
    let spool = std::env::temp_dir().join(format!("rsprof-bench-metrics-{}", std::process::id()));
    let mut child = Command::new(&bin)
        .args(["agent", "-F", "99", "--window", "600", "--metrics", "127.0.0.1:0", "--spool"])
        .arg(&spool)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let pid = child.id();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let Some(l) = lines.next() else { bail!("agent exited before serving metrics") };
        let l = l?;
        if let Some(rest) = l.split("metrics on http://").nth(1) {
            break rest.trim_end_matches("/metrics").to_owned();
        }
    };
    // Keep reading its stderr so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    let url = format!("http://{addr}/metrics");
    let result = (|| {
        // Warm up: the first scrapes allocate the buffers.
        for _ in 0..20 {
            ureq::get(&url).call()?.into_body().read_to_string()?;
        }
        std::thread::sleep(Duration::from_secs(2));
        let mut latencies = Vec::with_capacity(args.scrapes as usize);
        let mut bytes = 0;
        let cpu0 = cpu_seconds(pid)?;
        let t0 = Instant::now();
        for _ in 0..args.scrapes {
            let t = Instant::now();
            let body = ureq::get(&url).call()?.into_body().read_to_string()?;
            latencies.push(t.elapsed());
            bytes = body.len();
        }
        let busy = t0.elapsed();
        let cpu1 = cpu_seconds(pid)?;
        std::thread::sleep(busy);
        let cpu2 = cpu_seconds(pid)?;
        latencies.sort();
        anyhow::Ok((latencies, bytes, busy, cpu1 - cpu0, cpu2 - cpu1))
    })();
    // SAFETY: our own child.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&spool);
    let (latencies, bytes, busy, cpu_scraping, cpu_idle) = result?;
    let n = args.scrapes as f64;
    let q = |p: f64| latencies[((latencies.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6;
    let per_scrape_us = (cpu_scraping - cpu_idle) / n * 1e6;
    let mut report = String::new();
    let _ = writeln!(report, "Command: `cargo xtask bench-metrics --scrapes {}`\n", args.scrapes);
    let _ = writeln!(
        report,
        "The agent (`--all -F 99 --window 600`, no window written meanwhile) scraped {} times \
         back to back over {:.2} s, then left alone as long. Exposition {} bytes.\n",
        args.scrapes,
        busy.as_secs_f64(),
        bytes
    );
    let _ = writeln!(report, "| | value |\n|---|---|");
    let _ = writeln!(
        report,
        "| agent CPU per scrape (scraping minus idle, / scrapes) | {per_scrape_us:.0} µs |"
    );
    let _ = writeln!(
        report,
        "| agent CPU while scraping / idle | {cpu_scraping:.2} s / {cpu_idle:.2} s |"
    );
    let _ = writeln!(
        report,
        "| scrape latency p50 / p99 / max | {:.0} / {:.0} / {:.0} µs |",
        q(0.5),
        q(0.99),
        q(1.0)
    );
    let _ = writeln!(
        report,
        "\nAt Prometheus' default 15 s interval that is {:.4}% of one core.",
        per_scrape_us / 15e6 * 100.0
    );
    print!("{report}");
    if !args.no_write {
        crate::bench::update_section(
            &workspace_root().join("BENCHMARKS.md"),
            SECTION_BEGIN,
            SECTION_END,
            &report,
        )?;
    }
    Ok(())
}
