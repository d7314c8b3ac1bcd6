//! JIT code named from perf maps: real runtimes (Debian's `nodejs`) write `/tmp/perf-PID.map`
//! while an `--all` recording runs, and their samples carry the runtime's own names. Needs
//! root; run serially (`--test-threads=1`). A runtime that is missing fails the test, saying
//! which package to install (`cargo xtask setup` installs it).

use std::{
    path::Path,
    process::{Command, Stdio},
};

use serde_json::Value;
use tests::{
    fixtures,
    gecko_schema::validate,
    harness::{Recording, output_path},
    profile_query::{
        contains_path, frame_categories, function_name, module_name, sample_stacks, threads_of_pid,
    },
};

fn valid(profile: &Value) {
    if let Err(problems) = validate(profile) {
        panic!("profile breaks the Gecko v36 rules:\n{}", problems.join("\n"));
    }
}

/// The validated profile's main thread of process `pid`, and its samples' stacks.
fn main_thread_stacks(
    profile: &Value,
    pid: u32,
) -> (tests::profile_query::ThreadInfo<'_>, Vec<Vec<String>>) {
    valid(profile);
    let main = threads_of_pid(profile, pid)
        .into_iter()
        .find(|t| t.tid == u64::from(pid))
        .unwrap_or_else(|| panic!("no main thread of process {pid} in the profile"));
    let stacks = sample_stacks(main.thread);
    (main, stacks)
}

/// Removes a runtime's perf map when the test ends (the runtimes leave them in /tmp).
struct RemoveMap(String);

impl Drop for RemoveMap {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn node() -> &'static str {
    let node = "/usr/bin/node";
    assert!(
        Path::new(node).is_file(),
        "{node} is missing: install Debian's nodejs (`cargo xtask setup` does)"
    );
    node
}

/// `node --perf-basic-prof jsplit.js`, started during an `--all` recording: nearly all of its
/// main thread's samples are in the two hot functions, named as V8 names them, split 2:1, and
/// their stacks go on below the JS frames into node's own native frames.
#[test]
fn node_perf_basic_prof_names_hot_js_functions_2_to_1() {
    node_split(false, NodeMap::PerfMap);
}

/// `node --perf-prof`: V8 writes a jitdump (`jit-PID.dump` in its working directory, mapped
/// executable), found from its mapping record; the same names, from module `[jitdump]`.
#[test]
fn node_perf_prof_jitdump_names_hot_js_functions_2_to_1() {
    node_split(false, NodeMap::JitDump);
}

/// The same with node started first, its map already long when the recording finds it (read
/// from its start at node's first JIT address).
#[test]
fn node_started_before_the_recording_is_named_too() {
    node_split(true, NodeMap::PerfMap);
}

/// `node --perf-prof` started first: its jitdump is found in the mappings read from /proc
/// (the kernel's record of it came before the recording) and read from its start.
#[test]
fn node_with_a_jitdump_started_before_the_recording_is_named_too() {
    node_split(true, NodeMap::JitDump);
}

/// How node is asked to name its code.
#[derive(Clone, Copy, PartialEq)]
enum NodeMap {
    /// `--perf-basic-prof`: /tmp/perf-PID.map.
    PerfMap,
    /// `--perf-prof`: a jitdump in the working directory.
    JitDump,
}

fn node_split(started_before: bool, how: NodeMap) {
    let script = fixtures::source_dir().join("jsplit.js");
    let test = match (started_before, how) {
        (true, NodeMap::PerfMap) => "jit_node_before",
        (true, NodeMap::JitDump) => "jit_node_dump_before",
        (false, NodeMap::PerfMap) => "jit_node",
        (false, NodeMap::JitDump) => "jit_node_dump",
    };
    let output = output_path(test, "json");
    let mut rec =
        (!started_before).then(|| Recording::start(&["--all"], output.clone()).expect("start"));
    let mut cmd = Command::new(node());
    // V8's perf flags also write an `isolate-*-v8.log` into the working directory.
    cmd.current_dir(output.parent().expect("output in a directory"));
    // Started first, it runs longer: the recording starts once BPF is loaded (seconds).
    let secs = if started_before { "8" } else { "5" };
    // No inlining: each hot function keeps frames of its own (TurboFan would fold them into
    // their caller, which the map then names instead).
    let flag = match how {
        NodeMap::PerfMap => "--perf-basic-prof",
        NodeMap::JitDump => "--perf-prof",
    };
    cmd.args([flag, "--no-turbo-inlining"]).arg(&script).arg(secs);
    let child = cmd.stdout(Stdio::null()).spawn().expect("start node");
    let pid = child.id();
    let map = format!("/tmp/perf-{pid}.map");
    let _map = RemoveMap(map.clone());
    let dump = output.parent().unwrap().join(format!("jit-{pid}.dump"));
    let _dump = RemoveMap(dump.display().to_string());
    if started_before {
        // Running its hot code already: the map or dump names it.
        let file = match how {
            NodeMap::PerfMap => std::path::PathBuf::from(&map),
            NodeMap::JitDump => dump.clone(),
        };
        let named = |b: Vec<u8>| b.windows(b"JS:*jsHotAlpha".len()).any(|w| w == b"JS:*jsHotAlpha");
        let t0 = std::time::Instant::now();
        while !std::fs::read(&file).is_ok_and(named) {
            let f = file.display();
            assert!(t0.elapsed().as_secs() < 20, "node wrote no JS:*jsHotAlpha into {f}");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        rec = Some(Recording::start(&["--all"], output.clone()).expect("start"));
    }
    let out = child.wait_with_output().expect("node ran");
    assert!(out.status.success(), "node failed: {}", out.status);
    let done = rec.expect("recording").interrupt().expect("stop recording");
    let profile = done.profile().expect("profile written");
    let (main, stacks) = main_thread_stacks(&profile, pid);
    let total = stacks.len();
    // Node's start-up (some 100 ms of native code before any JS runs hot) is the rest: 5 s
    // keeps it a small part even when the test shares its CPUs.
    assert!(total > 1000, "5 s of a busy node at 999 Hz: ~5000 samples, got {total}");
    let holds = |s: &[String], f: &str| s.iter().any(|l| function_name(l).contains(f));
    let alpha = stacks.iter().filter(|s| holds(s, "JS:*jsHotAlpha")).count();
    let beta = stacks.iter().filter(|s| holds(s, "JS:*jsHotBeta")).count();
    let named = stacks.iter().filter(|s| holds(s, "jsHotAlpha") || holds(s, "jsHotBeta")).count();
    let pct = 100.0 * named as f64 / total as f64;
    let share = 100.0 * alpha as f64 / (alpha + beta).max(1) as f64;
    eprintln!(
        "node {pid}: {named} of {total} main-thread samples ({pct:.1}%) name a hot JS \
         function; jsHotAlpha {alpha}, jsHotBeta {beta}: alpha share {share:.1}%"
    );
    assert!(pct >= 90.0, "{named} of {total} samples ({pct:.1}%) name a hot function");
    assert!(
        (66.7 - 7.0..=66.7 + 7.0).contains(&share),
        "jsHotAlpha share {share:.1}% (alpha {alpha}, beta {beta}), want 66.7 ± 7"
    );

    // The frames: V8's names with the script's path, module [jit], category JavaScript.
    let hot = stacks.iter().flatten().find(|l| function_name(l).starts_with("JS:*jsHotAlpha"));
    let hot = hot.expect("a JS:*jsHotAlpha frame");
    let script = script.display().to_string();
    assert!(hot.contains(&format!("{script}:6:20")), "{hot}");
    let module = match how {
        NodeMap::PerfMap => "[jit]",
        NodeMap::JitDump => "[jitdump]",
    };
    assert_eq!(module_name(hot), Some(module), "{hot}");
    let cats = frame_categories(&profile, main.thread, function_name(hot));
    assert!(!cats.is_empty() && cats.iter().all(|c| c == "JavaScript"), "{cats:?}");

    // Below the JS frames: node's native frames (its `main`, in the node executable).
    let hot_stacks: Vec<&Vec<String>> =
        stacks.iter().filter(|s| holds(s, "jsHotAlpha") || holds(s, "jsHotBeta")).collect();
    let rooted = hot_stacks
        .iter()
        .filter(|s| {
            let first_js = s.iter().position(|l| module_name(l) == Some(module)).unwrap();
            s[..first_js].iter().any(|l| module_name(l) == Some("node"))
        })
        .count();
    let rooted_pct = 100.0 * rooted as f64 / hot_stacks.len() as f64;
    eprintln!(
        "{rooted} of {} hot stacks ({rooted_pct:.1}%) have node frames below",
        hot_stacks.len()
    );
    assert!(rooted_pct >= 90.0, "{rooted} of {} hot stacks go on into node", hot_stacks.len());

    let line = done.stderr.lines().find(|l| l.starts_with("JIT frames:"));
    let line =
        line.unwrap_or_else(|| panic!("no JIT frames line in the summary:\n{}", done.stderr));
    eprintln!("{line}");
    let source = match how {
        NodeMap::PerfMap => "named from perf maps",
        NodeMap::JitDump => "from jitdump",
    };
    assert!(count_before(line, source) > 0, "{line}");
}

const JDK: &str = "/usr/lib/jvm/java-17-openjdk-amd64";

/// How the JDK is asked for its perf map.
#[derive(Clone, Copy, PartialEq)]
enum JavaMap {
    /// `jcmd PID Compiler.perfmap` once the hot methods are compiled.
    Jcmd,
    /// `-XX:+DumpPerfMapAtExit`: written as the JVM exits, after every sample was collected.
    AtExit,
}

/// OpenJDK 17 running `JSplit` (two hot methods called 2:1) during an `--all` recording, with
/// a perf map written by `jcmd PID Compiler.perfmap` once the methods are compiled: the lines
/// read then also name the samples taken before (HotSpot's code cache keeps the methods where
/// they are), so nearly all of the hot thread's samples carry the hot methods, split 2:1.
#[test]
fn java_perf_map_from_jcmd_names_hot_methods_2_to_1() {
    java_split("jit_java_jcmd", JavaMap::Jcmd);
}

/// The same with `-XX:+DumpPerfMapAtExit`: the map is read at the process's exit (from our
/// own root, as /proc no longer shows the exiting process's).
#[test]
fn java_perf_map_at_exit_names_hot_methods_2_to_1() {
    java_split("jit_java_exit", JavaMap::AtExit);
}

fn java_split(test: &str, how: JavaMap) {
    use std::io::{BufRead as _, BufReader};
    let (java, javac, jcmd) =
        (format!("{JDK}/bin/java"), format!("{JDK}/bin/javac"), format!("{JDK}/bin/jcmd"));
    for tool in [&java, &javac, &jcmd] {
        assert!(
            Path::new(tool).is_file(),
            "{tool} is missing: install Debian's openjdk-17-jdk-headless"
        );
    }
    let output = output_path(test, "json");
    let classes = output.parent().unwrap().join("java-classes");
    let src = fixtures::source_dir().join("JSplit.java");
    let st = Command::new(&javac).arg("-d").arg(&classes).arg(&src).status().expect("javac");
    assert!(st.success(), "javac {} failed: {st}", src.display());

    let rec = Recording::start(&["--all"], output.clone()).expect("start");
    // No inlining: each hot method keeps frames of its own (C2 would fold them into `main`).
    let mut child = Command::new(&java)
        .args(["-XX:+PreserveFramePointer", "-XX:-Inline"])
        .args(match how {
            JavaMap::Jcmd => &[][..],
            JavaMap::AtExit => &["-XX:+UnlockDiagnosticVMOptions", "-XX:+DumpPerfMapAtExit"],
        })
        .arg("-cp")
        .arg(&classes)
        .args(["JSplit", "5", "1000"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start java");
    let pid = child.id();
    let _map = RemoveMap(format!("/tmp/perf-{pid}.map"));
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let warm = lines.next().and_then(Result::ok);
    assert_eq!(warm.as_deref(), Some("warm"), "JSplit did not say it was warm");
    if how == JavaMap::Jcmd {
        let st = Command::new(&jcmd)
            .arg(pid.to_string())
            .arg("Compiler.perfmap")
            .stdout(Stdio::null())
            .status()
            .expect("jcmd");
        assert!(st.success(), "jcmd {pid} Compiler.perfmap failed: {st}");
    }
    let done = lines.next().and_then(Result::ok).unwrap_or_default();
    assert!(done.starts_with("done"), "JSplit ended with {done:?}");
    assert!(child.wait().expect("java ran").success());
    let done = rec.interrupt().expect("stop recording");
    let profile = done.profile().expect("profile written");
    valid(&profile);

    let holds = |s: &[String], f: &str| s.iter().any(|l| function_name(l).contains(f));
    let threads = threads_of_pid(&profile, pid);
    let hot = threads
        .iter()
        .max_by_key(|t| sample_stacks(t.thread).iter().filter(|s| holds(s, "JSplit.hot")).count())
        .unwrap_or_else(|| panic!("no thread of java {pid} in the profile"));
    let stacks = sample_stacks(hot.thread);
    let total = stacks.len();
    let alpha = stacks.iter().filter(|s| holds(s, "int JSplit.hotAlpha(int)")).count();
    let beta = stacks.iter().filter(|s| holds(s, "int JSplit.hotBeta(int)")).count();
    let pct = 100.0 * (alpha + beta) as f64 / total as f64;
    let share = 100.0 * alpha as f64 / (alpha + beta).max(1) as f64;
    eprintln!(
        "java {pid} thread {}: {} of {total} samples ({pct:.1}%) name a hot method; hotAlpha \
         {alpha}, hotBeta {beta}: alpha share {share:.1}%",
        hot.tid,
        alpha + beta
    );
    assert!(total > 1000, "5 s of a busy thread at 999 Hz: ~5000 samples, got {total}");
    assert!(pct >= 90.0, "{} of {total} samples ({pct:.1}%) name a hot method", alpha + beta);
    assert!(
        (66.7 - 7.0..=66.7 + 7.0).contains(&share),
        "hotAlpha share {share:.1}% (alpha {alpha}, beta {beta}), want 66.7 ± 7"
    );
    let frame = stacks.iter().flatten().find(|l| function_name(l) == "int JSplit.hotAlpha(int)");
    let frame = frame.expect("a hotAlpha frame");
    assert_eq!(module_name(frame), Some("[jit]"), "{frame}");
    let cats = frame_categories(&profile, hot.thread, function_name(frame));
    assert!(!cats.is_empty() && cats.iter().all(|c| c == "Java"), "{cats:?}");
    let line = done.stderr.lines().find(|l| l.starts_with("JIT frames:")).unwrap_or_default();
    eprintln!("{line}");
}

/// Every CPython 3.`min_minor`+ that pyenv built on this machine (`-X perf` is 3.12's,
/// `-X perf_jit` 3.13's), oldest first.
fn pythons_from(min_minor: u32) -> Vec<std::path::PathBuf> {
    let root = std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or("/root".into()))
        .join(".pyenv/versions");
    let mut found: Vec<(u32, std::path::PathBuf)> = std::fs::read_dir(&root)
        .map(|d| {
            d.filter_map(|e| {
                let name = e.ok()?.file_name().to_string_lossy().into_owned();
                let minor: u32 = name.strip_prefix("3.")?.split('.').next()?.parse().ok()?;
                let exe = root.join(&name).join(format!("bin/python3.{minor}"));
                (minor >= min_minor && exe.is_file()).then_some((minor, exe))
            })
            .collect()
        })
        .unwrap_or_default();
    found.sort();
    assert!(
        !found.is_empty(),
        "no CPython 3.{min_minor} or newer under {}: the test needs one (pyenv install \
         3.{min_minor})",
        root.display()
    );
    found.into_iter().map(|(_, exe)| exe).collect()
}

/// CPython 3.12+ `-X perf`: every Python function gets a trampoline that the perf map names
/// `py::QUALNAME:FILE`; nearly all samples of the 2:1 fixture carry a hot function, in the
/// Python category, under its caller py_driver, down to the interpreter's `main`.
#[test]
fn python_x_perf_names_hot_python_functions_2_to_1() {
    for python in pythons_from(12) {
        python_x_perf(&python, "perf");
    }
}

/// CPython 3.13+ `-X perf_jit`: the trampolines are named in a jitdump (/tmp/jit-PID.dump),
/// with the same names, from module `[jitdump]`; the walker's trampoline rule follows them.
#[test]
fn python_x_perf_jit_names_hot_python_functions_2_to_1() {
    for python in pythons_from(13) {
        python_x_perf(&python, "perf_jit");
    }
}

/// `python -X OPTION pysplit.py` during an `--all` recording (OPTION `perf` or `perf_jit`).
fn python_x_perf(python: &Path, option: &str) {
    let script = fixtures::source_dir().join("pysplit.py");
    let output = output_path(&format!("jit_python_{option}"), "json");
    let rec = Recording::start(&["--all"], output.clone()).expect("start");
    let child = Command::new(python)
        .args(["-X", option])
        .arg(&script)
        .arg("4")
        .stdout(Stdio::null())
        .spawn()
        .expect("start python");
    let pid = child.id();
    let _files = jit_files(pid);
    let out = child.wait_with_output().expect("python ran");
    assert!(out.status.success(), "{} failed: {}", python.display(), out.status);
    let done = rec.interrupt().expect("stop recording");
    let profile = done.profile().expect("profile written");
    let (main, stacks) = main_thread_stacks(&profile, pid);
    let total = stacks.len();
    assert!(total > 1000, "4 s of a busy python at 999 Hz: ~4000 samples, got {total}");
    let holds = |s: &[String], f: &str| s.iter().any(|l| function_name(l).starts_with(f));
    let alpha = stacks.iter().filter(|s| holds(s, "py::py_hot_alpha:")).count();
    let beta = stacks.iter().filter(|s| holds(s, "py::py_hot_beta:")).count();
    let pct = 100.0 * (alpha + beta) as f64 / total as f64;
    let share = 100.0 * alpha as f64 / (alpha + beta).max(1) as f64;
    eprintln!(
        "python {pid}: {} of {total} ({pct:.1}%) named; alpha share {share:.1}%",
        alpha + beta
    );
    assert!(pct >= 90.0, "{} of {total} samples ({pct:.1}%) name a hot function", alpha + beta);
    assert!((66.7 - 7.0..=66.7 + 7.0).contains(&share), "py_hot_alpha share {share:.1}%");
    let hot = stacks.iter().flatten().find(|l| function_name(l).starts_with("py::py_hot_alpha:"));
    let hot = hot.expect("a py::py_hot_alpha frame");
    assert!(hot.contains(&script.display().to_string()), "{hot}");
    let module = if option == "perf_jit" { "[jitdump]" } else { "[jit]" };
    assert_eq!(module_name(hot), Some(module), "{hot}");
    let cats = frame_categories(&profile, main.thread, function_name(hot));
    assert!(!cats.is_empty() && cats.iter().all(|c| c == "Python"), "{cats:?}");

    // The walker steps over each trampoline (no CFI, no frame pointer): the stacks go on to
    // the caller, py_driver, and down to the interpreter's start, not cut at the first one.
    // The rule is set once the perf map naming the trampoline arena is read: drains follow
    // each other closely after a process's first JIT code, so that is within milliseconds.
    let hot_stacks: Vec<&Vec<String>> = stacks
        .iter()
        .filter(|s| holds(s, "py::py_hot_alpha:") || holds(s, "py::py_hot_beta:"))
        .collect();
    let whole = |s: &Vec<String>| {
        let names: Vec<&str> = s.iter().map(|l| function_name(l)).collect();
        let driver = names.iter().position(|n| n.starts_with("py::py_driver:"));
        let hot = names.iter().position(|n| n.starts_with("py::py_hot_"));
        !names[0].starts_with("[truncated")
            && names.iter().any(|n| *n == "main" || *n == "_start")
            && matches!((driver, hot), (Some(d), Some(h)) if d < h)
    };
    let complete = hot_stacks.iter().filter(|s| whole(s)).count();
    let complete_pct = 100.0 * complete as f64 / hot_stacks.len().max(1) as f64;
    if let Some(bad) = hot_stacks.iter().find(|s| !whole(s)) {
        eprintln!("e.g. {bad:?}");
    }
    assert!(
        complete_pct >= 90.0,
        "{complete} of {} hot stacks ({complete_pct:.1}%) go from main through py_driver",
        hot_stacks.len()
    );
}

/// The agent's spooled windows name JIT code too: Node.js `--perf-basic-prof` under the agent,
/// its windows read by Go's pprof (independent of our decoder) hold the hot JS functions in
/// mapping `[jit]`, split 2:1.
#[test]
fn agent_windows_read_by_go_pprof_name_js_functions() {
    use tests::{agent::Agent, go_pprof};
    let spool = output_path("jit_agent", "spool");
    let _ = std::fs::remove_dir_all(&spool);
    let d = spool.to_str().unwrap();
    let agent = Agent::start(&["--spool", d, "--window", "1", "-F", "499"]);
    let script = fixtures::source_dir().join("jsplit.js");
    let out = Command::new(node())
        .args(["--perf-basic-prof", "--no-turbo-inlining"])
        .arg(&script)
        .arg("4")
        .current_dir(spool.parent().expect("in a directory"))
        .stdout(Stdio::null())
        .spawn()
        .expect("start node");
    let _map = RemoveMap(format!("/tmp/perf-{}.map", out.id()));
    let status = out.wait_with_output().expect("node ran").status;
    assert!(status.success(), "node failed: {status}");
    let (status, stderr) = agent.stop(libc::SIGTERM, std::time::Duration::from_secs(10));
    assert!(status.success(), "agent failed:\n{stderr}");
    // The node service's windows (a process outside containers and units is its own service).
    let mut files: Vec<String> = std::fs::read_dir(&spool)
        .unwrap()
        .filter_map(|e| {
            let p = e.ok()?.path();
            let stem = p.file_name()?.to_str()?.strip_suffix(".json")?.to_owned();
            let meta: Value = serde_json::from_slice(&std::fs::read(&p).ok()?).ok()?;
            (meta["service_name"] == "node")
                .then(|| spool.join(format!("{stem}.pb.gz")).display().to_string())
        })
        .collect();
    files.sort();
    assert!(files.len() >= 3, "4 s of node in 1 s windows: {files:?}\n{stderr}");
    let mut args = vec!["-top", "-sample_index=samples", "-nodecount=100000", "-trim=false"];
    args.extend(files[1..].iter().map(String::as_str));
    let top = go_pprof::run(&args, Path::new(&files[0])).expect("pprof -top");
    // Rows: flat flat% sum% cum cum% NAME, the name possibly with spaces (V8's have a path).
    let cum_of = |f: &str| -> f64 {
        top.lines()
            .filter(|l| l.contains(f))
            .filter_map(|l| l.split_whitespace().nth(3)?.parse::<f64>().ok())
            .sum()
    };
    let (a, b) = (cum_of("JS:*jsHotAlpha"), cum_of("JS:*jsHotBeta"));
    assert!(a + b > 500.0, "4 s at 499 Hz: {a} + {b} samples in the hot JS functions:\n{top}");
    let share = 100.0 * a / (a + b);
    assert!((66.7 - 7.0..=66.7 + 7.0).contains(&share), "jsHotAlpha share {share:.1}%:\n{top}");
    let raw = go_pprof::run(&["-raw"], Path::new(&files[files.len() / 2])).expect("pprof -raw");
    assert!(raw.contains("[jit]"), "no [jit] mapping in a window:\n{raw}");
}

/// Removes what a JIT fixture left in /tmp (its jitdump and perf map).
struct RemoveFiles(Vec<String>);

impl Drop for RemoveFiles {
    fn drop(&mut self) {
        for f in &self.0 {
            let _ = std::fs::remove_file(f);
        }
    }
}

fn jit_files(pid: u32) -> RemoveFiles {
    RemoveFiles(vec![format!("/tmp/jit-{pid}.dump"), format!("/tmp/perf-{pid}.map")])
}

/// The summary line starting with `prefix`.
fn summary_line<'a>(stderr: &'a str, prefix: &str) -> &'a str {
    let line = stderr.lines().find(|l| l.trim_start().starts_with(prefix));
    line.unwrap_or_else(|| panic!("no {prefix:?} line in the summary:\n{stderr}"))
}

/// The number before `word` in `line` ("… 12 from jitdump" → 12 for "from jitdump").
fn count_before(line: &str, word: &str) -> u64 {
    let at = line.find(word).unwrap_or_else(|| panic!("no {word:?} in {line:?}"));
    let n = line[..at].split_whitespace().last().unwrap_or_default().trim_start_matches('(');
    n.parse().unwrap_or_else(|_| panic!("no count before {word:?} in {line:?}"))
}

/// A JIT that reuses an address mid-run (tests/fixtures/jitreuse.c: `jit_alpha` for 2 s, then
/// `jit_beta` mapped at the same address for 2 s, each announced in its jitdump and perf map
/// before it runs): every sample is named by the code there at its time, though samples of
/// alpha's last moments are collected after beta's record was read (a perf map alone, without
/// times, names them beta). The jitdump's debug info gives the line; stacks go on into the
/// fixture's own `run` and `main`.
#[test]
fn jitdump_names_a_reused_address_by_the_code_there_at_the_sample() {
    jit_reuse("good");
}

/// The same with beta's records written 0.3 s after beta starts running (timed at its
/// start), as a JIT that buffers its records writes them: samples of beta collected before
/// its record is read are not named alpha (the kernel said the memory was mapped again after
/// alpha's load), and are named beta once the record is read.
#[test]
fn jitdump_record_written_late_names_reused_memory_right() {
    jit_reuse("late");
}

fn jit_reuse(dump: &str) {
    let exe = fixtures::build("jitreuse").expect("build jitreuse");
    let output = output_path(&format!("jit_reuse_{dump}"), "json");
    let rec = Recording::start(&["--all"], output.clone()).expect("start");
    let child =
        Command::new(&exe).args(["2", dump]).stdout(Stdio::piped()).spawn().expect("jitreuse");
    let pid = child.id();
    let _files = jit_files(pid);
    let out = child.wait_with_output().expect("jitreuse ran");
    assert!(out.status.success(), "jitreuse failed: {}", out.status);
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    let switched: f64 = said
        .trim()
        .strip_prefix("switched ")
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("jitreuse said {said:?}"));
    let done = rec.interrupt().expect("stop recording");
    let profile = done.profile().expect("profile written");
    let (main, stacks) = main_thread_stacks(&profile, pid);
    let total = stacks.len();
    // Fewer when the test shares its CPUs; the split and times are what is tested.
    assert!(total > 300, "4 s of a busy thread at 999 Hz: ~4000 samples, got {total}");
    fn leaf_of(s: &[String]) -> Option<&String> {
        s.iter().rev().find(|l| function_name(l).starts_with("jit_"))
    }
    let kinds: Vec<Option<&str>> =
        stacks.iter().map(|s| leaf_of(s).map(|l| function_name(l))).collect();
    let alpha: Vec<usize> = (0..total).filter(|&i| kinds[i] == Some("jit_alpha")).collect();
    let beta: Vec<usize> = (0..total).filter(|&i| kinds[i] == Some("jit_beta")).collect();
    let unnamed =
        stacks.iter().filter(|s| s.iter().any(|l| module_name(l) == Some("[anon]"))).count();
    eprintln!(
        "jitreuse {pid}: {total} samples, jit_alpha {}, jit_beta {}, [anon] {unnamed}",
        alpha.len(),
        beta.len()
    );
    let named = alpha.len() + beta.len();
    assert!(named * 100 >= total * 90, "{named} of {total} samples name the JIT code");
    // Each sample is named by the code there at its time: alpha before the switch, beta
    // after (wall-clock times; 5 ms for the profile's clock pairing and the sample period).
    let start = profile["meta"]["startTime"].as_f64().expect("meta.startTime");
    let times = tests::profile_query::sample_times(main.thread);
    let wrong: Vec<(f64, &str)> = (0..total)
        .filter_map(|i| {
            let at = start + times[i] - switched;
            match kinds[i]? {
                "jit_beta" if at < -5.0 => Some((at, "jit_beta")),
                "jit_alpha" if at > 5.0 => Some((at, "jit_alpha")),
                _ => None,
            }
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "{} samples named by code not there at their time (ms from the switch, name): {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(10)]
    );
    // Each phase is 2 s of the thread's CPU time, so of its samples.
    let share = 100.0 * alpha.len() as f64 / named as f64;
    assert!((45.0..=55.0).contains(&share), "jit_alpha: {share:.1}% of named samples, want 50");
    let frame = leaf_of(&stacks[alpha[0]]).unwrap();
    assert_eq!(module_name(frame), Some("[jitdump]"), "{frame}");
    assert!(frame.ends_with("(jitreuse.js:11)"), "debug-info line: {frame}");
    let frame = leaf_of(&stacks[beta[0]]).unwrap();
    assert!(frame.ends_with("(jitreuse.js:22)"), "debug-info line: {frame}");
    let rooted = stacks
        .iter()
        .filter(|s| leaf_of(s).is_some())
        .filter(|s| contains_path(s, &["main", "run"]))
        .count();
    assert!(rooted * 100 >= named * 90, "{rooted} of {named} JIT stacks go on into run and main");

    let line = summary_line(&done.stderr, "JIT frames:");
    eprintln!("{line}\n{}", summary_line(&done.stderr, "jitdumps:"));
    assert!(count_before(line, "from jitdump") >= named as u64, "{line}");
    let dumps = summary_line(&done.stderr, "jitdumps:");
    assert!(count_before(dumps, "code loads") >= 2, "{dumps}");
    assert!(count_before(dumps, "debug-info") >= 2, "{dumps}");
}

/// Bad maps and dumps, each in a JIT process of its own in one recording: a dump with a bad
/// magic, version or record size, or another user's; a perf map with garbage and a truncated line, one past the
/// size bound, a symlink to /etc/shadow, another user's file. None stops or hangs the
/// recording: each is skipped and counted in the summary, and what a good file still says
/// (the garbage map's good line; the bad-magic process's perf map) names the code.
#[test]
fn bad_jitdumps_and_perf_maps_are_skipped_and_counted() {
    let exe = fixtures::build("jitreuse").expect("build jitreuse");
    let output = output_path("jit_bad_input", "json");
    let rec = Recording::start(&["--all"], output.clone()).expect("start");
    // (dump, map, how the code is named: its module, or None for unnamed)
    let cases: [(&str, &str, Option<&str>); 8] = [
        ("badmagic", "good", Some("[jit]")),
        ("otheruser", "none", None),
        ("badversion", "none", None),
        ("badsize", "none", None),
        ("none", "garbage", Some("[jit]")),
        ("none", "huge", None),
        ("none", "symlink", None),
        ("none", "otheruser", None),
    ];
    let mut children = Vec::new();
    let mut files = Vec::new();
    for (dump, map, _) in cases {
        let child = Command::new(&exe)
            .args(["1", dump, map])
            .stdout(Stdio::null())
            .spawn()
            .expect("start jitreuse");
        files.push(jit_files(child.id()));
        children.push(child);
    }
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    for mut c in children {
        assert!(c.wait().expect("jitreuse ran").success());
    }
    let done = rec.interrupt().expect("stop recording");
    assert!(done.status.success(), "recording failed:\n{}", done.stderr);
    let profile = done.profile().expect("profile written");
    for ((dump, map, want), pid) in cases.iter().zip(&pids) {
        let (_, stacks) = main_thread_stacks(&profile, *pid);
        // The code's frame: the one under `run`.
        let code: Vec<&String> = stacks
            .iter()
            .filter_map(|s| {
                let run = s.iter().position(|l| function_name(l) == "run")?;
                s.get(run + 1)
            })
            .filter(|l| module_name(l) != Some("jitreuse") && module_name(l) != Some("libc.so.6"))
            .filter(|l| {
                module_name(l) != Some("[vdso]") && module_name(l) != Some("[kernel.kallsyms]")
            })
            .collect();
        // A second of CPU time each: some 1,000 samples.
        assert!(code.len() > 50, "{dump}/{map}: {} samples in the JIT code", code.len());
        let as_wanted = code
            .iter()
            .filter(|l| match want {
                Some(module) => function_name(l) == "jit_alpha" && module_name(l) == Some(*module),
                None => module_name(l) == Some("[anon]"),
            })
            .count();
        eprintln!("{dump}/{map} ({pid}): {as_wanted} of {} code frames as wanted", code.len());
        assert!(
            as_wanted * 100 >= code.len() * 90,
            "{dump}/{map}: {as_wanted} of {} code frames {want:?}, e.g. {}",
            code.len(),
            code[0]
        );
    }
    let maps = summary_line(&done.stderr, "perf maps:");
    let dumps = summary_line(&done.stderr, "jitdumps:");
    eprintln!("{maps}\n{dumps}\n{}", summary_line(&done.stderr, "JIT frames:"));
    // Other processes on the host may add to these, never take away.
    assert!(count_before(maps, "garbage lines") >= 5, "{maps}");
    assert!(count_before(maps, "stopped at the") >= 1, "{maps}");
    assert!(count_before(maps, "refused") >= 2, "{maps}");
    assert!(count_before(dumps, "with a bad header") >= 2, "{dumps}");
    assert!(count_before(dumps, "stopped at a bad record") >= 1, "{dumps}");
    assert!(count_before(dumps, "refused") >= 1, "{dumps}");
}

/// A process in another pid and mount namespace (a container as `unshare` makes one): node
/// `--perf-basic-prof` is pid 1 there and writes `/tmp/perf-1.map` into a tmpfs only its
/// namespace sees. The map is read through its root under the pid it knows itself by
/// (`/proc/PID/root/tmp/perf-NSPID.map`): its samples carry the hot JS functions, 2:1.
#[test]
fn node_in_another_pid_namespace_is_named_from_its_own_tmp() {
    let script = fixtures::source_dir().join("jsplit.js");
    let output = output_path("jit_node_container", "json");
    let rec = Recording::start(&["--all"], output.clone()).expect("start");
    let inner = format!(
        "mount -t tmpfs rsprof-test /tmp && exec {} --perf-basic-prof --no-turbo-inlining {} 6",
        node(),
        script.display()
    );
    let unshare = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "sh", "-c", &inner])
        // Whatever node leaves in its working directory (V8's isolate logs) stays out of the
        // source tree.
        .current_dir(output.parent().expect("output in a directory"))
        .stdout(Stdio::null())
        .spawn()
        .expect("unshare (util-linux)");
    let outer = unshare.id();
    // node: the child unshare forked (pid 1 in the new namespace).
    let children = format!("/proc/{outer}/task/{outer}/children");
    let t0 = std::time::Instant::now();
    let pid: u32 = loop {
        let text = std::fs::read_to_string(&children).unwrap_or_default();
        if let Some(pid) = text.split_whitespace().next().and_then(|p| p.parse().ok()) {
            break pid;
        }
        assert!(t0.elapsed().as_secs() < 10, "unshare started no child");
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let nstgid = status.lines().find(|l| l.starts_with("NStgid:")).unwrap_or_default().to_owned();
    let out = unshare.wait_with_output().expect("unshare ran");
    assert!(out.status.success(), "unshare/node failed: {}", out.status);
    let done = rec.interrupt().expect("stop recording");
    assert!(
        !Path::new(&format!("/tmp/perf-{pid}.map")).exists(),
        "node's map is in its own /tmp only"
    );
    let profile = done.profile().expect("profile written");
    let (_, stacks) = main_thread_stacks(&profile, pid);
    let total = stacks.len();
    let holds = |s: &[String], f: &str| s.iter().any(|l| function_name(l).contains(f));
    let alpha = stacks.iter().filter(|s| holds(s, "JS:*jsHotAlpha")).count();
    let beta = stacks.iter().filter(|s| holds(s, "JS:*jsHotBeta")).count();
    let pct = 100.0 * (alpha + beta) as f64 / total.max(1) as f64;
    let share = 100.0 * alpha as f64 / (alpha + beta).max(1) as f64;
    eprintln!(
        "node {pid} ({nstgid}): {} of {total} samples ({pct:.1}%) name a hot JS function; alpha \
         share {share:.1}%",
        alpha + beta
    );
    eprintln!("{}", summary_line(&done.stderr, "JIT frames:"));
    // 6 s keeps node's start-up (native code, no JS yet) a small part under load too.
    assert!(total > 300, "6 s of a busy node: {total} samples");
    assert!(pct >= 90.0, "{} of {total} samples ({pct:.1}%) name a hot function", alpha + beta);
    assert!((66.7 - 7.0..=66.7 + 7.0).contains(&share), "jsHotAlpha share {share:.1}%");
    let hot = stacks.iter().flatten().find(|l| function_name(l).starts_with("JS:*jsHotAlpha"));
    assert_eq!(hot.and_then(|h| module_name(h)), Some("[jit]"), "{hot:?}");
}
