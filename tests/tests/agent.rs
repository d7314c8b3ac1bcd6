//! `rsprof-bpf agent` and `query` on a real host: windows spooled while the `split` fixture
//! runs, read back by Go's pprof (independent of our decoder) and, merged by `query`, by the
//! Firefox Profiler's importer. Needs root; the agent samples `--all`, so every check is about
//! the fixture's own pid.

use std::{fs, os::unix::fs::PermissionsExt as _, path::Path, time::Duration};

use serde_json::Value;
use tests::{
    agent::{Agent, spool_dir, windows_of},
    gecko_schema,
    go_pprof::{self, parse_top},
    harness::{output_path, run_fixture},
    profile_query::{count_samples_with_frame, threads},
};

#[test]
fn agent_spools_windows_read_by_go_pprof_and_query_merges_them() {
    let dir = spool_dir("agent_split");
    let d = dir.to_str().unwrap();
    let agent = Agent::start(&["--spool", d, "--window", "1", "-F", "499", "--host", "it-host"]);
    let pid = run_fixture("split", &["3"]).expect("run split");
    // SIGTERM right away: the window holding the split's end must be flushed, within 5 s.
    let (status, stderr) = agent.stop(libc::SIGTERM, Duration::from_secs(5));
    assert!(status.success(), "agent failed:\n{stderr}");
    assert!(stderr.contains("agent stopped by SIGTERM"), "{stderr}");

    let windows = windows_of(&dir, "split");
    assert!(windows.len() >= 3, "3 s of split in 1 s windows: {} windows\n{stderr}", windows.len());
    for (meta, profile) in &windows {
        // A window is a service's: whose each sample is, is in its pprof labels (below).
        assert!(meta.get("pid").is_none() && meta.get("process").is_none(), "{meta}");
        assert_eq!(meta["host"], "it-host", "{meta}");
        assert!(meta["service_name"].as_str().is_some_and(|s| !s.is_empty()), "{meta}");
        for p in [profile.clone(), profile.with_extension("").with_extension("json")] {
            let mode = fs::metadata(&p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", p.display());
        }
    }
    // Every window of the split read by Go's pprof, merged (pprof takes several profiles).
    let files: Vec<&Path> = windows.iter().map(|w| w.1.as_path()).collect();
    let tags = go_pprof::run(&["-tags"], files[0]).expect("pprof -tags");
    for want in [format!("{pid}"), "service_name:".into(), "host:".into(), "it-host".into()] {
        assert!(tags.contains(&want), "pprof -tags lacks {want:?}:\n{tags}");
    }
    let mut args =
        vec!["-top", "-sample_index=samples", "-nodecount=1000", "-nodefraction=0", "-trim=false"];
    let rest: Vec<String> = files[1..].iter().map(|p| p.display().to_string()).collect();
    args.extend(rest.iter().map(String::as_str));
    let out = go_pprof::run(&args, files[0]).expect("pprof -top");
    let (_, rows) = parse_top(&out).expect("parse -top");
    let flat = |n: &str| rows.iter().find(|r| r.name == n).map_or(0.0, |r| r.flat);
    let (a, b) = (flat("hot_a"), flat("hot_b"));
    // Not 3 s × 499 Hz: on a loaded machine the fixture gets less CPU; the share is the check.
    assert!(a + b > 150.0, "3 s at 499 Hz: {a} + {b} samples:\n{out}");
    let share = 100.0 * a / (a + b);
    assert!((70.0..=80.0).contains(&share), "hot_a share {share:.1}%, want 75 ± 5:\n{out}");

    // query: one Gecko profile with the split's track, its samples in its windows' times.
    let gecko = output_path("agent_query", "json.gz");
    let q = tests::harness::run(&[
        "query",
        "--spool",
        d,
        "--from",
        "-1h",
        "--host",
        "it-host",
        "--process",
        "split",
        "-o",
        gecko.to_str().unwrap(),
    ])
    .unwrap();
    assert!(q.status.success(), "query failed:\n{}", q.stderr);
    let profile = gecko_schema::load(&gecko).expect("query's profile loads");
    let ts = threads(&profile);
    let split: Vec<_> = ts.iter().filter(|t| t.process_name.starts_with("split")).collect();
    assert!(
        !split.is_empty(),
        "no split track: {:?}",
        ts.iter().map(|t| t.process_name).collect::<Vec<_>>()
    );
    assert!(split[0].process_name.contains("it-host"), "{}", split[0].process_name);
    let hot_a: usize = split.iter().map(|t| count_samples_with_frame(t.thread, "hot_a")).sum();
    // Samples with hot_a anywhere on the stack: pprof's cumulative count.
    let cum_a = rows.iter().find(|r| r.name == "hot_a").map_or(0.0, |r| r.cum);
    assert_eq!(hot_a as f64, cum_a, "query keeps every hot_a sample of the windows");
    // Nothing else was selected.
    assert!(ts.iter().all(|t| t.process_name.starts_with("split")), "only split was selected");
}

#[test]
fn agent_killed_leaves_no_partial_window_and_spool_size_deletes_oldest() {
    let dir = spool_dir("agent_kill");
    let d = dir.to_str().unwrap();
    let mut agent = Agent::start(&["--spool", d, "--window", "0.5", "-F", "99"]);
    // Windows until they take 160K (the next run's limit is half that, and at least the
    // agent's 64K minimum), however busy or quiet the host.
    let spool_bytes = |dir: &Path| -> u64 {
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while spool_bytes(&dir) < 160 << 10 {
        assert!(std::time::Instant::now() < deadline, "2 minutes of windows took under 160K");
        agent.wait_for("window:", Duration::from_secs(30));
    }
    let (status, _) = agent.stop(libc::SIGKILL, Duration::from_secs(5));
    assert!(!status.success());
    let names: Vec<String> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.starts_with('.')), "no temp file left: {names:?}");
    let held = names.iter().filter(|n| n.ends_with(".json")).count();
    assert!(held > 0, "windows were written: {names:?}");
    let bytes = spool_bytes(&dir);
    let limit = bytes / 2;
    let mut before = stems(&dir);
    before.sort();
    // A profile without labels, as a kill between a window's two files would leave.
    fs::write(dir.join("0000000000001-1-00000000.pb.gz"), b"partial").unwrap();

    // Restart with half that as the limit: the windows of the first run are found again, the
    // partial one removed and counted; then the oldest are deleted to fit, and counted.
    let limit_arg = limit.to_string();
    let mut agent =
        Agent::start(&["--spool", d, "--window", "0.5", "-F", "99", "--spool-size", &limit_arg]);
    let first = agent.seen.join("\n");
    assert!(
        first.contains(&format!("{held} windows")) && first.contains("1 incomplete removed"),
        "restart finds {held} windows and the partial one:\n{first}"
    );
    assert!(!dir.join("0000000000001-1-00000000.pb.gz").exists());
    agent.wait_for("window:", Duration::from_secs(30));
    let (status, stderr) = agent.stop(libc::SIGINT, Duration::from_secs(5));
    assert!(status.success(), "{stderr}");
    let total: u64 =
        fs::read_dir(&dir).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    assert!(total <= limit, "spool holds {total} bytes, limit {limit}");
    let deleted: u64 = (stderr.lines())
        .find_map(|l| l.strip_prefix("rsprof-bpf: agent stopped by Ctrl-C: "))
        .and_then(|l| {
            l.split(" deleted for --spool-size").next()?.rsplit(", ").next()?.parse().ok()
        })
        .unwrap_or_else(|| panic!("no deletion count:\n{stderr}"));
    assert!(deleted > 0, "{bytes} bytes before, limit {limit}, none deleted:\n{stderr}");
    // The oldest went first: the first run's windows still there are its newest.
    let left = stems(&dir);
    let kept: Vec<&String> = before.iter().filter(|s| left.contains(s)).collect();
    let newest: Vec<&String> = before[before.len() - kept.len()..].iter().collect();
    assert_eq!(kept, newest, "oldest deleted first");
    assert!(!left.is_empty());
}

fn stems(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().to_str()?.strip_suffix(".json").map(str::to_owned))
        .collect()
}

/// `agent --off-cpu`: windows carry the `off_cpu` sample type (nanoseconds blocked), and a
/// thread sleeping half of its time has its off-CPU time under its sleep, read by Go's pprof.
#[test]
fn agent_off_cpu_windows_carry_blocked_time() {
    let dir = spool_dir("agent_offcpu");
    let d = dir.to_str().unwrap();
    let agent = Agent::start(&["--off-cpu", "--spool", d, "--window", "1", "-F", "99"]);
    let pid = run_fixture("offcpu", &["duty", "5", "5", "3"]).expect("run offcpu duty");
    let (status, stderr) = agent.stop(libc::SIGTERM, Duration::from_secs(5));
    assert!(status.success(), "agent failed:\n{stderr}");

    let windows = windows_of(&dir, "offcpu");
    assert!(!windows.is_empty(), "no window of the offcpu fixture (pid {pid}):\n{stderr}");
    let (mut total_ms, mut sleep_ms, mut with_off_cpu) = (0.0, 0.0, 0);
    for (_, profile) in &windows {
        let args = ["-top", "-sample_index=off_cpu", "-unit=ms", "-nodecount=1000", "-trim=false"];
        // A window holding only the fixture's CPU samples has no off_cpu sample type: pprof
        // says so (profile/index.go), and only that is skipped; any other failure is the test's.
        let out = match go_pprof::run(&args, profile) {
            Ok(out) => out,
            Err(e) if format!("{e:#}").contains("sample_index \"off_cpu\" must be one of") => {
                continue;
            }
            Err(e) => panic!("pprof could not read window {}: {e:#}", profile.display()),
        };
        let (total, rows) = parse_top(&out).expect("parse -top");
        with_off_cpu += 1;
        total_ms += total;
        sleep_ms += rows.iter().find(|r| r.name == "sleep_phase").map_or(0.0, |r| r.cum);
    }
    assert!(with_off_cpu >= 2, "{} windows, {with_off_cpu} with off-CPU time", windows.len());
    // 3 s at 50% asleep: ~1.5 s blocked (less if the fixture was kept from running, never more).
    assert!((500.0..=3000.0).contains(&total_ms), "off-CPU total {total_ms} ms");
    assert!(sleep_ms >= 0.9 * total_ms, "{sleep_ms} of {total_ms} ms under sleep_phase");
}

/// Fanotify groups among the descriptors of `pid` (their fdinfo says `fanotify flags:`).
fn fanotify_fds(pid: u32) -> usize {
    let dir = format!("/proc/{pid}/fdinfo");
    (fs::read_dir(dir).unwrap().filter_map(|e| fs::read_to_string(e.ok()?.path()).ok()))
        .filter(|info| info.contains("fanotify flags:"))
        .count()
}

/// The agent never holds execs unless asked: no USDT exec gate (no fanotify group) by default;
/// `--usdt-exec-gate` starts one.
#[test]
fn agent_starts_the_exec_gate_only_when_asked() {
    let dir = spool_dir("agent_gate");
    let d = dir.to_str().unwrap();
    let agent = Agent::start(&["--spool", d, "--window", "1"]);
    let without = fanotify_fds(agent.child.id());
    let (status, stderr) = agent.stop(libc::SIGTERM, Duration::from_secs(5));
    assert!(status.success(), "{stderr}");
    assert_eq!(without, 0, "the agent watches execs by default");
    let agent = Agent::start(&["--spool", d, "--window", "1", "--usdt-exec-gate"]);
    let with = fanotify_fds(agent.child.id());
    let (status, stderr) = agent.stop(libc::SIGTERM, Duration::from_secs(5));
    assert!(status.success(), "{stderr}");
    assert_eq!(with, 1, "--usdt-exec-gate: one fanotify group");
}

/// A storm of short-lived processes of one program folds into one profile per window: spool
/// windows are bounded by the services (+ 1), not the processes, and `query --process` /
/// `--pid` still select one process by the samples' labels.
#[test]
fn agent_folds_short_lived_processes_into_one_window_per_service() {
    let dir = spool_dir("agent_churn");
    let d = dir.to_str().unwrap();
    // A program of our own name, each run burning a few ms of CPU so many are sampled.
    let exe = output_path("agent_churn", "bin");
    let _ = fs::remove_dir_all(&exe);
    fs::create_dir_all(&exe).unwrap();
    let exe = exe.join("rsprof_churn");
    fs::copy("/bin/dd", &exe).unwrap();
    let agent = Agent::start(&["--spool", d, "--window", "2", "-F", "499", "--host", "churn"]);
    let started = std::time::Instant::now();
    let mut pids = std::collections::HashSet::new();
    for _ in 0..300 {
        let mut run = std::process::Command::new(&exe)
            .args(["if=/dev/zero", "of=/dev/null", "bs=64k", "count=400", "status=none"])
            .spawn()
            .unwrap();
        pids.insert(u64::from(run.id()));
        assert!(run.wait().unwrap().success());
    }
    // Two windows at least, whatever the runs took (a window's labels file is written whole
    // or not parsed).
    let windows = || {
        let starts: std::collections::HashSet<u64> = (fs::read_dir(&dir).unwrap().flatten())
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .filter_map(|e| serde_json::from_slice::<Value>(&fs::read(e.path()).ok()?).ok())
            .filter_map(|m| m["start_ms"].as_u64())
            .collect();
        starts.len() >= 2
    };
    tests::wait::until("two windows in the spool", Duration::from_secs(60), windows).unwrap();
    let (status, stderr) = agent.stop(libc::SIGTERM, Duration::from_secs(5));
    assert!(status.success(), "{stderr}");
    eprintln!("300 runs in {:?}", started.elapsed());

    // Per window (start time): at most one profile per service, plus one.
    let mut by_start: std::collections::BTreeMap<u64, Vec<Value>> = Default::default();
    for e in fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "json") {
            let meta: Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
            by_start.entry(meta["start_ms"].as_u64().unwrap()).or_default().push(meta);
        }
    }
    assert!(by_start.len() >= 2, "{} windows:\n{stderr}", by_start.len());
    let mut churn_windows = 0;
    for (start, metas) in &by_start {
        let services: std::collections::HashSet<_> =
            metas.iter().map(|m| m["service_name"].as_str().unwrap()).collect();
        assert!(
            metas.len() <= services.len() + 1,
            "window {start}: {} profiles for {} services",
            metas.len(),
            services.len()
        );
        let churn = metas.iter().filter(|m| m["service_name"] == "rsprof_churn").count();
        assert!(churn <= 1, "window {start}: {churn} profiles of rsprof_churn");
        churn_windows += churn;
    }
    assert!(churn_windows >= 1, "rsprof_churn never sampled:\n{stderr}");

    // The churn's processes, from the merged profile: one track, many pids (their tids).
    let gecko = output_path("agent_churn", "json");
    let query = |extra: &[&str]| {
        let mut args = vec!["query", "--spool", d, "--host", "churn", "-o"];
        args.push(gecko.to_str().unwrap());
        args.extend_from_slice(extra);
        let q = tests::harness::run(&args).unwrap();
        assert!(q.status.success(), "query {extra:?} failed:\n{}", q.stderr);
        gecko_schema::load(&gecko).expect("query's profile loads")
    };
    let profile = query(&["--process", "rsprof_churn"]);
    let ts = threads(&profile);
    assert!(ts.iter().all(|t| t.process_name.starts_with("rsprof_churn")), "only the churn");
    let sampled: Vec<u64> = ts.iter().map(|t| t.tid).filter(|t| pids.contains(t)).collect();
    assert!(sampled.len() >= 10, "{} of 300 runs sampled: {sampled:?}", sampled.len());
    // One of them alone.
    let one = sampled[sampled.len() / 2].to_string();
    let profile = query(&["--pid", &one]);
    let ts = threads(&profile);
    assert!(
        !ts.is_empty() && ts.iter().all(|t| t.tid.to_string() == one),
        "--pid {one}: {:?}",
        ts.iter().map(|t| t.tid).collect::<Vec<_>>()
    );
}

/// The agent's counters (`rsprof_NAME_total` or `rsprof_NAME`) from its metrics endpoint.
fn scrape(addr: &str, names: &[&str]) -> Vec<u64> {
    let body = ureq::get(&format!("http://{addr}/metrics"))
        .call()
        .expect("metrics endpoint")
        .into_body()
        .read_to_string()
        .unwrap();
    names
        .iter()
        .map(|n| {
            let total = format!("rsprof_{n}_total{{");
            let plain = format!("rsprof_{n}{{");
            let line = body
                .lines()
                .find(|l| l.starts_with(&total) || l.starts_with(&plain))
                .unwrap_or_else(|| panic!("no {n} in the metrics:\n{body}"));
            line.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64
        })
        .collect()
}

/// Processes no sample hits cost the agent next to nothing: over 2,000 runs of `/bin/true`,
/// each walks with its parent's walker entry from its fork (taken by reference in the
/// kernel), none gets an entry of its own written (each exits long before the agent would
/// write it), userspace deletes none, and the loop is not woken per process. Asserted on counts, not time. The runs live in a cgroup of their
/// own, which the agent is told to watch, so other processes on the machine do not count.
#[test]
fn agent_pays_no_syscall_or_wakeup_per_unsampled_process() {
    use std::os::unix::process::CommandExt as _;
    let tree = tests::cgroups::CgroupTree::create("unsampled").expect("test cgroup");
    let cg = tree.mkdir("storm").unwrap();
    let dir = spool_dir("agent_unsampled");
    let d = dir.to_str().unwrap();
    // 1 Hz: on 2 CPUs a 1 ms process is almost never sampled.
    let cg_arg = cg.display().to_string();
    let mut agent = Agent::start(&["--spool", d, "--window", "60", "-F", "1", "--cgroup", &cg_arg]);
    let addr = agent.metrics_addr();
    let names = [
        "kernel_fork_walker_copies",
        "unwind_process_writes",
        "unwind_process_removals",
        "event_loop_drains",
    ];
    // The start-up pass writes every process's entry, and again as each table lands: wait
    // until it is over (no write for a second).
    let mut before = scrape(&addr, &names);
    let settle = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let now = scrape(&addr, &names);
        if now[1] == before[1] {
            break;
        }
        assert!(std::time::Instant::now() < settle, "start-up writes still going after 60 s");
        before = now;
    }
    let started = std::time::Instant::now();
    // The shell is in the cgroup from its exec on, so the agent writes its entry (it lives
    // seconds) and each run walks with it from its fork on. Its
    // first 1.5 s leave time for that write.
    let procs = cg.join("cgroup.procs");
    let mut shell = std::process::Command::new("/bin/sh");
    shell.args(["-c", "sleep 1.5; i=0; while [ $i -lt 2000 ]; do /bin/true; i=$((i+1)); done"]);
    // SAFETY: only a write(2) of "0" (this process) to the cgroup's procs file, before exec.
    unsafe {
        shell.pre_exec(move || std::fs::write(&procs, "0"));
    }
    assert!(shell.status().unwrap().success());
    // The exits' records reach userspace at the next timed drain (at most 1 s apart): two
    // drains after the last exit.
    let drains = scrape(&addr, &names)[3];
    let drained = || scrape(&addr, &names)[3] >= drains + 2;
    tests::wait::until("two drains after the runs", Duration::from_secs(30), drained).unwrap();
    let secs = started.elapsed().as_secs_f64();
    let after = scrape(&addr, &names);
    let (status, stderr) = agent.stop(libc::SIGTERM, Duration::from_secs(5));
    assert!(status.success(), "{stderr}");
    let d: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    let report = format!(
        "2000 runs in {secs:.1} s: {} given their parent's entry at the fork, {} written, {} removed by \
         userspace, {} drains\n{stderr}",
        d[0], d[1], d[2], d[3]
    );
    eprintln!("{report}");
    // The runs forked after the shell's entry was written (all but those of its first drain).
    assert!(d[0] >= 1900, "{report}");
    // Written: the shell and `sleep` (each lives past the agent's wait), rewritten when a
    // table lands; no run.
    assert!(d[1] <= 10, "{report}");
    // Userspace deletes only the entries it made itself (the shell's, `sleep`'s).
    assert!(d[2] <= 4, "{report}");
    // Timed drains, one a second, plus the 10 ms polls while the first tables compile (the
    // filter loaded none at the start): never one per process.
    assert!((d[3] as f64) <= 3.0 * secs + 60.0, "{report}");
}
