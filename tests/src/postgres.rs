//! A real PostgreSQL (Debian's `postgresql`) for tests that profile a pre-fork server: a
//! throwaway cluster in a temp directory, owned by the `postgres` user, reachable only through
//! a Unix socket in that directory (no TCP port).

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

/// What `cargo xtask setup` installs for these tests.
pub const DEBIAN_PACKAGES: &[&str] = &["postgresql"];

/// The server binaries of the installed major version.
pub fn bin_dir() -> Result<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.filter_map(|e| Some(e.ok()?.path().join("bin"))).collect())
        .unwrap_or_default();
    dirs.retain(|d| d.join("postgres").is_file() && d.join("pgbench").is_file());
    dirs.sort();
    match dirs.pop() {
        Some(d) => Ok(d),
        None => bail!(
            "PostgreSQL's server and pgbench are not installed (/usr/lib/postgresql/*/bin): run \
             `cargo xtask setup` (it installs Debian's {})",
            DEBIAN_PACKAGES.join(" ")
        ),
    }
}

/// A new cluster's data directory under `parent` (initdb'ed as `postgres`, trust auth). The
/// server is not started: a test starts it inside what it records.
pub fn init_cluster(parent: &Path) -> Result<PathBuf> {
    let bin = bin_dir()?;
    let dir = parent.join("pgdata");
    std::fs::create_dir_all(&dir)?;
    let st = std::process::Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(parent)
        .status()?;
    if !st.success() {
        bail!("chown {} to postgres failed (is Debian's postgresql installed?)", parent.display());
    }
    let out = std::process::Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(bin.join("initdb"))
        .args(["-A", "trust", "--no-sync", "-D"])
        .arg(&dir)
        .output()?;
    if !out.status.success() {
        bail!("initdb failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(dir)
}
