//! Off-CPU and wall-clock profiling (`--off-cpu`, `--mode wall`) with real BPF: off-CPU time
//! is written as samples in the "Off-CPU" category (one per sampling interval of time
//! blocked) with the stack at the switch-out, plus a marker per long block. Needs root; run
//! serially like the other recording tests.

use std::process::{Command, Stdio};

use serde_json::Value;
use tests::{
    fixtures,
    harness::{Finished, Recording, output_path, run},
    profile_query::{
        ThreadInfo, contains_path, function_name, markers, sample_leaf_categories, sample_stacks,
        threads,
    },
};

const OFF_CPU: &str = "Off-CPU";

/// Records with `args` while the `offcpu` fixture runs with `fixture_args` (it is started after
/// the profiler says "sampling"); returns the recording, the profile and the fixture's stdout.
fn record(test: &str, args: &[&str], fixture_args: &[&str]) -> (Finished, Value, String) {
    let exe = fixtures::build("offcpu").expect("build fixture");
    let rec = Recording::start(args, output_path(test, "json")).expect("start recording");
    let out = Command::new(&exe)
        .args(fixture_args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .expect("run fixture");
    let done = rec.interrupt().expect("stop recording");
    assert!(out.status.success(), "fixture failed: {}", out.status);
    // `load` validates the profile and runs the Firefox Profiler's importer on it.
    let profile = done.profile().expect("profile written");
    (done, profile, String::from_utf8(out.stdout).expect("fixture output is text"))
}

/// The tids the fixture printed for `role`.
fn tids(stdout: &str, role: &str) -> Vec<u64> {
    stdout
        .lines()
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["tid", r, t] if *r == role => t.parse().ok(),
            _ => None,
        })
        .collect()
}

fn value(stdout: &str, key: &str) -> f64 {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("fixture printed no {key:?}:\n{stdout}"))
}

fn thread<'p>(profile: &'p Value, tid: u64) -> ThreadInfo<'p> {
    threads(profile)
        .into_iter()
        .find(|t| t.tid == tid)
        .unwrap_or_else(|| panic!("thread {tid} not in the profile"))
}

/// (stack root→leaf, off-CPU?) of every sample of a thread.
fn samples(profile: &Value, t: &ThreadInfo) -> Vec<(Vec<String>, bool)> {
    let cats = sample_leaf_categories(profile, t.thread);
    sample_stacks(t.thread)
        .into_iter()
        .zip(cats)
        .map(|(s, c)| (s, c.as_deref() == Some(OFF_CPU)))
        .collect()
}

fn interval_ms(profile: &Value) -> f64 {
    profile["meta"]["interval"].as_f64().expect("meta.interval")
}

#[test]
fn offcpu_wall_mode_splits_duty_cycle_between_spin_and_sleep() {
    let secs = 3.0;
    let (_, profile, out) =
        record("offcpu_duty", &["--all", "--mode", "wall"], &["duty", "5", "5", "3"]);
    let tid = tids(&out, "duty")[0];
    let t = thread(&profile, tid);
    let all = samples(&profile, &t);
    let in_duty: Vec<_> = all.iter().filter(|(s, _)| contains_path(s, &["duty"])).collect();
    let n = in_duty.len() as f64;
    let sleep = in_duty
        .iter()
        .filter(|(s, off)| {
            *off && contains_path(s, &["sleep_phase"]) && contains_path(s, &["do_nanosleep"])
        })
        .count() as f64;
    let spin =
        in_duty.iter().filter(|(s, off)| !*off && contains_path(s, &["spin_phase"])).count() as f64;
    let wall_ms = n * interval_ms(&profile);
    eprintln!(
        "duty 5/5 for {secs} s, wall mode: {n} samples under duty = {wall_ms:.0} ms; \
         sleep (off-CPU) {:.1}%, spin (CPU) {:.1}%",
        100.0 * sleep / n,
        100.0 * spin / n
    );
    // Every stretch of the thread's time is a sample: CPU, blocked or waiting for a CPU.
    assert!(
        (wall_ms - secs * 1e3).abs() <= 0.1 * secs * 1e3,
        "samples under duty cover {wall_ms:.0} ms of a {secs} s run"
    );
    assert!((0.4..=0.6).contains(&(sleep / n)), "nanosleep share {:.3}, want 0.5 ± 0.1", sleep / n);
    assert!((0.4..=0.6).contains(&(spin / n)), "spin share {:.3}, want 0.5 ± 0.1", spin / n);
}

#[test]
fn offcpu_blocked_pipe_read_is_one_long_block_and_preemption_is_not_off_cpu() {
    let exe = fixtures::build("offcpu").expect("build fixture");
    let exe = exe.to_str().expect("UTF-8 path");
    // Three spinners on a small machine are preempted all the time but never block.
    let out = output_path("offcpu_pipe", "json");
    let o = out.to_str().expect("UTF-8 path");
    let mut done = run(&["--off-cpu", "-o", o, "--", exe, "pipe", "2", "3"]).expect("record");
    done.output = out.clone();
    let profile = done.profile().expect("profile written");
    let ts = threads(&profile);
    let reader = ts
        .iter()
        .find(|t| {
            samples(&profile, t).iter().any(|(s, off)| *off && contains_path(s, &["pipe_wait"]))
        })
        .expect("a thread with off-CPU samples under pipe_wait");
    let blocked: Vec<_> = samples(&profile, reader)
        .into_iter()
        .filter(|(s, off)| *off && contains_path(s, &["pipe_wait"]))
        .collect();
    let blocked_ms = blocked.len() as f64 * interval_ms(&profile);
    assert!(
        // `anon_pipe_read` since Linux 6.16.
        blocked.iter().all(|(s, _)| s.iter().any(|f| {
            f.ends_with("(in [kernel.kallsyms])") && function_name(f).ends_with("pipe_read")
        })),
        "off-CPU stacks under pipe_wait without the kernel's pipe_read: {:?}",
        blocked.first()
    );
    let long: Vec<_> = markers(reader.thread)
        .into_iter()
        .filter(|m| m.name == OFF_CPU)
        .map(|m| m.end.unwrap_or(0.0) - m.start.unwrap_or(0.0))
        .collect();
    eprintln!("pipe: reader off-CPU {blocked_ms:.0} ms under pipe_read; markers {long:?}");
    assert!((1800.0..=2300.0).contains(&blocked_ms), "{blocked_ms:.0} ms blocked, want ~2000");
    assert_eq!(long.iter().filter(|&&d| d >= 1800.0).count(), 1, "one ~2 s block: {long:?}");

    // Preempted, runnable threads are not off-CPU (without --mode wall).
    let mut spinner_samples = 0;
    for t in ts.iter().filter(|t| t.tid != reader.tid && t.pid == reader.pid) {
        let s = samples(&profile, t);
        let spin = s.iter().filter(|(st, _)| contains_path(st, &["spinner"])).count();
        let off = s.iter().filter(|(st, off)| *off && contains_path(st, &["spinner"])).count();
        if spin > 0 {
            spinner_samples += spin;
            eprintln!("spinner {}: {spin} samples, {off} off-CPU", t.tid);
            assert!(off * 100 <= spin, "spinner {}: {off} of {spin} samples off-CPU", t.tid);
        }
    }
    assert!(spinner_samples > 300, "spinners sampled only {spinner_samples} times");
    // The check means something only if the spinners were in fact preempted.
    let preempted: u64 = done
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("preempted ")?.trim().parse::<u64>().ok())
        .sum();
    eprintln!("spinners preempted {preempted} times");
    assert!(preempted >= 100, "spinners preempted only {preempted} times:\n{}", done.stdout);
    // -- CMD: nothing outside the command is recorded.
    assert!(ts.iter().all(|t| t.pid == reader.pid), "threads of other processes recorded");
}

#[test]
fn offcpu_context_switch_storm_is_summed_and_attributed() {
    let (done, profile, out) = record("offcpu_storm", &["--all", "--off-cpu"], &["pingpong", "3"]);
    let switches = value(&out, "switches");
    let secs = value(&out, "seconds");
    let (ping, pong) = (tids(&out, "ping")[0], tids(&out, "pong")[0]);
    eprintln!(
        "storm: {switches} blocking reads in {secs:.2} s = {:.0} switches/s under the profiler",
        switches / secs
    );
    let summary = &done.stderr;
    let line = summary.lines().find(|l| l.starts_with("off-CPU:")).expect("off-CPU summary line");
    eprintln!("{line}");
    let summed: u64 = line
        .split(", ")
        .find_map(|p| p.strip_suffix(" shorter than --off-cpu-min summed per thread"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no summed count in {line:?}"));
    assert!(summed as f64 >= 0.5 * switches, "{summed} blocks summed for {switches} switches");
    assert!(!summary.contains("off-CPU records but"), "records went missing:\n{summary}");
    // Each thread's off-CPU samples carry its own blocking stack, never the other's.
    for (tid, own, other) in [(ping, "ping_loop", "pong_loop"), (pong, "pong_loop", "ping_loop")] {
        let t = thread(&profile, tid);
        let off: Vec<_> = samples(&profile, &t).into_iter().filter(|(_, o)| *o).collect();
        let own_n = off.iter().filter(|(s, _)| contains_path(s, &[own])).count();
        let wrong = off.iter().filter(|(s, _)| contains_path(s, &[other])).count();
        eprintln!("storm: {tid} ({own}) {} off-CPU samples, {own_n} under {own}", off.len());
        assert!(off.len() > 100, "thread {tid}: only {} off-CPU samples", off.len());
        assert_eq!(wrong, 0, "thread {tid} has {wrong} off-CPU samples under {other}");
        assert!(own_n * 10 >= off.len() * 9, "thread {tid}: {own_n} of {} under {own}", off.len());
    }
}
