//! A killed recording leaves nothing beside its output: the pending profile (and a pending
//! snapshot) is an unnamed file until it is complete. Needs root; run serially.

use std::{
    fs,
    os::unix::process::ExitStatusExt as _,
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use tests::harness::{Recording, command};

/// A fresh, empty directory for one test's output.
fn empty_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rsprof-it-{}-{test}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    fs::canonicalize(dir).unwrap()
}

fn entries(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// How many files under `dir` process `pid` has open (named or not: an unnamed file reads as
/// `DIR/#INODE (deleted)`).
fn open_files_in(pid: u32, dir: &Path) -> usize {
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else { return 0 };
    fds.filter_map(|fd| fs::read_link(fd.ok()?.path()).ok())
        .filter(|target| target.starts_with(dir))
        .count()
}

/// Polls until `pid` has `n` files open under `dir`.
fn wait_for_open_files(pid: u32, dir: &Path, n: usize, timeout: Duration) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if open_files_in(pid, dir) >= n {
            return true;
        }
        std::thread::yield_now();
    }
    false
}

fn kill(pid: u32, sig: i32) {
    // SAFETY: signalling a child of this test.
    assert_eq!(unsafe { libc::kill(pid as i32, sig) }, 0, "kill({pid}, {sig})");
}

/// Whether `pid` has a handler installed for `sig` (the SigCgt mask of /proc/PID/status).
fn catches(pid: u32, sig: i32) -> bool {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let mask = status.lines().find_map(|l| l.strip_prefix("SigCgt:")).expect("SigCgt line");
    u64::from_str_radix(mask.trim(), 16).unwrap() & (1 << (sig - 1)) != 0
}

#[test]
fn sigkill_while_recording_or_writing_a_snapshot_leaves_nothing() {
    let dir = empty_dir("sigkill");
    let rec = Recording::start(&["--all"], dir.join("p.json.gz")).expect("start recording");
    assert_eq!(open_files_in(rec.pid(), &dir), 1, "the pending output is open");
    rec.signal(libc::SIGKILL);
    let done = rec.wait().unwrap();
    assert_eq!(done.status.signal(), Some(libc::SIGKILL), "{}", done.stderr);
    assert_eq!(entries(&dir), Vec::<String>::new(), "left beside the output");

    // Killed while a snapshot of the whole machine is being written.
    let rec = Recording::start(&["--all"], dir.join("p.json")).expect("start recording");
    std::thread::sleep(Duration::from_millis(500)); // some data for the snapshot
    rec.signal(libc::SIGUSR1);
    let writing = wait_for_open_files(rec.pid(), &dir, 2, Duration::from_secs(10));
    rec.signal(libc::SIGKILL);
    let done = rec.wait().unwrap();
    assert!(writing, "no snapshot file was opened:\n{}", done.stderr);
    assert!(
        !done.stderr.contains("wrote snapshot"),
        "the snapshot finished first:\n{}",
        done.stderr
    );
    assert_eq!(done.status.signal(), Some(libc::SIGKILL), "{}", done.stderr);
    assert_eq!(entries(&dir), Vec::<String>::new(), "left beside the output");
}

#[test]
fn sigterm_at_the_earliest_moment_leaves_nothing_half_written() {
    let dir = empty_dir("sigterm");
    // The output is opened (so an unwritable path fails early) just before the signal handlers
    // are installed; the BPF programs load after both. Catch the profiler as soon as its output
    // is open: stopped, checked for a SIGTERM handler, then terminated. Without a handler the
    // default action kills it and nothing may be left; with one (the usual case, the window is
    // microseconds) it stops like a Ctrl-C during start-up and may leave only a whole profile.
    let (mut killed, mut handled) = (0, 0);
    for _ in 0..10 {
        let child = command()
            .unwrap()
            .args(["--all", "-o"])
            .arg(dir.join("p.json"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let opened = wait_for_open_files(pid, &dir, 1, Duration::from_secs(10));
        kill(pid, libc::SIGSTOP);
        let has_handler = catches(pid, libc::SIGTERM);
        kill(pid, libc::SIGTERM);
        kill(pid, libc::SIGCONT);
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(opened, "rsprof-bpf never opened its output ({}):\n{stderr}", out.status);
        let left = entries(&dir);
        if has_handler {
            handled += 1;
            assert!(out.status.success(), "a handled SIGTERM is a normal stop:\n{stderr}");
            assert!(left.len() <= 1, "at most the profile is left: {left:?}");
            if left.len() == 1 {
                assert_eq!(left[0], "p.json", "only the profile itself: {left:?}");
                tests::gecko_schema::load(dir.join("p.json")).expect("a whole profile");
                fs::remove_file(dir.join("p.json")).unwrap();
            }
        } else {
            killed += 1;
            assert_eq!(out.status.signal(), Some(libc::SIGTERM), "killed by SIGTERM:\n{stderr}");
            assert_eq!(left, Vec::<String>::new(), "left beside the output");
        }
    }
    eprintln!("{killed} killed before the handler existed, {handled} stopped by it");
}
