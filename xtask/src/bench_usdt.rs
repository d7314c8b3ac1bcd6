//! `cargo xtask bench-usdt`: what one `rsprof` provider probe hit costs the instrumented
//! program, with rsprof-bpf attached and without (semaphore off).
//!
//! `tests/fixtures/usdt_bench.c` runs N iterations of one probe kind and prints its own
//! nanoseconds per iteration (timed inside the program, so profiler start-up is excluded):
//! alone, and as `rsprof-bpf -q -o <tmp> -- usdt_bench KIND N`. The cost per hit is the
//! difference to the bare loop, per probe hit. Results go to a section of BENCHMARKS.md.

use std::{
    fmt::Write as _,
    fs,
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

use crate::{
    bench::{median_f64, utc_now},
    build, step, workspace_root,
};

const SECTION_BEGIN: &str =
    "<!-- BEGIN cargo xtask bench-usdt (generated; edits are overwritten) -->";
const SECTION_END: &str = "<!-- END cargo xtask bench-usdt -->";

/// (kind, probe hits per iteration, what it does)
const KINDS: &[(&str, u64, &str)] = &[
    ("counter", 1, "`RSPROF_COUNTER(name, i)`: 1 string + 1 integer"),
    ("marker", 1, "`RSPROF_MARKER(name, text)`: 2 strings"),
    (
        "label",
        2,
        "`RSPROF_LABEL_PUSH(l)` + `RSPROF_LABEL_POP()`: kernel-side stack (the push walks the user stack to place the label), nothing sent",
    ),
];

#[derive(clap::Args)]
pub struct BenchUsdtArgs {
    /// Iterations per run.
    #[arg(long, default_value_t = 200_000)]
    iterations: u64,
    /// Runs per configuration; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Only print the results; leave BENCHMARKS.md alone.
    #[arg(long)]
    no_write: bool,
}

/// ns per iteration printed by the fixture (`KIND N NS`).
fn ns_per_iter(cmd: &mut Command) -> anyhow::Result<f64> {
    let out = cmd.stdin(Stdio::null()).stderr(Stdio::null()).output().context("run usdt_bench")?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .last()
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no timing in {text:?}"))
}

pub fn bench_usdt(args: BenchUsdtArgs) -> anyhow::Result<()> {
    if !crate::is_root() {
        bail!("the benchmark must run as root (rsprof-bpf loads BPF programs)");
    }
    if args.runs == 0 || args.iterations == 0 {
        bail!("--runs and --iterations must be positive");
    }
    let profiler = build()?;
    step("bench-usdt: building tests/fixtures/usdt_bench.c");
    let fixture = ::tests::fixtures::build("usdt_bench.c")?;
    let tmp = std::env::temp_dir().join(format!("rsprof-bench-usdt-{}", std::process::id()));
    fs::create_dir_all(&tmp)?;
    let out = tmp.join("bench.json");
    let n = args.iterations.to_string();
    let alone = |kind: &str| {
        let mut c = Command::new(&fixture);
        c.args([kind, &n]);
        c
    };
    let under = |kind: &str| {
        let mut c = Command::new(&profiler);
        c.arg("-q").arg("-o").arg(&out).arg("--").arg(&fixture).args([kind, &n]);
        c
    };
    let mut base = Vec::new();
    let mut rows = Vec::new();
    for run in 0..args.runs {
        step(&format!("bench-usdt: run {}/{}", run + 1, args.runs));
        base.push(ns_per_iter(&mut alone("none"))?);
        for (i, (kind, _, _)) in KINDS.iter().enumerate() {
            if rows.len() <= i {
                rows.push((Vec::new(), Vec::new()));
            }
            rows[i].0.push(ns_per_iter(&mut alone(kind))?);
            rows[i].1.push(ns_per_iter(&mut under(kind))?);
        }
    }
    let _ = fs::remove_dir_all(&tmp);
    let base = median_f64(base);
    let mut t = String::new();
    let _ = writeln!(t, "## USDT probe cost: `cargo xtask bench-usdt`\n");
    let _ =
        writeln!(t, "- Date: {}; {} online CPUs; kernel {}", utc_now(), online_cpus(), kernel());
    let _ = writeln!(
        t,
        "- Command: `cargo xtask bench-usdt{}{}`; fixture `tests/fixtures/usdt_bench.c` (`include/rsprof.h`), {} iterations per run, median of {} runs",
        if args.iterations != 200_000 {
            format!(" --iterations {}", args.iterations)
        } else {
            String::new()
        },
        if args.runs != 3 { format!(" --runs {}", args.runs) } else { String::new() },
        args.iterations,
        args.runs
    );
    let _ = writeln!(
        t,
        "- Off: the fixture alone (semaphores 0: the probe is a load and a branch). On: under `rsprof-bpf -q -o <tmp> -- usdt_bench KIND N`. The bare loop takes {base:.2} ns per iteration; cost per hit = (ns per iteration − bare loop) / hits per iteration.\n"
    );
    let _ = writeln!(t, "| Probe | Hits per iteration | Off: ns per hit | On: ns per hit |");
    let _ = writeln!(t, "|---|---:|---:|---:|");
    for ((kind, hits, what), (off, on)) in KINDS.iter().zip(rows) {
        let (off, on) = (median_f64(off), median_f64(on));
        let per = |v: f64| (v - base).max(0.0) / *hits as f64;
        let _ = writeln!(t, "| {kind}: {what} | {hits} | {:.2} | {:.0} |", per(off), per(on));
    }
    println!("{t}");
    if !args.no_write {
        update_section(&workspace_root().join("BENCHMARKS.md"), &t)?;
        println!("updated BENCHMARKS.md");
    }
    Ok(())
}

fn online_cpus() -> i64 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }
}

fn kernel() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

fn update_section(path: &Path, body: &str) -> anyhow::Result<()> {
    let old = fs::read_to_string(path).unwrap_or_default();
    let section = format!("{SECTION_BEGIN}\n{body}{SECTION_END}\n");
    let new = match (old.find(SECTION_BEGIN), old.find(SECTION_END)) {
        (Some(b), Some(e)) if b < e => {
            let end = e + SECTION_END.len();
            let end = if old[end..].starts_with('\n') { end + 1 } else { end };
            format!("{}{section}{}", &old[..b], &old[end..])
        }
        _ => format!("{old}{}{section}", if old.ends_with('\n') { "\n" } else { "\n\n" }),
    };
    fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}
