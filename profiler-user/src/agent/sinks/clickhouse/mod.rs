//! ClickHouse: the sink (`--clickhouse URL`, `sink`), the reading side of `query --clickhouse`
//! (`read`) and the names `query` stores (`names`); here the client and the schema they share.
//!
//! Schema (created if missing, in the URL's database), one row per thing:
//! * `rsprof_stacks`: each distinct stack once per day, by `stack_hash` (`rows::stack_hash`,
//!   the same on every host), frames root → leaf as parallel arrays (function, module, file,
//!   line, column, inlined). Day partitions let retention drop old stacks with old samples.
//! * `rsprof_samples`: one row per (window, thread, stack) with the window's labels, sample
//!   count, CPU and off-CPU ns. A window is a service's (`agent::labels`): its rows' `pid` and
//!   `process` are the thread's process, while `rsprof_windows` has 0 and '' there. Tables
//!   written by agents that wrote a window per process have the same columns with the same
//!   values in both tables, so they read back unchanged (no migration). The sort key still
//!   names a row by (window, tid, thread name, stack): two processes of a service reusing one
//!   tid under the same thread name in one window would collapse into one row when parts merge
//!   (pid reuse within a window; rare, and changing the key needs new tables). `ORDER BY (service_name, host, window_start, …)` makes "service
//!   X, hosts Y, time range Z" a range scan of the primary key; `PARTITION BY` day.
//! * `rsprof_windows`: one row per window, written last: the commit record.
//! * `rsprof_names`: frames agents left unnamed (stripped files; `rsprof_stacks` keeps their
//!   file's build-id and ELF address in `build_ids`/`addrs`), as `query` named them from debug
//!   files, per (build-id, address): a fleet's queries name each address once. Written by
//!   `query`; added to older databases (and the two `rsprof_stacks` columns) when missing.
//!
//! Exactly once, although the forwarder may deliver a window again (a crash or a lost answer
//! after the server stored it): delivery first looks the window up in `rsprof_windows` and
//! skips it when present; a delivery interrupted before its commit record leaves rows the
//! retry inserts again, so every table is a `ReplacingMergeTree` whose sort key identifies a
//! row (window id, thread, stack), making duplicates collapse when parts merge. Until they do,
//! reads deduplicate themselves: `FINAL` on samples and windows, `GROUP BY stack_hash` on
//! stacks, and only samples of windows that have their commit record are read, so a window
//! whose delivery never completed is not shown half.
//!
//! Compatibility: Debian 12's ClickHouse 18.16 and current releases. Only what both have is
//! used: `MergeTree`-family `ReplacingMergeTree()` with `PARTITION BY`/`ORDER BY`, `DateTime`
//! (seconds; window times in ms are `UInt64` columns), `Array(String)`/`Array(UInt32)`,
//! `FINAL`, `any`, `toYYYYMMDD`, `toDateTime`, `substring`, `today`, `system.parts`,
//! `ALTER TABLE … DROP PARTITION`, the HTTP interface with `FORMAT JSONEachRow` (64-bit
//! integers may come back quoted) and, for the millions of sample rows a fleet query reads,
//! `FORMAT RowBinary`. Retention: a table `TTL` where the server has it
//! (`version()` ≥ 19.6); on older servers the agent drops day partitions older than the
//! retention itself, at most once an hour.

use std::{
    collections::{HashMap, HashSet},
    fmt::Write as _,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};
use serde::{Deserialize, Deserializer, Serialize};

use crate::{
    agent::{
        labels::WindowLabels,
        query::Selection,
        rows::{self, Stacks, WindowRows},
        sinks::{RemoteSink, SinkError},
        spool::WindowMeta,
    },
    model::stacks::{ElfAddress, Frame},
};

pub const DEFAULT_RETENTION_DAYS: u32 = 30;
/// How often partitions are dropped on servers without TTL.
const RETENTION_EVERY: Duration = Duration::from_secs(3600);
/// Longest window the agent writes (`--window` ≤ 3600 s): reads look back this far before
/// `--from` for windows that started earlier and end in range.
const MAX_WINDOW_SECS: u64 = 3600;

/// ClickHouse exception codes that say the data or the table does not fit (not a transient
/// server state): CANNOT_PARSE_TEXT (6), NO_SUCH_COLUMN_IN_TABLE (16), CANNOT_PARSE_QUOTED_STRING
/// (26), CANNOT_PARSE_INPUT_ASSERTION_FAILED (27), CANNOT_READ_ALL_DATA (33), CANNOT_PARSE_DATE
/// (38), CANNOT_PARSE_DATETIME (41), ILLEGAL_COLUMN (44), TYPE_MISMATCH (53), ARGUMENT_OUT_OF_BOUND
/// (69), CANNOT_PARSE_NUMBER (72), INCORRECT_DATA (117), TOO_LARGE_STRING_SIZE (131),
/// THERE_IS_NO_COLUMN (8).
const DATA_ERRORS: &[u32] = &[6, 8, 16, 26, 27, 33, 38, 41, 44, 53, 69, 72, 117, 131];
/// UNKNOWN_TABLE: someone dropped a table; recreate the schema and retry.
const UNKNOWN_TABLE: u32 = 60;

/// An HTTP client for one server and database.
pub struct Client {
    /// Without the query string.
    base: String,
    /// The URL's own parameters (`database`, `user`, …), sent with every request.
    params: Vec<(String, String)>,
    agent: ureq::Agent,
}

/// A failed request, classified.
enum Failure {
    /// Not reachable, timed out, or a server error that may pass.
    Transient(anyhow::Error),
    /// The server refused the request for what it contains.
    Refused { code: Option<u32>, message: anyhow::Error },
}

impl Failure {
    fn into_sink_error(self) -> SinkError {
        match self {
            Self::Transient(e) => SinkError::Retry(e),
            Self::Refused { code: Some(UNKNOWN_TABLE), message } => SinkError::Retry(message),
            Self::Refused { message, .. } => SinkError::Reject(message),
        }
    }

    fn into_error(self) -> anyhow::Error {
        match self {
            Self::Transient(e) | Self::Refused { message: e, .. } => e,
        }
    }
}

/// The `Code: N` ClickHouse starts its exception texts with.
fn exception_code(body: &str) -> Option<u32> {
    let rest = &body[body.find("Code: ")? + 6..];
    rest[..rest.find(|c: char| !c.is_ascii_digit())?].parse().ok()
}

impl Client {
    pub fn new(url: &str, timeout: Duration) -> Result<Self> {
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            bail!("invalid ClickHouse URL '{url}': must start with http:// or https://");
        }
        let params = (query.split('&').filter(|p| !p.is_empty()))
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                (k.to_owned(), v.to_owned())
            })
            .collect();
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(timeout))
            .build()
            .into();
        Ok(Self { base: base.trim_end_matches('/').to_owned() + "/", params, agent })
    }

    /// Runs `sql`, with `data` as the body of an `INSERT … FORMAT` when given; returns the
    /// response body.
    fn run(&self, sql: &str, data: Option<&[u8]>) -> Result<String, Failure> {
        let body = self.run_bytes(sql, data)?;
        String::from_utf8(body)
            .map_err(|_| Failure::Transient(anyhow!("ClickHouse's answer is not UTF-8")))
    }

    /// `run`, the answer as bytes (binary formats).
    fn run_bytes(&self, sql: &str, data: Option<&[u8]>) -> Result<Vec<u8>, Failure> {
        (self.send(sql, data)?.into_with_config().limit(u64::MAX).read_to_vec())
            .map_err(|e| Failure::Transient(anyhow!("reading ClickHouse's answer: {e}")))
    }

    /// Runs a query whose answer is read as it arrives (parsed while the server still sends).
    fn run_reader(&self, sql: &str) -> Result<ureq::BodyReader<'static>, Failure> {
        Ok(self.send(sql, None)?.into_with_config().limit(u64::MAX).reader())
    }

    /// Sends a request; the body of a successful answer, or the failure with the server's
    /// message.
    fn send(&self, sql: &str, data: Option<&[u8]>) -> Result<ureq::Body, Failure> {
        let mut req = self.agent.post(&self.base);
        for (k, v) in &self.params {
            req = req.query(k, v);
        }
        let sent = match data {
            Some(d) => req.query("query", sql).send(d),
            None => req.send(sql.as_bytes()),
        };
        let resp = sent.map_err(|e| {
            Failure::Transient(anyhow!("ClickHouse at {} unreachable: {e}", self.base))
        })?;
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        if status == 200 {
            return Ok(body);
        }
        let body = (body.with_config().limit(u64::MAX).read_to_vec())
            .map_err(|e| Failure::Transient(anyhow!("reading ClickHouse's answer: {e}")))?;
        let body = String::from_utf8_lossy(&body);
        let code = exception_code(&body);
        let message = anyhow!(
            "ClickHouse HTTP {status}: {}",
            body.trim().lines().next().unwrap_or("(no message)")
        );
        let refused = match status {
            429 => false,
            400..=499 => true,
            _ => code.is_some_and(|c| DATA_ERRORS.contains(&c)),
        };
        Err(if refused { Failure::Refused { code, message } } else { Failure::Transient(message) })
    }

    /// Runs a query, an error carrying the server's message.
    pub fn query(&self, sql: &str) -> Result<String> {
        self.run(sql, None).map_err(Failure::into_error)
    }

    /// `(major, minor)` of `SELECT version()`.
    pub fn version(&self) -> Result<(u32, u32)> {
        let v = self.query("SELECT version()")?;
        let mut parts = v.trim().split('.').map(|p| p.parse::<u32>());
        match (parts.next(), parts.next()) {
            (Some(Ok(a)), Some(Ok(b))) => Ok((a, b)),
            _ => bail!("unexpected ClickHouse version '{}'", v.trim()),
        }
    }
}

/// A SQL string literal.
fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('\'');
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            _ => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// Columns every sample and window row carries: the window's labels.
const LABEL_COLUMNS: &str = "window_start DateTime,
    start_ms UInt64,
    end_ms UInt64,
    host String,
    service_name String,
    process String,
    pid UInt32,
    container_runtime String,
    container_id String,
    pod_uid String,
    pod_qos String,
    systemd_unit String,
    window_id String";

/// The tables, `TTL` clauses included when `ttl_days` is given.
fn schema(ttl_days: Option<u32>) -> [String; 3] {
    let ttl =
        |col: &str| ttl_days.map_or(String::new(), |d| format!(" TTL {col} + INTERVAL {d} DAY"));
    [
        format!(
            "CREATE TABLE IF NOT EXISTS rsprof_stacks (
    day DateTime,
    stack_hash UInt64,
    functions Array(String),
    modules Array(String),
    files Array(String),
    lines Array(UInt32),
    cols Array(UInt32),
    inlined Array(UInt8),
    build_ids Array(String),
    addrs Array(UInt64)
) ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMMDD(day) ORDER BY stack_hash{}",
            ttl("day")
        ),
        // thread_name is in the key: the idle tasks of every CPU share tid 0.
        format!(
            "CREATE TABLE IF NOT EXISTS rsprof_samples (
    {LABEL_COLUMNS},
    tid UInt32,
    thread_name String,
    stack_hash UInt64,
    samples UInt64,
    cpu_ns UInt64,
    off_cpu_ns UInt64
) ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMMDD(window_start)
ORDER BY (service_name, host, window_start, window_id, tid, thread_name, stack_hash){}",
            ttl("window_start")
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS rsprof_windows (
    {LABEL_COLUMNS},
    samples UInt64,
    sample_rows UInt64,
    period_ns UInt64
) ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMMDD(window_start)
ORDER BY (service_name, host, window_start, window_id){}",
            ttl("window_start")
        ),
    ]
}

const TABLES: [&str; 3] = ["rsprof_stacks", "rsprof_samples", "rsprof_windows"];

#[derive(Serialize, Deserialize)]
struct LabelRow {
    /// Seconds; only written (reads take the exact `start_ms`).
    #[serde(default, skip_deserializing)]
    window_start: u64,
    #[serde(deserialize_with = "u64_any")]
    start_ms: u64,
    #[serde(deserialize_with = "u64_any")]
    end_ms: u64,
    host: String,
    service_name: String,
    /// Written per row (`SampleRow`, `WindowRow`): a sample row's are its thread's process.
    #[serde(skip_serializing)]
    process: String,
    #[serde(skip_serializing)]
    pid: u32,
    container_runtime: String,
    container_id: String,
    pod_uid: String,
    pod_qos: String,
    systemd_unit: String,
    window_id: String,
}

impl LabelRow {
    fn of(m: &WindowMeta) -> Self {
        let l = &m.labels;
        let o = |v: &Option<String>| v.clone().unwrap_or_default();
        Self {
            window_start: m.start_ms / 1000,
            start_ms: m.start_ms,
            end_ms: m.end_ms,
            host: l.host.clone(),
            service_name: l.service_name.clone(),
            process: l.process.clone(),
            pid: l.pid,
            container_runtime: o(&l.container_runtime),
            container_id: o(&l.container_id),
            pod_uid: o(&l.pod_uid),
            pod_qos: o(&l.pod_qos),
            systemd_unit: o(&l.systemd_unit),
            window_id: m.window_id.clone(),
        }
    }

    fn meta(self, samples: u64) -> WindowMeta {
        let o = |v: String| Some(v).filter(|v| !v.is_empty());
        WindowMeta {
            window_id: self.window_id,
            start_ms: self.start_ms,
            end_ms: self.end_ms,
            samples,
            labels: WindowLabels {
                service_name: self.service_name,
                host: self.host,
                pid: self.pid,
                process: self.process,
                container_runtime: o(self.container_runtime),
                container_id: o(self.container_id),
                systemd_unit: o(self.systemd_unit),
                pod_uid: o(self.pod_uid),
                pod_qos: o(self.pod_qos),
            },
        }
    }
}

#[derive(Serialize)]
struct SampleRow<'a> {
    #[serde(flatten)]
    labels: &'a LabelRow,
    process: &'a str,
    pid: u32,
    tid: u32,
    thread_name: &'a str,
    stack_hash: u64,
    samples: u64,
    cpu_ns: u64,
    off_cpu_ns: u64,
}

impl<'a> SampleRow<'a> {
    /// The row of a thread's samples of one stack, with its window's labels.
    fn of(labels: &'a LabelRow, r: &'a rows::StackRow) -> Self {
        SampleRow {
            labels,
            process: &r.process,
            pid: r.pid,
            tid: r.tid,
            thread_name: &r.thread,
            stack_hash: r.stack,
            samples: r.samples,
            cpu_ns: r.cpu_ns,
            off_cpu_ns: r.off_cpu_ns,
        }
    }
}

#[derive(Serialize)]
struct WindowRow<'a> {
    #[serde(flatten)]
    labels: &'a LabelRow,
    process: &'a str,
    pid: u32,
    samples: u64,
    sample_rows: u64,
    period_ns: u64,
}

#[derive(Serialize, Deserialize)]
struct StackRow {
    #[serde(default)]
    #[serde(skip_deserializing)]
    day: u64,
    #[serde(deserialize_with = "u64_any")]
    stack_hash: u64,
    functions: Vec<String>,
    modules: Vec<String>,
    files: Vec<String>,
    lines: Vec<u32>,
    cols: Vec<u32>,
    inlined: Vec<u8>,
    /// Per frame: its file's build-id and its ELF address when it was left unnamed, else ''
    /// and 0 (both empty in tables of older agents).
    #[serde(default)]
    build_ids: Vec<String>,
    #[serde(default, deserialize_with = "vec_u64_any")]
    addrs: Vec<u64>,
}

/// The frame columns `rsprof_stacks` gained for unnamed frames, added to a table made before.
const ELF_COLUMNS: [(&str, &str); 2] = [("build_ids", "Array(String)"), ("addrs", "Array(UInt64)")];

/// The columns of `table` in the current database.
fn columns(client: &Client, table: &str) -> Result<HashSet<String>, Failure> {
    let sql = format!(
        "SELECT name FROM system.columns WHERE database = currentDatabase() AND table = {} \
         FORMAT TSV",
        quote(table)
    );
    Ok(client.run(&sql, None)?.lines().map(str::to_owned).collect())
}

/// Adds `ELF_COLUMNS` to an `rsprof_stacks` made by an older agent.
fn add_elf_columns(client: &Client) -> Result<(), Failure> {
    let have = columns(client, "rsprof_stacks")?;
    for (name, ty) in ELF_COLUMNS.iter().filter(|(n, _)| !have.contains(*n)) {
        client.run(&format!("ALTER TABLE rsprof_stacks ADD COLUMN {name} {ty}"), None)?;
    }
    Ok(())
}

impl StackRow {
    fn of(day: u64, stack_hash: u64, frames: &[Frame]) -> Self {
        Self {
            day,
            stack_hash,
            functions: frames.iter().map(|f| f.function.clone()).collect(),
            modules: frames.iter().map(|f| f.module.clone()).collect(),
            files: frames.iter().map(|f| f.file.clone().unwrap_or_default()).collect(),
            lines: frames.iter().map(|f| f.line.unwrap_or(0)).collect(),
            cols: frames.iter().map(|f| f.column.unwrap_or(0)).collect(),
            inlined: frames.iter().map(|f| u8::from(f.inlined)).collect(),
            build_ids: (frames.iter())
                .map(|f| f.elf.as_ref().map_or(String::new(), |e| e.build_id.clone()))
                .collect(),
            addrs: frames.iter().map(|f| f.elf.as_ref().map_or(0, |e| e.address)).collect(),
        }
    }

    fn frames(self) -> Vec<Frame> {
        let n = self.functions.len();
        let nz = |v: Option<&u32>| v.copied().filter(|&x| x > 0);
        (0..n)
            .map(|i| {
                let module = self.modules.get(i).cloned().unwrap_or_default();
                Frame {
                    kind: rows::kind_of(&module),
                    function: self.functions[i].clone(),
                    module,
                    file: self.files.get(i).cloned().filter(|f| !f.is_empty()),
                    line: nz(self.lines.get(i)),
                    column: nz(self.cols.get(i)),
                    inlined: self.inlined.get(i).is_some_and(|&x| x != 0),
                    elf: match (self.build_ids.get(i), self.addrs.get(i)) {
                        (Some(b), Some(&address)) if !b.is_empty() && address != 0 => {
                            Some(Box::new(ElfAddress { build_id: b.clone(), address }))
                        }
                        _ => None,
                    },
                }
            })
            .collect()
    }
}

/// ClickHouse's JSON output quotes 64-bit integers by default; accept both forms.
fn u64_any<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum N {
        Num(u64),
        Str(String),
    }
    match N::deserialize(d)? {
        N::Num(n) => Ok(n),
        N::Str(s) => s.parse().map_err(serde::de::Error::custom),
    }
}

/// `u64_any` for an array.
fn vec_u64_any<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
    #[derive(Deserialize)]
    struct N(#[serde(deserialize_with = "u64_any")] u64);
    Ok(Vec::<N>::deserialize(d)?.into_iter().map(|n| n.0).collect())
}

/// JSONEachRow: one JSON object per line (serde_json escapes quotes, backslashes and control
/// characters, newlines included).
fn json_lines<T: Serialize>(rows: impl IntoIterator<Item = T>) -> Vec<u8> {
    let mut out = Vec::new();
    for r in rows {
        serde_json::to_writer(&mut out, &r).expect("rows serialize");
        out.push(b'\n');
    }
    out
}

fn json_rows<T: for<'de> Deserialize<'de>>(text: &str) -> Result<Vec<T>> {
    (text.lines().filter(|l| !l.trim().is_empty()))
        .map(|l| serde_json::from_str(l).with_context(|| format!("bad row from ClickHouse: {l}")))
        .collect()
}

mod names;
mod read;
mod sink;

pub use names::{store_names, stored_names};
pub use read::read_windows;
pub use sink::{ClickHouseSink, ClickHouseStats};

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::{read::*, sink::*, *};
    use crate::writers::{
        Format,
        testdata::{self, IDLE, MAIN, S_HOT, S_LABEL, S_SYSCALL, S_WORK, WORKER, sample},
    };

    #[test]
    fn exception_codes_and_quoting() {
        assert_eq!(exception_code("Code: 117, e.displayText() = DB::Exception: x"), Some(117));
        assert_eq!(exception_code("no code"), None);
        assert_eq!(quote("a'b\\c\nd"), "'a\\'b\\\\c\nd'");
    }

    /// A spooled window: the writers' test recording as gzipped pprof, with `labels`.
    fn window(start_ms: u64, labels: WindowLabels) -> (WindowMeta, Vec<u8>) {
        let events = [
            (MAIN, sample(1, 1_000_000, Some(S_HOT))),
            (MAIN, sample(2, 1_000_000, Some(S_HOT))),
            (MAIN, sample(3, 2_000_000, Some(S_SYSCALL))),
            (WORKER, sample(4, 1_000_000, Some(S_WORK))),
            (WORKER, sample(5, 1_000_000, Some(S_LABEL))),
            (IDLE, sample(6, 1_000_000, None)),
        ];
        let pprof = testdata::write(Format::Pprof, &events);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&pprof).unwrap();
        let window_id = format!("{start_ms:013}-{}-{:08x}", labels.pid, labels.host.len());
        let meta =
            WindowMeta { window_id, start_ms, end_ms: start_ms + 10_000, samples: 6, labels };
        (meta, gz.finish().unwrap())
    }

    fn labels(host: &str, service: &str, process: &str, container: Option<&str>) -> WindowLabels {
        WindowLabels {
            service_name: service.into(),
            host: host.into(),
            pid: 100,
            process: process.into(),
            container_runtime: container.map(|_| "docker".into()),
            container_id: container.map(str::to_owned),
            ..Default::default()
        }
    }

    fn server() -> ::tests::clickhouse::Server {
        ::tests::clickhouse::Server::start().unwrap_or_else(|e| panic!("{e:#}"))
    }

    fn now_ms() -> u64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()
            as u64
    }

    fn all() -> Selection {
        Selection { to_ms: u64::MAX, ..Default::default() }
    }

    /// The rows of a window as decoded from its pprof, in a comparable order.
    fn sorted(mut rows: Vec<rows::StackRow>) -> Vec<rows::StackRow> {
        rows.sort_by(|a, b| (a.tid, &a.thread, a.stack).cmp(&(b.tid, &b.thread, b.stack)));
        rows
    }

    #[test]
    fn clickhouse_sink_round_trip_is_exact_and_escapes_names() {
        let server = server();
        let mut sink = ClickHouseSink::new(&server.url(), 30).unwrap();
        let t = now_ms() - 60_000;
        // Quotes, a newline, a backslash, a tab, a control character, and what a non-UTF-8
        // comm becomes (U+FFFD), in every label that is a string.
        let odd = "we'ird \"name\"\nline2\\x\tq\u{1}\u{fffd}\u{1f600}";
        let (meta, gz) = window(t, labels(odd, odd, odd, Some(odd)));
        sink.deliver(&meta, &gz).unwrap_or_else(|e| panic!("{e}\n{}", server.log()));
        assert_eq!(sink.stats.inserted, 1);

        let (windows, stacks) = read_windows(&server.url(), &all()).unwrap();
        assert_eq!(windows.len(), 1);
        let got = &windows[0];
        assert_eq!(got.meta.labels, meta.labels, "labels come back byte for byte");
        assert_eq!((got.meta.start_ms, got.meta.end_ms), (meta.start_ms, meta.end_ms));
        assert_eq!(got.meta.window_id, meta.window_id);
        let mut want_stacks = Stacks::new();
        let want =
            rows::from_pprof(meta.clone(), &rows::read_pprof_gz(&gz).unwrap(), &mut want_stacks)
                .unwrap();
        assert_eq!(sorted(got.rows.clone()), sorted(want.rows.clone()));
        assert_eq!(got.period_ns, want.period_ns);
        assert_eq!(stacks, want_stacks, "frames (names, modules, file:line, inlining) kept");
        assert!(stacks.values().any(|f| f.iter().any(|f| f.function == "a;b")));
        assert!(stacks.values().any(|f| f.iter().any(|f| f.inlined && f.function == "inl")));
        // Idle CPUs share tid 0: their rows stay apart by thread name.
        assert!(got.rows.iter().any(|r| r.tid == 0));
    }

    #[test]
    fn clickhouse_sink_redelivery_and_partial_insert_leave_no_duplicates() {
        let server = server();
        let url = server.url();
        let mut sink = ClickHouseSink::new(&url, 30).unwrap();
        let t = now_ms() - 60_000;
        let (meta, gz) = window(t, labels("h1", "svc", "app", None));
        let mut stacks = Stacks::new();
        let w = rows::from_pprof(meta.clone(), &rows::read_pprof_gz(&gz).unwrap(), &mut stacks)
            .unwrap();
        let n = w.rows.len();

        // A crash after the rows were inserted, before the commit record: rows without it.
        let client = Client::new(&url, Duration::from_secs(30)).unwrap();
        sink.ensure_schema().map_err(Failure::into_error).unwrap();
        let row_labels = LabelRow::of(&meta);
        let samples = w.rows.iter().map(|r| SampleRow::of(&row_labels, r));
        let body = json_lines(samples);
        client.run("INSERT INTO rsprof_samples FORMAT JSONEachRow", Some(&body)).ok().unwrap();
        let (windows, _) = read_windows(&url, &all()).unwrap();
        assert!(windows.is_empty(), "a window without its commit record is not shown");

        // The forwarder retries: the window is inserted whole, its rows a second time.
        sink.deliver(&meta, &gz).unwrap();
        // And once more, as after a crash between the insert and the spool's delivery record.
        sink.deliver(&meta, &gz).unwrap();
        assert_eq!((sink.stats.inserted, sink.stats.already_stored), (1, 1));
        let raw: usize =
            server.query("SELECT count() FROM rsprof_samples").unwrap().trim().parse().unwrap();
        assert_eq!(raw, 2 * n, "the partial insert's rows are stored twice (not merged yet)");
        let (windows, _) = read_windows(&url, &all()).unwrap();
        assert_eq!(windows.len(), 1);
        assert_eq!(sorted(windows[0].rows.clone()), sorted(w.rows.clone()), "read once each");
        // After merging, the table itself holds them once.
        server.query("OPTIMIZE TABLE rsprof_samples FINAL").unwrap();
        let count = |table: &str| -> usize {
            server.query(&format!("SELECT count() FROM {table}")).unwrap().trim().parse().unwrap()
        };
        assert_eq!(count("rsprof_samples"), n);

        // A batch: the window above (stored), a window delivered alone, and two whose batch
        // was interrupted after its samples insert, before the commit records.
        let a = window(t + 10_000, labels("h2", "svc", "app", None));
        sink.deliver(&a.0, &a.1).unwrap();
        let (b, c) = (
            window(t, labels("h3", "svc", "app", None)),
            window(t, labels("h4", "db", "pg", None)),
        );
        let partial: Vec<u8> = [&b, &c]
            .iter()
            .flat_map(|(m, _)| {
                let labels = LabelRow::of(m);
                json_lines(w.rows.iter().map(|r| SampleRow::of(&labels, r)))
            })
            .collect();
        client.run("INSERT INTO rsprof_samples FORMAT JSONEachRow", Some(&partial)).ok().unwrap();
        assert_eq!(read_windows(&url, &all()).unwrap().0.len(), 2, "b and c not shown yet");
        let batch = vec![(meta.clone(), gz.clone()), a.clone(), b.clone(), c.clone()];
        let before = sink.stats;
        let results = sink.deliver_batch(&batch);
        assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
        assert_eq!(sink.stats.inserted - before.inserted, 2, "b and c inserted");
        assert_eq!(sink.stats.already_stored - before.already_stored, 2, "the first two skipped");
        // The batch again, as after a crash before the spool recorded its delivery.
        let results = sink.deliver_batch(&batch);
        assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
        assert_eq!(sink.stats.inserted - before.inserted, 2);
        assert_eq!(sink.stats.already_stored - before.already_stored, 6);
        assert_eq!(count("rsprof_samples"), 4 * n + 2 * n, "b's and c's rows twice until merged");
        assert_eq!(count("rsprof_windows"), 4, "one commit record each");
        let (windows, _) = read_windows(&url, &all()).unwrap();
        let mut hosts: Vec<&str> = windows.iter().map(|w| w.meta.labels.host.as_str()).collect();
        hosts.sort_unstable();
        assert_eq!(hosts, ["h1", "h2", "h3", "h4"]);
        // The same rows but for the process, each window's own (per-process windows).
        let whose = |rows: &[rows::StackRow]| {
            sorted(
                rows.iter()
                    .map(|r| rows::StackRow { process: String::new(), ..r.clone() })
                    .collect(),
            )
        };
        for got in &windows {
            assert_eq!(whose(&got.rows), whose(&w.rows), "{}", got.meta.labels.host);
        }
        server.query("OPTIMIZE TABLE rsprof_samples FINAL").unwrap();
        assert_eq!(count("rsprof_samples"), 4 * n);

        // A window that does not decode is rejected alone; the rest of its batch goes in.
        let d = window(t + 20_000, labels("h5", "svc", "app", None));
        let e = window(t + 20_000, labels("h6", "svc", "app", None));
        let results = sink.deliver_batch(&[d.clone(), (e.0.clone(), b"not gzip".to_vec()), b]);
        assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
        assert!(matches!(results[1], Err(SinkError::Reject(_))), "{results:?}");
        let (windows, _) = read_windows(&url, &all()).unwrap();
        assert_eq!(windows.len(), 5, "d added, e rejected");
    }

    #[test]
    fn clickhouse_filters_select_the_right_windows() {
        let server = server();
        let url = server.url();
        let mut sink = ClickHouseSink::new(&url, 30).unwrap();
        let t = now_ms() - 3_600_000;
        let specs = [
            ("a", "web", "nginx", Some("3f2a9c1b0d4e"), 0),
            ("b", "web", "nginx", Some("77aa00ff0011"), 0),
            ("a", "db", "postgres", None, 0),
            ("a", "web", "nginx", Some("3f2a9c1b0d4e"), 600_000),
        ];
        for (host, service, process, container, dt) in specs {
            let (meta, gz) = window(t + dt, labels(host, service, process, container));
            sink.deliver(&meta, &gz).unwrap();
        }
        let pick = |sel: Selection| -> Vec<(String, String, u64)> {
            let (w, _) = read_windows(&url, &sel).unwrap();
            // Each with its own rows (windows "a web" and "a db" share a window id here).
            let rows = |w: &WindowRows| w.rows.iter().map(|r| r.samples).sum::<u64>();
            assert!(w.iter().all(|w| rows(w) == 6), "{:?}", w.iter().map(rows).collect::<Vec<_>>());
            w.into_iter()
                .map(|w| (w.meta.labels.host, w.meta.labels.service_name, w.meta.start_ms - t))
                .collect()
        };
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let row = |h: &str, sv: &str, dt: u64| (h.to_owned(), sv.to_owned(), dt);
        assert_eq!(pick(all()).len(), 4);
        assert_eq!(pick(Selection { hosts: s(&["b"]), ..all() }), vec![row("b", "web", 0)]);
        assert_eq!(pick(Selection { services: s(&["db"]), ..all() }), vec![row("a", "db", 0)]);
        assert_eq!(
            pick(Selection { processes: s(&["nginx"]), hosts: s(&["a"]), ..all() }),
            vec![row("a", "web", 0), row("a", "web", 600_000)]
        );
        // A container id prefix.
        assert_eq!(pick(Selection { containers: s(&["77aa"]), ..all() }), vec![row("b", "web", 0)]);
        // Time: windows ending after `from` and starting before `to`.
        assert_eq!(
            pick(Selection { from_ms: t + 300_000, ..all() }),
            vec![row("a", "web", 600_000)]
        );
        assert_eq!(pick(Selection { from_ms: t + 5_000, to_ms: t + 6_000, ..all() }).len(), 3);
        assert!(pick(Selection { hosts: s(&["c"]), ..all() }).is_empty());

        // A per-service window: no process of its own, its rows have theirs (the sample
        // labels): `app` (5 samples) and the idle tasks (1).
        let (meta, gz) = window(t, WindowLabels { pid: 0, ..labels("c", "svc", "", None) });
        sink.deliver(&meta, &gz).unwrap();
        let c = |sel: Selection| {
            let (w, _) = read_windows(&url, &Selection { hosts: s(&["c"]), ..sel }).unwrap();
            let procs: Vec<(u32, String, u64)> = (w.iter().flat_map(|w| &w.rows))
                .map(|r| (r.pid, r.process.clone(), r.samples))
                .collect();
            (w.len(), procs.iter().map(|p| p.2).sum::<u64>(), procs)
        };
        assert_eq!(c(all()).1, 6);
        let (n, samples, procs) = c(Selection { processes: s(&["app"]), ..all() });
        assert_eq!((n, samples), (1, 5), "{procs:?}");
        assert!(procs.iter().all(|p| p.0 == testdata::APP.0 && p.1 == "app"), "{procs:?}");
        assert_eq!(c(Selection { pids: vec![testdata::APP.0], ..all() }).1, 5);
        assert_eq!(c(Selection { processes: s(&["none"]), ..all() }).0, 0);
    }

    #[test]
    fn clickhouse_errors_retry_when_down_and_reject_bad_data() {
        let mut server = server();
        let url = server.url();
        let (meta, gz) = window(now_ms() - 60_000, labels("h", "s", "p", None));
        // A table of another shape (an operator's, or an incompatible version): ClickHouse
        // refuses the rows, with its message, and that is not retried.
        server.query("CREATE DATABASE other").unwrap();
        server
            .query("CREATE TABLE other.rsprof_samples (x UInt8) ENGINE = MergeTree() ORDER BY x")
            .unwrap();
        let mut sink = ClickHouseSink::new(&format!("{url}?database=other"), 30).unwrap();
        match sink.deliver(&meta, &gz) {
            Err(SinkError::Reject(e)) => {
                let e = format!("{e:#}");
                assert!(e.contains("Code: ") && e.contains("ClickHouse HTTP"), "{e}");
            }
            other => panic!("want a rejection, got {other:?}"),
        }
        // A corrupt spool file is rejected before reaching the server.
        assert!(matches!(sink.deliver(&meta, b"not gzip"), Err(SinkError::Reject(_))));

        let mut sink = ClickHouseSink::new(&url, 30).unwrap();
        server.kill();
        match sink.deliver(&meta, &gz) {
            Err(SinkError::Retry(e)) => assert!(format!("{e:#}").contains("unreachable"), "{e:#}"),
            other => panic!("want a retry while the server is down, got {other:?}"),
        }
        server.resume().unwrap();
        sink.deliver(&meta, &gz).unwrap();
        // Tables dropped behind the agent's back are created again (after one retry).
        server.query("DROP TABLE rsprof_windows").unwrap();
        server.query("DROP TABLE rsprof_stacks").unwrap();
        let (meta2, gz2) = window(now_ms() - 30_000, labels("h", "s", "p", None));
        assert!(matches!(sink.deliver(&meta2, &gz2), Err(SinkError::Retry(_))));
        sink.deliver(&meta2, &gz2).unwrap();
        let (windows, stacks) = read_windows(&url, &all()).unwrap();
        assert_eq!(windows.len(), 1);
        // The stacks the sink had sent before are sent again to the new table.
        let used: HashSet<u64> =
            windows[0].rows.iter().map(|r| r.stack).filter(|&h| h != 0).collect();
        assert!(!used.is_empty() && used.iter().all(|h| stacks.contains_key(h)));
    }

    #[test]
    fn clickhouse_retention_without_ttl_drops_old_days() {
        let server = server();
        let url = server.url();
        let version = Client::new(&url, Duration::from_secs(30)).unwrap().version().unwrap();
        let mut sink = ClickHouseSink::new(&url, 7).unwrap();
        let day = 86_400_000;
        let (old, gz_old) = window(now_ms() - 20 * day, labels("h", "s", "p", None));
        sink.deliver(&old, &gz_old).unwrap();
        let (new, gz_new) = window(now_ms() - 60_000, labels("h", "s", "p", None));
        sink.last_retention = None;
        sink.deliver(&new, &gz_new).unwrap();
        let (windows, _) = read_windows(&url, &all()).unwrap();
        if version >= (19, 6) {
            // TTL: the server deletes when it merges; the agent does not.
            assert_eq!(sink.stats.partitions_dropped, 0);
        } else {
            assert_eq!(sink.stats.partitions_dropped, 3, "one old day in each table");
            assert_eq!(windows.len(), 1, "only the recent window is left");
            assert_eq!(windows[0].meta.window_id, new.window_id);
        }
    }
}
