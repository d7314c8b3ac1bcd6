//! The agent's options: a TOML file (`--config`) and flags set the same ones, flags winning.
//! Validated once into an [`AgentPlan`].

use std::{path::PathBuf, time::Duration};

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;

use crate::{
    cli::args::Mode,
    cli::{
        args::{AgentArgs, RecordArgs, parse_size},
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
pub const DEFAULT_WINDOW_SECS: f64 = 10.0;
pub const DEFAULT_SPOOL: &str = "/var/lib/rsprof-bpf/spool";
pub const DEFAULT_SPOOL_SIZE: &str = "256M";
/// Enough for a window of a busy many-core host at the default rate; the oldest events of a
/// window are recycled (and counted) beyond it.
pub const DEFAULT_BUFFER_SIZE: &str = "16M";

/// The config file: every key optional, the same names as the flags.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct FileConfig {
    pub all: Option<bool>,
    pub cgroup: Option<Vec<String>>,
    pub container: Option<Vec<String>>,
    pub frequency: Option<u64>,
    /// Seconds.
    pub window: Option<f64>,
    pub spool: Option<PathBuf>,
    pub spool_size: Option<String>,
    pub buffer_size: Option<String>,
    pub host: Option<String>,
    pub quiet: Option<bool>,
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
    pub spool: PathBuf,
    pub spool_bytes: u64,
    pub host: String,
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
        let window = args.window.or(file.window).unwrap_or(DEFAULT_WINDOW_SECS);
        if !(window.is_finite() && (0.1..=3600.0).contains(&window)) {
            bail!("invalid window {window}: must be between 0.1 and 3600 seconds");
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
            quiet: args.quiet || file.quiet.unwrap_or(false),
            ring_buffer_size: 16 << 20,
            usdt: Vec::new(),
            usdt_interval: Vec::new(),
            usdt_dump: None,
            buffer_size: buffer,
            command: Vec::new(),
            // Off-CPU time is not part of the agent's windows yet.
            mode: Mode::Cpu,
            off_cpu: false,
            off_cpu_min: 1.0,
            unwind: crate::cli::args::Unwind::Fp,
            unwind_table_mb: 64,
        };
        let host = match args.host.or(file.host) {
            Some(h) if h.is_empty() => bail!("invalid host: empty"),
            Some(h) => h,
            None => hostname(),
        };
        Ok(Self {
            record: RecordPlan::from_args(record)?,
            window: Duration::from_secs_f64(window),
            spool: args.spool.or(file.spool).unwrap_or_else(|| DEFAULT_SPOOL.into()),
            spool_bytes,
            host,
        })
    }
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
        assert_eq!((c.frequency, c.window), (Some(49), Some(15.0)));
        assert_eq!(c.spool_size.as_deref(), Some("1G"));
        assert_eq!(c.cgroup, Some(vec!["/a".to_owned()]));
        let e = FileConfig::parse("frequency = 49\nwindoww = 3\n").unwrap_err().to_string();
        assert!(e.starts_with("line 2: unknown field `windoww`"), "{e}");
        assert!(!e.contains('\n'), "one line: {e}");
        let e = FileConfig::parse("frequency = \"fast\"").unwrap_err().to_string();
        assert!(e.starts_with("line 1: invalid type"), "{e}");
    }
}
