//! Command-line interface.

use std::{path::PathBuf, time::Duration};

use clap::{Args, Parser, Subcommand, ValueEnum, builder::FalseyValueParser};

use crate::{cli::duration, writers::Format};

#[derive(Parser, Debug)]
#[command(
    name = "rsprof-bpf",
    version,
    about = "System-wide sampling profiler on eBPF; writes Firefox Profiler (Gecko), pprof or \
             collapsed-stack profiles",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub record: RecordArgs,
}

#[derive(Subcommand, Debug)]
// Parsed once per run: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Record a profile (the default command).
    Record(RecordArgs),
    /// List the USDT probes of a binary or library, or of every file a process maps.
    ListUsdt(ListUsdtArgs),
    /// List the containers and services (cgroups) on this host, with process counts.
    ListContainers,
    /// Profile continuously: every window, one pprof profile per service (pid, thread and
    /// process as sample labels) into a spool directory.
    Agent(AgentArgs),
    /// Merge an agent's spooled windows into one profile (Gecko, pprof or collapsed).
    Query(QueryArgs),
    /// Ask a running agent (`--flight-recorder`) for its last minutes as a Gecko profile.
    Dump(DumpArgs),
    /// Write the profile of a recording saved with `record --save-raw`, without root or BPF.
    Replay(ReplayArgs),
}

#[derive(Args, Debug, Clone)]
pub struct ReplayArgs {
    /// The raw stream `record --save-raw` wrote.
    #[arg(value_name = "FILE")]
    pub raw: PathBuf,
    /// Output file, named as for `record -o` (`-` is standard output).
    #[arg(short = 'o', long, value_name = "PATH")]
    pub output: PathBuf,
    /// Output format: gecko, pprof or collapsed. Default: from the output file's name.
    #[arg(long, value_parser = parse_format, value_name = "FORMAT")]
    pub format: Option<Format>,
    /// Gzip the output whatever its name.
    #[arg(short = 'z', long)]
    pub compress: bool,
    /// No summary.
    #[arg(short = 'q', long)]
    pub quiet: bool,
}

#[derive(Args, Debug, Clone)]
pub struct DumpArgs {
    /// How far back (e.g. 2m, 90s; a plain number is seconds) [default: all the flight
    /// recorder keeps].
    #[arg(long, value_name = "DURATION", value_parser = duration::secs)]
    pub last: Option<Duration>,
    /// The Gecko profile to write (`.json` or `.json.gz`; mode 0600; `-` for standard output).
    #[arg(short = 'o', long, value_name = "FILE")]
    pub output: PathBuf,
    /// The agent's dump socket [default: /run/rsprof-bpf/agent.sock].
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
}

#[derive(Args, Debug, Clone, Default)]
pub struct AgentArgs {
    /// TOML file with the same options as the flags (kebab-case keys, e.g. `spool-size`);
    /// flags given override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Profile every process (the default without --cgroup/--container).
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Only tasks in this cgroup v2 or below it. Repeatable.
    #[arg(long, value_name = "PATH")]
    pub cgroup: Vec<String>,
    /// Only tasks in this container (id or unique id prefix; LXC: name). Repeatable.
    #[arg(long, value_name = "ID")]
    pub container: Vec<String>,
    /// Sampling frequency per CPU, in Hz [default: 19].
    #[arg(short = 'F', long, value_name = "HZ")]
    pub frequency: Option<u64>,
    /// Length of a window (e.g. 10s, 1m; a plain number is seconds): each window gives one
    /// profile per service [default: 10s].
    #[arg(long, value_name = "DURATION", value_parser = duration::secs)]
    pub window: Option<Duration>,
    /// Spool directory for the windows [default: /var/lib/rsprof-bpf/spool]. With remote
    /// sinks, windows stay there after delivery (bounded by --spool-size).
    #[arg(long, value_name = "DIR")]
    pub spool: Option<PathBuf>,
    /// Where windows wait for the remote sinks when --spool is not given; deleted once
    /// delivered [default: /var/lib/rsprof-bpf/spool].
    #[arg(long, value_name = "DIR")]
    pub queue_dir: Option<PathBuf>,
    /// Most bytes the spool holds; the oldest windows are deleted beyond it [default: 256M].
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub spool_size: Option<u64>,
    /// Memory for one window's samples [default: 16M].
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub buffer_size: Option<u64>,
    /// Also record off-CPU time (where threads block, and for how long), as the profiles'
    /// `off_cpu` sample type.
    #[arg(long)]
    pub off_cpu: bool,
    /// Off-CPU blocks shorter than this are summed per thread (e.g. 0.5ms, 2ms; a plain
    /// number is milliseconds) [default: 1ms].
    #[arg(long, value_name = "DURATION", value_parser = duration::millis)]
    pub off_cpu_min: Option<Duration>,
    /// How user stacks are walked (see `record --unwind`) [default: dwarf-fp].
    #[arg(long, value_enum)]
    pub unwind: Option<Unwind>,
    /// Kernel memory for unwind tables (MiB) [default: 64].
    #[arg(long, value_name = "MIB")]
    pub unwind_table_mb: Option<u32>,
    /// Do not read Python frames from CPython processes (see `record --no-python`).
    #[arg(long)]
    pub no_python: bool,
    /// Also write every window to this ClickHouse server's HTTP interface (e.g.
    /// `http://db:8123`, `?database=NAME` for another database than `default`); the tables are
    /// created if missing.
    #[arg(long, value_name = "URL")]
    pub clickhouse: Option<String>,
    /// Days ClickHouse keeps windows (a table TTL, or partitions dropped by the agent on
    /// servers before 19.6) [default: 30].
    #[arg(long, value_name = "DAYS")]
    pub clickhouse_retention: Option<u32>,
    /// Push every window to Grafana Pyroscope at URL (e.g. http://pyroscope:4040).
    #[arg(long, value_name = "URL")]
    pub pyroscope: Option<String>,
    /// File holding `user:password` for the Pyroscope server's basic auth.
    #[arg(long, value_name = "FILE")]
    pub pyroscope_basic_auth_file: Option<PathBuf>,
    /// File holding a bearer token for the Pyroscope server.
    #[arg(long, value_name = "FILE")]
    pub pyroscope_token_file: Option<PathBuf>,
    /// File holding the tenant id sent as `X-Scope-OrgID` (multi-tenant Pyroscope).
    #[arg(long, value_name = "FILE")]
    pub pyroscope_tenant_file: Option<PathBuf>,
    /// The `host` label [default: this host's name].
    #[arg(long, value_name = "NAME")]
    pub host: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics (`IP:PORT`; port 0 picks a free one),
    /// or `off` [default: 127.0.0.1:9749]. Only a loopback address unless you give another.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// Only warnings and errors on stderr.
    #[arg(short = 'q', long)]
    pub quiet: bool,
    /// Keep the last DURATION (e.g. 5m; a plain number is seconds) at full detail, within
    /// --buffer-size, for `rsprof-bpf dump` and SIGUSR1.
    #[arg(long, value_name = "DURATION", value_parser = duration::secs)]
    pub flight_recorder: Option<Duration>,
    /// The flight recorder's root-only dump socket [default: /run/rsprof-bpf/agent.sock].
    #[arg(long, value_name = "PATH")]
    pub dump_socket: Option<PathBuf>,
    /// SIGUSR1 writes the flight recorder here (created 0700; files 0600).
    #[arg(long, value_name = "DIR")]
    pub dump_dir: Option<PathBuf>,
    /// Hold the first exec of each new file (at most 50 ms) until its USDT probes are attached,
    /// as `record --all` does; off by default so the agent can never stall the host's execs.
    #[arg(long)]
    pub usdt_exec_gate: bool,
}

#[derive(Args, Debug, Clone)]
pub struct QueryArgs {
    /// The agent's spool directory to read.
    #[arg(long, value_name = "DIR", required_unless_present = "clickhouse")]
    #[arg(conflicts_with = "clickhouse")]
    pub spool: Option<PathBuf>,
    /// A ClickHouse server the agents write to (`--clickhouse`), e.g. `http://db:8123`; a
    /// `?database=NAME` parameter picks the database.
    #[arg(long, value_name = "URL")]
    pub clickhouse: Option<String>,
    /// Windows ending after this time: RFC 3339 (`2026-11-23T14:00:00Z`) or relative to now
    /// (`-1h`, `-30m`) [default: all].
    #[arg(long, value_name = "TIME", allow_hyphen_values = true)]
    pub from: Option<String>,
    /// Windows starting before this time (same forms) [default: now].
    #[arg(long, value_name = "TIME", allow_hyphen_values = true)]
    pub to: Option<String>,
    /// Only these hosts. Repeatable.
    #[arg(long, value_name = "HOST")]
    pub host: Vec<String>,
    /// Only these services (`service_name`). Repeatable.
    #[arg(long, value_name = "SERVICE")]
    pub service: Vec<String>,
    /// Only processes of these names (samples of a service's window are selected by their
    /// process). Repeatable.
    #[arg(long, value_name = "NAME")]
    pub process: Vec<String>,
    /// Only the processes with these pids (with --host, pids being per host). Repeatable.
    #[arg(long, value_name = "PID")]
    pub pid: Vec<u32>,
    /// Only containers with this id (or a prefix of it; LXC: name). Repeatable.
    #[arg(long, value_name = "ID")]
    pub container: Vec<String>,
    /// Output file; its name picks the format as for `record`; `-` for standard output.
    #[arg(short = 'o', long, value_name = "PATH")]
    pub output: PathBuf,
    /// Output format: gecko, pprof or collapsed. Default: from the output file's name.
    #[arg(long, value_parser = parse_format, value_name = "FORMAT")]
    pub format: Option<Format>,
    /// Gzip the output whatever its name (a `.gz` name always is).
    #[arg(short = 'z', long)]
    pub compress: bool,
    /// Name the frames agents left as addresses (stripped files) from debug files here, by
    /// build-id as under /usr/lib/debug (`DIR/.build-id/xx/rest.debug`).
    #[arg(long, value_name = "DIR")]
    pub debug_dir: Option<PathBuf>,
    /// No progress lines and no report.
    #[arg(short = 'q', long)]
    pub quiet: bool,
    #[command(flatten)]
    pub debuginfod: DebuginfodArgs,
}

#[derive(Args, Debug, Clone)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["path", "pid"])))]
pub struct ListUsdtArgs {
    /// ELF file to read.
    pub path: Option<PathBuf>,
    /// Process whose mapped files to read.
    #[arg(short = 'p', long = "pid", value_name = "PID")]
    pub pid: Option<u32>,
}

#[derive(Args, Debug, Clone)]
// --cgroup/--container alone select like a restricted --all; with -p or CMD they intersect.
#[command(group(clap::ArgGroup::new("target").required(true).multiple(true)
    .args(["all", "pid", "command", "cgroup", "container"])))]
pub struct RecordArgs {
    /// Profile every process on the machine.
    #[arg(short = 'a', long, conflicts_with_all = ["pid", "command"])]
    pub all: bool,

    /// Profile these processes (comma-separated pids), all their threads.
    #[arg(short = 'p', long = "pid", value_delimiter = ',', value_name = "PID")]
    #[arg(conflicts_with = "command")]
    pub pid: Vec<u32>,

    /// Only tasks in this cgroup v2 or below it, including cgroups created while recording.
    /// A directory under the cgroup v2 mount, or a path relative to it. Repeatable.
    #[arg(long, value_name = "PATH")]
    pub cgroup: Vec<String>,

    /// Only tasks in this container (id or unique id prefix; LXC: name). Repeatable.
    #[arg(long, value_name = "ID")]
    pub container: Vec<String>,

    /// Sampling frequency per CPU, in Hz.
    #[arg(short = 'F', long, default_value_t = 999, value_name = "HZ")]
    pub frequency: u64,

    /// What a thread's samples cover: `cpu`, its time on a CPU (plus time blocked with
    /// --off-cpu); `wall`, all of its time: CPU samples plus every stretch off the CPU
    /// (blocked, or runnable but waiting for a CPU), so its timeline adds up to wall time.
    #[arg(long, value_enum, default_value_t = Mode::Cpu)]
    pub mode: Mode,

    /// Also record where threads block and for how long (off-CPU time), with the stack at
    /// each switch-out to a sleeping state.
    #[arg(long)]
    pub off_cpu: bool,

    /// How user stacks are walked: `dwarf-fp` (the default) with the unwind tables
    /// (`.eh_frame`, `.debug_frame`) of the mapped files, in the kernel, following frame
    /// pointers through code without tables (JIT code, hand-written assembly; such stacks are
    /// flagged); `dwarf` the same without that fallback (such code ends the walk, flagged);
    /// `fp` frame pointers only (what most distribution binaries lack).
    #[arg(long, value_enum, default_value_t = Unwind::DwarfFp)]
    pub unwind: Unwind,

    /// Kernel memory for unwind tables (MiB; 8 bytes a row). When full, tables of files no
    /// running process maps are evicted (counted); files that still do not fit are counted, and
    /// their frames end the kernel's walk.
    #[arg(long, default_value_t = 64, value_name = "MIB")]
    pub unwind_table_mb: u32,

    /// Time the sampler per sample in the kernel and print the median and p99 at the end (for
    /// `cargo xtask bench-unwind`; off, it costs one branch per sample).
    #[arg(long, hide = true)]
    pub bpf_timing: bool,

    /// Do not read Python frames from CPython 3.8–3.13 processes (by default their stacks
    /// show the Python functions in place of the interpreter's eval loop).
    #[arg(long)]
    pub no_python: bool,

    /// Off-CPU blocks shorter than this (ms) are summed per thread and sent with the stack of
    /// the block that brings the sum to this length, which keeps context-switch storms cheap;
    /// longer ones are sent one by one.
    /// A plain number is milliseconds; units as for -d.
    #[arg(long, default_value = "1ms", value_parser = duration::millis, value_name = "DURATION")]
    pub off_cpu_min: Duration,

    /// Stop after this long: 10, 10s, 1500ms, 2m, 1h (a plain number is seconds) (default: on
    /// Ctrl-C, or when CMD exits).
    #[arg(short = 'd', long, value_name = "DURATION", value_parser = duration::secs)]
    pub duration: Option<Duration>,

    /// Output file; gzip-compressed when it ends in .gz. Its name picks the format unless
    /// --format does: .json[.gz] Gecko, .pb[.gz] or .pprof[.gz] pprof, .folded[.gz] or
    /// .collapsed[.gz] collapsed stacks; any other name Gecko. `-` is standard output; a
    /// device, FIFO or socket (`/dev/stdout`, a `mkfifo`) is written in place, a regular
    /// file atomically (a symlink is followed to its target).
    #[arg(short = 'o', long, default_value = "rsprof.json.gz", value_name = "PATH")]
    pub output: PathBuf,

    /// Output format: gecko (Firefox Profiler), pprof, or collapsed (flamegraph.pl / inferno
    /// input). Default: from the output file's name.
    #[arg(long, value_parser = parse_format, value_name = "FORMAT")]
    pub format: Option<Format>,

    /// Gzip the output whatever its name (a `.gz` name always is): for `-o -` or a pipe.
    #[arg(short = 'z', long)]
    pub compress: bool,

    /// No live status line and no summary.
    #[arg(short = 'q', long)]
    pub quiet: bool,

    /// The full report at the end (every counter of the kernel, the collector, the unwinder
    /// and the symbolizer), not just the few lines of the summary. A Gecko profile carries it
    /// either way, in `meta.rsprof.report`.
    /// `RSPROF_VERBOSE=1` does the same (any value but 0, false, no, off or empty).
    #[arg(short = 'v', long, env = "RSPROF_VERBOSE", value_parser = FalseyValueParser::new())]
    pub verbose: bool,

    /// Size of the kernel→user ring buffer (bytes; K/M suffixes). Rounded up to a power of two.
    /// [default: 2 KiB per sample per CPU at -F; 4M–16M]
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub ring_buffer_size: Option<u64>,

    /// Record hits of a USDT probe as instant markers (repeatable). Without @PATH it is looked
    /// for in every file of the profiled processes. `rsprof` provider probes are always
    /// recorded.
    #[arg(long = "usdt", value_name = "PROVIDER:NAME[@PATH]")]
    pub usdt: Vec<String>,

    /// Record intervals from a USDT start probe to the next end probe on the same thread.
    #[arg(long = "usdt-interval", value_name = "PROVIDER:START:END[@PATH]")]
    pub usdt_interval: Vec<String>,

    /// Write every USDT hit as a text line to this file (for debugging and tests).
    #[arg(long, hide = true, value_name = "PATH")]
    pub usdt_dump: Option<PathBuf>,

    /// Also save what the recording read — every ring-buffer record, and the /proc facts and
    /// kernel names it used — to this file, for `rsprof-bpf replay` (no root needed there): to
    /// debug a profile from a bug report.
    #[arg(long, value_name = "FILE")]
    pub save_raw: Option<PathBuf>,
    /// Memory for recorded samples and markers (K/M/G suffixes). When full, the oldest data is
    /// recycled: the profile holds the newest window.
    #[arg(long, default_value = "64M", value_parser = parse_size, value_name = "SIZE")]
    pub buffer_size: u64,

    #[command(flatten)]
    pub debuginfod: DebuginfodArgs,

    /// Run this command and profile it and its children.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// Where debug files of stripped files are fetched from (see `symbolize::debuginfod`).
#[derive(Args, Debug, Clone, Default)]
pub struct DebuginfodArgs {
    /// debuginfod servers to fetch debug files of stripped files from, by build-id, tried in
    /// order [default: $DEBUGINFOD_URLS, space-separated]. Cached as gdb and perf cache them
    /// ($DEBUGINFOD_CACHE_PATH or ~/.cache/debuginfod_client).
    #[arg(long, value_name = "URL", num_args = 1.., conflicts_with = "no_debuginfod")]
    pub debuginfod: Vec<String>,
    /// Never ask a debuginfod server (even with $DEBUGINFOD_URLS set).
    #[arg(long)]
    pub no_debuginfod: bool,
    /// Timeout of one debuginfod request.
    #[arg(long, default_value = "15s", value_parser = duration::secs, value_name = "DURATION")]
    pub debuginfod_timeout: Duration,
    /// Longest an export waits for debuginfod in all; files still coming are used next time.
    #[arg(long, default_value = "60s", value_parser = duration::secs, value_name = "DURATION")]
    pub debuginfod_budget: Duration,
}

impl DebuginfodArgs {
    /// Makes symbolization in this process use debuginfod as these arguments say (`quiet`:
    /// without progress lines).
    pub fn apply(&self, quiet: bool) {
        crate::symbolize::debuginfod::configure(self.config(quiet));
    }

    /// The debuginfod configuration these arguments say (None: none).
    pub fn config(&self, quiet: bool) -> Option<crate::symbolize::debuginfod::Config> {
        use crate::symbolize::debuginfod::Config;
        let config = match (self.no_debuginfod, self.debuginfod.is_empty()) {
            (true, _) => None,
            (false, true) => Config::from_env(),
            (false, false) => Config::with_urls(self.debuginfod.clone()),
        };
        config.map(|c| Config {
            timeout: self.debuginfod_timeout,
            budget: self.debuginfod_budget,
            quiet,
            ..c
        })
    }
}

pub fn parse_format(s: &str) -> Result<Format, String> {
    Format::from_name(s).ok_or_else(|| {
        let names: Vec<_> = Format::ALL.iter().map(|f| f.name()).collect();
        format!("unknown format '{s}' (one of: {})", names.join(", "))
    })
}

#[derive(ValueEnum, serde::Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Unwind {
    Dwarf,
    DwarfFp,
    Fp,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Cpu,
    Wall,
}

/// Parses `123`, `64K`, `16M`, `1G` (binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.eq_ignore_ascii_case(&'k') => (&s[..i], 1u64 << 10),
        Some((i, c)) if c.eq_ignore_ascii_case(&'m') => (&s[..i], 1 << 20),
        Some((i, c)) if c.eq_ignore_ascii_case(&'g') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    let n: u64 = num.parse().map_err(|_| format!("invalid size '{s}'"))?;
    n.checked_mul(mult).ok_or_else(|| format!("size '{s}' too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("16M"), Ok(16 << 20));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("x").is_err());
    }

    #[test]
    fn record_is_the_default_command() {
        let c = Cli::try_parse_from(["rsprof-bpf", "--all", "-F", "99"]).unwrap();
        assert!(c.record.all && c.record.frequency == 99 && c.command.is_none());
        let c = Cli::try_parse_from(["rsprof-bpf", "record", "-p", "1,2"]).unwrap();
        let Some(Command::Record(r)) = c.command else { panic!() };
        assert_eq!(r.pid, vec![1, 2]);
        let c = Cli::try_parse_from(["rsprof-bpf", "--", "sleep", "1"]).unwrap();
        assert_eq!(c.record.command, vec!["sleep", "1"]);
        assert!(Cli::try_parse_from(["rsprof-bpf", "-F", "99"]).is_err(), "a target is required");
        let c = Cli::try_parse_from(["rsprof-bpf", "-a", "--mode", "wall"]).unwrap();
        let ms = Duration::from_millis;
        assert!(c.record.mode == Mode::Wall && !c.record.off_cpu && c.record.off_cpu_min == ms(1));
        let c = Cli::try_parse_from(["rsprof-bpf", "-a", "--off-cpu", "--off-cpu-min", "5"]);
        let c = c.unwrap();
        assert!(c.record.mode == Mode::Cpu && c.record.off_cpu && c.record.off_cpu_min == ms(5));
        assert_eq!(c.record.unwind, Unwind::DwarfFp, "tables by default");
        let c = Cli::try_parse_from(["rsprof-bpf", "-a", "--unwind", "fp"]).unwrap();
        assert_eq!(c.record.unwind, Unwind::Fp);
    }

    #[test]
    fn cgroup_filters_combine_with_targets() {
        let c = Cli::try_parse_from(["rsprof-bpf", "--cgroup", "/a", "--cgroup", "b"]).unwrap();
        assert_eq!(c.record.cgroup, vec!["/a", "b"]);
        let c = Cli::try_parse_from(["rsprof-bpf", "-p", "1", "--container", "3f2a"]).unwrap();
        assert_eq!((c.record.pid, c.record.container), (vec![1], vec!["3f2a".to_owned()]));
        let c = Cli::try_parse_from(["rsprof-bpf", "--all", "--cgroup", "/a"]).unwrap();
        assert!(c.record.all);
        let c = Cli::try_parse_from(["rsprof-bpf", "--cgroup", "/a", "--", "make"]).unwrap();
        assert_eq!(c.record.command, vec!["make"]);
        assert!(Cli::try_parse_from(["rsprof-bpf", "--all", "-p", "1"]).is_err());
        assert!(Cli::try_parse_from(["rsprof-bpf", "-p", "1", "--", "make"]).is_err());
        let c = Cli::try_parse_from(["rsprof-bpf", "list-containers"]).unwrap();
        assert!(matches!(c.command, Some(Command::ListContainers)));
    }

    /// Every option that takes a time takes the same units; a plain number keeps its unit.
    #[test]
    fn one_duration_syntax() {
        let rec = |argv: &[&str]| {
            let mut full = vec!["rsprof-bpf", "-a"];
            full.extend(argv);
            Cli::try_parse_from(full).map(|c| c.record)
        };
        assert_eq!(rec(&["-d", "1500ms"]).unwrap().duration, Some(Duration::from_millis(1500)));
        assert_eq!(rec(&["-d", "2"]).unwrap().duration, Some(Duration::from_secs(2)));
        assert_eq!(rec(&["--off-cpu-min", "2s"]).unwrap().off_cpu_min, Duration::from_secs(2));
        let e = rec(&["-d", "5x"]).unwrap_err().to_string();
        assert!(e.contains("invalid duration '5x'"), "{e}");
        let agent = |argv: &[&str]| {
            let mut full = vec!["rsprof-bpf", "agent"];
            full.extend(argv);
            match Cli::try_parse_from(full).unwrap().command {
                Some(Command::Agent(a)) => a,
                _ => panic!(),
            }
        };
        assert_eq!(agent(&["--window", "5s"]).window, Some(Duration::from_secs(5)));
        assert_eq!(agent(&["--window", "5"]).window, Some(Duration::from_secs(5)));
        let fr = agent(&["--flight-recorder", "2m"]).flight_recorder;
        assert_eq!(fr, Some(Duration::from_secs(120)));
        assert_eq!(agent(&["--off-cpu-min", "3"]).off_cpu_min, Some(Duration::from_millis(3)));
        let c = Cli::try_parse_from(["rsprof-bpf", "dump", "--last", "90", "-o", "x.json"]);
        match c.unwrap().command {
            Some(Command::Dump(d)) => assert_eq!(d.last, Some(Duration::from_secs(90))),
            _ => panic!(),
        }
    }
}
