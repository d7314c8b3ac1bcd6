//! Names JIT code from a process's jitdump (`jit-PID.dump`: the format of the Linux tree's
//! `tools/perf/Documentation/jitdump-specification.txt`), which V8 (`--perf-prof`), CPython
//! 3.13 (`-X perf_jit`), .NET (`DOTNET_PerfMapEnabled=1|2`) and perf's JVMTI agent write.
//! A JIT announces the file by mapping it executable, so the kernel's mapping record of it is
//! how it is found, as perf finds it.
//!
//! Unlike a perf map, each record carries a CLOCK_MONOTONIC time (the clock of our samples):
//! a code load names its range from that time on, so an address reused for other code names
//! what was there at the sample's time, whichever records were read by then. Callers also
//! pass when the memory at the address was mapped (the kernel's records say): code loaded
//! before that names nothing there, so memory mapped again is never named by a record of the
//! old code while the new code's record is still in the JIT's buffer. Debug-info
//! records give JIT frames a file and line; unwinding-info records are checked and counted
//! (the walker does not use them: V8 keeps frame pointers in its code, and CPython's
//! trampolines have their own rule).
//!
//! The file is the process's; what is read is bounded, and a bad header or record stops the
//! reading of that file (counted), never the recording.

use std::{
    collections::{BTreeMap, HashMap},
    fs::File,
    os::unix::fs::{FileExt as _, MetadataExt as _, OpenOptionsExt as _},
    sync::Arc,
};

use super::perfmap::{self, OpenError};
use crate::model::ids::Pid;

/// "JiTD" as the writer's u32; byte-swapped, the file is of the other byte order.
const MAGIC: u32 = 0x4A69_5444;
const MAGIC_SWAPPED: u32 = 0x4454_694A;
const HEADER: usize = 40;
const RECORD_HEADER: usize = 16;
/// Record ids.
const CODE_LOAD: u32 = 0;
const CODE_MOVE: u32 = 1;
const CODE_DEBUG_INFO: u32 = 2;
const CODE_CLOSE: u32 = 3;
const CODE_UNWINDING_INFO: u32 = 4;
/// Header flag: timestamps are the CPU's time-stamp counter, not CLOCK_MONOTONIC.
const FLAG_ARCH_TIMESTAMP: u64 = 1;

/// File bytes gone through at most per dump. Most of a dump is code bytes, skipped unread:
/// V8 writes ~1 KiB a function (name, code, unwinding info).
pub const MAX_DUMP_BYTES: u64 = 1 << 30;
/// A record claiming more than this is garbage (the largest are debug-info records of big
/// functions, some KiB).
const MAX_RECORD: u32 = 64 << 20;
/// Bytes of a load record's name read at most (names are at most a few hundred bytes).
const MAX_NAME: usize = 4096;
/// Debug-info records read at most this many bytes (larger ones are skipped, counted).
const MAX_DEBUG_RECORD: u32 = 1 << 20;
/// Code versions kept per address range: older ones (code long since replaced) go first, so
/// a range reused without end costs no more.
const MAX_VERSIONS: usize = 8;
/// Ranges held per dump: past it, further loads are not placed (counted over the bound).
pub const MAX_PIECES: usize = 1 << 18;

/// What reading dumps ran into, for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JitDumpStats {
    /// Dumps opened, and those refused (not a regular file, another user's, not the file
    /// mapped).
    pub opened: u64,
    pub refused: u64,
    /// Dumps whose header was bad (magic, byte order, version, size): not read.
    pub bad_header: u64,
    /// Dumps whose reading stopped at a record of impossible size or layout.
    pub bad_record: u64,
    pub loads: u64,
    pub moves: u64,
    pub debug_info: u64,
    pub unwinding_info: u64,
    pub closes: u64,
    /// Records of ids this reader does not know (skipped by their size).
    pub unknown: u64,
    pub bytes: u64,
    /// Dumps that reached `MAX_DUMP_BYTES` or `MAX_PIECES`.
    pub over_bound: u64,
    /// Dumps timed by the CPU's counter, not CLOCK_MONOTONIC: their loads name from the
    /// moment they are read, as a perf map's lines do.
    pub arch_timestamps: u64,
}

impl JitDumpStats {
    pub fn add(&mut self, o: &JitDumpStats) {
        self.opened += o.opened;
        self.refused += o.refused;
        self.bad_header += o.bad_header;
        self.bad_record += o.bad_record;
        self.loads += o.loads;
        self.moves += o.moves;
        self.debug_info += o.debug_info;
        self.unwinding_info += o.unwinding_info;
        self.closes += o.closes;
        self.unknown += o.unknown;
        self.bytes += o.bytes;
        self.over_bound += o.over_bound;
        self.arch_timestamps += o.arch_timestamps;
    }

    fn since(&self, o: &JitDumpStats) -> JitDumpStats {
        JitDumpStats {
            opened: self.opened - o.opened,
            refused: self.refused - o.refused,
            bad_header: self.bad_header - o.bad_header,
            bad_record: self.bad_record - o.bad_record,
            loads: self.loads - o.loads,
            moves: self.moves - o.moves,
            debug_info: self.debug_info - o.debug_info,
            unwinding_info: self.unwinding_info - o.unwinding_info,
            closes: self.closes - o.closes,
            unknown: self.unknown - o.unknown,
            bytes: self.bytes - o.bytes,
            over_bound: self.over_bound - o.over_bound,
            arch_timestamps: self.arch_timestamps - o.arch_timestamps,
        }
    }
}

/// One row of a function's line table: from `addr` on, the code is of `file:line`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LineRow {
    pub addr: u64,
    pub line: u32,
    pub file: Arc<str>,
}

/// Code a load record placed.
#[derive(Debug, PartialEq, Eq)]
pub struct Code {
    pub name: Arc<str>,
    /// Its debug-info rows, by address (empty without a debug-info record).
    pub lines: Vec<LineRow>,
}

impl Code {
    /// The file and line of the instruction at `addr`.
    pub fn line_at(&self, addr: u64) -> Option<(&Arc<str>, u32)> {
        let i = self.lines.partition_point(|r| r.addr <= addr);
        let r = self.lines.get(i.checked_sub(1)?)?;
        Some((&r.file, r.line))
    }
}

/// What a range held from `since` on: code, or nothing (its code moved away).
#[derive(Clone, Debug)]
struct Version {
    since: u64,
    code: Option<Arc<Code>>,
}

#[derive(Clone, Debug)]
struct Piece {
    end: u64,
    /// By `since`, oldest first.
    versions: Vec<Version>,
}

/// What a dump says of an address at a time.
#[derive(Debug, PartialEq, Eq)]
pub enum At<'a> {
    /// No record ever placed code there: ask the perf map.
    NotCovered,
    /// Records place code there, none of it at that time (later code; or moved away).
    Unknown,
    /// The code there; `superseded` when later records placed other code there (the name
    /// holds for this time only).
    Named { code: &'a Arc<Code>, superseded: bool },
}

/// What a dump says of an address over a span of time.
#[derive(Debug, PartialEq, Eq)]
pub enum Over<'a> {
    NotCovered,
    /// The span crosses a change of code, or precedes all of it.
    Ambiguous,
    Named(&'a Arc<Code>),
}

/// The ranges a dump's records placed code in, each with its code over time.
#[derive(Debug, Default)]
pub struct CodeIndex {
    pieces: BTreeMap<u64, Piece>,
    /// Debug-info rows waiting for the load of their code (they precede it).
    pending_lines: HashMap<u64, Vec<LineRow>>,
    /// Where each code (by the writer's `code_index`) was loaded, for moves.
    by_index: HashMap<u64, (u64, u64, Arc<Code>)>,
    pub over_bound: bool,
}

impl CodeIndex {
    /// Cuts the piece across `x` in two at it.
    fn split_at(&mut self, x: u64) {
        let Some((&s, p)) = self.pieces.range_mut(..x).next_back() else { return };
        if p.end > x && s < x {
            let tail = Piece { end: p.end, versions: p.versions.clone() };
            p.end = x;
            self.pieces.insert(x, tail);
        }
    }

    /// `start..end` holds `code` (None: nothing known) from time `since` on.
    fn place(&mut self, start: u64, end: u64, since: u64, code: Option<Arc<Code>>) {
        if start >= end {
            return;
        }
        self.split_at(start);
        self.split_at(end);
        let mut gaps = Vec::new();
        let mut cur = start;
        for (&s, p) in self.pieces.range(start..end) {
            if s > cur {
                gaps.push((cur, s));
            }
            cur = p.end;
        }
        if cur < end {
            gaps.push((cur, end));
        }
        if self.pieces.len() + gaps.len() > MAX_PIECES {
            self.over_bound = true;
            return;
        }
        for (s, e) in gaps {
            self.pieces.insert(s, Piece { end: e, versions: Vec::new() });
        }
        for (_, p) in self.pieces.range_mut(start..end) {
            let i = p.versions.partition_point(|v| v.since <= since);
            p.versions.insert(i, Version { since, code: code.clone() });
            if p.versions.len() > MAX_VERSIONS {
                p.versions.remove(0);
            }
        }
    }

    fn piece(&self, addr: u64) -> Option<&Piece> {
        let (_, p) = self.pieces.range(..=addr).next_back()?;
        (addr < p.end && !p.versions.is_empty()).then_some(p)
    }

    /// What was at `addr` at time `t`, counting only code loaded from time `floor` on (when
    /// the memory there was mapped: code loaded before was in memory unmapped since).
    pub fn at(&self, addr: u64, t: u64, floor: u64) -> At<'_> {
        let Some(p) = self.piece(addr) else { return At::NotCovered };
        let i = p.versions.partition_point(|v| v.since <= t);
        match i.checked_sub(1).map(|i| &p.versions[i]) {
            Some(Version { code: Some(code), since }) if *since >= floor => {
                At::Named { code, superseded: i < p.versions.len() }
            }
            _ => At::Unknown,
        }
    }

    /// What was at `addr` all through `t0..=t1` (`floor` as for `at`).
    pub fn over(&self, addr: u64, t0: u64, t1: u64, floor: u64) -> Over<'_> {
        let Some(p) = self.piece(addr) else { return Over::NotCovered };
        let i = p.versions.partition_point(|v| v.since <= t0);
        let j = p.versions.partition_point(|v| v.since <= t1);
        match i.checked_sub(1).map(|i| &p.versions[i]) {
            Some(Version { code: Some(code), since }) if i == j && *since >= floor => {
                Over::Named(code)
            }
            _ => Over::Ambiguous,
        }
    }

    /// The latest code at `addr`, whatever the time.
    pub fn latest(&self, addr: u64) -> Option<&Arc<Code>> {
        self.piece(addr)?.versions.last()?.code.as_ref()
    }

    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    fn load(&mut self, since: u64, code_addr: u64, size: u64, index: u64, name: Arc<str>) {
        let mut lines = self.pending_lines.remove(&code_addr).unwrap_or_default();
        lines.sort_by_key(|r| r.addr);
        let code = Arc::new(Code { name, lines });
        let end = code_addr.saturating_add(size);
        self.place(code_addr, end, since, Some(code.clone()));
        self.by_index.insert(index, (code_addr, end, code));
        if self.by_index.len() > MAX_PIECES {
            // Moves of code this old are not followed (the JIT that moves code, .NET, keeps
            // few); what the index forgets is only where to move from.
            self.by_index.clear();
        }
    }

    fn moved(&mut self, since: u64, old: u64, new: u64, size: u64, index: u64) {
        let code = match self.by_index.get(&index) {
            Some((start, _, code)) if *start == old => code.clone(),
            _ => match self.latest(old) {
                Some(code) => code.clone(),
                None => return,
            },
        };
        self.place(old, old.saturating_add(size), since, None);
        let end = new.saturating_add(size);
        self.place(new, end, since, Some(code.clone()));
        self.by_index.insert(index, (new, end, code));
    }
}

/// Why reading a dump stopped for good.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bad {
    Header(&'static str),
    Record(&'static str),
}

/// A dump being followed: what is read, and the offset of the next record.
#[derive(Debug)]
pub struct DumpFile {
    file: File,
    offset: u64,
    size_seen: u64,
    header_read: bool,
    /// Timestamps are not CLOCK_MONOTONIC: every load counts from time 0.
    untimed: bool,
    pub bad: Option<Bad>,
    pub index: CodeIndex,
    pub stats: JitDumpStats,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The NUL-terminated string at the start of `b`, and the bytes after its NUL.
fn c_str(b: &[u8]) -> Option<(&[u8], &[u8])> {
    let nul = b.iter().position(|&c| c == 0)?;
    Some((&b[..nul], &b[nul + 1..]))
}

impl DumpFile {
    pub fn new(file: File) -> Self {
        Self {
            file,
            offset: 0,
            size_seen: 0,
            header_read: false,
            untimed: false,
            bad: None,
            index: CodeIndex::default(),
            stats: JitDumpStats::default(),
        }
    }

    /// A mapping time to compare with this dump's times: none for a dump not on our clock.
    fn floor(&self, floor: u64) -> u64 {
        if self.untimed { 0 } else { floor }
    }

    fn read(&mut self, at: u64, len: usize) -> Option<Vec<u8>> {
        let mut buf = vec![0; len];
        self.file.read_exact_at(&mut buf, at).ok()?;
        self.stats.bytes += len as u64;
        Some(buf)
    }

    fn stop(&mut self, bad: Bad) {
        match bad {
            Bad::Header(_) => self.stats.bad_header += 1,
            Bad::Record(_) => self.stats.bad_record += 1,
        }
        self.bad = Some(bad);
    }

    fn read_header(&mut self, size: u64) -> bool {
        if size < HEADER as u64 {
            return false;
        }
        let Some(h) = self.read(0, HEADER) else { return false };
        let bad = match u32_at(&h, 0) {
            MAGIC => match (u32_at(&h, 4), u32_at(&h, 8)) {
                (1, total) if (HEADER as u32..=4096).contains(&total) => None,
                (1, _) => Some("header size"),
                _ => Some("version"),
            },
            MAGIC_SWAPPED => Some("other byte order"),
            _ => Some("magic"),
        };
        if let Some(why) = bad {
            self.stop(Bad::Header(why));
            return false;
        }
        // CPython 3.13.0 writes a wall-clock header timestamp and elf_mach 0: neither is used.
        if u64_at(&h, 32) & FLAG_ARCH_TIMESTAMP != 0 {
            self.untimed = true;
            self.stats.arch_timestamps += 1;
        }
        self.offset = u64::from(u32_at(&h, 8));
        self.header_read = true;
        true
    }

    /// Reads the records appended since the last read; returns whether any placed code. A
    /// last record not yet written whole waits for the next read.
    pub fn read_tail(&mut self) -> bool {
        if self.bad.is_some() || self.index.over_bound {
            return false;
        }
        let Ok(meta) = self.file.metadata() else { return false };
        let size = meta.len();
        if size == self.size_seen {
            return false;
        }
        self.size_seen = size;
        if !self.header_read && !self.read_header(size) {
            return false;
        }
        let mut placed = false;
        while self.offset + RECORD_HEADER as u64 <= size {
            if self.offset >= MAX_DUMP_BYTES {
                self.stats.over_bound = 1;
                self.index.over_bound = true;
                break;
            }
            let Some(h) = self.read(self.offset, RECORD_HEADER) else { break };
            let (id, total, time) = (u32_at(&h, 0), u32_at(&h, 4), u64_at(&h, 8));
            let fixed = match id {
                CODE_LOAD => 40 + 1,
                CODE_MOVE => 48,
                CODE_DEBUG_INFO => 16,
                CODE_UNWINDING_INFO => 24,
                _ => 0,
            };
            if (total as usize) < RECORD_HEADER + fixed || total > MAX_RECORD {
                self.stop(Bad::Record("size"));
                break;
            }
            if self.offset + u64::from(total) > size {
                break;
            }
            let body_at = self.offset + RECORD_HEADER as u64;
            let body_len = total as usize - RECORD_HEADER;
            let since = if self.untimed { 0 } else { time };
            let ok = match id {
                CODE_LOAD => self.on_load(body_at, body_len, since),
                CODE_MOVE => self.on_move(body_at, since),
                CODE_DEBUG_INFO => self.on_debug_info(body_at, body_len),
                CODE_UNWINDING_INFO => self.on_unwinding_info(body_at, body_len),
                CODE_CLOSE => {
                    self.stats.closes += 1;
                    Ok(false)
                }
                _ => {
                    self.stats.unknown += 1;
                    Ok(false)
                }
            };
            match ok {
                Ok(p) => placed |= p,
                Err(why) => {
                    self.stop(Bad::Record(why));
                    break;
                }
            }
            self.offset += u64::from(total);
        }
        placed
    }

    fn on_load(&mut self, at: u64, len: usize, since: u64) -> Result<bool, &'static str> {
        let want = len.min(40 + MAX_NAME);
        let b = self.read(at, want).ok_or("unreadable")?;
        let (code_addr, size, index) = (u64_at(&b, 16), u64_at(&b, 24), u64_at(&b, 32));
        let name = match c_str(&b[40..]) {
            Some((name, _)) => name,
            // Longer than we read: cut (a record without its NUL at all is bad).
            None if want < len => &b[40..],
            None => return Err("load name"),
        };
        let name_end = 40 + name.len() + 1;
        if code_addr.checked_add(size).is_none()
            || (name_end as u64).saturating_add(size) > len as u64
        {
            return Err("load code size");
        }
        self.stats.loads += 1;
        if size == 0 || name.is_empty() {
            return Ok(false);
        }
        self.index.load(since, code_addr, size, index, String::from_utf8_lossy(name).into());
        Ok(true)
    }

    fn on_move(&mut self, at: u64, since: u64) -> Result<bool, &'static str> {
        // pid, tid (u32 each), vma, old_code_addr, new_code_addr, code_size, code_index.
        let b = self.read(at, 48).ok_or("unreadable")?;
        let (old, new, size, index) =
            (u64_at(&b, 16), u64_at(&b, 24), u64_at(&b, 32), u64_at(&b, 40));
        if old.checked_add(size).is_none() || new.checked_add(size).is_none() {
            return Err("move size");
        }
        self.stats.moves += 1;
        self.index.moved(since, old, new, size, index);
        Ok(true)
    }

    fn on_debug_info(&mut self, at: u64, len: usize) -> Result<bool, &'static str> {
        self.stats.debug_info += 1;
        if len > MAX_DEBUG_RECORD as usize {
            return Ok(false);
        }
        let b = self.read(at, len).ok_or("unreadable")?;
        let (code_addr, n) = (u64_at(&b, 0), u64_at(&b, 8));
        let mut rest = &b[16..];
        let mut rows = Vec::new();
        let mut file: Arc<str> = "".into();
        for _ in 0..n {
            if rest.len() < 16 + 1 {
                return Err("debug entry");
            }
            let (addr, line) = (u64_at(rest, 0), u32_at(rest, 8));
            let (name, after) = c_str(&rest[16..]).ok_or("debug entry name")?;
            // V8 writes "\xff" for "the previous entry's file".
            if name != b"\xff" {
                file = String::from_utf8_lossy(name).into();
            }
            rows.push(LineRow { addr, line, file: file.clone() });
            rest = after;
        }
        if self.index.pending_lines.len() >= 64 {
            // Rows never followed by their load: not kept.
            self.index.pending_lines.clear();
        }
        self.index.pending_lines.insert(code_addr, rows);
        Ok(false)
    }

    fn on_unwinding_info(&mut self, at: u64, len: usize) -> Result<bool, &'static str> {
        let b = self.read(at, 24).ok_or("unreadable")?;
        let (unwind, hdr, _mapped) = (u64_at(&b, 0), u64_at(&b, 8), u64_at(&b, 16));
        if hdr > unwind || unwind > (len - 24) as u64 {
            return Err("unwinding info size");
        }
        self.stats.unwinding_info += 1;
        Ok(false)
    }
}

/// Whether `path` names a jitdump as writers name them: `jit-PID.dump`.
pub fn is_dump_path(path: &str) -> bool {
    // Every file mapping record asks: the suffix rejects nearly all at once.
    if !path.ends_with(".dump") {
        return false;
    }
    let name = path.rsplit('/').next().unwrap_or(path);
    name.strip_prefix("jit-")
        .and_then(|n| n.strip_suffix(".dump"))
        .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
}

/// Opens the dump that process `pid` mapped at `start..end`: its own handle on the mapped
/// file (`/proc/PID/map_files`), else `path` inside its root without following a symlink at
/// the last component, checked to be the file mapped (`ident`: device and inode as the kernel
/// reported them). Only a regular file owned by one of the process's users is returned.
pub fn open_mapped(
    pid: Pid,
    (start, end): (u64, u64),
    ident: Option<(u64, u64)>,
    path: &str,
) -> Result<File, OpenError> {
    let (_, uids) = perfmap::status(pid).ok_or(OpenError::Missing)?;
    let same = |f: &File| match ident {
        Some((dev, ino)) => f
            .metadata()
            .is_ok_and(|m| m.ino() == ino && crate::collect::modules::dev_matches(m.dev(), dev)),
        None => true,
    };
    let map_file = format!("/proc/{}/map_files/{start:x}-{end:x}", pid.0);
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&map_file);
    if let Ok(f) = opened {
        if !same(&f) {
            return Err(OpenError::Refused("not the file mapped"));
        }
        return perfmap::owned_regular_file(f, uids);
    }
    // The mapping is gone by now (the record was read late): by path, if it is the same file.
    if ident.is_none() {
        return Err(OpenError::Missing);
    }
    let f = perfmap::open_in_root(
        &format!("/proc/{}/root", pid.0),
        path.trim_start_matches('/'),
        uids,
    )?;
    if !same(&f) {
        return Err(OpenError::Refused("not the file mapped"));
    }
    Ok(f)
}

/// A process's jitdump as collection follows it: opened when its mapping is seen, read when a
/// sample is later than the last read (so every record written before the sample is known
/// when it is named) and at the process's exit.
#[derive(Debug, Default)]
pub struct ProcessJitDump {
    file: Option<DumpFile>,
    /// CLOCK_MONOTONIC time of the last read.
    read_ns: u64,
    /// Why the dump was refused, once.
    pub refused: Option<&'static str>,
    opens: JitDumpStats,
    reported: JitDumpStats,
}

impl ProcessJitDump {
    /// The process mapped a dump: opened now (a second dump of one image is not followed).
    pub fn found(&mut self, open: impl FnOnce() -> Result<File, OpenError>) -> bool {
        if self.file.is_some() || self.refused.is_some() {
            return false;
        }
        match open() {
            Ok(f) => {
                self.file = Some(DumpFile::new(f));
                self.opens.opened += 1;
                self.read_ns = 0;
                true
            }
            Err(OpenError::Refused(why)) => {
                self.refused = Some(why);
                self.opens.refused += 1;
                false
            }
            Err(OpenError::Missing) => false,
        }
    }

    /// Reads what was appended if the sample at `t` is later than the last read; returns
    /// whether records placed more code.
    pub fn refresh(&mut self, t: u64) -> bool {
        let Some(f) = self.file.as_mut() else { return false };
        if t < self.read_ns {
            return false;
        }
        self.read_ns = crate::model::time::MonoNs::now().0;
        f.read_tail()
    }

    /// Reads what the process wrote up to its exit (the file stays open).
    pub fn finish(&mut self) -> bool {
        self.file.as_mut().is_some_and(DumpFile::read_tail)
    }

    pub fn is_open(&self) -> bool {
        self.file.is_some()
    }

    /// What the dump says was at `addr` at time `t`; `floor` is when the memory there was
    /// mapped, as the kernel's records said (0: not known).
    pub fn at(&self, addr: u64, t: u64, floor: u64) -> At<'_> {
        match &self.file {
            Some(f) => f.index.at(addr, t, f.floor(floor)),
            None => At::NotCovered,
        }
    }

    pub fn over(&self, addr: u64, t0: u64, t1: u64, floor: u64) -> Over<'_> {
        match &self.file {
            Some(f) => f.index.over(addr, t0, t1, f.floor(floor)),
            None => Over::NotCovered,
        }
    }

    pub fn latest(&self, addr: u64) -> Option<&Arc<Code>> {
        self.file.as_ref()?.index.latest(addr)
    }

    pub fn stats(&self) -> JitDumpStats {
        self.file.as_ref().map(|f| f.stats).unwrap_or_default()
    }

    /// What reading the dump did since the last call.
    pub fn take_stats(&mut self) -> JitDumpStats {
        let mut now = self.stats();
        now.add(&self.opens);
        let new = now.since(&self.reported);
        self.reported = now;
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes dumps as JITs do.
    #[derive(Default)]
    struct Writer(Vec<u8>);

    impl Writer {
        fn header(magic: u32, version: u32, flags: u64) -> Self {
            let mut w = Writer::default();
            for v in [magic, version, HEADER as u32, 62, 0, 1234] {
                w.0.extend_from_slice(&v.to_le_bytes());
            }
            w.0.extend_from_slice(&99u64.to_le_bytes());
            w.0.extend_from_slice(&flags.to_le_bytes());
            w
        }

        fn record(&mut self, id: u32, time: u64, body: &[u8]) {
            self.0.extend_from_slice(&id.to_le_bytes());
            self.0.extend_from_slice(&((RECORD_HEADER + body.len()) as u32).to_le_bytes());
            self.0.extend_from_slice(&time.to_le_bytes());
            self.0.extend_from_slice(body);
        }

        fn load(&mut self, time: u64, addr: u64, size: u64, index: u64, name: &str) {
            let mut b = Vec::new();
            b.extend_from_slice(&1234u32.to_le_bytes());
            b.extend_from_slice(&1234u32.to_le_bytes());
            for v in [addr, addr, size, index] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            b.extend_from_slice(name.as_bytes());
            b.push(0);
            b.extend(std::iter::repeat_n(0xcc, size as usize));
            self.record(CODE_LOAD, time, &b);
        }

        fn moved(&mut self, time: u64, old: u64, new: u64, size: u64, index: u64) {
            let mut b = vec![0; 8];
            for v in [old, old, new, size, index] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            self.record(CODE_MOVE, time, &b);
        }

        fn debug(&mut self, time: u64, addr: u64, rows: &[(u64, u32, &[u8])]) {
            let mut b = Vec::new();
            b.extend_from_slice(&addr.to_le_bytes());
            b.extend_from_slice(&(rows.len() as u64).to_le_bytes());
            for (a, line, file) in rows {
                b.extend_from_slice(&a.to_le_bytes());
                b.extend_from_slice(&line.to_le_bytes());
                b.extend_from_slice(&0u32.to_le_bytes());
                b.extend_from_slice(file);
                b.push(0);
            }
            self.record(CODE_DEBUG_INFO, time, &b);
        }

        fn unwinding(&mut self, time: u64, unwind: u64, hdr: u64, data: usize) {
            let mut b = Vec::new();
            for v in [unwind, hdr, unwind] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            b.extend(std::iter::repeat_n(0, data));
            self.record(CODE_UNWINDING_INFO, time, &b);
        }
    }

    struct Tmp(std::path::PathBuf);
    impl Drop for Tmp {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn tmp(name: &str) -> Tmp {
        Tmp(std::env::temp_dir().join(format!("rsprof-jitdump-{name}-{}", std::process::id())))
    }

    fn dump_of(t: &Tmp, bytes: &[u8]) -> DumpFile {
        std::fs::write(&t.0, bytes).unwrap();
        DumpFile::new(File::open(&t.0).unwrap())
    }

    fn name_at(d: &DumpFile, addr: u64, t: u64) -> Option<String> {
        match d.index.at(addr, t, 0) {
            At::Named { code, .. } => Some(code.name.to_string()),
            _ => None,
        }
    }

    /// An address reused for other code names, at each time, the code loaded there last
    /// before it, whatever was read since; before any load it is unknown, and an address no
    /// record covers is left to the perf map.
    #[test]
    fn a_reused_address_names_the_code_there_at_the_time() {
        let t = tmp("reuse");
        let mut w = Writer::header(MAGIC, 1, 0);
        w.load(100, 0x1000, 0x40, 0, "alpha");
        w.load(200, 0x2000, 0x10, 1, "other");
        w.load(300, 0x1020, 0x40, 2, "beta");
        let mut d = dump_of(&t, &w.0);
        assert!(d.read_tail());
        assert_eq!(d.stats.loads, 3);
        assert_eq!(d.index.at(0x1010, 50, 0), At::Unknown, "before any load");
        assert_eq!(d.index.at(0x5000, 150, 0), At::NotCovered);
        assert_eq!(name_at(&d, 0x1030, 299).as_deref(), Some("alpha"));
        assert_eq!(name_at(&d, 0x1030, 300).as_deref(), Some("beta"));
        assert_eq!(name_at(&d, 0x1050, 10_000).as_deref(), Some("beta"));
        // Outside the reused part, alpha stays alpha after beta's load.
        assert_eq!(name_at(&d, 0x1010, 10_000).as_deref(), Some("alpha"));
        assert!(matches!(d.index.at(0x1030, 299, 0), At::Named { superseded: true, .. }));
        assert!(matches!(d.index.at(0x1030, 301, 0), At::Named { superseded: false, .. }));
        // A span crossing the reuse names nothing; one inside a single code names it.
        assert_eq!(d.index.over(0x1030, 150, 350, 0), Over::Ambiguous);
        assert!(matches!(d.index.over(0x1030, 150, 299, 0), Over::Named(c) if &*c.name == "alpha"));
        assert!(matches!(d.index.over(0x1010, 150, 900, 0), Over::Named(c) if &*c.name == "alpha"));
        assert_eq!(d.index.over(0x1030, 50, 150, 0), Over::Ambiguous, "starts before any load");
        assert_eq!(d.index.latest(0x1030).map(|c| &*c.name), Some("beta"));
        // Memory mapped at 0x1000 at time 250: alpha (loaded at 100) was in the memory
        // unmapped before, so it names nothing there now, though beta's record is not read
        // yet; beta (loaded at 300) does.
        let mut early = Writer::header(MAGIC, 1, 0);
        early.load(100, 0x1000, 0x40, 0, "alpha");
        let mut d = dump_of(&t, &early.0);
        d.read_tail();
        assert_eq!(d.index.at(0x1010, 260, 250), At::Unknown);
        assert!(matches!(d.index.at(0x1010, 260, 100), At::Named { .. }));
        assert_eq!(d.index.over(0x1010, 260, 270, 250), Over::Ambiguous);
        let mut d = dump_of(&t, &w.0);
        d.read_tail();
        assert!(
            matches!(d.index.over(0x1030, 310, 900, 250), Over::Named(c) if &*c.name == "beta")
        );
        assert_eq!(d.index.at(0x1010, 310, 250), At::Unknown, "alpha's part, mapped again");
    }

    #[test]
    fn moves_take_the_name_along_and_leave_nothing_behind() {
        let t = tmp("move");
        let mut w = Writer::header(MAGIC, 1, 0);
        w.load(100, 0x1000, 0x40, 7, "mover");
        w.moved(200, 0x1000, 0x8000, 0x40, 7);
        let mut d = dump_of(&t, &w.0);
        d.read_tail();
        assert_eq!(d.stats.moves, 1);
        assert_eq!(name_at(&d, 0x1010, 150).as_deref(), Some("mover"));
        assert_eq!(d.index.at(0x1010, 250, 0), At::Unknown);
        assert_eq!(name_at(&d, 0x8010, 250).as_deref(), Some("mover"));
        assert_eq!(d.index.at(0x8010, 150, 0), At::Unknown);
    }

    /// Debug-info rows give lines by address, V8's "\xff" repeating the previous file; a
    /// load without one has none; unwinding info is checked and counted.
    #[test]
    fn debug_info_gives_lines_and_unwinding_info_is_counted() {
        let t = tmp("debug");
        let mut w = Writer::header(MAGIC, 1, 0);
        w.debug(90, 0x1000, &[(0x1000, 3, b"/a.js"), (0x1010, 5, b"\xff"), (0x1020, 9, b"/b.js")]);
        w.unwinding(95, 32, 8, 32);
        w.load(100, 0x1000, 0x40, 0, "f");
        w.load(110, 0x2000, 0x40, 1, "g");
        let mut d = dump_of(&t, &w.0);
        d.read_tail();
        assert_eq!((d.stats.debug_info, d.stats.unwinding_info, d.stats.loads), (1, 1, 2));
        let At::Named { code, .. } = d.index.at(0x1015, 200, 0) else { panic!() };
        assert_eq!(code.line_at(0x1015), Some((&"/a.js".into(), 5)));
        assert_eq!(code.line_at(0x1000), Some((&"/a.js".into(), 3)));
        assert_eq!(code.line_at(0x103f), Some((&"/b.js".into(), 9)));
        let At::Named { code, .. } = d.index.at(0x2000, 200, 0) else { panic!() };
        assert_eq!(code.line_at(0x2000), None);
    }

    /// Records arrive as the JIT writes them: a record cut short waits for its end, and is
    /// then read once.
    #[test]
    fn reads_appended_records_and_waits_for_a_partial_one() {
        use std::io::Write as _;
        let t = tmp("tail");
        let mut w = Writer::header(MAGIC, 1, 0);
        w.load(100, 0x1000, 0x10, 0, "first");
        let first_len = w.0.len();
        w.load(200, 0x2000, 0x10, 1, "second");
        let mut d = dump_of(&t, &w.0[..first_len + 30]);
        assert!(d.read_tail());
        assert_eq!(d.stats.loads, 1);
        assert!(!d.read_tail(), "nothing more");
        let mut f = std::fs::OpenOptions::new().append(true).open(&t.0).unwrap();
        f.write_all(&w.0[first_len + 30..]).unwrap();
        assert!(d.read_tail());
        assert_eq!(d.stats.loads, 2);
        assert_eq!(name_at(&d, 0x2000, 300).as_deref(), Some("second"));
        assert!(d.bad.is_none());
    }

    /// A bad magic, byte order, version or record size stops the file's reading, counted;
    /// what was read before a bad record stays.
    #[test]
    fn bad_headers_and_records_are_counted_not_read() {
        let t = tmp("bad");
        for (magic, version, why) in [
            (0x1234_5678, 1, "magic"),
            (MAGIC_SWAPPED, 1, "other byte order"),
            (MAGIC, 7, "version"),
        ] {
            let mut w = Writer::header(magic, version, 0);
            w.load(100, 0x1000, 0x10, 0, "f");
            let mut d = dump_of(&t, &w.0);
            assert!(!d.read_tail());
            assert_eq!(d.bad, Some(Bad::Header(why)));
            assert_eq!(d.stats.bad_header, 1);
            assert!(!d.read_tail(), "not read again");
        }
        // Too short for its own header, then one claiming more than the bound.
        for bad_size in [8u32, MAX_RECORD + 1] {
            let mut w = Writer::header(MAGIC, 1, 0);
            w.load(100, 0x1000, 0x10, 0, "kept");
            w.0.extend_from_slice(&0u32.to_le_bytes());
            w.0.extend_from_slice(&bad_size.to_le_bytes());
            w.0.extend_from_slice(&0u64.to_le_bytes());
            w.load(300, 0x2000, 0x10, 1, "after");
            let mut d = dump_of(&t, &w.0);
            assert!(d.read_tail());
            assert_eq!(d.bad, Some(Bad::Record("size")));
            assert_eq!(d.stats.bad_record, 1);
            assert_eq!(name_at(&d, 0x1000, 200).as_deref(), Some("kept"));
            assert_eq!(d.index.at(0x2000, 400, 0), At::NotCovered);
        }
        // A load whose code size runs past its record.
        let mut w = Writer::header(MAGIC, 1, 0);
        w.load(100, 0x1000, 0x10, 0, "f");
        let at = HEADER + RECORD_HEADER + 24;
        w.0[at..at + 8].copy_from_slice(&0x1000u64.to_le_bytes());
        let mut d = dump_of(&t, &w.0);
        d.read_tail();
        assert_eq!(d.bad, Some(Bad::Record("load code size")));
        // Unwinding info larger than its record.
        let mut w = Writer::header(MAGIC, 1, 0);
        w.unwinding(90, 4096, 8, 16);
        let mut d = dump_of(&t, &w.0);
        d.read_tail();
        assert_eq!(d.bad, Some(Bad::Record("unwinding info size")));
        // Garbage, and a file too short for a header: nothing, no panic.
        let mut d = dump_of(&t, b"JiTD");
        assert!(!d.read_tail());
        assert!(d.bad.is_none());
        let mut d = dump_of(&t, &[0xffu8; 4096]);
        assert!(!d.read_tail());
        assert_eq!(d.bad, Some(Bad::Header("magic")));
    }

    /// Timestamps of the CPU's counter are not our clock: loads name from the start, the
    /// latest winning, as perf map lines do.
    #[test]
    fn arch_timestamps_name_regardless_of_time() {
        let t = tmp("tsc");
        let mut w = Writer::header(MAGIC, 1, FLAG_ARCH_TIMESTAMP);
        w.load(5_000_000, 0x1000, 0x10, 0, "f");
        let mut d = dump_of(&t, &w.0);
        d.read_tail();
        assert_eq!(d.stats.arch_timestamps, 1);
        assert_eq!(name_at(&d, 0x1000, 1).as_deref(), Some("f"));
    }

    /// A range reused without end keeps its last `MAX_VERSIONS` codes; the index stays
    /// bounded by `MAX_PIECES`.
    #[test]
    fn versions_and_pieces_are_bounded() {
        let mut ix = CodeIndex::default();
        for i in 0..100u64 {
            let code = Arc::new(Code { name: format!("f{i}").into(), lines: Vec::new() });
            ix.place(0x1000, 0x1010, 10 * i, Some(code));
        }
        assert_eq!(ix.pieces[&0x1000].versions.len(), MAX_VERSIONS);
        assert!(matches!(ix.at(0x1000, 995, 0), At::Named { code, .. } if &*code.name == "f99"));
        assert_eq!(ix.at(0x1000, 5, 0), At::Unknown, "older codes forgotten");
        let mut ix = CodeIndex::default();
        for i in 0..(MAX_PIECES as u64 + 10) {
            let code = Arc::new(Code { name: "x".into(), lines: Vec::new() });
            ix.place(i * 0x10, i * 0x10 + 8, 1, Some(code));
        }
        assert!(ix.over_bound);
        assert_eq!(ix.len(), MAX_PIECES);
    }

    #[test]
    fn dump_paths_as_writers_name_them() {
        assert!(is_dump_path("/tmp/jit-1234.dump"));
        assert!(is_dump_path("/srv/app/jit-7.dump"));
        assert!(!is_dump_path("/tmp/jit-.dump"));
        assert!(!is_dump_path("/tmp/jit-12a.dump"));
        assert!(!is_dump_path("/tmp/perf-12.map"));
    }
}
