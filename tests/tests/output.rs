//! Where the profile goes. A killed recording leaves nothing beside its output: the pending
//! profile (and a pending snapshot) is an unnamed file until it is complete. A device, FIFO or
//! our own standard output is written in place and stays what it was. Needs root; run
//! serially.

use std::{
    fs,
    os::unix::process::ExitStatusExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use tests::harness::{Background, Recording, command};

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
    let split = tests::fixtures::build("split").unwrap();
    let busy = Background(Command::new(&split).arg("600").stdout(Stdio::null()).spawn().unwrap());
    let rec = Recording::start(&["--all"], dir.join("p.json")).expect("start recording");
    // Some data for the snapshot: a few hundred samples of a busy fixture.
    let cpu = Duration::from_millis(300);
    let start = tests::wait::cpu_time(busy.0.id()).expect("fixture runs");
    tests::wait::until_cpu_time(busy.0.id(), start, cpu, Duration::from_secs(30)).unwrap();
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

/// The file type, device numbers and inode of `p`, symlinks not followed: what must be the
/// same after rsprof-bpf wrote to it in place.
fn identity(p: &Path) -> (u32, u64, u64) {
    use std::os::unix::fs::MetadataExt as _;
    let m = fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    (m.mode() & libc::S_IFMT, m.rdev(), m.ino())
}

fn mknod_char(path: &Path, major: u32, minor: u32) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path; the test runs as root.
    let r = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(major, minor)) };
    assert_eq!(r, 0, "mknod {}: {}", path.display(), std::io::Error::last_os_error());
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", path.display());
}

/// A short recording of a busy shell loop, the output named by `out`; `-d` is spelled with a
/// unit, as users may. Returns the exit status, stdout bytes and stderr.
fn record_to(out: &str, extra: &[&str]) -> (std::process::ExitStatus, Vec<u8>, String) {
    let busy = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done";
    let child = command()
        .unwrap()
        .args(["-F", "199", "-d", "1500ms", "-o", out])
        .args(extra)
        .args(["--", "sh", "-c", busy])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (out.status, out.stdout, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// What a reader of a stream got must be a whole profile the Firefox Profiler imports.
fn check_profile_bytes(dir: &Path, name: &str, bytes: &[u8], gzip: bool) {
    assert_eq!(bytes.starts_with(&[0x1f, 0x8b]), gzip, "gzip {gzip}: {} bytes", bytes.len());
    let file = dir.join(name);
    fs::write(&file, bytes).unwrap();
    let p = tests::gecko_schema::load(&file).expect("a whole profile");
    // The recorded command is a process of its own (the top level holds the parent's threads).
    let procs = p["processes"].as_array().map_or(0, |p| p.len());
    assert!(procs > 0, "the recorded command's process in {name}");
}

/// A character device, a FIFO with a reader, `/proc/self/fd/1`, `/dev/stdout` and `-`: each is
/// written in place and is afterwards the same node it was (type, device numbers, inode).
#[test]
fn devices_fifos_and_stdout_are_written_in_place() {
    let dir = empty_dir("inplace");

    // A /dev/null made here: written, still the device.
    let null = dir.join("null");
    mknod_char(&null, 1, 3);
    let before = identity(&null);
    let (status, _, stderr) = record_to(null.to_str().unwrap(), &[]);
    assert!(status.success(), "{stderr}");
    assert_eq!(identity(&null), before, "the device node is unchanged:\n{stderr}");

    // A /dev/full: the write fails with a clear error, the node is left as it was.
    let full = dir.join("full");
    mknod_char(&full, 1, 7);
    let before = identity(&full);
    let (status, _, stderr) = record_to(full.to_str().unwrap(), &[]);
    assert!(!status.success(), "writing to a full device must fail:\n{stderr}");
    assert!(stderr.contains("No space left on device"), "{stderr}");
    assert_eq!(identity(&full), before, "the device node is unchanged:\n{stderr}");

    // A FIFO with a reader: it gets the whole (gzipped, by the name) profile.
    let fifo = dir.join("p.json.gz");
    mkfifo(&fifo);
    let before = identity(&fifo);
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || fs::read(fifo).unwrap())
    };
    let (status, _, stderr) = record_to(fifo.to_str().unwrap(), &[]);
    assert!(status.success(), "{stderr}");
    let got = reader.join().unwrap();
    assert_eq!(identity(&fifo), before, "still the same FIFO:\n{stderr}");
    check_profile_bytes(&dir, "from-fifo.json.gz", &got, true);

    // Our own pipe, as /proc/self/fd/1 (self is rsprof-bpf), /dev/stdout and `-` (gzip on -z).
    let dev_stdout = identity(Path::new("/dev/stdout"));
    for (out, extra, gzip) in [
        ("/proc/self/fd/1", &[][..], false),
        ("/dev/stdout", &[], false),
        ("-", &["-z"], true),
        ("-", &[], false),
    ] {
        let (status, stdout, stderr) = record_to(out, extra);
        assert!(status.success(), "-o {out}: {stderr}");
        assert!(!stderr.contains("\nwrote -"), "{stderr}");
        check_profile_bytes(&dir, "from-stdout.json", &stdout, gzip);
        assert_eq!(identity(Path::new("/dev/stdout")), dev_stdout, "/dev/stdout is a link still");
    }
    let left = {
        let mut v = entries(&dir);
        v.sort();
        v
    };
    let want = ["from-fifo.json.gz", "from-stdout.json", "full", "null", "p.json.gz"];
    assert_eq!(left, want, "nothing else was created beside them");
}

/// A regular file behind a symlink is replaced atomically and the link stays a link: a
/// recording killed mid-run leaves the old content; a finished one, the new profile.
#[test]
fn a_symlinked_file_is_written_through_atomically() {
    let dir = empty_dir("symlink");
    let real = dir.join("real.json");
    fs::write(&real, "old").unwrap();
    let link = dir.join("p.json");
    std::os::unix::fs::symlink("real.json", &link).unwrap();
    let link_id = identity(&link);

    let rec = Recording::start(&["--all", "-F", "99"], link.clone()).expect("start recording");
    rec.signal(libc::SIGKILL);
    let done = rec.wait().unwrap();
    assert_eq!(done.status.signal(), Some(libc::SIGKILL), "{}", done.stderr);
    assert_eq!(fs::read_to_string(&real).unwrap(), "old", "a killed run leaves the old file");
    assert_eq!(identity(&link), link_id);

    let (status, _, stderr) = record_to(link.to_str().unwrap(), &[]);
    assert!(status.success(), "{stderr}");
    assert_eq!(identity(&link), link_id, "the link itself is untouched");
    tests::gecko_schema::load(&real).expect("the target holds the new profile");
    let mut left = entries(&dir);
    left.sort();
    assert_eq!(left, ["p.json", "real.json"]);
}

/// SIGUSR1 with a stream output: the snapshot goes to the working directory under a name of
/// its own, never under /dev or into the stream.
#[test]
fn a_snapshot_of_a_stream_output_goes_to_the_working_directory() {
    use std::io::{BufRead as _, Read as _};
    let dir = empty_dir("snapstream");
    let mut child = command()
        .unwrap()
        .args(["--all", "-F", "99", "-o", "-"])
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        stdout.read_to_end(&mut v).unwrap();
        v
    });
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    let mut wait_for = |needle: &str, seen: &mut Vec<String>| loop {
        match lines.next() {
            Some(Ok(l)) => {
                let hit = l.contains(needle);
                seen.push(l);
                if hit {
                    return;
                }
            }
            _ => panic!("no {needle:?} line:\n{}", seen.join("\n")),
        }
    };
    wait_for("rsprof-bpf: sampling", &mut seen);
    kill(pid, libc::SIGUSR1);
    wait_for("wrote snapshot", &mut seen);
    kill(pid, libc::SIGINT);
    let status = child.wait().unwrap();
    assert!(status.success(), "{}", seen.join("\n"));
    let snap = dir.join("rsprof.snapshot-1.json");
    assert!(seen.iter().any(|l| l.contains("rsprof.snapshot-1.json")), "{}", seen.join("\n"));
    tests::gecko_schema::load(&snap).expect("a whole snapshot");
    check_profile_bytes(&dir, "final.json", &reader.join().unwrap(), false);
}

/// One duration syntax: a bad unit is a one-line error before anything starts.
#[test]
fn durations_take_units_and_a_bad_one_is_a_one_line_error() {
    let out = command().unwrap().args(["--all", "-d", "5x"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("invalid duration '5x'"), "{stderr}");
    let out = command().unwrap().args(["agent", "--window", "5parsecs"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("invalid duration '5parsecs'"), "{stderr}");
}
