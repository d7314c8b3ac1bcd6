//! The agent's ClickHouse sink and `query --clickhouse` against a real ClickHouse server
//! (Debian's clickhouse-server, started per test by `tests::clickhouse::Server`), with a real
//! agent sampling `--all`: windows read back by the Firefox Profiler's importer and Go's pprof,
//! compared with the same windows read from the spool; ClickHouse killed mid-run; rejections.
//! Needs root.

use std::{
    collections::{BTreeMap, HashMap},
    fs,
    hash::{BuildHasher as _, RandomState},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use serde_json::Value;
use tests::{
    agent::{Agent, spool_dir},
    cgroups::CgroupTree,
    clickhouse::Server,
    fixtures, gecko_schema,
    go_pprof::{self, parse_top},
    harness::{output_path, run},
    profile_query::{count_samples_with_frame, threads},
};

fn server() -> Server {
    Server::start().unwrap_or_else(|e| panic!("ClickHouse server: {e:#}"))
}

/// A number in the agent's summary: the word before `after`, in the line with `line`.
fn summary_number(stderr: &str, line: &str, after: &str) -> u64 {
    stderr
        .lines()
        .filter(|l| l.contains(line))
        .find_map(|l| l.split(after).next()?.rsplit([' ', ':', '(']).next()?.parse().ok())
        .unwrap_or_else(|| panic!("no '{after}' in the '{line}' line:\n{stderr}"))
}

/// Every window in the spool: window id → (labels json).
fn spooled(dir: &Path) -> BTreeMap<String, Value> {
    fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            let name = p.file_name()?.to_str()?.to_owned();
            if name.starts_with('.') || !name.ends_with(".json") {
                return None;
            }
            let meta: Value = serde_json::from_slice(&fs::read(&p).ok()?).ok()?;
            Some((meta["window_id"].as_str()?.to_owned(), meta))
        })
        .collect()
}

/// `SELECT … FORMAT TSV` rows split into fields.
fn tsv(server: &Server, sql: &str) -> Vec<Vec<String>> {
    let out = server.query(&format!("{sql} FORMAT TSV")).unwrap_or_else(|e| panic!("{e:#}"));
    out.lines().map(|l| l.split('\t').map(str::to_owned).collect()).collect()
}

/// hot_a's share of hot_a + hot_b (flat samples) in `pprof -top` of `profile`.
fn hot_share(profile: &Path) -> (f64, f64, String) {
    let args =
        ["-top", "-sample_index=samples", "-nodecount=1000", "-nodefraction=0", "-trim=false"];
    let out = go_pprof::run(&args, profile).expect("pprof -top");
    let (_, rows) = parse_top(&out).expect("parse -top");
    let flat = |n: &str| rows.iter().find(|r| r.name == n).map_or(0.0, |r| r.flat);
    let (a, b) = (flat("hot_a"), flat("hot_b"));
    (100.0 * a / (a + b).max(1.0), a + b, out)
}

/// A docker-style container cgroup in `tree`: (id, directory).
fn container(tree: &CgroupTree) -> (String, PathBuf) {
    let id: String = (0..4).map(|i| format!("{:016x}", RandomState::new().hash_one(i))).collect();
    let cg = tree.mkdir(&format!("system.slice/docker-{id}.scope")).unwrap();
    (id, cg)
}

/// Starts `split SECS` inside the cgroup `cg`.
fn split_in(cg: &Path, secs: &str) -> Child {
    let split = fixtures::build("split").unwrap();
    Command::new("/bin/sh")
        .args(["-c", r#"echo $$ > "$1/cgroup.procs" && exec "$2" "$3""#, "sh"])
        .arg(cg)
        .arg(&split)
        .arg(secs)
        .stdout(Stdio::null())
        .spawn()
        .expect("run split in the container")
}

#[test]
fn clickhouse_agent_windows_query_like_the_spool() {
    let server = server();
    let url = server.url();
    let dir = spool_dir("ch_split");
    let d = dir.to_str().unwrap();
    // The split runs in a docker-style container cgroup so `--container` selects it.
    let tree = CgroupTree::create("ch").expect("create test cgroup tree");
    let (id, cg) = container(&tree);
    // Only the container: at ~0.3-0.7 s per delivered window on this loaded 2-CPU host,
    // `--all` (15-20 processes a second) outruns the sink (see the report).
    let agent = Agent::start(&[
        "--spool",
        d,
        "--clickhouse",
        &url,
        "--window",
        "1",
        "-F",
        "499",
        "--host",
        "it-host",
        "--container",
        &id,
    ]);
    assert!(split_in(&cg, "3").wait().unwrap().success());
    let (status, stderr) = agent.stop(libc::SIGTERM, Duration::from_secs(10));
    assert!(status.success(), "agent failed:\n{stderr}");
    let written = summary_number(&stderr, "agent stopped by", " windows written");
    let delivered = summary_number(&stderr, "sink clickhouse:", " windows delivered");
    let rejected = summary_number(&stderr, "sink clickhouse:", " rejected");
    assert_eq!(rejected, 0, "{stderr}");
    assert_eq!(delivered, written, "every window delivered before exit:\n{stderr}");

    // ClickHouse holds exactly the spool's windows, each once.
    let spool = spooled(&dir);
    let stored = tsv(&server, "SELECT window_id, samples FROM rsprof_windows FINAL");
    let stored: BTreeMap<String, u64> =
        stored.into_iter().map(|r| (r[0].clone(), r[1].parse().unwrap())).collect();
    assert_eq!(stored.len(), spool.len());
    for (id, meta) in &spool {
        assert_eq!(stored.get(id).copied(), meta["samples"].as_u64(), "window {id}");
    }

    let ch_gecko = output_path("ch_query", "json.gz");
    let q = |source: &[&str], out: &Path, extra: &[&str]| {
        let mut args = vec!["query"];
        args.extend(source);
        args.extend(["--from", "-1h", "--host", "it-host", "-o", out.to_str().unwrap()]);
        args.extend(extra);
        let r = run(&args).unwrap();
        assert!(r.status.success(), "query {args:?} failed:\n{}", r.stderr);
    };
    let ch = ["--clickhouse", url.as_str()];
    let sp = ["--spool", d];
    let prefix = &id[..12];
    q(&ch, &ch_gecko, &["--container", prefix]);
    let profile = gecko_schema::load(&ch_gecko).expect("query's profile loads");
    let ts = threads(&profile);
    assert!(!ts.is_empty());
    for t in &ts {
        assert!(
            t.process_name.starts_with("split") && t.process_name.contains("it-host"),
            "only the container's split: {}",
            t.process_name
        );
    }
    let hot_a: usize = ts.iter().map(|t| count_samples_with_frame(t.thread, "hot_a")).sum();

    // pprof from both sources, read by Go's pprof.
    let (ch_pb, sp_pb) = (output_path("ch_query", "pb.gz"), output_path("sp_query", "pb.gz"));
    q(&ch, &ch_pb, &["--container", prefix]);
    q(&sp, &sp_pb, &["--container", prefix]);
    let (ch_share, ch_n, ch_top) = hot_share(&ch_pb);
    let (sp_share, sp_n, _) = hot_share(&sp_pb);
    // The split may get a small share of a loaded host's CPUs: no fixed sample count, no fixed
    // share; the two paths must agree on the same windows.
    assert!(ch_n >= 50.0, "3 s at 499 Hz: only {ch_n} hot samples:\n{ch_top}");
    assert!(
        (ch_share - sp_share).abs() <= 5.0,
        "ClickHouse {ch_share:.1}% vs spool {sp_share:.1}%"
    );
    assert_eq!(ch_n, sp_n, "the same windows hold the same samples");
    let out = go_pprof::run(&["-top", "-sample_index=samples", "-nodefraction=0"], &ch_pb).unwrap();
    let (_, rows) = parse_top(&out).unwrap();
    let cum_a = rows.iter().find(|r| r.name == "hot_a").map_or(0.0, |r| r.cum);
    assert_eq!(hot_a as f64, cum_a, "Gecko and pprof from ClickHouse hold the same hot_a samples");

    // Filters that match nothing.
    for extra in [&["--container", "0000"][..], &["--process", "no-such-process"][..]] {
        let mut args = vec!["query", "--clickhouse", &url, "--from", "-1h", "-o"];
        let o = output_path("ch_none", "json");
        args.push(o.to_str().unwrap());
        args.extend(extra);
        let r = run(&args).unwrap();
        assert!(!r.status.success() && r.stderr.contains("no window"), "{extra:?}: {}", r.stderr);
    }
}

#[test]
fn clickhouse_killed_mid_run_gets_every_window_once() {
    let mut server = server();
    let url = server.url();
    let dir = spool_dir("ch_outage");
    let d = dir.to_str().unwrap();
    let tree = CgroupTree::create("ch_outage").expect("create test cgroup tree");
    let (id, cg) = container(&tree);
    let mut split = split_in(&cg, "60");
    // Only the container: a window or two per second, which the sink keeps up with on a
    // loaded test host (a window per process costs about 4 requests).
    let mut agent = Agent::start(&[
        "--spool",
        d,
        "--clickhouse",
        &url,
        "--window",
        "1",
        "-F",
        "49",
        "--container",
        &id,
    ]);
    for _ in 0..2 {
        agent.wait_for("window:", Duration::from_secs(30));
    }
    server.kill();
    agent.wait_for("clickhouse: delivery failed", Duration::from_secs(30));
    for _ in 0..3 {
        agent.wait_for("window:", Duration::from_secs(30));
    }
    server.resume().unwrap_or_else(|e| panic!("{e:#}"));
    agent.wait_for("clickhouse: delivering again", Duration::from_secs(90));
    agent.wait_for("window:", Duration::from_secs(30));
    let (status, stderr) = agent.stop(libc::SIGTERM, Duration::from_secs(10));
    let _ = split.kill();
    let _ = split.wait();
    assert!(status.success(), "agent failed:\n{stderr}");
    let written = summary_number(&stderr, "agent stopped by", " windows written");
    let delivered = summary_number(&stderr, "sink clickhouse:", " windows delivered");
    let retries = summary_number(&stderr, "sink clickhouse:", " retries");
    assert!(retries > 0, "{stderr}");
    assert_eq!(delivered, written, "every window delivered after the outage:\n{stderr}");

    let spool = spooled(&dir);
    let raw = tsv(&server, "SELECT window_id FROM rsprof_windows");
    let stored: BTreeMap<String, usize> = raw.iter().fold(BTreeMap::new(), |mut m, r| {
        *m.entry(r[0].clone()).or_default() += 1;
        m
    });
    assert!(stored.values().all(|&n| n == 1), "a window stored twice: {stored:?}");
    assert_eq!(stored.keys().collect::<Vec<_>>(), spool.keys().collect::<Vec<_>>());
    // Samples as queries see them (FINAL) match each window's count.
    let sums: HashMap<String, u64> =
        tsv(&server, "SELECT window_id, sum(samples) FROM rsprof_samples FINAL GROUP BY window_id")
            .into_iter()
            .map(|r| (r[0].clone(), r[1].parse().unwrap()))
            .collect();
    for (id, meta) in &spool {
        assert_eq!(sums.get(id).copied().unwrap_or(0), meta["samples"].as_u64().unwrap(), "{id}");
    }
}

#[test]
fn clickhouse_rejections_are_counted_and_logged() {
    let server = server();
    // A table of another shape where the agent writes: ClickHouse refuses every window.
    server.query("CREATE DATABASE other").unwrap();
    server
        .query("CREATE TABLE other.rsprof_samples (x UInt8) ENGINE = MergeTree() ORDER BY x")
        .unwrap();
    let url = format!("{}?database=other", server.url());
    let dir = spool_dir("ch_reject");
    let mut agent =
        Agent::start(&["--spool", dir.to_str().unwrap(), "--clickhouse", &url, "--window", "1"]);
    let warning = agent.wait_for("rejected, not retried", Duration::from_secs(30));
    assert!(warning.contains("Code: ") && warning.contains("ClickHouse HTTP"), "{warning}");
    let (status, stderr) = agent.stop(libc::SIGTERM, Duration::from_secs(10));
    assert!(status.success(), "{stderr}");
    let rejected = summary_number(&stderr, "sink clickhouse:", " rejected");
    let delivered = summary_number(&stderr, "sink clickhouse:", " windows delivered");
    assert!(rejected > 0 && delivered == 0, "{stderr}");
    assert_eq!(stderr.matches("rejected, not retried").count(), 1, "logged once:\n{stderr}");
}
