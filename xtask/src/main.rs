//! Developer tasks for rsprof-bpf, run as `cargo xtask <command>`.
//!
//! * `setup`  installs what building and testing need (nightly + rust-src, bpf-linker, Debian
//!   packages, the Firefox Profiler's CLI, Go's pprof built from Debian's sources), idempotently.
//! * `build`  setup (what building needs), then builds the release profiler
//!   (`target/release/rsprof-bpf`).
//! * `run`    setup, build, then runs the profiler with the given arguments (as root).
//! * `test`   setup, build, then the whole test suite, tests running one at a time.
//! * `bench`  measures the profiler's overhead next to `perf record`, see `bench.rs`.
//! * `bench-cgroup` measures the kernel cgroup filter's cost, see `bench_cgroup.rs`.
//! * `bench-agent` measures the agent's all-day cost, see `bench_agent.rs`.
//! * `bench-dump` measures a flight recorder dump, see `bench_dump.rs`.
//! * `bench-offcpu` measures off-CPU recording under a context-switch storm, see
//!   `bench_offcpu.rs`.
//! * `bench-cost` measures the profiler's own CPU and RSS while recording system-wide, idle and
//!   busy with an exec storm, next to `perf record`, see `bench_cost.rs`.
//! * `bench-unwind` compares user stack unwinding without frame pointers with perf and samply,
//!   see `bench_unwind.rs`.
//! * `bench-python` measures reading CPython's frames in the kernel (BPF time per sample with
//!   and without it) and the profiler's cost on a Python workload next to py-spy, see
//!   `bench_python.rs`.

mod bench;
mod bench_agent;
mod bench_cgroup;
mod bench_cost;
mod bench_dump;
mod bench_metrics;
mod bench_offcpu;
mod bench_python;
mod bench_storage;
mod bench_unwind;
mod bench_usdt;
mod layers;
mod setup;

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

use anyhow::Context as _;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", bin_name = "cargo xtask", about = "Developer tasks for rsprof-bpf")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what is missing: nightly toolchain with rust-src, bpf-linker 0.10.4, the
    /// Debian packages gcc, linux-perf, systemtap-sdt-dev, nodejs, npm, clickhouse-server and
    /// clickhouse-client (18.16 on Debian 12, started by the ClickHouse tests), and the Firefox
    /// Profiler's CLI (npm @firefox-devtools/profiler-cli) in target/profiler-cli, and py-spy
    /// (pip, for bench-python) in target/py-spy. Safe to run repeatedly.
    Setup,
    /// Setup, then build the release profiler: cargo build --release -p profiler-user.
    Build {
        /// Skip the setup step.
        #[arg(long)]
        no_setup: bool,
    },
    /// Setup, build, then run target/release/rsprof-bpf with ARGS (through `sudo -E` unless
    /// root).
    Run {
        /// Skip the setup step.
        #[arg(long)]
        no_setup: bool,
        /// Arguments for rsprof-bpf, e.g. `cargo xtask run -- --all -F 999 -o out.json.gz`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Setup, then the root-free crates' tests, then build and run the profiler's unit and
    /// integration tests (release, --test-threads=1); each tier's time is printed.
    Test {
        /// Skip the setup step.
        #[arg(long)]
        no_setup: bool,
        /// Extra arguments for the test harnesses (after --test-threads=1), e.g. a test name.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        test_args: Vec<OsString>,
    },
    /// Print the imports between each crate's top-level modules; fail on a cycle.
    Layers,
    /// Measure the profiler's overhead against perf record and update BENCHMARKS.md.
    Bench(bench::BenchArgs),
    /// Measure the cost of one USDT probe hit with and without the profiler attached and
    /// update BENCHMARKS.md.
    BenchUsdt(bench_usdt::BenchUsdtArgs),
    /// Measure the cgroup filter (kernel cost per filtered-out sample, profiler CPU with 1 of
    /// N busy cgroups selected vs --all) and update BENCHMARKS.md.
    BenchCgroup(bench_cgroup::BenchCgroupArgs),
    /// Measure off-CPU recording under a context-switch storm (slowdown and profiler CPU next
    /// to perf) and update BENCHMARKS.md.
    BenchOffcpu(bench_offcpu::BenchOffCpuArgs),
    /// Measure chunked storage (encode and Gecko throughput, bytes per sample) and a long
    /// recording with a small buffer (RSS over time); update BENCHMARKS.md.
    BenchStorage(bench_storage::BenchStorageArgs),
    /// Measure the agent's CPU, RSS and bytes written over long runs at fleet rates, idle
    /// and busy, and update BENCHMARKS.md.
    BenchAgent(bench_agent::BenchAgentArgs),
    /// Measure the profiler's own CPU and RSS while recording system-wide (idle, and busy with
    /// an exec storm) next to perf record; update BENCHMARKS.md.
    BenchCost(bench_cost::BenchCostArgs),
    /// Measure a flight recorder dump (latency, the agent's peak memory) of a full window at
    /// 99 Hz with every CPU busy, and update BENCHMARKS.md.
    BenchDump(bench_dump::BenchDumpArgs),
    /// Measure what a Prometheus scrape of the agent costs (agent CPU per scrape, latency);
    /// update BENCHMARKS.md.
    BenchMetrics(bench_metrics::BenchMetricsArgs),
    /// Measure unwinding without frame pointers (rsprof-bpf --unwind dwarf / fp, perf
    /// --call-graph dwarf, samply) on a C fixture and python3.11; update BENCHMARKS.md.
    BenchUnwind(bench_unwind::BenchUnwindArgs),
    /// Measure CPython frames read in the kernel (BPF ns per sample with and without
    /// --no-python at 10 and 50 Python frames) and the profiler's CPU, RSS and share of samples
    /// with Python frames next to py-spy; update BENCHMARKS.md.
    BenchPython(bench_python::BenchPythonArgs),
}

/// A failed command; `main` exits with its exit code.
#[derive(Debug)]
pub struct Failed {
    pub what: String,
    pub code: i32,
}

impl fmt::Display for Failed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` failed with exit code {}", self.what, self.code)
    }
}

impl std::error::Error for Failed {}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Setup => setup::setup(),
        // The README's first command is `cargo xtask run` on a fresh machine: setup comes first.
        Cmd::Build { no_setup } => setup_unless(no_setup).and_then(|()| build()).map(|_| ()),
        Cmd::Run { no_setup, args } => setup_unless(no_setup).and_then(|()| run(args)),
        Cmd::Test { no_setup, test_args } => test(no_setup, test_args),
        Cmd::Layers => layers::layers(),
        Cmd::Bench(args) => bench::bench(args),
        Cmd::BenchUsdt(args) => bench_usdt::bench_usdt(args),
        Cmd::BenchCost(args) => bench_cost::bench_cost(args),
        Cmd::BenchStorage(args) => bench_storage::bench_storage(args),
        Cmd::BenchCgroup(args) => bench_cgroup::bench_cgroup(args),
        Cmd::BenchOffcpu(args) => bench_offcpu::bench_offcpu(args),
        Cmd::BenchAgent(args) => bench_agent::bench_agent(args),
        Cmd::BenchDump(args) => bench_dump::bench_dump(args),
        Cmd::BenchMetrics(args) => bench_metrics::bench_metrics(args),
        Cmd::BenchUnwind(args) => bench_unwind::bench_unwind(args),
        Cmd::BenchPython(args) => bench_python::bench_python(args),
    };
    if let Err(err) = result {
        eprintln!("xtask: error: {err:#}");
        let code = err.downcast_ref::<Failed>().map_or(1, |f| f.code);
        std::process::exit(if code == 0 { 1 } else { code });
    }
}

/// The workspace root: the parent of this crate's directory.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask has a parent directory")
        .to_path_buf()
}

/// Cargo's target directory: `$CARGO_TARGET_DIR` (relative paths are taken from the workspace
/// root, where cargo is run) or `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => workspace_root().join(dir),
        None => workspace_root().join("target"),
    }
}

/// Path of the release profiler binary.
pub fn profiler_bin() -> PathBuf {
    target_dir().join("release").join("rsprof-bpf")
}

/// A `cargo` command (the same cargo that runs xtask) in the workspace root.
pub fn cargo() -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace_root());
    cmd
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Prints a step banner.
pub fn step(what: &str) {
    println!("\n==> {what}");
}

/// The command line of `cmd`, for messages.
pub fn display(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

/// Exit code of a finished process, 128+signal when killed by a signal.
pub fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt as _;
    status.code().or_else(|| status.signal().map(|s| 128 + s)).unwrap_or(1)
}

/// Runs `cmd` with inherited stdio, echoing it first; a non-zero exit becomes [`Failed`].
pub fn run_cmd(cmd: &mut Command) -> anyhow::Result<()> {
    let what = display(cmd);
    println!("$ {what}");
    let status = cmd.status().with_context(|| format!("could not start `{what}`"))?;
    if !status.success() {
        return Err(Failed { what, code: exit_code(status) }.into());
    }
    Ok(())
}

/// `cargo build --release -p profiler-user`; returns the binary's path.
pub fn build() -> anyhow::Result<PathBuf> {
    step("build: cargo build --release -p profiler-user");
    run_cmd(cargo().args(["build", "--release", "-p", "profiler-user"]))?;
    let bin = profiler_bin();
    anyhow::ensure!(bin.is_file(), "build succeeded but {} does not exist", bin.display());
    println!("built {}", bin.display());
    Ok(bin)
}

/// The quick setup check (installing what is missing) unless `--no-setup`.
fn setup_unless(no_setup: bool) -> anyhow::Result<()> {
    if no_setup { Ok(()) } else { setup::ensure() }
}

fn run(args: Vec<OsString>) -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt as _;

    let bin = build()?;
    let mut cmd = if is_root() {
        Command::new(&bin)
    } else {
        let mut sudo = Command::new("sudo");
        sudo.arg("-E").arg(&bin);
        sudo
    };
    cmd.args(&args);
    step(&format!("run: {}", display(&cmd)));
    let err = cmd.exec();
    Err(err).with_context(|| format!("could not execute `{}`", display(&cmd)))
}

/// The crates whose tests need no root, no kernel and no BPF toolchain: they run first, before
/// the profiler is built, so a broken writer or decoder shows in seconds.
const ROOT_FREE: [&str; 3] = ["rsprof-core", "profiler-unwind", "profiler-common"];

fn test(no_setup: bool, test_args: Vec<OsString>) -> anyhow::Result<()> {
    if !no_setup {
        setup::setup()?;
    }
    let mut tiers = Vec::new();
    let started = std::time::Instant::now();
    step("test, tier 1: root-free crates (no BPF, no root)");
    let mut root_free = vec!["test", "--release"];
    for c in ROOT_FREE {
        root_free.extend(["-p", c]);
    }
    root_free.extend(["--lib", "--tests", "--no-fail-fast", "--", "--test-threads=1"]);
    let mut cmd = cargo();
    cmd.args(&root_free).args(&test_args);
    tiers.push(("root-free crates", run_tests(cmd)?, started.elapsed()));

    let started = std::time::Instant::now();
    let bin = build()?;
    if !is_root() {
        eprintln!(
            "warning: not running as root; tests that load BPF programs will fail \
             (use `sudo -E cargo xtask test`)"
        );
    }
    step(&format!(
        "test, tier 2: the profiler's unit and integration tests (release, serial), RSPROF_BIN={}",
        bin.display()
    ));
    let mut cmd = cargo();
    cmd.args(["test", "--workspace", "--exclude", "profiler-ebpf"]);
    for c in ROOT_FREE {
        cmd.args(["--exclude", c]);
    }
    cmd.args([
        "--release",
        "--lib",
        "--bins",
        "--tests",
        // Every test binary runs even after one fails: CI shows all failures at once.
        "--no-fail-fast",
        "--",
        "--test-threads=1",
    ])
    .args(&test_args)
    .env("RSPROF_BIN", &bin);
    tiers.push(("profiler and integration (root, BPF)", run_tests(cmd)?, started.elapsed()));

    // One plain closing line per tier and for the whole run.
    println!();
    let (mut passed, mut failed, mut ok) = (0, 0, true);
    for (name, t, took) in &tiers {
        println!(
            "tier {name}: {} passed, {} failed in {:.0} s",
            t.passed,
            t.failed,
            took.as_secs_f64()
        );
        passed += t.passed;
        failed += t.failed;
        ok &= t.success;
    }
    println!("tests: {passed} passed, {failed} failed");
    if !ok {
        anyhow::bail!("tests failed");
    }
    if passed == 0 {
        anyhow::bail!("no test ran");
    }
    Ok(())
}

struct TierResult {
    passed: u64,
    failed: u64,
    success: bool,
}

/// Runs one `cargo test`, echoing its output and counting the harnesses' result lines. Doc tests
/// are left out (there are none), so the last runner line is a real count.
fn run_tests(mut cmd: Command) -> anyhow::Result<TierResult> {
    cmd.stdout(std::process::Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("could not run `{}`", display(&cmd)))?;
    let (mut passed, mut failed) = (0u64, 0u64);
    let stdout = child.stdout.take().expect("piped stdout");
    for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)).map_while(Result::ok) {
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            let count = |word: &str| {
                rest.split(';')
                    .find_map(|part| {
                        part.trim()
                            .trim_start_matches("ok. ")
                            .trim_start_matches("FAILED. ")
                            .strip_suffix(word)
                    })
                    .and_then(|n| n.trim().parse::<u64>().ok())
                    .unwrap_or(0)
            };
            passed += count(" passed");
            failed += count(" failed");
        }
    }
    let status = child.wait()?;
    Ok(TierResult { passed, failed, success: status.success() })
}
