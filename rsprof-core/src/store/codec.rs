//! Stored events and their block encoding.
//!
//! A block is one event: a kind byte, then LEB128 varints. Thread timestamps are deltas from
//! the same thread's previous event in the same chunk (zigzag, so a marker that starts before
//! the thread's last sample still encodes), and a thread's first event in a chunk is relative
//! to the chunk's base time: every chunk decodes without its predecessors. Stacks and strings
//! are ids into tables kept beside the chunks.

use std::collections::HashMap;

pub use crate::model::markers::MarkerPhase;
use crate::model::{
    OffCpu,
    ids::{Pid, StackId, StringId, ThreadKey, Tid},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredSample {
    pub time_ns: u64,
    pub cpu_delta_ns: u64,
    pub stack: Option<StackId>,
    /// Off-CPU time (then `cpu_delta_ns` is 0). Its own block kind: CPU samples keep their
    /// compact encoding.
    pub off_cpu: Option<OffCpu>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MarkerField {
    Str(StringId),
    Int(i64),
    Uint(u64),
    /// No value: the payload leaves this schema field out.
    Absent,
}

/// A marker on a thread. `schema` names its payload type (a `meta.markerSchema` entry) and
/// `fields` follow that schema's field order. Instant and IntervalStart markers have
/// `end_ns == start_ns`; IntervalEnd markers have `start_ns == end_ns`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredMarker {
    pub phase: MarkerPhase,
    pub start_ns: u64,
    pub end_ns: u64,
    pub name: StringId,
    pub schema: StringId,
    pub fields: Vec<MarkerField>,
}

impl StoredMarker {
    /// The time the marker is filed under (its start, or its end for an IntervalEnd).
    pub fn time_ns(&self) -> u64 {
        if self.phase == MarkerPhase::IntervalEnd { self.end_ns } else { self.start_ns }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoredEvent {
    Sample(ThreadKey, StoredSample),
    Marker(ThreadKey, StoredMarker),
}

impl StoredEvent {
    pub fn thread(&self) -> ThreadKey {
        match self {
            StoredEvent::Sample(t, _) | StoredEvent::Marker(t, _) => *t,
        }
    }

    pub fn time_ns(&self) -> u64 {
        match self {
            StoredEvent::Sample(_, s) => s.time_ns,
            StoredEvent::Marker(_, m) => m.time_ns(),
        }
    }
}

const KIND_SAMPLE: u8 = 1;
const KIND_MARKER: u8 = 2;
const KIND_OFF_CPU: u8 = 3;
const FIELD_STR: u8 = 0;
const FIELD_INT: u8 = 1;
const FIELD_UINT: u8 = 2;
const FIELD_ABSENT: u8 = 3;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockError {
    UnknownKind(u8),
    /// A varint or field runs off the end of the block, or a value is out of range.
    Malformed(&'static str),
    /// Bytes left over after the event.
    TrailingBytes(usize),
}

impl std::fmt::Display for BlockError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::UnknownKind(k) => write!(f, "unknown block kind {k}"),
            Self::Malformed(what) => write!(f, "malformed block ({what})"),
            Self::TrailingBytes(n) => write!(f, "{n} bytes after the event in a block"),
        }
    }
}

impl std::error::Error for BlockError {}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

fn put(out: &mut Vec<u8>, v: u64) {
    leb128::write::unsigned(out, v).expect("Vec write");
}

/// Per-chunk delta state, identical on the encoding and the decoding side.
#[derive(Debug, Default)]
pub struct ChunkTimes {
    base_ns: u64,
    /// Looked up for every event: a fast hash (the keys are no secret to protect).
    last: HashMap<ThreadKey, u64, foldhash::fast::RandomState>,
}

impl ChunkTimes {
    pub fn new(base_ns: u64) -> Self {
        Self { base_ns, last: HashMap::default() }
    }

    fn delta(&mut self, thread: ThreadKey, time_ns: u64) -> u64 {
        let prev = self.last.insert(thread, time_ns).unwrap_or(self.base_ns);
        zigzag(time_ns.wrapping_sub(prev) as i64)
    }

    fn undelta(&mut self, thread: ThreadKey, delta: u64) -> u64 {
        let prev = self.last.get(&thread).copied().unwrap_or(self.base_ns);
        let t = prev.wrapping_add(unzigzag(delta) as u64);
        self.last.insert(thread, t);
        t
    }
}

/// The idle tasks are written as the kernel numbers them (pid 0), with their CPU as tid: no
/// real task has pid 0.
fn put_thread(out: &mut Vec<u8>, t: ThreadKey) {
    let (pid, tid) = match t {
        ThreadKey::Idle { cpu } => (0, cpu),
        ThreadKey::Task { pid, tid } => (pid.0, tid.0),
    };
    put(out, tid as u64);
    // Most events come from a process's main thread: pid == tid costs a byte.
    put(out, if pid == tid { 0 } else { pid as u64 + 1 });
}

const PHASES: [MarkerPhase; 4] = [
    MarkerPhase::Instant,
    MarkerPhase::Interval,
    MarkerPhase::IntervalStart,
    MarkerPhase::IntervalEnd,
];

fn phase_code(p: MarkerPhase) -> u8 {
    PHASES.iter().position(|&q| q == p).expect("every phase is listed") as u8
}

/// Appends the encoding of `ev` to `out` (cleared first).
pub fn encode(ev: &StoredEvent, times: &mut ChunkTimes, out: &mut Vec<u8>) {
    out.clear();
    match ev {
        StoredEvent::Sample(t, s) => match s.off_cpu {
            None => {
                out.push(KIND_SAMPLE);
                put_thread(out, *t);
                put(out, times.delta(*t, s.time_ns));
                put(out, s.cpu_delta_ns);
                put(out, s.stack.map_or(0, |id| id.0 as u64 + 1));
            }
            Some(o) => {
                out.push(KIND_OFF_CPU);
                put_thread(out, *t);
                put(out, times.delta(*t, s.time_ns));
                put(out, s.stack.map_or(0, |id| id.0 as u64 + 1));
                put(out, o.weight_ns);
                // Usually a single block: weight == block, one byte.
                put(out, zigzag(o.weight_ns.wrapping_sub(o.block_ns) as i64));
                put(out, o.blocks as u64);
                put(out, o.state as u64);
            }
        },
        StoredEvent::Marker(t, m) => {
            out.push(KIND_MARKER);
            put_thread(out, *t);
            out.push(phase_code(m.phase));
            put(out, times.delta(*t, m.time_ns()));
            if m.phase == MarkerPhase::Interval {
                put(out, m.end_ns.saturating_sub(m.start_ns));
            }
            put(out, m.name.0 as u64);
            put(out, m.schema.0 as u64);
            put(out, m.fields.len() as u64);
            for f in &m.fields {
                match *f {
                    MarkerField::Str(s) => {
                        out.push(FIELD_STR);
                        put(out, s.0 as u64);
                    }
                    MarkerField::Int(v) => {
                        out.push(FIELD_INT);
                        put(out, zigzag(v));
                    }
                    MarkerField::Uint(v) => {
                        out.push(FIELD_UINT);
                        put(out, v);
                    }
                    // Padded to two bytes like every other field (the decoder's size check).
                    MarkerField::Absent => {
                        out.push(FIELD_ABSENT);
                        put(out, 0);
                    }
                }
            }
        }
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn u64(&mut self, what: &'static str) -> Result<u64, BlockError> {
        leb128::read::unsigned(&mut self.0).map_err(|_| BlockError::Malformed(what))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, BlockError> {
        u32::try_from(self.u64(what)?).map_err(|_| BlockError::Malformed(what))
    }

    fn byte(&mut self, what: &'static str) -> Result<u8, BlockError> {
        let (&b, rest) = self.0.split_first().ok_or(BlockError::Malformed(what))?;
        self.0 = rest;
        Ok(b)
    }

    fn thread(&mut self) -> Result<ThreadKey, BlockError> {
        let tid = self.u32("tid")?;
        let pid = match self.u64("pid")? {
            0 => tid,
            p => u32::try_from(p - 1).map_err(|_| BlockError::Malformed("pid"))?,
        };
        Ok(if pid == 0 {
            ThreadKey::Idle { cpu: tid }
        } else {
            ThreadKey::Task { pid: Pid(pid), tid: Tid(tid) }
        })
    }
}

pub fn decode(block: &[u8], times: &mut ChunkTimes) -> Result<StoredEvent, BlockError> {
    let mut r = Reader(block);
    let ev = match r.byte("kind")? {
        KIND_SAMPLE => {
            let t = r.thread()?;
            let time_ns = times.undelta(t, r.u64("time")?);
            let cpu_delta_ns = r.u64("cpu delta")?;
            let stack = r.u32("stack")?.checked_sub(1).map(StackId);
            StoredEvent::Sample(t, StoredSample { time_ns, cpu_delta_ns, stack, off_cpu: None })
        }
        KIND_OFF_CPU => {
            let t = r.thread()?;
            let time_ns = times.undelta(t, r.u64("time")?);
            let stack = r.u32("stack")?.checked_sub(1).map(StackId);
            let weight_ns = r.u64("off-CPU weight")?;
            let block_ns = weight_ns.wrapping_sub(unzigzag(r.u64("off-CPU block")?) as u64);
            let blocks = r.u32("off-CPU blocks")?;
            let state = r.u32("off-CPU state")?;
            let off_cpu = Some(OffCpu { weight_ns, block_ns, blocks, state });
            StoredEvent::Sample(t, StoredSample { time_ns, cpu_delta_ns: 0, stack, off_cpu })
        }
        KIND_MARKER => {
            let t = r.thread()?;
            let phase =
                *PHASES.get(r.byte("phase")? as usize).ok_or(BlockError::Malformed("phase"))?;
            let time = times.undelta(t, r.u64("time")?);
            let end_ns = if phase == MarkerPhase::Interval {
                time.checked_add(r.u64("duration")?).ok_or(BlockError::Malformed("duration"))?
            } else {
                time
            };
            let name = StringId(r.u32("name")?);
            let schema = StringId(r.u32("schema")?);
            let n = r.u64("field count")?;
            // Each field takes at least two bytes: refuse counts the block cannot hold.
            if n > r.0.len() as u64 / 2 {
                return Err(BlockError::Malformed("field count"));
            }
            let mut fields = Vec::with_capacity(n as usize);
            for _ in 0..n {
                fields.push(match r.byte("field tag")? {
                    FIELD_STR => MarkerField::Str(StringId(r.u32("string field")?)),
                    FIELD_INT => MarkerField::Int(unzigzag(r.u64("int field")?)),
                    FIELD_UINT => MarkerField::Uint(r.u64("uint field")?),
                    FIELD_ABSENT => {
                        r.u64("absent field")?;
                        MarkerField::Absent
                    }
                    _ => return Err(BlockError::Malformed("field tag")),
                });
            }
            StoredEvent::Marker(
                t,
                StoredMarker { phase, start_ns: time, end_ns, name, schema, fields },
            )
        }
        k => return Err(BlockError::UnknownKind(k)),
    };
    if !r.0.is_empty() {
        return Err(BlockError::TrailingBytes(r.0.len()));
    }
    Ok(ev)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(pid: u32, tid: u32) -> ThreadKey {
        ThreadKey::Task { pid: Pid(pid), tid: Tid(tid) }
    }

    #[test]
    fn events_round_trip_with_per_thread_deltas() {
        let evs = vec![
            StoredEvent::Sample(
                key(10, 10),
                StoredSample { time_ns: 1_000, cpu_delta_ns: 0, stack: None, off_cpu: None },
            ),
            StoredEvent::Sample(
                key(10, 11),
                StoredSample {
                    time_ns: 900,
                    cpu_delta_ns: 0,
                    stack: Some(StackId(0)),
                    off_cpu: Some(OffCpu {
                        weight_ns: 2_000_000,
                        block_ns: 30_000,
                        blocks: 40,
                        state: 1,
                    }),
                },
            ),
            StoredEvent::Marker(
                key(10, 10),
                StoredMarker {
                    phase: MarkerPhase::Interval,
                    start_ns: 500,
                    end_ns: 2_000,
                    name: StringId(3),
                    schema: StringId(1),
                    fields: vec![
                        MarkerField::Str(StringId(2)),
                        MarkerField::Int(-7),
                        MarkerField::Uint(u64::MAX),
                        MarkerField::Absent,
                    ],
                },
            ),
            StoredEvent::Sample(
                key(10, 10),
                StoredSample {
                    time_ns: 2_000_000,
                    cpu_delta_ns: 999_000,
                    stack: Some(StackId(u32::MAX - 1)),
                    off_cpu: None,
                },
            ),
        ];
        let (mut enc, mut dec) = (ChunkTimes::new(1_000), ChunkTimes::new(1_000));
        let mut buf = Vec::new();
        for ev in &evs {
            encode(ev, &mut enc, &mut buf);
            assert_eq!(&decode(&buf, &mut dec).unwrap(), ev);
        }
        // A typical sample: kind 1, tid 2 + pid 1, ~1 ms delta 3, ~1 ms cpu 3, stack id 3 bytes.
        let typical = StoredEvent::Sample(
            key(4000, 4000),
            StoredSample {
                time_ns: 2_000_000,
                cpu_delta_ns: 999_000,
                stack: Some(StackId(40_000)),
                off_cpu: None,
            },
        );
        encode(&typical, &mut ChunkTimes::new(1_000_000), &mut buf);
        assert_eq!(buf.len(), 13);
    }

    #[test]
    fn malformed_blocks_are_errors() {
        let mut t = ChunkTimes::new(0);
        assert_eq!(decode(&[], &mut t), Err(BlockError::Malformed("kind")));
        assert_eq!(decode(&[9], &mut t), Err(BlockError::UnknownKind(9)));
        assert!(decode(&[KIND_SAMPLE, 0x80], &mut t).is_err());
        assert_eq!(
            decode(&[KIND_SAMPLE, 1, 0, 0, 0, 0, 7], &mut t),
            Err(BlockError::TrailingBytes(1))
        );
        assert!(decode(&[KIND_MARKER, 1, 0, 0, 0, 0, 0, 0x7f], &mut t).is_err());
    }
}
