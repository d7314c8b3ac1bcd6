//! The agent's Prometheus metrics, served at `http://ADDR/metrics` (OpenMetrics text, which
//! Prometheus negotiates) by a small HTTP responder on the agent's tokio runtime.
//!
//! Nothing is updated per sample. What the recording loop knows (kernel counters from THE
//! counters table, ring fill, BPF run times, tracked processes, the sample store) is read
//! when a scrape asks for it (`session::Request::Stats`, answered between drains); what the
//! writer thread and the sinks do is counted per window or per push in atomics
//! ([`WindowMetrics`], [`SpoolMetrics`]); remote sinks' push counters are their forwarders',
//! read on scrape too.
//!
//! Every series carries a `host` label: the agent listens on loopback, so whatever scrapes
//! it runs on the same host and its `instance` label would not tell hosts apart.

use std::{
    borrow::Cow,
    collections::HashSet,
    fmt::Write as _,
    sync::{Arc, Mutex},
    time::Duration,
};

use prometheus_client::{
    collector::Collector,
    encoding::{
        DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, EncodeLabelSet, EncodeMetric,
        NoLabelSet, text,
    },
    metrics::{
        MetricType,
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::{ConstGauge, Gauge},
        histogram::{Histogram, exponential_buckets},
        info::Info,
    },
    registry::{Registry, Unit},
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    sync::{mpsc, oneshot},
};

use crate::{
    agent::sinks::forward::{LATENCY_BUCKETS, Queue, SinkStats},
    session::{LiveStats, Request},
    system::procfs,
};

/// Loopback only: metrics show what runs on the host. 9749 is not in Prometheus's list of
/// default exporter ports.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9749";
/// Distinct `service` label values counted per agent; later ones share `service="other"`, so
/// a host with many short-lived process names cannot grow the series without bound.
pub const MAX_SERVICES: usize = 256;
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// A scrape waits at most this long for the recording loop, which answers between drains.
const LIVE_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServiceLabel {
    service: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
}

/// Windows made by the writer thread.
/// Declares a metrics struct from one table, one row per series: field, type and initial
/// value, the series' name (after the `rsprof_` prefix) and unit, and its help text.
/// `register` adds every row to a registry, so a metric cannot be declared and left out.
macro_rules! metrics_table {
    ($(#[$m:meta])* pub struct $name:ident {
        $($field:ident: $ty:ty = $init:expr => $series:literal $(in $unit:ident)?, $help:literal;)*
    }) => {
        $(#[$m])*
        pub struct $name {
            $(pub $field: $ty,)*
        }

        impl $name {
            fn new() -> Self {
                Self { $($field: $init,)* }
            }

            fn register(&self, r: &mut Registry) {
                $(metrics_table!(@one r, $series, $help, self.$field.clone() $(, $unit)?);)*
            }
        }
    };
    (@one $r:ident, $series:literal, $help:literal, $m:expr) => {
        $r.register($series, $help, $m)
    };
    (@one $r:ident, $series:literal, $help:literal, $m:expr, $unit:ident) => {
        $r.register_with_unit($series, $help, Unit::$unit, $m)
    };
}

metrics_table! {
    /// What the writer thread does, per window.
    pub struct WindowMetrics {
        produced: Counter = Counter::default()
            => "windows", "Windows made (one profile per service each)";
        profiles: Counter = Counter::default()
            => "window_profiles", "Profiles written for windows";
        dropped: Counter = Counter::default()
            => "windows_dropped", "Windows dropped: the writer thread was behind";
        events_lost: Counter = Counter::default()
            => "window_events_lost",
            "Events recycled in the sample store before their window was read";
        failed: Counter = Counter::default()
            => "windows_failed", "Windows that could not be written";
        // 10 ms to ~40 s.
        write_seconds: Histogram = Histogram::new(exponential_buckets(0.01, 2.0, 13))
            => "window_write" in Seconds, "Time to symbolize and spool a window";
        symbol_lookups: Counter = Counter::default()
            => "symbol_lookups", "Frame addresses the symbolizer was asked to name";
        symbol_cache_hits: Counter = Counter::default()
            => "symbol_cache_hits", "Frame addresses the symbolizer had named in an earlier window";
        symbol_cache_entries: Gauge = Gauge::default()
            => "symbol_cache_entries", "Frame addresses the symbolizer holds named";
        symbol_cache_bytes: Gauge = Gauge::default()
            => "symbol_cache" in Bytes, "Estimated heap bytes of the names the symbolizer holds";
        symbol_cache_evictions: Counter = Counter::default()
            => "symbol_cache_evictions",
            "Named frame addresses evicted (least recently used) to keep the cache bounded";
        heap_in_use_bytes: Gauge = Gauge::default()
            => "heap_in_use" in Bytes, "Heap bytes malloc has handed out, after the last window's trim";
        heap_free_bytes: Gauge = Gauge::default()
            => "heap_free" in Bytes,
            "Heap bytes free inside malloc's arena but not handed back, after the last window's trim";
        symbol_files: Gauge = Gauge::default()
            => "symbol_files", "Files blazesym holds parsed for the symbolizer";
        symbol_file_evictions: Counter = Counter::default()
            => "symbol_file_evictions", "Files evicted from blazesym: released, changed, or past its bound";
        symbolizer_rebuilds: Counter = Counter::default()
            => "symbolizer_rebuilds", "Times blazesym's symbolizer was dropped and rebuilt empty";
        symbol_dwarf_reads: Counter = Counter::default()
            => "symbol_dwarf_reads",
            "Files whose DWARF was parsed to name a window's frames (parsed afresh each window, not held)";
        symbol_dwarf_copy_failures: Counter = Counter::default()
            => "symbol_dwarf_copy_failures",
            "Files with compressed DWARF that could not be copied uncompressed into the debug cache (held parsed instead)";
        // 1 ms to ~16 s.
        symbolize_seconds: Histogram = Histogram::new(exponential_buckets(0.001, 2.0, 14))
            => "window_symbolize" in Seconds, "Time to name a window's frames";
    }
}

metrics_table! {
    /// The spool, as the writer thread sees it.
    pub struct SpoolMetrics {
        bytes: Gauge = Gauge::default() => "spool" in Bytes, "Bytes held in the spool";
        windows: Gauge = Gauge::default() => "spool_windows", "Windows held in the spool";
        written_bytes: Counter = Counter::default()
            => "spool_written" in Bytes, "Bytes written to the spool";
        written: Counter = Counter::default()
            => "spool_windows_written", "Windows written to the spool";
        deleted: Counter = Counter::default()
            => "spool_windows_deleted", "Oldest windows deleted to stay within --spool-size";
        write_errors: Counter = Counter::default()
            => "spool_write_errors", "Spool writes that failed";
        incomplete_removed: Counter = Counter::default()
            => "spool_incomplete_removed", "Half-written windows of a killed run removed at start";
    }
}

/// Samples per service, the services bounded (`MAX_SERVICES`, then `other`) so a host with
/// many short-lived services cannot grow the series without bound.
#[derive(Default)]
pub struct ServiceSamples {
    samples: Family<ServiceLabel, Counter>,
    services: Mutex<HashSet<String>>,
}

impl ServiceSamples {
    pub fn add(&self, service: &str, n: u64) {
        let mut known = self.services.lock().unwrap_or_else(|e| e.into_inner());
        let service = if known.contains(service) || known.len() < MAX_SERVICES {
            known.insert(service.to_owned());
            service
        } else {
            "other"
        };
        self.samples.get_or_create(&ServiceLabel { service: service.to_owned() }).inc_by(n);
    }
}

struct SinkCollector {
    spool: Arc<Mutex<SinkStats>>,
    queue: Option<Arc<Queue>>,
}

impl std::fmt::Debug for SinkCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SinkCollector")
    }
}

impl Collector for SinkCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let spool = self.spool.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut sinks = vec![(spool, None)];
        if let Some(q) = &self.queue {
            sinks.extend(q.stats_and_backlog().into_iter().map(|(s, b)| (s, Some(b))));
        }
        let e = &mut enc;
        let help = "Pushes to sinks by outcome: ok, retry (failed, sent again later), reject \
                    (refused by the server, not sent again).";
        let mut m = e.encode_descriptor("sink_pushes", help, None, MetricType::Counter)?;
        for (s, _) in &sinks {
            let ok = s.delivered;
            for (outcome, n) in [("ok", ok), ("retry", s.retries), ("reject", s.rejected)] {
                ConstCounter::new(n)
                    .encode(m.encode_family(&[("sink", s.name), ("outcome", outcome)])?)?;
            }
        }
        let help = "Time of successful pushes to sinks.";
        let unit = Unit::Seconds;
        let mut m =
            e.encode_descriptor("sink_push_duration", help, Some(&unit), MetricType::Histogram)?;
        for (s, _) in &sinks {
            let h = &s.latency;
            let mut buckets: Vec<(f64, u64)> =
                LATENCY_BUCKETS.iter().copied().zip(h.counts.iter().copied()).collect();
            buckets.push((f64::INFINITY, h.counts[LATENCY_BUCKETS.len()]));
            m.encode_family(&[("sink", s.name)])?
                .encode_histogram::<NoLabelSet>(h.sum_secs, h.count, &buckets, None)?;
        }
        let help = "Windows a sink never had: deleted for --spool-size first, or unreadable.";
        let mut m = e.encode_descriptor("sink_windows_dropped", help, None, MetricType::Counter)?;
        for (s, _) in &sinks {
            ConstCounter::new(s.dropped).encode(m.encode_family(&[("sink", s.name)])?)?;
        }
        let help = "Windows spooled that a remote sink has yet to be sent.";
        let mut m = e.encode_descriptor("sink_backlog_windows", help, None, MetricType::Gauge)?;
        for (s, backlog) in &sinks {
            if let Some(b) = backlog {
                ConstGauge::new(*b as u64).encode(m.encode_family(&[("sink", s.name)])?)?;
            }
        }
        Ok(())
    }
}

/// The agent's metrics. Shared (`Arc`) by the HTTP responder, the writer thread and sinks.
pub struct AgentMetrics {
    registry: Registry,
    host: String,
    pub windows: Arc<WindowMetrics>,
    pub spool: Arc<SpoolMetrics>,
    pub services: Arc<ServiceSamples>,
    spool_sink: Arc<Mutex<SinkStats>>,
}

fn host_labels(host: &str) -> impl Iterator<Item = (Cow<'static, str>, Cow<'static, str>)> {
    std::iter::once((Cow::Borrowed("host"), Cow::Owned(host.to_owned())))
}

impl AgentMetrics {
    /// The symbolizer's counters since `seen` (its totals at the last window).
    pub fn symbolizer(
        &self,
        st: &crate::symbolize::ServiceStats,
        seen: &crate::symbolize::ServiceStats,
    ) {
        let mw = &self.windows;
        mw.symbol_lookups.inc_by(st.asked - seen.asked);
        mw.symbol_cache_hits.inc_by(st.cached - seen.cached);
        mw.symbol_cache_entries.set(st.entries as i64);
        mw.symbol_cache_bytes.set(st.bytes as i64);
        mw.symbol_cache_evictions.inc_by(st.evicted - seen.evicted);
        mw.symbol_files.set(st.files as i64);
        mw.symbol_file_evictions.inc_by(st.files_evicted - seen.files_evicted);
        mw.symbolizer_rebuilds.inc_by(st.rebuilds - seen.rebuilds);
        mw.symbol_dwarf_reads.inc_by(st.dwarf_reads - seen.dwarf_reads);
        mw.symbol_dwarf_copy_failures.inc_by(st.dwarf_copy_failures - seen.dwarf_copy_failures);
    }

    /// `queue`: the spool shared with the remote sinks' forwarders, whose counters are read on
    /// each scrape.
    pub fn new(host: &str, queue: Option<Arc<Queue>>) -> Arc<Self> {
        let windows = Arc::new(WindowMetrics::new());
        let spool = Arc::new(SpoolMetrics::new());
        let services = Arc::new(ServiceSamples::default());
        let spool_sink = Arc::new(Mutex::new(SinkStats { name: "spool", ..Default::default() }));
        let mut registry = Registry::with_labels(host_labels(host));
        registry.register_collector(Box::new(ProcessCollector));
        let r = registry.sub_registry_with_prefix("rsprof");
        r.register(
            "build",
            "rsprof-bpf version",
            Info::new(BuildLabels { version: env!("CARGO_PKG_VERSION").to_owned() }),
        );
        windows.register(r);
        r.register("window_samples", "Samples in windows, by service", services.samples.clone());
        spool.register(r);
        r.register_collector(Box::new(SinkCollector { spool: spool_sink.clone(), queue }));
        Arc::new(Self { registry, host: host.to_owned(), windows, spool, services, spool_sink })
    }

    /// One window written to the spool (or not), and how long it took.
    pub fn spool_write(&self, ok: bool, took: Duration) {
        let mut s = self.spool_sink.lock().unwrap_or_else(|e| e.into_inner());
        s.attempts += 1;
        if ok {
            s.delivered += 1;
            s.latency.observe(took);
        } else {
            s.rejected += 1;
            self.spool.write_errors.inc();
        }
    }

    /// The exposition: the atomics, then what the recording loop reports (if it answered).
    pub fn encode(&self, live: Option<LiveStats>) -> String {
        let mut out = String::with_capacity(16 << 10);
        // Writing to a String cannot fail.
        let _ = text::encode_registry(&mut out, &self.registry);
        let up = u64::from(live.is_some());
        let mut r = Registry::with_prefix_and_labels("rsprof", host_labels(&self.host));
        r.register(
            "recorder_up",
            "1 if the recording loop answered this scrape",
            ConstGauge::new(up as i64),
        );
        if let Some(live) = live {
            r.register_collector(Box::new(LiveCollector(live)));
        }
        let _ = text::encode_registry(&mut out, &r);
        let _ = text::encode_eof(&mut out);
        out
    }

    /// Asks the recording loop for its numbers, then encodes.
    pub async fn scrape(&self, requests: &mpsc::Sender<Request>) -> String {
        let (tx, rx) = oneshot::channel();
        let live = match requests.send(Request::Stats(tx)).await {
            Ok(()) => tokio::time::timeout(LIVE_TIMEOUT, rx).await.ok().and_then(Result::ok),
            Err(_) => None,
        };
        self.encode(live)
    }
}

fn counter<V: EncodeCounterValue>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    v: V,
) -> std::fmt::Result {
    let m = ConstCounter::new(v);
    // Full stop as the registry adds to the help of registered metrics.
    m.encode(enc.encode_descriptor(name, &format!("{help}."), unit, MetricType::Counter)?)
}

fn gauge<V: EncodeGaugeValue>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    v: V,
) -> std::fmt::Result {
    let m = ConstGauge::new(v);
    m.encode(enc.encode_descriptor(name, &format!("{help}."), unit, MetricType::Gauge)?)
}

/// What the recording loop reported for one scrape.
#[derive(Debug)]
struct LiveCollector(LiveStats);

impl Collector for LiveCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.0;
        let e = &mut enc;
        // Every kernel counter, named and explained by the one table.
        let mut name = String::new();
        for (def, v) in s.counters.iter() {
            name.clear();
            let _ = write!(name, "kernel_{}", def.name);
            counter(e, &name, def.help, None, v)?;
        }
        counter(e, "samples_recorded", "Samples decoded and stored", None, s.collector.samples)?;
        counter(
            e,
            "decode_errors",
            "Ring buffer records that could not be decoded",
            None,
            s.collector.decode_errors,
        )?;
        counter(
            e,
            "unmapped_frames",
            "User frames in no known mapping of their process",
            None,
            s.collector.unmapped_frames,
        )?;
        if let Some(used) = s.ring_used_bytes {
            gauge(
                e,
                "ring_buffer_used",
                "Bytes waiting in the BPF ring buffer",
                Some(&Unit::Bytes),
                used,
            )?;
        }
        gauge(
            e,
            "ring_buffer_size",
            "Size of the BPF ring buffer",
            Some(&Unit::Bytes),
            s.ring_size_bytes,
        )?;
        if !s.bpf_programs.is_empty() {
            let help = "Runs of each BPF program (counted while kernel.bpf_stats_enabled is 1).";
            let mut m = e.encode_descriptor("bpf_program_runs", help, None, MetricType::Counter)?;
            for (prog, runs, _) in &s.bpf_programs {
                ConstCounter::new(*runs).encode(m.encode_family(&[("program", prog.as_str())])?)?;
            }
            let help = "Time in each BPF program (counted while kernel.bpf_stats_enabled is 1).";
            let unit = Unit::Seconds;
            let mut m =
                e.encode_descriptor("bpf_program_run", help, Some(&unit), MetricType::Counter)?;
            for (prog, _, time) in &s.bpf_programs {
                ConstCounter::new(time.as_secs_f64())
                    .encode(m.encode_family(&[("program", prog.as_str())])?)?;
            }
        }
        // Userspace's share of the per-sample cost, beside the BPF programs' time above.
        counter(e, "event_loop_drains", "Drains of the BPF ring buffer", None, s.drains.drains)?;
        counter(e, "event_loop_records", "Ring buffer records drained", None, s.drains.records)?;
        counter(
            e,
            "event_loop_drain",
            "Time spent draining the ring buffer: its records and the work they lead to",
            Some(&Unit::Seconds),
            s.drains.time.as_secs_f64(),
        )?;
        gauge(e, "processes_tracked", "Processes in the process table", None, s.processes as u64)?;
        gauge(e, "threads_tracked", "Threads of the tracked processes", None, s.threads as u64)?;
        gauge(e, "modules_tracked", "Executables and libraries known", None, s.modules as u64)?;
        if let Some(u) = s.unwind {
            let row = std::mem::size_of::<profiler_common::UnwindRow>() as u64;
            gauge(e, "unwind_tables", "Files whose unwind table is loaded", None, u.tables)?;
            gauge(e, "unwind_table", "Unwind rows loaded", Some(&Unit::Bytes), u.rows * row)?;
            gauge(
                e,
                "unwind_table_limit",
                "Unwind rows array size (--unwind-table-mb)",
                Some(&Unit::Bytes),
                u.rows_capacity * row,
            )?;
            let no_cfi = u.files_without_cfi;
            gauge(e, "unwind_files_without_cfi", "Files with no usable CFI", None, no_cfi)?;
            let help = "Walker entries (a process's mappings) written to the kernel";
            counter(e, "unwind_process_writes", help, None, u.process_writes)?;
            let help = "Walker entries deleted from userspace (the kernel deletes them at exit)";
            counter(e, "unwind_process_removals", help, None, u.process_removals)?;
        }
        if let Some(g) = s.exec_gate {
            // Only with --usdt-exec-gate: how many execs waited for a scan, and how many were
            // let go at the deadline before it was done.
            counter(
                e,
                "usdt_exec_gate_execs",
                "Exec opens the USDT exec gate answered",
                None,
                g.execs,
            )?;
            counter(
                e,
                "usdt_exec_gate_held",
                "Execs held by the USDT exec gate while their new file was scanned",
                None,
                g.held,
            )?;
            counter(
                e,
                "usdt_exec_gate_expired",
                "Held execs let go at the exec gate's deadline before their scan was done \
                 (their probes possibly attached late)",
                None,
                g.expired,
            )?;
            counter(
                e,
                "usdt_exec_gate_hold",
                "Time execs were held by the USDT exec gate",
                Some(&Unit::Seconds),
                g.hold_ns_total as f64 / 1e9,
            )?;
        }
        gauge(
            e,
            "store",
            "Sample store chunk memory allocated",
            Some(&Unit::Bytes),
            s.store_bytes as u64,
        )?;
        gauge(
            e,
            "store_limit",
            "Sample store chunk memory bound (--buffer-size)",
            Some(&Unit::Bytes),
            s.store_limit_bytes as u64,
        )?;
        gauge(
            e,
            "store_tables",
            "Sample store interned stacks and strings",
            Some(&Unit::Bytes),
            s.store_table_bytes as u64,
        )?;
        counter(
            e,
            "store_recycled_chunks",
            "Sample store chunks recycled (released after their window or overwritten)",
            None,
            s.recycled.chunks,
        )?;
        counter(
            e,
            "store_recycled_events",
            "Events in recycled sample store chunks",
            None,
            s.recycled.blocks,
        )?;
        counter(
            e,
            "store_oversized_events",
            "Events too large for a store chunk",
            None,
            s.store.oversized,
        )?;
        Ok(())
    }
}

/// `process_*` metrics of the agent itself, read from /proc on each scrape.
#[derive(Debug)]
struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let Some(u) = procfs::self_usage() else { return Ok(()) };
        let e = &mut enc;
        counter(e, "process_cpu", "User and system CPU time", Some(&Unit::Seconds), u.cpu_seconds)?;
        gauge(
            e,
            "process_resident_memory",
            "Resident memory",
            Some(&Unit::Bytes),
            u.resident_bytes,
        )?;
        gauge(
            e,
            "process_start_time",
            "Start time since the Unix epoch",
            Some(&Unit::Seconds),
            u.start_time_seconds,
        )?;
        gauge(e, "process_open_fds", "Open file descriptors", None, u.open_fds)?;
        Ok(())
    }
}

/// Binds the metrics address.
pub async fn bind(addr: std::net::SocketAddr) -> anyhow::Result<TcpListener> {
    use anyhow::Context as _;
    TcpListener::bind(addr).await.with_context(|| format!("listen for metrics on {addr}"))
}

/// Serves `/metrics` until the runtime stops. Connections are answered one at a time (a
/// scrape takes well under a millisecond; Prometheus does not scrape one target in parallel),
/// and one that stalls is cut off, so no client can hold memory or the loop for long.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<AgentMetrics>,
    requests: mpsc::Sender<Request>,
) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(_) => {
                // Out of fds, most likely: wait instead of spinning.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(5), respond(stream, &metrics, &requests))
            .await;
    }
}

/// Longest request head read; a scrape's is a few hundred bytes.
const MAX_REQUEST: usize = 8 << 10;

async fn respond(
    mut stream: TcpStream,
    metrics: &AgentMetrics,
    requests: &mpsc::Sender<Request>,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; MAX_REQUEST];
    let mut len = 0;
    let (method, path) = loop {
        let n = stream.read(&mut buf[len..]).await?;
        if n == 0 {
            return Ok(());
        }
        len += n;
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf[..len]) {
            Ok(httparse::Status::Complete(_)) => {
                break (
                    req.method.unwrap_or_default().to_owned(),
                    req.path.unwrap_or_default().to_owned(),
                );
            }
            Ok(httparse::Status::Partial) if len < MAX_REQUEST => {}
            _ => {
                return reply(&mut stream, "400 Bad Request", "text/plain", b"bad request\n", true)
                    .await;
            }
        }
    };
    let path = path.split('?').next().unwrap_or_default();
    let head = method == "HEAD";
    match (method.as_str(), path) {
        ("GET" | "HEAD", "/metrics") => {
            let body = metrics.scrape(requests).await;
            reply(&mut stream, "200 OK", CONTENT_TYPE, body.as_bytes(), !head).await
        }
        ("GET" | "HEAD", _) => {
            reply(&mut stream, "404 Not Found", "text/plain", b"see /metrics\n", !head).await
        }
        _ => reply(&mut stream, "405 Method Not Allowed", "text/plain", b"GET only\n", true).await,
    }
}

async fn reply(
    stream: &mut TcpStream,
    status: &str,
    content_type: &str,
    body: &[u8],
    with_body: bool,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: \
         close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    if with_body {
        stream.write_all(body).await?;
    }
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf::counters::COUNTERS;

    #[test]
    fn exposition_names_every_kernel_counter_and_the_host() {
        let m = AgentMetrics::new("h\"1", None);
        m.services.add("svc", 5);
        m.spool_write(true, Duration::from_millis(30));
        m.spool_write(false, Duration::from_millis(1));
        let live = LiveStats {
            bpf_programs: vec![("on_cpu_clock".into(), 10, Duration::from_micros(20))],
            exec_gate: Some(crate::usdt::gate::GateStats { expired: 3, ..Default::default() }),
            ..Default::default()
        };
        let text = m.encode(Some(live));
        for d in COUNTERS {
            let line = format!("rsprof_kernel_{}_total{{host=\"h\\\"1\"}} 0", d.name);
            assert!(text.contains(&line), "{line} in\n{text}");
        }
        for needle in [
            "rsprof_window_samples_total{host=\"h\\\"1\",service=\"svc\"} 5",
            "rsprof_sink_pushes_total{host=\"h\\\"1\",sink=\"spool\",outcome=\"reject\"} 1",
            "rsprof_sink_pushes_total{host=\"h\\\"1\",sink=\"spool\",outcome=\"ok\"} 1",
            "rsprof_sink_push_duration_seconds_bucket{host=\"h\\\"1\",le=\"0.05\",sink=\"spool\"} 1",
            "rsprof_sink_push_duration_seconds_bucket{host=\"h\\\"1\",le=\"0.025\",sink=\"spool\"} 0",
            "rsprof_spool_write_errors_total{host=\"h\\\"1\"} 1",
            "rsprof_bpf_program_runs_total{host=\"h\\\"1\",program=\"on_cpu_clock\"} 10",
            "rsprof_bpf_program_run_seconds_total{host=\"h\\\"1\",program=\"on_cpu_clock\"} 0.00002",
            "rsprof_build_info{host=\"h\\\"1\",version=\"",
            "process_cpu_seconds_total{host=\"h\\\"1\"} ",
            "process_resident_memory_bytes{host=\"h\\\"1\"} ",
            "rsprof_recorder_up{host=\"h\\\"1\"} 1",
            "rsprof_usdt_exec_gate_expired_total{host=\"h\\\"1\"} 3",
        ] {
            assert!(text.contains(needle), "{needle} in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
        let down = m.encode(None);
        assert!(down.contains("rsprof_recorder_up{host=\"h\\\"1\"} 0"));
        assert!(!down.contains("rsprof_kernel_"));
    }

    #[test]
    fn services_beyond_the_limit_share_other() {
        let m = AgentMetrics::new("h", None);
        for i in 0..MAX_SERVICES + 10 {
            m.services.add(&format!("s{i}"), 1);
        }
        let text = m.encode(None);
        assert!(text.contains("service=\"other\"} 10"), "{text}");
        assert_eq!(text.matches("rsprof_window_samples_total{").count(), MAX_SERVICES + 1);
    }
}
