//! `cargo xtask bench-unwind --cold-start`: a short command with big libraries, recorded from
//! its start (`record -- rustc -O small.rs`: librustc_driver 154 MB, libLLVM 200 MB, about
//! 0.3 s), where every table is new. Side by side in one run: rsprof-bpf with an empty disk
//! cache (cold), rsprof-bpf again with what the cold run left (warm: the disk cache and the
//! command's launch list), `perf record --call-graph dwarf` (+ `perf script`) and samply, each
//! `RUNS` times. A stack is complete when it reaches a root: `_start` (the main thread) or
//! `clone3`/`clone` (other threads); for rsprof-bpf also its own count (no `[truncated: …]`
//! frame), which is what the profile holds.

use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, bail};

use super::{BenchUnwindArgs, column, tail};
use crate::{
    bench::{online_cpus, utc_now},
    step,
};

pub(super) const SECTION_BEGIN: &str =
    "<!-- BEGIN cargo xtask bench-unwind --cold-start (generated; edits are overwritten) -->";
pub(super) const SECTION_END: &str = "<!-- END cargo xtask bench-unwind --cold-start -->";
/// Runs per tool: each a fresh command (the cold one with an emptied cache).
const RUNS: usize = 3;
const SOURCE: &str = "fn main() { let v: Vec<u64> = (0..1000).map(|x| x * x).collect(); println!(\"{}\", v.iter().sum::<u64>()); }\n";
/// Frames a complete stack ends in: the executable's entry, or a thread's start.
pub(super) const ROOTS: &[&str] = &["_start", "clone3", "__clone3", "clone", "__clone"];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tool {
    Cold,
    Warm,
    Perf,
    Samply,
}

impl Tool {
    fn label(self) -> &'static str {
        match self {
            Tool::Cold => "rsprof-bpf, empty cache (first run)",
            Tool::Warm => "rsprof-bpf, second run (disk cache and launch list)",
            Tool::Perf => "perf record --call-graph dwarf,16384 + perf script",
            Tool::Samply => "samply record",
        }
    }
}

/// One run: (complete, all) user stacks by the root rule, rsprof-bpf's own in-profile count,
/// and the wall time of the recording.
#[derive(Default)]
struct Run {
    roots: (u64, u64),
    own: Option<(u64, u64)>,
    secs: f64,
    /// rsprof-bpf's `first sample to table in the kernel: …` summary line, after its prefix.
    waits: Option<String>,
}

pub(super) fn cold_start(args: &BenchUnwindArgs, profiler: &Path) -> anyhow::Result<()> {
    let tmp = std::env::temp_dir().join(format!("rsprof-bench-cold-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    let src = tmp.join("small.rs");
    fs::write(&src, SOURCE)?;
    let rustc = crate::bench::stdout_of(Command::new("rustup").args(["which", "rustc"]))
        .context("`rustup which rustc`")?;
    let rustc = PathBuf::from(rustc.trim());
    let samply = crate::setup::samply().map_err(|e| format!("{e:#}"));
    // samply refuses kernel.perf_event_paranoid above 1.
    let _paranoid = super::ParanoidGuard::at_most_1()?;
    let cache = tmp.join("cache");
    let mut results = Vec::new();
    for tool in [Tool::Cold, Tool::Warm, Tool::Perf, Tool::Samply] {
        let mut runs = Vec::new();
        for i in 0..RUNS {
            step(&format!("bench-unwind --cold-start: {} ({}/{RUNS})", tool.label(), i + 1));
            let r = match (tool, &samply) {
                (Tool::Samply, Err(e)) => Err(anyhow::anyhow!("samply unavailable: {e}")),
                (Tool::Samply, Ok(s)) => samply_run(s, args.freq, &rustc, &src, &tmp),
                (Tool::Perf, _) => perf_run(args.freq, &rustc, &src, &tmp),
                (Tool::Cold | Tool::Warm, _) => {
                    if tool == Tool::Cold {
                        let _ = fs::remove_dir_all(&cache);
                    }
                    rsprof_run(profiler, args.freq, &rustc, &src, &tmp, &cache)
                }
            };
            match r {
                Ok(r) => {
                    println!(
                        "  complete by roots {}/{}; own {:?}; {:.2} s",
                        r.roots.0, r.roots.1, r.own, r.secs
                    );
                    runs.push(Ok(r));
                }
                Err(e) => {
                    println!("  FAILED: {e:#}");
                    runs.push(Err(format!("{e:#}")));
                }
            }
        }
        results.push((tool, runs));
    }
    let _ = fs::remove_dir_all(&tmp);
    let table = render(args, &rustc, &results);
    crate::bench::publish(&table, args.no_write, SECTION_BEGIN, SECTION_END)
}

/// Runs `tool` (its arguments up to `--`) recording the compile; its stderr and the wall
/// time, or an error with its last lines.
fn record_compile(
    mut tool: Command,
    what: &str,
    rustc: &Path,
    src: &Path,
    tmp: &Path,
) -> anyhow::Result<(String, f64)> {
    tool.arg(rustc).arg("-O").arg(src).arg("-o").arg(tmp.join("small"));
    let started = Instant::now();
    let done = tool.stdin(Stdio::null()).output()?;
    let secs = started.elapsed().as_secs_f64();
    let stderr = String::from_utf8_lossy(&done.stderr).into_owned();
    if !done.status.success() {
        bail!("{what} failed{}", tail(&stderr));
    }
    Ok((stderr, secs))
}

fn rsprof_run(
    profiler: &Path,
    freq: u64,
    rustc: &Path,
    src: &Path,
    tmp: &Path,
    cache: &Path,
) -> anyhow::Result<Run> {
    let out = tmp.join("rsprof.folded");
    let mut cmd = Command::new(profiler);
    cmd.env("RSPROF_UNWIND_CACHE", cache)
        .args(["-v", "-F", &freq.to_string(), "-o"])
        .arg(&out)
        .arg("--");
    let (stderr, secs) = record_compile(cmd, "rsprof-bpf", rustc, src, tmp)?;
    let folded = fs::read_to_string(&out)?;
    let roots = folded_roots(&folded);
    // "in the profile (stack copies walked): N of M user stacks complete"
    let own = summary_after(&stderr, "in the profile (stack copies walked): ").and_then(|rest| {
        let mut w = rest.split_whitespace();
        let n = w.next()?.parse().ok()?;
        let m = w.nth(1)?.parse().ok()?;
        Some((n, m))
    });
    let waits = summary_after(&stderr, "first sample to table in the kernel: ").map(str::to_owned);
    Ok(Run { roots, own, secs, waits })
}

/// What follows `marker` on the first summary line holding it.
fn summary_after<'a>(stderr: &'a str, marker: &str) -> Option<&'a str> {
    stderr.lines().find_map(|l| Some(l.split_once(marker)?.1.trim()))
}

fn perf_run(freq: u64, rustc: &Path, src: &Path, tmp: &Path) -> anyhow::Result<Run> {
    let data = tmp.join("perf.data");
    let mut cmd = Command::new("perf");
    cmd.args(["record", "-q", "-F", &freq.to_string(), "--call-graph", "dwarf,16384", "-o"])
        .arg(&data)
        .arg("--");
    let (_, secs) = record_compile(cmd, "perf record", rustc, src, tmp)?;
    let script = Command::new("perf").args(["script", "-i"]).arg(&data).output()?;
    if !script.status.success() {
        bail!("perf script failed{}", tail(&String::from_utf8_lossy(&script.stderr)));
    }
    let text = String::from_utf8_lossy(&script.stdout);
    Ok(Run { roots: perf_roots(&text), own: None, secs, waits: None })
}

fn samply_run(
    samply: &Path,
    freq: u64,
    rustc: &Path,
    src: &Path,
    tmp: &Path,
) -> anyhow::Result<Run> {
    let out = tmp.join("samply.json.gz");
    let mut cmd = Command::new(samply);
    cmd.args(["record", "--save-only", "-r", &freq.to_string(), "-o"]).arg(&out).arg("--");
    let (_, secs) = record_compile(cmd, "samply", rustc, src, tmp)?;
    Ok(Run { roots: samply_cfi_end(&out)?, own: None, secs, waits: None })
}

/// (complete, all) samples of samply's profile with user frames, complete when the outermost
/// frame is where CFI ends the stack (its return address undefined: `_start`, `clone3`). Its
/// frames are unsymbolicated and Debian's libc has no `clone3` symbol, so the rule is looked up
/// in the frame's file (`profiler_unwind::rule_at`), at the address and at the call before it.
fn samply_cfi_end(path: &Path) -> anyhow::Result<(u64, u64)> {
    use std::{collections::HashMap, io::Read as _};
    let mut json = String::new();
    flate2::read::GzDecoder::new(fs::File::open(path)?).read_to_string(&mut json)?;
    let p: serde_json::Value = serde_json::from_str(&json).context("samply profile JSON")?;
    let libs = p["libs"].as_array().context("profile has no libs")?;
    // Per library: its bytes and lowest loaded address (samply's addresses are relative to it).
    let mut files: HashMap<u64, Option<(Vec<u8>, u64)>> = HashMap::new();
    let mut is_end = |lib: u64, rel: u64| -> bool {
        let f = files.entry(lib).or_insert_with(|| {
            use object::{Object as _, ObjectSegment as _};
            let path = libs.get(lib as usize)?["path"].as_str()?;
            let data = fs::read(path).ok()?;
            let base = object::File::parse(&*data).ok()?.segments().map(|s| s.address()).min()?;
            Some((data, base))
        });
        let Some((data, base)) = f else { return false };
        let base = *base;
        [rel, rel.saturating_sub(1)].iter().any(|&a| {
            profiler_unwind::rule_at(data, base + a)
                .ok()
                .flatten()
                .is_some_and(|r| r.cfa_kind() == profiler_common::UNWIND_CFA_END)
        })
    };
    let (mut complete, mut all) = (0u64, 0u64);
    for t in p["threads"].as_array().context("profile has no threads")? {
        let stack_prefix = column(&t["stackTable"], "prefix");
        let stack_frame = column(&t["stackTable"], "frame");
        let frame_addr = column(&t["frameTable"], "address");
        let frame_func = column(&t["frameTable"], "func");
        let func_res = column(&t["funcTable"], "resource");
        let res_lib = column(&t["resourceTable"], "lib");
        let mut memo: HashMap<usize, bool> = HashMap::new();
        for s in t["samples"]["stack"].as_array().into_iter().flatten() {
            let Some(first) = s.as_u64().map(|v| v as usize) else { continue };
            all += 1;
            if let Some(&c) = memo.get(&first) {
                complete += u64::from(c);
                continue;
            }
            let mut stack = first;
            while let Some(prev) = stack_prefix.get(stack).copied().flatten() {
                stack = prev as usize;
            }
            let frame = stack_frame.get(stack).copied().flatten().map(|f| f as usize);
            let lib = frame
                .and_then(|f| frame_func.get(f).copied().flatten())
                .and_then(|f| func_res.get(f as usize).copied().flatten())
                .and_then(|r| res_lib.get(r as usize).copied().flatten());
            let addr = frame.and_then(|f| frame_addr.get(f).copied().flatten());
            let done = match (lib, addr) {
                (Some(l), Some(a)) => is_end(l, a),
                _ => false,
            };
            memo.insert(first, done);
            complete += u64::from(done);
        }
    }
    Ok((complete, all))
}

/// (complete, all) of collapsed stacks with user frames, by `ROOTS`.
fn folded_roots(text: &str) -> (u64, u64) {
    let (mut complete, mut all) = (0, 0);
    for line in text.lines() {
        let Some((stack, n)) = line.rsplit_once(' ') else { continue };
        let Ok(n) = n.parse::<u64>() else { continue };
        // Process and thread first; then frames, user ones without a `_[k]` suffix.
        let frames: Vec<&str> = stack.split(';').skip(2).collect();
        if !frames.iter().any(|f| !f.ends_with("_[k]")) {
            continue;
        }
        all += n;
        if frames.iter().any(|f| ROOTS.contains(f)) {
            complete += n;
        }
    }
    (complete, all)
}

/// (complete, all) samples of `perf script` with user frames, by `ROOTS`.
fn perf_roots(text: &str) -> (u64, u64) {
    let (mut complete, mut all) = (0, 0);
    let (mut root, mut user) = (false, false);
    let mut finish = |root: bool, user: bool| {
        if user {
            all += 1;
            complete += u64::from(root);
        }
    };
    for line in text.lines() {
        if line.trim().is_empty() {
            continue;
        }
        if !line.starts_with(char::is_whitespace) {
            finish(root, user);
            (root, user) = (false, false);
            continue;
        }
        let mut t = line.split_whitespace();
        let _addr = t.next();
        let Some(sym) = t.next() else { continue };
        let dso = line.rsplit_once('(').map_or("", |(_, d)| d);
        user |= !dso.starts_with("[kernel");
        let name = sym.split_once("+0x").map_or(sym, |(n, _)| n);
        root |= ROOTS.contains(&name) || name.starts_with("__GI___clone");
    }
    finish(root, user);
    (complete, all)
}

fn render(
    args: &BenchUnwindArgs,
    rustc: &Path,
    results: &[(Tool, Vec<Result<Run, String>>)],
) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "## Cold start: `cargo xtask bench-unwind --cold-start`\n");
    let _ = writeln!(
        s,
        "Run {} on {} CPUs (kernel {}). `{} -O small.rs -o small` (a 0.3 s compile: \
         librustc_driver 154 MB, libLLVM 200 MB), recorded from its start at {} Hz, {RUNS} runs \
         per row. Commands: `rsprof-bpf -v -F {f} -o out.folded -- rustc …` with \
         `RSPROF_UNWIND_CACHE` emptied before each cold run (the warm runs follow the last cold \
         one: its disk cache and the command's launch list); `perf record -F {f} --call-graph \
         dwarf,16384 -- rustc …` then `perf script`; `samply record --save-only -r {f} -- rustc \
         …`. Complete: the stack reaches `_start` or a thread's `clone3`, from each tool's own \
         output (samply's frames are unsymbolicated: its outermost frame is complete when CFI \
         ends the stack there); for rsprof-bpf also the summary's `in the profile … complete` \
         (no `[truncated: …]` frame).\n",
        utc_now(),
        online_cpus(),
        fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
        rustc.display(),
        args.freq,
        f = args.freq,
    );
    let _ = writeln!(s, "| tool | complete (roots), each run | rsprof-bpf's own count | wall s |");
    let _ = writeln!(s, "|---|---|---|---|");
    for (tool, runs) in results {
        let pct = |(c, a): (u64, u64)| format!("{:.1}% of {a}", c as f64 * 100.0 / a.max(1) as f64);
        let mut roots = Vec::new();
        let mut own = Vec::new();
        let mut secs = Vec::new();
        for r in runs {
            match r {
                Ok(r) => {
                    roots.push(pct(r.roots));
                    if let Some(o) = r.own {
                        own.push(pct(o));
                    }
                    secs.push(format!("{:.2}", r.secs));
                }
                Err(e) => roots.push(format!("failed: {}", e.lines().next().unwrap_or(""))),
            }
        }
        let own = if own.is_empty() { "-".to_owned() } else { own.join(", ") };
        let _ = writeln!(
            s,
            "| {} | {} | {own} | {} |",
            tool.label(),
            roots.join(", "),
            secs.join(", ")
        );
    }
    let _ = writeln!(
        s,
        "\nrsprof-bpf: how long each file's first sample that stopped for want of its table \
         waited for the table to land in the kernel (the summary's `first sample to table in \
         the kernel`; median and p99 over the files of a run, then the largest files'):\n"
    );
    for (tool, runs) in results.iter().filter(|(t, _)| matches!(t, Tool::Cold | Tool::Warm)) {
        for (i, r) in runs.iter().enumerate() {
            let waits = match r {
                Ok(Run { waits: Some(w), .. }) => w.clone(),
                Ok(_) => "no sample stopped for want of a table".to_owned(),
                Err(_) => "run failed".to_owned(),
            };
            let _ = writeln!(s, "- {}, run {}: {waits}", tool.label(), i + 1);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roots_count_main_and_thread_stacks() {
        let folded = "rustc;rustc;_start;main;work 3\nrustc;t1;clone3;start_thread;f 2\n\
                      rustc;t1;f;g 4\nrustc;t1;schedule_[k] 5\n";
        assert_eq!(folded_roots(folded), (5, 9));
        let script = "rustc 1 [000] 1.0: cpu-clock:\n\
                      \t  abc f+0x1 (/lib/x.so)\n\t  abd __GI___clone3+0x2 (/lib/libc.so.6)\n\n\
                      rustc 1 [000] 1.1: cpu-clock:\n\t  abc f+0x1 (/lib/x.so)\n\n\
                      rustc 1 [000] 1.2: cpu-clock:\n\t  ffff schedule+0x1 ([kernel.kallsyms])\n";
        assert_eq!(perf_roots(script), (1, 2));
    }
}
