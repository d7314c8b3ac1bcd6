//! Fixture programs for the integration tests, compiled on demand from `tests/fixtures/`.
//!
//! * `*.c` are built with `gcc -O1 -g -fno-omit-frame-pointer -fno-inline
//!   -fno-optimize-sibling-calls -pthread`.
//! * `*.rs` are built with `rustc --edition 2024 -O -C force-frame-pointers=yes -g`.
//!
//! Binaries are cached in `<target dir>/fixtures/` (the target dir is `$CARGO_TARGET_DIR` or
//! `<workspace>/target`) and rebuilt only when the source is newer than the binary or the
//! compiler command line changed. A C fixture `NAME.c` becomes `fixtures/NAME`, a Rust fixture
//! `NAME.rs` becomes `fixtures/NAME_rs` (so `split.c` and `split.rs` can coexist and their
//! processes have distinct names).

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::SystemTime;

use anyhow::{Context as _, bail};

/// Flags for C fixtures (after the compiler name, before `-o`).
pub const C_FLAGS: &[&str] = &[
    "-O1",
    "-g",
    "-fno-omit-frame-pointer",
    "-fno-inline",
    "-fno-optimize-sibling-calls",
    "-pthread",
];

/// Flags for Rust fixtures (after `rustc`, before `-o`).
pub const RUST_FLAGS: &[&str] =
    &["--edition", "2024", "-O", "-C", "force-frame-pointers=yes", "-g"];

/// Serializes builds within this process; builds in other processes are made safe by writing
/// to a temporary file and renaming it into place.
static BUILD_LOCK: Mutex<()> = Mutex::new(());

/// The workspace root (parent of the `tests` crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests crate has a parent directory")
        .to_path_buf()
}

/// Directory holding the fixture sources.
pub fn source_dir() -> PathBuf {
    workspace_root().join("tests").join("fixtures")
}

/// Cargo's target directory: `$CARGO_TARGET_DIR` (relative to the workspace root when
/// relative) or `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => workspace_root().join(dir),
        None => workspace_root().join("target"),
    }
}

/// Where compiled fixtures are cached.
pub fn cache_dir() -> PathBuf {
    target_dir().join("fixtures")
}

/// Path of the source of fixture `name`: `name` may carry its extension (`split.rs`); without
/// one, `name.c` is preferred over `name.rs`.
pub fn source_path(name: &str) -> anyhow::Result<PathBuf> {
    let dir = source_dir();
    if name.ends_with(".c") || name.ends_with(".rs") {
        let path = dir.join(name);
        if !path.is_file() {
            bail!("fixture source {} does not exist", path.display());
        }
        return Ok(path);
    }
    for ext in ["c", "rs"] {
        let path = dir.join(format!("{name}.{ext}"));
        if path.is_file() {
            return Ok(path);
        }
    }
    bail!("no fixture named {name:?}: neither {name}.c nor {name}.rs exists in {}", dir.display())
}

/// Compiles fixture `name` (`split`, `split.c`, `split.rs`, `threads`, ...) if needed and
/// returns the path of the executable.
pub fn build(name: &str) -> anyhow::Result<PathBuf> {
    let src = source_path(name)?;
    let stem = src
        .file_stem()
        .and_then(|s| s.to_str())
        .context("fixture file name is not UTF-8")?
        .to_owned();
    let is_rust = src.extension().is_some_and(|e| e == "rs");
    let out_dir = cache_dir();
    let out = out_dir.join(if is_rust { format!("{stem}_rs") } else { stem });

    let (program, flags): (OsString, &[&str]) = if is_rust {
        (
            std::env::var_os("RUSTC").filter(|v| !v.is_empty()).unwrap_or_else(|| "rustc".into()),
            RUST_FLAGS,
        )
    } else {
        ("gcc".into(), C_FLAGS)
    };
    // C fixtures may use the rsprof provider header (include/rsprof.h).
    let include = format!("-I{}", workspace_root().join("include").display());
    let extra: Vec<&str> = if is_rust { vec![] } else { vec![include.as_str()] };
    // Recorded next to the binary so a change of flags triggers a rebuild.
    let recipe = format!(
        "{} {} {} {}",
        program.to_string_lossy(),
        flags.join(" "),
        extra.join(" "),
        src.display()
    );
    let recipe_path = out.with_extension("cmd");

    let _guard = BUILD_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if is_up_to_date(&src, &out, &recipe_path, &recipe) {
        return Ok(out);
    }

    fs::create_dir_all(&out_dir)
        .with_context(|| format!("creating fixture cache dir {}", out_dir.display()))?;
    let tmp = out.with_extension(format!("tmp.{}", std::process::id()));
    let output = Command::new(&program)
        .args(flags)
        .args(&extra)
        .arg("-o")
        .arg(&tmp)
        .arg(&src)
        .output()
        .with_context(|| format!("running {} (is it installed?)", program.to_string_lossy()))?;
    if !output.status.success() {
        let _ = fs::remove_file(&tmp);
        bail!(
            "building fixture {name} failed ({}): {recipe} -o {}\n{}{}",
            output.status,
            tmp.display(),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    fs::rename(&tmp, &out)
        .with_context(|| format!("moving {} to {}", tmp.display(), out.display()))?;
    fs::write(&recipe_path, &recipe)
        .with_context(|| format!("writing {}", recipe_path.display()))?;
    Ok(out)
}

/// Builds example `example` of workspace package `package` (release, frame pointers) in its
/// own target dir under the fixture cache, so it never waits on or invalidates the main
/// build; returns the executable. Cargo decides whether anything needs rebuilding.
pub fn build_example(package: &str, example: &str) -> anyhow::Result<PathBuf> {
    let target = cache_dir().join("cargo");
    let cargo =
        std::env::var_os("CARGO").filter(|v| !v.is_empty()).unwrap_or_else(|| "cargo".into());
    let _guard = BUILD_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let output = Command::new(&cargo)
        .current_dir(workspace_root())
        .env("RUSTFLAGS", "-C force-frame-pointers=yes")
        .args(["build", "--release", "-p", package, "--example", example, "--target-dir"])
        .arg(&target)
        .output()
        .with_context(|| format!("running {}", cargo.to_string_lossy()))?;
    if !output.status.success() {
        bail!(
            "building example {example} of {package} failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(target.join("release").join("examples").join(example))
}

fn mtime(path: &Path) -> Option<SystemTime> {
    fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn is_up_to_date(src: &Path, out: &Path, recipe_path: &Path, recipe: &str) -> bool {
    let (Some(_), Some(out_time)) = (mtime(src), mtime(out)) else { return false };
    // The source and the fixture sources it includes (`renamed.c` includes `split.c`; an
    // include found elsewhere, like `rsprof.h`, is not followed).
    let mut sources = vec![src.to_owned()];
    if let Ok(text) = fs::read_to_string(src) {
        let dir = src.parent().unwrap_or(Path::new("."));
        for line in text.lines() {
            let Some(rest) = line.trim_start().strip_prefix("#include \"") else { continue };
            if let Some((name, _)) = rest.split_once('"') {
                sources.push(dir.join(name));
            }
        }
    }
    let newer = |p: &PathBuf| mtime(p).is_some_and(|t| t > out_time);
    !sources.iter().any(newer) && fs::read_to_string(recipe_path).is_ok_and(|r| r == recipe)
}

/// The profiler binary under test: `$RSPROF_BIN`, else `<target dir>/release/rsprof-bpf`.
pub fn rsprof_bin() -> anyhow::Result<PathBuf> {
    if let Some(bin) = std::env::var_os("RSPROF_BIN").filter(|v| !v.is_empty()) {
        let bin = PathBuf::from(bin);
        if !bin.is_file() {
            bail!(
                "RSPROF_BIN={} does not exist; run `cargo xtask build` (or `cargo xtask test`)",
                bin.display()
            );
        }
        return Ok(bin);
    }
    let bin = target_dir().join("release").join("rsprof-bpf");
    if !bin.is_file() {
        bail!(
            "{} does not exist; run `cargo xtask build` first, or set RSPROF_BIN \
             (`cargo xtask test` does both)",
            bin.display()
        );
    }
    Ok(bin)
}

/// Effective uid of this process, from `/proc/self/status`.
fn effective_uid() -> anyhow::Result<u32> {
    let status = fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .context("no Uid line in /proc/self/status")?;
    let euid = line.split_whitespace().nth(1).context("malformed Uid line in /proc/self/status")?;
    euid.parse().with_context(|| format!("malformed effective uid {euid:?}"))
}

/// Fails (does not skip) unless running as root: the profiler loads BPF programs and opens
/// system-wide perf events.
pub fn require_root() -> anyhow::Result<()> {
    let euid = effective_uid()?;
    if euid != 0 {
        bail!(
            "this test must run as root (effective uid is {euid}): rsprof-bpf loads BPF programs \
             and opens system-wide perf events. Run the suite as root, e.g. `sudo -E cargo xtask test`"
        );
    }
    Ok(())
}

/// Builds Go fixture `NAME.go` (a single-file `main`, no modules: `GO111MODULE=off`) with
/// Debian's `go` and `-ldflags` `ldflags` (e.g. `-s -w`, stripped) as `fixtures/<out>`,
/// rebuilt when the source is newer or the flags changed.
pub fn build_go(name: &str, ldflags: &str, out: &str) -> anyhow::Result<PathBuf> {
    let src = source_dir().join(format!("{name}.go"));
    let out_dir = cache_dir();
    let out = out_dir.join(out);
    let recipe = format!("go build -ldflags={ldflags} {}", src.display());
    let recipe_path = out.with_extension("cmd");
    let _guard = BUILD_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if is_up_to_date(&src, &out, &recipe_path, &recipe) {
        return Ok(out);
    }
    fs::create_dir_all(&out_dir)?;
    let tmp = out.with_extension(format!("tmp.{}", std::process::id()));
    let output = Command::new("go")
        .env("GO111MODULE", "off")
        .env("GOCACHE", out_dir.join("gocache"))
        .env("GOFLAGS", "")
        .args(["build", "-ldflags", ldflags, "-o"])
        .arg(&tmp)
        .arg(&src)
        .output()
        .context("running go (Debian package golang-go: `cargo xtask setup` installs it)")?;
    if !output.status.success() {
        let _ = fs::remove_file(&tmp);
        bail!(
            "building Go fixture {name} failed ({}): {recipe}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    fs::rename(&tmp, &out)?;
    fs::write(&recipe_path, &recipe)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn run_ok(name: &str, args: &[&str]) -> Duration {
        let bin = build(name).unwrap();
        let start = Instant::now();
        let status = Command::new(&bin)
            .args(args)
            .status()
            .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
        let elapsed = start.elapsed();
        assert!(status.success(), "{} {args:?}: {status}", bin.display());
        elapsed
    }

    #[test]
    fn split_c_runs() {
        let t = run_ok("split", &["0.2"]);
        assert!(t >= Duration::from_millis(200), "{t:?}");
        assert!(build("split").unwrap().ends_with("fixtures/split"));
        assert_eq!(build("split").unwrap(), build("split.c").unwrap());
    }

    #[test]
    fn split_rs_runs() {
        let t = run_ok("split.rs", &["0.2"]);
        assert!(t >= Duration::from_millis(200), "{t:?}");
        assert!(build("split.rs").unwrap().ends_with("fixtures/split_rs"));
    }

    #[test]
    fn syscalls_runs() {
        run_ok("syscalls", &["0.2"]);
    }

    #[test]
    fn threads_runs_and_renames() {
        let bin = build("threads").unwrap();
        let mut child = Command::new(&bin).arg("2.0").spawn().unwrap();
        let task_names = |pid: u32| -> Vec<String> {
            let mut names: Vec<String> = fs::read_dir(format!("/proc/{pid}/task"))
                .map(|dir| {
                    dir.filter_map(|t| fs::read_to_string(t.ok()?.path().join("comm")).ok())
                        .map(|c| c.trim_end().to_owned())
                        .collect()
                })
                .unwrap_or_default();
            names.sort();
            names
        };
        // Poll rather than sleep to fixed points, so a loaded machine cannot make us miss
        // the phases: first the three workers, then worker-b renamed (at 1 s).
        let (mut saw_initial, mut saw_renamed) = (false, false);
        let deadline = Instant::now() + Duration::from_secs(30);
        while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
            let names = task_names(child.id());
            if names == ["threads", "worker-a", "worker-b", "worker-c"] {
                saw_initial = true;
            } else if saw_initial && names == ["renamed-b", "threads", "worker-a", "worker-c"] {
                saw_renamed = true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let status = child.wait().unwrap();
        assert!(status.success(), "{status}");
        assert!(saw_initial, "never saw threads worker-a, worker-b, worker-c");
        assert!(saw_renamed, "never saw worker-b renamed to renamed-b");
    }

    #[test]
    fn shortlived_runs() {
        let t = run_ok("shortlived", &["200"]);
        assert!(t >= Duration::from_millis(200), "{t:?}");
    }

    #[test]
    fn bench_work_runs() {
        let bin = build("bench_work").unwrap();
        let out = Command::new(&bin).args(["100000", "2"]).output().unwrap();
        assert!(out.status.success(), "{}", out.status);
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim().len(), 16);
    }

    #[test]
    fn build_is_cached() {
        let first = build("shortlived").unwrap();
        let before = mtime(&first).unwrap();
        let second = build("shortlived").unwrap();
        assert_eq!(first, second);
        assert_eq!(before, mtime(&second).unwrap());
    }

    #[test]
    fn unknown_fixture_is_an_error() {
        assert!(build("no-such-fixture").is_err());
    }
}
