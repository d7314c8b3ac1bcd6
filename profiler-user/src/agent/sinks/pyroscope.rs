//! Grafana Pyroscope push: `push.v1.PusherService/Push` over the connect protocol (an HTTP
//! POST of a protobuf `PushRequest`), one `RawProfileSeries` per window carrying its gzipped
//! pprof as is.
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
/// Connect to an unreachable server fails fast; a push of one window is small.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

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

/// The request body for one window.
pub fn push_request(meta: &WindowMeta, pprof_gz: &[u8]) -> Vec<u8> {
    use prost::Message as _;
    proto::PushRequest {
        series: vec![proto::RawProfileSeries {
            labels: series_labels(meta),
            samples: vec![proto::RawSample { raw_profile: pprof_gz.to_vec(), id: sample_id(meta) }],
        }],
    }
    .encode_to_vec()
}

impl RemoteSink for PyroscopeSink {
    fn name(&self) -> &'static str {
        "pyroscope"
    }

    fn deliver(&mut self, meta: &WindowMeta, pprof_gz: &[u8]) -> Result<(), SinkError> {
        let body = push_request(meta, pprof_gz);
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
        let mut resp = match req.send(&body[..]) {
            Ok(r) => r,
            // Connection refused, DNS, timeouts, TLS: the server may be back later.
            Err(e) => return Err(SinkError::Retry(anyhow!("POST {}: {e}", self.url))),
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
        if status.is_server_error() || status.as_u16() == 429 || status.as_u16() == 408 {
            Err(SinkError::Retry(e))
        } else {
            Err(SinkError::Reject(e))
        }
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
                systemd_unit: None,
                pod_uid: None,
                pod_qos: None,
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
}
