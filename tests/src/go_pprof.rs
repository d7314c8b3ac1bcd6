//! Reads pprof profiles with Go's own `pprof` (github.com/google/pprof), the reference reader
//! of the format: `cargo xtask setup` builds it offline from Debian's Go sources
//! (`golang-github-google-pprof-dev`, with `golang-go`) into `<target dir>/pprof`, and records
//! the package version it was built from beside it.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};

use crate::fixtures;

/// The Debian packages it is built from.
pub const DEBIAN_PACKAGES: &[&str] = &["golang-go", "golang-github-google-pprof-dev"];
/// The package holding pprof's sources, whose version is recorded in [`stamp`].
pub const SOURCE_PACKAGE: &str = "golang-github-google-pprof-dev";
/// The Go import path built (from `/usr/share/gocode`, GOPATH mode).
pub const IMPORT_PATH: &str = "github.com/google/pprof";
pub const GOPATH: &str = "/usr/share/gocode";

pub fn binary() -> PathBuf {
    fixtures::target_dir().join("pprof")
}

/// The `SOURCE_PACKAGE` version the binary was built from.
pub fn stamp() -> PathBuf {
    fixtures::target_dir().join("pprof.version")
}

pub fn built_version() -> Option<String> {
    if !binary().is_file() {
        return None;
    }
    std::fs::read_to_string(stamp()).ok().map(|s| s.trim().to_owned())
}

/// Runs `pprof ARGS PROFILE` (no symbolization, no browser, no network) and returns its
/// stdout; a failure carries its stderr.
pub fn run(args: &[&str], profile: &Path) -> anyhow::Result<String> {
    let bin = binary();
    if built_version().is_none() {
        bail!(
            "Go's pprof is not built at {}: run `cargo xtask setup` (it installs {} and builds \
             it)",
            bin.display(),
            DEBIAN_PACKAGES.join(" ")
        );
    }
    let out = Command::new(&bin)
        .args(["-symbolize=none"])
        .args(args)
        .arg(profile)
        // pprof keeps fetched profiles under $PPROF_TMPDIR (default $HOME/pprof).
        .env("PPROF_TMPDIR", std::env::temp_dir())
        .output()
        .with_context(|| format!("run {}", bin.display()))?;
    if !out.status.success() {
        bail!(
            "`pprof {} {}` failed ({}):\n{}",
            args.join(" "),
            profile.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A row of `pprof -top`.
#[derive(Debug, Clone, PartialEq)]
pub struct TopRow {
    pub flat: f64,
    pub cum: f64,
    pub name: String,
}

/// Parses `pprof -top` output: rows `flat flat% sum% cum cum% name`, the total from the
/// `Showing nodes accounting for X, Y% of TOTAL total` line. Values are plain numbers (counts)
/// or carry one unit, e.g. `-unit=ms` gives `2250ms`, which is dropped.
pub fn parse_top(out: &str) -> anyhow::Result<(f64, Vec<TopRow>)> {
    let number = |s: &str| s.trim_end_matches(|c: char| c.is_ascii_alphabetic()).parse::<f64>();
    let total = out
        .lines()
        .find_map(|l| number(l.split(" of ").nth(1)?.strip_suffix(" total")?.trim()).ok())
        .with_context(|| format!("no 'of N total' line in pprof -top output:\n{out}"))?;
    let mut rows = Vec::new();
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || !f[1].ends_with('%') || !f[4].ends_with('%') {
            continue;
        }
        let (Ok(flat), Ok(cum)) = (number(f[0]), number(f[3])) else { continue };
        rows.push(TopRow { flat, cum, name: f[5..].join(" ") });
    }
    if rows.is_empty() {
        bail!("no rows in pprof -top output:\n{out}");
    }
    Ok((total, rows))
}
