//! `rsprof-bpf record`: checks, loads and attaches, collects until told to stop, then
//! symbolizes and writes the profile.

use std::{
    io::IsTerminal as _,
    path::Path,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result, bail};
use aya::maps::{MapData, RingBuf};
use profiler_common::{Config, FILTER_TARGETS};
use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::{SignalKind, signal},
    sync::oneshot,
};

use crate::{
    assemble::RecordingInfo,
    cli::RecordArgs,
    collector::Collector,
    export::{ExportJob, snapshot_path},
    ids::Pid,
    kernel_btf, launch,
    loader::Sampler,
    output::PendingOutput,
    storage::ChunkedStore,
    summary,
    usdt::{self, UsdtCounters, UsdtSession, markers},
};

fn max_sample_rate() -> u64 {
    std::fs::read_to_string("/proc/sys/kernel/perf_event_max_sample_rate")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100_000)
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid timespec pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// (CLOCK_MONOTONIC ns, wall-clock ms) read as close together as possible.
fn clock_pair() -> (u64, f64) {
    let mut best = (u64::MAX, 0u64, 0.0);
    for _ in 0..5 {
        let a = monotonic_ns();
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        let b = monotonic_ns();
        if b - a < best.0 {
            best = (b - a, a + (b - a) / 2, wall.as_secs_f64() * 1000.0);
        }
    }
    (best.1, best.2)
}

fn check_privileges() -> Result<()> {
    // SAFETY: trivial syscall.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "rsprof-bpf needs root (CAP_BPF and CAP_PERFMON) to load BPF programs: run it with sudo"
        );
    }
    Ok(())
}

fn check_pid(pid: u32) -> Result<()> {
    if pid == 0 || !Path::new(&format!("/proc/{pid}/stat")).exists() {
        bail!("no process with pid {pid}");
    }
    Ok(())
}

pub fn validate(args: &RecordArgs) -> Result<()> {
    let max = max_sample_rate();
    if args.frequency == 0 || args.frequency > max {
        bail!(
            "invalid frequency {} Hz: must be between 1 and {max} (kernel.perf_event_max_sample_rate)",
            args.frequency
        );
    }
    if let Some(d) = args.duration
        && !(d.is_finite() && d > 0.0)
    {
        bail!("invalid duration {d}: must be a positive number of seconds");
    }
    if args.buffer_size < (64 << 10) || args.buffer_size > (64 << 30) {
        bail!("invalid buffer size {}: must be between 64K and 64G", args.buffer_size);
    }
    if args.ring_buffer_size < 4096 || args.ring_buffer_size > (1 << 30) {
        bail!("invalid ring buffer size {}: must be between 4K and 1G", args.ring_buffer_size);
    }
    usdt::requests_from_args(&args.usdt, &args.usdt_interval)?;
    Ok(())
}

pub fn run(args: RecordArgs) -> Result<()> {
    validate(&args)?;
    let output = PendingOutput::create(&args.output)?;
    check_privileges()?;
    for &pid in &args.pid {
        check_pid(pid)?;
    }
    let cgroups = crate::cgroup_filter::Selection::from_args(&args.cgroup, &args.container)?;
    let mut config = Config::default();
    kernel_btf::fill_offsets(Path::new(kernel_btf::VMLINUX_BTF), &mut config)?;
    if !args.pid.is_empty() || !args.command.is_empty() {
        config.filter_mode = FILTER_TARGETS;
        config.follow_children = u32::from(!args.command.is_empty());
    }

    // One thread only until the command is forked.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let _guard = rt.enter();
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigusr1 = signal(SignalKind::user_defined1())?;

    let ring_bytes = args.ring_buffer_size.next_power_of_two() as u32;
    let mut sampler = Sampler::load(
        config,
        cgroups.as_ref().map(|c| c.kernel_config()).unwrap_or_default(),
        ring_bytes,
    )?;
    if let Some(c) = &cgroups {
        sampler.add_cgroups(&c.ids())?;
    }
    let gated =
        if args.command.is_empty() { None } else { Some(launch::spawn_gated(&args.command)?) };
    let mut targets: Vec<Pid> = args.pid.iter().map(|&p| Pid(p)).collect();
    targets.extend(gated.as_ref().map(|g| g.pid));
    sampler.add_targets(&targets)?;
    let (requests, intervals) = usdt::requests_from_args(&args.usdt, &args.usdt_interval)?;
    let mut usdt = UsdtSession::new(&mut sampler, requests, intervals, args.usdt_dump.as_deref())?;
    if args.all {
        usdt.scan_all_processes();
    }
    for &pid in &targets {
        usdt.scan_pid(pid);
    }
    // The command's own binary is attached before it runs; its libraries and later execs
    // are found when the collector sees their mappings.
    if let Some(exe) = args.command.first().and_then(|c| usdt::attach::which(c)) {
        let _ = usdt.scan_file(&exe, &exe.display().to_string(), false);
    }

    let mut collector = Collector::new(ChunkedStore::new(args.buffer_size as usize));
    for &pid in &targets {
        collector.register_existing(pid);
    }
    let ring = sampler.take_ring()?;
    let (start_mono_ns, start_wall_ms) = clock_pair();
    sampler.attach(args.frequency)?;
    let mut child_exit = None;
    if let Some(g) = gated {
        let pid = g.release()?;
        let (tx, rx) = oneshot::channel();
        std::thread::Builder::new()
            .name("wait-cmd".into())
            .spawn(move || tx.send(launch::wait_exit(pid)))?;
        child_exit = Some(rx);
    }

    if !args.quiet {
        let what = match (&args.command[..], &args.pid[..]) {
            ([], []) => "all processes".to_owned(),
            ([], pids) => {
                format!("pid {}", pids.iter().map(u32::to_string).collect::<Vec<_>>().join(","))
            }
            (cmd, _) => format!("'{}' and its children", cmd.join(" ")),
        };
        let what = match &cgroups {
            Some(c) if args.pid.is_empty() && args.command.is_empty() => c.describe(),
            Some(c) => format!("{what} in {}", c.describe()),
            None => what,
        };
        eprintln!(
            "rsprof-bpf: sampling {what} on {} CPUs at {} Hz; Ctrl-C to stop",
            sampler.cpus.len(),
            args.frequency
        );
    }
    let status = (!args.quiet && std::io::stderr().is_terminal()).then(Instant::now);
    let mut afd = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
        .context("poll ring buffer")?;
    let logical_cpus = sampler.cpus.len() as u32;
    let base_info = RecordingInfo {
        start_mono_ns,
        start_wall_ms,
        end_mono_ns: start_mono_ns,
        frequency: args.frequency,
        logical_cpus,
        physical_cpus: physical_cpus().unwrap_or(logical_cpus),
        product: format!("rsprof-bpf {}", env!("CARGO_PKG_VERSION")),
        oscpu: oscpu(),
    };
    let info_at = |end_mono_ns| RecordingInfo { end_mono_ns, ..base_info.clone() };
    let mut snapshots: Vec<std::thread::JoinHandle<()>> = Vec::new();
    let deadline = args.duration.map(|d| tokio::time::Instant::now() + Duration::from_secs_f64(d));
    let stop_reason = rt.block_on(async {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        // With -p / CMD, look for libraries with probes that were loaded but not yet sampled;
        // with --all, execs and samples in unknown mappings trigger the scans.
        let mut usdt_rescan = tokio::time::interval(Duration::from_secs(1));
        // Samples are sent without wakeups (lifecycle records still wake us): drain often
        // enough that a 16 MB ring never fills at 999 Hz on hundreds of CPUs.
        let mut poll = tokio::time::interval(Duration::from_millis(20));
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(sleep);
        let child = async {
            match child_exit {
                Some(rx) => rx.await.unwrap_or(-1),
                None => std::future::pending().await,
            }
        };
        tokio::pin!(child);
        loop {
            tokio::select! {
                ready = afd.readable_mut() => {
                    let mut g = ready?;
                    drain(g.get_inner_mut(), &mut collector, &mut usdt);
                    g.clear_ready();
                }
                _ = poll.tick() => drain(afd.get_mut(), &mut collector, &mut usdt),
                _ = sigint.recv() => return Ok::<_, anyhow::Error>("Ctrl-C".to_owned()),
                _ = sigterm.recv() => return Ok("SIGTERM".to_owned()),
                // A snapshot of what is recorded so far, written while recording goes on.
                _ = sigusr1.recv() => {
                    drain(afd.get_mut(), &mut collector, &mut usdt);
                    let path = snapshot_path(&args.output, snapshots.len() as u32 + 1);
                    let (schemas, open) = (usdt.marker_schemas(), usdt.open_markers());
                    let info = info_at(monotonic_ns());
                    let job = ExportJob::capture(&collector, info, schemas, open);
                    snapshots.push(spawn_snapshot(job, path, args.quiet)?);
                }
                _ = &mut sleep => return Ok("duration".to_owned()),
                code = &mut child => return Ok(format!("command exit (status {code})")),
                _ = usdt_rescan.tick(), if !args.all => usdt.rescan_live(&collector),
                _ = tick.tick() => if let Some(t0) = status {
                    let c = sampler.counters().unwrap_or_default();
                    eprint!(
                        "\r\x1b[2K[rsprof-bpf] {:.1}s  samples {}  lost {}  processes {}",
                        t0.elapsed().as_secs_f64(), collector.stats.samples, c.lost_samples(),
                        collector.processes.len()
                    );
                },
            }
        }
    })?;
    let end_mono_ns = monotonic_ns();
    sampler.detach();
    usdt.detach();
    drain(afd.get_mut(), &mut collector, &mut usdt);
    if status.is_some() {
        eprint!("\r\x1b[2K");
    }
    let counters = sampler.counters()?;
    for t in snapshots {
        let _ = t.join();
    }
    let usdt_report = usdt.finish(&mut collector, UsdtCounters::read(&sampler)?)?;
    let marker_schemas = markers::schemas(&usdt_report.registry);

    let store_stats = collector.store.stats;
    let buffer_bytes = collector.store.buffer().limit_bytes();
    let collector_stats = collector.stats;
    let out_path = output.path().display().to_string();
    let profile =
        ExportJob::finish(collector, info_at(end_mono_ns), marker_schemas).write(output)?;
    if !args.quiet {
        let bytes = std::fs::metadata(&args.output).map(|m| m.len()).unwrap_or(0);
        eprint!(
            "{}",
            summary::render(&summary::SummaryInput {
                profile: &profile,
                store: &store_stats,
                buffer_bytes,
                counters: &counters,
                stats: &collector_stats,
                duration_s: (end_mono_ns - start_mono_ns) as f64 / 1e9,
                frequency: args.frequency,
                cpus: sampler.cpus.len(),
                output: &out_path,
                output_bytes: bytes,
                stop_reason: &stop_reason,
            })
        );
        if !usdt_report.is_empty() {
            eprint!("{}", usdt_report.render());
        }
    }
    for (prog, what) in [("on_cpu_clock", "sampler"), ("on_sched_switch", "sched_switch hook")] {
        if let (false, Some((runs, time))) = (args.quiet, sampler.run_stats(prog)) {
            eprintln!(
                "BPF {what} (kernel.bpf_stats_enabled): {runs} runs, {:.0} ns per run, {:.3} s in all",
                time.as_nanos() as f64 / runs as f64,
                time.as_secs_f64()
            );
        }
    }
    if let Some(c) = &cgroups {
        // Printed even with -q: an empty profile must not go unexplained.
        let kept = collector_stats.samples;
        let note = c.end_note(kept, counters.samples_filtered);
        if !args.quiet || kept == 0 {
            eprint!("{note}");
        }
    }
    Ok(())
}

/// Writes a snapshot on its own thread; failures are reported, never fatal to the recording.
fn spawn_snapshot(
    job: ExportJob,
    path: std::path::PathBuf,
    quiet: bool,
) -> Result<std::thread::JoinHandle<()>> {
    let output = PendingOutput::create(&path);
    Ok(std::thread::Builder::new().name("snapshot".into()).spawn(move || {
        let res = output.and_then(|o| job.write(o));
        match res {
            Ok(stats) if !quiet => eprintln!(
                "\rrsprof-bpf: wrote snapshot {} ({} samples)",
                path.display(),
                stats.samples
            ),
            Ok(_) => {}
            Err(e) => eprintln!("\rrsprof-bpf: snapshot {} failed: {e:#}", path.display()),
        }
    })?)
}

fn drain(
    ring: &mut RingBuf<MapData>,
    collector: &mut Collector<ChunkedStore>,
    usdt: &mut UsdtSession,
) {
    while let Some(item) = ring.next() {
        // Undecodable records are counted in the collector's stats and reported.
        let _ = collector.handle_record(&item);
    }
    usdt.after_drain(collector);
}

fn oscpu() -> String {
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: valid utsname buffer.
    if unsafe { libc::uname(&mut u) } != 0 {
        return "Linux".into();
    }
    let field = |f: &[libc::c_char]| {
        let b: Vec<u8> = f.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        String::from_utf8_lossy(&b).into_owned()
    };
    format!("{} {} {}", field(&u.sysname), field(&u.release), field(&u.machine))
}

/// Distinct (package, core) pairs in /proc/cpuinfo.
fn physical_cpus() -> Option<u32> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mut cores = std::collections::HashSet::new();
    let (mut phys, mut core) = (None, None);
    for line in text.lines() {
        let mut kv = line.splitn(2, ':').map(str::trim);
        match (kv.next(), kv.next()) {
            (Some("physical id"), Some(v)) => phys = Some(v.to_owned()),
            (Some("core id"), Some(v)) => core = Some(v.to_owned()),
            (Some(""), None) | (None, _) => {
                if let (Some(p), Some(c)) = (phys.take(), core.take()) {
                    cores.insert((p, c));
                }
            }
            _ => {}
        }
    }
    if let (Some(p), Some(c)) = (phys, core) {
        cores.insert((p, c));
    }
    (!cores.is_empty()).then_some(cores.len() as u32)
}
