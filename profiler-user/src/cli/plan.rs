//! A recording's arguments validated once into a [`RecordPlan`]: sizes and rates checked,
//! pids checked to exist, USDT requests parsed, cgroup/container selection resolved. Nothing
//! after this parses or re-checks an argument.

use std::{path::PathBuf, time::Duration};

use anyhow::{Result, bail};

use crate::{
    cli::args::{Mode, RecordArgs, Unwind},
    export::output::Destination,
    model::ids::Pid,
    system::{cgroup::filter::Selection, host},
    usdt::{self, ProbeRequest},
    writers::Format,
};

/// What to profile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// Every process (possibly restricted by `cgroups`).
    All,
    Pids(Vec<Pid>),
    /// Run this command and profile it and its children.
    Command(Vec<String>),
}

pub struct RecordPlan {
    pub target: Target,
    /// `--cgroup`/`--container`, resolved to cgroups.
    pub cgroups: Option<Selection>,
    pub frequency: u64,
    pub duration: Option<Duration>,
    pub output: PathBuf,
    /// What `output` is (a file, or a stream written in place), resolved once.
    pub output_dest: Destination,
    /// `-z`: gzip whatever the output's name.
    pub compress: bool,
    /// From --format, else from the output's name.
    pub format: Format,
    pub quiet: bool,
    /// `-v`: the full report instead of the short summary.
    pub verbose: bool,
    pub buffer_bytes: usize,
    /// A power of two.
    pub ring_bytes: u32,
    pub usdt_requests: Vec<ProbeRequest>,
    /// `--usdt-interval` specs, by interval id.
    pub usdt_intervals: Vec<String>,
    pub usdt_dump: Option<PathBuf>,
    /// `--save-raw`.
    pub save_raw: Option<PathBuf>,
    /// `profiler_common::OFF_CPU_*`.
    pub off_cpu: u32,
    pub off_cpu_min_ns: u64,
    /// `profiler_common::UNWIND_MODE_*`.
    pub unwind_mode: u32,
    /// Capacity of the unwind rows array.
    pub unwind_rows: u32,
    /// Hidden `--bpf-timing`.
    pub bpf_timing: bool,
    /// Read CPython frames (not `--no-python`).
    pub python: bool,
    /// Hold first execs of new files for their USDT probes (`usdt::gate`) with `--all` or a
    /// command: on for `record`, where someone is watching; the agent's `--usdt-exec-gate`.
    pub usdt_exec_gate: bool,
    /// New images and code mappings wake the loop (`Config::wake_for_tables`) and get their
    /// walker entries at once, within milliseconds: on for `record`. The agent waits for a
    /// process to be sampled or to live `unwind::DEFER_YOUNG` (most never are, under churn).
    pub eager_tables: bool,
}

impl RecordPlan {
    pub fn from_args(args: RecordArgs) -> Result<Self> {
        let max = host::max_sample_rate();
        if args.frequency == 0 || args.frequency > max {
            bail!(
                "invalid frequency {} Hz: must be between 1 and {max} (kernel.perf_event_max_sample_rate)",
                args.frequency
            );
        }
        if args.duration == Some(Duration::ZERO) {
            bail!("invalid duration 0: must be longer than that");
        }
        if args.buffer_size < (64 << 10) || args.buffer_size > (64 << 30) {
            bail!("invalid buffer size {}: must be between 64K and 64G", args.buffer_size);
        }
        let ring_buffer_size = args
            .ring_buffer_size
            .unwrap_or_else(|| default_ring_bytes(args.frequency, RECORD_MIN_RING));
        if !((4096..=(1 << 30)).contains(&ring_buffer_size)) {
            bail!("invalid ring buffer size {ring_buffer_size}: must be between 4K and 1G");
        }
        let format = output_format(&args.output, args.format)?;
        if args.off_cpu_min > Duration::from_secs(60) {
            bail!("invalid --off-cpu-min {:?}: must be at most 60s", args.off_cpu_min);
        }
        let off_cpu = match (args.mode, args.off_cpu) {
            (Mode::Wall, _) => profiler_common::OFF_CPU_WALL,
            (Mode::Cpu, true) => profiler_common::OFF_CPU_BLOCKED,
            (Mode::Cpu, false) => profiler_common::OFF_CPU_NONE,
        };
        if args.unwind_table_mb == 0 || args.unwind_table_mb > 4096 {
            bail!("invalid --unwind-table-mb {}: must be between 1 and 4096", args.unwind_table_mb);
        }
        let unwind_mode = match args.unwind {
            Unwind::Dwarf => profiler_common::UNWIND_MODE_DWARF,
            Unwind::DwarfFp => profiler_common::UNWIND_MODE_DWARF_FP,
            Unwind::Fp => profiler_common::UNWIND_MODE_FP,
        };
        let row = std::mem::size_of::<profiler_common::UnwindRow>() as u64;
        let unwind_rows = (u64::from(args.unwind_table_mb) << 20) / row;
        let (usdt_requests, usdt_intervals) =
            usdt::requests_from_args(&args.usdt, &args.usdt_interval)?;
        let target = if !args.command.is_empty() {
            Target::Command(args.command)
        } else if !args.pid.is_empty() {
            for &pid in &args.pid {
                if pid == 0 || !host::process_exists(Pid(pid)) {
                    bail!("no process with pid {pid}");
                }
            }
            Target::Pids(args.pid.into_iter().map(Pid).collect())
        } else {
            Target::All
        };
        Ok(Self {
            target,
            cgroups: Selection::from_args(&args.cgroup, &args.container)?,
            frequency: args.frequency,
            duration: args.duration,
            output_dest: Destination::resolve(&args.output)?,
            output: args.output,
            compress: args.compress,
            format,
            quiet: args.quiet,
            verbose: args.verbose,
            buffer_bytes: args.buffer_size as usize,
            ring_bytes: ring_buffer_size.next_power_of_two() as u32,
            usdt_requests,
            usdt_intervals,
            usdt_dump: args.usdt_dump,
            save_raw: args.save_raw,
            off_cpu,
            off_cpu_min_ns: args.off_cpu_min.as_nanos() as u64,
            unwind_mode,
            unwind_rows: unwind_rows as u32,
            bpf_timing: args.bpf_timing,
            python: !args.no_python,
            usdt_exec_gate: true,
            eager_tables: true,
        })
    }

    /// What the recording covers, for the "sampling …" line.
    pub fn describe(&self) -> String {
        let what = match &self.target {
            Target::All => "all processes".to_owned(),
            Target::Pids(pids) => {
                format!("pid {}", pids.iter().map(Pid::to_string).collect::<Vec<_>>().join(","))
            }
            Target::Command(cmd) => format!("'{}' and its children", cmd.join(" ")),
        };
        match (&self.cgroups, &self.target) {
            (Some(c), Target::All) => c.describe(),
            (Some(c), _) => format!("{what} in {}", c.describe()),
            (None, _) => what,
        }
    }
}

/// The ring buffer when `--ring-buffer-size` is not given: 2 KiB per sample per CPU at the
/// rate (a full-depth kernel and user stack, or half a typical stack copy), between `min` and
/// 16 MiB. It need not hold a second of copies: past a quarter full every record wakes the
/// loop, and the copy budget (`bpf::object`) is a quarter of the ring per 100 ms. The kernel
/// maps a ring's pages twice, so it counts twice in RSS: the 16 MiB that 8 KiB per sample gave
/// at 999 Hz on 2 CPUs was 32 MiB of the recording's RSS and a 66 MiB start-up peak, for
/// samples that fill a few hundred KiB a second. Recordings take at least `RECORD_MIN_RING`;
/// the agent, at fleet rates, less.
pub fn default_ring_bytes(frequency: u64, min: u64) -> u64 {
    let cpus = u64::from(host::online_cpus());
    (cpus * frequency.max(1) * 2048).next_power_of_two().clamp(min, 16 << 20)
}

/// The smallest default ring of a recording (`default_ring_bytes`).
pub const RECORD_MIN_RING: u64 = 4 << 20;

/// `--format` if given, else what the output's name implies (Gecko for other names). A
/// `--format` that the name contradicts is an error: the file would be misread.
pub fn output_format(output: &std::path::Path, explicit: Option<Format>) -> Result<Format> {
    match (explicit, Format::from_path(output)) {
        (Some(f), Some((implied, ext))) if f != implied => bail!(
            "--format {f} contradicts the output name {} ({ext} is {implied}); change the name \
             or drop --format",
            output.display()
        ),
        (Some(f), _) => Ok(f),
        (None, implied) => Ok(implied.map_or(Format::Gecko, |(f, _)| f)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::args::Cli;
    use clap::Parser as _;

    fn plan(argv: &[&str]) -> Result<RecordPlan> {
        let mut full = vec!["rsprof-bpf"];
        full.extend(argv);
        RecordPlan::from_args(Cli::try_parse_from(full).unwrap().record)
    }

    #[test]
    fn validates_once() {
        let p = plan(&["--all", "-F", "99", "-d", "1.5", "--ring-buffer-size", "5000"]).unwrap();
        assert_eq!(p.target, Target::All);
        assert_eq!(p.duration, Some(Duration::from_millis(1500)));
        assert_eq!(p.ring_bytes, 8192);
        // Default ring: sized by the rate, within 4–16 MiB.
        assert_eq!(plan(&["--all", "-F", "1"]).unwrap().ring_bytes, 4 << 20);
        let fast = plan(&["--all", "-F", "999"]).unwrap().ring_bytes;
        assert!((4 << 20..=16 << 20).contains(&fast) && fast.is_power_of_two(), "{fast}");
        assert_eq!(p.describe(), "all processes");
        let me = std::process::id();
        let p = plan(&["-p", &me.to_string()]).unwrap();
        assert_eq!(p.target, Target::Pids(vec![Pid(me)]));
        let p = plan(&["--", "sleep", "1"]).unwrap();
        assert_eq!(p.describe(), "'sleep 1' and its children");
        assert_eq!(p.format, Format::Gecko, "default output rsprof.json.gz");
        for (args, want) in [
            (&["-o", "x.pb.gz"][..], Format::Pprof),
            (&["-o", "x.pprof"], Format::Pprof),
            (&["-o", "x.folded"], Format::Collapsed),
            (&["-o", "x.collapsed.gz"], Format::Collapsed),
            (&["-o", "out"], Format::Gecko),
            (&["-o", "out", "--format", "pprof"], Format::Pprof),
            (&["-o", "x.pb", "--format", "pprof"], Format::Pprof),
            (&["-o", "x.txt", "--format", "collapsed"], Format::Collapsed),
        ] {
            let mut argv = vec!["--all"];
            argv.extend(args);
            assert_eq!(plan(&argv).unwrap().format, want, "{args:?}");
        }
        let e = plan(&["--all", "--format", "pprof", "-o", "x.json.gz"]).err().unwrap();
        assert_eq!(
            e.to_string(),
            "--format pprof contradicts the output name x.json.gz (.json.gz is gecko); change the \
             name or drop --format"
        );
        for bad in [
            &["--all", "-F", "0"][..],
            &["--all", "-d=0"],
            &["--all", "--off-cpu-min", "61s"],
            &["--all", "--buffer-size", "1K"],
            &["--all", "--usdt", "nocolon"],
            &["-p", "4294967294"],
            &["--all", "--format", "pprof", "-o", "x.json.gz"],
            &["--all", "--format", "gecko", "-o", "x.folded"],
            &["--all", "--format", "collapsed", "-o", "x.pb.gz"],
        ] {
            assert!(plan(bad).is_err(), "{bad:?}");
        }
    }
}
