//! The agent's flight recorder for real: a USDT-marker-firing fixture runs under
//! `rsprof-bpf agent --flight-recorder 2m`; `rsprof-bpf dump` gets its samples and markers as
//! a Gecko profile (read by the Firefox Profiler's importer) while windows keep being spooled;
//! SIGUSR1 writes a dump into the dump dir; the socket is root's only, twice over (its mode,
//! and SO_PEERCRED should the mode be loosened). Needs root; the agent samples `--all`, so
//! every check is about the fixture's own pid.

use std::{
    fs,
    io::{BufRead as _, BufReader},
    os::unix::fs::{FileTypeExt as _, MetadataExt as _, PermissionsExt as _},
    path::Path,
    process::{Command, Stdio},
    sync::mpsc,
    time::Duration,
};

use serde_json::Value;
use tests::{
    agent::Agent,
    fixtures,
    gecko_schema::{self, validate},
    harness::{Background, command, output_path},
    profile_query::{markers, sample_times, threads_of_pid},
};

fn mode(p: &Path) -> u32 {
    fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
}

/// (samples, "tick" markers, "step" intervals) of `pid` in `profile`, which must be valid.
fn fixture_content(profile: &Value, pid: u32) -> (usize, usize, usize) {
    if let Err(problems) = validate(profile) {
        panic!("dump breaks the Gecko v36 rules:\n{}", problems.join("\n"));
    }
    let threads = threads_of_pid(profile, pid);
    let samples = threads.iter().map(|t| sample_times(t.thread).len()).sum();
    let ms: Vec<_> = threads.iter().flat_map(|t| markers(t.thread)).collect();
    let ticks = ms.iter().filter(|m| m.name == "tick").count();
    let steps = ms.iter().filter(|m| m.name == "step" && m.phase == 1).count();
    (samples, ticks, steps)
}

/// `rsprof-bpf dump ARGS` as root, or through `setpriv` as `nobody`.
fn dump(args: &[&str], as_nobody: bool) -> std::process::Output {
    let mut cmd = if as_nobody {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"]);
        c.arg(fixtures::rsprof_bin().unwrap());
        c
    } else {
        command().unwrap()
    };
    cmd.arg("dump").args(args).output().unwrap()
}

#[test]
fn flight_recorder_dumps_markers_and_samples_while_windows_go_on() {
    let spool = output_path("flight_spool", "d");
    let dumps = output_path("flight_dumps", "d");
    let sock_dir = output_path("flight_sock", "d");
    for d in [&spool, &dumps, &sock_dir] {
        let _ = fs::remove_dir_all(d);
    }
    let sock = sock_dir.join("agent.sock");
    let s = sock.to_str().unwrap();
    let mut agent = Agent::start(&[
        "--spool",
        spool.to_str().unwrap(),
        "--window",
        "1",
        "-F",
        "99",
        "--flight-recorder",
        "2m",
        "--dump-socket",
        s,
        "--dump-dir",
        dumps.to_str().unwrap(),
    ]);
    // Runs until its stdin closes; one stdout line per step (tick marker + step interval).
    let exe = fixtures::build("usdt_app").unwrap();
    let mut app = Background(
        Command::new(&exe)
            .args(["markers", "0"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let pid = app.0.id();
    let stop_app = app.0.stdin.take().unwrap();
    let (step_tx, steps) = mpsc::channel();
    let lines = BufReader::new(app.0.stdout.take().unwrap()).lines();
    std::thread::spawn(move || lines.map_while(Result::ok).try_for_each(|_| step_tx.send(())));
    // Probes are attached when the agent sees the exec; 3,000 steps (over 3 s) give it time.
    let n = steps.iter().take(3000).count();
    assert_eq!(n, 3000, "the fixture stopped early");

    // The socket: root's, 0600, in a 0700 directory.
    let meta = fs::symlink_metadata(&sock).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!((meta.uid(), mode(&sock), mode(&sock_dir)), (0, 0o600, 0o700));

    let windows_before = agent.seen.iter().filter(|l| l.contains("rsprof-bpf: window:")).count();
    let out = output_path("flight_dump", "json.gz");
    let _ = fs::remove_file(&out);
    let o = out.to_str().unwrap();
    let r = dump(&["--last", "1m", "-o", o, "--socket", s], false);
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "dump failed: {stderr}");
    assert!(stderr.contains("rsprof-bpf: wrote ") && stderr.contains(" markers"), "{stderr}");
    assert_eq!(mode(&out), 0o600);
    let profile = gecko_schema::load(&out).expect("the Firefox Profiler's importer reads it");
    let (samples, ticks, steps_seen) = fixture_content(&profile, pid);
    assert!(
        samples > 50 && ticks > 300 && steps_seen > 300,
        "the fixture in the dump: {samples} samples, {ticks} ticks, {steps_seen} steps"
    );
    // At most the last minute: nothing in the profile before its start.
    let dur_ms = profile["meta"]["profilingEndTime"].as_f64().unwrap_or(0.0)
        - profile["meta"]["profilingStartTime"].as_f64().unwrap_or(0.0);
    assert!(dur_ms <= 60_500.0, "a dump of the last minute spans {dur_ms} ms");

    // The agent kept running and spooling: more windows come, the fixture's among them.
    agent.wait_for("flight recorder: sent the last", Duration::from_secs(30));
    for _ in 0..2 {
        agent.wait_for("rsprof-bpf: window:", Duration::from_secs(30));
    }
    let windows_after = agent.seen.iter().filter(|l| l.contains("rsprof-bpf: window:")).count();
    assert!(windows_after >= windows_before + 2, "{windows_before} → {windows_after}");
    let spooled: Vec<_> = fs::read_dir(&spool).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(!spooled.is_empty());
    for p in &spooled {
        assert_eq!(mode(p), 0o600, "{}", p.display());
    }

    // SIGUSR1: the whole flight recorder into the dump dir.
    agent.signal(libc::SIGUSR1);
    let line = agent.wait_for("flight recorder: wrote ", Duration::from_secs(60));
    let files: Vec<_> = fs::read_dir(&dumps).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{line}: {files:?}");
    assert_eq!((mode(&dumps), mode(&files[0])), (0o700, 0o600));
    assert!(files[0].to_str().unwrap().ends_with(".json.gz"), "{files:?}");
    let profile = gecko_schema::load(&files[0]).unwrap();
    let (samples2, ticks2, _) = fixture_content(&profile, pid);
    assert!(samples2 >= samples && ticks2 >= ticks, "{samples2} samples, {ticks2} ticks");

    // Not root: refused by the socket's mode...
    let nobody_out =
        std::env::temp_dir().join(format!("rsprof-flight-{}.json", std::process::id()));
    let n = nobody_out.to_str().unwrap();
    let r = dump(&["-o", n, "--socket", s], true);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success(), "nobody dumped: {err}");
    assert!(err.contains("permission denied (only root may dump"), "{err}");
    // ...and by the agent itself (SO_PEERCRED) with the mode loosened.
    fs::set_permissions(&sock_dir, fs::Permissions::from_mode(0o711)).unwrap();
    fs::set_permissions(&sock, fs::Permissions::from_mode(0o666)).unwrap();
    let r = dump(&["-o", n, "--socket", s], true);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success(), "nobody dumped: {err}");
    assert!(err.contains("the agent refused the dump: refused: uid 65534 is not root"), "{err}");
    agent.wait_for("dump socket: refused uid 65534", Duration::from_secs(10));
    let _ = fs::remove_file(&nobody_out);

    drop(stop_app);
    let st = app.0.wait().unwrap();
    assert!(st.success());
    let (status, stderr) = agent.stop(libc::SIGTERM, Duration::from_secs(5));
    assert!(status.success(), "{stderr}");
    assert!(!sock.exists(), "the socket is removed at exit");
}
