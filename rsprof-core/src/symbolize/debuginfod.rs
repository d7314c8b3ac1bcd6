//! debuginfod client: fetches the debug file of a stripped ELF file by its build-id
//! (`GET <server>/buildid/<hex>/debuginfo`), for files named from their `.dynsym` alone.
//!
//! Servers come from `DEBUGINFOD_URLS` (space-separated, as elfutils reads it) or
//! `--debuginfod URL…`; `--no-debuginfod` turns it off. Files go to the elfutils client cache
//! (`$DEBUGINFOD_CACHE_PATH`, else `$XDG_CACHE_HOME/debuginfod_client`, else
//! `~/.cache/debuginfod_client`) at `<cache>/<hex>/debuginfo`, so files gdb or perf fetched
//! are used, and ours are theirs. A 404 leaves an empty file there, as elfutils does: a
//! negative result, believed for `<cache>/cache_miss_s` seconds (600 by default).
//!
//! Each request has a timeout, and the files one export asks for share a total budget: an
//! export waits for debuginfod at most that long, whatever the servers do.

use std::{
    collections::HashMap,
    io::{Read as _, Write as _},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, mpsc},
    time::{Duration, Instant, SystemTime},
};

/// The per-request timeout and per-export budget unless told otherwise.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(15);
const DEFAULT_BUDGET: Duration = Duration::from_secs(60);
/// Requests in flight at once.
const PARALLEL: usize = 4;
/// elfutils' default for how long a negative result is believed.
const DEFAULT_CACHE_MISS: Duration = Duration::from_secs(600);
/// A debug file larger than this is not fetched (Chromium's is ~4 GiB uncompressed, but
/// Debian serves it compressed at well under this).
const MAX_FILE_BYTES: u64 = 4 << 30;
/// Fetches running longer than this print their progress, then again at this interval.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// How debuginfod is used in this process.
#[derive(Clone, Debug)]
pub struct Config {
    /// Server base URLs, tried in order.
    pub urls: Vec<String>,
    pub cache: PathBuf,
    pub timeout: Duration,
    pub budget: Duration,
    /// No progress lines (`-q`).
    pub quiet: bool,
}

impl Config {
    /// The servers of `DEBUGINFOD_URLS` and the standard cache, or None when it names none.
    pub fn from_env() -> Option<Self> {
        let urls = std::env::var("DEBUGINFOD_URLS").unwrap_or_default();
        Self::with_urls(urls.split_whitespace().map(str::to_owned).collect())
    }

    pub fn with_urls(urls: Vec<String>) -> Option<Self> {
        let urls: Vec<String> = urls
            .into_iter()
            .map(|u| u.trim().trim_end_matches('/').to_owned())
            .filter(|u| !u.is_empty())
            .collect();
        (!urls.is_empty()).then(|| Self {
            urls,
            cache: cache_root(),
            timeout: DEFAULT_TIMEOUT,
            budget: DEFAULT_BUDGET,
            quiet: false,
        })
    }
}

/// The elfutils client cache directory.
pub fn cache_root() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = var("DEBUGINFOD_CACHE_PATH") {
        return p;
    }
    if let Some(p) = var("XDG_CACHE_HOME") {
        return p.join("debuginfod_client");
    }
    var("HOME").unwrap_or_else(|| "/root".into()).join(".cache/debuginfod_client")
}

/// This process's configuration: set once from the command line (`configure`); `None`
/// until then, or with `--no-debuginfod`.
static CONFIG: Mutex<Option<Arc<Config>>> = Mutex::new(None);

/// Uses `config` for every symbolization from now on (None: no debuginfod).
pub fn configure(config: Option<Config>) {
    *CONFIG.lock().unwrap_or_else(|e| e.into_inner()) = config.map(Arc::new);
}

pub fn current() -> Option<Arc<Config>> {
    CONFIG.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// What debuginfod did for an export.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Files downloaded, and their bytes.
    pub fetched: u64,
    pub bytes: u64,
    /// Files found in the cache (ours, gdb's, perf's), with no request.
    pub cached: u64,
    /// Build-ids no server had (404), asked now or remembered from the cache.
    pub not_found: u64,
    /// Requests that failed otherwise (server down, timeout, a file not ELF or of another
    /// build-id), and those not made because the budget was spent.
    pub errors: u64,
    pub over_budget: u64,
    /// The last failure, for the summary.
    pub last_error: Option<String>,
}

impl Stats {
    pub fn add(&mut self, o: &Stats) {
        self.fetched += o.fetched;
        self.bytes += o.bytes;
        self.cached += o.cached;
        self.not_found += o.not_found;
        self.errors += o.errors;
        self.over_budget += o.over_budget;
        if o.last_error.is_some() {
            self.last_error.clone_from(&o.last_error);
        }
    }

    pub fn is_empty(&self) -> bool {
        *self == Stats::default()
    }
}

/// What one build-id came to.
enum Outcome {
    Fetched(PathBuf, u64),
    NotFound,
    Failed(String),
}

/// The debug files of `ids` (lower-case hex build-ids): from the cache, else fetched from
/// `config`'s servers, several at once, within its budget. Returns those found by build-id.
pub fn debug_files(config: &Config, ids: &[String], stats: &mut Stats) -> HashMap<String, PathBuf> {
    let mut found = HashMap::new();
    let mut wanted = Vec::new();
    let miss_for = cache_miss(&config.cache);
    for id in ids {
        if !valid_id(id) {
            continue;
        }
        let path = cache_path(&config.cache, id);
        match std::fs::metadata(&path) {
            Ok(m) if m.len() > 0 => {
                if file_build_id(&path).as_deref() == Some(id.as_str()) {
                    stats.cached += 1;
                    found.insert(id.clone(), path);
                    continue;
                }
                // Not the file it should be: fetched again.
                let _ = std::fs::remove_file(&path);
            }
            Ok(m) => {
                let age = m.modified().ok().and_then(|t| SystemTime::now().duration_since(t).ok());
                if age.is_some_and(|a| a <= miss_for) {
                    stats.not_found += 1;
                    continue;
                }
                let _ = std::fs::remove_file(&path);
            }
            Err(_) => {}
        }
        wanted.push(id.clone());
    }
    if wanted.is_empty() {
        return found;
    }
    let began = Instant::now();
    let deadline = began + config.budget;
    let queue = Arc::new(Mutex::new(wanted));
    let total = queue.lock().map(|q| q.len()).unwrap_or(0);
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(config.timeout))
        .build()
        .into();
    let (tx, rx) = mpsc::channel::<(String, Outcome)>();
    let progress = Arc::new(std::sync::atomic::AtomicU64::new(0));
    for _ in 0..PARALLEL.min(total) {
        let (queue, tx, agent, progress) =
            (Arc::clone(&queue), tx.clone(), agent.clone(), Arc::clone(&progress));
        let config = config.clone();
        let spawned = std::thread::Builder::new().name("debuginfod".into()).spawn(move || {
            loop {
                let Some(id) = queue.lock().ok().and_then(|mut q| q.pop()) else { return };
                let outcome = fetch(&agent, &config, &id, deadline, &progress);
                if tx.send((id, outcome)).is_err() {
                    return;
                }
            }
        });
        if spawned.is_err() {
            break;
        }
    }
    drop(tx);
    let mut done = 0;
    let mut next_progress = began + PROGRESS_EVERY;
    while done < total {
        let now = Instant::now();
        // The budget is the export's: threads still fetching are left to their timeout, their
        // files unused this time (the cache has them next time).
        let Some(left) = deadline.checked_duration_since(now) else { break };
        let wait = left.min(next_progress.saturating_duration_since(now));
        match rx.recv_timeout(wait) {
            Ok((id, outcome)) => {
                done += 1;
                match outcome {
                    Outcome::Fetched(path, bytes) => {
                        stats.fetched += 1;
                        stats.bytes += bytes;
                        found.insert(id, path);
                    }
                    Outcome::NotFound => stats.not_found += 1,
                    Outcome::Failed(e) => {
                        stats.errors += 1;
                        stats.last_error = Some(e);
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if Instant::now() >= next_progress && !config.quiet {
                    let bytes = progress.load(std::sync::atomic::Ordering::Relaxed);
                    eprintln!(
                        "rsprof-bpf: debuginfod: {done} of {total} debug files after {:.0?}, {:.1} MiB \
                         received…",
                        began.elapsed(),
                        bytes as f64 / (1 << 20) as f64,
                    );
                    next_progress = Instant::now() + PROGRESS_EVERY;
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    if done < total {
        let left = (total - done) as u64;
        stats.errors += left;
        stats.over_budget += left;
        stats.last_error =
            Some(format!("{left} debug files not fetched within the {:?} budget", config.budget));
    }
    found
}

fn valid_id(id: &str) -> bool {
    id.len() >= 2 && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

/// `<cache>/<hex>/debuginfo`, elfutils' layout.
pub fn cache_path(cache: &Path, id: &str) -> PathBuf {
    cache.join(id).join("debuginfo")
}

/// How long a negative result is believed: `<cache>/cache_miss_s`, as elfutils reads it.
fn cache_miss(cache: &Path) -> Duration {
    std::fs::read_to_string(cache.join("cache_miss_s"))
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map_or(DEFAULT_CACHE_MISS, Duration::from_secs)
}

/// The build-id of the ELF file at `path`, lower-case hex.
pub fn file_build_id(path: &Path) -> Option<String> {
    let file = std::fs::File::open(path).ok()?;
    // SAFETY: a read-only private mapping of a file in our cache; a file truncated meanwhile
    // faults only this read.
    let data = unsafe { memmap2::Mmap::map(&file) }.ok()?;
    let id = profiler_unwind::debug_links(&data).ok()?.build_id?;
    Some(id.iter().map(|b| format!("{b:02x}")).collect())
}

/// Asks each server in turn for `id`'s debug file, until one has it.
fn fetch(
    agent: &ureq::Agent,
    config: &Config,
    id: &str,
    deadline: Instant,
    progress: &std::sync::atomic::AtomicU64,
) -> Outcome {
    let mut last = Outcome::NotFound;
    for url in &config.urls {
        if Instant::now() >= deadline {
            return Outcome::Failed("budget spent".into());
        }
        last = fetch_from(agent, config, url, id, deadline, progress);
        if !matches!(last, Outcome::NotFound | Outcome::Failed(_)) {
            return last;
        }
    }
    if matches!(last, Outcome::NotFound) {
        write_negative(&config.cache, id);
    }
    last
}

fn fetch_from(
    agent: &ureq::Agent,
    config: &Config,
    url: &str,
    id: &str,
    deadline: Instant,
    progress: &std::sync::atomic::AtomicU64,
) -> Outcome {
    let at = format!("{url}/buildid/{id}/debuginfo");
    // Never past the export's budget.
    let timeout = config.timeout.min(deadline.saturating_duration_since(Instant::now()));
    let resp = match agent.get(&at).config().timeout_global(Some(timeout)).build().call() {
        Ok(r) => r,
        Err(e) if Instant::now() >= deadline => {
            return Outcome::Failed(format!("{at}: {e} (at the end of the budget)"));
        }
        Err(e) => return Outcome::Failed(format!("{at}: {e}")),
    };
    match resp.status().as_u16() {
        200 => {}
        404 => return Outcome::NotFound,
        s => return Outcome::Failed(format!("{at}: HTTP {s}")),
    }
    let dir = config.cache.join(id);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        return Outcome::Failed(format!("{}: {e}", dir.display()));
    }
    let tmp = dir.join(format!(
        ".debuginfo.{}.{:?}.tmp",
        std::process::id(),
        std::thread::current().id()
    ));
    let written = (|| -> Result<u64, String> {
        let mut out = std::fs::File::create(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
        let mut body = resp.into_body();
        let mut reader = body.with_config().limit(MAX_FILE_BYTES).reader();
        let mut buf = vec![0u8; 256 << 10];
        let mut n = 0u64;
        loop {
            let got = reader.read(&mut buf).map_err(|e| format!("{at}: {e}"))?;
            if got == 0 {
                break;
            }
            out.write_all(&buf[..got]).map_err(|e| format!("{}: {e}", tmp.display()))?;
            n += got as u64;
            progress.fetch_add(got as u64, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(n)
    })();
    let bytes = match written {
        Ok(n) => n,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Outcome::Failed(e);
        }
    };
    // A server may answer with anything: only an ELF file of this build-id is kept.
    match file_build_id(&tmp) {
        Some(got) if got == id => {}
        got => {
            let _ = std::fs::remove_file(&tmp);
            let what = got.map_or("not an ELF file with a build-id".into(), |g| {
                format!("an ELF file of build-id {g}")
            });
            return Outcome::Failed(format!("{at}: answered {what}"));
        }
    }
    let path = cache_path(&config.cache, id);
    if let Err(e) = std::fs::rename(&tmp, &path) {
        let _ = std::fs::remove_file(&tmp);
        return Outcome::Failed(format!("{}: {e}", path.display()));
    }
    Outcome::Fetched(path, bytes)
}

/// An empty `<cache>/<hex>/debuginfo`, mode 0: elfutils' negative result.
fn write_negative(cache: &Path, id: &str) {
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = cache_path(cache, id);
    if std::fs::create_dir_all(path.parent().unwrap_or(cache)).is_ok() {
        let _ = std::fs::File::options().write(true).create_new(true).mode(0o000).open(&path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_split_as_elfutils_splits_them() {
        let c = Config::with_urls(
            "http://a:1/  https://b/x/\n\thttp://c".split_whitespace().map(str::to_owned).collect(),
        )
        .unwrap();
        assert_eq!(c.urls, ["http://a:1", "https://b/x", "http://c"]);
        assert!(Config::with_urls(vec![" ".into()]).is_none());
        assert!(!valid_id("../x"));
        assert!(valid_id("ab12"));
    }

    /// A negative result in the cache answers without a request (the server's URL is not
    /// even reachable); once older than `cache_miss_s`, it is forgotten and the server asked.
    #[test]
    fn negative_results_are_cached_then_expire() {
        let dir = super::super::cache::tests::TempDir::new("debuginfod-negative");
        let config = Config {
            // A closed port on loopback: a request fails at once.
            urls: vec!["http://127.0.0.1:9".into()],
            cache: dir.path().to_owned(),
            timeout: Duration::from_secs(2),
            budget: Duration::from_secs(5),
            quiet: false,
        };
        let id = "00112233445566778899aabbccddeeff00112233".to_owned();
        write_negative(&config.cache, &id);
        let mut stats = Stats::default();
        assert!(debug_files(&config, std::slice::from_ref(&id), &mut stats).is_empty());
        assert_eq!((stats.not_found, stats.errors), (1, 0), "{stats:?}");
        std::fs::write(dir.path().join("cache_miss_s"), "0\n").unwrap();
        std::thread::sleep(Duration::from_millis(1100));
        let mut stats = Stats::default();
        assert!(debug_files(&config, std::slice::from_ref(&id), &mut stats).is_empty());
        assert_eq!((stats.not_found, stats.errors), (0, 1), "{stats:?}");
        assert!(stats.last_error.unwrap().contains("127.0.0.1:9"));
    }
}
