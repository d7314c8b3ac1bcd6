//! Remote sinks: where spooled windows go after the spool. The spool is the queue: every
//! window is written there first, and each remote sink is handed spooled windows in order
//! until the server has them, so a sink that is down only makes the spool grow (bounded by
//! `--spool-size`, oldest dropped and counted) and a restarted agent resends what was not
//! acknowledged. A sink must therefore accept a window it may already have (after a crash
//! between delivery and its acknowledgement being recorded) without storing it twice.

pub mod clickhouse;
pub mod forward;
pub mod pyroscope;

use crate::agent::spool::WindowMeta;

/// Why a delivery failed, which decides what the forwarder does next.
#[derive(Debug)]
pub enum SinkError {
    /// The server could not be reached or failed transiently (connection refused, timeout,
    /// HTTP 5xx/429): keep the window and retry with backoff.
    Retry(anyhow::Error),
    /// The server refused this window (HTTP 4xx, a database error about the data): count it,
    /// log the first of each kind with the server's message, and do not send it again.
    Reject(anyhow::Error),
}

impl std::fmt::Display for SinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Retry(e) => write!(f, "will retry: {e:#}"),
            Self::Reject(e) => write!(f, "rejected: {e:#}"),
        }
    }
}

/// A remote destination for windows.
pub trait RemoteSink: Send {
    /// Short stable name ("pyroscope", "clickhouse"): used in logs, counters and the spool's
    /// per-sink delivery records.
    fn name(&self) -> &'static str;

    /// Delivers one window: its labels and its gzipped pprof profile, as spooled. Returns
    /// once the server has it. Must be idempotent per `(meta.labels.host, meta.window_id)`.
    fn deliver(&mut self, meta: &WindowMeta, pprof_gz: &[u8]) -> Result<(), SinkError>;

    /// Delivers several windows, oldest first: one result per window, in order. Sinks that
    /// can send many windows in one request override it (ClickHouse: one insert per table
    /// instead of one per window). By default one `deliver` each, stopping at the first
    /// retryable failure (the server is likely down: the rest are not attempted, and retried).
    fn deliver_batch(&mut self, windows: &[(WindowMeta, Vec<u8>)]) -> Vec<Result<(), SinkError>> {
        let mut out = Vec::with_capacity(windows.len());
        for (meta, pprof_gz) in windows {
            if out.iter().any(|r| matches!(r, Err(SinkError::Retry(_)))) {
                let e = anyhow::anyhow!("not attempted after an earlier window failed");
                out.push(Err(SinkError::Retry(e)));
            } else {
                out.push(self.deliver(meta, pprof_gz));
            }
        }
        out
    }

    /// What kind of rejection `e` is: the forwarder logs the first rejection of each kind
    /// only. By default its message up to the first `": "` (e.g. `HTTP 400 Bad Request`).
    fn error_kind(&self, e: &anyhow::Error) -> String {
        let text = format!("{e:#}");
        text.split(": ").next().unwrap_or_default().chars().take(80).collect()
    }
}
