//! Mappings from the kernel: processes too short-lived for /proc to describe them still get
//! named stacks, because their executable, interpreter and libraries are recorded by the BPF
//! programs as they are mapped. Real recordings (`--all`), assertions about the fixtures' own
//! processes.

use std::{
    collections::{HashMap, HashSet},
    process::{Command, Stdio},
    time::Duration,
};

use serde_json::Value;
use tests::{
    fixtures,
    gecko_schema::validate,
    harness::{Recording, output_path, spawn_fresh},
    profile_query::{ThreadInfo, contains_path, markers, module_name, sample_stacks, threads},
    wait,
};

/// Records `--all` while `workload` runs; returns the validated profile and rsprof's stderr.
fn record_all<T>(test: &str, workload: impl FnOnce() -> T) -> (Value, T, String) {
    let rec = Recording::start(&["--all"], output_path(test, "json")).expect("start recording");
    let out = workload();
    let done = rec.interrupt().expect("stop recording");
    let profile = done.profile().expect("profile written");
    if let Err(problems) = validate(&profile) {
        panic!("profile breaks the Gecko v36 rules:\n{}", problems.join("\n"));
    }
    (profile, out, done.stderr)
}

/// A frame in no known mapping (a frame in a mapped file without symbols, like ld.so, shows
/// as an address in that file).
fn unmapped(frame: &str) -> bool {
    module_name(frame).is_none_or(|m| m == "[unknown]")
}

/// `--all` summary: "unmapped user frames N".
fn summary_unmapped(stderr: &str) -> u64 {
    let tail = stderr.split("unmapped user frames ").nth(1).expect("summary line");
    tail.split_whitespace().next().unwrap().parse().unwrap()
}

fn summary_lost_samples(stderr: &str) -> u64 {
    let line = stderr.lines().find(|l| l.contains("lost")).unwrap_or("");
    line.split("lost ").nth(1).and_then(|t| t.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.stderr(Stdio::inherit()).output().expect("run fixture");
    assert!(out.status.success(), "{cmd:?} failed: {}", out.status);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn maptrack_exec_storm_processes_have_named_stacks() {
    let burner = fixtures::build("mapburn").unwrap();
    let storm = fixtures::build("execstorm").unwrap();
    let (profile, out, stderr) = record_all("exec_storm", || {
        run(Command::new(&storm).args([burner.to_str().unwrap(), "5", "20", "10"]))
    });
    let burners: u64 = out.lines().find_map(|l| l.strip_prefix("burners ")?.parse().ok()).unwrap();
    let trues: u64 = out.lines().find_map(|l| l.strip_prefix("trues ")?.parse().ok()).unwrap();
    let ts: Vec<ThreadInfo> =
        threads(&profile).into_iter().filter(|t| t.process_name == "mapburn").collect();
    let pids: HashSet<u64> = ts.iter().map(|t| t.pid).collect();
    let stacks: Vec<Vec<String>> = ts.iter().flat_map(|t| sample_stacks(t.thread)).collect();
    // Samples of the burners' own code: they have a frame in the mapburn executable. Before
    // main (exec, ld.so) and at exit a sample may have none.
    let in_code = |st: &Vec<String>| st.iter().any(|f| module_name(f) == Some("mapburn"));
    let own: Vec<&Vec<String>> = stacks.iter().filter(|st| in_code(st)).collect();
    let named = own.iter().filter(|st| contains_path(st, &["main", "storm_hot"])).count();
    // A leaf (the sampled instruction) outside every known mapping is a mapping we missed;
    // unmapped callers are mostly frame-pointer garbage under ld.so (built without frame
    // pointers), which no mapping table can name.
    let leaf_unmapped = |st: &Vec<String>| {
        st.iter()
            .rev()
            .find(|f| module_name(f) != Some("[kernel.kallsyms]"))
            .is_some_and(|f| unmapped(f))
    };
    let missed: Vec<&Vec<String>> = stacks.iter().filter(|st| leaf_unmapped(st)).collect();
    let with_unmapped = stacks.iter().filter(|st| st.iter().any(|f| unmapped(f))).count();
    eprintln!(
        "{burners} burners ({} in the profile), {trues} /bin/true runs; {} samples, {} in \
         mapburn code, {named} named main → storm_hot; {} with an unmapped leaf, {with_unmapped} \
         with any unmapped frame",
        pids.len(),
        stacks.len(),
        own.len(),
        missed.len()
    );
    assert!(burners >= 100 && pids.len() as f64 >= 0.5 * burners as f64, "{burners} burners");
    // 10 ms of CPU each: most of their samples are in storm_hot, and all of those are named.
    // The rest is exec, ld.so and exit, which took up to 11% of the samples on a loaded
    // 2-CPU machine.
    let walks: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("user stacks:") || l.contains("stack copies:"))
        .collect();
    assert!(own.len() as f64 >= 0.85 * stacks.len() as f64, "{} of {}", own.len(), stacks.len());
    if (named as f64) < 0.99 * own.len() as f64 {
        let others = own.iter().filter(|st| !contains_path(st, &["main", "storm_hot"]));
        let others = most_common(others.map(|st| &st[..st.len().min(4)]), 5);
        panic!("{named} of {} named; most common others:\n{others}\n{walks:?}", own.len());
    }
    // A sample taken during exec after the new image's entry was set but before the exec
    // record is the one way to miss: rare.
    assert!(
        (missed.len() as f64) < 0.01 * stacks.len() as f64,
        "{} of {} burner samples have an unmapped leaf, e.g. {:#?}",
        missed.len(),
        stacks.len(),
        &missed[..missed.len().min(8)]
    );
    assert_eq!(summary_lost_samples(&stderr), 0, "{stderr}");
    // The summary's count covers every process on the machine (other users' code without
    // frame pointers yields garbage callers), so it is only shown; the assertions above are
    // about our processes.
    eprintln!("summary: {} unmapped user frames in the whole recording", summary_unmapped(&stderr));
    assert!(stderr.contains("/proc/PID/maps read"), "{stderr}");
}

#[test]
fn maptrack_process_living_5ms_is_named_with_frames() {
    let exe = fixtures::build("mapburn").unwrap();
    let mut pids = Vec::new();
    // A distinctive argument, and one with a space, to find in the profile's command lines.
    let tag = format!("--tag=argv-{}", std::process::id());
    let (profile, _, _) = record_all("five_ms", || {
        // Several, so that some are sampled (5 ms at 999 Hz is ~5 samples).
        for _ in 0..20 {
            let mut c = Command::new(&exe).args(["5", &tag, "two words"]).spawn().unwrap();
            pids.push(u64::from(c.id()));
            assert!(c.wait().unwrap().success());
        }
    });
    let ts: Vec<ThreadInfo> =
        threads(&profile).into_iter().filter(|t| pids.contains(&t.pid)).collect();
    assert!(ts.len() >= 15, "{} of 20 five-ms processes in the profile", ts.len());
    // The kernel walks the real path (no symlinks), as /proc/PID/exe shows it.
    let real_exe = std::fs::canonicalize(&exe).unwrap();
    let want_argv = format!("{} 5 {tag} 'two words'", exe.display());
    for t in &ts {
        assert_eq!(t.process_name, "mapburn");
        assert!(t.thread["unregisterTime"].is_number(), "exit time of {}", t.pid);
        // Exe and argv, read by the kernel at exec: /proc is gone before a 5 ms process is
        // first looked at.
        let ms = markers(t.thread);
        let Some(m) = ms.iter().find(|m| m.name == "Process") else {
            panic!(
                "no Process marker on {}: {:?}",
                t.pid,
                ms.iter().map(|m| m.name).collect::<Vec<_>>()
            )
        };
        assert_eq!(m.data["argv"], want_argv.as_str(), "argv of {}", t.pid);
        assert_eq!(m.data["exe"], real_exe.to_str().unwrap(), "exe of {}", t.pid);
        assert_eq!(m.data["pid"], t.pid);
        assert_eq!(m.end, t.thread["unregisterTime"].as_f64(), "spans the life of {}", t.pid);
    }
    let stacks: Vec<Vec<String>> = ts.iter().flat_map(|t| sample_stacks(t.thread)).collect();
    // Where each sample ran is named: its innermost user frame is in a known mapping (an
    // address in none shows as `0x… (in [unknown])`), start-up and exit included. Callers
    // above frame-pointer-less code (ld.so) can be garbage: that is the unwinder's issue.
    let leaf_unnamed: Vec<_> = stacks
        .iter()
        .filter(|st| {
            let user_leaf = st.iter().rev().find(|f| !f.contains("(in [kernel.kallsyms])"));
            user_leaf.is_some_and(|f| f.contains("(in [unknown])"))
        })
        .collect();
    assert!(
        (leaf_unnamed.len() as f64) <= 0.05 * stacks.len() as f64,
        "{} of {} samples ran in no known mapping, e.g. {:?}",
        leaf_unnamed.len(),
        stacks.len(),
        &leaf_unnamed[..leaf_unnamed.len().min(4)]
    );
    let burning = stacks.iter().filter(|st| contains_path(st, &["main", "storm_hot"])).count();
    assert!(
        burning as f64 >= 0.6 * stacks.len() as f64,
        "{burning} of {} in the burn",
        stacks.len()
    );
}

#[test]
fn maptrack_library_replaced_at_the_same_address_is_named_before_and_after() {
    let dir = output_path("remap", "d");
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixtures::source_dir().join("maplib.c.in");
    let lib = |name: &str| {
        let path = dir.join(format!("libmap{name}.so"));
        let st = Command::new("gcc")
            .args(["-O1", "-g", "-fno-omit-frame-pointer", "-shared", "-fPIC"])
            .arg(format!("-DLIB={name}"))
            .args(["-x", "c", "-o"])
            .arg(&path)
            .arg(&src)
            .status()
            .unwrap();
        assert!(st.success(), "building {}", path.display());
        path
    };
    let (a, b) = (lib("a"), lib("b"));
    let exe = fixtures::build("remap").unwrap();
    let mut pid = 0;
    let (profile, out, _) = record_all("remap", || {
        let child = Command::new(&exe)
            .args([a.to_str().unwrap(), b.to_str().unwrap(), "700"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        pid = u64::from(child.id());
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    });
    let base = |k: &str| out.lines().find_map(|l| l.strip_prefix(k)).unwrap().to_owned();
    assert_eq!(base("a "), base("b "), "libmapb.so did not land where libmapa.so was");
    let t = threads(&profile).into_iter().find(|t| t.pid == pid).expect("remap thread");
    let stacks = sample_stacks(t.thread);
    let in_lib = |st: &Vec<String>, f: &str, m: &str| {
        st.iter().any(|x| x.starts_with(f) && module_name(x) == Some(m))
    };
    let sa = stacks.iter().filter(|s| in_lib(s, "hot_in_a", "libmapa.so")).count();
    let sb = stacks.iter().filter(|s| in_lib(s, "hot_in_b", "libmapb.so")).count();
    let wrong = stacks
        .iter()
        .filter(|s| {
            s.iter().any(|x| {
                (x.starts_with("hot_in_a") && module_name(x) != Some("libmapa.so"))
                    || (x.starts_with("hot_in_b") && module_name(x) != Some("libmapb.so"))
            })
        })
        .count();
    assert!(sa >= 100 && sb >= 100, "hot_in_a {sa}, hot_in_b {sb} of {}", stacks.len());
    assert_eq!(wrong, 0);
    // In time order: all of a's samples before b's.
    let last_a = stacks.iter().rposition(|s| in_lib(s, "hot_in_a", "libmapa.so")).unwrap();
    let first_b = stacks.iter().position(|s| in_lib(s, "hot_in_b", "libmapb.so")).unwrap();
    assert!(last_a < first_b);
}

#[test]
fn maptrack_deleted_executable_is_still_named() {
    let exe = fixtures::build("mapburn").unwrap();
    let copy = output_path("deleted", "mapburn");
    std::fs::copy(&exe, &copy).unwrap();
    let mut pid = 0;
    let (profile, _, stderr) = record_all("deleted", || {
        // 1 s, so its first milliseconds (before its table lands, while the start-up tables
        // of the whole host are compiled) are a small share of its samples.
        let mut c = spawn_fresh(Command::new(&copy).arg("1000"));
        pid = u64::from(c.id());
        // Gone from the file system while it runs, mostly after the profiler queued its table
        // (from the path) and before the table was compiled, which must then read the
        // mapped file (the unit test `job_reads_the_mapped_file_after_its_path_is_gone`
        // covers that order exactly): it has run (and been sampled) for 50 ms of CPU.
        let cpu = Duration::from_millis(50);
        wait::until_cpu_time(c.id(), Duration::ZERO, cpu, Duration::from_secs(10)).unwrap();
        std::fs::remove_file(&copy).unwrap();
        assert!(c.wait().unwrap().success());
    });
    let t = threads(&profile).into_iter().find(|t| t.pid == pid).expect("deleted exe's thread");
    let stacks = sample_stacks(t.thread);
    // Named down from `_start` and not flagged truncated: walked with the file's table (a
    // table missing for want of the file would end in frame pointers or a copy, flagged).
    let complete = stacks
        .iter()
        .filter(|st| {
            contains_path(st, &["_start", "__libc_start_main_impl"])
                && contains_path(st, &["main", "storm_hot"])
                && !st.iter().any(|f| f.starts_with("[truncated"))
        })
        .count();
    assert!(
        complete >= 500 && complete as f64 >= 0.9 * stacks.len() as f64,
        "{complete} of {} complete _start -> main -> storm_hot; its most common stacks:\n{}\n\
         summary:\n{stderr}",
        stacks.len(),
        most_common(stacks.iter().map(Vec::as_slice), 5)
    );
}

/// The `n` most frequent stacks, one per line with their counts: what a failure shows.
fn most_common<'s>(stacks: impl Iterator<Item = &'s [String]>, n: usize) -> String {
    let mut counts = HashMap::<&[String], usize>::new();
    for st in stacks {
        *counts.entry(st).or_default() += 1;
    }
    let mut v: Vec<_> = counts.into_iter().collect();
    v.sort_by_key(|(_, c)| std::cmp::Reverse(*c));
    let lines: Vec<String> =
        v.iter().take(n).map(|(st, c)| format!("{c:6}  {}", st.join(" <- "))).collect();
    lines.join("\n")
}

#[test]
fn maptrack_executable_on_a_filesystem_unmounted_while_it_runs_is_named() {
    let exe = fixtures::build("mapburn").unwrap();
    let dir = output_path("unmounted", "mnt");
    std::fs::create_dir_all(&dir).unwrap();
    let mount = Command::new("mount").args(["-t", "tmpfs", "rsprof-test"]).arg(&dir).status();
    assert!(mount.is_ok_and(|s| s.success()), "mounting a tmpfs at {} (needs root)", dir.display());
    let copy = dir.join("mapburn");
    std::fs::copy(&exe, &copy).unwrap();
    let mut pid = 0;
    let (profile, _, stderr) = record_all("unmounted", || {
        let mut c = spawn_fresh(Command::new(&copy).arg("400"));
        pid = u64::from(c.id());
        let cpu = Duration::from_millis(50);
        wait::until_cpu_time(c.id(), Duration::ZERO, cpu, Duration::from_secs(10)).unwrap();
        // Lazily: the running process keeps the file system alive, but no path reaches it.
        let st = Command::new("umount").arg("-l").arg(&dir).status().unwrap();
        assert!(st.success(), "umount -l {}", dir.display());
        assert!(c.wait().unwrap().success());
    });
    let t = threads(&profile).into_iter().find(|t| t.pid == pid).expect("the fixture's thread");
    let stacks = sample_stacks(t.thread);
    let named = |st: &&Vec<String>| contains_path(st, &["storm_hot"]);
    let through_main = |st: &&Vec<String>| contains_path(st, &["main", "storm_hot"]);
    // A sample taken before the walker had the fresh file's table, and not continued over a
    // stack copy (the copy budget is spent fast while a cold start compiles tables), stops
    // flagged at storm_hot; the file's symbols still name it.
    let flagged = |st: &&Vec<String>| st.first().is_some_and(|f| f.starts_with("[truncated: "));
    let (n_named, n_main) =
        (stacks.iter().filter(named).count(), stacks.iter().filter(through_main).count());
    let misplaced: Vec<_> =
        stacks.iter().filter(|st| named(st) && !through_main(st) && !flagged(st)).collect();
    assert!(
        n_named as f64 >= 0.9 * stacks.len() as f64 && n_main >= 200 && misplaced.is_empty(),
        "{n_named} of {} named storm_hot, {n_main} under main, {} neither under main nor \
         flagged; its most common stacks:\n{}\nsummary:\n{stderr}",
        stacks.len(),
        misplaced.len(),
        most_common(stacks.iter().map(Vec::as_slice), 5)
    );
}

/// Builds `codemap_hot.c.in` as a shared object in `dir`; returns it with `codemap_hot`'s
/// link-time address and size (from `nm`).
fn codemap_lib(dir: &std::path::Path) -> (std::path::PathBuf, u64, u64) {
    std::fs::create_dir_all(dir).unwrap();
    let lib = dir.join("libcodemap.so");
    let st = Command::new("gcc")
        .args(["-O1", "-g", "-fno-omit-frame-pointer", "-shared", "-fPIC", "-x", "c", "-o"])
        .arg(&lib)
        .arg(fixtures::source_dir().join("codemap_hot.c.in"))
        .status()
        .unwrap();
    assert!(st.success(), "building {}", lib.display());
    let nm = run(Command::new("nm").args(["-S", "--defined-only"]).arg(&lib));
    let line = nm.lines().find(|l| l.ends_with(" codemap_hot")).expect("codemap_hot in nm");
    let f: Vec<u64> =
        line.split_whitespace().take(2).map(|x| u64::from_str_radix(x, 16).unwrap()).collect();
    (lib, f[0], f[1])
}

/// Code made executable by mprotect (a file mapped PROT_READ, anonymous memory written then
/// made RX as a JIT does) and moved by mremap is named from what is there now; the range a
/// mapping moved away from no longer names its file.
#[test]
fn maptrack_mprotect_and_mremap_of_code_are_followed() {
    let (lib, vaddr, size) = codemap_lib(&output_path("codemap", "d"));
    let exe = fixtures::build("codemap").unwrap();
    let mut pid = 0;
    let (profile, out, stderr) = record_all("codemap", || {
        let child = Command::new(&exe)
            .arg(&lib)
            .args([format!("{vaddr:#x}"), size.to_string(), "400".into()])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        pid = u64::from(child.id());
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "codemap failed");
        String::from_utf8_lossy(&out.stdout).into_owned()
    });
    assert!(!stderr.contains("mprotect/mremap of code is not tracked"), "{stderr}");
    let addr = |k: &str| out.lines().find_map(|l| l.strip_prefix(k)).unwrap().to_owned();
    assert_ne!(addr("old "), addr("new "), "mremap did not move the mapping");
    let t = threads(&profile).into_iter().find(|t| t.pid == pid).expect("codemap thread");
    let stacks = sample_stacks(t.thread);
    // Stacks are root first; the leaf is the innermost user frame.
    let leaf = |st: &Vec<String>| {
        st.iter().rev().find(|f| module_name(f) != Some("[kernel.kallsyms]")).cloned()
    };
    let phase = |name: &str| -> Vec<&Vec<String>> {
        stacks.iter().filter(|st| st.iter().any(|f| f.starts_with(name))).collect()
    };
    let hot_in_lib =
        |f: &String| f.starts_with("codemap_hot") && module_name(f) == Some("libcodemap.so");
    let report = |name: &str, ok: usize, all: &[&Vec<String>]| {
        eprintln!("{name}: {ok} of {} samples as expected, e.g. {:?}", all.len(), all.first());
    };
    for name in ["phase_mprotect", "phase_moved"] {
        let all = phase(name);
        let named = all.iter().filter(|st| leaf(st).is_some_and(|f| hot_in_lib(&f))).count();
        report(name, named, &all);
        // ~400 samples at the default rate, nearly all in codemap_hot (the rest in the clock
        // read between calls).
        assert!(all.len() >= 100, "{name}: {} samples", all.len());
        assert!(named as f64 >= 0.9 * all.len() as f64, "{name}: {named} of {}", all.len());
    }
    let jit = phase("phase_jit");
    let anon =
        jit.iter().filter(|st| leaf(st).is_some_and(|f| module_name(&f) == Some("[anon]"))).count();
    report("phase_jit", anon, &jit);
    assert!(jit.len() >= 100, "phase_jit: {} samples", jit.len());
    assert!(anon as f64 >= 0.9 * jit.len() as f64, "phase_jit: {anon} of {} in [anon]", jit.len());
    // The copy at the old address is where libcodemap.so's codemap_hot was, byte for byte: a
    // stale mapping would name it so.
    let stale = phase("phase_stale");
    let wrong = stale.iter().filter(|st| st.iter().any(hot_in_lib)).count();
    report("phase_stale (named from the old mapping)", wrong, &stale);
    assert!(stale.len() >= 100, "phase_stale: {} samples", stale.len());
    assert_eq!(wrong, 0, "frames at the range mremap moved away from named from the old file");
}
