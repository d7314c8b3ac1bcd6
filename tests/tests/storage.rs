//! Chunked storage end to end: a tiny `--buffer-size` recycles many times and keeps only the
//! newest window; SIGUSR1 writes a snapshot while recording goes on. Needs root; run serially.

use std::{
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use serde_json::Value;
use tests::{
    gecko_schema::validate,
    harness::{Recording, output_path, run_fixture},
    profile_query::{count_samples_with_path, sample_times, threads, threads_of_pid},
};

fn valid(profile: &Value) {
    if let Err(problems) = validate(profile) {
        panic!("profile breaks the Gecko v36 rules:\n{}", problems.join("\n"));
    }
}

#[test]
fn tiny_buffer_keeps_only_the_newest_window() {
    let rec =
        Recording::start(&["--all", "--buffer-size", "64K"], output_path("tiny_buffer", "json.gz"))
            .expect("start recording");
    // Two busy fixtures keep both CPUs sampling even on an idle machine (idle CPUs barely
    // fire): ~2,000 samples/s of ~11 bytes fill 64 KiB (8 chunks) in 3 s, and 8 s recycles a
    // dozen chunks.
    let other = thread::spawn(|| run_fixture("split.c", &["8"]).expect("run second fixture"));
    let pid = run_fixture("split.c", &["8"]).expect("run fixture");
    other.join().unwrap();
    let done = rec.interrupt().expect("stop recording");
    let profile = done.profile().expect("profile written");
    valid(&profile);
    assert!(done.stderr.contains("recycled"), "summary says data was recycled:\n{}", done.stderr);

    let r = &profile["meta"]["rsprof"]["recycled"];
    assert!(r["chunks"].as_u64().unwrap() >= 8, "recycled many times: {r}");
    let dropped_end = r["endTime"].as_f64().unwrap();
    assert!(dropped_end > 2000.0, "seconds of data were dropped: {r}");
    let start = profile["meta"]["profilingStartTime"].as_f64().unwrap();
    // Samples from different CPUs reach the ring slightly out of order: allow one drain.
    let slack = 100.0;
    let mut min_time = f64::MAX;
    for t in threads(&profile) {
        for time in sample_times(t.thread) {
            assert!(time >= dropped_end - slack, "sample at {time} ms is in the recycled range");
            min_time = min_time.min(time);
        }
    }
    assert!(start <= min_time, "the root range starts at the kept window: {start} vs {min_time}");

    let ts = threads_of_pid(&profile, pid);
    assert_eq!(ts.len(), 1, "the fixture's thread is in the newest window");
    let times = sample_times(ts[0].thread);
    let span = times.last().unwrap() - times.first().unwrap();
    assert!(span < 7000.0, "only a window of the 8 s run is kept: {span} ms");
    assert!(
        count_samples_with_path(ts[0].thread, &["main", "work"]) as f64 > 0.9 * times.len() as f64,
        "the kept samples are still fully symbolized"
    );
}

#[test]
fn sigusr1_writes_a_snapshot_while_recording_continues() {
    let out = output_path("snapshot", "json");
    let exe = tests::fixtures::build("split.c").expect("build fixture");
    let mut rec = Recording::start(&["--all"], out.clone()).expect("start recording");
    let mut fixture = Command::new(&exe).arg("3").stdout(Stdio::null()).spawn().unwrap();
    let pid = fixture.id();
    // Some 600 samples of it in the snapshot, however busy the CPUs are.
    let cpu = Duration::from_millis(600);
    tests::wait::until_cpu_time(pid, Duration::ZERO, cpu, Duration::from_secs(30)).unwrap();
    rec.signal(10); // SIGUSR1
    let line = rec.wait_for_line("wrote snapshot", Duration::from_secs(60)).expect("snapshot");
    assert!(fixture.wait().unwrap().success(), "fixture split.c failed");
    let done = rec.interrupt().expect("stop recording");
    let profile = done.profile().expect("final profile");
    valid(&profile);

    let snap_path = out.with_file_name("snapshot.snapshot-1.json");
    assert!(line.contains(&*snap_path.to_string_lossy()), "{line}");
    let snap = tests::gecko_schema::load(&snap_path).expect("snapshot written");
    valid(&snap);
    let in_snap = threads_of_pid(&snap, pid);
    assert_eq!(in_snap.len(), 1, "the fixture was running when the snapshot was taken");
    let snap_times = sample_times(in_snap[0].thread);
    let final_times = sample_times(threads_of_pid(&profile, pid)[0].thread);
    assert!(snap_times.len() > 300, "{} samples in the snapshot", snap_times.len());
    assert!(
        final_times.len() as f64 > snap_times.len() as f64 * 1.5,
        "sampling went on after the snapshot: {} then {}",
        snap_times.len(),
        final_times.len()
    );
    assert!(final_times.last() > snap_times.last());
}
