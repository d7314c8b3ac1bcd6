//! `cargo xtask bench-dump`: what a flight recorder dump costs. The agent runs at 99 Hz with
//! `--flight-recorder` as long as the window, every CPU busy with `bench_work` (4-deep stacks),
//! until the window is full; then `rsprof-bpf dump` asks for all of it. Measured: the dump's
//! latency as the client sees it (request to file written), the agent's RSS before the dump and
//! its peak (VmHWM) after, the profile's samples and size.

use std::fmt::Write as _;
use std::fs;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::{
    bench::{Reaper, online_cpus, profiler_binary, update_section},
    bench_agent::{mib, rss_kib, start_agent, tempfile_dir},
    display, step, workspace_root,
};

const SECTION_BEGIN: &str =
    "<!-- BEGIN cargo xtask bench-dump (generated; edits are overwritten) -->";
const SECTION_END: &str = "<!-- END cargo xtask bench-dump -->";
const RATE: u32 = 99;

#[derive(clap::Args)]
pub struct BenchDumpArgs {
    /// The flight recorder's length and how long the agent runs before the dump (the issue
    /// asks for 300).
    #[arg(long, default_value_t = 300)]
    secs: u64,
    /// Use this rsprof-bpf binary instead of building target/release/rsprof-bpf.
    #[arg(long)]
    profiler: Option<std::path::PathBuf>,
    /// Only print the results; leave BENCHMARKS.md alone.
    #[arg(long)]
    no_write: bool,
}

/// Peak RSS (VmHWM) of `pid`, KiB.
fn hwm_kib(pid: u32) -> anyhow::Result<u64> {
    crate::bench::status_kib(pid, "VmHWM:").with_context(|| format!("no VmHWM for pid {pid}"))
}

pub fn bench_dump(args: BenchDumpArgs) -> anyhow::Result<()> {
    let profiler = profiler_binary(args.profiler.as_deref())?;
    let tmp = tempfile_dir()?;
    let sock = tmp.join("sock/agent.sock");
    let out = tmp.join("dump.json.gz");
    let cpus = online_cpus();
    let fixture = ::tests::fixtures::build("bench_work.c")?;
    let _busy = Reaper(
        Command::new(&fixture)
            .args(["1000000000000", &cpus.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .context("start bench_work")?,
    );
    step(&format!("bench-dump: {RATE} Hz, {cpus} CPUs busy, --flight-recorder {}s", args.secs));
    let extra = [
        "--flight-recorder".to_owned(),
        format!("{}s", args.secs),
        "--dump-socket".to_owned(),
        sock.display().to_string(),
    ];
    let (mut agent, _lines) = start_agent(&profiler, RATE, &tmp.join("spool"), &extra)?;
    let pid = agent.0.id();
    // A little over the window, so the dump covers a full one.
    std::thread::sleep(Duration::from_secs(args.secs + 5));
    if let Some(status) = agent.0.try_wait()? {
        bail!("the agent exited early: {status}");
    }
    let (rss_before, hwm_before) = (rss_kib(pid)?, hwm_kib(pid)?);
    let mut cmd = Command::new(&profiler);
    cmd.arg("dump").arg("-o").arg(&out).arg("--socket").arg(&sock);
    println!("$ {}", display(&cmd));
    let t = Instant::now();
    let done = cmd.output()?;
    let latency = t.elapsed();
    if !done.status.success() {
        bail!("dump failed: {}", String::from_utf8_lossy(&done.stderr));
    }
    let said = String::from_utf8_lossy(&done.stderr).trim().to_owned();
    let (rss_after, hwm_after) = (rss_kib(pid)?, hwm_kib(pid)?);
    let bytes = fs::metadata(&out)?.len();
    drop(agent);
    let _ = fs::remove_dir_all(&tmp);
    let mut md = String::new();
    let _ = writeln!(md, "## Flight recorder dump: `cargo xtask bench-dump`\n");
    let _ = writeln!(
        md,
        "- Command: `cargo xtask bench-dump --secs {}`; {cpus} online CPUs, all busy \
         (`bench_work`); agent at {RATE} Hz with `--flight-recorder {}s` (default `--buffer-size` 16M); \
         kernel {}",
        args.secs,
        args.secs,
        fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim()
    );
    let _ = writeln!(
        md,
        "- Latency = `rsprof-bpf dump` of the whole window, from start to file written \
         (capture, symbolize, Gecko JSON, gzip, transfer). Peak = the agent's VmHWM.\n"
    );
    let _ = writeln!(
        md,
        "| Window | Dump latency | Agent RSS before | Agent peak RSS before → after | RSS after | Profile | `dump` said |"
    );
    let _ = writeln!(md, "|---:|---:|---:|---:|---:|---:|---|");
    let _ = writeln!(
        md,
        "| {} s | {:.2} s | {} | {} → {} | {} | {:.2} MiB | {said} |",
        args.secs,
        latency.as_secs_f64(),
        mib(rss_before),
        mib(hwm_before),
        mib(hwm_after),
        mib(rss_after),
        bytes as f64 / (1024.0 * 1024.0)
    );
    println!("\n{md}");
    if !args.no_write {
        update_section(&workspace_root().join("BENCHMARKS.md"), SECTION_BEGIN, SECTION_END, &md)?;
        println!("updated BENCHMARKS.md");
    }
    Ok(())
}
