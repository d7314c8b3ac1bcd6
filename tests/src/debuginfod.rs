//! A real debuginfod server (Debian's `debuginfod` package) for tests: started on a free
//! loopback port over a directory of debug files it indexes (`-F`), stopped when dropped; and
//! a stripped fixture whose debug file only such a server has.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{fixtures, ports};

/// The Debian package `cargo xtask setup` installs.
pub const DEBIAN_PACKAGES: &[&str] = &["debuginfod"];
pub const BIN: &str = "/usr/bin/debuginfod";

pub struct Server {
    child: Child,
    dir: PathBuf,
    pub url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Server {
    /// Starts debuginfod serving the ELF files under `files`, and waits until it answers for
    /// `ready_id` (a build-id it should have; None: until it answers at all).
    pub fn start(name: &str, files: &Path, ready_id: Option<&str>) -> Result<Self> {
        if !Path::new(BIN).is_file() {
            bail!(
                "{BIN} is missing: run `cargo xtask setup` (it installs Debian's {})",
                DEBIAN_PACKAGES.join(" ")
            );
        }
        let dir =
            std::env::temp_dir().join(format!("rsprof-debuginfod-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        for attempt in 1..=ports::START_ATTEMPTS {
            let port = ports::free_port()?;
            let log = std::fs::File::create(dir.join("log"))?;
            let mut child = Command::new(BIN)
                .args(["-F", "-t", "0", "-g", "0", "-p", &port.to_string(), "-d"])
                .arg(dir.join("db.sqlite"))
                .arg(files)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .context("start debuginfod")?;
            let url = format!("http://127.0.0.1:{port}");
            let log = || std::fs::read_to_string(dir.join("log")).unwrap_or_default();
            let probe = match ready_id {
                Some(id) => format!("{url}/buildid/{id}/debuginfo"),
                None => format!("{url}/metrics"),
            };
            let end = Instant::now() + Duration::from_secs(60);
            loop {
                let status = ureq::get(&probe)
                    .config()
                    .http_status_as_error(false)
                    .build()
                    .call()
                    .map(|r| r.status().as_u16());
                if status.is_ok_and(|s| s == 200) {
                    return Ok(Self { child, dir, url });
                }
                if let Ok(Some(status)) = child.try_wait() {
                    if attempt < ports::START_ATTEMPTS && ports::in_use(&log()) {
                        eprintln!("debuginfod: port {port} taken, starting on another");
                        break;
                    }
                    bail!("debuginfod exited ({status}) at start:\n{}", log());
                }
                if Instant::now() > end {
                    let _ = child.kill();
                    let _ = child.wait();
                    bail!("debuginfod did not serve {probe} within 60 s:\n{}", log());
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        unreachable!("the last attempt returns")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// The `GET /buildid/…` requests the server logged.
    pub fn buildid_requests(&self) -> usize {
        self.log().lines().filter(|l| l.contains("GET /buildid/")).count()
    }
}

/// A C fixture built with `-g` and a build-id, then split as distributions ship it: `exe`
/// stripped of every symbol but `.dynsym` (`strip`), its DWARF and `.symtab` in `debug`
/// (`objcopy --only-keep-debug`), alone in `debug_dir`.
pub struct Stripped {
    pub source: PathBuf,
    pub exe: PathBuf,
    pub debug_dir: PathBuf,
    pub build_id: String,
}

/// Builds fixture `fixture` (a `tests/fixtures/*.c`) as `<dir>/<name>`, split (see `Stripped`).
pub fn stripped_fixture(fixture: &str, dir: &Path, name: &str) -> Result<Stripped> {
    let source = dir.join(format!("{name}.c"));
    std::fs::copy(fixtures::source_path(fixture)?, &source)?;
    let exe = dir.join(name);
    run(Command::new("gcc")
        .args(fixtures::C_FLAGS)
        .arg("-Wl,--build-id")
        .arg("-o")
        .arg(&exe)
        .arg(&source))?;
    let debug_dir = dir.join("debug");
    std::fs::create_dir_all(&debug_dir)?;
    let debug = debug_dir.join(format!("{name}.debug"));
    run(Command::new("objcopy").arg("--only-keep-debug").arg(&exe).arg(&debug))?;
    run(Command::new("strip").arg(&exe))?;
    let notes = run(Command::new("readelf").arg("-n").arg(&exe))?;
    let build_id = notes
        .lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: "))
        .context("no build-id in the fixture")?
        .to_owned();
    let symbols = run(Command::new("readelf").arg("-S").arg(&exe))?;
    if symbols.contains(".symtab") || symbols.contains(".debug_info") {
        bail!("{} still has a .symtab or DWARF after strip", exe.display());
    }
    Ok(Stripped { source, exe, debug_dir, build_id })
}

fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("run {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
