//! `cargo xtask bench-storage`: chunked storage and Gecko writer throughput, and a long
//! recording with a small buffer to show memory stays flat once the buffer is full.
//!
//! 1. `cargo bench -p rsprof-core --bench storage` (rsprof-core/benches/storage.rs): fills
//!    a 64 MiB store with a synthetic mix, then writes it as a gzipped Gecko profile.
//! 2. `rsprof-bpf --all -F 999 --buffer-size 8M` for `--long-seconds` (default 600) while one
//!    busy loop per CPU runs, sampling the profiler's RSS every 5 s from /proc; then checks the
//!    profile holds only the newest window.

use std::{
    fmt::Write as _,
    fs,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use serde_json::Value;

use crate::{
    bench::{busy_loops, status_kib},
    build, cargo, display, step, workspace_root,
};

const SECTION_BEGIN: &str =
    "<!-- BEGIN cargo xtask bench-storage (generated; edits are overwritten) -->";
const SECTION_END: &str = "<!-- END cargo xtask bench-storage -->";

#[derive(clap::Args)]
pub struct BenchStorageArgs {
    /// Length of the long recording, seconds.
    #[arg(long, default_value_t = 600)]
    long_seconds: u64,
    /// Buffer size for the long recording.
    #[arg(long, default_value = "8M")]
    long_buffer: String,
    /// Only print the results; leave BENCHMARKS.md alone.
    #[arg(long)]
    no_write: bool,
}

pub fn bench_storage(args: BenchStorageArgs) -> anyhow::Result<()> {
    step("bench-storage: cargo bench -p rsprof-core --bench storage");
    let mut cmd = cargo();
    cmd.args(["bench", "-p", "rsprof-core", "--bench", "storage"]).current_dir(workspace_root());
    let out = cmd.stderr(Stdio::inherit()).output().context("cargo bench")?;
    if !out.status.success() {
        bail!("`{}` failed", display(&cmd));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.starts_with('{')).context("no result line")?;
    let micro: Value = serde_json::from_str(line)?;
    println!("{micro:#}");

    let bin = build()?;
    let cpus = thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let out_path = std::env::temp_dir().join("rsprof-bench-long.json.gz");
    step(&format!(
        "bench-storage: rsprof-bpf --all -F 999 --buffer-size {} for {} s with {cpus} busy loops",
        args.long_buffer, args.long_seconds
    ));
    let loops = busy_loops(cpus)?;
    let mut child = Command::new(&bin)
        .args(["-v", "--all", "-F", "999", "--buffer-size", &args.long_buffer, "-o"])
        .arg(&out_path)
        .args(["-d", &args.long_seconds.to_string()])
        .stderr(Stdio::piped())
        .spawn()
        .context("start rsprof-bpf")?;
    let t0 = Instant::now();
    let mut series: Vec<(u64, u64)> = Vec::new();
    while child.try_wait()?.is_none() {
        if let Some(r) = status_kib(child.id(), "VmRSS:") {
            series.push((t0.elapsed().as_secs(), r));
        }
        thread::sleep(Duration::from_secs(5));
    }
    drop(loops);
    let out = child.wait_with_output()?;
    let summary = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        bail!("rsprof-bpf failed:\n{summary}");
    }
    let profile = tests::gecko_schema::load(&out_path)?;
    let _ = fs::remove_file(&out_path);
    let report = render(&args, &micro, &series, &profile, &summary);
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

fn render(
    args: &BenchStorageArgs,
    micro: &Value,
    series: &[(u64, u64)],
    profile: &Value,
    summary: &str,
) -> String {
    let f = |k: &str| micro[k].as_f64().unwrap_or(f64::NAN);
    let mib = |kib: f64| kib / 1024.0;
    let mut s = String::new();
    let cmd = if args.long_seconds == 600 && args.long_buffer == "8M" {
        "cargo xtask bench-storage".to_owned()
    } else {
        format!(
            "cargo xtask bench-storage --long-seconds {} --long-buffer {}",
            args.long_seconds, args.long_buffer
        )
    };
    writeln!(s, "## Chunked storage (`{cmd}`)\n").unwrap();
    writeln!(
        s,
        "Synthetic mix (`rsprof-core/benches/storage.rs`): 400 threads in 100 processes, \
         stacks of 2–40 frames from 200 call paths per process, a third with kernel frames.\n"
    )
    .unwrap();
    writeln!(s, "| measure | value |\n|---|---:|").unwrap();
    let rows = [
        ("buffer", format!("{:.0} MiB", f("buffer_bytes") / 1048576.0)),
        ("encode throughput", format!("{:.0} samples/s", f("encode_events_per_s"))),
        ("bytes per stored sample", format!("{:.1}", f("bytes_per_sample"))),
        ("samples held by the full buffer", format!("{:.0}", f("events_kept"))),
        ("stack table beside it", format!("{:.1} MiB", f("stack_nodes_bytes") / 1048576.0)),
        ("Gecko generation", format!("{:.0} samples/s", f("write_samples_per_s"))),
        ("Gecko JSON produced", format!("{:.1} MB/s", f("write_json_mb_per_s"))),
        (
            "profile size (JSON / gzip)",
            format!("{:.0} / {:.0} MB", f("json_bytes") / 1e6, f("gzip_bytes") / 1e6),
        ),
        ("RSS with the buffer full", format!("{:.0} MiB", mib(f("rss_filled_kib")))),
        ("peak RSS while writing", format!("{:.0} MiB", mib(f("rss_peak_kib")))),
    ];
    for (k, v) in rows {
        writeln!(s, "| {k} | {v} |").unwrap();
    }
    let recycled = &profile["meta"]["rsprof"]["recycled"];
    let start = profile["meta"]["profilingStartTime"].as_f64().unwrap_or(0.0);
    let end = profile["meta"]["profilingEndTime"].as_f64().unwrap_or(0.0);
    writeln!(
        s,
        "\nLong recording: `rsprof-bpf --all -F 999 --buffer-size {} -d {}` with one busy loop \
         per CPU. RSS of rsprof-bpf every minute (MiB):\n",
        args.long_buffer, args.long_seconds
    )
    .unwrap();
    let minutes: Vec<String> = series
        .iter()
        .filter(|(t, _)| t % 60 < 5)
        .map(|(t, r)| format!("{}:{:.1}", t / 60, mib(*r as f64)))
        .collect();
    writeln!(s, "`{}`\n", minutes.join("  ")).unwrap();
    let half = args.long_seconds / 2;
    let max_second_half = series.iter().filter(|(t, _)| *t >= half).map(|x| x.1).max();
    let at_half = series.iter().find(|(t, _)| *t >= half).map(|x| x.1);
    if let (Some(a), Some(m)) = (at_half, max_second_half) {
        writeln!(
            s,
            "RSS at {half} s: {:.1} MiB; highest after: {:.1} MiB.",
            mib(a as f64),
            mib(m as f64)
        )
        .unwrap();
    }
    writeln!(
        s,
        "The profile covers {:.1} s to {:.1} s; recycled: {}.",
        start / 1e3,
        end / 1e3,
        recycled
    )
    .unwrap();
    if let Some(line) = summary.lines().find(|l| l.starts_with("buffer:")) {
        writeln!(s, "Summary line: `{line}`").unwrap();
    }
    s
}
