//! Names JIT code from a process's perf map (`/tmp/perf-PID.map`): text lines `START SIZE NAME`
//! (hex, the JDK writes a `0x` prefix; the name is the rest of the line) that Node.js
//! (`--perf-basic-prof`), the JDK (`jcmd PID Compiler.perfmap`), CPython 3.12+ (`-X perf`) and
//! .NET (`DOTNET_PerfMapEnabled`) append as they make code. Samples are named at collection
//! time, so each is named by the lines written before it: the file is read incrementally (from
//! the offset read so far), on a JIT address no line names yet and when it grows, never whole
//! per sample. A range written twice (code freed and its memory reused) takes the later line's
//! name from the moment that line is read.
//!
//! The file is opened with the profiler's privileges from a path the profiled process
//! controls, so it is opened inside the process's root without following a symlink at its last
//! component, never blocks (a FIFO), and is read only if it is a regular file owned by the
//! process's user; what is read is bounded, and lines that do not parse are skipped and counted.

use std::{
    collections::BTreeMap,
    ffi::CString,
    fs::File,
    os::{fd::FromRawFd as _, unix::fs::FileExt as _},
    sync::Arc,
};

use crate::model::{ids::Pid, stacks::JitLanguage};

/// Bytes read from one map at most. A JIT-heavy Node.js service writes some 100 bytes per code
/// object; 64 MiB is ~600,000 of them, more code than a long-running service keeps, while the
/// entries held cost about what was read: a process writing without end (eval-heavy code, or a
/// hostile writer) costs at most this much. Past it, further lines are not read (counted).
pub const MAX_MAP_BYTES: u64 = 64 << 20;
/// A "line" longer than this without a newline is garbage (names are at most a few KiB).
const MAX_LINE: usize = 64 << 10;
/// Bytes read per `read` call.
const CHUNK: usize = 256 << 10;
/// Bytes read per `MapFile::read_tail` at most: a long map (a JDK snapshot, or one near the
/// bound) is read over several calls, so no drain stalls the event loop for long (64 MiB
/// at once took long enough to fill the ring).
const READ_PER_CALL: u64 = 4 << 20;

/// What reading maps ran into, for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerfMapStats {
    /// Lines that named a range.
    pub lines: u64,
    /// Lines that did not parse (skipped).
    pub garbage: u64,
    pub bytes: u64,
    /// Maps that reached `MAX_MAP_BYTES` (the rest is not read).
    pub over_bound: u64,
    /// Maps opened, and those refused (a symlink, not a regular file, another user's).
    pub opened: u64,
    pub refused: u64,
}

impl PerfMapStats {
    pub fn add(&mut self, o: &PerfMapStats) {
        self.lines += o.lines;
        self.garbage += o.garbage;
        self.bytes += o.bytes;
        self.over_bound += o.over_bound;
        self.opened += o.opened;
        self.refused += o.refused;
    }

    fn since(&self, o: &PerfMapStats) -> PerfMapStats {
        PerfMapStats {
            lines: self.lines - o.lines,
            garbage: self.garbage - o.garbage,
            bytes: self.bytes - o.bytes,
            over_bound: self.over_bound - o.over_bound,
            opened: self.opened - o.opened,
            refused: self.refused - o.refused,
        }
    }
}

#[derive(Clone, Debug)]
struct Entry {
    end: u64,
    name: Arc<str>,
}

/// The ranges a map names, as its lines read so far say: non-overlapping, a later line cutting
/// away whatever earlier ones said of its range.
#[derive(Debug, Default)]
pub struct PerfMap {
    entries: BTreeMap<u64, Entry>,
    pub stats: PerfMapStats,
}

/// One line's range and name; None for a line that does not parse.
pub fn parse_line(line: &[u8]) -> Option<(u64, u64, &[u8])> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let mut parts = line.splitn(3, |&b| b == b' ');
    let start = hex(parts.next()?)?;
    let size = hex(parts.next()?)?;
    let name = parts.next()?;
    if name.is_empty() || size == 0 {
        return None;
    }
    start.checked_add(size)?;
    Some((start, size, name))
}

fn hex(field: &[u8]) -> Option<u64> {
    let digits = field.strip_prefix(b"0x").or_else(|| field.strip_prefix(b"0X")).unwrap_or(field);
    if digits.is_empty() || digits.len() > 16 {
        return None;
    }
    u64::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
}

impl PerfMap {
    /// Reads the complete lines at the start of `text`; returns the bytes consumed (up to and
    /// including the last newline: a last line without one may still be being written).
    pub fn feed(&mut self, text: &[u8]) -> usize {
        let Some(last_nl) = text.iter().rposition(|&b| b == b'\n') else { return 0 };
        for line in text[..last_nl].split(|&b| b == b'\n') {
            if line.is_empty() {
                continue;
            }
            match parse_line(line) {
                Some((start, size, name)) => {
                    self.stats.lines += 1;
                    self.insert(start, start + size, String::from_utf8_lossy(name).into());
                }
                None => self.stats.garbage += 1,
            }
        }
        last_nl + 1
    }

    /// Names `start..end`, cutting earlier ranges that overlap it.
    fn insert(&mut self, start: u64, end: u64, name: Arc<str>) {
        let overlapping: Vec<u64> = self
            .entries
            .range(..end)
            .rev()
            .take_while(|(_, e)| e.end > start)
            .map(|(&s, _)| s)
            .collect();
        for s in overlapping {
            let e = self.entries.remove(&s).expect("listed");
            if s < start {
                self.entries.insert(s, Entry { end: start, name: e.name.clone() });
            }
            if e.end > end {
                self.entries.insert(end, Entry { end: e.end, name: e.name });
            }
        }
        self.entries.insert(start, Entry { end, name });
    }

    pub fn lookup(&self, addr: u64) -> Option<&Arc<str>> {
        let (_, e) = self.entries.range(..=addr).next_back()?;
        (addr < e.end).then_some(&e.name)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// A map file being followed: what is parsed, and the offset of the first byte not consumed.
#[derive(Debug)]
pub struct MapFile {
    file: File,
    offset: u64,
    /// Bytes read so far (re-reads after a truncation included), against `MAX_MAP_BYTES`.
    read: u64,
    /// The file's size at the last read: an unfinished last line is read again only once the
    /// file grew.
    size_seen: u64,
    pub map: PerfMap,
}

impl MapFile {
    pub fn new(file: File) -> Self {
        Self { file, offset: 0, read: 0, size_seen: 0, map: PerfMap::default() }
    }

    /// Reads what was appended since the last read; returns whether new lines were read. A
    /// file that shrank was rewritten (the JDK rewrites its map at each `Compiler.perfmap`):
    /// it is read again from its start, its lines winning over the old ones.
    pub fn read_tail(&mut self) -> bool {
        let Ok(meta) = self.file.metadata() else { return false };
        let size = meta.len();
        if size < self.offset {
            self.offset = 0;
        } else if size == self.size_seen {
            return false;
        }
        self.size_seen = size;
        let before = self.map.stats.lines;
        let mut buf = Vec::new();
        let mut this_call = 0;
        while self.offset < size {
            if this_call >= READ_PER_CALL {
                // The rest at the next call (which must not take the file for unchanged).
                self.size_seen = u64::MAX;
                break;
            }
            let room = MAX_MAP_BYTES.saturating_sub(self.read);
            if room == 0 {
                self.map.stats.over_bound = 1;
                break;
            }
            let want = (size - self.offset).min(CHUNK as u64).min(room) as usize;
            let start = buf.len();
            buf.resize(start + want, 0);
            let n = match self.file.read_at(&mut buf[start..], self.offset + start as u64) {
                Ok(0) | Err(_) => {
                    buf.truncate(start);
                    break;
                }
                Ok(n) => n,
            };
            buf.truncate(start + n);
            this_call += n as u64;
            self.read += n as u64;
            self.map.stats.bytes += n as u64;
            let used = self.map.feed(&buf);
            self.offset += used as u64;
            buf.drain(..used);
            if buf.len() > MAX_LINE {
                // No newline in sight: skip this much as one garbage line.
                self.map.stats.garbage += 1;
                self.offset += buf.len() as u64;
                buf.clear();
            }
            if used == 0 && self.offset + (buf.len() as u64) >= size {
                break;
            }
        }
        self.map.stats.lines > before
    }
}

/// Why a process's map could not be opened.
#[derive(Debug, PartialEq, Eq)]
pub enum OpenError {
    /// No such file (yet), or the process is gone.
    Missing,
    /// A symlink, a FIFO or other non-regular file, or owned by another user: not read.
    Refused(&'static str),
}

/// The process's pid in its own pid namespace (`NStgid`, innermost) and its user ids (real,
/// effective, saved, filesystem), from /proc/PID/status.
pub(crate) fn status(pid: Pid) -> Option<(u32, [u32; 4])> {
    let text = std::fs::read_to_string(format!("/proc/{}/status", pid.0)).ok()?;
    let mut nstgid = None;
    let mut uids = None;
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("NStgid:") {
            nstgid = v.split_whitespace().last().and_then(|s| s.parse().ok());
        } else if let Some(v) = line.strip_prefix("Uid:") {
            let ids: Vec<u32> = v.split_whitespace().filter_map(|s| s.parse().ok()).collect();
            uids = ids.try_into().ok();
        }
    }
    Some((nstgid?, uids?))
}

/// Opens the perf map of `pid`: `/tmp/perf-NSPID.map` inside the process's root (its mount
/// namespace, under the pid it knows itself by). Symlinks on the way resolve inside that root,
/// none at the last component is followed; only a regular file owned by one of the process's
/// user ids is returned.
pub fn open(pid: Pid) -> Result<File, OpenError> {
    let (nstgid, uids) = status(pid).ok_or(OpenError::Missing)?;
    open_in(&format!("/proc/{}/root", pid.0), nstgid, uids)
}

/// Who a process is, learnt while /proc showed it, to find its map after it exited.
#[derive(Clone, Copy, Debug)]
pub struct Identity {
    nstgid: u32,
    uids: [u32; 4],
}

impl Identity {
    /// The process's identity, if it lives and shares the profiler's root (its map is then
    /// `/tmp/perf-NSPID.map` here too, after its root is gone from /proc).
    pub fn of(pid: Pid) -> Option<Self> {
        use std::os::unix::fs::MetadataExt as _;
        let (nstgid, uids) = status(pid)?;
        let theirs = std::fs::metadata(format!("/proc/{}/root", pid.0)).ok()?;
        let ours = std::fs::metadata("/").ok()?;
        (theirs.dev() == ours.dev() && theirs.ino() == ours.ino())
            .then_some(Identity { nstgid, uids })
    }

    /// Opens the map of a process that exited (a JDK's `DumpPerfMapAtExit` map is written
    /// as it exits, when /proc no longer shows its root), with the same checks as `open`.
    pub fn open(&self) -> Result<File, OpenError> {
        open_in("/", self.nstgid, self.uids)
    }
}

/// Opens `tmp/perf-NSTGID.map` under `root` (see `open`).
fn open_in(root: &str, nstgid: u32, uids: [u32; 4]) -> Result<File, OpenError> {
    open_in_root(root, &format!("tmp/perf-{nstgid}.map"), uids)
}

/// Opens `path` (relative) under `root` as `open` does: symlinks resolved inside the root,
/// none followed at the last component, never blocking, only a regular file owned by one of
/// `uids`.
pub(crate) fn open_in_root(root: &str, path: &str, uids: [u32; 4]) -> Result<File, OpenError> {
    let root = CString::new(root).map_err(|_| OpenError::Missing)?;
    // SAFETY: plain syscalls on NUL-terminated paths; each fd returned is owned once.
    let root_fd =
        unsafe { libc::open(root.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if root_fd < 0 {
        return Err(OpenError::Missing);
    }
    // SAFETY: `root_fd` was just opened and is owned here.
    let root_dir = unsafe { std::os::fd::OwnedFd::from_raw_fd(root_fd) };
    let path = CString::new(path).map_err(|_| OpenError::Missing)?;
    // SAFETY: `open_how` is plain integers; all zero is its "no flags" value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    use std::os::fd::AsRawFd as _;
    // SAFETY: openat2 with a valid dirfd, path and `open_how` of the size passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root_dir.as_raw_fd(),
            path.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::ELOOP) => OpenError::Refused("a symlink"),
            _ => OpenError::Missing,
        });
    }
    // SAFETY: `fd` was just opened and is owned by the `File` alone.
    let file = unsafe { File::from_raw_fd(fd as i32) };
    owned_regular_file(file, uids)
}

/// `file` if it is a regular file owned by one of `uids`.
pub(crate) fn owned_regular_file(file: File, uids: [u32; 4]) -> Result<File, OpenError> {
    let meta = file.metadata().map_err(|_| OpenError::Missing)?;
    use std::os::unix::fs::MetadataExt as _;
    if !meta.file_type().is_file() {
        return Err(OpenError::Refused("not a regular file"));
    }
    if !uids.contains(&meta.uid()) {
        return Err(OpenError::Refused("owned by another user"));
    }
    Ok(file)
}

/// How long after a failed open the map is looked for again (a process may start writing one
/// later, e.g. `jcmd PID Compiler.perfmap`): from `REOPEN_FIRST_NS`, doubling after each miss
/// up to `REOPEN_NS`. A runtime may run JIT code a moment before its map's first line exists
/// (CPython 3.13 `-X perf`): a second's wait left its first second of stacks unnamed and cut
/// at the trampolines, while a process that never writes one costs a few opens, then one a
/// second.
const REOPEN_FIRST_NS: u64 = 25_000_000;
const REOPEN_NS: u64 = 1_000_000_000;
/// Tail reads for JIT addresses no line names are at least this far apart, so a process with
/// code its map never names costs a read now and then, not one per sample.
const MISS_READ_NS: u64 = 10_000_000;
/// How often an open map is checked for growth, so a reused range takes its new name even
/// when every address sampled is already named.
pub const POLL_NS: u64 = 250_000_000;

/// A process's perf map as collection follows it. It is opened at the process's first JIT
/// address (so processes without JIT code cost nothing), then read on misses and polled, and
/// looked for again now and then while it is missing.
#[derive(Debug, Default)]
pub struct ProcessPerfMap {
    file: Option<MapFile>,
    /// A JIT address was looked up: the map is worth looking for.
    wanted: bool,
    /// When opening may be tried again (after a failure), and the wait after the next one.
    next_open: u64,
    reopen_gap: u64,
    next_miss_read: u64,
    next_poll: u64,
    /// Why the map was refused, once (a refused map is not tried again).
    pub refused: Option<&'static str>,
    /// The process, as found at the first JIT address, for `finish` to find a map written
    /// at exit.
    identity: Option<Identity>,
    /// Opening and refusing, counted in `stats`.
    opens: PerfMapStats,
    /// What [`ProcessPerfMap::take_stats`] reported so far.
    reported: PerfMapStats,
}

impl ProcessPerfMap {
    /// The name of `addr` (in anonymous executable memory, or in no mapping) at time `now_ns`;
    /// `new_lines` is set when lines were read on the way.
    pub fn name(
        &mut self,
        pid: Pid,
        addr: u64,
        now_ns: u64,
        new_lines: &mut bool,
    ) -> Option<Arc<str>> {
        if let Some(f) = &self.file
            && let Some(n) = f.map.lookup(addr)
        {
            return Some(n.clone());
        }
        if now_ns < self.next_miss_read {
            return None;
        }
        self.next_miss_read = now_ns.saturating_add(MISS_READ_NS);
        if !self.wanted {
            self.wanted = true;
            self.identity = Identity::of(pid);
        }
        if self.file.is_none() {
            self.try_open(pid, now_ns);
        }
        let f = self.file.as_mut()?;
        if f.read_tail() {
            *new_lines = true;
        }
        f.map.lookup(addr).cloned()
    }

    /// A map already open on `file` (tests: the real one is found through the process's root).
    #[cfg(test)]
    pub fn following(file: File) -> Self {
        Self { file: Some(MapFile::new(file)), wanted: true, ..Default::default() }
    }

    fn try_open(&mut self, pid: Pid, now_ns: u64) {
        self.try_open_with(now_ns, || open(pid));
    }

    fn try_open_with(&mut self, now_ns: u64, open: impl FnOnce() -> Result<File, OpenError>) {
        if self.refused.is_some() || now_ns < self.next_open {
            return;
        }
        match open() {
            Ok(file) => {
                self.file = Some(MapFile::new(file));
                self.next_poll = now_ns.saturating_add(POLL_NS);
                self.opens.opened += 1;
            }
            Err(OpenError::Missing) => {
                let gap = self.reopen_gap.clamp(REOPEN_FIRST_NS, REOPEN_NS);
                self.next_open = now_ns.saturating_add(gap);
                self.reopen_gap = gap.saturating_mul(2);
            }
            Err(OpenError::Refused(why)) => {
                self.refused = Some(why);
                self.opens.refused += 1;
            }
        }
    }

    /// Checks the map for growth now and then (and looks for a missing one, once a JIT
    /// address wanted it); returns whether new lines were read. Stacks named from the map
    /// are cached until then.
    pub fn poll(&mut self, pid: Pid, now_ns: u64) -> bool {
        if self.file.is_none() {
            if !self.wanted || now_ns < self.next_open {
                return false;
            }
            self.try_open(pid, now_ns);
            return self.file.as_mut().is_some_and(MapFile::read_tail);
        }
        if now_ns < self.next_poll {
            return false;
        }
        self.next_poll = now_ns.saturating_add(POLL_NS);
        self.file.as_mut().is_some_and(MapFile::read_tail)
    }

    /// What reading the map did since the last call.
    pub fn take_stats(&mut self) -> PerfMapStats {
        let mut now = self.stats();
        now.add(&self.opens);
        let new = now.since(&self.reported);
        self.reported = now;
        new
    }

    /// Reads what the process wrote up to its exit (the file stays open: its pid may be
    /// reused, or the file removed, after this). A map not found yet is looked for once more:
    /// through /proc while it still shows the process, else in our own root for a process
    /// that shared it.
    pub fn finish(&mut self, pid: Pid, now_ns: u64) -> bool {
        if self.file.is_none() && self.wanted {
            self.next_open = 0;
            self.try_open(pid, now_ns);
            if let (None, Some(id)) = (&self.file, self.identity) {
                self.next_open = 0;
                self.try_open_with(now_ns, || id.open());
            }
        }
        self.file.as_mut().is_some_and(MapFile::read_tail)
    }

    pub fn stats(&self) -> PerfMapStats {
        self.file.as_ref().map(|f| f.map.stats).unwrap_or_default()
    }

    /// What the lines read so far name `addr`, without reading.
    pub fn lookup(&self, addr: u64) -> Option<&Arc<str>> {
        self.file.as_ref()?.map.lookup(addr)
    }

    pub fn is_open(&self) -> bool {
        self.file.is_some()
    }
}

/// The language a JIT frame is in, from its name as runtimes write it, else from the
/// executable that wrote the map.
pub fn language(name: &str, exe: &str) -> JitLanguage {
    const V8: [&str; 12] = [
        "JS:",
        "Builtin:",
        "BytecodeHandler:",
        "Stub:",
        "Handler:",
        "RegExp:",
        "Function:",
        "LazyCompile:",
        "Script:",
        "Eval:",
        "InterpretedFunction:",
        "Baseline:",
    ];
    if name.starts_with("py::") {
        return JitLanguage::Python;
    }
    if V8.iter().any(|p| name.starts_with(p)) {
        return JitLanguage::JavaScript;
    }
    let exe = exe.rsplit('/').next().unwrap_or(exe);
    match exe {
        "node" | "nodejs" | "deno" | "bun" => JitLanguage::JavaScript,
        "java" | "javaw" => JitLanguage::Java,
        e if e.starts_with("python") => JitLanguage::Python,
        _ => JitLanguage::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(map: &PerfMap, addrs: &[u64]) -> Vec<Option<String>> {
        addrs.iter().map(|&a| map.lookup(a).map(|n| n.to_string())).collect()
    }

    #[test]
    fn parses_plain_and_0x_prefixed_lines() {
        let mut m = PerfMap::default();
        let text = b"3d2a1c0 40 JS:*jsHotAlpha /tmp/x.js:3:20\n\
            0x00007f3c2d0a1000 0x0000000000000180 long Hot.f(int)\n";
        assert_eq!(m.feed(text), text.len());
        assert_eq!(m.stats.lines, 2);
        assert_eq!(m.stats.garbage, 0);
        assert_eq!(
            names(&m, &[0x3d2a1c0, 0x3d2a1ff, 0x3d2a200, 0x7f3c2d0a1000 + 0x17f]),
            [
                Some("JS:*jsHotAlpha /tmp/x.js:3:20".into()),
                Some("JS:*jsHotAlpha /tmp/x.js:3:20".into()),
                None,
                Some("long Hot.f(int)".into())
            ]
        );
        // The name is the rest of the line, spaces and all.
        assert_eq!(parse_line(b"10 8 a b  c\r"), Some((0x10, 8, &b"a b  c"[..])));
    }

    #[test]
    fn skips_and_counts_garbage_lines() {
        let mut m = PerfMap::default();
        let text = b"zz 10 bad start\n10 yy bad size\n20 8\n\n0x 8 empty hex\n\
            30 0 zero size\nffffffffffffffff 2 overflows\n11112222333344445 1 too long\n\
            40 8 good\n\xff\xfe 1 binary\n";
        m.feed(text);
        assert_eq!(m.stats.lines, 1);
        assert_eq!(m.stats.garbage, 8);
        assert_eq!(names(&m, &[0x44]), [Some("good".into())]);
    }

    #[test]
    fn a_truncated_last_line_waits_for_its_newline() {
        let mut m = PerfMap::default();
        let text = b"10 8 first\n20 8 sec";
        assert_eq!(m.feed(text), 11);
        assert_eq!(names(&m, &[0x10, 0x20]), [Some("first".into()), None]);
        // The writer finishes the line: read from the offset consumed, it names in full.
        assert_eq!(m.feed(b"20 8 second\n"), 12);
        assert_eq!(names(&m, &[0x20]), [Some("second".into())]);
        assert_eq!(m.stats.garbage, 0);
    }

    #[test]
    fn a_later_line_wins_where_ranges_overlap() {
        let mut m = PerfMap::default();
        m.feed(b"1000 100 old\n2000 10 other\n");
        assert_eq!(names(&m, &[0x1000, 0x1050]), [Some("old".into()), Some("old".into())]);
        // The range is reused: a second line for part of it.
        m.feed(b"1040 20 new\n");
        assert_eq!(
            names(&m, &[0x103f, 0x1040, 0x105f, 0x1060, 0x10ff, 0x1100, 0x2000]),
            [
                Some("old".into()),
                Some("new".into()),
                Some("new".into()),
                Some("old".into()),
                Some("old".into()),
                None,
                Some("other".into())
            ]
        );
        // The same range again, and one covering several.
        m.feed(b"1040 20 newer\n0 10000 all\n");
        assert_eq!(names(&m, &[0x1050, 0x2005, 0x5]), vec![Some("all".to_owned()); 3]);
        assert_eq!(m.len(), 1);
    }

    struct Dir(std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    fn dir(name: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("rsprof-perfmap-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    #[test]
    fn reads_only_the_appended_tail() {
        use std::io::Write as _;
        let d = dir("tail");
        let path = d.0.join("perf-1.map");
        let mut w = std::fs::File::create(&path).unwrap();
        w.write_all(b"10 8 a\n20 8 b").unwrap();
        let mut f = MapFile::new(File::open(&path).unwrap());
        assert!(f.read_tail());
        assert_eq!(f.offset, 7);
        assert!(!f.read_tail(), "nothing complete appended");
        w.write_all(b"\n30 8 c\n").unwrap();
        assert!(f.read_tail());
        assert_eq!(names(&f.map, &[0x10, 0x20, 0x30]).iter().flatten().count(), 3);
        // Each byte was read once but the unfinished line, read again with its end.
        assert_eq!(f.map.stats.bytes, 13 + 8 + 6);
        // Rewritten shorter (the JDK's Compiler.perfmap): read again from the start.
        std::fs::write(&path, b"0x10 0x8 z\n").unwrap();
        assert!(f.read_tail());
        assert_eq!(names(&f.map, &[0x10]), [Some("z".into())]);
    }

    #[test]
    fn stops_at_the_size_bound_and_skips_endless_lines() {
        let d = dir("bound");
        let path = d.0.join("perf-1.map");
        let line = b"1000 10 a_name_of_some_length_for_the_test\n";
        let n = (MAX_MAP_BYTES as usize / line.len()) + 100;
        let mut text = line.repeat(n);
        text.extend_from_slice(b"2000 10 past_the_bound\n");
        std::fs::write(&path, &text).unwrap();
        let mut f = MapFile::new(File::open(&path).unwrap());
        assert!(f.read_tail());
        assert!(f.map.stats.bytes <= READ_PER_CALL + CHUNK as u64, "one call reads a part");
        while f.read_tail() {}
        assert_eq!(f.map.stats.bytes, MAX_MAP_BYTES);
        assert_eq!(f.map.stats.over_bound, 1);
        assert!(f.map.lookup(0x2000).is_none());
        assert!(!f.read_tail(), "nothing more is read");
        // A line with no end is skipped as garbage, not held.
        let mut long = vec![b'x'; MAX_LINE + 10];
        long.extend_from_slice(b"\n3000 10 after\n");
        std::fs::write(&path, &long).unwrap();
        let mut f = MapFile::new(File::open(&path).unwrap());
        f.read_tail();
        assert_eq!(f.map.stats.garbage, 1);
    }

    #[test]
    fn opens_only_own_regular_files_without_following_symlinks() {
        use std::os::unix::fs::{chown, symlink};
        let me = Pid(std::process::id());
        let (nstgid, _) = status(me).unwrap();
        let path = std::path::PathBuf::from(format!("/tmp/perf-{nstgid}.map"));
        let _ = std::fs::remove_file(&path);
        struct Rm(std::path::PathBuf);
        impl Drop for Rm {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
        let _rm = Rm(path.clone());
        assert_eq!(open(me).unwrap_err(), OpenError::Missing);
        std::fs::write(&path, b"10 8 mine\n").unwrap();
        let mut f = MapFile::new(open(me).unwrap());
        f.read_tail();
        assert_eq!(names(&f.map, &[0x10]), [Some("mine".into())]);
        // A symlink to a file we may read but the process should not make us read.
        std::fs::remove_file(&path).unwrap();
        symlink("/etc/shadow", &path).unwrap();
        assert_eq!(open(me).unwrap_err(), OpenError::Refused("a symlink"));
        std::fs::remove_file(&path).unwrap();
        // A FIFO would block a plain open: refused at once.
        let c = CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo on a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_eq!(open(me).unwrap_err(), OpenError::Refused("not a regular file"));
        std::fs::remove_file(&path).unwrap();
        // Another user's file: as root, a file it gives away; otherwise one of root's.
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            std::fs::write(&path, b"10 8 theirs\n").unwrap();
            chown(&path, Some(65534), Some(65534)).unwrap();
            assert_eq!(open(me).unwrap_err(), OpenError::Refused("owned by another user"));
        } else {
            let (_, uids) = status(me).unwrap();
            let refused = open_in_root("/", "etc/passwd", uids).unwrap_err();
            assert_eq!(refused, OpenError::Refused("owned by another user"));
        }
    }

    #[test]
    fn languages_from_names_then_executables() {
        assert_eq!(language("JS:*f /x.js:1:2", "/usr/bin/foo"), JitLanguage::JavaScript);
        assert_eq!(language("Builtin:CallFunction", ""), JitLanguage::JavaScript);
        assert_eq!(language("py::f:/x.py", "/usr/bin/foo"), JitLanguage::Python);
        let java = "/usr/lib/jvm/java-17-openjdk-amd64/bin/java";
        assert_eq!(language("long Hot.f(int)", java), JitLanguage::Java);
        assert_eq!(language("Interpreter", "/usr/bin/node"), JitLanguage::JavaScript);
        assert_eq!(language("void X::Y()[Optimized]", "/usr/bin/dotnet"), JitLanguage::Other);
    }
}
