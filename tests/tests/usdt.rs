//! USDT probes for real: `list-usdt` on system binaries, recordings of CPython's GC probes
//! (semaphore-guarded) and of the rsprof provider from C and Rust fixtures. Markers and label
//! frames are checked in the Gecko profile; argument values also through `--usdt-dump` (one
//! line per hit: `TIME PID TID CPU PROVIDER:NAME ARGS…`); counts in the summary. Needs root;
//! run serially.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;
use tests::{
    fixtures,
    gecko_schema::validate,
    harness::{Background, Recording, command, output_path, run, spawn_fresh},
    profile_query::{
        Marker, category, contains_path, frame_categories, function_name, markers, sample_stacks,
        threads, threads_of_pid,
    },
};

const PYTHON: &str = "/usr/bin/python3.11";
const LIBJVM: &str = "/usr/lib/jvm/java-17-openjdk-amd64/lib/server/libjvm.so";

fn list_usdt(args: &[&str]) -> (bool, String, String) {
    let out = command().unwrap().arg("list-usdt").args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

struct Recorded {
    stderr: String,
    stdout: String,
    profile: Value,
    /// `--usdt-dump` lines split into fields (hits only, not the label table).
    hits: Vec<Vec<String>>,
    labels: Vec<String>,
}

impl Recorded {
    fn of(&self, probe: &str) -> Vec<&Vec<String>> {
        self.hits.iter().filter(|h| h[4] == probe).collect()
    }
}

/// Records `-- CMD` with `extra` options and a hit dump; checks the profile is valid.
fn record_cmd(test: &str, extra: &[&str], cmd: &[&str]) -> Recorded {
    let out = output_path(test, "json");
    let dump = output_path(test, "hits");
    let mut args: Vec<&str> =
        vec!["-o", out.to_str().unwrap(), "--usdt-dump", dump.to_str().unwrap()];
    args.extend(extra);
    args.push("--");
    args.extend(cmd);
    let done = run(&args).unwrap();
    assert!(done.status.success(), "rsprof-bpf {args:?} failed:\n{}", done.stderr);
    let profile = tests::gecko_schema::load(&out).expect("profile written");
    if let Err(problems) = validate(&profile) {
        panic!("profile breaks the Gecko v36 rules:\n{}", problems.join("\n"));
    }
    let text = std::fs::read_to_string(&dump).unwrap();
    let (labels, hits): (Vec<&str>, Vec<&str>) =
        text.lines().partition(|l| l.starts_with("label "));
    Recorded {
        stderr: done.stderr,
        stdout: done.stdout,
        profile,
        hits: hits.iter().map(|l| split_fields(l)).collect(),
        labels: labels.into_iter().map(str::to_owned).collect(),
    }
}

/// Splits on spaces, keeping `"quoted strings"` (Rust debug escapes) whole.
fn split_fields(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let (mut quoted, mut escaped) = (false, false);
    for c in line.chars() {
        match c {
            '\\' if quoted && !escaped => {
                escaped = true;
                cur.push(c);
                continue;
            }
            '"' if !escaped => {
                quoted = !quoted;
                cur.push(c);
            }
            ' ' if !quoted => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
        escaped = false;
    }
    out.push(cur);
    out
}

#[test]
fn list_usdt_shows_python_gc_start_with_its_semaphore() {
    let (ok, out, err) = list_usdt(&[PYTHON]);
    assert!(ok, "{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with(&format!("usdt:{PYTHON}:python:gc__start ")))
        .unwrap_or_else(|| panic!("no python:gc__start in:\n{out}"));
    assert!(line.contains("semaphore=0x"), "{line}");
    assert!(line.contains("args: -4@112(%rsp)"), "{line}");
}

#[test]
fn list_usdt_lists_hotspot_probes_of_libjvm() {
    let (ok, out, err) = list_usdt(&[LIBJVM]);
    assert!(ok, "{err}");
    let n = out.lines().filter(|l| l.starts_with(&format!("usdt:{LIBJVM}:hotspot"))).count();
    assert!(n > 50, "{n} hotspot probes:\n{out}");
    assert!(out.contains(":hotspot:class__loaded "), "{out}");
}

#[test]
fn list_usdt_of_a_process_covers_its_executable() {
    let exe = fixtures::build("usdt_app").unwrap();
    let mut child = Command::new(&exe).args(["labels", "3"]).stdout(Stdio::null()).spawn().unwrap();
    let (ok, out, err) = list_usdt(&["-p", &child.id().to_string()]);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(ok, "{err}");
    for probe in ["label_push", "label_pop", "marker", "begin", "end", "counter"] {
        assert!(out.contains(&format!(":rsprof:{probe} ")), "no rsprof:{probe} in:\n{out}");
    }
    let (ok, _, err) = list_usdt(&["/no/such/file"]);
    assert!(!ok && err.starts_with("rsprof-bpf: error: ") && err.lines().count() == 1, "{err}");
}

/// python:gc__start's argument is the generation; gc.collect() collects generation 2.
/// Returns (generation-2 gc interval markers in the profile, all gc markers, stderr).
fn python_gc(test: &str, n: usize) -> (usize, usize, String) {
    let code = format!("import gc\n[gc.collect() for _ in range({n})]");
    let r =
        record_cmd(test, &["--usdt-interval", "python:gc__start:gc__done"], &[PYTHON, "-c", &code]);
    let starts = r.of("python:gc__start");
    let dones = r.of("python:gc__done");
    assert_eq!(starts.len(), dones.len(), "every start has its done:\n{}", r.stderr);
    let gc: Vec<Marker> = threads(&r.profile)
        .iter()
        .flat_map(|t| markers(t.thread))
        .filter(|m| m.name == "python:gc__start:gc__done")
        .collect();
    assert_eq!(gc.len(), starts.len(), "one marker per collection:\n{}", r.stderr);
    for m in &gc {
        assert_eq!(m.phase, 1, "complete intervals: {m:?}");
        assert!(m.end.unwrap() >= m.start.unwrap(), "{m:?}");
        assert_eq!(m.data["type"], "USDT interval python:gc__start:gc__done", "{m:?}");
    }
    let schema = r.profile["meta"]["markerSchema"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "USDT interval python:gc__start:gc__done")
        .expect("schema for the interval");
    assert!(schema["display"].as_array().unwrap().iter().any(|d| d == "timeline-overview"));
    let gen2 = gc.iter().filter(|m| m.data["start0"] == 2).count();
    (gen2, gc.len(), r.stderr)
}

#[test]
fn python_gc_interval_probes_fire_once_per_collect() {
    // The interpreter collects on its own too (at start-up and exit); the difference between
    // N collects and none is exactly N generation-2 gc markers.
    let (base, _, _) = python_gc("gc0", 0);
    let (gen2, all, stderr) = python_gc("gc50", 50);
    assert_eq!(gen2 - base, 50, "{gen2} gen-2 collections vs {base} without gc.collect()");
    assert!(
        stderr.contains(&format!("python:gc__done {all}, python:gc__start {all}")),
        "summary counts hits by probe:\n{stderr}"
    );
    assert!(stderr.contains(&format!("0 instant, {all} intervals")), "{stderr}");
    assert!(stderr.contains("usdt: ") && stderr.contains(" 0 lost"), "{stderr}");
}

/// The fixture's main thread and the one it named `name`.
fn main_and_named<'v>(profile: &'v Value, name: &str) -> (&'v Value, &'v Value) {
    let all = threads(profile);
    let named = all.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no thread {name}"));
    let main = threads_of_pid(profile, named.pid as u32)
        .into_iter()
        .find(|t| t.tid == t.pid)
        .expect("main thread");
    (main.thread, named.thread)
}

fn check_markers(r: &Recorded, n: usize) {
    let (main, worker) = main_and_named(&r.profile, "worker");
    let on_main = markers(main);
    let named =
        |ms: &[Marker<'_>], name: &str| -> usize { ms.iter().filter(|m| m.name == name).count() };
    let ticks: Vec<&Marker> = on_main.iter().filter(|m| m.name == "tick").collect();
    assert_eq!(ticks.len(), n, "{}", r.stderr);
    for (i, m) in ticks.iter().enumerate() {
        assert_eq!((m.phase, m.end), (0, None), "instant: {m:?}");
        assert_eq!(m.data["type"], "RsprofMarker");
        assert_eq!(m.data["text"], format!("marker {i}"));
    }
    // Each interval lies inside what the app measured around its begin..end (same clock,
    // CLOCK_MONOTONIC) and holds the 1 ms spin between them. Not "within 1 ms of the app's
    // measurement": the app can be preempted between its clock read and a probe (7.4 ms
    // measured around a 1.3 ms interval, once, on a loaded 2-CPU machine).
    let measured: Vec<f64> = r
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("interval "))
        .map(|l| l.split(' ').nth(1).unwrap().parse::<f64>().unwrap() / 1e6)
        .collect();
    assert_eq!(measured.len(), n, "{}", r.stdout);
    let steps: Vec<&Marker> = on_main.iter().filter(|m| m.name == "step").collect();
    assert_eq!(steps.len(), n, "{}", r.stderr);
    for (i, m) in steps.iter().enumerate() {
        assert_eq!(
            (m.phase, &m.data["id"], &m.data["type"]),
            (1, &i.into(), &"RsprofInterval".into())
        );
        let d = m.end.unwrap() - m.start.unwrap();
        assert!(
            d >= 1.0 && d <= measured[i] + 0.01,
            "step {i}: {d} ms, app measured {} ms",
            measured[i]
        );
    }
    let counters: Vec<&Marker> = on_main.iter().filter(|m| m.name == "progress").collect();
    assert_eq!(counters.len(), n);
    for (i, m) in counters.iter().enumerate() {
        assert_eq!((&m.data["type"], &m.data["value"]), (&"RsprofCounter".into(), &i.into()));
    }
    assert_eq!(named(&on_main, "worker-tick"), 0, "worker markers stay on the worker thread");
    let on_worker = markers(worker);
    assert_eq!(named(&on_worker, "worker-tick"), n, "{}", r.stderr);
    assert_eq!(on_worker.len(), n, "only its own markers: {on_worker:?}");
    let schemas: Vec<&str> = r.profile["meta"]["markerSchema"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["name"].as_str())
        .collect();
    for s in ["RsprofMarker", "RsprofInterval", "RsprofCounter"] {
        assert!(schemas.contains(&s), "{schemas:?}");
    }
    assert!(r.stderr.contains(&format!("markers: {} instant, {n} intervals, {n} counter values; incomplete: 0 never ended, 0 ended without a begin", 2 * n)), "{}", r.stderr);
    assert_eq!(r.of("rsprof:marker").len(), 2 * n);
    // USDT markers stand out in the Marker Chart: their own category, a colour nothing else in
    // the profile's category list uses.
    // The process's own markers (its container, its argv) are not USDT hits.
    let ours =
        |m: &&Marker| !matches!(m.data["type"].as_str(), Some("ContainerIdentity" | "ProcessInfo"));
    for m in on_main.iter().chain(&on_worker).filter(ours) {
        assert_eq!(category(&r.profile, m.category).0, "USDT", "{m:?}");
    }
    let usdt_colour = category(&r.profile, on_worker[0].category).1;
    let cats = r.profile["meta"]["categories"].as_array().unwrap();
    let same = cats.iter().filter(|c| c["color"] == usdt_colour).count();
    assert_eq!(same, 1, "the USDT colour {usdt_colour} is its own: {cats:?}");
}

#[test]
fn c_markers_intervals_and_counters_are_recorded() {
    let exe = fixtures::build("usdt_app").unwrap();
    let r = record_cmd("c_markers", &[], &[exe.to_str().unwrap(), "markers", "25"]);
    check_markers(&r, 25);
    assert!(r.stderr.contains("rsprof:marker 50"), "{}", r.stderr);
}

#[test]
fn rust_markers_intervals_and_counters_are_recorded() {
    let exe = fixtures::build_example("rsprof-probes", "rsprof_demo").unwrap();
    let r = record_cmd("rust_markers", &[], &[exe.to_str().unwrap(), "markers", "25"]);
    check_markers(&r, 25);
}

fn label_samples(stderr: &str, label: &str) -> u64 {
    let prefix = format!("  label '{label}': ");
    stderr
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.strip_suffix(" samples"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no samples labelled '{label}':\n{stderr}"))
}

/// `label` sits between `work` and `hot` in the call tree (`outer` → work → [label] → hot on
/// the main thread) for 99% of the samples in `hot` (those taken while the fixture started,
/// before its unwind tables were loaded, included: their pushes are placed from a copy of the
/// pusher's stack), never above `unlabelled`, and is in the Label category.
fn check_label_frames(r: &Recorded, label: &str, outer: &str, f: impl Fn(&str) -> String) {
    let (work, hot, unlabelled) = (f("work"), f("hot"), f("unlabelled"));
    let all = threads(&r.profile);
    let mut checked = 0;
    for t in all.iter().filter(|t| !t.name.starts_with("swapper")) {
        let stacks = sample_stacks(t.thread);
        let in_hot: Vec<&Vec<String>> =
            stacks.iter().filter(|s| s.iter().any(|l| function_name(l) == hot)).collect();
        if in_hot.len() < 100 {
            continue;
        }
        checked += 1;
        let (under, not_under): (Vec<&Vec<String>>, Vec<&Vec<String>>) =
            in_hot.iter().partition(|s| contains_path(s, &[&work, label, &hot]));
        assert!(
            under.len() * 100 >= in_hot.len() * 99,
            "{} of {} samples in {hot} are under {work} → {label}; the others: {}",
            under.len(),
            in_hot.len(),
            stack_histogram(&not_under)
        );
        let wrong = stacks
            .iter()
            .filter(|s| {
                s.iter().any(|l| function_name(l) == label)
                    && s.iter().any(|l| function_name(l) == unlabelled)
            })
            .count();
        assert_eq!(wrong, 0, "label above {unlabelled}");
        if t.tid == t.pid {
            let full = stacks.iter().filter(|s| contains_path(s, &[&f(outer), &work, label, &hot]));
            assert!(full.count() * 100 >= in_hot.len() * 99, "{outer} → {work} → {label} → {hot}");
        }
        let cats = frame_categories(&r.profile, t.thread, label);
        assert!(!cats.is_empty() && cats.iter().all(|c| c == "Label"), "{cats:?}");
    }
    assert_eq!(
        checked,
        2,
        "both threads ran hot(): {:?}",
        all.iter().map(|t| t.name).collect::<Vec<_>>()
    );
}

/// The distinct stacks of `stacks`, most frequent first, for a failure message.
fn stack_histogram(stacks: &[&Vec<String>]) -> String {
    let mut counts: Vec<(usize, &Vec<String>)> = Vec::new();
    for s in stacks {
        match counts.iter_mut().find(|(_, t)| t == s) {
            Some((n, _)) => *n += 1,
            None => counts.push((1, s)),
        }
    }
    counts.sort_by_key(|c| std::cmp::Reverse(c.0));
    counts.iter().take(8).map(|(n, s)| format!("\n  {n} × {}", s.join(" → "))).collect()
}

fn check_labels(r: &Recorded, label: &str) {
    // Two threads, each labelled half of the time (`-- CMD` records only the fixture).
    let n = label_samples(&r.stderr, label);
    let recorded: u64 = r
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("samples: ")?.split(' ').next()?.parse().ok())
        .unwrap();
    let share = n as f64 / recorded as f64;
    assert!(
        n > 300 && (0.3..=0.7).contains(&share),
        "{n} of {recorded} samples labelled '{label}':\n{}",
        r.stderr
    );
    // The label text is sent once per process, not once per push (twice at most when both
    // threads push it first at the same moment).
    let sent = r.of("rsprof:label_push").len();
    assert!((1..=2).contains(&sent), "{sent} label_push hits sent: {:?}", r.hits);
    assert_eq!(r.labels.len(), 1, "{:?}", r.labels);
    assert!(r.labels[0].ends_with(&format!("{label:?}")), "{:?}", r.labels);
    assert!(r.stderr.contains(" 0 underflows"), "{}", r.stderr);
    // Pushes made before the tables were loaded (if any) all found their pusher.
    if let Some(l) = r.stderr.lines().find(|l| l.contains("labels pushed before")) {
        assert!(l.ends_with(" 0 placed above the leaf (pusher unknown)"), "{l}");
    }
}

#[test]
fn c_labels_mark_the_samples_taken_under_them() {
    let exe = fixtures::build("usdt_app").unwrap();
    let r = record_cmd("c_labels", &[], &[exe.to_str().unwrap(), "labels", "2"]);
    check_labels(&r, "hot-work");
    check_label_frames(&r, "hot-work", "main", str::to_owned);
}

#[test]
fn rust_label_guards_mark_the_samples_taken_under_them() {
    let exe = fixtures::build_example("rsprof-probes", "rsprof_demo").unwrap();
    let r = record_cmd("rust_labels", &[], &[exe.to_str().unwrap(), "labels", "2"]);
    check_labels(&r, "rust-hot");
    check_label_frames(&r, "rust-hot", "main", |f| format!("rsprof_demo::{f}"));
}

#[test]
fn bad_strings_and_unbalanced_labels_are_counted_not_fatal() {
    let exe = fixtures::build("usdt_app").unwrap();
    let r = record_cmd("edge", &[], &[exe.to_str().unwrap(), "edge"]);
    let hits = r.of("rsprof:marker");
    let args: Vec<(&str, &str)> = hits.iter().map(|m| (m[5].as_str(), m[6].as_str())).collect();
    let big = format!("\"{}…[truncated]\"", "x".repeat(127));
    let want = [
        ("\"<null>\"", "\"null name\""),
        ("\"unreadable\"", "\"<unreadable 0x10>\""),
        ("\"big\"", big.as_str()),
        ("\"utf8\"", "\"bad \u{fffd}\u{fffd} bytes[invalid utf-8]\""),
        ("\"done\"", "\"edge\""),
    ];
    assert_eq!(args, want, "{}", r.stderr);
    let s = &r.stderr;
    assert!(s.contains("strings: 2 null, 1 unreadable (0 of them read later from read-only mappings), 1 truncated"), "{s}");
    // 100 + 2 + 1 pushes; 1 + 100 + 1 pops, the first with nothing pushed; 68 of the 100
    // nested pushes are deeper than the 32 kept.
    assert!(
        s.contains("labels: 103 pushes, 102 pops, 68 overflows, 1 underflows, 0 map full"),
        "{s}"
    );
    // Each label is named once: nested, left-a, left-b, and the NULL label.
    assert_eq!(r.of("rsprof:label_push").len(), 4, "{:?}", r.hits);

    // The profile shows all of it.
    let all = threads(&r.profile);
    let ms: Vec<Marker> = all.iter().flat_map(|t| markers(t.thread)).collect();
    let text = |name: &str| -> Vec<String> {
        ms.iter().filter(|m| m.name == name).map(|m| m.data["text"].to_string()).collect()
    };
    assert_eq!(text("<null>"), ["\"null name\""]);
    assert_eq!(text("unreadable"), ["\"<unreadable 0x10>\""]);
    assert_eq!(text("big"), [big.as_str()]);
    // An end without a begin and a begin never ended are kept as incomplete markers.
    let end = ms.iter().find(|m| m.name == "rsprof:end without begin").expect("unmatched end");
    assert_eq!((end.phase, end.start, &end.data["id"]), (3, None, &12345.into()));
    let begin = ms.iter().find(|m| m.name == "never-ended").expect("never-ended begin");
    assert_eq!((begin.phase, begin.end, &begin.data["id"]), (2, None, &99.into()));
    assert!(s.contains("incomplete: 1 never ended, 1 ended without a begin"), "{s}");
    // 100 nested pushes: samples carry the 32 kept levels; the thread that exited with two
    // labels pushed has them in its stacks.
    let stacks: Vec<Vec<String>> = all.iter().flat_map(|t| sample_stacks(t.thread)).collect();
    let deepest = stacks
        .iter()
        .map(|st| st.iter().filter(|l| *l == "nested (in rsprof label)").count())
        .max();
    assert_eq!(deepest, Some(32), "{s}");
    assert!(stacks.iter().any(|st| contains_path(st, &["left-a", "left-b"])), "{s}");
}

#[test]
fn bad_usdt_options_give_one_line_errors() {
    for (args, want) in [
        (vec!["--all", "--usdt", "python"], "expected PROVIDER:NAME"),
        (vec!["--all", "--usdt-interval", "python:a:a"], "start and end are the same probe"),
        (
            vec!["--all", "-d", "1", "--usdt", "python:nope@/usr/bin/python3.11"],
            "no USDT probe python:nope",
        ),
        (vec!["--all", "-d", "1", "--usdt", "python:gc__start@/no/such/file"], "/no/such/file"),
    ] {
        let out = output_path("bad_usdt", "json");
        let mut a = args.clone();
        a.extend(["-o", out.to_str().unwrap()]);
        let done = run(&a).unwrap();
        assert!(!done.status.success(), "{a:?} succeeded");
        let lines: Vec<&str> = done.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{a:?}:\n{}", done.stderr);
        assert!(
            lines[0].starts_with("rsprof-bpf: error: ") && lines[0].contains(want),
            "{a:?}: {}",
            lines[0]
        );
    }
}

#[test]
fn probes_of_a_program_execed_during_the_recording_are_found() {
    // The shell is attached before it runs; the fixture it starts is found from its exec.
    let exe = fixtures::build("usdt_app").unwrap();
    let script = format!("{} labels 2; true", exe.display());
    let r = record_cmd("exec_later", &[], &["/bin/sh", "-c", &script]);
    assert!(label_samples(&r.stderr, "hot-work") > 300, "{}", r.stderr);
}

#[test]
fn all_mode_attaches_to_processes_already_running() {
    let exe = fixtures::build("usdt_app").unwrap();
    // Both run until the test ends them, however long the profiler takes to attach.
    let labels = Background(
        Command::new(&exe).args(["labels", "600"]).stdout(Stdio::null()).spawn().unwrap(),
    );
    let mut markers_child = Background(
        Command::new(&exe)
            .args(["markers", "0"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stop_markers = markers_child.0.stdin.take().unwrap();
    // One message per step, read as they come (a full pipe would stall the fixture).
    let (step_tx, steps) = std::sync::mpsc::channel();
    let marker_lines = BufReader::new(markers_child.0.stdout.take().unwrap()).lines();
    std::thread::spawn(move || {
        marker_lines.map_while(Result::ok).try_for_each(|_| step_tx.send(()))
    });
    // Hitting its probes before the profiler starts.
    steps.recv_timeout(Duration::from_secs(10)).expect("markers fixture runs");
    let out = output_path("all_running", "json");
    let rec = Recording::start(&["--all"], out.clone());
    // 1000 more steps with the profiler attached, then the fixture exits mid-recording.
    let before = steps.try_iter().count();
    let seen = steps.iter().take(1000).count();
    drop(stop_markers);
    let rest = steps.iter().count();
    let markers_status = markers_child.0.wait().unwrap();
    // Labelled samples of the other fixture for a while longer: 500 more, however busy.
    if let Some(now) = tests::wait::cpu_time(labels.0.id()) {
        let cpu = Duration::from_millis(500);
        let r = tests::wait::until_cpu_time(labels.0.id(), now, cpu, Duration::from_secs(60));
        r.expect("labels fixture runs");
    }
    let done = rec.and_then(|r| r.interrupt());
    drop(labels);
    let done = done.unwrap();
    assert!(done.status.success(), "{}", done.stderr);
    assert!(
        markers_status.success() && seen == 1000,
        "markers fixture: {markers_status}, {before} + {seen} + {rest} steps"
    );
    assert!(label_samples(&done.stderr, "hot-work") > 300, "{}", done.stderr);
    let profile = tests::gecko_schema::load(&out).unwrap();
    if let Err(problems) = validate(&profile) {
        panic!("profile breaks the Gecko v36 rules:\n{}", problems.join("\n"));
    }
    let pid = markers_child.0.id();
    let ms: Vec<Marker> =
        threads_of_pid(&profile, pid).iter().flat_map(|t| markers(t.thread)).collect();
    let steps = ms.iter().filter(|m| m.name == "step" && m.phase == 1).count();
    // Attached mid-run: at most the interval in flight at attach time lacks its begin.
    let unbegun = ms.iter().filter(|m| m.name == "rsprof:end without begin").count();
    assert!(steps > 300 && unbegun <= 1, "{steps} steps, {unbegun} unmatched ends");
    assert!(ms.iter().filter(|m| m.name == "tick").count() >= steps, "{ms:?}");
}

#[test]
fn probes_of_a_library_loaded_later_are_found() {
    let lib = build_usdt_lib();
    let exe = fixtures::build("usdt_app").unwrap();
    let r =
        record_cmd("dlopen", &[], &[exe.to_str().unwrap(), "dlopen", lib.to_str().unwrap(), "7"]);
    let markers = r.of("rsprof:marker");
    assert_eq!(markers.len(), 7, "{}", r.stderr);
    // The library's strings may not be resident at the first hits (BPF cannot fault them
    // in); they are read afterwards from its read-only mapping.
    assert!(
        markers.iter().all(|m| m[5] == "\"lib\"" && m[6] == "\"from the library\""),
        "{markers:?}\n{}",
        r.stderr
    );
}

/// `usdt_lib.c.in` built as a shared library: `lib_markers(N)` fires N `rsprof:marker`s.
fn build_usdt_lib() -> std::path::PathBuf {
    let lib = output_path("usdt_lib", "so");
    let src = fixtures::source_dir().join("usdt_lib.c.in");
    let include = fixtures::workspace_root().join("include");
    let st = Command::new("gcc")
        .args(["-O1", "-shared", "-fPIC", "-x", "c"])
        .arg(format!("-I{}", include.display()))
        .arg("-o")
        .arg(&lib)
        .arg(&src)
        .status()
        .unwrap();
    assert!(st.success(), "building {}", src.display());
    lib
}

#[test]
fn with_p_probes_of_a_library_loaded_by_a_probeless_process_are_found() {
    // With `-p`, the USDT program is loaded only once a file with probes turns up: here a
    // library that python3.11 (no rsprof probes of its own) loads after the recording began.
    let lib = build_usdt_lib();
    let script = format!(
        "import ctypes, sys, time\n\
         sys.stdin.readline()\n\
         lib = ctypes.CDLL({lib:?})\n\
         time.sleep(1.5)  # time for the profiler to find the library\n\
         lib.lib_markers(7)\n\
         time.sleep(0.3)  # alive while the profiler drains the hits\n",
        lib = lib.to_str().unwrap()
    );
    let mut child =
        Command::new(PYTHON).args(["-c", &script]).stdin(Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let out = output_path("p_late_lib", "json");
    let dump = output_path("p_late_lib", "hits");
    let rec = Recording::start(
        &["-p", &pid.to_string(), "--usdt-dump", dump.to_str().unwrap()],
        out.clone(),
    )
    .unwrap();
    // Sampling: now the library is loaded.
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    assert!(child.wait().unwrap().success());
    let done = rec.interrupt().unwrap();
    let markers: Vec<Vec<String>> = dump_hits(&dump)
        .into_iter()
        .filter(|h| h[4] == "rsprof:marker" && h[1] == pid.to_string())
        .collect();
    assert_eq!(markers.len(), 7, "{markers:?}\n{}", done.stderr);
    assert!(markers.iter().all(|m| m[5] == "\"lib\""), "{markers:?}");
}

#[test]
fn rip_relative_arguments_are_evaluated_at_the_probe() {
    // `8@rip_value(%rip) -4@rip_array+8(%rip) 8@$rip_value`: two loads of globals and one
    // address, resolved through the symbol table; the fixture prints the true values.
    let exe = fixtures::build("usdt_app").unwrap();
    let r = record_cmd("rip", &["--usdt", "rsprof_test:rip"], &[exe.to_str().unwrap(), "rip", "4"]);
    let want: Vec<Vec<String>> = r
        .stderr
        .lines()
        .filter_map(|l| l.strip_prefix("rip "))
        .map(|l| l.split(' ').map(str::to_owned).collect())
        .collect();
    let got: Vec<Vec<String>> = r.of("rsprof_test:rip").iter().map(|h| h[5..].to_vec()).collect();
    assert_eq!(want.len(), 4, "{}", r.stderr);
    assert_eq!(got, want);
    // In the profile: instant markers named by the probe, arguments as `arg0…` fields.
    let in_profile: Vec<Vec<String>> = threads(&r.profile)
        .iter()
        .flat_map(|t| markers(t.thread))
        .filter(|m| m.name == "rsprof_test:rip")
        .map(|m| {
            assert_eq!((m.phase, &m.data["type"]), (0, &"USDT rsprof_test:rip".into()), "{m:?}");
            (0..3).map(|i| m.data[format!("arg{i}")].to_string()).collect()
        })
        .collect();
    assert_eq!(in_profile, want);
}

#[test]
fn snapshots_show_intervals_still_open() {
    let exe = fixtures::build("usdt_app").unwrap();
    let mut child = Command::new(&exe)
        .arg("long")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = output_path("open_snapshot", "json");
    let mut rec = Recording::start(&["-p", &pid.to_string()], out.clone()).unwrap();
    // The profiler samples: begin the interval, and snapshot once it has begun.
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    stdin.write_all(b"begin\n").unwrap();
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line, "begun\n");
    let begun = Instant::now();
    rec.signal(10); // SIGUSR1
    rec.wait_for_line("wrote snapshot", Duration::from_secs(60)).expect("snapshot");
    let open_for = begun.elapsed().as_secs_f64() * 1000.0;
    drop(stdin); // ends the interval
    assert!(child.wait().unwrap().success());
    let done = rec.interrupt().unwrap();
    let long = |profile: &Value| -> Vec<(u64, Option<f64>, Option<f64>, Value)> {
        if let Err(problems) = validate(profile) {
            panic!("profile breaks the Gecko v36 rules:\n{}", problems.join("\n"));
        }
        threads_of_pid(profile, pid)
            .iter()
            .filter(|t| t.tid == t.pid)
            .flat_map(|t| markers(t.thread))
            .filter(|m| m.name == "long")
            .map(|m| (m.phase, m.start, m.end, m.data["id"].clone()))
            .collect()
    };
    let snap = tests::gecko_schema::load(out.with_file_name("open_snapshot.snapshot-1.json"))
        .expect("snapshot written");
    let in_snap = long(&snap);
    assert!(
        matches!(in_snap[..], [(2, Some(_), None, ref id)] if *id == 7),
        "an IntervalStart in the snapshot: {in_snap:?}"
    );
    let in_final = long(&done.profile().unwrap());
    let [(1, Some(a), Some(b), _)] = in_final[..] else { panic!("{in_final:?}") };
    assert!(b - a >= open_for && in_snap[0].1 == Some(a), "{in_final:?} {in_snap:?} {open_for}");
}

/// Parses a `--usdt-dump` file into hit fields.
fn dump_hits(path: &std::path::Path) -> Vec<Vec<String>> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("label "))
        .map(split_fields)
        .collect()
}

/// The summary's count of /proc/PID/maps reads after the initial scan.
fn late_maps_reads(stderr: &str) -> u64 {
    let line = stderr.lines().find(|l| l.contains("/proc/PID/maps read ")).expect(stderr);
    let rest = line.rsplit_once(" (").expect(line).1;
    rest.split(' ').next().unwrap().parse().expect(line)
}

#[test]
fn probes_fire_from_the_first_instruction_of_programs_built_during_the_recording() {
    let out = output_path("fresh", "json");
    let dump = output_path("fresh", "hits");
    let rec = Recording::start(&["--all", "--usdt-dump", dump.to_str().unwrap()], out.clone());
    let rec = rec.unwrap();
    // Built now, and copied to a new file (a new inode) for each run: 100 programs the
    // profiler has never seen, each firing its probes at the top of main.
    let src = fixtures::source_dir().join("usdt_first.c.in");
    let include = fixtures::workspace_root().join("include");
    let built = output_path("usdt_first", "bin");
    let st = Command::new("gcc")
        .args(["-O1", "-x", "c"])
        .arg(format!("-I{}", include.display()))
        .arg("-o")
        .arg(&built)
        .arg(&src)
        .status()
        .unwrap();
    assert!(st.success(), "building {}", src.display());
    let mut pids = Vec::new();
    let mut times = Vec::new();
    for i in 0..100 {
        let exe = output_path(&format!("usdt_first_{i}"), "bin");
        std::fs::copy(&built, &exe).unwrap();
        let t = Instant::now();
        let mut child = spawn_fresh(&mut Command::new(&exe));
        pids.push(child.id().to_string());
        assert!(child.wait().unwrap().success());
        times.push(t.elapsed());
    }
    // The same file again: answered without a scan.
    let t = Instant::now();
    assert!(Command::new(&built).status().unwrap().success());
    let known = t.elapsed();
    let done = rec.interrupt().unwrap();
    assert!(done.status.success(), "{}", done.stderr);
    times.sort();
    eprintln!(
        "fresh-file runs (spawn to exit): median {:?}, max {:?}; a scanned file: {known:?}",
        times[50], times[99]
    );
    let hits = dump_hits(&dump);
    let fired = |pid: &str, probe: &str| hits.iter().any(|h| h[1] == pid && h[4] == probe);
    let both = pids.iter().filter(|p| fired(p, "rsprof:marker") && fired(p, "rsprof:begin"));
    let both = both.count();
    assert!(both >= 99, "{both} of 100 runs have their first marker and begin:\n{}", done.stderr);
    let profile = tests::gecko_schema::load(&out).unwrap();
    if let Err(problems) = validate(&profile) {
        panic!("profile breaks the Gecko v36 rules:\n{}", problems.join("\n"));
    }
    let mut firsts = 0;
    for pid in &pids {
        let ms: Vec<Marker> = threads_of_pid(&profile, pid.parse().unwrap())
            .iter()
            .flat_map(|t| markers(t.thread))
            .collect();
        assert!(!ms.iter().any(|m| m.name == "rsprof:end without begin"), "{pid}: {ms:?}");
        firsts += usize::from(ms.iter().any(|m| m.name == "first" && m.phase == 0));
    }
    assert!(firsts >= 99, "{firsts} of 100 runs have their marker in the profile");
    // Each file was held once while scanned. /proc/PID/maps is never read for the new
    // processes: only for one first seen without a fork record (rare; not once per process).
    let gate = done.stderr.lines().find(|l| l.contains("exec gate:")).expect(&done.stderr);
    let held: u64 = gate.split(", ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(held >= 100, "{gate}");
    assert!(late_maps_reads(&done.stderr) < 10, "{}", done.stderr);
}

#[test]
fn python_gc_probes_without_a_path_are_found_in_processes_started_before_and_after() {
    // Each waits for a line, runs 25 explicit collections between two clock readings, prints
    // them and exits. The interpreter also collects on its own; only collections inside the
    // window are counted.
    let code = "import gc, sys, time\nprint('ready', flush=True)\nsys.stdin.readline()\n\
                t0 = time.monotonic_ns()\nfor _ in range(25): gc.collect()\n\
                t1 = time.monotonic_ns()\nprint(t0, t1, flush=True)\n";
    let spawn = || {
        let mut c = Background(
            Command::new(PYTHON)
                .args(["-c", code])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let mut out = BufReader::new(c.0.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line, "ready\n");
        (c, out)
    };
    let before = spawn();
    let out = output_path("py_all", "json");
    let dump = output_path("py_all", "hits");
    let args = [
        "--all",
        "--usdt-interval",
        "python:gc__start:gc__done",
        "--usdt-dump",
        dump.to_str().unwrap(),
    ];
    let rec = Recording::start(&args, out.clone()).unwrap();
    let after = spawn();
    let mut windows = Vec::new();
    for (mut c, mut out) in [before, after] {
        c.0.stdin.take().unwrap().write_all(b"go\n").unwrap();
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let t: Vec<u64> = line.split_whitespace().map(|v| v.parse().unwrap()).collect();
        assert!(c.0.wait().unwrap().success());
        windows.push((c.0.id(), t[0], t[1]));
    }
    let done = rec.interrupt().unwrap();
    assert!(done.status.success(), "{}", done.stderr);
    let hits = dump_hits(&dump);
    let profile = tests::gecko_schema::load(&out).unwrap();
    if let Err(problems) = validate(&profile) {
        panic!("profile breaks the Gecko v36 rules:\n{}", problems.join("\n"));
    }
    for (pid, t0, t1) in windows {
        let in_window = |probe: &str, arg: Option<&str>| {
            hits.iter()
                .filter(|h| h[1] == pid.to_string() && h[4] == probe)
                .filter(|h| (t0..=t1).contains(&h[0].parse::<u64>().unwrap()))
                .filter(|h| arg.is_none_or(|a| h[5] == a))
                .count()
        };
        // gc__start's argument is the generation; gc__done's the number of objects collected.
        let starts = in_window("python:gc__start", Some("2"));
        let dones = in_window("python:gc__done", None);
        assert!(starts == 25 && dones >= 25, "pid {pid}: {starts} {dones}:\n{}", done.stderr);
        let intervals = threads_of_pid(&profile, pid)
            .iter()
            .flat_map(|t| markers(t.thread))
            .filter(|m| m.name == "python:gc__start:gc__done" && m.phase == 1)
            .filter(|m| m.data["start0"] == 2)
            .count();
        assert!(intervals >= 25, "pid {pid}: {intervals} gen-2 gc intervals");
    }
}

/// The exec gate answers every exec within its deadline (50 ms): a file whose scan is made to
/// take 2 s (the hidden `RSPROF_TEST_SLOW_SCAN` hook sleeps inside the scan) still runs at
/// once, and the summary counts the hold as let go at the deadline.
#[test]
fn a_slow_scan_holds_an_exec_no_longer_than_the_gate_deadline() {
    let out = output_path("slow_scan", "json");
    // A fresh copy (a file the gate has not seen) under a name only this test uses.
    let exe = output_path("rsprof_slow_scan_true", "bin");
    std::fs::copy("/bin/true", &exe).unwrap();
    let name = exe.file_name().unwrap().to_str().unwrap().to_owned();
    let hook = format!("{name}:2000");
    let rec = Recording::start_with_env(&["--all"], out, &[("RSPROF_TEST_SLOW_SCAN", &hook)]);
    let rec = rec.unwrap();
    let t = Instant::now();
    assert!(Command::new(&exe).status().unwrap().success());
    let took = t.elapsed();
    // Past the scanner's lock (still held by the slow scan): a second new file is also let go.
    let other = output_path("rsprof_slow_scan_other", "bin");
    std::fs::copy("/bin/true", &other).unwrap();
    let t = Instant::now();
    assert!(Command::new(&other).status().unwrap().success());
    let took_other = t.elapsed();
    let done = rec.interrupt().unwrap();
    assert!(done.status.success(), "{}", done.stderr);
    eprintln!("slow-scan file ran in {took:?}, the next new file in {took_other:?}");
    // The deadline plus a margin for a loaded 2-CPU machine: far below the 2 s scan.
    let bound = Duration::from_millis(50 + 300);
    assert!(took < bound, "the exec of a file scanned for 2 s took {took:?}");
    assert!(took_other < bound, "a new file behind the slow scan took {took_other:?}");
    let gate = done.stderr.lines().find(|l| l.contains("exec gate:")).expect(&done.stderr);
    let expired: u64 = (gate.split(" let go at the 50 ms deadline").next())
        .and_then(|l| l.rsplit(", ").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no deadline count: {gate}"));
    assert!(expired >= 1, "{gate}");
}
