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

/// The mappings of a live process.
pub fn read_maps(pid: Pid) -> Result<Vec<MapsLine>, ProcError> {
    Ok(parse_maps(&std::fs::read_to_string(format!("/proc/{}/maps", pid.0))?))
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
        assert!(read_maps(me).unwrap().iter().any(|m| m.exec && m.is_file()));
        assert!(all_pids().contains(&me));
    }

    #[test]
    fn a_missing_process_is_gone() {
        // Pids are below 2^22 on Linux.
        assert!(matches!(read_maps(Pid(u32::MAX - 1)), Err(ProcError::Gone)));
    }
}
