//! End-to-end recordings: rsprof-bpf loads its BPF programs into the running kernel and
//! profiles real fixture processes. Needs root; run serially (`--test-threads=1`), since
//! `--all` recordings see every process on the machine. Assertions are about the fixture's own
//! pid, so other activity on the machine does not matter.

use std::{
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use serde_json::Value;
use tests::{
    fixtures,
    gecko_schema::validate,
    harness::{Background, Recording, output_path, run, run_fixture},
    profile_query::{
        ThreadInfo, count_samples_with_path, module_name, sample_stacks, threads, threads_of_pid,
    },
    wait,
};

fn valid(profile: &Value) {
    if let Err(problems) = validate(profile) {
        panic!("profile breaks the Gecko v36 rules:\n{}", problems.join("\n"));
    }
}

/// Records `--all` while `workload` runs, stops with SIGINT, returns the validated profile.
fn record_all<T>(test: &str, workload: impl FnOnce() -> T) -> (Value, T, String) {
    let rec = Recording::start(&["--all"], output_path(test, "json")).expect("start recording");
    let out = workload();
    let done = rec.interrupt().expect("stop recording");
    let profile = done.profile().expect("profile written");
    valid(&profile);
    (profile, out, done.stderr)
}

fn single_thread<'v>(profile: &'v Value, pid: u32) -> ThreadInfo<'v> {
    let mut ts = threads_of_pid(profile, pid);
    assert_eq!(ts.len(), 1, "fixture {pid} has one thread: {:?}", names(&ts));
    ts.remove(0)
}

fn names(ts: &[ThreadInfo]) -> Vec<String> {
    ts.iter().map(|t| format!("{}:{}:{}", t.process_name, t.tid, t.name)).collect()
}

fn check_split(test: &str, fixture: &str, main: &str, work: &str, hot_a: &str, hot_b: &str) {
    let (profile, pid, _) = record_all(test, || run_fixture(fixture, &["3"]).expect("run fixture"));
    let t = single_thread(&profile, pid);
    let a = count_samples_with_path(t.thread, &[main, work, hot_a]);
    let b = count_samples_with_path(t.thread, &[main, work, hot_b]);
    let total = sample_stacks(t.thread).len();
    assert!(total > 1000, "3 s of one busy thread at 999 Hz gives ~3000 samples, got {total}");
    assert!(
        (a + b) as f64 > 0.9 * total as f64,
        "main → work → hot_* in most samples: {a} + {b} of {total}"
    );
    let share = 100.0 * a as f64 / (a + b) as f64;
    assert!((70.0..=80.0).contains(&share), "hot_a share {share:.1}% (a={a}, b={b}), want 75 ± 5");
}

#[test]
fn c_fixture_split_is_75_25_under_main_work() {
    check_split("split_c", "split.c", "main", "work", "hot_a", "hot_b");
}

#[test]
fn rust_fixture_split_is_75_25_under_main_work() {
    check_split(
        "split_rs",
        "split.rs",
        "split::main",
        "split::work",
        "split::hot_a",
        "split::hot_b",
    );
}

#[test]
fn syscall_heavy_fixture_has_kernel_frames_under_user_frames() {
    let (profile, pid, _) =
        record_all("syscalls", || run_fixture("syscalls", &["2"]).expect("run fixture"));
    let t = single_thread(&profile, pid);
    let stacks = sample_stacks(t.thread);
    let in_kernel_from_user = stacks
        .iter()
        .filter(|st| {
            st.windows(2).any(|w| {
                w[0].starts_with("do_syscalls ") && module_name(&w[1]) == Some("[kernel.kallsyms]")
            })
        })
        .count();
    assert!(
        in_kernel_from_user as f64 > 0.3 * stacks.len() as f64,
        "kernel frames directly beneath do_syscalls in {in_kernel_from_user} of {} samples",
        stacks.len()
    );
    // Kernel frames are named by the kernel's own kallsyms lookup (bpf::ksym): each name is
    // a symbol of /proc/kallsyms, never a bare address.
    let kallsyms: std::collections::HashSet<String> = std::fs::read_to_string("/proc/kallsyms")
        .expect("read /proc/kallsyms")
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_owned))
        .collect();
    let kernel_names: Vec<&str> = stacks
        .iter()
        .flatten()
        .filter(|f| module_name(f) == Some("[kernel.kallsyms]"))
        .map(|f| f.split(" (in ").next().unwrap())
        .collect();
    assert!(!kernel_names.is_empty(), "no kernel frames");
    let unknown: Vec<&&str> = kernel_names.iter().filter(|n| !kallsyms.contains(**n)).collect();
    assert!(unknown.is_empty(), "kernel frames not named by kallsyms: {unknown:?}");
    // Kernel frames are never above user frames in a stack.
    for st in &stacks {
        if let Some(k) = st.iter().position(|f| module_name(f) == Some("[kernel.kallsyms]")) {
            assert!(
                st[k..].iter().all(|f| module_name(f) == Some("[kernel.kallsyms]")),
                "user frame below a kernel frame: {st:?}"
            );
        }
    }
}

#[test]
fn short_lived_process_is_present_with_named_frames() {
    let mut rec = Recording::start(&["--all"], output_path("shortlived", "json")).expect("start");
    // Its stacks are walked from its first sample only once the host's start-up tables are in
    // (the loader is busy with them until then).
    rec.wait_for_line("start-up unwind tables loaded", Duration::from_secs(60)).expect("tables");
    let pid = run_fixture("shortlived", &["300"]).expect("run fixture");
    let done = rec.interrupt().expect("stop recording");
    let profile = done.profile().expect("profile written");
    valid(&profile);
    let stderr = done.stderr;
    let walks: Vec<&str> = (stderr.lines())
        .filter(|l| {
            ["user stacks:", "stack copies:", "start-up tables:"].iter().any(|k| l.contains(k))
        })
        .collect();
    let t = single_thread(&profile, pid);
    assert_eq!(t.process_name, "shortlived");
    let named = count_samples_with_path(t.thread, &["main", "short_hot"]);
    let total = sample_stacks(t.thread).len();
    assert!(total >= 100, "300 ms at 999 Hz: got {total} samples");
    assert!(
        named as f64 >= 0.9 * total as f64,
        "{named} of {total} samples named main → short_hot; {walks:#?}"
    );
    assert!(t.thread["unregisterTime"].is_number(), "exit time recorded");
    // Its process has a command line from the exec tracepoint, even though it is gone now.
    let reg = t.thread["registerTime"].as_f64().unwrap();
    let first = t.thread["samples"]["data"][0]
        [t.thread["samples"]["schema"]["time"].as_u64().unwrap() as usize]
        .as_f64()
        .unwrap();
    assert!(reg <= first);
}

#[test]
fn threads_keep_their_names_and_renames() {
    let (profile, pid, _) =
        record_all("threads", || run_fixture("threads", &["2"]).expect("run fixture"));
    let ts = threads_of_pid(&profile, pid);
    let mut names: Vec<&str> = ts.iter().map(|t| t.name).collect();
    names.sort();
    for want in ["worker-a", "renamed-b", "worker-c"] {
        assert!(names.contains(&want), "thread {want} missing from {names:?}");
    }
    for (name, func) in [("worker-a", "burn_a"), ("renamed-b", "burn_b"), ("worker-c", "burn_c")] {
        let t = ts.iter().find(|t| t.name == name).unwrap();
        assert!(count_samples_with_path(t.thread, &[func]) > 100, "{name} burns in {func}");
        assert!(t.process_name == "threads");
    }
}

#[test]
fn thread_cpu_delta_comes_from_real_cpu_time() {
    let (profile, pid, _) =
        record_all("cpudelta", || run_fixture("split", &["2"]).expect("run fixture"));
    let t = single_thread(&profile, pid);
    let s = &t.thread["samples"];
    let col = s["schema"]["threadCPUDelta"].as_u64().expect("threadCPUDelta column") as usize;
    let tcol = s["schema"]["time"].as_u64().unwrap() as usize;
    let rows = s["data"].as_array().unwrap();
    let cpu_ns: f64 = rows.iter().skip(1).map(|r| r[col].as_f64().unwrap()).sum();
    let wall_ms = rows.last().unwrap()[tcol].as_f64().unwrap() - rows[0][tcol].as_f64().unwrap();
    let ratio = cpu_ns / 1e6 / wall_ms;
    // A CPU-bound thread on a 2-CPU machine shared with the profiler and the test: busy most of
    // the time, and never more than the wall time (allowing for sampling-edge effects).
    assert!((0.5..=1.05).contains(&ratio), "cpu/wall = {ratio:.2}");
    // Not derived from sample counts: deltas vary sample to sample.
    let distinct: std::collections::HashSet<u64> =
        rows.iter().skip(1).map(|r| r[col].as_f64().unwrap() as u64).collect();
    assert!(distinct.len() > 10);
}

#[test]
fn pid_filter_records_only_that_process() {
    let exe = fixtures::build("split").unwrap();
    // Busy until killed, however long the profiler takes to attach.
    let spawn = || Background(Command::new(&exe).arg("600").stdout(Stdio::null()).spawn().unwrap());
    let (target, _other) = (spawn(), spawn());
    let pid = target.0.id();
    let rec = Recording::start(&["-p", &pid.to_string(), "-d", "2"], output_path("pid", "json"))
        .expect("start");
    let done = rec.wait().unwrap();
    let profile = done.profile().unwrap();
    valid(&profile);
    let all = threads(&profile);
    assert!(!all.is_empty());
    assert!(all.iter().all(|t| t.pid == u64::from(pid)), "only pid {pid}: {:?}", names(&all));
    let hot = count_samples_with_path(all[0].thread, &["work", "hot_a"]);
    assert!(hot > 500, "{hot} samples in work → hot_a");
    assert!(done.stderr.contains("filtered out"), "summary reports filtered samples");
}

/// `-p` without `-d` stops by itself once every given process has exited (as perf does), not
/// when the first one does, and writes what it recorded of both.
#[test]
fn pid_mode_stops_when_the_last_given_process_exits() {
    let exe = fixtures::build("split").unwrap();
    let spawn = || Background(Command::new(&exe).arg("600").stdout(Stdio::null()).spawn().unwrap());
    let (mut a, mut b) = (spawn(), spawn());
    let (pa, pb) = (a.0.id(), b.0.id());
    let list = format!("{pa},{pb}");
    let mut rec = Recording::start(&["-p", &list], output_path("pid_exit", "json")).expect("start");
    // A few hundred samples of each, however busy the CPUs are: samples follow CPU time.
    for pid in [pa, pb] {
        let now = wait::cpu_time(pid).expect("target runs");
        let cpu = Duration::from_millis(300);
        wait::until_cpu_time(pid, now, cpu, Duration::from_secs(60)).unwrap();
    }
    let _ = (b.0.kill(), b.0.wait());
    assert!(
        rec.wait_for_line("stopped by", Duration::from_secs(2)).is_err(),
        "stopped while pid {pa} still ran"
    );
    let _ = (a.0.kill(), a.0.wait());
    let line = rec.wait_for_line("stopped by", Duration::from_secs(30)).expect("stops by itself");
    assert!(line.ends_with(&format!("stopped by exit of pids {list}")), "{line}");
    let done = rec.wait().unwrap();
    assert!(done.status.success(), "{}", done.stderr);
    let profile = done.profile().unwrap();
    valid(&profile);
    for pid in [pa, pb] {
        let ts = threads_of_pid(&profile, pid);
        assert!(
            ts.iter().any(|t| count_samples_with_path(t.thread, &["work", "hot_a"]) > 50),
            "pid {pid} recorded:\n{}",
            done.stderr
        );
    }
}

#[test]
fn command_mode_records_the_command_and_its_children_only() {
    let exe = fixtures::build("split").unwrap();
    let script = format!("{0} 1 & {0} 1; wait", exe.display());
    let out = output_path("cmd", "json.gz");
    let done = run(&["-o", out.to_str().unwrap(), "--", "/bin/sh", "-c", &script]).unwrap();
    assert!(done.status.success(), "{}", done.stderr);
    let profile = tests::gecko_schema::load(&out).unwrap();
    valid(&profile);
    let all = threads(&profile);
    let splits: std::collections::HashSet<u64> =
        all.iter().filter(|t| t.process_name == "split").map(|t| t.pid).collect();
    assert_eq!(splits.len(), 2, "both children recorded: {:?}", names(&all));
    for t in &all {
        assert!(
            t.process_name == "split" || t.process_name == "sh",
            "unexpected thread {}:{}:{} in a -- CMD profile",
            t.process_name,
            t.tid,
            t.name
        );
    }
    assert!(done.stderr.contains("command exit (status 0)"), "{}", done.stderr);
}

fn one_line_error(args: &[&str], want: &str) {
    let done = run(args).unwrap();
    assert!(!done.status.success(), "{args:?} should fail");
    let lines: Vec<&str> = done.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one-line error for {args:?}, got:\n{}", done.stderr);
    assert!(lines[0].starts_with("rsprof-bpf: error:") && lines[0].contains(want), "{}", lines[0]);
}

#[test]
fn bad_input_gives_a_one_line_error() {
    let out = output_path("bad", "json");
    let o = out.to_str().unwrap();
    one_line_error(&["-p", "2147483000", "-o", o], "no process with pid 2147483000");
    one_line_error(&["--all", "-o", "/nonexistent-dir/p.json"], "cannot write output");
    one_line_error(&["--all", "-F", "0", "-o", o], "invalid frequency");
    one_line_error(&["--all", "-F", "10000000", "-o", o], "invalid frequency");
    one_line_error(&["-o", o, "--", "/nonexistent/command"], "cannot run");
    // Not root: drop to nobody for this one run.
    let done = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(fixtures::rsprof_bin().unwrap())
        .args(["--all", "-o", "/tmp/rsprof-nobody.json"])
        .output()
        .expect("setpriv (util-linux) runs");
    let err = String::from_utf8_lossy(&done.stderr);
    assert!(!done.status.success() && err.lines().count() == 1, "{err}");
    assert!(err.contains("needs root"), "{err}");
    assert!(!out.exists(), "failed runs leave no output");
    let dir = out.parent().unwrap();
    let leftovers: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temp files left: {leftovers:?}");
}

#[test]
fn ctrl_c_right_after_start_still_writes_a_valid_profile() {
    let out = output_path("ctrlc", "json.gz");
    let rec = Recording::start(&["--all"], out.clone()).unwrap();
    thread::sleep(Duration::from_millis(300));
    let done = rec.interrupt().unwrap();
    assert!(done.status.success(), "{}", done.stderr);
    assert_eq!(&std::fs::read(&out).unwrap()[..2], &[0x1f, 0x8b], "gzip output");
    let profile = done.profile().unwrap();
    valid(&profile);
    assert!(done.stderr.contains("stopped by Ctrl-C"));
    assert!(done.stderr.contains("samples:"));
}

#[test]
fn duration_stops_the_recording_and_summary_reports_losses() {
    let out = output_path("duration", "json");
    let done = run(&["--all", "-d", "1", "-o", out.to_str().unwrap()]).unwrap();
    assert!(done.status.success(), "{}", done.stderr);
    valid(&tests::gecko_schema::load(&out).unwrap());
    for want in ["stopped by duration", "samples:", "lost by cause:", "top functions", "wrote"] {
        assert!(done.stderr.contains(want), "summary lacks '{want}':\n{}", done.stderr);
    }
}

/// A ring far too small for 999 Hz between drains (the loop drains on a timer, and BPF wakes
/// it only once a quarter of the ring is pending): what does not fit is counted as lost
/// ("ring buffer full"), and recorded plus lost add up to the sampler's rate.
#[test]
fn tiny_ring_buffer_loses_samples_and_counts_them() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let exe = fixtures::build("bench_work.c").unwrap();
    // Far more work than the recording lasts; killed when dropped.
    let _busy = Background(
        Command::new(&exe)
            .args(["1000000000000", &cpus.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let out = output_path("tiny_ring", "json");
    let args = ["--all", "-F", "999", "--ring-buffer-size", "4096", "-d", "3"];
    let done = run(&[&args[..], &["-o", out.to_str().unwrap()]].concat()).unwrap();
    assert!(done.status.success(), "{}", done.stderr);
    let number_after = |before: &str| -> u64 {
        let at =
            done.stderr.find(before).unwrap_or_else(|| panic!("no '{before}':\n{}", done.stderr));
        let rest = &done.stderr[at + before.len()..];
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().unwrap_or_else(|_| panic!("no number after '{before}':\n{}", done.stderr))
    };
    let recorded = number_after("samples: ");
    let lost = number_after(" recorded, ");
    let ring_full = number_after("ring buffer full ");
    assert!(
        ring_full > 0 && lost >= ring_full,
        "a 4 KiB ring at 999 Hz overflows:\n{}",
        done.stderr
    );
    // The timer fires on every CPU, idle or not: 999 Hz × 3 s × CPUs, less start-up slack.
    let expected = 999 * 3 * cpus as u64;
    assert!(
        (recorded + lost) as f64 > 0.8 * expected as f64,
        "recorded {recorded} + lost {lost} of ~{expected} sampler runs:\n{}",
        done.stderr
    );
}

/// Nothing to record (the only target sleeps throughout): the profile still opens in the
/// Firefox Profiler (which refuses one without threads) with one thread, rsprof-bpf's own,
/// carrying a note that says why; stderr says so even with -q.
#[test]
fn nothing_recorded_writes_a_profile_that_says_so() {
    let mut sleeper = Command::new("sleep").arg("30").spawn().unwrap();
    let out = output_path("nothing_recorded", "json");
    let pid = sleeper.id().to_string();
    let done = run(&["-p", &pid, "-d", "0.3", "-q", "-o", out.to_str().unwrap()]).unwrap();
    let _ = (sleeper.kill(), sleeper.wait());
    assert!(done.status.success(), "{}", done.stderr);
    assert!(done.stderr.contains("nothing was recorded"), "{}", done.stderr);
    let profile = tests::gecko_schema::load(&out).unwrap();
    valid(&profile);
    let ts = threads(&profile);
    assert_eq!(ts.len(), 1, "{:?}", names(&ts));
    assert_eq!(ts[0].process_name, "rsprof-bpf");
    assert!(sample_stacks(ts[0].thread).is_empty(), "no sample is invented");
    let notes = tests::profile_query::markers(ts[0].thread);
    assert_eq!(notes.len(), 1);
    assert_eq!(notes[0].name, "Nothing recorded");
    let text = notes[0].data["text"].as_str().unwrap_or_default();
    assert!(text.contains("stopped by duration"), "{text}");
}

/// A host where tracefs is not mounted (a fresh VM, a minimal container host): the
/// tracepoints need it, so rsprof-bpf mounts it, says so, and records. Run in a private mount
/// namespace, so unmounting tracefs there does not touch the host's (or other tests').
#[test]
fn records_on_a_host_without_tracefs_mounted() {
    let out = output_path("no_tracefs", "json");
    let script = r#"
        umount -l /sys/kernel/tracing 2>/dev/null
        umount -l /sys/kernel/debug/tracing 2>/dev/null
        umount -l /sys/kernel/debug 2>/dev/null
        if [ -n "$(ls -A /sys/kernel/tracing)" ]; then
            echo "precondition: tracefs still mounted at /sys/kernel/tracing" >&2; exit 90
        fi
        exec "$0" -d 0.5 -o "$1" -- sleep 0.2
    "#;
    let done = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", script])
        .arg(fixtures::rsprof_bin().unwrap())
        .arg(&out)
        .stdin(Stdio::null())
        .output()
        .expect("unshare (util-linux) runs");
    let err = String::from_utf8_lossy(&done.stderr);
    assert_ne!(done.status.code(), Some(90), "could not unmount tracefs for the test: {err}");
    assert!(done.status.success(), "{}: {err}", done.status);
    assert!(err.contains("tracefs was not mounted: mounted it at /sys/kernel/tracing"), "{err}");
    valid(&tests::gecko_schema::load(&out).unwrap());
}

/// SIGTERM at any moment of start-up (BPF loading, attaching, the first drain): the recording
/// either ends before anything is written (then nothing at all is left in the directory) or
/// writes a profile that opens.
#[test]
fn sigterm_during_startup_leaves_an_openable_profile_or_nothing() {
    let bin = tests::fixtures::rsprof_bin().unwrap();
    tests::fixtures::require_root().unwrap();
    for delay_ms in [0u64, 50, 100, 150, 200, 400] {
        let dir = output_path(&format!("early_term_{delay_ms}"), "d");
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("p.json.gz");
        let child = Command::new(&bin)
            .args(["--all", "-q", "-o", out.to_str().unwrap()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        thread::sleep(Duration::from_millis(delay_ms));
        let term = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        assert!(term.unwrap().success());
        let result = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&result.stderr);
        let left: Vec<_> =
            std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name()).collect();
        if out.exists() {
            assert!(result.status.success(), "{delay_ms} ms: {stderr}");
            let profile = tests::gecko_schema::load(&out).unwrap();
            valid(&profile);
            assert_eq!(left.len(), 1, "{delay_ms} ms: only the profile is left: {left:?}");
        } else {
            assert!(left.is_empty(), "{delay_ms} ms: nothing is left behind: {left:?}");
        }
    }
}

/// The libraries a process's frames name are its `libs`, each with the identifiers symbol
/// servers use: `codeId` the file's GNU build-id as `readelf -n` prints it, `breakpadId` the
/// Breakpad form of it (first 16 bytes as a little-endian GUID, then age 0). The profile still
/// imports with the Firefox Profiler's own importer.
#[test]
fn gecko_libs_carry_build_ids() {
    // Our own libc, which dd (from the same system) maps too.
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let libc_path = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libc.so.6"))
        .expect("libc.so.6 in our own maps")
        .to_owned();
    let notes = Command::new("readelf").args(["-n", &libc_path]).output().expect("readelf");
    let notes = String::from_utf8_lossy(&notes.stdout);
    let build_id =
        notes.lines().find_map(|l| l.trim().strip_prefix("Build ID: ")).expect("libc build-id");
    // Breakpad's GUID form, spelled out here from the build-id bytes.
    let b: Vec<&str> = (0..16).map(|i| &build_id[2 * i..2 * i + 2]).collect();
    let swapped = [b[3], b[2], b[1], b[0], b[5], b[4], b[7], b[6]];
    let want_breakpad = format!("{}{}0", swapped.concat(), b[8..].concat()).to_uppercase();

    let out = output_path("gecko_libs", "json");
    // Syscall wrappers in libc are the innermost user frame of nearly every dd sample.
    let args = ["if=/dev/zero", "of=/dev/null", "bs=4k", "count=400000"];
    let done = run(&[&["-o", out.to_str().unwrap(), "--", "dd"][..], &args[..]].concat()).unwrap();
    assert!(done.status.success(), "{}", done.stderr);
    let profile = tests::gecko_schema::load(&out).expect("the Firefox Profiler imports it");
    valid(&profile);
    let procs = profile["processes"].as_array().unwrap();
    let libs: Vec<&Value> = procs.iter().flat_map(|p| p["libs"].as_array().unwrap()).collect();
    let libc: Vec<&&Value> = libs.iter().filter(|l| l["name"] == "libc.so.6").collect();
    assert!(!libc.is_empty(), "no libc.so.6 in any process's libs: {libs:#?}");
    for l in libc {
        assert_eq!(l["codeId"], build_id, "{l}");
        assert_eq!(l["breakpadId"], want_breakpad.as_str(), "{l}");
        assert_eq!(l["debugName"], "libc.so.6");
    }
    // Files only: the kernel's frames are no library.
    assert!(!libs.iter().any(|l| l["name"] == "[kernel.kallsyms]"), "{libs:#?}");
}

/// A process that starts and ends thousands of threads over a long recording does not grow
/// the thread table without bound: exited threads nothing stored refers to are forgotten a
/// second after their exit (the summary says how many, and the most held at once), while the
/// threads that were sampled are in the profile with their names.
#[test]
fn exited_threads_of_a_live_process_are_forgotten() {
    let exe = fixtures::build("threadchurn").unwrap();
    let out = output_path("threadchurn", "json");
    let n = 5000u64;
    // The busy threads go on 1.5 s after the last short thread: every short thread then
    // exited more than the 1 s grace before the end. The churn never starts more than
    // n / 5 threads in a second, however loaded the machine, so about 1000 are within the
    // grace at any time; holding n / 2 would mean exited threads are not forgotten.
    let done = run(&[
        "-o",
        out.to_str().unwrap(),
        "--",
        exe.to_str().unwrap(),
        &n.to_string(),
        "5",
        "2",
        "1.5",
    ])
    .unwrap();
    assert!(done.status.success(), "{}", done.stderr);
    assert!(done.stdout.contains(&format!("short {n}")), "{}", done.stdout);
    let number_before = |s: &str, key: &str| -> u64 {
        let head = s.split(key).next().unwrap();
        head.split_whitespace().last().unwrap().parse().unwrap()
    };
    let line = done
        .stderr
        .lines()
        .find(|l| l.contains("tables kept bounded"))
        .unwrap_or_else(|| panic!("no tables line in the summary:\n{}", done.stderr));
    let forgotten = number_before(line, " exited threads forgotten");
    let peak = number_before(line, " threads held at once");
    eprintln!("{line}");
    let profile = tests::gecko_schema::load(&out).expect("profile");
    valid(&profile);
    // Short threads that were sampled are kept with their samples; every other one exited
    // more than a second before the end and is forgotten.
    let sampled_short = profile["threads"]
        .as_array()
        .into_iter()
        .chain(
            profile["processes"]
                .as_array()
                .into_iter()
                .flat_map(|ps| ps.iter().filter_map(|p| p["threads"].as_array())),
        )
        .flatten()
        .filter(|t| !t["name"].as_str().unwrap_or("").starts_with("busy-") && t["tid"] != t["pid"])
        .count() as u64;
    eprintln!("{sampled_short} short threads sampled");
    assert!(
        forgotten + sampled_short >= n * 98 / 100,
        "{forgotten} of {n} short threads forgotten, {sampled_short} sampled"
    );
    assert!(peak < n / 2, "{peak} threads held at once for {n} started");
    let ts = threads(&profile);
    for name in ["busy-0", "busy-1"] {
        let t = ts.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no thread {name}"));
        let n = count_samples_with_path(t.thread, &["busy_loop"]);
        assert!(n >= 200, "{name}: {n} samples in busy_loop");
    }
}
