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
/// The frame standing for an off-CPU stack the kernel did not take.
const NOT_CAPTURED: &str = "[off-CPU: stack not captured]";

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
    // Each thread's off-CPU samples carry its own blocking stack, never the other's. Blocks
    // that turn long without warning (the other thread preempted for a while on a loaded
    // machine) have no stack taken: they show as not captured, never under another stack.
    for (tid, own, other) in [(ping, "ping_loop", "pong_loop"), (pong, "pong_loop", "ping_loop")] {
        let t = thread(&profile, tid);
        let off: Vec<_> = samples(&profile, &t).into_iter().filter(|(_, o)| *o).collect();
        let own_n = off.iter().filter(|(s, _)| contains_path(s, &[own])).count();
        let wrong = off.iter().filter(|(s, _)| contains_path(s, &[other])).count();
        let not_captured = off
            .iter()
            .filter(|(s, _)| s.len() == 1 && function_name(&s[0]) == NOT_CAPTURED)
            .count();
        eprintln!(
            "storm: {tid} ({own}) {} off-CPU samples, {own_n} under {own}, {not_captured} not \
             captured",
            off.len()
        );
        assert!(off.len() > 100, "thread {tid}: only {} off-CPU samples", off.len());
        assert_eq!(wrong, 0, "thread {tid} has {wrong} off-CPU samples under {other}");
        assert!(
            (own_n + not_captured) * 10 >= off.len() * 9,
            "thread {tid}: {own_n} of {} under {own}, {not_captured} not captured",
            off.len()
        );
    }
    let not_captured = summary_count(summary, "long sent without a stack (not walked)");
    let walks = summary
        .lines()
        .find_map(|l| {
            l.split("stacks walked ").nth(1)?.split(',').next()?.trim().parse::<f64>().ok()
        })
        .expect("stacks walked in the summary");
    eprintln!("storm: {walks} stack walks, {not_captured} long blocks not captured");
    // Stacks are walked for a small share of the blocks, not for each.
    assert!(walks < 0.2 * switches, "{walks} stack walks for {switches} blocking reads");
}

/// Count `what` from the summary's "off-CPU:" line, e.g. "long sent without a stack".
fn summary_count(summary: &str, what: &str) -> u64 {
    let line = summary.lines().find(|l| l.starts_with("off-CPU:")).expect("off-CPU summary line");
    line.split(", ")
        .find_map(|p| p.trim().strip_suffix(what)?.trim().rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {what:?} count in {line:?}"))
}

#[test]
fn offcpu_long_block_not_walked_is_flagged_not_given_another_stack() {
    let exe = fixtures::build("offcpu").expect("build fixture");
    let exe = exe.to_str().expect("UTF-8 path");
    let out = output_path("offcpu_not_captured", "json");
    let o = out.to_str().expect("UTF-8 path");
    // Each round: 1000 short sleeps in tiny_wait, then a 200 ms one in late_wait, whose site's
    // last block was short. With --off-cpu-min 50 the short sleeps' sum is rarely within a
    // short block of the threshold when the long sleep starts, so its stack is rarely walked.
    let (rounds, long_ms) = (4.0, 200.0);
    let mut done = run(&[
        "--off-cpu",
        "--off-cpu-min",
        "50",
        "-o",
        o,
        "--",
        exe,
        "tinylong",
        "4",
        "1000",
        "200",
    ])
    .expect("record");
    done.output = out.clone();
    let profile = done.profile().expect("profile written");
    let tid = tids(&done.stdout, "tinylong")[0];
    let (tiny_ms, fixture_long_ms) =
        (value(&done.stdout, "tiny_ms"), value(&done.stdout, "long_ms"));
    let t = thread(&profile, tid);
    let off: Vec<_> = samples(&profile, &t).into_iter().filter(|(_, o)| *o).collect();
    let iv = interval_ms(&profile);
    let ms =
        |f: &dyn Fn(&Vec<String>) -> bool| off.iter().filter(|(s, _)| f(s)).count() as f64 * iv;
    let is_placeholder = |s: &Vec<String>| s.iter().any(|f| function_name(f) == NOT_CAPTURED);
    let placeholder_ms = ms(&is_placeholder);
    let late_ms = ms(&|s| contains_path(s, &["late_wait"]));
    let tiny_wait_ms = ms(&|s| contains_path(s, &["tiny_wait"]));
    let not_captured = summary_count(&done.stderr, "long sent without a stack (not walked)");
    eprintln!(
        "tinylong: fixture tiny {tiny_ms:.0} ms, long {fixture_long_ms:.0} ms; off-CPU under \
         late_wait {late_ms:.0} ms, tiny_wait {tiny_wait_ms:.0} ms, not captured \
         {placeholder_ms:.0} ms; {not_captured} blocks not captured"
    );
    // The not-captured path is taken, counted, and shows as such: its frame alone.
    assert!(not_captured >= 1, "no long block went without a walk:\n{}", done.stderr);
    assert!(
        off.iter().filter(|(s, _)| is_placeholder(s)).all(|(s, _)| s.len() == 1),
        "a not-captured block has other frames: {:?}",
        off.iter().find(|(s, _)| is_placeholder(s) && s.len() > 1)
    );
    // Each such block's time, plus at most the short blocks' sum still pending at the exit
    // (sent without a stack when none of its blocks was walked).
    let expected = not_captured as f64 * long_ms;
    assert!(
        placeholder_ms >= 0.95 * expected - 2.0 * iv
            && placeholder_ms <= 1.05 * expected + 50.0 + 2.0 * iv,
        "{placeholder_ms:.0} ms not captured for {not_captured} blocks of {long_ms} ms"
    );
    // Not attributed elsewhere: the long sleeps are all under late_wait or not captured, and
    // tiny_wait carries no more than the short sleeps (plus one unsent sum).
    let long_total = late_ms + placeholder_ms;
    assert!(
        long_total >= 0.9 * rounds * long_ms && long_total <= 1.1 * rounds * long_ms + 50.0,
        "long sleeps: {late_ms:.0} ms under late_wait + {placeholder_ms:.0} ms not captured, \
         want ~{}",
        rounds * long_ms
    );
    assert!(
        tiny_wait_ms <= 1.1 * tiny_ms + 50.0 + 2.0 * iv,
        "{tiny_wait_ms:.0} ms under tiny_wait for {tiny_ms:.0} ms of short sleeps"
    );
}

/// A block still open when the recording stops is cut at the stop, not lost: a reader blocked
/// on an empty pipe from just after the start until after the stop shows its wait up to the
/// stop, under its own stack, and the summary counts the cut block.
#[test]
fn offcpu_block_open_at_the_stop_is_cut_there_not_lost() {
    let exe = fixtures::build("offcpu").expect("build fixture");
    let out = output_path("offcpu_open_at_stop", "json");
    let rec = Recording::start(&["--all", "--off-cpu"], out).expect("start recording");
    // The reader blocks at once and stays blocked for 60 s, long after the stop.
    let mut fixture = Command::new(&exe)
        .args(["pipe", "60", "0"])
        .stdout(Stdio::null())
        .spawn()
        .expect("start fixture");
    let started = std::time::Instant::now();
    // The workload: 1.5 s of waiting, all of it in the recording.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let held_ms = started.elapsed().as_secs_f64() * 1e3;
    let done = rec.interrupt().expect("stop recording");
    let _ = fixture.kill();
    let _ = fixture.wait();
    let profile = done.profile().expect("profile written");
    let pid = u64::from(fixture.id());
    let ts = threads(&profile);
    let reader = ts
        .iter()
        .filter(|t| t.pid == pid)
        .find(|t| {
            samples(&profile, t).iter().any(|(s, off)| *off && contains_path(s, &["pipe_wait"]))
        })
        .unwrap_or_else(|| {
            panic!("no off-CPU time under pipe_wait in the fixture (pid {pid}):\n{}", done.stderr)
        });
    let iv = interval_ms(&profile);
    let blocked_ms = samples(&profile, reader)
        .iter()
        .filter(|(s, off)| *off && contains_path(s, &["pipe_wait"]))
        .count() as f64
        * iv;
    eprintln!("open at stop: reader off-CPU {blocked_ms:.0} ms of {held_ms:.0} ms held");
    // From its first read (a few ms after the fixture started) to the stop, which came after
    // `held_ms`; never more than that plus the stop's own delay.
    assert!(
        blocked_ms >= 0.8 * held_ms && blocked_ms <= held_ms + 1000.0,
        "{blocked_ms:.0} ms under pipe_wait, want about {held_ms:.0}"
    );
    assert!(
        done.stderr.contains("open at the stop"),
        "the summary does not count blocks cut at the stop:\n{}",
        done.stderr
    );
}
