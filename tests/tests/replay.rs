//! `record --save-raw` and `rsprof-bpf replay`: a live `--all` recording saves its raw
//! stream, which an unprivileged user replays (no root, no BPF) into the same Gecko profile
//! for the fixture's processes: one that existed before sampling (its mappings and name come
//! from /proc, so from the stream at replay, after it is killed) and one that started and
//! exited during the recording (kernel records only). Cut and garbage streams are clear
//! errors. Needs root for the recording; run serially (`--test-threads=1`).

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use serde_json::Value;
use tests::{
    fixtures,
    gecko_schema::validate,
    harness::{Background, Recording, output_path, spawn_fresh},
    profile_query::{
        ThreadInfo, contains_path, function_name, sample_cpu_deltas, sample_stacks, sample_times,
        threads_of_pid,
    },
};

/// The unprivileged user the replay runs as (`nobody`).
const NOBODY: &str = "65534";

/// A directory anyone may write to and read from, for the replay's input and output.
fn open_dir(test: &str) -> PathBuf {
    let dir = output_path(test, "d");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    dir
}

/// The split fixture, copied where an unprivileged replay can read it (the fixture cache may
/// be under a private home directory): a replay reads the ELF files again to name frames.
fn readable_split(dir: &Path) -> PathBuf {
    let built = fixtures::build("split").expect("build split");
    let exe = dir.join("split");
    std::fs::copy(&built, &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    exe
}

/// Runs `rsprof-bpf replay ARGS` as `nobody`; (success, stderr).
fn replay_unprivileged(args: &[&Path]) -> (bool, String) {
    let bin = fixtures::rsprof_bin().expect("rsprof-bpf");
    let readable = std::fs::metadata(&bin).is_ok_and(|m| m.permissions().mode() & 0o005 == 0o005);
    assert!(readable, "{} must be executable by others to run as nobody", bin.display());
    let out = Command::new("setpriv")
        .args(["--reuid", NOBODY, "--regid", NOBODY, "--clear-groups", "--"])
        .arg(&bin)
        .arg("replay")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run setpriv (util-linux)");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// One thread as the replay must reproduce it: its names, lifetime, and every sample's time,
/// CPU delta and stack (function names and modules, root first).
type Sampled = (String, String, Vec<(String, Option<u64>, Vec<String>)>);

fn thread_view(t: &ThreadInfo) -> Sampled {
    let times = sample_times(t.thread);
    let deltas = sample_cpu_deltas(t.thread);
    let stacks = sample_stacks(t.thread);
    assert_eq!(times.len(), stacks.len());
    let samples = times
        .iter()
        .zip(deltas)
        .zip(stacks)
        // Printed at the writer's precision: the same float either way.
        .map(|((time, delta), stack)| (format!("{time:.6}"), delta, stack))
        .collect();
    let life = format!("{} {}", t.thread["registerTime"], t.thread["unregisterTime"]);
    (format!("{}:{}:{}", t.process_name, t.tid, t.name), life, samples)
}

fn threads_view(profile: &Value, pid: u32) -> Vec<Sampled> {
    let mut v: Vec<Sampled> = threads_of_pid(profile, pid).iter().map(thread_view).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(bytes).unwrap();
    gz.finish().unwrap()
}

fn valid(profile: &Value, what: &str) {
    if let Err(problems) = validate(profile) {
        panic!("{what} breaks the Gecko v36 rules:\n{}", problems.join("\n"));
    }
}

#[test]
fn a_replay_without_root_gives_the_live_profile() {
    let dir = open_dir("replay_same");
    let exe = readable_split(&dir);
    // Running before sampling starts: known from /proc, read once at the start.
    let mut before = Background(spawn_fresh(Command::new(&exe).arg("30").stdout(Stdio::null())));
    let before_pid = before.0.id();
    let raw = dir.join("rec.raw");
    let live_path = dir.join("live.json");
    let raw_arg = raw.to_str().unwrap();
    let rec = Recording::start(&["--all", "--save-raw", raw_arg], live_path.clone())
        .expect("start recording");
    // Started and gone during the recording: known from the kernel's records alone.
    let mut short = spawn_fresh(Command::new(&exe).arg("1.5").stdout(Stdio::null()));
    let short_pid = short.id();
    assert!(short.wait().unwrap().success());
    let done = rec.interrupt().expect("stop recording");
    // The process the stream has /proc facts of is gone before the replay.
    let _ = before.0.kill();
    let _ = before.0.wait();
    let live = done.profile().expect("live profile");
    valid(&live, "the live profile");
    assert!(done.stderr.contains("saved the raw stream"), "{}", done.stderr);
    std::fs::set_permissions(&raw, std::fs::Permissions::from_mode(0o644)).unwrap();

    let replayed_path = dir.join("replayed.json");
    let (ok, stderr) = replay_unprivileged(&[&raw, Path::new("-o"), &replayed_path]);
    assert!(ok, "replay as nobody failed:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("replayed "), "the replay's summary: {stderr}");
    assert!(!stderr.contains("had no answer"), "every /proc read is in the stream: {stderr}");
    let replayed = tests::gecko_schema::load(&replayed_path).expect("replayed profile");
    valid(&replayed, "the replayed profile");

    for (what, pid) in [("pre-existing", before_pid), ("short-lived", short_pid)] {
        let (a, b) = (threads_view(&live, pid), threads_view(&replayed, pid));
        assert_eq!(a.len(), 1, "{what} split {pid}: one thread live: {:?}", a.first());
        let samples = &a[0].2;
        assert!(samples.len() > 300, "{what} split {pid}: {} samples live", samples.len());
        // Real stacks, named: the replay's sameness is not that of two empty profiles.
        let named = samples
            .iter()
            .filter(|(_, _, s)| contains_path(s, &["main", "work"]))
            .filter(|(_, _, s)| s.last().is_some_and(|l| function_name(l).starts_with("hot_")))
            .count();
        assert!(named * 10 > samples.len() * 9, "{what}: {named} of {} in hot_*", samples.len());
        assert_eq!(a[0].0, b.first().map_or("", |t| &t.0), "{what} split {pid}: thread names");
        assert_eq!(a[0].1, b[0].1, "{what} split {pid}: thread lifetime");
        assert_eq!(samples.len(), b[0].2.len(), "{what} split {pid}: sample count");
        for (k, (x, y)) in samples.iter().zip(&b[0].2).enumerate() {
            assert_eq!(x, y, "{what} split {pid}: sample {k}");
        }
    }
    // The recording's time base and description (`meta.markerSchema` differs: the recording's
    // USDT probe schemas are not replayed, see `rsprof_core::replay`).
    for key in ["startTime", "interval", "product", "oscpu", "logicalCPUs", "physicalCPUs"] {
        assert_eq!(live["meta"][key], replayed["meta"][key], "meta.{key}");
    }
}

/// A stream cut short (the recorder killed mid-write), an empty file and a file of another
/// kind each fail with an error saying so; no panic, no profile written.
#[test]
fn cut_and_garbage_raw_files_are_clear_errors() {
    let dir = open_dir("replay_bad");
    let raw = dir.join("whole.raw");
    let rec =
        Recording::start(&["--all", "--save-raw", raw.to_str().unwrap()], dir.join("live.json"))
            .expect("start recording");
    let done = rec.interrupt().expect("stop recording");
    assert!(done.status.success(), "{}", done.stderr);
    let whole = std::fs::read(&raw).unwrap();
    assert!(whole.len() > 1000, "{} bytes", whole.len());

    let mut cut = flate2::read::MultiGzDecoder::new(&whole[..]);
    let mut plain = Vec::new();
    std::io::Read::read_to_end(&mut cut, &mut plain).unwrap();
    let cases: Vec<(&str, Vec<u8>, &[&str])> = vec![
        ("compressed-half", whole[..whole.len() / 2].to_vec(), &["truncated", "corrupt"]),
        // Whole gzip, of a stream cut in the middle of an entry.
        (
            "entry-cut",
            gzip(&plain[..plain.len() * 2 / 3]),
            &["truncated", "before the recording did"],
        ),
        ("empty", Vec::new(), &["not an rsprof-bpf raw stream"]),
        ("json", br#"{"meta": {"version": 36}}"#.to_vec(), &["not an rsprof-bpf raw stream"]),
    ];
    for (name, bytes, any_of) in cases {
        let path = dir.join(format!("{name}.raw"));
        std::fs::write(&path, &bytes).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let out = dir.join(format!("{name}.json"));
        let (ok, stderr) = replay_unprivileged(&[&path, Path::new("-o"), &out]);
        assert!(!ok, "{name}: replay succeeded:\n{stderr}");
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
        assert!(stderr.contains("rsprof-bpf: error:"), "{name}: {stderr}");
        assert!(
            any_of.iter().any(|w| stderr.contains(w)),
            "{name}: want one of {any_of:?}: {stderr}"
        );
        assert!(!out.exists(), "{name}: no profile is written");
    }
}
