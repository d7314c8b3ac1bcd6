//! CPU time in samples (`threadCPUDelta`) must be current at the sample, not as of the last
//! scheduler tick: a busy thread reads as busy in every sample, and deltas add up to the CPU
//! time the kernel reports. Needs root; run serially like the other recording tests.
//!
//! The `cpu_time` fixture prints marks (CLOCK_REALTIME, its own CPU time) during its work;
//! samples are placed on the same clock as `meta.startTime + time`.

use std::process::{Command, Stdio};

use tests::{
    fixtures,
    gecko_schema::validate,
    harness::{Recording, output_path},
    profile_query::{sample_cpu_deltas, sample_times, threads_of_pid},
};

/// A sample of the fixture thread: CLOCK_REALTIME ns and CPU delta ns.
#[derive(Clone, Copy, Debug)]
struct Sample {
    real_ns: f64,
    delta_ns: f64,
}

/// A fixture mark: CLOCK_REALTIME ns and the thread's CPU time (ns) then.
#[derive(Clone, Copy, Debug)]
struct Mark {
    real_ns: f64,
    cpu_ns: f64,
}

/// Records `--all` while the fixture runs with `args`; returns the fixture thread's samples
/// (time order) and its marks.
fn record(test: &str, args: &[&str]) -> (Vec<Sample>, Vec<Mark>) {
    let exe = fixtures::build("cpu_time").expect("build fixture");
    let rec = Recording::start(&["--all"], output_path(test, "json")).expect("start recording");
    let out = Command::new(&exe)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .expect("run fixture");
    let done = rec.interrupt().expect("stop recording");
    assert!(out.status.success(), "fixture failed: {}", out.status);
    let profile = done.profile().expect("profile written");
    if let Err(problems) = validate(&profile) {
        panic!("profile breaks the Gecko rules:\n{}", problems.join("\n"));
    }
    assert_eq!(profile["meta"]["sampleUnits"]["threadCPUDelta"], "ns");

    let stdout = String::from_utf8(out.stdout).expect("fixture output is text");
    let mut tid = None;
    let mut marks = Vec::new();
    for line in stdout.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["tid", t] => tid = Some(t.parse::<u64>().expect("tid")),
            ["mark", r, c] => marks.push(Mark {
                real_ns: r.parse::<u64>().expect("mark time") as f64,
                cpu_ns: c.parse::<u64>().expect("mark cpu") as f64,
            }),
            _ => panic!("unexpected fixture line {line:?}"),
        }
    }
    let tid = tid.expect("fixture printed its tid");
    assert!(marks.len() >= 100, "fixture printed {} marks", marks.len());

    // The fixture is single-threaded: its tid is its pid.
    let threads = threads_of_pid(&profile, tid as u32);
    let t = threads.iter().find(|t| t.tid == tid).expect("fixture thread in the profile");
    let start_ms = profile["meta"]["startTime"].as_f64().expect("meta.startTime");
    let deltas = sample_cpu_deltas(t.thread);
    let mut samples: Vec<Sample> = sample_times(t.thread)
        .into_iter()
        .zip(deltas)
        .map(|(ms, d)| Sample {
            // Sum in ms first: both are ms, and f64 keeps ~0.2 µs at today's epoch.
            real_ns: (start_ms + ms) * 1e6,
            delta_ns: d.expect("every fixture sample has a CPU delta") as f64,
        })
        .collect();
    samples.sort_by(|a, b| a.real_ns.total_cmp(&b.real_ns));
    (samples, marks)
}

/// Consecutive sample pairs that both lie between the first and last mark (the fixture's
/// steady work, without its start and exit): (gap ns, delta ns of the later sample).
fn steady_pairs(samples: &[Sample], marks: &[Mark]) -> Vec<(f64, f64)> {
    let (lo, hi) = (marks[0].real_ns, marks[marks.len() - 1].real_ns);
    samples
        .windows(2)
        .filter(|w| w[0].real_ns >= lo && w[1].real_ns <= hi)
        .map(|w| (w[1].real_ns - w[0].real_ns, w[1].delta_ns))
        .collect()
}

/// The Firefox Profiler draws a sample at `delta / gap`, capped at 100%.
fn capped(gap: f64, delta: f64) -> f64 {
    (delta / gap).min(1.0)
}

#[test]
fn spinning_thread_is_fully_busy_in_every_sample() {
    let (samples, marks) = record("cpu_spin", &["spin", "2"]);
    let pairs = steady_pairs(&samples, &marks);
    assert!(pairs.len() >= 1000, "2 s of spinning at 999 Hz: only {} sample pairs", pairs.len());
    let mean = pairs.iter().map(|&(g, d)| capped(g, d)).sum::<f64>() / pairs.len() as f64;
    // A delta larger than the time since the previous sample (plus timer slack) is CPU time
    // that belongs to earlier samples: what a tick-updated counter produces.
    let over = pairs.iter().filter(|&&(g, d)| d > 1.1 * g + 50_000.0).count();
    let (first, last) = (marks[0], marks[marks.len() - 1]);
    let share = (last.cpu_ns - first.cpu_ns) / (last.real_ns - first.real_ns);
    eprintln!(
        "spin: {} pairs, mean per-sample CPU {:.3}, {over} deltas above their gap, kernel share {share:.3}",
        pairs.len(),
        mean
    );
    assert!(mean >= 0.9, "mean per-sample CPU {mean:.3} of a spinning thread, want >= 0.9");
    assert!(
        (over as f64) < 0.01 * pairs.len() as f64,
        "{over} of {} samples carry more CPU time than time passed since the previous one",
        pairs.len()
    );
}

#[test]
fn half_busy_thread_is_drawn_at_half_height() {
    let (samples, marks) = record("cpu_duty", &["duty", "5", "5", "3"]);
    let pairs = steady_pairs(&samples, &marks);
    assert!(pairs.len() >= 500, "3 s half busy at 999 Hz: only {} sample pairs", pairs.len());
    // Each sample is drawn over its gap: the graph's average height over time.
    let drawn = pairs.iter().map(|&(g, d)| capped(g, d) * g).sum::<f64>()
        / pairs.iter().map(|&(g, _)| g).sum::<f64>();
    let (first, last) = (marks[0], marks[marks.len() - 1]);
    let share = (last.cpu_ns - first.cpu_ns) / (last.real_ns - first.real_ns);
    eprintln!(
        "duty 5/5: {} pairs, drawn CPU {:.3} (time-weighted, capped), kernel share {share:.3}",
        pairs.len(),
        drawn
    );
    assert!(
        (0.4..=0.6).contains(&drawn),
        "5 ms busy / 5 ms asleep drawn at {drawn:.3}, want 0.5 ± 0.1"
    );
}

#[test]
fn cpu_deltas_add_up_to_kernel_cpu_time() {
    let (samples, marks) = record("cpu_sum", &["spin", "2"]);
    // Cumulative CPU time at each sample (the first sample's delta only starts the count).
    let mut cum = Vec::with_capacity(samples.len());
    let mut total = 0.0;
    for s in &samples {
        total += s.delta_ns;
        cum.push((s.real_ns, total));
    }
    // The profile's CPU time at a mark: interpolated between the samples around it (the
    // thread spins, so its CPU time grows linearly between two samples ~1 ms apart).
    let at = |t: f64| -> Option<f64> {
        let i = cum.partition_point(|&(ts, _)| ts <= t);
        let ((t0, v0), (t1, v1)) = (*cum.get(i.checked_sub(1)?)?, *cum.get(i)?);
        Some(v0 + (v1 - v0) * (t - t0) / (t1 - t0))
    };
    let points: Vec<(f64, f64)> =
        marks.iter().filter_map(|m| Some((at(m.real_ns)?, m.cpu_ns))).collect();
    assert!(points.len() >= 100, "only {} marks fall between samples", points.len());
    let (p0, pn) = (points[0], points[points.len() - 1]);
    let (profile_total, kernel_total) = (pn.0 - p0.0, pn.1 - p0.1);
    // Per 10 ms window between marks: a tick-updated counter is off by up to a tick (4 ms at
    // HZ=250) at each end, a current one by the thread's rare preemptions only.
    let (mut abs_err, mut kernel_sum) = (0.0, 0.0);
    for w in points.windows(2) {
        let (p, k) = (w[1].0 - w[0].0, w[1].1 - w[0].1);
        abs_err += (p - k).abs();
        kernel_sum += k;
    }
    let window_err = abs_err / kernel_sum;
    let total_err = (profile_total - kernel_total).abs() / kernel_total;
    eprintln!(
        "sum: {} windows, profile {:.1} ms vs kernel {:.1} ms ({:.2}%), mean window error {:.2}%",
        points.len() - 1,
        profile_total / 1e6,
        kernel_total / 1e6,
        100.0 * total_err,
        100.0 * window_err
    );
    assert!(total_err <= 0.05, "total CPU off by {:.2}%", 100.0 * total_err);
    assert!(window_err <= 0.05, "10 ms windows off by {:.2}% on average", 100.0 * window_err);
}
