//! `cargo xtask setup`: installs what is missing, says what was already there.

use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, bail};

use crate::{is_root, run_cmd, step};

/// bpf-linker version the BPF crate is built with.
pub const BPF_LINKER_VERSION: &str = "0.10.4";

/// Debian packages: gcc builds the test fixtures, linux-perf is the benchmark's reference
/// profiler, systemtap-sdt-dev provides <sys/sdt.h> for USDT fixtures. `setup` (for the tests)
/// adds those Go's pprof is built from (`tests::go_pprof::DEBIAN_PACKAGES`) and the ClickHouse
/// server the ClickHouse sink's tests start (`tests::clickhouse::DEBIAN_PACKAGES`) and the
/// PostgreSQL the unwinder's pre-fork test profiles (`tests::postgres::DEBIAN_PACKAGES`).
pub const DEBIAN_PACKAGES: &[&str] = &["gcc", "linux-perf", "systemtap-sdt-dev"];

/// `cargo xtask setup`: every check on its own line.
pub fn setup() -> anyhow::Result<()> {
    step("setup: toolchains, bpf-linker, system packages, profiler-cli, Go's pprof, py-spy");
    let mut present = Vec::new();
    // The tests also need the packages Go's pprof is built from, ClickHouse, protoc (decodes
    // the agent's Pyroscope pushes independently of its own structs), Prometheus (scrapes the
    // agent in the dashboards test), systemd-analyze and setpriv (check the service unit);
    // `build` and `run` (`ensure`) do not install them.
    let extra: Vec<&str> = [
        tests::go_pprof::DEBIAN_PACKAGES,
        tests::clickhouse::DEBIAN_PACKAGES,
        &["protobuf-compiler"],
        tests::prometheus::DEBIAN_PACKAGES,
        tests::agent::DEBIAN_PACKAGES,
        tests::postgres::DEBIAN_PACKAGES,
        // The debuginfod server the symbolizer's debuginfod tests start.
        tests::debuginfod::DEBIAN_PACKAGES,
        // The JIT tests' Java (tests/tests/jit.rs: java, javac, jcmd of OpenJDK 17).
        &["openjdk-17-jdk-headless"],
        // `cargo xtask bench-unwind`'s Python workload.
        &["python3.11-minimal"],
    ]
    .concat();
    install_missing(&mut present, &extra)?;
    for what in &present {
        println!("{what}: already installed");
    }
    profiler_cli()?;
    go_pprof()?;
    py_spy()?;
    environment_checks();
    println!("setup: done");
    Ok(())
}

/// Setup before `build` and `run`: one line when everything is already installed (the checks
/// take a few tens of milliseconds), the full story only when something is installed.
pub fn ensure() -> anyhow::Result<()> {
    let mut present = Vec::new();
    install_missing(&mut present, &[])?;
    if !present.is_empty() {
        println!("setup: already installed: {}", present.join(", "));
    }
    if !Path::new(VMLINUX_BTF).exists() {
        println!("{NO_BTF}");
    }
    Ok(())
}

/// Installs what is missing; names what was already there in `present`.
fn install_missing(present: &mut Vec<String>, extra_packages: &[&str]) -> anyhow::Result<()> {
    rust_nightly(present)?;
    bpf_linker(present)?;
    debian_packages(present, extra_packages)
}

/// Output of a command, or None when it could not be started or failed.
fn stdout_of(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn host_triple() -> Option<String> {
    let out = stdout_of(Command::new("rustc").arg("-vV"))?;
    out.lines().find_map(|l| l.strip_prefix("host: ")).map(|h| h.trim().to_owned())
}

fn rust_nightly(present: &mut Vec<String>) -> anyhow::Result<()> {
    let Some(toolchains) = stdout_of(Command::new("rustup").args(["toolchain", "list"])) else {
        bail!(
            "`rustup` was not found (or failed). The BPF crate needs a nightly toolchain managed \
             by rustup: install rustup from https://rustup.rs, e.g.\n  \
             curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y\n  \
             . \"$HOME/.cargo/env\"\nthen run `cargo xtask setup` again"
        );
    };
    let nightly = match host_triple() {
        Some(host) => format!("nightly-{host}"),
        None => "nightly-".to_owned(),
    };
    let installed = toolchains.lines().any(|l| {
        let name = l.split_whitespace().next().unwrap_or("");
        name == "nightly" || name.starts_with(&nightly)
    });
    if !installed {
        println!("nightly toolchain: missing, installing (with rust-src)");
        run_cmd(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
            "--component",
            "rust-src",
        ]))?;
    } else {
        present.push("nightly toolchain".to_owned());
    }

    let components = stdout_of(Command::new("rustup").args([
        "component",
        "list",
        "--toolchain",
        "nightly",
        "--installed",
    ]))
    .context("`rustup component list --toolchain nightly --installed` failed")?;
    if components.lines().any(|l| l.trim() == "rust-src" || l.trim().starts_with("rust-src-")) {
        present.push("rust-src (nightly)".to_owned());
    } else {
        println!("rust-src (nightly): missing, installing");
        run_cmd(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))?;
    }
    Ok(())
}

/// The version printed by `bpf-linker --version` ("bpf-linker 0.10.4"), if it runs.
fn bpf_linker_version() -> Option<String> {
    let out = stdout_of(Command::new("bpf-linker").arg("--version"))?;
    out.split_whitespace().nth(1).map(str::to_owned)
}

fn bpf_linker(present: &mut Vec<String>) -> anyhow::Result<()> {
    match bpf_linker_version() {
        Some(v) if v == BPF_LINKER_VERSION => {
            present.push(format!("bpf-linker {v}"));
            return Ok(());
        }
        Some(v) => println!("bpf-linker: found {v}, need {BPF_LINKER_VERSION}; installing"),
        None => println!("bpf-linker: missing, installing {BPF_LINKER_VERSION}"),
    }
    run_cmd(Command::new("cargo").args([
        "install",
        &format!("bpf-linker@{BPF_LINKER_VERSION}"),
        "--locked",
        "--force",
    ]))?;
    match bpf_linker_version() {
        Some(v) if v == BPF_LINKER_VERSION => {
            println!("bpf-linker {v}: installed");
            Ok(())
        }
        other => bail!(
            "bpf-linker was installed but `bpf-linker --version` reports {other:?}; is \
             ~/.cargo/bin on PATH (`. \"$HOME/.cargo/env\"`)?"
        ),
    }
}

/// samply version `cargo xtask bench-unwind` compares with (installed by it when missing: a
/// build of tens of minutes, which `setup`, run by every `cargo xtask test`, must not pay).
pub const SAMPLY_VERSION: &str = "0.13.1";

/// Where `cargo install` puts samply: `$CARGO_HOME/bin` or `~/.cargo/bin`.
fn samply_path() -> std::path::PathBuf {
    let home = std::env::var_os("CARGO_HOME")
        .filter(|h| !h.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")))
        .unwrap_or_else(|| "/root/.cargo".into());
    home.join("bin").join("samply")
}

/// The installed samply's version (`samply --version` prints "samply 0.13.1").
fn samply_version(path: &Path) -> Option<String> {
    stdout_of(Command::new(path).arg("--version"))
        .and_then(|v| v.split_whitespace().nth(1).map(str::to_owned))
}

/// samply's path if the pinned version is installed, else why not.
pub fn samply_installed() -> anyhow::Result<std::path::PathBuf> {
    let path = samply_path();
    match samply_version(&path) {
        Some(v) if v == SAMPLY_VERSION => Ok(path),
        Some(v) => bail!("{} is {v}, not {SAMPLY_VERSION} (`cargo xtask setup`)", path.display()),
        None => bail!("{} is not installed (`cargo xtask setup` installs it)", path.display()),
    }
}

/// samply (`cargo install samply --locked`, pinned), installed when missing; its path.
pub fn samply() -> anyhow::Result<std::path::PathBuf> {
    let path = samply_path();
    let version = || samply_version(&path);
    match version() {
        Some(v) if v == SAMPLY_VERSION => {
            println!("samply {v}: already installed");
            return Ok(path);
        }
        Some(v) => println!("samply: found {v}, need {SAMPLY_VERSION}; installing"),
        None => println!("samply: missing, installing {SAMPLY_VERSION}"),
    }
    run_cmd(Command::new("cargo").args([
        "install",
        &format!("samply@{SAMPLY_VERSION}"),
        "--locked",
        "--force",
    ]))?;
    match version() {
        Some(v) if v == SAMPLY_VERSION => Ok(path),
        other => bail!("samply was installed but {} --version reports {other:?}", path.display()),
    }
}

/// py-spy version `cargo xtask bench-python` compares with (a PyPI wheel holding a static
/// binary).
pub const PY_SPY_VERSION: &str = "0.4.3";

/// Where `setup` installs py-spy: `pip install --target <target dir>/py-spy`, its binary in
/// `bin/` (project-local: no system or user site-packages touched).
fn py_spy_dir() -> std::path::PathBuf {
    crate::target_dir().join("py-spy")
}

/// The installed py-spy's version (`py-spy --version` prints "py-spy 0.4.3").
fn py_spy_version(path: &Path) -> Option<String> {
    stdout_of(Command::new(path).arg("--version"))
        .and_then(|v| v.split_whitespace().nth(1).map(str::to_owned))
}

/// py-spy's path if the pinned version is installed, else why not.
pub fn py_spy_installed() -> anyhow::Result<std::path::PathBuf> {
    let path = py_spy_dir().join("bin").join("py-spy");
    match py_spy_version(&path) {
        Some(v) if v == PY_SPY_VERSION => Ok(path),
        Some(v) => bail!(
            "{} is py-spy {v}, not {PY_SPY_VERSION}: run `cargo xtask setup` to install it",
            path.display()
        ),
        None => bail!(
            "py-spy is not installed at {}: run `cargo xtask setup` (it installs py-spy \
             {PY_SPY_VERSION} with pip)",
            path.display()
        ),
    }
}

/// A Python whose pip runs: the one on PATH (pyenv's here), else Debian's, with python3-pip
/// installed when it has none.
fn python_with_pip() -> anyhow::Result<&'static str> {
    let has_pip = |py: &str| stdout_of(Command::new(py).args(["-m", "pip", "--version"])).is_some();
    for py in ["python3", "/usr/bin/python3"] {
        if has_pip(py) {
            return Ok(py);
        }
    }
    println!("pip: missing, installing the Debian package python3-pip");
    apt_install(&["python3-pip"])?;
    anyhow::ensure!(has_pip("/usr/bin/python3"), "python3-pip installed but pip does not run");
    Ok("/usr/bin/python3")
}

/// py-spy (the benchmark's peer for Python profiles), pinned, installed with pip into
/// `<target dir>/py-spy` when missing. `--target` keeps it out of every site-packages (and
/// so out of PEP 668's way on Debian's Python).
fn py_spy() -> anyhow::Result<()> {
    let dir = py_spy_dir();
    let path = dir.join("bin").join("py-spy");
    match py_spy_version(&path) {
        Some(v) if v == PY_SPY_VERSION => {
            println!("py-spy {v}: already installed at {}", path.display());
            return Ok(());
        }
        Some(v) => println!("py-spy: found {v}, need {PY_SPY_VERSION}; installing"),
        None => println!("py-spy: missing, installing {PY_SPY_VERSION} into {}", dir.display()),
    }
    let python = python_with_pip()?;
    // A fresh directory: pip --target does not replace an older version's files.
    let _ = std::fs::remove_dir_all(&dir);
    run_cmd(
        Command::new(python)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
            .arg("--root-user-action=ignore")
            .args(["--no-deps", "--target"])
            .arg(&dir)
            .arg(format!("py-spy=={PY_SPY_VERSION}")),
    )?;
    match py_spy_version(&path) {
        Some(v) if v == PY_SPY_VERSION => {
            println!("py-spy {v}: installed at {}", path.display());
            Ok(())
        }
        other => bail!("pip install finished but {} --version reports {other:?}", path.display()),
    }
}

fn package_installed(pkg: &str) -> bool {
    stdout_of(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]))
        .is_some_and(|s| s.trim() == "install ok installed")
}

/// `DEBIAN_PACKAGES` and `extra`, with one `apt-get update` when any is missing.
fn debian_packages(present: &mut Vec<String>, extra: &[&str]) -> anyhow::Result<()> {
    let all: Vec<&str> = DEBIAN_PACKAGES.iter().chain(extra).copied().collect();
    if Command::new("dpkg-query").arg("--version").output().is_err() {
        println!(
            "warning: dpkg-query not found (not Debian?); make sure these are installed: {}",
            all.join(" ")
        );
        return Ok(());
    }
    let missing: Vec<&str> = all.iter().copied().filter(|p| !package_installed(p)).collect();
    for pkg in all.iter().filter(|p| !missing.contains(p)) {
        present.push(format!("package {pkg}"));
    }
    if missing.is_empty() {
        return Ok(());
    }
    println!("packages missing: {}; installing", missing.join(" "));
    apt_install(&missing)
}

/// `apt-get update`, then installs `missing` and checks they are installed.
fn apt_install(missing: &[&str]) -> anyhow::Result<()> {
    let apt = |args: &[&str]| {
        let mut cmd = if is_root() {
            Command::new("apt-get")
        } else {
            let mut sudo = Command::new("sudo");
            sudo.arg("apt-get");
            sudo
        };
        cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    };
    run_cmd(&mut apt(&["update"]))?;
    let mut install = apt(&["install", "-y", "--no-install-recommends"]);
    install.args(missing);
    run_cmd(&mut install)?;
    let still: Vec<&str> = missing.iter().copied().filter(|p| !package_installed(p)).collect();
    if !still.is_empty() {
        bail!("packages still not installed: {}", still.join(" "));
    }
    println!("packages installed: {}", missing.join(" "));
    Ok(())
}

/// `node` and `npm` run profiler-cli and install it. They are checked as commands, not
/// packages: a NodeSource `nodejs` package bundles npm and conflicts with Debian's `npm`.
fn node_npm() -> anyhow::Result<()> {
    let version = |cmd: &str| stdout_of(Command::new(cmd).arg("--version"));
    if let (Some(node), Some(npm)) = (version("node"), version("npm")) {
        println!("node {}, npm {}: already installed", node.trim(), npm.trim());
        return Ok(());
    }
    println!("node/npm: missing, installing the Debian packages nodejs npm");
    apt_install(&["nodejs", "npm"])
}

/// The Firefox Profiler's CLI, pinned, in `<target dir>/profiler-cli` (see
/// `tests::firefox_import`).
fn profiler_cli() -> anyhow::Result<()> {
    use tests::firefox_import::{PACKAGE, VERSION, install_dir, installed_version};
    node_npm()?;
    let dir = install_dir();
    match installed_version() {
        Some(v) if v == VERSION => {
            println!("{PACKAGE} {v}: already installed in {}", dir.display());
            return Ok(());
        }
        Some(v) => println!("{PACKAGE}: found {v}, need {VERSION}; installing"),
        None => println!("{PACKAGE}: missing, installing {VERSION} into {}", dir.display()),
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // The package declares Node >= 24 but runs on Node 20 (see
    // tests::firefox_import::VERSION); --engine-strict=false keeps a user's npm config from
    // turning npm's engine warning into an error.
    run_cmd(
        Command::new("npm")
            .args(["install", "--prefix"])
            .arg(&dir)
            .args(["--no-audit", "--no-fund", "--no-save", "--engine-strict=false"])
            .arg(format!("{PACKAGE}@{VERSION}")),
    )?;
    match installed_version() {
        Some(v) if v == VERSION => {
            println!("{PACKAGE} {v}: installed");
            Ok(())
        }
        other => bail!("npm install finished but {} holds {other:?}", dir.display()),
    }
}

const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";
const NO_BTF: &str = "WARNING: /sys/kernel/btf/vmlinux is missing: the kernel lacks BTF \
                      (CONFIG_DEBUG_INFO_BTF); rsprof-bpf cannot run and the tests will fail";

/// Version of an installed Debian package.
fn package_version(pkg: &str) -> Option<String> {
    stdout_of(Command::new("dpkg-query").args(["-W", "-f=${Version}", pkg]))
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// Go's pprof, built offline (GOPATH mode, no module downloads) from the Debian package's
/// sources into `<target dir>/pprof`; rebuilt only when that package's version changed.
fn go_pprof() -> anyhow::Result<()> {
    use tests::go_pprof::{GOPATH, IMPORT_PATH, SOURCE_PACKAGE, binary, built_version, stamp};
    let Some(version) = package_version(SOURCE_PACKAGE) else {
        bail!("{SOURCE_PACKAGE} is not installed (it is in the packages setup installs)");
    };
    let bin = binary();
    match built_version() {
        Some(v) if v == version => {
            println!("pprof ({SOURCE_PACKAGE} {v}): already built at {}", bin.display());
            return Ok(());
        }
        Some(v) => println!("pprof: built from {v}, package is {version}; rebuilding"),
        None => {
            println!("pprof: missing, building {} from {SOURCE_PACKAGE} {version}", bin.display())
        }
    }
    let dir = bin.parent().context("target dir")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(".pprof.{}.tmp", std::process::id()));
    run_cmd(
        Command::new("go")
            .args(["build", "-o"])
            .arg(&tmp)
            .arg(IMPORT_PATH)
            .env("GOPATH", GOPATH)
            .env("GO111MODULE", "off")
            .env("GOFLAGS", "")
            .env("GOCACHE", dir.join("go-cache"))
            .env("GOPROXY", "off"),
    )?;
    std::fs::rename(&tmp, &bin).with_context(|| format!("renaming {}", tmp.display()))?;
    std::fs::write(stamp(), format!("{version}\n"))?;
    println!("pprof ({SOURCE_PACKAGE} {version}): built");
    Ok(())
}

/// Warnings only: the suite needs them, building does not.
fn environment_checks() {
    if Path::new(VMLINUX_BTF).exists() {
        println!("kernel BTF ({VMLINUX_BTF}): present");
    } else {
        println!("{NO_BTF}");
    }
    if is_root() {
        println!("running as root: yes");
    } else {
        println!(
            "WARNING: not running as root: rsprof-bpf needs root to load BPF programs; the \
             integration tests will fail (run `sudo -E cargo xtask test`)"
        );
    }
}
