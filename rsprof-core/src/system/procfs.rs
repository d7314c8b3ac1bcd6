//! The one reader of /proc: a process's name and command line, and its mappings.
//!
//! Errors say whether the process is gone (ENOENT/ESRCH: it exited, which is ordinary) or
//! something else failed (permissions, a kernel refusing), so callers count the second kind
//! instead of taking every failure for an exit.

use std::io;

use crate::model::ids::Pid;

#[derive(Debug)]
pub enum ProcError {
    /// The process no longer exists.
    Gone,
    Io(io::Error),
}

impl std::fmt::Display for ProcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProcError::Gone => f.write_str("process exited"),
            ProcError::Io(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ProcError {}

impl From<io::Error> for ProcError {
    fn from(e: io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::ENOENT | libc::ESRCH) => ProcError::Gone,
            _ if e.kind() == io::ErrorKind::NotFound => ProcError::Gone,
            _ => ProcError::Io(e),
        }
    }
}

/// One line of /proc/PID/maps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapsLine {
    pub start: u64,
    pub end: u64,
    pub readable: bool,
    pub writable: bool,
    pub exec: bool,
    pub offset: u64,
    /// (major << 32) | minor
    pub dev: u64,
    pub inode: u64,
    /// File path, `[vdso]`-style pseudo name, or empty for anonymous memory.
    pub path: String,
}

impl MapsLine {
    /// Backed by a file (not anonymous memory or a pseudo mapping).
    pub fn is_file(&self) -> bool {
        self.inode != 0 && self.path.starts_with('/')
    }

    /// `start-end` in hex as maps and `/proc/PID/map_files/` name the mapping.
    pub fn range_name(&self) -> String {
        format!("{:x}-{:x}", self.start, self.end)
    }
}

pub fn parse_maps_line(line: &str) -> Option<MapsLine> {
    let mut it = line.splitn(6, ' ');
    let (range, perms, offset, dev, inode) =
        (it.next()?, it.next()?, it.next()?, it.next()?, it.next()?);
    let path = it.next().unwrap_or("").trim_start().to_owned();
    let (start, end) = range.split_once('-')?;
    let (major, minor) = dev.split_once(':')?;
    let perm = |i: usize, c: u8| perms.as_bytes().get(i) == Some(&c);
    Some(MapsLine {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        readable: perm(0, b'r'),
        writable: perm(1, b'w'),
        exec: perm(2, b'x'),
        offset: u64::from_str_radix(offset, 16).ok()?,
        dev: u64::from_str_radix(major, 16).ok()? << 32 | u64::from_str_radix(minor, 16).ok()?,
        inode: inode.parse().ok()?,
        path,
    })
}

/// Parses a whole maps file; unparsable lines are skipped.
pub fn parse_maps(text: &str) -> Vec<MapsLine> {
    text.lines().filter_map(parse_maps_line).collect()
}

/// The text of a live process's /proc/PID/maps.
pub fn read_maps_text(pid: Pid) -> Result<String, ProcError> {
    Ok(std::fs::read_to_string(format!("/proc/{}/maps", pid.0))?)
}

/// The mappings of a live process.
pub fn read_maps(pid: Pid) -> Result<Vec<MapsLine>, ProcError> {
    Ok(parse_maps(&read_maps_text(pid)?))
}

/// The vDSO's mapping in this process (the same image in every process).
pub fn self_vdso() -> Option<MapsLine> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    parse_maps(&maps).into_iter().find(|l| l.path == "[vdso]")
}

/// Name (`comm`) and argv of a live process; empty values for what cannot be read.
pub fn read_identity(pid: Pid) -> (String, Vec<String>) {
    let comm = std::fs::read_to_string(format!("/proc/{}/comm", pid.0))
        .map(|s| s.trim_end_matches('\n').to_owned())
        .unwrap_or_default();
    let argv = std::fs::read(format!("/proc/{}/cmdline", pid.0))
        .map(|raw| {
            raw.split(|&c| c == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default();
    (comm, argv)
}

/// Path of a live process's executable (`/proc/PID/exe`), without the ` (deleted)` suffix.
pub fn read_exe(pid: Pid) -> Option<String> {
    let link = std::fs::read_link(format!("/proc/{}/exe", pid.0)).ok()?;
    let s = link.to_string_lossy();
    Some(s.strip_suffix(" (deleted)").unwrap_or(&s).to_owned())
}

/// Pids of every process now in /proc.
pub fn all_pids() -> Vec<Pid> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok().map(Pid)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines() {
        let l = parse_maps_line(
            "7f0000000000-7f0000100000 r-xp 00028000 fd:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6",
        )
        .unwrap();
        assert_eq!(
            (l.start, l.end, l.offset, l.inode),
            (0x7f0000000000, 0x7f0000100000, 0x28000, 99)
        );
        assert!(l.readable && !l.writable && l.exec && l.is_file());
        assert_eq!(l.dev, 0xfd << 32 | 1);
        assert_eq!(l.range_name(), "7f0000000000-7f0000100000");
        let anon = parse_maps_line("7f0000200000-7f0000201000 rw-p 00000000 00:00 0 ").unwrap();
        assert!(!anon.is_file() && anon.path.is_empty());
        let spaced = parse_maps_line("1000-2000 r-xp 0 08:01 5   /tmp/a b (deleted)").unwrap();
        assert_eq!(spaced.path, "/tmp/a b (deleted)");
    }

    #[test]
    fn reads_own_identity_and_maps() {
        let me = Pid(std::process::id());
        let (comm, argv) = read_identity(me);
        assert!(!comm.is_empty());
        assert!(!argv.is_empty());
        let exe = read_exe(me).unwrap();
        assert_eq!(Some(std::path::Path::new(&exe)), std::env::current_exe().ok().as_deref());
        assert!(read_maps(me).unwrap().iter().any(|m| m.exec && m.is_file()));
        assert!(all_pids().contains(&me));
    }

    #[test]
    fn a_missing_process_is_gone() {
        // Pids are below 2^22 on Linux.
        assert!(matches!(read_maps(Pid(u32::MAX - 1)), Err(ProcError::Gone)));
    }
}

/// This process's own resource use, for its metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SelfUsage {
    /// User plus system CPU time.
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    /// Seconds since the epoch.
    pub start_time_seconds: f64,
    pub open_fds: u64,
}

/// Reads /proc/self/stat, /proc/self/statm and /proc/self/fd.
pub fn self_usage() -> Option<SelfUsage> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
    // SAFETY: sysconf has no preconditions.
    let (tick, page) =
        unsafe { (libc::sysconf(libc::_SC_CLK_TCK), libc::sysconf(libc::_SC_PAGESIZE)) };
    let u = parse_self_usage(&stat, &statm, &uptime, tick as f64, page as u64)?;
    let open_fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count() as u64).unwrap_or(0);
    Some(SelfUsage { open_fds, ..u })
}

/// `stat`'s fields after the command (which may hold spaces and parentheses): utime and stime
/// are fields 14 and 15, starttime (ticks since boot) 22; `statm`'s second field is resident
/// pages.
fn parse_self_usage(
    stat: &str,
    statm: &str,
    uptime: &str,
    tick: f64,
    page: u64,
) -> Option<SelfUsage> {
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_ascii_whitespace().collect();
    let field = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
    let cpu_ticks = field(14)? + field(15)?;
    let start_ticks = field(22)?;
    let resident_pages: u64 = statm.split_ascii_whitespace().nth(1)?.parse().ok()?;
    let uptime: f64 = uptime.split_ascii_whitespace().next()?.parse().ok()?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok()?;
    let boot = now.as_secs_f64() - uptime;
    Some(SelfUsage {
        cpu_seconds: cpu_ticks as f64 / tick,
        resident_bytes: resident_pages * page,
        start_time_seconds: boot + start_ticks as f64 / tick,
        open_fds: 0,
    })
}

#[cfg(test)]
mod self_usage_tests {
    use super::*;

    #[test]
    fn parses_stat_with_spaces_in_the_command() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 1000 \
                    123456 789 18446744073709551615";
        let u =
            parse_self_usage(stat, "5000 789 100 1 0 200 0", "100.5 50.0", 100.0, 4096).unwrap();
        assert_eq!(u.cpu_seconds, 3.0);
        assert_eq!(u.resident_bytes, 789 * 4096);
        let boot = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
            - 100.5;
        assert!((u.start_time_seconds - (boot + 10.0)).abs() < 1.0);
        let live = self_usage().unwrap();
        assert!(live.resident_bytes > 0 && live.open_fds >= 3, "{live:?}");
    }
}
