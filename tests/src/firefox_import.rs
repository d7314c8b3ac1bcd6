//! Imports a profile file with the Firefox Profiler's own code: `profiler-cli` (npm
//! `@firefox-devtools/profiler-cli`, published by the front-end's maintainers) runs the
//! front-end's importer and selectors in Node. `gecko_schema` is our reading of the format; this
//! is the front-end's verdict. `cargo xtask setup` installs the pinned version into
//! `<target dir>/profiler-cli`.
//!
//! The CLI loads the profile in a daemon and answers queries over a socket in its session
//! directory. Each import gets a fresh session directory and its own daemon, killed afterwards,
//! so imports never share state and leave nothing running.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use serde_json::Value;

use crate::{fixtures, profile_query};

pub const PACKAGE: &str = "@firefox-devtools/profiler-cli";
/// Exact version installed by `cargo xtask setup`. It declares Node >= 24 but runs on Node 20
/// (checked on 20.20 and 18.20): the newer features we found in its
/// bundle are feature-detected, except `--use-env-proxy` for its daemon, which it leaves out
/// (with a warning) when a proxy variable is set; we clear those variables (it never needs the
/// network here, see `SYMBOL_SERVER`).
pub const VERSION: &str = "0.10.0";

/// Our profiles carry no libraries to symbolicate, so the front-end should never ask a symbol
/// server; pointing it at a closed local port keeps the tests off the network and turns an
/// unexpected request into a logged failure instead of a download.
const SYMBOL_SERVER: &str = "http://127.0.0.1:9";

const PROXY_VARS: &[&str] =
    &["HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"];

/// Where `cargo xtask setup` installs the package (`npm install --prefix`).
pub fn install_dir() -> PathBuf {
    fixtures::target_dir().join("profiler-cli")
}

/// The CLI's script, run with `node`.
pub fn script() -> PathBuf {
    package_dir().join("dist").join("profiler-cli.js")
}

fn package_dir() -> PathBuf {
    install_dir().join("node_modules").join(PACKAGE)
}

/// Version of the package installed in [`install_dir`], if any.
pub fn installed_version() -> Option<String> {
    let json = std::fs::read(package_dir().join("package.json")).ok()?;
    let v: Value = serde_json::from_slice(&json).ok()?;
    v["version"].as_str().map(str::to_owned)
}

/// What the front-end made of a profile, for comparison with our JSON.
#[derive(Debug, PartialEq)]
pub struct Imported {
    /// (pid, tid) of every thread, in the importer's thread order.
    pub threads: Vec<(u64, u64)>,
    /// The thread with the most samples in our JSON: its index, sample count and non-idle
    /// sample count as the front-end counts them.
    pub busiest: Option<(usize, u64, u64)>,
}

/// Imports `path` with profiler-cli and checks the result against `ours` (the same file, parsed):
/// the load must succeed without any error or warning from the front-end, its threads must be
/// ours in the same order, and our busiest thread must have the same number of samples and of
/// non-idle samples.
pub fn check(path: &Path, ours: &Value) -> anyhow::Result<()> {
    let imported = import(path, busiest_thread(ours))?;
    compare(ours, &imported).with_context(|| {
        format!("the Firefox Profiler (profiler-cli {VERSION}) imported {}", path.display())
    })
}

fn compare(ours: &Value, imported: &Imported) -> anyhow::Result<()> {
    let threads: Vec<(u64, u64)> =
        profile_query::threads(ours).iter().map(|t| (t.pid, t.tid)).collect();
    ensure!(
        imported.threads == threads,
        "its threads (pid, tid) differ from ours:\n  imported: {:?}\n  ours:     {:?}",
        imported.threads,
        threads
    );
    if let Some((index, samples, active)) = imported.busiest {
        let thread = profile_query::threads(ours)[index].thread;
        let (our_samples, our_active) = sample_counts(ours, thread);
        ensure!(
            (samples, active) == (our_samples, our_active),
            "thread t-{index} has {samples} samples, {active} of them not idle; ours has \
             {our_samples} and {our_active}"
        );
    }
    Ok(())
}

/// Index of the thread with the most samples (the first on a tie), None without samples.
fn busiest_thread(profile: &Value) -> Option<usize> {
    let counts = profile_query::threads(profile)
        .iter()
        .map(|t| t.thread["samples"]["data"].as_array().map_or(0, Vec::len))
        .collect::<Vec<_>>();
    let max = *counts.iter().max()?;
    (max > 0).then(|| counts.iter().position(|&c| c == max).unwrap())
}

/// (all samples, samples with a stack whose category is not "Idle") of `thread`: the front-end
/// leaves null stacks and idle stacks out of `thread samples`. A frame without a category takes
/// its caller's, the root's default is category 0.
fn sample_counts(profile: &Value, thread: &Value) -> (u64, u64) {
    let idle = profile["meta"]["categories"]
        .as_array()
        .and_then(|c| c.iter().position(|c| c["name"] == "Idle"))
        .map(|i| i as u64);
    let col = |table: &str, name: &str| -> Vec<Value> {
        let t = &thread[table];
        let i = t["schema"][name].as_u64().unwrap_or(u64::MAX) as usize;
        t["data"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| r.get(i).cloned().unwrap_or(Value::Null))
            .collect()
    };
    let frame_cat = col("frameTable", "category");
    let (prefix, frame) = (col("stackTable", "prefix"), col("stackTable", "frame"));
    let stack_cat = |mut s: usize| -> u64 {
        loop {
            let f = frame[s].as_u64().unwrap_or(0) as usize;
            if let Some(c) = frame_cat.get(f).and_then(Value::as_u64) {
                return c;
            }
            match prefix[s].as_u64() {
                Some(p) => s = p as usize,
                None => return 0,
            }
        }
    };
    let stacks = col("samples", "stack");
    let active = stacks
        .iter()
        .filter_map(Value::as_u64)
        .filter(|&s| Some(stack_cat(s as usize)) != idle)
        .count();
    (stacks.len() as u64, active as u64)
}

static SESSIONS: AtomicU32 = AtomicU32::new(0);

const SESSION: &str = "s";

/// How long a profile may take to load (large `--all` profiles on a busy machine).
const LOAD_TIMEOUT: Duration = Duration::from_secs(300);

/// One profiler-cli daemon with the profile loaded, in its own session directory (short: the
/// socket path must fit in 108 bytes). Dropping it kills the daemon and removes the directory.
///
/// We start the daemon ourselves, with the same command `profiler-cli load` spawns (and its
/// error messages suggest running in the foreground), because `load` gives it a fixed 500 ms
/// to start listening: on a busy 2-CPU machine Node takes longer and every `load` failed.
struct Session {
    dir: PathBuf,
    daemon: Child,
}

fn node(dir: &Path) -> Command {
    let mut cmd = Command::new("node");
    cmd.arg(script()).env("PROFILER_CLI_SESSION_DIR", dir);
    for var in PROXY_VARS {
        cmd.env_remove(var);
    }
    cmd
}

impl Session {
    fn start(profile: &Path) -> anyhow::Result<Self> {
        let n = SESSIONS.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("rsprof-pq-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let out = |name: &str| std::fs::File::create(dir.join(name)).map(Stdio::from);
        let daemon = node(&dir)
            .arg("--daemon")
            .arg(profile)
            .args(["--session", SESSION, "--symbol-server", SYMBOL_SERVER])
            .stdin(Stdio::null())
            .stdout(out("daemon.stdout")?)
            .stderr(out("daemon.stderr")?)
            .spawn()
            .context("running `node` (install Node.js: run `cargo xtask setup`)")?;
        Ok(Session { dir, daemon })
    }

    /// Waits until the daemon has loaded the profile or failed to; Err only when it neither
    /// finished nor failed in time.
    fn wait_loaded(&mut self) -> anyhow::Result<()> {
        let end = Instant::now() + LOAD_TIMEOUT;
        loop {
            let log = self.log();
            if log.contains("Profile loaded successfully") || log.contains("Failed to load profile")
            {
                return Ok(());
            }
            if let Some(status) = self.daemon.try_wait()? {
                bail!("the profiler-cli daemon exited ({status}):\n{}", self.report());
            }
            if Instant::now() > end {
                bail!("the profile did not load within {LOAD_TIMEOUT:?}:\n{}", self.report());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs the queries at once (each is a Node start; the daemon answers them in turn); each
    /// must succeed and print JSON.
    fn queries<const N: usize>(&self, queries: [&[&str]; N]) -> anyhow::Result<[Value; N]> {
        let running = queries.map(|args| {
            let mut all = args.to_vec();
            all.extend(["--json", "--session", SESSION]);
            let child = node(&self.dir)
                .args(&all)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .context("running `node`");
            (all.join(" "), child)
        });
        let mut results = Vec::with_capacity(N);
        for (cmd, child) in running {
            let out = child?.wait_with_output()?;
            let stdout = String::from_utf8_lossy(&out.stdout);
            if !out.status.success() || !out.stderr.is_empty() {
                bail!(
                    "`profiler-cli {cmd}` failed ({}):\n{}{}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr),
                    self.report()
                );
            }
            let json = serde_json::from_str(&stdout)
                .with_context(|| format!("`profiler-cli {cmd}` printed no JSON:\n{stdout}"))?;
            results.push(json);
        }
        Ok(results.try_into().unwrap())
    }

    fn read(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(name)).unwrap_or_default()
    }

    /// The daemon's log: where the front-end's console messages, errors and warnings go.
    fn log(&self) -> String {
        self.read(&format!("{SESSION}.log"))
    }

    /// Error and warning lines of the log, and anything the daemon printed itself.
    fn complaints(&self) -> Vec<String> {
        let log = self.log();
        let lines = log.lines().filter(|l| l.starts_with("[ERROR]") || l.starts_with("[WARN]"));
        let printed = [self.read("daemon.stdout"), self.read("daemon.stderr")];
        lines.map(str::to_owned).chain(printed.into_iter().filter(|s| !s.is_empty())).collect()
    }

    /// The daemon's log and output, for an error message.
    fn report(&self) -> String {
        format!(
            "--- daemon log:\n{}--- daemon stdout:\n{}--- daemon stderr:\n{}",
            self.log(),
            self.read("daemon.stdout"),
            self.read("daemon.stderr")
        )
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Loads `path` in a fresh profiler-cli daemon and reads back its threads and, for thread
/// `busiest`, its sample counts. A failed load, a failed query, or any error or warning the
/// front-end logs or prints is an error carrying the daemon's log and output.
pub fn import(path: &Path, busiest: Option<usize>) -> anyhow::Result<Imported> {
    match installed_version() {
        Some(v) if v == VERSION => {}
        found => bail!(
            "{PACKAGE} {VERSION} is not installed in {} (found {found:?}): run `cargo xtask \
             setup`",
            install_dir().display()
        ),
    }
    let path = std::path::absolute(path)?;
    let mut session = Session::start(&path)?;
    session.wait_loaded()?;
    let failed = |what: &str| {
        anyhow::anyhow!(
            "the Firefox Profiler (profiler-cli {VERSION}) {what} {}:\n{}\n{}",
            path.display(),
            session.complaints().join("\n"),
            session.report()
        )
    };
    if !session.complaints().is_empty() {
        return Err(failed("could not import, or complained importing,"));
    }

    // Thread 0 stands in when there are no samples, so every import runs the same queries.
    let handle = format!("t-{}", busiest.unwrap_or(0));
    let [list, info, samples] = session.queries([
        &["thread", "list", "--limit", "1000000000"],
        &["thread", "info", "--thread", &handle],
        &["thread", "samples", "--thread", &handle],
    ])?;
    let mut threads = list["threads"]
        .as_array()
        .context("`thread list` has no threads array")?
        .iter()
        .map(|t| {
            let id = |v: &Value| v.as_u64().or_else(|| v.as_str()?.parse().ok());
            Ok((
                t["threadIndex"].as_u64().context("threadIndex")?,
                id(&t["pid"]).context("pid")?,
                id(&t["tid"]).context("tid")?,
            ))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    threads.sort_unstable();
    ensure!(
        threads.iter().enumerate().all(|(i, t)| t.0 == i as u64),
        "`thread list` thread indices are not 0..n: {threads:?}"
    );
    let threads = threads.into_iter().map(|(_, pid, tid)| (pid, tid)).collect();
    let busiest = match busiest {
        Some(i) => Some((
            i,
            info["sampleCount"].as_u64().context("`thread info` has no sampleCount")?,
            samples["categoryBreakdown"]["totalSamples"]
                .as_u64()
                .context("`thread samples` has no categoryBreakdown.totalSamples")?,
        )),
        None => None,
    };
    // The queries run in the daemon too: look again.
    if !session.complaints().is_empty() {
        return Err(failed("complained answering queries on"));
    }
    Ok(Imported { threads, busiest })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn write(name: &str, profile: &Value) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("firefox-import-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, serde_json::to_vec(profile).unwrap()).unwrap();
        path
    }

    #[test]
    fn valid_profile_imports_and_matches() {
        let p = crate::gecko_schema::tests::valid();
        let path = write("valid.json", &p);
        check(&path, &p).unwrap();
        let imported = import(&path, busiest_thread(&p)).unwrap();
        // Thread 7 of the root and thread 8 of the sub-process; 3 samples, one null, none idle.
        assert_eq!(imported, Imported { threads: vec![(7, 7), (7, 8)], busiest: Some((0, 3, 2)) });
    }

    /// The front-end refuses these; the check must say so with its message.
    #[test]
    fn broken_profiles_fail() {
        let mut p = crate::gecko_schema::tests::valid();
        p["threads"] = json!([]);
        p["processes"][0]["threads"] = json!([]);
        let err = format!("{:#}", check(&write("no-threads.json", &p), &p).unwrap_err());
        assert!(err.contains("This profile has no threads"), "{err}");

        let mut p = crate::gecko_schema::tests::valid();
        p["meta"]["version"] = json!(9999);
        let err = format!("{:#}", check(&write("version.json", &p), &p).unwrap_err());
        assert!(err.contains("version 9999"), "{err}");

        let path = write("not-json.json", &json!(null));
        std::fs::write(&path, "{not json").unwrap();
        let err = format!("{:#}", import(&path, None).unwrap_err());
        assert!(err.contains("Unserializing the profile failed"), "{err}");
    }

    /// A profile the front-end imports but reads differently from ours fails the comparison.
    #[test]
    fn mismatch_with_ours_fails() {
        let p = crate::gecko_schema::tests::valid();
        let path = write("valid-2.json", &p);
        let mut other = p.clone();
        other["processes"][0]["threads"][0]["tid"] = json!(9);
        let err = format!("{:#}", check(&path, &other).unwrap_err());
        assert!(err.contains("threads (pid, tid) differ"), "{err}");
        let mut other = p.clone();
        other["threads"][0]["samples"]["data"][0][0] = json!(null);
        let err = format!("{:#}", check(&path, &other).unwrap_err());
        assert!(err.contains("has 3 samples, 2 of them not idle; ours has 3 and 1"), "{err}");
    }

    #[test]
    fn counts_idle_by_stack_category() {
        let mut p = crate::gecko_schema::tests::valid();
        p["meta"]["categories"][1]["name"] = json!("Idle");
        // Frame 1 has no category of its own: it takes frame 0's (Idle).
        p["threads"][0]["frameTable"]["data"][1][6] = json!(null);
        assert_eq!(sample_counts(&p, &p["threads"][0]), (3, 0));
        p["threads"][0]["frameTable"]["data"][1][6] = json!(0);
        assert_eq!(sample_counts(&p, &p["threads"][0]), (3, 1));
    }
}
