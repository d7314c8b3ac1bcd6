//! The cgroup filter (`--cgroup`, `--container`) and container identity, on real cgroup v2
//! trees the tests build themselves (named like a containerd/Kubernetes node) with real
//! workloads inside and outside. Needs root and cgroup v2 (hybrid hosts are fine).

use std::{
    collections::{BTreeMap, HashSet},
    hash::{BuildHasher as _, RandomState},
    path::Path,
    process::{Command, Stdio},
};

use serde_json::Value;
use tests::{
    cgroups::CgroupTree,
    fixtures,
    gecko_schema::validate,
    harness::{Background, Recording, output_path, run},
    profile_query::{ThreadInfo, sample_stacks, threads},
};

const POD_UID: &str = "0125ec2f-b64a-4868-8f5b-94b56cbab864";

/// A 64-hex container id, different for every call.
fn container_id() -> String {
    (0..4).map(|i| format!("{:016x}", RandomState::new().hash_one(i))).collect()
}

/// `<tree>/kubepods.slice/kubepods-pod<uid>.slice/cri-containerd-<id>.scope`.
fn container_cgroup(tree: &CgroupTree, id: &str) -> std::path::PathBuf {
    let pod = POD_UID.replace('-', "_");
    tree.mkdir(&format!("kubepods.slice/kubepods-pod{pod}.slice/cri-containerd-{id}.scope"))
        .expect("create container cgroup")
}

fn valid(profile: &Value) {
    if let Err(problems) = validate(profile) {
        panic!("profile breaks the Gecko v36 rules:\n{}", problems.join("\n"));
    }
}

fn names(ts: &[ThreadInfo]) -> Vec<String> {
    ts.iter().map(|t| format!("{}:{}:{}", t.process_name, t.tid, t.name)).collect()
}

/// Runs the inside workload to completion: a shell that moves itself into `cg`, starts a busy
/// `split`, and, a second later (so after recording began), creates `cg/nested`, moves a new
/// child into it and runs a second `split` there. Returns the pids of both splits.
fn run_inside_workload(cg: &Path, split: &Path) -> (u32, u32) {
    let script = r#"
        echo $$ > "$1/cgroup.procs"
        "$2" 3 & echo "main $!"
        sleep 1
        mkdir "$1/nested"
        sh -c 'echo $$ > "$1/nested/cgroup.procs" && exec "$2" 1.5' nested "$1" "$2" &
        echo "nested $!"
        wait
    "#;
    let out = Command::new("/bin/sh")
        .args(["-c", script, "inside"])
        .arg(cg)
        .arg(split)
        .stderr(Stdio::inherit())
        .output()
        .expect("run the inside workload");
    assert!(out.status.success(), "inside workload failed: {}", out.status);
    let text = String::from_utf8_lossy(&out.stdout);
    let pid = |what: &str| -> u32 {
        text.lines()
            .find_map(|l| l.strip_prefix(what)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no '{what}' pid in workload output {text:?}"))
    };
    (pid("main "), pid("nested "))
}

/// Records with `filter` while the inside workload and an outside `split` run; checks that
/// only the inside processes (including the child in the cgroup created mid-recording) are
/// in the profile, with their container identity.
fn check_filter(test: &str, filter: impl FnOnce(&CgroupTree, &Path, &str) -> Vec<String>) {
    let tree = CgroupTree::create(test).expect("create test cgroup tree");
    let id = container_id();
    let cg = container_cgroup(&tree, &id);
    let split = fixtures::build("split").unwrap();
    let args = filter(&tree, &cg, &id);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let rec = Recording::start(&args, output_path(test, "json")).expect("start recording");
    let mut outside = Command::new(&split).arg("3").stdout(Stdio::null()).spawn().unwrap();
    let (main_pid, nested_pid) = run_inside_workload(&cg, &split);
    let _ = outside.wait();
    let done = rec.interrupt().expect("stop recording");
    let profile = done.profile().expect("profile written");
    valid(&profile);

    let all = threads(&profile);
    let pids: HashSet<u64> = all.iter().map(|t| t.pid).collect();
    assert!(
        !pids.contains(&u64::from(outside.id())),
        "the outside split (pid {}) was sampled: {:?}",
        outside.id(),
        names(&all)
    );
    let samples = |pid: u32| -> usize {
        all.iter().filter(|t| t.pid == u64::from(pid)).map(|t| sample_stacks(t.thread).len()).sum()
    };
    assert!(samples(main_pid) > 300, "inside split {main_pid}: {} samples", samples(main_pid));
    assert!(
        samples(nested_pid) > 100,
        "split in the cgroup created while recording ({nested_pid}): {} samples; threads {:?}",
        samples(nested_pid),
        names(&all)
    );
    // Nothing but the workload runs in the test's cgroups, and all of it is in the container.
    let label = format!("[containerd {}]", &id[..8]);
    for t in &all {
        let base = t.process_name.strip_suffix(&label).map(str::trim_end);
        assert!(
            matches!(base, Some("sh" | "split" | "sleep" | "mkdir")),
            "unexpected process '{}' (pid {}) in a filtered profile",
            t.process_name,
            t.pid
        );
    }
    // The identity marker of the main split.
    let main = all.iter().find(|t| t.pid == u64::from(main_pid) && t.tid == t.pid).unwrap();
    let markers = main.thread["markers"]["data"].as_array().unwrap();
    let data = markers.iter().map(|m| &m[5]).find(|d| d["type"] == "ContainerIdentity");
    let data = data.unwrap_or_else(|| panic!("no ContainerIdentity marker: {markers:?}"));
    assert_eq!(data["runtime"], "containerd");
    assert_eq!(data["id"], id.as_str());
    assert_eq!(data["podUid"], POD_UID);
    assert_eq!(data["qos"], "Guaranteed");
    assert_eq!(data["cgroup"], tree.cgroup_path(&cg).as_str());

    for want in ["filtered out", "filter: ", "samples kept"] {
        assert!(done.stderr.contains(want), "summary lacks '{want}':\n{}", done.stderr);
    }
    let filtered: u64 = done
        .stderr
        .lines()
        .find_map(|l| l.split("samples kept, ").nth(1)?.split(' ').next()?.parse().ok())
        .expect("filtered-out count in the summary");
    assert!(filtered > 100, "the outside split's samples are filtered out: {filtered}");
}

#[test]
fn cgroup_filter_records_only_the_cgroup_and_cgroups_created_below_it() {
    check_filter("cgroup", |_, cg, _| vec!["--cgroup".into(), cg.display().to_string()]);
}

#[test]
fn container_filter_by_id_prefix_records_only_the_container() {
    check_filter("container", |_, _, id| vec!["--container".into(), id[..12].to_owned()]);
}

#[test]
fn filter_that_matches_nothing_says_so() {
    let tree = CgroupTree::create("nomatch").unwrap();
    let empty = tree.mkdir("empty").unwrap();
    let out = output_path("cgroup_nomatch", "json");
    // Relative to the mount, as /proc/PID/cgroup shows it.
    let rel = tree.cgroup_path(&empty);
    let done = run(&["--cgroup", &rel, "-d", "1", "-o", out.to_str().unwrap()]).unwrap();
    assert!(done.status.success(), "{}", done.stderr);
    assert!(done.stderr.contains("no sample matched the filter"), "{}", done.stderr);
    assert!(done.stderr.contains(&rel), "names the cgroup: {}", done.stderr);
    assert!(done.stderr.contains("the profile is empty"), "{}", done.stderr);
    // Still written, and it opens: one thread (rsprof-bpf's own) with a note saying why.
    let profile = tests::gecko_schema::load(&out).expect("the (empty) profile is still written");
    valid(&profile);
    assert!(threads(&profile).iter().all(|t| t.process_name == "rsprof-bpf"));
}

#[test]
fn pid_and_command_filters_intersect_with_the_cgroup() {
    let tree = CgroupTree::create("intersect").unwrap();
    let cg = tree.mkdir("work").unwrap();
    let split = fixtures::build("split").unwrap();
    let cg_arg = cg.display().to_string();

    // -p of a process outside the cgroup (busy all through the recording, however long the
    // profiler takes to attach): nothing matches both.
    let outside =
        Background(Command::new(&split).arg("600").stdout(Stdio::null()).spawn().unwrap());
    let out = output_path("cgroup_pid", "json");
    let pid = outside.0.id().to_string();
    let done =
        run(&["-p", &pid, "--cgroup", &cg_arg, "-d", "1", "-o", out.to_str().unwrap()]).unwrap();
    drop(outside);
    assert!(done.status.success(), "{}", done.stderr);
    assert!(done.stderr.contains("no sample matched the filter"), "{}", done.stderr);

    // -- CMD: of its two children only the one that moves into the cgroup is recorded.
    let pid_file = output_path("cgroup_cmd_outside", "pid");
    let script = format!(
        // The inside child runs 2 s: > 300 samples even when other work shares the CPUs.
        "{s} 1 & echo $! > {f}; echo $$ > {cg}/cgroup.procs; exec {s} 2",
        s = split.display(),
        f = pid_file.display(),
        cg = cg.display()
    );
    let out = output_path("cgroup_cmd", "json");
    let done =
        run(&["--cgroup", &cg_arg, "-o", out.to_str().unwrap(), "--", "/bin/sh", "-c", &script])
            .unwrap();
    assert!(done.status.success(), "{}", done.stderr);
    let outside_pid: u64 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
    let profile = tests::gecko_schema::load(&out).unwrap();
    valid(&profile);
    let all = threads(&profile);
    let mut per_pid: BTreeMap<u64, usize> = BTreeMap::new();
    for t in &all {
        *per_pid.entry(t.pid).or_default() += sample_stacks(t.thread).len();
    }
    assert!(!per_pid.contains_key(&outside_pid), "outside child sampled: {per_pid:?}");
    assert!(per_pid.values().any(|&n| n > 300), "the inside split is recorded: {per_pid:?}");
    assert!(all.iter().all(|t| t.process_name == "split"), "{:?}", names(&all));
}

fn one_line_error(args: &[&str], want: &[&str]) {
    let done = run(args).unwrap();
    assert!(!done.status.success(), "{args:?} should fail");
    let lines: Vec<&str> = done.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one-line error for {args:?}, got:\n{}", done.stderr);
    assert!(lines[0].starts_with("rsprof-bpf: error:"), "{}", lines[0]);
    for w in want {
        assert!(lines[0].contains(w), "error lacks '{w}': {}", lines[0]);
    }
}

#[test]
fn bad_cgroup_and_container_arguments_are_one_line_errors() {
    let tree = CgroupTree::create("errors").unwrap();
    // Two containers whose ids share their first 12 digits.
    let a = format!("abcdef012345{}", &container_id()[12..]);
    let b = format!("abcdef012345{}", &container_id()[12..]);
    tree.mkdir(&format!("system.slice/docker-{a}.scope")).unwrap();
    tree.mkdir(&format!("system.slice/docker-{b}.scope")).unwrap();
    let out = output_path("cgroup_errors", "json");
    let o = out.to_str().unwrap();
    one_line_error(&["--container", "abcdef012345", "-o", o], &["ambiguous", &a[..12], &b[..12]]);
    one_line_error(
        &["--container", &a[..16], "--container", "fedcba987654", "-o", o],
        &["no container matches 'fedcba987654'", "docker abcdef012345"],
    );
    one_line_error(&["--cgroup", "/rsprof-no-such-cgroup/x", "-o", o], &["no cgroup"]);
    one_line_error(&["--cgroup", "/tmp", "-o", o], &["no cgroup"]);
    assert!(!out.exists(), "failed runs leave no output");
}

#[test]
fn list_containers_shows_runtime_id_pod_and_process_count() {
    let tree = CgroupTree::create("list").unwrap();
    let id = container_id();
    let cg = container_cgroup(&tree, &id);
    let mut sleeper = Command::new("/bin/sh")
        .args(["-c", "echo $$ > \"$1/cgroup.procs\" && exec sleep 30", "sleeper"])
        .arg(&cg)
        .spawn()
        .unwrap();
    // Wait until it moved itself in.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::fs::read_to_string(cg.join("cgroup.procs")).unwrap().trim().is_empty() {
        assert!(std::time::Instant::now() < deadline, "sleeper never entered its cgroup");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = tests::harness::command().unwrap().arg("list-containers").output().unwrap();
    let _ = (sleeper.kill(), sleeper.wait());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = text
        .lines()
        .find(|l| l.contains(&id[..12]))
        .unwrap_or_else(|| panic!("container {} not listed:\n{text}", &id[..12]));
    let cols: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(&cols[..5], ["containerd", &id[..12], POD_UID, "Guaranteed", "1"], "{line}");
    assert_eq!(cols[5], tree.cgroup_path(&cg));
}
