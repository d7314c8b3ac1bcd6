//! pprof and collapsed-stack output of real recordings, read back by independent readers: Go's
//! `pprof` (built by `cargo xtask setup`, see `tests::go_pprof`) for `.pb.gz`, and a plain
//! line parser for `.folded`. Needs root; `--all` recordings, so every check is about the
//! fixture's own pid.

use std::{collections::HashMap, path::Path, time::Duration};

use tests::{
    go_pprof::{self, parse_top},
    harness::{Recording, output_path, run, run_fixture},
};

/// Records `--all` (plus `extra`) to `output` while `split 3` runs; returns the split's pid and
/// rsprof-bpf's stderr. With `snapshot`, a SIGUSR1 snapshot is taken after the split ended.
fn record_split(extra: &[&str], output: &Path, snapshot: bool) -> (u32, String) {
    let mut args = vec!["--all"];
    args.extend(extra);
    let mut rec = Recording::start(&args, output.to_path_buf()).expect("start recording");
    let pid = run_fixture("split", &["3"]).expect("run split");
    if snapshot {
        rec.signal(10);
        rec.wait_for_line("wrote snapshot", Duration::from_secs(60)).expect("snapshot written");
    }
    let done = rec.interrupt().expect("stop recording");
    assert!(done.status.success(), "rsprof-bpf failed:\n{}", done.stderr);
    (pid, done.stderr)
}

/// hot_a's share of hot_a + hot_b in pprof's `-top` of `sample_index` (`samples`, or `cpu` in
/// ms) for the split's pid; also checks the two are most of the pid's total, under `work`.
fn top_share(profile: &Path, pid: u32, sample_index: &str) -> f64 {
    // Nothing dropped or trimmed, so the flat column sums to the pid's total (the "of N
    // total" line counts the whole profile).
    let mut args = vec!["-top", "-nodecount=100000", "-nodefraction=0", "-trim=false"];
    args.push("-tagfocus");
    let (focus, index) = (format!("pid={pid}"), format!("-sample_index={sample_index}"));
    args.extend([focus.as_str(), index.as_str()]);
    if sample_index == "cpu" {
        args.push("-unit=ms");
    }
    let out = go_pprof::run(&args, profile).expect("pprof -top");
    let (_, rows) = parse_top(&out).expect("parse -top");
    let total: f64 = rows.iter().map(|r| r.flat).sum();
    if sample_index == "samples" {
        assert!(total > 500.0, "3 s of split at 999 Hz: {total} samples for pid {pid}:\n{out}");
    }
    let flat = |name: &str| {
        rows.iter()
            .find(|r| r.name == name)
            .unwrap_or_else(|| panic!("{name} not in pprof -top for pid {pid}:\n{out}"))
            .flat
    };
    let (a, b) = (flat("hot_a"), flat("hot_b"));
    assert!(
        a + b > 0.9 * total,
        "hot_a + hot_b ({a} + {b}) are most of pid {pid}'s {total} {sample_index}:\n{out}"
    );
    let work = rows.iter().find(|r| r.name == "work").map_or(0.0, |r| r.cum);
    // A walk that did not reach `main` (the process's first milliseconds, before its unwind
    // table was in the kernel, when the stack copy could not finish it) is under a
    // `[truncated: …]` root: flagged, never under another function, and rare.
    let truncated: f64 =
        rows.iter().filter(|r| r.name.starts_with("[truncated")).map(|r| r.cum).sum();
    assert!(truncated <= 0.02 * (a + b), "{truncated} truncated of {}:\n{out}", a + b);
    // pprof prints rounded values (3000.71 cum for 2263.16 + 737.56 flat): allow that.
    assert!(
        work + truncated >= 0.999 * (a + b),
        "work's cumulative {work} (+ {truncated} truncated) includes hot_a and hot_b:\n{out}"
    );
    100.0 * a / (a + b)
}

/// The summary's `idle: …% of samples (N on idle CPUs)`.
fn summary_idle_samples(stderr: &str) -> u64 {
    stderr
        .split_once(" on idle CPUs)")
        .and_then(|(before, _)| before.rsplit('(').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no idle count in the summary:\n{stderr}"))
}

fn assert_75_25(share: f64, what: &str) {
    assert!((70.0..=80.0).contains(&share), "{what}: hot_a share {share:.1}%, want 75 ± 5");
}

#[test]
fn pprof_output_read_by_go_pprof_has_the_split_and_labels() {
    let out = output_path("pprof_split", "pb.gz");
    let (pid, stderr) = record_split(&[], &out, true);
    assert!(stderr.contains("(pprof, "), "summary names the format:\n{stderr}");
    let raw = std::fs::read(&out).unwrap();
    assert_eq!(&raw[..2], &[0x1f, 0x8b], ".gz output is gzip");

    let samples = top_share(&out, pid, "samples");
    assert_75_25(samples, "samples");
    let cpu = top_share(&out, pid, "cpu");
    assert_75_25(cpu, "cpu time");

    // Labels: pprof's own tag summary for the fixture's samples.
    let tags = go_pprof::run(&["-tags", "-tagfocus", &format!("pid={pid}")], &out).unwrap();
    for want in [format!(": {pid}"), "process: Total".into(), ": split".into(), "tid: Total".into()]
    {
        assert!(tags.contains(&want), "pprof -tags lacks {want:?}:\n{tags}");
    }
    // The main thread's tid is the pid; the only thread.
    let tid_section = tags.split("tid: Total").nth(1).unwrap();
    let tid_line = tid_section.lines().nth(1).unwrap();
    assert!(tid_line.trim_end().ends_with(&format!(": {pid}")), "tid of split:\n{tags}");

    // Stacks, leaf first: hot_a under work under main.
    let traces = go_pprof::run(&["-traces", "-tagfocus", &format!("pid={pid}")], &out).unwrap();
    let chain = traces.split("-----------+").any(|t| {
        let fns: Vec<&str> = t.lines().filter_map(|l| l.split_whitespace().last()).collect();
        fns.windows(3).any(|w| w == ["hot_a", "work", "main"])
    });
    assert!(chain, "no hot_a → work → main trace in pprof -traces:\n{traces}");

    // Idle samples are all kept, labelled as the idle process (there may be none when the
    // machine's CPUs are busy; then pprof must find none either).
    let recorded = summary_idle_samples(&stderr);
    let idle_args = ["-tags", "-sample_index=samples", "-tagfocus", "process=\\[idle\\]"];
    let idle = go_pprof::run(&idle_args, &out).unwrap();
    let in_profile = idle
        .lines()
        .find_map(|l| l.trim().strip_prefix("process: Total ")?.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert_eq!(in_profile, recorded as f64, "idle samples in pprof vs summary:\n{idle}");
    if recorded > 0 {
        assert!(idle.contains(": swapper/"), "idle threads are swapper/N:\n{idle}");
        assert!(!idle.contains("pid: "), "no pid label on idle samples:\n{idle}");
    }

    // The SIGUSR1 snapshot is pprof too, with the split in it.
    let snap = out.with_file_name("pprof_split.snapshot-1.pb.gz");
    assert!(snap.is_file(), "snapshot {} written", snap.display());
    assert_75_25(top_share(&snap, pid, "samples"), "snapshot samples");
}

#[test]
fn collapsed_output_has_the_split_per_process_and_thread() {
    let out = output_path("collapsed_split", "folded");
    let (pid, stderr) = record_split(&[], &out, false);
    assert!(stderr.contains("(collapsed, "), "summary names the format:\n{stderr}");
    let text = std::fs::read_to_string(&out).unwrap();
    let root = format!("split-{pid};split-{pid};");
    let mut by_leaf: HashMap<&str, u64> = HashMap::new();
    let mut total = 0;
    let mut lines = Vec::new();
    for line in text.lines() {
        let (stack, n) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no count: {line:?}"));
        let n: u64 = n.parse().unwrap_or_else(|_| panic!("bad count: {line:?}"));
        assert!(n > 0 && !stack.contains('\n'));
        lines.push(line);
        let Some(frames) = stack.strip_prefix(&root) else { continue };
        total += n;
        let f: Vec<&str> = frames.split(';').collect();
        // Root first: … main → work → hot_x, nothing below the hot function but the kernel.
        if let Some(i) = f.iter().position(|x| x.starts_with("hot_"))
            && i >= 2
            && f[i - 2..i] == ["main", "work"]
            && f[i + 1..].iter().all(|k| k.ends_with("_[k]"))
        {
            *by_leaf.entry(f[i]).or_default() += n;
        }
    }
    let mut sorted = lines.clone();
    sorted.sort();
    assert_eq!(lines, sorted, "lines are sorted");
    let (a, b) =
        (by_leaf.get("hot_a").copied().unwrap_or(0), by_leaf.get("hot_b").copied().unwrap_or(0));
    // ~3000 on an idle machine; fewer when the CPUs are shared, still plenty for ±5 points.
    assert!(total > 500, "3 s of split at 999 Hz: {total} samples for {root}");
    assert!((a + b) as f64 > 0.9 * total as f64, "main;work;hot_* in {a} + {b} of {total}");
    assert_75_25(100.0 * a as f64 / (a + b) as f64, "collapsed");
    // Every idle sample is kept, under [idle];swapper/N (none when the CPUs were all busy).
    let idle: u64 = (text.lines())
        .filter(|l| l.starts_with("[idle];swapper/"))
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<u64>().unwrap())
        .sum();
    assert_eq!(idle, summary_idle_samples(&stderr), "idle samples in the file vs the summary");
}

#[test]
fn format_flag_and_contradicting_name() {
    // A --format the name contradicts: one line, before any sampling, nothing written.
    let bad = output_path("contradiction", "json.gz");
    let r = run(&["--all", "-d", "1", "--format", "pprof", "-o", bad.to_str().unwrap()]).unwrap();
    assert!(!r.status.success());
    assert_eq!(r.stderr.trim().lines().count(), 1, "one-line error:\n{}", r.stderr);
    assert!(r.stderr.contains("--format pprof contradicts"), "{}", r.stderr);
    assert!(!r.stderr.contains("sampling"), "failed before sampling:\n{}", r.stderr);
    assert!(!bad.exists());
    let r = run(&["--all", "--format", "svg", "-o", bad.to_str().unwrap()]).unwrap();
    assert!(!r.status.success() && r.stderr.contains("unknown format 'svg'"), "{}", r.stderr);

    // A name without a known suffix takes --format.
    let out = output_path("explicit", "out");
    let r = run(&["--all", "-d", "1", "--format", "pprof", "-o", out.to_str().unwrap()]).unwrap();
    assert!(r.status.success(), "{}", r.stderr);
    let top = go_pprof::run(&["-top", "-sample_index=samples"], &out).expect("pprof reads it");
    let (total, _) = parse_top(&top).unwrap();
    assert!(total > 0.0, "1 s --all has samples:\n{top}");
}
