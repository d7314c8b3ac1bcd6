//! The agent's options: a TOML file (`--config`) and flags set the same ones, flags winning.
//! Validated once into an [`AgentPlan`].

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;

use crate::{
    agent::metrics,
    agent::sinks::pyroscope::PyroscopeAuth,
    cli::args::{Mode, Unwind},
    cli::duration::ConfigDuration,
    cli::{
        args::{AgentArgs, DebuginfodArgs, RecordArgs, parse_size},
        plan::RecordPlan,
    },
    writers::Format,
};

/// Parca Agent samples at 19 Hz and the OpenTelemetry eBPF profiler at 20 Hz; Grafana Alloy's
/// eBPF profiler defaults to 97 Hz. A fleet agent runs everywhere all the time, so the low end
/// wins; 19 rather than 20 so sampling does not run in lockstep with timers at round rates
/// (10, 20, 50, 100 Hz ticks), which would over- or under-represent their work.
pub const DEFAULT_FREQUENCY: u64 = 19;
/// Parca and the OpenTelemetry profiler send every 10 s (Pyroscope every 15 s).
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(10);
pub const DEFAULT_SPOOL: &str = "/var/lib/rsprof-bpf/spool";
pub const DEFAULT_SPOOL_SIZE: &str = "256M";
/// Enough for a window of a busy many-core host at the default rate; the oldest events of a
/// window are recycled (and counted) beyond it.
pub const DEFAULT_BUFFER_SIZE: &str = "16M";

/// The agent's smallest ring buffer (`cli::plan::default_ring_bytes`, the recording's rule):
/// at fleet rates a second of samples fills far less, and a fixed 16 MiB ring was a third of
/// an idle agent's RSS (the kernel maps a ring buffer's pages twice).
const AGENT_MIN_RING: u64 = 2 << 20;

/// The config file: every key optional, the same names as the flags.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct FileConfig {
    pub all: Option<bool>,
    pub cgroup: Option<Vec<String>>,
    pub container: Option<Vec<String>>,
    pub frequency: Option<u64>,
    /// Seconds, or a string with a unit (`"10s"`).
    #[serde(default, deserialize_with = "ConfigDuration::secs")]
    pub window: Option<ConfigDuration>,
    pub spool: Option<PathBuf>,
    pub queue_dir: Option<PathBuf>,
    pub clickhouse: Option<String>,
    pub clickhouse_retention: Option<u32>,
    pub spool_size: Option<String>,
    pub buffer_size: Option<String>,
    pub off_cpu: Option<bool>,
    /// Milliseconds, or a string with a unit (`"2ms"`).
    #[serde(default, deserialize_with = "ConfigDuration::millis")]
    pub off_cpu_min: Option<ConfigDuration>,
    /// `dwarf`, `dwarf-fp` or `fp`.
    pub unwind: Option<Unwind>,
    pub unwind_table_mb: Option<u32>,
    pub host: Option<String>,
    /// `IP:PORT` or `off`.
    pub metrics: Option<String>,
    pub quiet: Option<bool>,
    pub pyroscope: Option<String>,
    pub pyroscope_basic_auth_file: Option<PathBuf>,
    pub pyroscope_token_file: Option<PathBuf>,
    pub pyroscope_tenant_file: Option<PathBuf>,
    /// Seconds, or a string with a unit (`"5m"`).
    #[serde(default, deserialize_with = "ConfigDuration::secs")]
    pub flight_recorder: Option<ConfigDuration>,
    pub dump_socket: Option<PathBuf>,
    pub dump_dir: Option<PathBuf>,
    pub usdt_exec_gate: Option<bool>,
}

impl FileConfig {
    pub fn parse(text: &str) -> Result<Self> {
        // toml's messages span lines (with a source excerpt): keep the first, which says what.
        toml::from_str(text).map_err(|e| {
            let first = e.message().lines().next().unwrap_or("invalid").to_owned();
            match e.span().map(|s| text[..s.start].matches('\n').count() + 1) {
                Some(line) => anyhow::anyhow!("line {line}: {first}"),
                None => anyhow::anyhow!("{first}"),
            }
        })
    }
}

pub struct AgentPlan {
    pub record: RecordPlan,
    pub window: Duration,
    /// The spool, also the remote sinks' queue.
    pub spool: PathBuf,
    /// Keep delivered windows: `--spool` was given, or there is no remote sink.
    pub keep_spool: bool,
    pub spool_bytes: u64,
    pub host: String,
    /// `--clickhouse URL` and the days its tables keep.
    pub clickhouse: Option<(String, u32)>,
    /// Where to serve Prometheus metrics; None: not served.
    pub metrics: Option<SocketAddr>,
    /// Grafana Pyroscope's URL and credentials (read from their files at start).
    pub pyroscope: Option<(String, PyroscopeAuth)>,
    pub flight: Option<crate::agent::flight::FlightPlan>,
}

impl AgentPlan {
    pub fn from_args(args: AgentArgs) -> Result<Self> {
        let file = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("read config {}", path.display()))?;
                FileConfig::parse(&text)
                    .with_context(|| format!("bad config {}", path.display()))?
            }
            None => FileConfig::default(),
        };
        let frequency = args.frequency.or(file.frequency).unwrap_or(DEFAULT_FREQUENCY);
        let window = args.window.or(file.window.map(|d| d.0)).unwrap_or(DEFAULT_WINDOW);
        if !(Duration::from_millis(100)..=Duration::from_secs(3600)).contains(&window) {
            bail!("invalid window {window:?}: must be between 100ms and 1h");
        }
        let size = |flag: Option<u64>, file: Option<String>, default: &str, what: &str| {
            flag.map_or_else(
                || {
                    parse_size(file.as_deref().unwrap_or(default))
                        .map_err(|e| anyhow::anyhow!("{what}: {e}"))
                },
                Ok,
            )
        };
        let spool_bytes = size(args.spool_size, file.spool_size, DEFAULT_SPOOL_SIZE, "spool-size")?;
        if spool_bytes < (64 << 10) {
            bail!("invalid spool size {spool_bytes}: must be at least 64K");
        }
        let buffer = size(args.buffer_size, file.buffer_size, DEFAULT_BUFFER_SIZE, "buffer-size")?;
        let cgroup =
            if args.cgroup.is_empty() { file.cgroup.unwrap_or_default() } else { args.cgroup };
        let container = if args.container.is_empty() {
            file.container.unwrap_or_default()
        } else {
            args.container
        };
        let all =
            args.all || file.all.unwrap_or(false) || (cgroup.is_empty() && container.is_empty());
        let record = RecordArgs {
            all,
            pid: Vec::new(),
            cgroup,
            container,
            frequency,
            duration: None,
            output: PathBuf::from("agent.pb.gz"),
            format: Some(Format::Pprof),
            compress: false,
            quiet: args.quiet || file.quiet.unwrap_or(false),
            verbose: false,
            ring_buffer_size: Some(crate::cli::plan::default_ring_bytes(frequency, AGENT_MIN_RING)),
            usdt: Vec::new(),
            usdt_interval: Vec::new(),
            usdt_dump: None,
            save_raw: None,
            buffer_size: buffer,
            command: Vec::new(),
            mode: Mode::Cpu,
            off_cpu: args.off_cpu || file.off_cpu.unwrap_or(false),
            off_cpu_min: (args.off_cpu_min.or(file.off_cpu_min.map(|d| d.0)))
                .unwrap_or(Duration::from_millis(1)),
            unwind: args.unwind.or(file.unwind).unwrap_or(Unwind::DwarfFp),
            unwind_table_mb: args.unwind_table_mb.or(file.unwind_table_mb).unwrap_or(64),
            bpf_timing: false,
            no_python: args.no_python,
            // Hosts send what they cannot name; `query` names it centrally.
            debuginfod: DebuginfodArgs { no_debuginfod: true, ..Default::default() },
        };
        let retention = (args.clickhouse_retention.or(file.clickhouse_retention))
            .unwrap_or(crate::agent::sinks::clickhouse::DEFAULT_RETENTION_DAYS);
        if retention == 0 {
            bail!("invalid clickhouse-retention 0: at least 1 day");
        }
        let clickhouse = args.clickhouse.or(file.clickhouse).map(|url| (url, retention));
        let pyroscope = match args.pyroscope.or(file.pyroscope) {
            Some(url) => {
                let or = |a: Option<PathBuf>, b: Option<PathBuf>| a.or(b);
                let auth = PyroscopeAuth::from_files(
                    or(args.pyroscope_basic_auth_file, file.pyroscope_basic_auth_file).as_deref(),
                    or(args.pyroscope_token_file, file.pyroscope_token_file).as_deref(),
                    or(args.pyroscope_tenant_file, file.pyroscope_tenant_file).as_deref(),
                )?;
                Some((url, auth))
            }
            None => None,
        };
        let flight = crate::agent::flight::FlightPlan::from_options(
            args.flight_recorder.or(file.flight_recorder.map(|d| d.0)),
            args.dump_socket.or(file.dump_socket),
            args.dump_dir.or(file.dump_dir),
        )?;
        let remote = pyroscope.is_some() || clickhouse.is_some();
        let host = match args.host.or(file.host) {
            Some(h) if h.is_empty() => bail!("invalid host: empty"),
            Some(h) => h,
            None => hostname(),
        };
        let metrics = parse_metrics_addr(
            args.metrics.or(file.metrics).as_deref().unwrap_or(metrics::DEFAULT_ADDR),
        )?;
        let mut record = RecordPlan::from_args(record)?;
        // Off unless asked: a fleet agent must never be able to stall the host's execs (a
        // stopped agent would hold them until the deadline); the first hits of brand-new
        // binaries are worth less.
        record.usdt_exec_gate = args.usdt_exec_gate || file.usdt_exec_gate.unwrap_or(false);
        // An exec storm would wake it per process for entries its rare samples seldom need.
        record.eager_tables = false;
        Ok(Self {
            metrics,
            record,
            window,
            keep_spool: args.spool.is_some() || file.spool.is_some() || !remote,
            spool: (args.spool.or(file.spool))
                .or(args.queue_dir.or(file.queue_dir))
                .unwrap_or_else(|| DEFAULT_SPOOL.into()),
            spool_bytes,
            host,
            clickhouse,
            pyroscope,
            flight,
        })
    }
}

/// `IP:PORT` or `off`. A name such as `localhost:9749` is refused: what it resolves to could
/// change, and the metrics must not end up on another interface by surprise.
fn parse_metrics_addr(text: &str) -> Result<Option<SocketAddr>> {
    if text == "off" {
        return Ok(None);
    }
    text.parse().map(Some).map_err(|_| {
        anyhow::anyhow!(
            "invalid metrics address {text:?}: expected IP:PORT (e.g. 127.0.0.1:9749) or off"
        )
    })
}

/// This host's name (the kernel's nodename).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_file_keys_and_errors() {
        let c = FileConfig::parse(
            "frequency = 49\nwindow = 15\nspool = \"/tmp/s\"\nspool-size = \"1G\"\ncgroup = [\"/a\"]\n",
        )
        .unwrap();
        assert_eq!(
            (c.frequency, c.window),
            (Some(49), Some(ConfigDuration(Duration::from_secs(15))))
        );
        let t = FileConfig::parse("window = \"10s\"\nflight-recorder = \"2m\"\noff-cpu-min = 3\n");
        let t = t.unwrap();
        assert_eq!(t.window, Some(ConfigDuration(Duration::from_secs(10))));
        assert_eq!(t.flight_recorder, Some(ConfigDuration(Duration::from_secs(120))));
        assert_eq!(t.off_cpu_min, Some(ConfigDuration(Duration::from_millis(3))));
        let e = FileConfig::parse("window = \"10 parsecs\"\n").unwrap_err().to_string();
        assert!(e.starts_with("line 1: invalid duration '10 parsecs'"), "{e}");
        assert_eq!(c.spool_size.as_deref(), Some("1G"));
        assert_eq!(c.cgroup, Some(vec!["/a".to_owned()]));
        let e = FileConfig::parse("frequency = 49\nwindoww = 3\n").unwrap_err().to_string();
        assert!(e.starts_with("line 2: unknown field `windoww`"), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
        let c = FileConfig::parse("metrics = \"off\"").unwrap();
        assert_eq!(parse_metrics_addr(c.metrics.as_deref().unwrap()).unwrap(), None);
        assert_eq!(
            parse_metrics_addr("127.0.0.1:0").unwrap(),
            Some("127.0.0.1:0".parse().unwrap())
        );
        assert!(parse_metrics_addr("localhost:9749").is_err());
        assert!(parse_metrics_addr(metrics::DEFAULT_ADDR).unwrap().unwrap().ip().is_loopback());
        let e = FileConfig::parse("frequency = \"fast\"").unwrap_err().to_string();
        assert!(e.starts_with("line 1: invalid type"), "{e}");
        assert_eq!(FileConfig::parse("usdt-exec-gate = true").unwrap().usdt_exec_gate, Some(true));
        let c = FileConfig::parse("unwind = \"dwarf-fp\"\nunwind-table-mb = 16").unwrap();
        assert_eq!((c.unwind, c.unwind_table_mb), (Some(Unwind::DwarfFp), Some(16)));
        let e = FileConfig::parse("unwind = \"lbr\"").unwrap_err().to_string();
        assert!(e.starts_with("line 1: unknown variant `lbr`"), "{e}");
    }
}
