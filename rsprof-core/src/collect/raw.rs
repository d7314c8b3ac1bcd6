//! The raw stream (`record --save-raw`, `rsprof-bpf replay`): what a recording's collector
//! was fed — each ring-buffer record as the kernel wrote it, and the /proc facts, cgroup
//! paths and kernel symbol names it read — so the collector, store and writers can run again
//! without root or BPF on a user's recording. Everything that is gone after the recording is
//! in the stream; ELF files are read again from disk at replay.
//!
//! Layout, gzip-compressed as a whole: the magic and a little-endian u32 version, then
//! entries of one kind byte, a little-endian u32 length and the payload. Ring records are
//! their bytes as they came; everything else is JSON (rare: per process, per drain).

use std::{
    fs::File,
    io::{self, BufReader, BufWriter, Read, Write},
    path::Path,
};

use anyhow::{Context as _, Result, bail};
use flate2::{Compression, read::MultiGzDecoder, write::GzEncoder};
use serde::{Deserialize, Serialize};

use crate::model::{ids::Pid, recording::RecordingInfo, time::MonoNs};

pub const MAGIC: &[u8; 8] = b"RSPROFRW";
/// Changes whenever a reader of the previous version would misread the stream. The ring
/// records' own layout is the BPF object's: a replay decodes them with this build's decoder,
/// so a stream is replayed by the version of rsprof-bpf that recorded it (`Start::product`).
pub const VERSION: u32 = 1;
/// Larger than any ring record or JSON entry we write (a kernel symbol batch is the largest).
const MAX_ENTRY: u32 = 256 << 20;

const RING: u8 = 1;
const DRAIN: u8 = 2;
const START: u8 = 3;
const IDENTITY: u8 = 4;
const MAPS: u8 = 5;
const EXISTING: u8 = 6;
const SCAN_DONE: u8 = 7;
const CGROUPS: u8 = 8;
const KERNEL_SYMBOLS: u8 = 9;
const END: u8 = 10;
const INFO: u8 = 11;

/// How the recording's collector was set up: the stream's first entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Start {
    /// e.g. `rsprof-bpf 0.1.0`: the ring records' layout is that version's.
    pub product: String,
    pub host: String,
    /// What was recorded (`RecordPlan::describe`), for the reader.
    pub targets: String,
    /// The store's memory bound (recycling depends on it).
    pub buffer_bytes: usize,
    /// `--unwind dwarf-fp`: stack copies fall back to frame pointers.
    pub fp_fallback: bool,
    /// Size of the vDSO image (from the recorder's /proc/self/maps).
    pub vdso_len: Option<u64>,
}

/// The recording's time base and description ([`RecordingInfo`] but its end), written once
/// sampling starts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Info {
    pub start_ns: u64,
    pub start_wall_ms: f64,
    pub frequency: u64,
    pub logical_cpus: u32,
    pub physical_cpus: u32,
    pub product: String,
    pub oscpu: String,
}

impl Info {
    pub fn new(info: &RecordingInfo) -> Self {
        Self {
            start_ns: info.start.0,
            start_wall_ms: info.start_wall_ms,
            frequency: info.frequency,
            logical_cpus: info.logical_cpus,
            physical_cpus: info.physical_cpus,
            product: info.product.clone(),
            oscpu: info.oscpu.clone(),
        }
    }

    /// The recording's info, ending at `end`.
    pub fn at(&self, end: MonoNs) -> RecordingInfo {
        RecordingInfo {
            start: MonoNs(self.start_ns),
            start_wall_ms: self.start_wall_ms,
            end,
            frequency: self.frequency,
            logical_cpus: self.logical_cpus,
            physical_cpus: self.physical_cpus,
            product: self.product.clone(),
            oscpu: self.oscpu.clone(),
        }
    }
}

/// What /proc said of a process's name, command line and executable when first seen.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub pid: u32,
    pub comm: String,
    pub argv: Vec<String>,
    pub exe: Option<String>,
}

/// /proc/PID/maps when first read: its text, or why not.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MapsRead {
    Text(String),
    /// The process had exited.
    Gone,
    Failed(String),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Maps {
    pub pid: u32,
    pub read: MapsRead,
}

/// A kernel address and the name the recorder's kernel gave it (None: none).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelName {
    pub addr: u64,
    pub name: Option<(String, u64, u64)>,
}

/// How the recording ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct End {
    pub end_ns: u64,
    pub stop_reason: String,
    /// The kernel counters by `profiler_common::counter` index.
    pub counters: Vec<u64>,
}

/// One entry of the stream.
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    /// A ring-buffer record as the kernel wrote it.
    Ring(Vec<u8>),
    /// The end of a drain of the ring, at this time.
    Drain(MonoNs),
    Start(Box<Start>),
    Info(Box<Info>),
    Identity(Identity),
    Maps(Maps),
    /// A process that existed before sampling was registered (`Collector::register_existing`).
    Existing(Pid),
    /// `Collector::initial_scan_done`.
    ScanDone,
    /// cgroup id → path, as the recording resolved them.
    Cgroups(Vec<(u64, String)>),
    KernelSymbols(Vec<KernelName>),
    End(End),
}

/// Writes a raw stream. Write errors are kept, not returned per entry: a recording goes on
/// without its raw copy, and `finish` reports the first one.
pub struct RawWriter {
    out: Option<GzEncoder<BufWriter<File>>>,
    error: Option<io::Error>,
    pub entries: u64,
}

impl RawWriter {
    /// Creates (truncates) `path` and writes the header: fails now if it is not writable.
    pub fn create(path: &Path) -> Result<Self> {
        let file = File::create(path).with_context(|| format!("create {}", path.display()))?;
        // Level 1: the stream is written while recording, on the event loop.
        let mut out = GzEncoder::new(BufWriter::with_capacity(1 << 20, file), Compression::fast());
        out.write_all(MAGIC)?;
        out.write_all(&VERSION.to_le_bytes())?;
        Ok(Self { out: Some(out), error: None, entries: 0 })
    }

    fn put(&mut self, kind: u8, payload: &[u8]) {
        let Some(out) = &mut self.out else { return };
        let r = (|| {
            let len = u32::try_from(payload.len())
                .ok()
                .filter(|&n| n <= MAX_ENTRY)
                .ok_or_else(|| io::Error::other("raw entry too large"))?;
            out.write_all(&[kind])?;
            out.write_all(&len.to_le_bytes())?;
            out.write_all(payload)
        })();
        match r {
            Ok(()) => self.entries += 1,
            Err(e) => {
                self.error = Some(e);
                self.out = None;
            }
        }
    }

    fn put_json<T: Serialize>(&mut self, kind: u8, v: &T) {
        match serde_json::to_vec(v) {
            Ok(bytes) => self.put(kind, &bytes),
            Err(e) => self.error = self.error.take().or(Some(io::Error::other(e))),
        }
    }

    pub fn ring(&mut self, record: &[u8]) {
        self.put(RING, record);
    }

    pub fn write(&mut self, e: &Entry) {
        match e {
            Entry::Ring(r) => self.ring(r),
            Entry::Drain(t) => self.put(DRAIN, &t.0.to_le_bytes()),
            Entry::Start(s) => self.put_json(START, s),
            Entry::Info(i) => self.put_json(INFO, i),
            Entry::Identity(i) => self.put_json(IDENTITY, i),
            Entry::Maps(m) => self.put_json(MAPS, m),
            Entry::Existing(pid) => self.put(EXISTING, &pid.0.to_le_bytes()),
            Entry::ScanDone => self.put(SCAN_DONE, &[]),
            Entry::Cgroups(c) => self.put_json(CGROUPS, c),
            Entry::KernelSymbols(k) => self.put_json(KERNEL_SYMBOLS, k),
            Entry::End(end) => self.put_json(END, end),
        }
    }

    /// Ends the gzip stream and flushes the file; the first error met while writing, if any.
    pub fn finish(&mut self) -> io::Result<()> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let Some(out) = self.out.take() else { return Ok(()) };
        let file = out.finish()?.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()
    }
}

/// Reads a raw stream entry by entry.
pub struct RawReader<R: Read> {
    input: R,
    /// Entries read so far, for errors.
    pub entries: u64,
}

impl RawReader<MultiGzDecoder<BufReader<File>>> {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("open {}", path.display()))?;
        Self::new(MultiGzDecoder::new(BufReader::new(file)))
            .with_context(|| format!("{} is not an rsprof-bpf raw stream", path.display()))
    }
}

impl<R: Read> RawReader<R> {
    /// Checks the magic and the version.
    pub fn new(mut input: R) -> Result<Self> {
        let mut head = [0u8; 12];
        input.read_exact(&mut head).context("reading its header")?;
        if &head[..8] != MAGIC {
            bail!("no raw stream header");
        }
        let version = u32::from_le_bytes(head[8..].try_into().expect("4 bytes"));
        if version != VERSION {
            bail!("raw stream version {version}; this build reads version {VERSION}");
        }
        Ok(Self { input, entries: 0 })
    }

    /// The next entry; None at the end of the stream (which must fall between entries).
    pub fn next_entry(&mut self) -> Result<Option<Entry>> {
        let mut head = [0u8; 5];
        match read_full(&mut self.input, &mut head)
            .with_context(|| format!("after entry {}", self.entries))?
        {
            0 => return Ok(None),
            5 => {}
            _ => bail!("truncated after entry {}: partial entry header", self.entries),
        }
        let kind = head[0];
        let len = u32::from_le_bytes(head[1..].try_into().expect("4 bytes"));
        if len > MAX_ENTRY {
            bail!("entry {} claims {len} bytes: not a raw stream, or corrupt", self.entries + 1);
        }
        let mut payload = vec![0u8; len as usize];
        let got = read_full(&mut self.input, &mut payload)
            .with_context(|| format!("reading entry {}", self.entries + 1))?;
        if got < payload.len() {
            bail!(
                "truncated in entry {} ({got} of {len} bytes): the recording did not finish \
                 writing it",
                self.entries + 1
            );
        }
        self.entries += 1;
        let n = self.entries;
        let json = |what: &str| format!("entry {n}: bad {what}");
        Ok(Some(match kind {
            RING => Entry::Ring(payload),
            DRAIN => Entry::Drain(MonoNs(u64::from_le_bytes(fixed(&payload, n)?))),
            START => Entry::Start(serde_json::from_slice(&payload).with_context(|| json("start"))?),
            INFO => Entry::Info(serde_json::from_slice(&payload).with_context(|| json("info"))?),
            IDENTITY => {
                Entry::Identity(serde_json::from_slice(&payload).with_context(|| json("identity"))?)
            }
            MAPS => Entry::Maps(serde_json::from_slice(&payload).with_context(|| json("maps"))?),
            EXISTING => Entry::Existing(Pid(u32::from_le_bytes(fixed(&payload, n)?))),
            SCAN_DONE => Entry::ScanDone,
            CGROUPS => {
                Entry::Cgroups(serde_json::from_slice(&payload).with_context(|| json("cgroups"))?)
            }
            KERNEL_SYMBOLS => Entry::KernelSymbols(
                serde_json::from_slice(&payload).with_context(|| json("kernel symbols"))?,
            ),
            END => Entry::End(serde_json::from_slice(&payload).with_context(|| json("end"))?),
            k => bail!("entry {n} is of unknown kind {k}"),
        }))
    }
}

fn fixed<const N: usize>(payload: &[u8], n: u64) -> Result<[u8; N]> {
    payload.try_into().map_err(|_| anyhow::anyhow!("entry {n}: {} bytes, want {N}", payload.len()))
}

/// Reads until `buf` is full or the input ends; the bytes read.
fn read_full(input: &mut impl Read, buf: &mut [u8]) -> Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match input.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                bail!("truncated: the compressed stream ends early ({e})")
            }
            Err(e) => return Err(anyhow::Error::new(e).context("corrupt compressed stream")),
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_kind() -> Vec<Entry> {
        let info = RecordingInfo {
            start: MonoNs(5),
            start_wall_ms: 1.7e12,
            end: MonoNs(5),
            frequency: 999,
            logical_cpus: 2,
            physical_cpus: 1,
            product: "rsprof-bpf test".into(),
            oscpu: "Linux 6".into(),
        };
        let start = Start {
            product: info.product.clone(),
            host: "host".into(),
            targets: "every process".into(),
            buffer_bytes: 64 << 20,
            fp_fallback: true,
            vdso_len: Some(8192),
        };
        vec![
            Entry::Start(Box::new(start)),
            Entry::Info(Box::new(Info::new(&info))),
            Entry::Identity(Identity {
                pid: 7,
                comm: "busy".into(),
                argv: vec!["./busy".into(), "x y".into()],
                exe: Some("/tmp/busy".into()),
            }),
            Entry::Maps(Maps { pid: 7, read: MapsRead::Text("55-66 r-xp 0 fd:01 3 /x\n".into()) }),
            Entry::Maps(Maps { pid: 8, read: MapsRead::Gone }),
            Entry::Maps(Maps { pid: 9, read: MapsRead::Failed("denied".into()) }),
            Entry::Existing(Pid(7)),
            Entry::ScanDone,
            Entry::Ring(vec![1, 2, 3, 0, 255]),
            Entry::Ring(Vec::new()),
            Entry::Drain(MonoNs(123_456_789)),
            Entry::Cgroups(vec![(42, "/system.slice/x.service".into())]),
            Entry::KernelSymbols(vec![
                KernelName { addr: 0xffff_ffff_8100_0000, name: Some(("f".into(), 3, 16)) },
                KernelName { addr: 0xffff_ffff_8100_1000, name: None },
            ]),
            Entry::End(End { end_ns: 99, stop_reason: "duration".into(), counters: vec![1, 0] }),
        ]
    }

    /// The file `RawWriter` makes of `entries` (under `name`: tests run in parallel).
    fn written(name: &str, entries: &[Entry]) -> Vec<u8> {
        let dir = std::env::temp_dir().join(format!("rsprof-raw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        let mut w = RawWriter::create(&path).unwrap();
        for e in entries {
            w.write(e);
        }
        w.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        bytes
    }

    fn read_all(bytes: &[u8]) -> Result<Vec<Entry>> {
        let mut r = RawReader::new(MultiGzDecoder::new(bytes))?;
        let mut out = Vec::new();
        while let Some(e) = r.next_entry()? {
            out.push(e);
        }
        Ok(out)
    }

    #[test]
    fn every_kind_of_entry_round_trips() {
        let entries = every_kind();
        assert_eq!(read_all(&written("round-trip.raw", &entries)).unwrap(), entries);
    }

    /// A stream cut anywhere is an error saying so (or, cut between entries, fewer entries),
    /// never a panic; garbage is not taken for a stream.
    #[test]
    fn cut_and_garbage_streams_are_errors() {
        let entries = every_kind();
        let bytes = written("cut.raw", &entries);
        let mut plain = Vec::new();
        MultiGzDecoder::new(&bytes[..]).read_to_end(&mut plain).unwrap();
        for cut in 0..plain.len() {
            let mut r = match RawReader::new(&plain[..cut]) {
                Ok(r) => r,
                Err(e) => {
                    assert!(cut < 12, "header at {cut}: {e:#}");
                    continue;
                }
            };
            let mut n = 0;
            let end = loop {
                match r.next_entry() {
                    Ok(Some(_)) => n += 1,
                    Ok(None) => break Ok(n),
                    Err(e) => break Err(e),
                }
            };
            match end {
                Ok(n) => assert!(n < entries.len() || cut == plain.len()),
                Err(e) => assert!(format!("{e:#}").contains("truncated"), "cut {cut}: {e:#}"),
            }
        }
        // The compressed file cut short: an error from the decoder or the reader.
        assert!(read_all(&bytes[..bytes.len() / 2]).is_err());
        let e = read_all(b"{\"meta\": {}}").unwrap_err();
        assert!(format!("{e:#}").contains("header") || format!("{e:#}").contains("gzip"), "{e:#}");
        // A header with a lying length.
        let mut bad = plain[..12].to_vec();
        bad.extend([RING, 0xff, 0xff, 0xff, 0xff]);
        let e = RawReader::new(&bad[..]).unwrap().next_entry().unwrap_err();
        assert!(format!("{e:#}").contains("claims"), "{e:#}");
        let mut bad = plain[..12].to_vec();
        bad.extend([77, 0, 0, 0, 0]);
        let e = RawReader::new(&bad[..]).unwrap().next_entry().unwrap_err();
        assert!(format!("{e:#}").contains("unknown kind"), "{e:#}");
        let mut bad = plain[..8].to_vec();
        bad.extend(99u32.to_le_bytes());
        let e = RawReader::new(&bad[..]).err().unwrap();
        assert!(format!("{e:#}").contains("version 99"), "{e:#}");
    }
}
