//! Grafana Pyroscope push: `push.v1.PusherService/Push` over the connect protocol (an HTTP
//! POST of a protobuf `PushRequest`), one `RawProfileSeries` per window carrying its gzipped
//! pprof as is, the forwarder's batch in as few requests as [`MAX_REQUEST_BYTES`] allows (a
//! backlog after an outage is a few requests, not one per window).
//!
//! A request is all or nothing for us: its windows are marked delivered only when the server
//! answered 2xx. Pyroscope's distributor validates every profile and label set of a request
//! before it stores any (pkg/distributor: `PushParsed` returns `InvalidArgument` from its
//! validation loop before routing), so a 400/413/422 means none of the request was kept: the
//! request is halved and each half sent again until the refused windows are alone, so one bad
//! window (too large, a label the server's limits refuse) costs about 2·log2(n) requests
//! instead of the other windows of its batch; a request refused as a whole for reasons no
//! window can change (401, 403, 404, ...) rejects all its windows at once. Every window is
//! rejected (and counted) once, never retried.
//!
//! Labels follow Pyroscope's validation (pkg/validation/validate.go): `__name__` must be a
//! metric name (`process_cpu`, the name its eBPF profiles use), `service_name` must be
//! non-empty, names match `[a-zA-Z_][a-zA-Z0-9_]*`, values are UTF-8 of at most 2048 bytes
//! (the default limit), no name twice. Values are bytes in protobuf, so quotes and newlines
//! need no escaping; non-UTF-8 `comm`s were made UTF-8 (U+FFFD) when read. `__delta__=false`
//! says the profile already holds one window's samples, not a running total to difference.

use std::{path::Path, time::Duration};

use anyhow::{Context as _, Result, anyhow, bail};

use crate::agent::{
    sinks::{RemoteSink, SinkError},
    spool::WindowMeta,
};

/// `push.v1` and `types.v1` messages of grafana/pyroscope's api/push/v1/push.proto and
/// api/types/v1/types.proto, declared by field number with prost's derive.
pub mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PushRequest {
        #[prost(message, repeated, tag = "1")]
        pub series: Vec<RawProfileSeries>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RawProfileSeries {
        #[prost(message, repeated, tag = "1")]
        pub labels: Vec<LabelPair>,
        #[prost(message, repeated, tag = "2")]
        pub samples: Vec<RawSample>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RawSample {
        /// A pprof profile, gzipped or not.
        #[prost(bytes = "vec", tag = "1")]
        pub raw_profile: Vec<u8>,
        #[prost(string, tag = "2")]
        pub id: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct LabelPair {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub value: String,
    }
}

pub const PUSH_PATH: &str = "/push.v1.PusherService/Push";
/// Pyroscope's default `validation.max-length-label-value`.
const MAX_LABEL_VALUE: usize = 2048;
/// Connect to an unreachable server fails fast.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// A full request ([`MAX_REQUEST_BYTES`]) on a slow uplink still fits.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Body size above which a batch is split into several requests: well under the limits of
/// the servers and proxies in front of them (Pyroscope takes 4 MiB decompressed per profile
/// and far more per request; nginx' default body limit is 1 MiB, so keep proxies configured),
/// and small enough that a retried request does not resend much. A window larger than this
/// goes alone.
pub const MAX_REQUEST_BYTES: usize = 4 << 20;

/// Credentials, each read from a file (never given on the command line).
#[derive(Clone, Debug, Default)]
pub struct PyroscopeAuth {
    /// `user:password`.
    pub basic: Option<(String, String)>,
    pub bearer: Option<String>,
    /// `X-Scope-OrgID`, for multi-tenant servers.
    pub tenant: Option<String>,
}

impl PyroscopeAuth {
    /// Reads the files given; a missing or malformed one is an error naming it.
    pub fn from_files(
        basic: Option<&Path>,
        bearer: Option<&Path>,
        tenant: Option<&Path>,
    ) -> Result<Self> {
        let read = |p: &Path| -> Result<String> {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()))?;
            let text = text.trim_end_matches(['\n', '\r']).to_owned();
            if text.is_empty() || text.contains(['\n', '\r']) {
                bail!("{}: want one non-empty line", p.display());
            }
            Ok(text)
        };
        if basic.is_some() && bearer.is_some() {
            bail!("pyroscope: basic auth and a bearer token are exclusive");
        }
        let basic = match basic {
            Some(p) => {
                let text = read(p)?;
                let (user, pass) = text
                    .split_once(':')
                    .ok_or_else(|| anyhow!("{}: want `user:password`", p.display()))?;
                Some((user.to_owned(), pass.to_owned()))
            }
            None => None,
        };
        Ok(Self {
            basic,
            bearer: bearer.map(read).transpose()?,
            tenant: tenant.map(read).transpose()?,
        })
    }
}

pub struct PyroscopeSink {
    url: String,
    auth: PyroscopeAuth,
    agent: ureq::Agent,
}

impl PyroscopeSink {
    /// `base` is the server's URL (e.g. `http://pyroscope:4040`).
    pub fn new(base: &str, auth: PyroscopeAuth) -> Result<Self> {
        let base = base.trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            bail!("invalid pyroscope URL {base:?}: want http:// or https://");
        }
        let agent = ureq::Agent::config_builder()
            .timeout_connect(Some(CONNECT_TIMEOUT))
            .timeout_global(Some(REQUEST_TIMEOUT))
            // Statuses are classified below (retry or reject), with the server's message.
            .http_status_as_error(false)
            .user_agent(concat!("rsprof-bpf/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Ok(Self { url: format!("{base}{PUSH_PATH}"), auth, agent })
    }
}

/// The series labels of a window, in Pyroscope's rules, sorted by name.
pub fn series_labels(meta: &WindowMeta) -> Vec<proto::LabelPair> {
    let l = &meta.labels;
    let service = if l.service_name.is_empty() { "unknown_service" } else { &l.service_name };
    let mut v: Vec<(&str, String)> = vec![
        ("__name__", "process_cpu".into()),
        ("__delta__", "false".into()),
        ("service_name", service.into()),
        ("host", l.host.clone()),
        ("process", l.process.clone()),
    ];
    if l.pid != 0 {
        v.push(("pid", l.pid.to_string()));
    }
    for (name, value) in [
        ("container_runtime", &l.container_runtime),
        ("container_id", &l.container_id),
        ("systemd_unit", &l.systemd_unit),
        ("pod_uid", &l.pod_uid),
        ("pod_qos", &l.pod_qos),
    ] {
        if let Some(value) = value {
            v.push((name, value.clone()));
        }
    }
    let mut out: Vec<proto::LabelPair> = (v.into_iter())
        .filter(|(_, value)| !value.is_empty())
        .map(|(name, value)| proto::LabelPair { name: name.into(), value: truncate(value) })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn truncate(mut s: String) -> String {
    if s.len() > MAX_LABEL_VALUE {
        let mut end = MAX_LABEL_VALUE;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

/// A UUID-shaped id derived from the host and window id: the same window pushed again (after
/// a crash before its delivery was recorded) carries the same id.
pub fn sample_id(meta: &WindowMeta) -> String {
    let key = format!("{}\0{}", meta.labels.host, meta.window_id);
    let mut h = [0u8; 16];
    for (i, chunk) in h.chunks_mut(4).enumerate() {
        let mut c = crc32fast::Hasher::new_with_initial((i as u32).wrapping_mul(0x9e37_79b9));
        c.update(key.as_bytes());
        chunk.copy_from_slice(&c.finalize().to_be_bytes());
    }
    // Version 8 (custom), RFC 4122 variant.
    h[6] = (h[6] & 0x0f) | 0x80;
    h[8] = (h[8] & 0x3f) | 0x80;
    let x: String = h.iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &x[..8], &x[8..12], &x[12..16], &x[16..20], &x[20..])
}

/// One window as a `PushRequest.series` field (tag, length, `RawProfileSeries`): a request
/// body is such fields concatenated (repeated fields may be), so each window is encoded once
/// whatever requests it ends up in.
pub fn series_field(meta: &WindowMeta, pprof_gz: &[u8]) -> Vec<u8> {
    let series = proto::RawProfileSeries {
        labels: series_labels(meta),
        samples: vec![proto::RawSample { raw_profile: pprof_gz.to_vec(), id: sample_id(meta) }],
    };
    let mut out = Vec::new();
    prost::encoding::message::encode(1, &series, &mut out);
    out
}

/// Consecutive ranges of `sizes` each at most `max` in total (a larger item alone).
fn split_by_size(sizes: &[usize], max: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut total) = (0, 0);
    for (i, &n) in sizes.iter().enumerate() {
        if i > start && total + n > max {
            out.push(start..i);
            (start, total) = (i, 0);
        }
        total += n;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// Why a push failed.
struct Failed {
    error: SinkError,
    /// The server refused the request for its content (400, 413, 422): a part of it may pass.
    split: bool,
}

/// A copy of `e` for each window of a failed request.
fn copy(e: &SinkError) -> SinkError {
    match e {
        SinkError::Retry(e) => SinkError::Retry(anyhow!("{e:#}")),
        SinkError::Reject(e) => SinkError::Reject(anyhow!("{e:#}")),
    }
}

impl PyroscopeSink {
    /// POSTs one request body.
    fn post(&mut self, body: &[u8]) -> Result<(), Failed> {
        let mut req = (self.agent.post(&self.url))
            .header("Content-Type", "application/proto")
            .header("Connect-Protocol-Version", "1")
            .header("Connect-Timeout-Ms", REQUEST_TIMEOUT.as_millis().to_string());
        if let Some((user, pass)) = &self.auth.basic {
            use base64::Engine as _;
            let b64 = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"));
            req = req.header("Authorization", format!("Basic {b64}"));
        }
        if let Some(token) = &self.auth.bearer {
            req = req.header("Authorization", format!("Bearer {token}"));
        }
        if let Some(tenant) = &self.auth.tenant {
            req = req.header("X-Scope-OrgID", tenant);
        }
        let mut resp = match req.send(body) {
            Ok(r) => r,
            // Connection refused, DNS, timeouts, TLS: the server may be back later.
            Err(e) => {
                let error = SinkError::Retry(anyhow!("POST {}: {e}", self.url));
                return Err(Failed { error, split: false });
            }
        };
        let status = resp.status();
        if status.is_success() {
            return Ok(());
        }
        // Connect errors are JSON `{"code": ..., "message": ...}`; keep the message.
        let text = resp.body_mut().with_config().limit(4096).read_to_string().unwrap_or_default();
        let message = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_owned))
            .unwrap_or_else(|| text.trim().to_owned());
        let e = anyhow!("HTTP {status}: {message}");
        let code = status.as_u16();
        if status.is_server_error() || code == 429 || code == 408 {
            Err(Failed { error: SinkError::Retry(e), split: false })
        } else {
            Err(Failed { error: SinkError::Reject(e), split: matches!(code, 400 | 413 | 422) })
        }
    }

    /// Pushes `fields` (encoded series) in one request, halving it while the server refuses
    /// it for its content; appends one result per field to `out`.
    fn push(&mut self, fields: &[Vec<u8>], out: &mut Vec<Result<(), SinkError>>) {
        match self.post(&fields.concat()) {
            Ok(()) => out.extend(fields.iter().map(|_| Ok(()))),
            Err(Failed { split: true, .. }) if fields.len() > 1 => {
                let (a, b) = fields.split_at(fields.len() / 2);
                self.push(a, out);
                match out.last() {
                    // Down meanwhile: the rest waits too.
                    Some(Err(e @ SinkError::Retry(_))) => {
                        let e = copy(e);
                        out.extend(b.iter().map(|_| Err(copy(&e))));
                    }
                    _ => self.push(b, out),
                }
            }
            Err(Failed { error, .. }) => out.extend(fields.iter().map(|_| Err(copy(&error)))),
        }
    }
}

impl RemoteSink for PyroscopeSink {
    fn name(&self) -> &'static str {
        "pyroscope"
    }

    fn deliver(&mut self, meta: &WindowMeta, pprof_gz: &[u8]) -> Result<(), SinkError> {
        let mut out = Vec::with_capacity(1);
        self.push(&[series_field(meta, pprof_gz)], &mut out);
        out.pop().expect("one result")
    }

    /// The batch in requests of at most [`MAX_REQUEST_BYTES`], in order; after a retryable
    /// failure the remaining requests are not attempted (the server is likely down).
    fn deliver_batch(&mut self, windows: &[(WindowMeta, Vec<u8>)]) -> Vec<Result<(), SinkError>> {
        let fields: Vec<Vec<u8>> = windows.iter().map(|(m, gz)| series_field(m, gz)).collect();
        let sizes: Vec<usize> = fields.iter().map(Vec::len).collect();
        let mut out = Vec::with_capacity(fields.len());
        for range in split_by_size(&sizes, MAX_REQUEST_BYTES) {
            if let Some(Err(e @ SinkError::Retry(_))) = out.last() {
                let e =
                    SinkError::Retry(anyhow!("not attempted after an earlier request failed: {e}"));
                out.extend(range.map(|_| Err(copy(&e))));
            } else {
                self.push(&fields[range], &mut out);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::labels::WindowLabels;

    fn meta(process: &str) -> WindowMeta {
        WindowMeta {
            window_id: "0001700000000000-42-deadbeef".into(),
            start_ms: 1_700_000_000_000,
            end_ms: 1_700_000_010_000,
            samples: 3,
            labels: WindowLabels {
                service_name: String::new(),
                host: "h".into(),
                pid: 42,
                process: process.into(),
                container_runtime: Some("docker".into()),
                container_id: Some("abc".into()),
                ..Default::default()
            },
        }
    }

    #[test]
    fn labels_follow_pyroscope_rules() {
        let long = "x".repeat(3000) + "é";
        let ls = series_labels(&meta(&long));
        let names: Vec<&str> = ls.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "__delta__",
                "__name__",
                "container_id",
                "container_runtime",
                "host",
                "pid",
                "process",
                "service_name"
            ]
        );
        let get = |n: &str| ls.iter().find(|l| l.name == n).unwrap().value.clone();
        assert_eq!(get("service_name"), "unknown_service", "never empty");
        assert_eq!(get("process").len(), MAX_LABEL_VALUE);
        assert_eq!(get("pid"), "42");
        for l in &ls {
            let mut c = l.name.chars();
            assert!(c.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_'), "{}", l.name);
            assert!(c.all(|c| c.is_ascii_alphanumeric() || c == '_'), "{}", l.name);
        }
    }

    #[test]
    fn sample_id_is_a_stable_uuid() {
        let a = sample_id(&meta("p"));
        assert_eq!(a, sample_id(&meta("q")), "depends on host and window id only");
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "8");
        let mut m = meta("p");
        m.window_id.push('0');
        assert_ne!(a, sample_id(&m));
    }

    #[test]
    fn batches_split_by_size_in_order() {
        assert_eq!(split_by_size(&[], 10), Vec::<std::ops::Range<usize>>::new());
        assert_eq!(split_by_size(&[4, 4, 4, 4], 10), [0..2, 2..4]);
        assert_eq!(split_by_size(&[3, 30, 3, 3], 10), [0..1, 1..2, 2..4], "large ones alone");
        assert_eq!(
            split_by_size(&[5, 5], 10),
            vec![std::ops::Range { start: 0, end: 2 }],
            "the limit is inclusive"
        );
    }

    #[test]
    fn concatenated_series_fields_are_one_push_request() {
        use prost::Message as _;
        let (a, b) = (meta("a"), meta("b"));
        let body = [series_field(&a, b"one"), series_field(&b, b"two")].concat();
        let req = proto::PushRequest::decode(&body[..]).unwrap();
        assert_eq!(req.series.len(), 2);
        assert_eq!(req.series[1].labels, series_labels(&b));
        assert_eq!(req.series[1].samples[0].raw_profile, b"two");
    }
}
