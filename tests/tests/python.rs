//! Python frames read from CPython itself (no `-X perf`, no flag in the application): real
//! interpreters — Debian's `/usr/bin/python3.11` and each pyenv CPython 3.8–3.13 — profiled
//! with `--all`, their stacks carrying the Python functions in place of the eval loop. Needs
//! root; run serially (`--test-threads=1`). A missing interpreter fails, naming it.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use serde_json::Value;
use tests::{
    agent::{Agent, spool_dir, windows_of},
    fixtures,
    gecko_schema::validate,
    go_pprof::{self, parse_top},
    harness::{Recording, output_path, spawn_fresh},
    profile_query::{frame_categories, function_name, module_name, sample_stacks, threads_of_pid},
};

/// Every interpreter the tests cover: (name, executable).
fn interpreters() -> Vec<(String, PathBuf)> {
    let mut all = vec![("debian 3.11".to_owned(), PathBuf::from("/usr/bin/python3.11"))];
    let root =
        PathBuf::from(std::env::var_os("HOME").unwrap_or("/root".into())).join(".pyenv/versions");
    for (v, minor) in [
        ("3.8.18", 8),
        ("3.9.18", 9),
        ("3.10.13", 10),
        ("3.11.7", 11),
        ("3.12.1", 12),
        ("3.13.0", 13),
    ] {
        all.push((format!("pyenv {v}"), root.join(v).join(format!("bin/python3.{minor}"))));
    }
    let missing: Vec<String> = all
        .iter()
        .filter(|(_, p)| !p.is_file())
        .map(|(n, p)| format!("{n} ({})", p.display()))
        .collect();
    assert!(
        missing.is_empty(),
        "CPython missing: {missing:?} (cargo xtask setup installs Debian's python3.11; pyenv install the others)"
    );
    all
}

fn debian_python() -> PathBuf {
    let p = PathBuf::from("/usr/bin/python3.11");
    assert!(p.is_file(), "/usr/bin/python3.11 is missing: install Debian's python3.11");
    p
}

fn valid(profile: &Value) {
    if let Err(problems) = validate(profile) {
        panic!("profile breaks the Gecko v36 rules:\n{}", problems.join("\n"));
    }
}

fn start_python(python: &Path, script: &str, args: &[&str]) -> Child {
    spawn_fresh(
        Command::new(python)
            .arg(fixtures::source_dir().join(script))
            .args(args)
            .stdout(Stdio::null()),
    )
}

fn names(stack: &[String]) -> Vec<&str> {
    stack.iter().map(|l| function_name(l)).collect()
}

/// The sample stacks of each thread of `pid`, by tid.
fn thread_stacks(profile: &Value, pid: u32) -> Vec<(u64, Vec<Vec<String>>)> {
    threads_of_pid(profile, pid).into_iter().map(|t| (t.tid, sample_stacks(t.thread))).collect()
}

/// The 2:1 fixture on every interpreter, in one `--all` recording per interpreter: one
/// process started before the recording and one during it. ≥ 90% of each main thread's
/// samples carry `py_driver → py_hot_alpha|beta` (Python frames with file and line, in the
/// Python category), split 2:1 ± 7 points.
#[test]
fn every_cpython_2_to_1_started_before_and_during_an_all_recording() {
    let mut failures = Vec::new();
    for (name, python) in interpreters() {
        split_for(&name, &python, &mut failures);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn split_for(name: &str, python: &Path, failures: &mut Vec<String>) {
    // Long enough that the during process's start-up (exec, ld.so, imports: no Python
    // function of the script yet) stays a few percent of its samples.
    let mut before = start_python(python, "pysplit.py", &["11"]);
    let output = output_path("python_split", "json");
    let rec = Recording::start(&["--all", "-F", "999"], output).expect("start");
    let mut during = start_python(python, "pysplit.py", &["8"]);
    let mut pids = Vec::new();
    for (when, child) in [("started before", &mut before), ("started during", &mut during)] {
        let status = child.wait().expect("python ran");
        assert!(status.success(), "{name} {when} failed: {status}");
        pids.push((format!("{name}, {when}"), child.id()));
    }
    let done = rec.interrupt().expect("stop recording");
    let profile = done.profile().expect("profile written");
    valid(&profile);
    let summary = done.stderr.lines().find(|l| l.starts_with("python:")).unwrap_or_default();
    eprintln!("{summary}");
    let script = fixtures::source_dir().join("pysplit.py").display().to_string();
    for (name, pid) in pids {
        let main = threads_of_pid(&profile, pid).into_iter().find(|t| t.tid == u64::from(pid));
        let Some(main) = main else {
            failures.push(format!("{name} ({pid}): no main thread in the profile"));
            continue;
        };
        let stacks = sample_stacks(main.thread);
        let chain = |s: &Vec<String>, hot: &str| {
            let n = names(s);
            let driver = n.iter().position(|f| *f == "py::py_driver");
            let h = n.iter().position(|f| *f == hot);
            matches!((driver, h), (Some(d), Some(h)) if d < h)
        };
        let alpha = stacks.iter().filter(|s| chain(s, "py::py_hot_alpha")).count();
        let beta = stacks.iter().filter(|s| chain(s, "py::py_hot_beta")).count();
        let total = stacks.len();
        let pct = 100.0 * (alpha + beta) as f64 / total.max(1) as f64;
        let share = 100.0 * alpha as f64 / (alpha + beta).max(1) as f64;
        eprintln!(
            "{name} ({pid}): {} of {total} ({pct:.1}%) carry the chain; alpha share {share:.1}%",
            alpha + beta
        );
        if total < 300 {
            failures.push(format!("{name}: only {total} samples"));
        } else if pct < 90.0 {
            let bad = stacks
                .iter()
                .find(|s| !chain(s, "py::py_hot_alpha") && !chain(s, "py::py_hot_beta"));
            failures.push(format!("{name}: {pct:.1}% carry the chain, e.g. {bad:?}"));
        } else if !(66.7 - 7.0..=66.7 + 7.0).contains(&share) {
            failures.push(format!("{name}: py_hot_alpha share {share:.1}%"));
        }
        // Named with file and line, in the Python category.
        let hot = stacks.iter().flatten().find(|l| function_name(l) == "py::py_hot_alpha");
        match hot {
            Some(hot) if hot.contains(&script) && module_name(hot) == Some("[python]") => {
                let cats = frame_categories(&profile, main.thread, "py::py_hot_alpha");
                if cats.is_empty() || cats.iter().any(|c| c != "Python") {
                    failures.push(format!("{name}: categories {cats:?}"));
                }
                // Alpha's lines: 7 (`def`: the entry's RESUME instruction, 3.11+) to 11.
                let line: Option<u32> =
                    hot.rsplit(':').next().and_then(|l| l.trim_end_matches(')').parse().ok());
                if !line.is_some_and(|l| (7..=11).contains(&l)) {
                    failures.push(format!("{name}: line of {hot}"));
                }
            }
            other => failures.push(format!("{name}: hot frame {other:?}")),
        }
    }
}

/// Four threads, each in its own function: each thread's samples carry its own, never
/// another thread's.
#[test]
fn threads_carry_their_own_functions() {
    let output = output_path("python_threads", "json");
    let rec = Recording::start(&["--all", "-F", "499"], output).expect("start");
    let mut child = start_python(&debian_python(), "py_threads.py", &["3"]);
    assert!(child.wait().expect("python ran").success());
    let pid = child.id();
    let done = rec.interrupt().expect("stop recording");
    let profile = done.profile().expect("profile written");
    valid(&profile);
    let workers = ["py::py_worker_a", "py::py_worker_b", "py::py_worker_c", "py::py_worker_d"];
    let mut owners = Vec::new();
    for (tid, stacks) in thread_stacks(&profile, pid) {
        if tid == u64::from(pid) || stacks.is_empty() {
            continue;
        }
        let seen: std::collections::BTreeSet<&str> =
            stacks.iter().flat_map(|s| names(s)).filter(|f| workers.contains(f)).collect();
        assert!(seen.len() <= 1, "thread {tid} carries {seen:?}");
        let with = stacks.iter().filter(|s| names(s).iter().any(|f| seen.contains(f))).count();
        eprintln!("thread {tid}: {seen:?} in {with} of {} samples", stacks.len());
        if let Some(&f) = seen.iter().next() {
            assert!(
                with * 10 >= stacks.len() * 8,
                "thread {tid}: {f} in {with} of {}",
                stacks.len()
            );
            owners.push(f.to_owned());
        }
    }
    owners.sort_unstable();
    assert_eq!(owners, workers, "each worker function on its own thread");
}

/// zlib.compress from Python: libz's native frames sit under the Python caller.
#[test]
fn c_extension_frames_sit_under_the_python_caller() {
    let output = output_path("python_zlib", "json");
    let rec = Recording::start(&["--all", "-F", "499"], output).expect("start");
    let mut child = start_python(&debian_python(), "py_zlib.py", &["3"]);
    assert!(child.wait().expect("python ran").success());
    let pid = child.id();
    let done = rec.interrupt().expect("stop recording");
    let profile = done.profile().expect("profile written");
    valid(&profile);
    let (_, stacks) = thread_stacks(&profile, pid)
        .into_iter()
        .find(|(t, _)| *t == u64::from(pid))
        .expect("main thread");
    let under = |s: &Vec<String>| {
        let at = s.iter().position(|l| function_name(l) == "py::py_compress");
        at.is_some_and(|i| {
            s[i + 1..].iter().any(|l| module_name(l).is_some_and(|m| m.starts_with("libz")))
        })
    };
    let n = stacks.iter().filter(|s| under(s)).count();
    eprintln!("{n} of {} samples: libz under py_compress", stacks.len());
    assert!(
        n * 2 >= stacks.len(),
        "{n} of {} samples have libz under py::py_compress",
        stacks.len()
    );
}

/// A script that lives 50 ms: its function is named (code objects read while it lived: the
/// kernel knows the interpreter file from the first run, and a process's first Python sample
/// wakes the collector).
#[test]
fn a_50ms_script_is_named() {
    let output = output_path("python_brief", "json");
    let rec = Recording::start(&["--all", "-F", "999"], output).expect("start");
    let mut pids = Vec::new();
    for _ in 0..3 {
        let mut child = start_python(&debian_python(), "py_brief.py", &[]);
        assert!(child.wait().expect("python ran").success());
        pids.push(child.id());
        std::thread::sleep(Duration::from_millis(300));
    }
    let done = rec.interrupt().expect("stop recording");
    let profile = done.profile().expect("profile written");
    valid(&profile);
    let mut named = 0;
    for pid in pids {
        let stacks: Vec<Vec<String>> =
            thread_stacks(&profile, pid).into_iter().flat_map(|(_, s)| s).collect();
        let n = stacks.iter().filter(|s| names(s).contains(&"py::py_brief_work")).count();
        let unreadable =
            stacks.iter().flatten().filter(|l| l.contains("unreadable code object")).count();
        eprintln!(
            "{pid}: {n} of {} samples name py_brief_work, {unreadable} unreadable frames",
            stacks.len()
        );
        // About half its life is the interpreter's start-up (no function of the script yet).
        if n * 4 >= stacks.len() && n >= 5 && unreadable == 0 {
            named += 1;
        }
    }
    // A run during the recording's start-up (its first drains compile unwind tables) can end
    // before its code objects are read: those frames are counted as unreadable, so two of
    // three are asked for.
    assert!(named >= 2, "of 3 runs of a 50 ms script, {named} had their function named");
}

/// A program that is no Python but exports `_PyRuntime` (and a fake frame chain): run as
/// `python3.11`, it profiles like any program, and the summary counts it.
#[test]
fn a_fake_python_exporting_pyruntime_is_harmless() {
    let exe = fixtures::build("py_garbage.c").expect("build the fixture");
    let dir = std::env::temp_dir().join(format!("rsprof-fakepy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fake = dir.join("python3.11");
    std::fs::copy(&exe, &fake).unwrap();
    let output = output_path("python_garbage", "json");
    let rec = Recording::start(&["--all", "-F", "499"], output).expect("start");
    let mut child = spawn_fresh(Command::new(&fake).arg("2"));
    assert!(child.wait().expect("fake ran").success());
    let pid = child.id();
    let done = rec.interrupt().expect("stop recording");
    let _ = std::fs::remove_dir_all(&dir);
    let profile = done.profile().expect("profile written");
    valid(&profile);
    let (_, stacks) = thread_stacks(&profile, pid)
        .into_iter()
        .find(|(t, _)| *t == u64::from(pid))
        .expect("main thread");
    let spin = stacks.iter().filter(|s| names(s).contains(&"garbage_spin")).count();
    let py = stacks.iter().flatten().filter(|l| function_name(l).starts_with("py::")).count();
    let summary = done.stderr.lines().find(|l| l.starts_with("python:")).unwrap_or_default();
    eprintln!("{spin} of {} in garbage_spin; {py} Python frames; {summary}", stacks.len());
    assert!(spin * 10 >= stacks.len() * 9, "{spin} of {} samples in garbage_spin", stacks.len());
    assert_eq!(py, 0, "no Python frame in a program that runs no Python");
    assert!(
        summary.contains("not code objects") && !summary.contains(" 0 not code objects"),
        "{summary}"
    );
}

/// The agent's spooled windows of the 2:1 fixture, read by Go's pprof (merged, the
/// fixture's pid only): `py::py_hot_alpha` and `py::py_hot_beta` hold nearly all of its
/// samples, split 2:1 ± 7 points, under `py::py_driver`.
#[test]
fn agent_windows_read_by_go_pprof_split_the_python_functions_2_to_1() {
    let dir = spool_dir("agent_python");
    let d = dir.to_str().unwrap();
    let agent = Agent::start(&["--spool", d, "--window", "1", "-F", "499"]);
    let mut child = start_python(&debian_python(), "pysplit.py", &["4"]);
    assert!(child.wait().expect("python ran").success());
    let pid = child.id();
    let (status, stderr) = agent.stop(libc::SIGTERM, Duration::from_secs(5));
    assert!(status.success(), "agent failed:\n{stderr}");
    // A process outside a container or unit is its own service, by its name.
    let windows = windows_of(&dir, "python3.11");
    assert!(windows.len() >= 3, "4 s of python3.11 in 1 s windows: {} windows", windows.len());
    let files: Vec<String> = windows.iter().map(|w| w.1.display().to_string()).collect();
    let focus = format!("pid={pid}");
    let mut args = vec!["-top", "-sample_index=samples", "-nodecount=100000", "-nodefraction=0"];
    args.extend(["-trim=false", "-tagfocus", &focus]);
    args.extend(files[1..].iter().map(String::as_str));
    let out = go_pprof::run(&args, Path::new(&files[0])).expect("pprof -top");
    let (_, rows) = parse_top(&out).expect("parse -top");
    // Nothing trimmed: the flat column sums to the pid's samples.
    let total: f64 = rows.iter().map(|r| r.flat).sum();
    let cum = |n: &str| rows.iter().find(|r| r.name == n).map_or(0.0, |r| r.cum);
    let (a, b, driver) = (cum("py::py_hot_alpha"), cum("py::py_hot_beta"), cum("py::py_driver"));
    eprintln!("pid {pid}: {total} samples, alpha {a}, beta {b}, driver {driver}");
    assert!(total > 500.0, "4 s at 499 Hz: {total} samples of pid {pid}:\n{out}");
    // The interpreter's start-up and exit run no function of the script.
    assert!(a + b >= 0.85 * total, "alpha + beta ({a} + {b}) of {total} samples:\n{out}");
    // pprof prints rounded values: allow that.
    assert!(driver >= 0.999 * (a + b), "py_driver's cumulative {driver} holds both:\n{out}");
    let share = 100.0 * a / (a + b);
    assert!(
        (66.7 - 7.0..=66.7 + 7.0).contains(&share),
        "py_hot_alpha share {share:.1}%, want 66.7 ± 7:\n{out}"
    );
    // Traces, leaf first: the hot function right under py_driver.
    let mut args = vec!["-traces", "-tagfocus", &focus];
    args.extend(files[1..].iter().map(String::as_str));
    let traces = go_pprof::run(&args, Path::new(&files[0])).expect("pprof -traces");
    let chain = traces.split("-----------+").any(|t| {
        let fns: Vec<&str> = t.lines().filter_map(|l| l.split_whitespace().last()).collect();
        fns.windows(2).any(|w| w == ["py::py_hot_alpha", "py::py_driver"])
    });
    assert!(chain, "no py_hot_alpha → py_driver trace in pprof -traces:\n{traces}");
}

/// Off-CPU: a thread blocked in `time.sleep` shows the Python function that slept.
#[test]
fn time_sleep_off_cpu_shows_the_sleeping_function() {
    let output = output_path("python_sleep", "json");
    let rec = Recording::start(&["--all", "--off-cpu", "-F", "499"], output).expect("start");
    let mut child = start_python(&debian_python(), "py_sleep.py", &["2"]);
    assert!(child.wait().expect("python ran").success());
    let pid = child.id();
    let done = rec.interrupt().expect("stop recording");
    let profile = done.profile().expect("profile written");
    valid(&profile);
    let (_, stacks) = thread_stacks(&profile, pid)
        .into_iter()
        .find(|(t, _)| *t == u64::from(pid))
        .expect("main thread");
    // Off-CPU samples: those whose stack ends in the kernel's scheduler.
    let off: Vec<&Vec<String>> =
        stacks.iter().filter(|s| names(s).iter().any(|f| f.contains("clock_nanosleep"))).collect();
    let named = off.iter().filter(|s| names(s).contains(&"py::py_sleeper")).count();
    eprintln!("{named} of {} sleeping samples under py::py_sleeper", off.len());
    if let Some(bad) = off.iter().find(|s| !names(s).contains(&"py::py_sleeper")) {
        eprintln!("e.g. {bad:?}");
    }
    assert!(off.len() >= 5, "{} samples in clock_nanosleep", off.len());
    // A record taken before the kernel knew the process lacks them (counted in the summary's
    // `python off-CPU records:` line); each record weighs its block's length here.
    assert!(named * 10 >= off.len() * 8, "{named} of {} under py::py_sleeper", off.len());
    let line = done.stderr.lines().find(|l| l.contains("python off-CPU records:"));
    eprintln!("{}", line.unwrap_or_default());
}

/// A code object freed mid-run is never named as the one that had its memory before:
/// generation after generation of `py_reuse.py` compiles a function, runs it ~80 ms and frees
/// it, and the next generation's code object takes the same memory. Even generations
/// (`zlib_gen_N`) compress with zlib, odd ones (`sha_gen_N`) hash with OpenSSL's SHA-256: a
/// frame named for one kind over the other kind's native frames is misnamed, and that work
/// right under the caller lost its generation's frame. Every interpreter; most generations
/// must be named.
#[test]
fn a_freed_and_reused_code_object_is_not_named_as_the_old_one() {
    let mut failures = Vec::new();
    for (name, python) in interpreters() {
        reuse_for(&name, &python, &mut failures);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn reuse_for(name: &str, python: &Path, failures: &mut Vec<String>) {
    let output = output_path("python_reuse", "json");
    let rec = Recording::start(&["--all", "-F", "999"], output).expect("start");
    let child = spawn_fresh(
        Command::new(python)
            .arg(fixtures::source_dir().join("py_reuse.py"))
            .args(["3", "0.08"])
            .stdout(Stdio::piped()),
    );
    let pid = child.id();
    let out = child.wait_with_output().expect("python ran");
    assert!(out.status.success(), "{name}: py_reuse.py failed: {}", out.status);
    let done = rec.interrupt().expect("stop recording");
    let profile = done.profile().expect("profile written");
    valid(&profile);
    let summary = done.stderr.lines().find(|l| l.starts_with("python:")).unwrap_or_default();
    eprintln!("{name}: {summary}");

    // Generations whose code object took memory a generation of the other kind had held:
    // without them a misnamed frame could not be seen here.
    let mut kind_at: std::collections::HashMap<&str, Vec<bool>> = Default::default();
    let mut generations = 0;
    let mut reused = 0;
    for line in std::str::from_utf8(&out.stdout).expect("utf-8").lines() {
        let [_, func, addr] = line.split(' ').collect::<Vec<_>>()[..] else {
            panic!("{name}: py_reuse.py printed {line:?}");
        };
        let zlib = func.starts_with("zlib_gen_");
        let before = kind_at.entry(addr).or_default();
        if before.contains(&!zlib) {
            reused += 1;
        }
        before.push(zlib);
        generations += 1;
    }

    let stacks: Vec<Vec<String>> =
        thread_stacks(&profile, pid).into_iter().flat_map(|(_, s)| s).collect();
    // The extension module (pyenv builds; Debian's python3.11 has zlib built in) or the
    // library doing the work.
    const ZLIB: [&str; 2] = ["libz.", "zlib."];
    const SHA: [&str; 2] = ["libcrypto.", "_hashlib."];
    let module_in = |s: &[String], prefixes: [&str; 2]| {
        s.iter().any(|l| module_name(l).is_some_and(|m| prefixes.iter().any(|p| m.starts_with(p))))
    };
    let (mut checked, mut misnamed, mut dropped) = (0, Vec::new(), Vec::new());
    let mut named = std::collections::BTreeSet::new();
    for s in &stacks {
        // The generation's frame, and what ran beneath it.
        let Some(at) = s.iter().position(|l| {
            let f = function_name(l);
            f.starts_with("py::zlib_gen_") || f.starts_with("py::sha_gen_")
        }) else {
            // py_generations calls zlib or SHA-256 only through a generation: such work right
            // under py_generations lost the generation's frame (a stack without Python frames,
            // taken before the process was known, is counted in the summary; `import hashlib`
            // runs OpenSSL's start-up under other frames).
            let py = s.iter().rposition(|l| function_name(l).starts_with("py::"));
            let caller = py.filter(|&i| function_name(&s[i]) == "py::py_generations");
            // Its gc.collect() visits the modules' objects with their own traverse functions
            // (in zlib's and _hashlib's extension modules): not a generation's work.
            let collecting = |i: usize| s[i..].iter().any(|l| function_name(l).starts_with("gc_"));
            let caller = caller.filter(|&i| !collecting(i));
            if caller.is_some_and(|i| module_in(&s[i..], ZLIB) || module_in(&s[i..], SHA)) {
                dropped.push(s.clone());
            }
            continue;
        };
        let func = function_name(&s[at]);
        named.insert(func.to_owned());
        let below = &s[at + 1..];
        let (z, sha) = (module_in(below, ZLIB), module_in(below, SHA));
        if z || sha {
            checked += 1;
        }
        let zlib_gen = func.starts_with("py::zlib_gen_");
        // Its file is `<NAME>`: the name and the file must be of one code object.
        let own_file = s[at].contains(&format!("<{}>", &func[4..]));
        if (zlib_gen && sha) || (!zlib_gen && z) || !own_file {
            misnamed.push(s[at..].to_vec());
        }
    }
    eprintln!(
        "{name} ({pid}): {generations} generations, {reused} in memory of the other kind; {} \
         of {} samples checked against their native frames, {} misnamed, {} lost the \
         generation's frame; {} generations named",
        checked,
        stacks.len(),
        misnamed.len(),
        dropped.len(),
        named.len(),
    );
    if !dropped.is_empty() {
        failures.push(format!(
            "{name}: {} samples lost the generation's frame, e.g. {:?}",
            dropped.len(),
            &dropped[0][dropped[0].len().saturating_sub(8)..]
        ));
    }
    if reused < 3 {
        failures.push(format!(
            "{name}: only {reused} of {generations} generations reused the other kind's code \
             object memory: the test proves nothing"
        ));
    }
    if !misnamed.is_empty() {
        failures.push(format!(
            "{name}: {} of {checked} samples misnamed, e.g. {:?}",
            misnamed.len(),
            misnamed[0]
        ));
    }
    if checked < 200 || named.len() * 2 < generations {
        failures.push(format!(
            "{name}: {checked} samples checked, {} of {generations} generations named",
            named.len()
        ));
    }
}
