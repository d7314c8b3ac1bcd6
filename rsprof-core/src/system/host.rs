//! Facts about the host a recording needs: privileges, CPU counts, the OS string, limits.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

use crate::model::ids::Pid;

/// `kernel.perf_event_max_sample_rate`, the highest sampling frequency the kernel allows.
pub fn max_sample_rate() -> u64 {
    std::fs::read_to_string("/proc/sys/kernel/perf_event_max_sample_rate")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100_000)
}

/// The directory named by the environment variable `var` (tests point it elsewhere), else
/// `default`; an empty value counts as unset.
pub fn dir_from_env(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(default), PathBuf::from)
}

pub fn process_exists(pid: Pid) -> bool {
    Path::new(&format!("/proc/{pid}/stat")).exists()
}

pub fn check_privileges() -> Result<()> {
    // SAFETY: trivial syscall.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "rsprof-bpf needs root (CAP_BPF and CAP_PERFMON) to load BPF programs: run it with sudo"
        );
    }
    Ok(())
}

/// The oldest kernel the BPF programs load on: they loop with `bpf_loop` (the unwinder's walk,
/// mapped files' paths, USDT arguments), Linux 5.17+.
const MIN_KERNEL: (u32, u32) = (5, 17);

/// Fails with a clear message on a kernel older than `MIN_KERNEL` (the verifier's own error
/// would name a helper, not the kernel version).
pub fn check_kernel() -> Result<()> {
    let release = uname().map(|[_, r, _]| r).unwrap_or_default();
    match kernel_version(&release) {
        Some(v) if v < MIN_KERNEL => bail!(
            "rsprof-bpf needs Linux {}.{} or newer (its BPF programs loop with bpf_loop); this \
             kernel is {release}",
            MIN_KERNEL.0,
            MIN_KERNEL.1
        ),
        _ => Ok(()),
    }
}

/// (major, minor) of a `uname -r` string such as `6.18.44-fc-v782`.
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// uname(2): (sysname, release, machine).
fn uname() -> Option<[String; 3]> {
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: valid utsname buffer.
    if unsafe { libc::uname(&mut u) } != 0 {
        return None;
    }
    let field = |f: &[libc::c_char]| {
        let b: Vec<u8> = f.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        String::from_utf8_lossy(&b).into_owned()
    };
    Some([field(&u.sysname), field(&u.release), field(&u.machine)])
}

/// The host's name (`uname -n`).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

/// `uname -srm`.
pub fn oscpu() -> String {
    uname().map_or_else(
        || "Linux".into(),
        |[sys, release, machine]| format!("{sys} {release} {machine}"),
    )
}

/// CPUs online now (sysconf), at least 1.
pub fn online_cpus() -> u32 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as u32
}

/// Distinct (package, core) pairs in /proc/cpuinfo.
pub fn physical_cpus() -> Option<u32> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mut cores = std::collections::HashSet::new();
    let (mut phys, mut core) = (None, None);
    for line in text.lines() {
        let mut kv = line.splitn(2, ':').map(str::trim);
        match (kv.next(), kv.next()) {
            (Some("physical id"), Some(v)) => phys = Some(v.to_owned()),
            (Some("core id"), Some(v)) => core = Some(v.to_owned()),
            (Some(""), None) | (None, _) => {
                if let (Some(p), Some(c)) = (phys.take(), core.take()) {
                    cores.insert((p, c));
                }
            }
            _ => {}
        }
    }
    if let (Some(p), Some(c)) = (phys, core) {
        cores.insert((p, c));
    }
    (!cores.is_empty()).then_some(cores.len() as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions() {
        assert_eq!(kernel_version("6.18.44-fc-v782"), Some((6, 18)));
        assert_eq!(kernel_version("5.15.0-91-generic"), Some((5, 15)));
        assert_eq!(kernel_version("5.17"), Some((5, 17)));
        assert_eq!(kernel_version("garbage"), None);
        assert!(kernel_version("5.15.0").unwrap() < MIN_KERNEL);
        assert!(kernel_version("6.1.0").unwrap() >= MIN_KERNEL);
        check_kernel().expect("this machine's kernel");
    }
}
