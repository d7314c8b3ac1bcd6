//! Frames of stripped programs named from a real debuginfod server (Debian's), its debug file
//! cached for the next run as elfutils caches it (elfutils' `debuginfod-find` and rsprof-bpf
//! each use what the other fetched); servers that are down, lack the file or send
//! garbage leave the frames as addresses, counted, within the export's budget.

use std::{
    io::{Read as _, Write as _},
    net::TcpListener,
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;
use tests::{
    debuginfod::{Server, Stripped, stripped_fixture},
    gecko_schema, harness, ports,
    profile_query::{sample_stacks, threads},
};

/// The fixture's process name; no other process on the machine has it.
const NAME: &str = "dbgsplit";

fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rsprof-dbgd-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

struct Run {
    stderr: String,
    profile: Value,
    took: Duration,
}

impl Run {
    /// `(fetched, not found, errors, from the cache)` of the summary's debuginfod line.
    fn counts(&self) -> (u64, u64, u64, u64) {
        let line = self
            .stderr
            .lines()
            .filter(|l| l.contains(" files fetched ("))
            .find_map(|l| l.trim().strip_prefix("debuginfod: "))
            .unwrap_or_else(|| panic!("no debuginfod line in the summary:\n{}", self.stderr));
        let num = |after: &str| -> u64 {
            line.split(after)
                .next()
                .and_then(|s| s.split([' ', ',', ';']).rfind(|w| !w.is_empty()))
                .and_then(|w| w.parse().ok())
                .unwrap_or(0)
        };
        let cached = line
            .split("; ")
            .nth(1)
            .and_then(|s| s.strip_suffix(" from the cache"))
            .map_or(0, |n| n.parse().unwrap());
        (num(" files fetched"), num(" not found"), num(" errors"), cached)
    }

    /// Every location of the fixture's frames in its samples, one per sample leaf.
    fn leaves(&self) -> Vec<String> {
        threads(&self.profile)
            .into_iter()
            .filter(|t| t.process_name == NAME)
            .flat_map(|t| sample_stacks(t.thread))
            .filter_map(|s| s.last().cloned())
            .filter(|l| l.contains(&format!("(in {NAME})")))
            .collect()
    }
}

/// Records the fixture for `seconds` with `args` (debuginfod options), the cache at `cache`.
fn record(exe: &Path, seconds: &str, cache: &Path, args: &[&str]) -> Result<Run> {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let out = exe.with_extension(format!("{n}.json"));
    let began = Instant::now();
    let done = harness::command()?
        .env_remove("DEBUGINFOD_URLS")
        .env("DEBUGINFOD_CACHE_PATH", cache)
        .args(args)
        .arg("-o")
        .arg(&out)
        .arg("--")
        .arg(exe)
        .arg(seconds)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .output()
        .context("run rsprof-bpf")?;
    let took = began.elapsed();
    let stderr = String::from_utf8_lossy(&done.stderr).into_owned();
    if !done.status.success() {
        bail!("rsprof-bpf failed ({}):\n{stderr}", done.status);
    }
    let profile = gecko_schema::load(&out)?;
    Ok(Run { stderr, profile, took })
}

/// The source lines of function `f` in the fixture (its definition to its closing brace).
fn lines_of(source: &Path, f: &str) -> std::ops::RangeInclusive<u32> {
    let text = std::fs::read_to_string(source).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.iter().position(|l| l.contains(&format!("void {f}("))).unwrap();
    let end = start + lines[start..].iter().position(|l| *l == "}").unwrap();
    (start as u32 + 1)..=(end as u32 + 1)
}

/// Leaves named `f (in dbgsplit) (SOURCE:LINE…)` with LINE in `f`'s body.
fn named_with_line(leaves: &[String], stripped: &Stripped, f: &str) -> usize {
    let prefix = format!("{f} (in {NAME}) ({}:", stripped.source.display());
    let body = lines_of(&stripped.source, f);
    leaves
        .iter()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|rest| rest.split([':', ')']).next()?.parse::<u32>().ok())
        .filter(|line| body.contains(line))
        .count()
}

fn unnamed(leaves: &[String]) -> usize {
    leaves.iter().filter(|l| l.starts_with("0x")).count()
}

#[test]
fn stripped_program_is_named_from_the_server_then_from_the_cache() -> Result<()> {
    let dir = temp_dir("named");
    let stripped = stripped_fixture("split", &dir, NAME)?;
    let server = Server::start("named", &stripped.debug_dir, Some(&stripped.build_id))?;
    let cache = dir.join("cache");
    let url = server.url.clone();
    let before = server.buildid_requests();

    let first = record(&stripped.exe, "1.5", &cache, &["--debuginfod", &url])?;
    let leaves = first.leaves();
    assert!(leaves.len() > 300, "{} fixture samples:\n{}", leaves.len(), first.stderr);
    let (a, b) = (
        named_with_line(&leaves, &stripped, "hot_a"),
        named_with_line(&leaves, &stripped, "hot_b"),
    );
    // hot_a runs three times as long as hot_b; nearly every leaf is one of them.
    assert!(a + b >= leaves.len() * 9 / 10, "{a}+{b} of {}: {:?}", leaves.len(), &leaves[..10]);
    assert!(a > 2 * b && b > 0, "hot_a {a}, hot_b {b}");
    assert_eq!(first.counts(), (1, 0, 0, 0), "{}", first.stderr);
    assert_eq!(server.buildid_requests() - before, 1, "{}", server.log());
    let cached = cache.join(&stripped.build_id).join("debuginfo");
    assert!(std::fs::metadata(&cached)?.len() > 0, "{} not cached", cached.display());

    // elfutils' own client fills another cache from the server.
    let elfutils_cache = dir.join("cache-elfutils");
    let found = debuginfod_find(&url, &elfutils_cache, &stripped.build_id)?;
    assert!(found.starts_with(&elfutils_cache), "{}", found.display());

    // The server gone: named from the cache, nothing asked; elfutils' cache serves alike.
    drop(server);
    for cache in [&cache, &elfutils_cache] {
        let second = record(&stripped.exe, "1", cache, &["--debuginfod", &url])?;
        let leaves = second.leaves();
        assert!(named_with_line(&leaves, &stripped, "hot_a") > leaves.len() / 2, "{leaves:?}");
        assert_eq!(second.counts(), (0, 0, 0, 1), "{}", second.stderr);
    }
    // And elfutils' client finds ours there with the server gone.
    assert_eq!(debuginfod_find(&url, &cache, &stripped.build_id)?, cached);

    // Without debuginfod the same cache is not read: the frames are addresses.
    let third = record(&stripped.exe, "1", &cache, &["--no-debuginfod"])?;
    let leaves = third.leaves();
    assert!(unnamed(&leaves) >= leaves.len() * 9 / 10, "{leaves:?}");
    assert!(!third.stderr.contains("debuginfod:"), "{}", third.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Where elfutils' `debuginfod-find` finds `id`'s debug file, with `url` and `cache`.
fn debuginfod_find(url: &str, cache: &Path, id: &str) -> Result<PathBuf> {
    let out = std::process::Command::new("debuginfod-find")
        .env("DEBUGINFOD_URLS", url)
        .env("DEBUGINFOD_CACHE_PATH", cache)
        .args(["debuginfo", id])
        .output()
        .context("run debuginfod-find (Debian package debuginfod)")?;
    if !out.status.success() {
        bail!("debuginfod-find failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// A server that answers every request with `answer` (None: reads it and never answers).
fn bad_server(answer: Option<&'static [u8]>) -> Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let url = format!("http://{}", listener.local_addr()?);
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf);
            match answer {
                Some(a) => {
                    let _ = conn.write_all(a);
                }
                None => held.push(conn),
            }
        }
    });
    Ok(url)
}

#[test]
fn servers_down_missing_garbage_or_silent_leave_addresses_counted() -> Result<()> {
    let dir = temp_dir("bad");
    let stripped = stripped_fixture("split", &dir, NAME)?;
    let check = |run: &Run, counts: (u64, u64, u64, u64), why: &str| {
        let leaves = run.leaves();
        assert!(leaves.len() > 100, "{} fixture samples:\n{}", leaves.len(), run.stderr);
        assert!(unnamed(&leaves) >= leaves.len() * 9 / 10, "{:?}", &leaves[..10]);
        assert_eq!(run.counts(), counts, "{}", run.stderr);
        assert!(run.stderr.contains(why), "no {why:?} in:\n{}", run.stderr);
    };

    // Down: nothing listens on the port.
    let closed = format!("http://127.0.0.1:{}", ports::free_port()?);
    let cache = dir.join("cache-down");
    let down = record(&stripped.exe, "1", &cache, &["--debuginfod", &closed])?;
    check(&down, (0, 0, 1, 0), "warning: debuginfod: ");

    // A real server without the file: 404, remembered as elfutils remembers it (an empty
    // file), so the next run asks nothing.
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty)?;
    let server = Server::start("missing", &empty, None)?;
    let cache = dir.join("cache-missing");
    let missing = record(&stripped.exe, "1", &cache, &["--debuginfod", &server.url])?;
    check(&missing, (0, 1, 0, 0), "debuginfod: 0 files fetched");
    let negative = cache.join(&stripped.build_id).join("debuginfo");
    assert_eq!(std::fs::metadata(&negative)?.len(), 0, "no negative result cached");
    let asked = server.buildid_requests();
    assert_eq!(asked, 1, "{}", server.log());
    let again = record(&stripped.exe, "1", &cache, &["--debuginfod", &server.url])?;
    check(&again, (0, 1, 0, 0), "debuginfod: 0 files fetched");
    assert_eq!(server.buildid_requests(), asked, "asked again:\n{}", server.log());

    // Garbage with a 200: not kept, not used.
    let garbage = bad_server(Some(
        b"HTTP/1.1 200 OK\r\nContent-Length: 16\r\nConnection: close\r\n\r\nnot an ELF file!",
    ))?;
    let cache = dir.join("cache-garbage");
    let run = record(&stripped.exe, "1", &cache, &["--debuginfod", &garbage])?;
    check(&run, (0, 0, 1, 0), "not an ELF file");
    assert!(!cache.join(&stripped.build_id).join("debuginfo").exists());

    // Silent: the export waits for the 3 s budget, not for the 120 s request timeout.
    let silent = bad_server(None)?;
    let cache = dir.join("cache-silent");
    let args =
        ["--debuginfod", &silent, "--debuginfod-timeout", "120s", "--debuginfod-budget", "3s"];
    let run = record(&stripped.exe, "1", &cache, &args)?;
    check(&run, (0, 0, 1, 0), "budget");
    // The fixture's second and the budget, plus start-up and writing: far under the timeout.
    assert!(run.took < Duration::from_secs(30), "took {:?}", run.took);
    // The wait says how it goes every 2 s, but not with -q.
    assert!(run.stderr.contains("debug files after"), "{}", run.stderr);
    let quiet = [&args[..], &["-q"]].concat();
    let run = record(&stripped.exe, "1", &dir.join("cache-quiet"), &quiet)?;
    assert!(!run.stderr.contains("debug files after"), "{}", run.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// `rsprof-bpf query` of `spool` (the fixture's process only) with `args`, the debuginfod
/// cache at `cache`: the merged profile and query's stderr.
fn query(spool: &Path, cache: &Path, args: &[&str], out: &Path) -> Result<(Value, String)> {
    query_from(&["--spool", spool.to_str().unwrap()], cache, args, out)
}

/// `query`, of the windows `source` says.
fn query_from(source: &[&str], cache: &Path, args: &[&str], out: &Path) -> Result<(Value, String)> {
    let done = harness::command()?
        .env_remove("DEBUGINFOD_URLS")
        .env("DEBUGINFOD_CACHE_PATH", cache)
        .arg("query")
        .args(source)
        .args(["--process", NAME, "-o"])
        .arg(out)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("run rsprof-bpf query")?;
    let stderr = String::from_utf8_lossy(&done.stderr).into_owned();
    if !done.status.success() {
        bail!("query failed ({}):\n{stderr}", done.status);
    }
    Ok((gecko_schema::load(out)?, stderr))
}

/// The fixture's sample leaves in a merged profile (its track is `dbgsplit @ host`).
fn query_leaves(profile: &Value) -> Vec<String> {
    threads(profile)
        .into_iter()
        .filter(|t| t.process_name.starts_with(&format!("{NAME} @ ")))
        .flat_map(|t| sample_stacks(t.thread))
        .filter_map(|s| s.last().cloned())
        .filter(|l| l.contains(&format!("(in {NAME})")))
        .collect()
}

/// `(named, left as addresses)` of query's report on the frames agents left unnamed.
fn query_counts(stderr: &str) -> (u64, u64) {
    let line = stderr
        .lines()
        .find_map(|l| {
            l.strip_prefix("rsprof-bpf: addresses agents left unnamed (stripped files): ")
        })
        .unwrap_or_else(|| panic!("no report on unnamed addresses:\n{stderr}"));
    let mut n = line.split(", ").map(|p| p.split(' ').next().unwrap().parse::<u64>().unwrap());
    (n.next().unwrap(), n.next().unwrap())
}

/// An agent on a host without the fixture's debug file spools its frames as (build-id,
/// address); `query` names them from a debug directory or from a debuginfod server, and
/// without either they stay addresses, counted.
#[test]
fn agent_leaves_addresses_that_query_names_from_debug_files() -> Result<()> {
    let dir = temp_dir("agent");
    let stripped = stripped_fixture("split", &dir, NAME)?;
    let spool = dir.join("spool");
    let agent = tests::agent::Agent::start(&[
        "--spool",
        spool.to_str().unwrap(),
        "--window",
        "1",
        "-F",
        "499",
    ]);
    let ran = std::process::Command::new(&stripped.exe).arg("3").status()?;
    assert!(ran.success(), "{ran}");
    let (status, agent_err) = agent.stop(libc::SIGTERM, Duration::from_secs(10));
    assert!(status.success(), "agent failed:\n{agent_err}");

    // Neither a debug directory nor a server: addresses, counted.
    let cache = dir.join("cache");
    let (profile, err) = query(&spool, &cache, &["--no-debuginfod"], &dir.join("q0.json"))?;
    let leaves = query_leaves(&profile);
    assert!(leaves.len() > 300, "{} fixture samples:\n{err}\n{agent_err}", leaves.len());
    assert!(unnamed(&leaves) >= leaves.len() * 9 / 10, "{:?}", &leaves[..10]);
    let (named, left) = query_counts(&err);
    assert!(named == 0 && left > 0, "{err}");
    // The fixture's and those of the libraries' frames outside their .dynsym.
    assert!(err.contains(" found nowhere (no --debug-dir, no debuginfod)"), "{err}");

    let check = |profile: &Value, err: &str| {
        let leaves = query_leaves(profile);
        let (a, b) = (
            named_with_line(&leaves, &stripped, "hot_a"),
            named_with_line(&leaves, &stripped, "hot_b"),
        );
        assert!(a + b >= leaves.len() * 9 / 10, "{a}+{b} of {}: {:?}", leaves.len(), &leaves[..10]);
        assert!(a > 2 * b && b > 0, "hot_a {a}, hot_b {b}");
        let (named, _) = query_counts(err);
        assert!(named > 0, "{err}");
    };
    // A debug directory laid out as /usr/lib/debug.
    let root = dir.join("debug-root");
    let (head, rest) = stripped.build_id.split_at(2);
    let by_id = root.join(".build-id").join(head);
    std::fs::create_dir_all(&by_id)?;
    std::fs::copy(
        stripped.debug_dir.join(format!("{NAME}.debug")),
        by_id.join(format!("{rest}.debug")),
    )?;
    let args = ["--no-debuginfod", "--debug-dir", root.to_str().unwrap()];
    let (profile, err) = query(&spool, &cache, &args, &dir.join("q1.json"))?;
    check(&profile, &err);
    assert!(err.contains("1 from --debug-dir, "), "{err}");

    // Debian's debuginfod server: fetched once into the cache.
    let server = Server::start("query", &stripped.debug_dir, Some(&stripped.build_id))?;
    let (profile, err) =
        query(&spool, &cache, &["--debuginfod", &server.url], &dir.join("q2.json"))?;
    check(&profile, &err);
    assert!(err.contains("debuginfod: 1 files fetched"), "{err}");
    let asked = (server.log().lines())
        .filter(|l| l.contains(&format!("GET /buildid/{}/debuginfo 200 ", stripped.build_id)))
        .count();
    assert_eq!(asked, 2, "the probe and query's:\n{}", server.log());
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// `(named, by the database's names, stored there)` of query's report.
fn query_store_counts(stderr: &str) -> (u64, u64, u64) {
    let line = stderr
        .lines()
        .find_map(|l| {
            l.strip_prefix("rsprof-bpf: addresses agents left unnamed (stripped files): ")
        })
        .unwrap_or_else(|| panic!("no report on unnamed addresses:\n{stderr}"));
    let n: Vec<u64> = line.split([' ', '(', ',']).filter_map(|w| w.parse().ok()).collect();
    (n[0], n[1], n[2])
}

/// The agent's ClickHouse sink keeps the unnamed frames' build-id and address; the first
/// `query --clickhouse` that names them (from a debug directory) stores the names in the
/// database, and later queries, with no debug file anywhere, name them from there.
#[test]
fn clickhouse_keeps_addresses_and_the_names_a_query_found() -> Result<()> {
    let dir = temp_dir("ch");
    let stripped = stripped_fixture("split", &dir, NAME)?;
    let server = tests::clickhouse::Server::start()?;
    let url = server.url();
    let tree = tests::cgroups::CgroupTree::create("dbgd-ch")?;
    let cg = tree.mkdir("app")?;
    let spool = dir.join("spool");
    // `rsprof_stacks` as agents made it before frames kept their place: the agent adds the
    // columns.
    server.query(
        "CREATE TABLE rsprof_stacks (day DateTime, stack_hash UInt64, functions Array(String), \
         modules Array(String), files Array(String), lines Array(UInt32), cols Array(UInt32), \
         inlined Array(UInt8)) ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMMDD(day) ORDER \
         BY stack_hash",
    )?;
    // Only the fixture's cgroup: the sink keeps up with one process's windows.
    let agent = tests::agent::Agent::start(&[
        "--spool",
        spool.to_str().unwrap(),
        "--clickhouse",
        &url,
        "--window",
        "1",
        "-F",
        "499",
        "--cgroup",
        cg.to_str().unwrap(),
    ]);
    let ran = std::process::Command::new("/bin/sh")
        .args(["-c", r#"echo $$ > "$1/cgroup.procs" && exec "$2" 3"#, "sh"])
        .arg(&cg)
        .arg(&stripped.exe)
        .stdout(Stdio::null())
        .status()?;
    assert!(ran.success(), "{ran}");
    let (status, agent_err) = agent.stop(libc::SIGTERM, Duration::from_secs(10));
    assert!(status.success(), "agent failed:\n{agent_err}");
    assert!(agent_err.contains(" rejected"), "no sink line:\n{agent_err}");
    let id = &stripped.build_id;
    let kept = server.query(&format!(
        "SELECT count() FROM rsprof_stacks ARRAY JOIN build_ids AS b, addrs AS a WHERE b = \
         '{id}' AND a != 0 FORMAT TSV"
    ))?;
    assert!(kept.trim().parse::<u64>()? > 0, "no frame of {id} kept:\n{agent_err}");

    let cache = dir.join("cache");
    let ch = ["--clickhouse", url.as_str()];
    // Nothing to name them with: addresses, counted, nothing stored.
    let (profile, err) = query_from(&ch, &cache, &["--no-debuginfod"], &dir.join("c0.json"))?;
    let leaves = query_leaves(&profile);
    assert!(leaves.len() > 300, "{} fixture samples:\n{err}\n{agent_err}", leaves.len());
    assert!(unnamed(&leaves) >= leaves.len() * 9 / 10, "{:?}", &leaves[..10]);
    assert_eq!(query_store_counts(&err), (0, 0, 0), "{err}");

    let check = |profile: &Value| {
        let leaves = query_leaves(profile);
        let (a, b) = (
            named_with_line(&leaves, &stripped, "hot_a"),
            named_with_line(&leaves, &stripped, "hot_b"),
        );
        assert!(a + b >= leaves.len() * 9 / 10, "{a}+{b} of {}: {:?}", leaves.len(), &leaves[..10]);
        assert!(a > 2 * b && b > 0, "hot_a {a}, hot_b {b}");
    };
    // Named from a debug directory, the names stored.
    let root = dir.join("debug-root");
    let (head, rest) = id.split_at(2);
    std::fs::create_dir_all(root.join(".build-id").join(head))?;
    std::fs::copy(
        stripped.debug_dir.join(format!("{NAME}.debug")),
        root.join(".build-id").join(head).join(format!("{rest}.debug")),
    )?;
    let args = ["--no-debuginfod", "--debug-dir", root.to_str().unwrap()];
    let (profile, err) = query_from(&ch, &cache, &args, &dir.join("c1.json"))?;
    check(&profile);
    let (named, from_db, stored) = query_store_counts(&err);
    assert!(named > 0 && from_db == 0 && stored == named, "{err}");
    let held = server.query(&format!(
        "SELECT count(), countIf(has(functions, 'hot_a')) FROM rsprof_names WHERE build_id = \
         '{id}' FORMAT TSV"
    ))?;
    let held: Vec<u64> = held.split_whitespace().map(|n| n.parse().unwrap()).collect();
    assert!(held[0] >= stored && held[1] > 0, "rsprof_names holds {held:?} of {stored}");

    // No debug file anywhere now: named from the database's names alone.
    let (profile, err) = query_from(&ch, &cache, &["--no-debuginfod"], &dir.join("c2.json"))?;
    check(&profile);
    let (named2, from_db, stored) = query_store_counts(&err);
    assert!(named2 == named && from_db == named && stored == 0, "{err}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
