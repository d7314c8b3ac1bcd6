//! Operating the agent: its Prometheus metrics scraped by a real Prometheus (Debian's package)
//! and every query of the Grafana dashboards in dashboards/ evaluated there; the dashboards'
//! structure; the systemd unit in deploy/ (verified, and its capabilities enough). Needs root
//! (the agent loads BPF programs).

use std::{
    collections::{BTreeSet, HashSet},
    fs,
    os::fd::{FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use serde_json::Value;
use tests::{
    agent::Agent,
    harness::output_path,
    prometheus::{Prometheus, value_of},
};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_owned()
}

fn dashboards() -> Vec<(String, Value)> {
    let dir = repo().join("dashboards");
    let mut v: Vec<(String, Value)> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let d = serde_json::from_slice(&fs::read(&p).unwrap())
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p.file_name().unwrap().to_string_lossy().into_owned(), d)
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Every panel, rows' nested panels included.
fn panels(d: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().into_iter().flatten() {
        out.push(p);
        out.extend(p["panels"].as_array().into_iter().flatten());
    }
    out
}

/// (panel title, expr) of every query.
fn queries(d: &Value) -> Vec<(String, String)> {
    panels(d)
        .into_iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or_default().to_owned();
            p["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .map(move |t| (title.clone(), t["expr"].as_str().unwrap_or_default().to_owned()))
        })
        .collect()
}

const GRAFANA_BUILTINS: &[&str] = &["__rate_interval", "__interval", "__range"];

#[test]
fn ops_dashboards_structure() {
    let all = dashboards();
    let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["rsprof-agent-health.json", "rsprof-fleet-overview.json"]);
    let mut uids = HashSet::new();
    for (name, d) in &all {
        let schema = d["schemaVersion"].as_u64().unwrap_or(0);
        assert!(schema >= 36, "{name}: schemaVersion {schema} (datasource refs by uid need 36+)");
        assert!(uids.insert(d["uid"].as_str().unwrap().to_owned()), "{name}: duplicate uid");
        assert!(!d["title"].as_str().unwrap_or_default().is_empty(), "{name}: no title");
        let vars = d["templating"]["list"].as_array().expect("templating");
        let var = |n: &str| vars.iter().find(|v| v["name"] == n);
        let ds = var("datasource").unwrap_or_else(|| panic!("{name}: no datasource variable"));
        assert_eq!((&ds["type"], &ds["query"]), (&"datasource".into(), &"prometheus".into()));
        let host = var("host").unwrap_or_else(|| panic!("{name}: no host variable"));
        assert_eq!(host["type"], "query", "{name}");
        assert_eq!(host["datasource"]["uid"], "${datasource}", "{name}: host variable source");
        assert!(
            host["query"]["query"].as_str().unwrap().starts_with("label_values(rsprof_build_info"),
            "{name}: {}",
            host["query"]
        );
        let defined: HashSet<&str> = vars.iter().filter_map(|v| v["name"].as_str()).collect();
        let mut ids = HashSet::new();
        for p in panels(d) {
            let title = p["title"].as_str().unwrap_or_default();
            let id = p["id"].as_u64().unwrap_or_else(|| panic!("{name}: {title}: no id"));
            assert!(ids.insert(id), "{name}: panel id {id} ({title}) used twice");
            let g = &p["gridPos"];
            let (x, w) = (g["x"].as_u64().unwrap(), g["w"].as_u64().unwrap());
            assert!(x + w <= 24 && g["h"].as_u64().unwrap() > 0, "{name}: {title}: gridPos {g}");
            if p["type"] == "row" {
                continue;
            }
            assert!(!title.is_empty(), "{name}: panel {id} has no title");
            let source = serde_json::json!({"type": "prometheus", "uid": "${datasource}"});
            assert_eq!(p["datasource"], source, "{name}: {title}: panel datasource");
            let targets = p["targets"].as_array().unwrap_or_else(|| panic!("{title}: targets"));
            assert!(!targets.is_empty(), "{name}: {title}: no query");
            let mut refs = HashSet::new();
            for t in targets {
                assert_eq!(t["datasource"], source, "{name}: {title}: query datasource");
                assert!(refs.insert(t["refId"].as_str().unwrap()), "{name}: {title}: refId");
                let expr = t["expr"].as_str().unwrap_or_default();
                assert!(!expr.is_empty(), "{name}: {title}: empty expr");
                for var in expr.split('$').skip(1) {
                    let v: String =
                        var.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                    assert!(
                        defined.contains(v.as_str()) || GRAFANA_BUILTINS.contains(&v.as_str()),
                        "{name}: {title}: ${v} is not defined in {expr}"
                    );
                }
            }
        }
    }
    let prov = fs::read_to_string(repo().join("dashboards/provisioning/rsprof-bpf.yaml")).unwrap();
    for needle in ["apiVersion: 1", "providers:", "type: file", "path: "] {
        assert!(prov.contains(needle), "provisioning file lacks {needle:?}");
    }
}

/// Turns BPF run-time statistics on while the fd lives (`BPF_ENABLE_STATS`: counted, so it
/// does not switch them off under anyone else who enabled them).
fn enable_bpf_stats() -> OwnedFd {
    const BPF_ENABLE_STATS: libc::c_long = 32;
    // union bpf_attr's enable_stats: { __u32 type }, BPF_STATS_RUN_TIME = 0.
    let attr = [0u32; 2];
    // SAFETY: the attr buffer is valid for its size; the kernel returns a new fd or -1.
    let fd = unsafe {
        libc::syscall(libc::SYS_bpf, BPF_ENABLE_STATS, attr.as_ptr(), size_of_val(&attr))
    };
    assert!(fd >= 0, "BPF_ENABLE_STATS: {}", std::io::Error::last_os_error());
    // SAFETY: a new fd we own.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

/// Panels whose first query must be above zero on any host running the agent (not just
/// present): they show the agent's cost and its samples.
const POSITIVE: &[&str] = &[
    "Agent CPU",
    "Agent RSS",
    "BPF time",
    "Samples",
    "Samples per service",
    "Hosts reporting",
    "Samples per host",
];

#[test]
fn ops_dashboards_queries_return_data_from_a_real_prometheus() {
    let _stats = enable_bpf_stats();
    let host = format!("ops-dash-{}", std::process::id());
    let spool = output_path("ops_dashboards", "spool");
    let _ = fs::remove_dir_all(&spool);
    let spool_arg = spool.display().to_string();
    let mut agent = Agent::start(&[
        "--metrics",
        "127.0.0.1:0",
        "--window",
        "1",
        "-F",
        "49",
        "--host",
        &host,
        "--spool",
        &spool_arg,
    ]);
    let addr = agent.metrics_addr();
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    let prom = Prometheus::start("dashboards", &[&addr]).unwrap();
    // 15 scrapes: enough for rate() over the 10 s standing in for $__rate_interval.
    let ready = format!("count_over_time(rsprof_windows_total{{host=\"{host}\"}}[1m]) >= 15");
    let end = Instant::now() + Duration::from_secs(120);
    while prom.query(&ready).unwrap().is_empty() {
        assert!(Instant::now() < end, "15 scrapes not done in 120 s:\n{}", prom.log());
        assert!(agent.running(), "agent exited:\n{}", agent.seen.join("\n"));
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(
        prom.label_values("host", "rsprof_build_info").unwrap().contains(&host),
        "the host variable's query does not list {host}"
    );
    let mut failures = Vec::new();
    let mut checked = BTreeSet::new();
    for (name, d) in dashboards() {
        let mut first_of_panel = HashSet::new();
        for (title, expr) in queries(&d) {
            let q = expr.replace("$host", &host).replace("$__rate_interval", "10s");
            let result = match prom.query(&q) {
                Ok(r) => r,
                Err(e) => {
                    failures.push(format!("{name}: {title}: {e:#}"));
                    continue;
                }
            };
            if result.is_empty() {
                failures.push(format!("{name}: {title}: no data for {q}"));
                continue;
            }
            if POSITIVE.contains(&title.as_str()) && first_of_panel.insert(title.clone()) {
                let best = result.iter().map(value_of).fold(f64::NAN, f64::max);
                if best.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
                    failures.push(format!("{name}: {title}: {best} from {q}: {result:?}"));
                }
                checked.insert(title);
            }
        }
    }
    assert!(failures.is_empty(), "dashboard queries failing:\n{}", failures.join("\n"));
    assert_eq!(checked.len(), POSITIVE.len(), "positive checks done: {checked:?}");
    // The BPF time panel is per program: the sampler is among them.
    let bpf = prom
        .query(&format!(
            "rate(rsprof_bpf_program_run_seconds_total{{host=\"{host}\",program=\"on_cpu_clock\"}}[10s]) > 0"
        ))
        .unwrap();
    assert_eq!(bpf.len(), 1, "sampler run time: {bpf:?}");
    // Beside it, the event loop's time draining what the programs sent.
    let drain = prom
        .query(&format!(
            "rate(rsprof_event_loop_drain_seconds_total{{host=\"{host}\"}}[10s]) > 0 and \
             rate(rsprof_event_loop_records_total{{host=\"{host}\"}}[10s]) > 0"
        ))
        .unwrap();
    assert_eq!(drain.len(), 1, "event loop time: {drain:?}");
    drop(agent);
}

fn unit_path() -> PathBuf {
    repo().join("deploy/rsprof-bpf-agent.service")
}

/// `systemd-analyze verify` on `unit`: its whole output (empty when the unit is clean; verify
/// exits 0 after "ignoring" a setting it cannot parse, so the output is what tells).
fn verify(unit: &Path) -> (bool, String) {
    let out = std::process::Command::new("systemd-analyze")
        .arg("verify")
        .arg(unit)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "systemd-analyze cannot run ({e}): install Debian's systemd package (`cargo \
                 xtask setup` does)"
            )
        });
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn ops_service_unit_verifies() {
    let bin = tests::fixtures::rsprof_bin().unwrap();
    let unit = fs::read_to_string(unit_path()).unwrap();
    assert!(unit.contains("ExecStart=/usr/local/bin/rsprof-bpf agent"), "{unit}");
    let dir = output_path("ops_service", "d");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    // The unit's name must be kept: verify checks the file name too.
    let copy = dir.join("rsprof-bpf-agent.service");
    let real = unit.replace("/usr/local/bin/rsprof-bpf", &bin.display().to_string());
    fs::write(&copy, &real).unwrap();
    let (ok, text) = verify(&copy);
    assert!(ok && text.trim().is_empty(), "systemd-analyze verify:\n{text}");
    // And it does notice a bad setting (so a clean result above means something).
    fs::write(&copy, real.replace("ProtectSystem=strict", "ProtectSystem=strictly")).unwrap();
    let (_, text) = verify(&copy);
    assert!(text.contains("ProtectSystem") || text.contains("protect system"), "{text}");
    for needle in [
        "ProtectSystem=strict",
        "StateDirectory=rsprof-bpf",
        "Restart=on-failure",
        "NoNewPrivileges=yes",
    ] {
        assert!(unit.contains(needle), "unit lacks {needle}");
    }
}

/// The unit's `CapabilityBoundingSet`, as setpriv's `-all,+bpf,+perfmon,...`.
fn unit_capabilities() -> String {
    let unit = fs::read_to_string(unit_path()).unwrap();
    let line = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("CapabilityBoundingSet");
    let caps: Vec<String> = line
        .split_whitespace()
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    assert!(caps.contains(&"+bpf".to_owned()) && caps.contains(&"+perfmon".to_owned()));
    format!("-all,{}", caps.join(","))
}

/// Samples of `pid` in collapsed stacks, and how many of them are in `func`.
fn samples_of(folded: &str, pid: u32, func: &str) -> (u64, u64) {
    let tag = format!("-{pid};");
    let mut all = (0, 0);
    for l in folded.lines().filter(|l| l.contains(&tag)) {
        let n: u64 = l.rsplit(' ').next().and_then(|n| n.parse().ok()).unwrap_or(0);
        all.0 += n;
        if l.split(';').any(|f| f.starts_with(func)) {
            all.1 += n;
        }
    }
    all
}

/// The agent with only the unit's capabilities (setpriv bounds them as systemd would for a
/// root service) still does everything they were chosen for: loads and samples, names kernel
/// frames (through BPF, without CAP_SYSLOG), symbolizes an executable only its owner (nobody)
/// can read (CAP_DAC_READ_SEARCH) and a deleted executable of a root process, read through
/// /proc/PID/map_files (CAP_CHECKPOINT_RESTORE, CAP_SYS_PTRACE). Each of those was measured:
/// with it removed from the unit, this test fails on the check named.
#[test]
fn ops_service_capabilities_are_enough() {
    use std::os::unix::fs::{PermissionsExt as _, chown};
    let split = tests::fixtures::build("split").unwrap();
    let dir = output_path("ops_caps", "d");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let private_dir = dir.join("private");
    fs::create_dir(&private_dir).unwrap();
    let private = private_dir.join("split_private");
    fs::copy(&split, &private).unwrap();
    for p in [&private, &private_dir] {
        chown(p, Some(65534), Some(65534)).unwrap();
        fs::set_permissions(p, fs::Permissions::from_mode(0o700)).unwrap();
    }
    let deleted = dir.join("split_deleted");
    fs::copy(&split, &deleted).unwrap();
    let run = |cmd: &mut std::process::Command| {
        tests::harness::Background(cmd.stdout(std::process::Stdio::null()).spawn().unwrap())
    };
    let as_nobody = run(std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(&private)
        .arg("60"));
    let as_root = run(std::process::Command::new(&deleted).arg("60"));
    // Wait until both run their code, then delete the root one's executable.
    for p in [&as_nobody, &as_root] {
        let (cpu, deadline) = (Duration::from_millis(50), Duration::from_secs(30));
        tests::wait::until_cpu_time(p.0.id(), Duration::ZERO, cpu, deadline).unwrap();
    }
    fs::remove_file(&deleted).unwrap();
    let spool = dir.join("spool");
    let spool_arg = spool.display().to_string();
    let wrapper =
        ["setpriv".to_owned(), format!("--bounding-set={}", unit_capabilities()), "--".into()];
    let mut agent = Agent::start_wrapped(
        &wrapper,
        &["--metrics", "off", "--window", "1", "-F", "99", "--spool", &spool_arg],
    );
    let status = fs::read_to_string(format!("/proc/{}/status", agent.child.id())).unwrap();
    let bound = status.lines().find(|l| l.starts_with("CapBnd:")).unwrap().to_owned();
    for _ in 0..4 {
        agent.wait_for("window:", Duration::from_secs(30));
        agent.seen.retain(|l| !l.contains("window:"));
    }
    agent.signal(libc::SIGTERM);
    let _ = agent.child.wait();
    let folded = dir.join("all.folded");
    let out = tests::harness::command()
        .unwrap()
        .args(["query", "--spool", &spool_arg, "-o"])
        .arg(&folded)
        .output()
        .unwrap();
    assert!(out.status.success(), "query: {}", String::from_utf8_lossy(&out.stderr));
    let text = fs::read_to_string(&folded).unwrap();
    let mut problems = Vec::new();
    for (what, pid) in
        [("nobody's 0700 executable", as_nobody.0.id()), ("a deleted executable", as_root.0.id())]
    {
        let (n, hot) = samples_of(&text, pid, "hot_");
        if n == 0 || hot * 2 < n {
            problems.push(format!("{what} (pid {pid}): {hot} of {n} samples in hot_a/hot_b"));
        }
    }
    let kernel: Vec<&str> = text.split([';', ' ']).filter(|f| f.ends_with("_[k]")).collect();
    if kernel.is_empty() || kernel.iter().all(|f| f.contains("+0x")) {
        problems.push(format!("no kernel frame named ({} kernel frames)", kernel.len()));
    }
    assert!(
        problems.is_empty(),
        "with {bound}:\n{}\n{}",
        problems.join("\n"),
        agent.seen.join("\n")
    );
}
