//! Sample and marker storage with a memory limit: events are encoded into the chunked buffer
//! (`chunks`, `events`); stacks and strings live in interned tables beside it.
//!
//! Stacks are a prefix tree of normalized frames ([`FrameAddr`]: kernel addresses and
//! (module, file offset) pairs, which mean the same thing after the process is gone), so a
//! stack costs one node per frame it does not share with one seen before.
//!
//! Memory stays bounded: chunk bytes never exceed the buffer size, and each table entry is
//! stamped with the last chunk that referred to it, so recycling a chunk prunes what only it
//! used. If the tables alone outgrow half the buffer size (e.g. every sample a new deep stack),
//! the oldest chunks are recycled early until they fit.

use std::collections::{HashMap, HashSet};

pub mod chunks;
pub mod codec;
pub(crate) mod intern;

pub mod snapshot;

use crate::{
    model::{
        address::FrameAddr,
        ids::{ModuleId, Pid, StackId, StringId, ThreadKey, Tid},
    },
    store::{
        chunks::{ChunkedBuffer, PushError, RecycledChunk},
        codec::{ChunkTimes, MarkerField, StoredEvent, StoredMarker, StoredSample},
        intern::PrunableInterner,
        snapshot::StoreSnapshot,
    },
};

/// One node of the stack prefix tree: a frame and the stack it was called from.
pub type StackNode = (Option<StackId>, FrameAddr);

/// Approximate heap cost of one table entry (value stored twice, hash slot, generation).
const STACK_NODE_BYTES: usize = 80;
const STRING_BYTES: usize = 112;

/// Where an agent's window ended in the store: a chunk and how many of its blocks were read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowCursor {
    pub seq: u64,
    pub blocks: u32,
}

/// One window of events (see [`ChunkedStore::window_snapshot`]).
pub struct WindowSnapshot {
    pub snapshot: StoreSnapshot,
    /// Where the next window starts.
    pub next: WindowCursor,
    /// Events of this window recycled before it was read (buffer full).
    pub lost: u64,
}

/// Where the collector puts what it decoded.
pub trait SampleSink {
    /// `frames` is root first; None for an empty stack.
    fn intern_stack(&mut self, frames: &[FrameAddr]) -> Option<StackId>;
    fn intern_string(&mut self, s: &str) -> StringId;
    fn push_sample(&mut self, thread: ThreadKey, sample: StoredSample);
    fn push_marker(&mut self, thread: ThreadKey, marker: StoredMarker);
    /// Processes no stored event refers to any more (their last events were recycled).
    fn take_released_pids(&mut self) -> Vec<Pid>;
    /// Whether a stored event refers to `pid`.
    fn holds_pid(&self, pid: Pid) -> bool;
    /// Threads no stored event refers to any more (their last events were recycled).
    fn take_released_threads(&mut self) -> Vec<(Pid, Tid)>;
    /// Whether a stored event refers to thread `tid` of `pid`.
    fn holds_thread(&self, pid: Pid, tid: Tid) -> bool;
    /// Adds the modules stored stacks refer to.
    fn referenced_modules(&self, out: &mut HashSet<ModuleId>);
    /// When stacks are interned: a stack id handed out under an older `epoch` may have been
    /// pruned and its id reused; one handed out in an older `generation` of the same epoch is
    /// still valid but must be [`touched`](SampleSink::touch_stack) before it is reused.
    fn stack_stamp(&self) -> StackStamp;
    /// Marks the nodes of `id` (valid in the current epoch) used now, as interning its frames
    /// again would: lets a caller that keeps its own map from samples to stack ids reuse one.
    fn touch_stack(&mut self, id: StackId);
}

/// See [`SampleSink::stack_stamp`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackStamp {
    pub epoch: u64,
    pub generation: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub samples: u64,
    pub markers: u64,
    /// Events that could not be stored (larger than a chunk).
    pub oversized: u64,
    pub pruned_stack_nodes: u64,
    pub pruned_strings: u64,
    /// Chunks recycled early because the interned tables reached their budget.
    pub table_pressure_recycles: u64,
}

pub struct ChunkedStore {
    buffer: ChunkedBuffer,
    times: ChunkTimes,
    stacks: PrunableInterner<StackNode>,
    /// Whole stacks interned recently → their leaf node and the generation they were last
    /// interned in: a repeated stack (idle CPUs, a hot loop) costs one lookup instead of one
    /// per frame. Emptied whenever stack nodes are pruned (their ids may then be reused), and
    /// when it reaches RECENT_STACKS_MAX.
    recent_stacks: RecentStacks,
    strings: PrunableInterner<String>,
    /// Last chunk holding an event of each process.
    pid_last_chunk: HashMap<Pid, u64, foldhash::fast::RandomState>,
    released: Vec<Pid>,
    /// The same for each thread (a long-lived process starts and ends many).
    thread_last_chunk: HashMap<(Pid, Tid), u64, foldhash::fast::RandomState>,
    /// Counts prunings of stack nodes (see [`SampleSink::stack_stamp`]).
    stack_epoch: u64,
    released_threads: Vec<(Pid, Tid)>,
    table_budget: usize,
    scratch: Vec<u8>,
    /// How long chunks an agent's windows have read are kept (its flight recorder); None:
    /// released once read.
    retain_ns: Option<u64>,
    /// Where the last window ended, and events recycled since that it had not read.
    read_to: WindowCursor,
    unread_recycled: u64,
    /// Without a retention, the next event starts a new chunk: a window's chunk can then be
    /// released by the next window instead of staying (with every process, thread, stack and
    /// string it refers to) until it fills, which at an idle host's rate takes many minutes.
    seal_at_next_push: bool,
    pub stats: StoreStats,
}

type RecentStacks = HashMap<Box<[FrameAddr]>, (StackId, u64), foldhash::fast::RandomState>;
/// Bounds `recent_stacks` (at ~30 frames a stack, well under a MiB).
const RECENT_STACKS_MAX: usize = 1024;

impl ChunkedStore {
    /// `buffer_bytes` bounds the chunks; the interned tables get half as much again.
    pub fn new(buffer_bytes: usize) -> Self {
        Self::with_buffer(ChunkedBuffer::new(buffer_bytes), buffer_bytes / 2)
    }

    pub fn with_buffer(buffer: ChunkedBuffer, table_budget: usize) -> Self {
        Self {
            buffer,
            times: ChunkTimes::default(),
            stacks: PrunableInterner::default(),
            recent_stacks: RecentStacks::default(),
            strings: PrunableInterner::default(),
            pid_last_chunk: HashMap::default(),
            released: Vec::new(),
            thread_last_chunk: HashMap::default(),
            stack_epoch: 0,
            released_threads: Vec::new(),
            table_budget,
            scratch: Vec::with_capacity(256),
            retain_ns: None,
            read_to: WindowCursor::default(),
            unread_recycled: 0,
            seal_at_next_push: false,
            stats: StoreStats::default(),
        }
    }

    fn generation(&self) -> u64 {
        self.buffer.current_seq().unwrap_or(0)
    }

    pub fn buffer(&self) -> &ChunkedBuffer {
        &self.buffer
    }

    pub fn stack_nodes(&self) -> usize {
        self.stacks.len()
    }

    pub fn table_bytes(&self) -> usize {
        self.stacks.len() * STACK_NODE_BYTES + self.strings.len() * STRING_BYTES
    }

    pub fn snapshot(&self) -> StoreSnapshot {
        self.snapshot_with(self.buffer.snapshot())
    }

    /// Keeps the chunks windows have read until their newest event is `retain_ns` older than
    /// the newest event stored (an agent's flight recorder), within the byte bound: beyond it
    /// the oldest are recycled and counted as usual.
    pub fn set_retention(&mut self, retain_ns: Option<u64>) {
        self.retain_ns = retain_ns;
    }

    /// The events stored since `cursor` (None: since the start), and the cursor to pass next
    /// time: each event is in exactly one such window. The chunks read are then released (not
    /// counted as recycled), but for the one being written and those the retention keeps;
    /// without a retention the one being written is sealed, so the next window releases it.
    /// Events recycled before a window read them are its `lost`.
    pub fn window_snapshot(&mut self, cursor: Option<WindowCursor>) -> WindowSnapshot {
        let from = cursor.unwrap_or_default();
        let mut snap = self.snapshot_with(self.buffer.snapshot_from(from.seq));
        let cursor_chunk_live =
            (self.buffer.live_chunks().next()).is_some_and(|c| c.header.seq <= from.seq);
        if cursor_chunk_live {
            snap.skip_blocks = from.blocks;
        }
        let lost = std::mem::take(&mut self.unread_recycled);
        let (seq, blocks) = self.buffer.position().unwrap_or((from.seq, from.blocks));
        let next = WindowCursor { seq, blocks };
        self.read_to = next;
        self.seal_at_next_push = self.retain_ns.is_none() && blocks > 0;
        let keep_after = match (self.retain_ns, self.buffer.newest_time_ns()) {
            (None, _) => u64::MAX,
            (Some(r), Some(newest)) => newest.saturating_sub(r),
            (Some(_), None) => 0,
        };
        while let Some(r) = self.buffer.release_oldest_before(seq, keep_after) {
            self.after_recycle(r);
        }
        WindowSnapshot { snapshot: snap, next, lost }
    }

    /// The stored events at or after `from_ns` (what a flight recorder dump holds); what was
    /// recycled is reported only where it overlaps that range.
    pub fn snapshot_since(&self, from_ns: u64) -> StoreSnapshot {
        let mut snap = self.snapshot_with(self.buffer.snapshot_since(from_ns));
        snap.from_ns = from_ns;
        let r = &mut snap.recycled;
        match r.first_time_ns {
            Some(_) if r.last_time_ns < from_ns => *r = Default::default(),
            Some(first) => r.first_time_ns = Some(first.max(from_ns)),
            None => {}
        }
        snap
    }

    /// The final snapshot: chunks are moved out rather than copied.
    pub fn into_snapshot(mut self) -> StoreSnapshot {
        let chunks = self.buffer.drain_snapshot();
        self.snapshot_with(chunks)
    }

    fn snapshot_with(&self, chunks: Vec<Vec<u8>>) -> StoreSnapshot {
        StoreSnapshot {
            chunks,
            stacks: self.stacks.slots().to_vec(),
            strings: self.strings.slots().to_vec(),
            recycled: self.buffer.recycled(),
            stats: self.stats,
            buffer_bytes: self.buffer.limit_bytes(),
            skip_blocks: 0,
            from_ns: 0,
        }
    }

    fn push(&mut self, ev: StoredEvent) {
        let time = ev.time_ns();
        codec::encode(&ev, &mut self.times, &mut self.scratch);
        let pushed = if std::mem::take(&mut self.seal_at_next_push) {
            Err(PushError::NeedChunk)
        } else {
            self.buffer.push(&self.scratch, time)
        };
        match pushed {
            Ok(()) => {}
            Err(PushError::NeedChunk) => {
                let recycled = self.buffer.start_chunk(time);
                self.times = ChunkTimes::new(time);
                // What this event refers to was stamped with the previous chunk.
                self.touch(&ev);
                codec::encode(&ev, &mut self.times, &mut self.scratch);
                if let Err(e) = self.buffer.push(&self.scratch, time) {
                    unreachable!("an empty chunk refused a block that fits: {e:?}");
                }
                if let Some(r) = recycled {
                    self.after_recycle(r);
                }
            }
            Err(PushError::TooLarge { .. }) => {
                self.stats.oversized += 1;
                return;
            }
        }
        if let ThreadKey::Task { pid, tid } = ev.thread() {
            let g = self.generation();
            self.pid_last_chunk.insert(pid, g);
            self.thread_last_chunk.insert((pid, tid), g);
        }
        while self.table_bytes() > self.table_budget {
            match self.buffer.recycle_oldest() {
                Some(r) => {
                    self.stats.table_pressure_recycles += 1;
                    self.after_recycle(r);
                }
                None => break,
            }
        }
    }

    fn touch(&mut self, ev: &StoredEvent) {
        let g = self.generation();
        match ev {
            StoredEvent::Sample(_, s) => {
                let mut cur = s.stack;
                while let Some(id) = cur {
                    self.stacks.touch(id.0, g);
                    cur = self.stacks.get(id.0).and_then(|n| n.0);
                }
            }
            StoredEvent::Marker(_, m) => {
                self.strings.touch(m.name.0, g);
                self.strings.touch(m.schema.0, g);
                for f in &m.fields {
                    if let MarkerField::Str(s) = f {
                        self.strings.touch(s.0, g);
                    }
                }
            }
        }
    }

    fn after_recycle(&mut self, r: RecycledChunk) {
        if r.lost {
            // Blocks the last window had read are no window's loss.
            self.unread_recycled += match r.seq.cmp(&self.read_to.seq) {
                std::cmp::Ordering::Less => 0,
                std::cmp::Ordering::Equal => {
                    u64::from(r.blocks.saturating_sub(self.read_to.blocks))
                }
                std::cmp::Ordering::Greater => u64::from(r.blocks),
            };
        }
        let pruned = self.stacks.prune(r.seq);
        if pruned > 0 {
            self.recent_stacks.clear();
            self.stack_epoch += 1;
        }
        self.stats.pruned_stack_nodes += pruned as u64;
        self.stats.pruned_strings += self.strings.prune(r.seq) as u64;
        self.pid_last_chunk.retain(|pid, last| {
            let live = *last > r.seq;
            if !live {
                self.released.push(*pid);
            }
            live
        });
        self.thread_last_chunk.retain(|key, last| {
            let live = *last > r.seq;
            if !live {
                self.released_threads.push(*key);
            }
            live
        });
    }
}

impl SampleSink for ChunkedStore {
    fn intern_stack(&mut self, frames: &[FrameAddr]) -> Option<StackId> {
        let g = self.generation();
        if let Some((leaf, seen)) = self.recent_stacks.get_mut(frames) {
            // Alive: nothing was pruned since it was cached. Its nodes are used in this
            // generation too (what interning each frame would have recorded).
            let leaf = *leaf;
            if *seen != g {
                *seen = g;
                self.touch_stack(leaf);
            }
            return Some(leaf);
        }
        let mut parent = None;
        for &f in frames {
            parent = Some(StackId(self.stacks.intern(&(parent, f), g)));
        }
        if let Some(leaf) = parent {
            if self.recent_stacks.len() >= RECENT_STACKS_MAX {
                self.recent_stacks.clear();
            }
            self.recent_stacks.insert(frames.into(), (leaf, g));
        }
        parent
    }

    fn intern_string(&mut self, s: &str) -> StringId {
        let g = self.generation();
        StringId(self.strings.intern(s, g))
    }

    fn push_sample(&mut self, thread: ThreadKey, sample: StoredSample) {
        self.stats.samples += 1;
        self.push(StoredEvent::Sample(thread, sample));
    }

    fn push_marker(&mut self, thread: ThreadKey, marker: StoredMarker) {
        self.stats.markers += 1;
        self.push(StoredEvent::Marker(thread, marker));
    }

    fn take_released_pids(&mut self) -> Vec<Pid> {
        std::mem::take(&mut self.released)
    }

    fn holds_pid(&self, pid: Pid) -> bool {
        self.pid_last_chunk.contains_key(&pid)
    }

    fn take_released_threads(&mut self) -> Vec<(Pid, Tid)> {
        std::mem::take(&mut self.released_threads)
    }

    fn holds_thread(&self, pid: Pid, tid: Tid) -> bool {
        self.thread_last_chunk.contains_key(&(pid, tid))
    }

    fn referenced_modules(&self, out: &mut HashSet<ModuleId>) {
        for (_, f) in self.stacks.slots().iter().flatten() {
            if let FrameAddr::User { module, .. } = f {
                out.insert(*module);
            }
        }
    }

    fn stack_stamp(&self) -> StackStamp {
        StackStamp { epoch: self.stack_epoch, generation: self.generation() }
    }

    fn touch_stack(&mut self, id: StackId) {
        let g = self.generation();
        let mut cur = Some(id);
        while let Some(id) = cur {
            self.stacks.touch(id.0, g);
            cur = self.stacks.get(id.0).and_then(|n| n.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::snapshot::read_events;

    /// (pid, tid) of a task; the idle tasks as the kernel numbers them.
    fn pair(t: ThreadKey) -> (u32, u32) {
        match t {
            ThreadKey::Idle { cpu } => (0, cpu),
            ThreadKey::Task { pid, tid } => (pid.0, tid.0),
        }
    }
    use crate::model::ids::Tid;

    fn key(pid: u32, tid: u32) -> ThreadKey {
        ThreadKey::Task { pid: Pid(pid), tid: Tid(tid) }
    }

    /// Frames of stack `id`, root first.
    fn stack_path(s: &ChunkedStore, id: StackId) -> Vec<FrameAddr> {
        let mut v = Vec::new();
        let mut cur = Some(id);
        while let Some(n) = cur.and_then(|i| s.stacks.get(i.0)) {
            v.push(n.1);
            cur = n.0;
        }
        v.reverse();
        v
    }

    fn events_of(s: &ChunkedStore) -> Vec<StoredEvent> {
        let mut v = vec![];
        read_events(&s.snapshot(), |e| v.push(e), |e| panic!("{e}"));
        v
    }

    #[test]
    fn stacks_share_prefixes() {
        let mut s = ChunkedStore::new(1 << 20);
        let a = [FrameAddr::Kernel(1), FrameAddr::Unmapped(2)];
        let ia = s.intern_stack(&a).unwrap();
        assert_eq!(s.intern_stack(&a), Some(ia));
        let ib = s.intern_stack(&a[..1]).unwrap();
        assert_ne!(ia, ib);
        assert_eq!(stack_path(&s, ia), a);
        assert_eq!(s.stack_nodes(), 2, "the one-frame stack is the prefix node");
        assert_eq!(s.intern_stack(&[]), None);
    }

    /// Stacks repeated across recycled chunks (served from `recent_stacks`) keep their nodes
    /// alive, and stacks whose nodes were pruned come back with the right frames.
    #[test]
    fn repeated_stacks_survive_recycling_and_pruned_ones_come_back_right() {
        let mut s =
            ChunkedStore::with_buffer(ChunkedBuffer::with_chunk_size(16 << 10, 4 << 10), 1 << 30);
        let hot = [FrameAddr::Kernel(1), FrameAddr::Kernel(2), FrameAddr::Kernel(3)];
        for t in 0..20_000u64 {
            // A one-off stack per sample makes the interner prune as chunks recycle.
            let once = [FrameAddr::Kernel(1), FrameAddr::Unmapped(1000 + t)];
            let frames: &[FrameAddr] = if t % 2 == 0 { &hot } else { &once };
            let stack = s.intern_stack(frames);
            assert_eq!(stack_path(&s, stack.unwrap()), frames, "sample {t}");
            s.push_sample(
                key(1, 1),
                StoredSample { time_ns: t, cpu_delta_ns: 1, stack, off_cpu: None },
            );
        }
        assert!(s.stats.pruned_stack_nodes > 0, "the one-off stacks were pruned");
        let mut hot_samples = 0;
        let snap = s.snapshot();
        read_events(
            &snap,
            |e| {
                if let StoredEvent::Sample(_, smp) = e {
                    let path = stack_path(&s, smp.stack.unwrap());
                    if smp.time_ns % 2 == 0 {
                        assert_eq!(path, hot);
                        hot_samples += 1;
                    } else {
                        assert_eq!(
                            path,
                            [FrameAddr::Kernel(1), FrameAddr::Unmapped(1000 + smp.time_ns)]
                        );
                    }
                }
            },
            |e| panic!("{e}"),
        );
        assert!(hot_samples > 0);
    }

    /// Random stacks with many shared prefixes, across chunk recycling that prunes nodes (and
    /// empties the recent-stacks cache): each comes back as its frames, and one stack gets one
    /// id while its nodes live.
    #[test]
    fn stacks_with_shared_prefixes_are_interned_right_across_pruning() {
        let mut s =
            ChunkedStore::with_buffer(ChunkedBuffer::with_chunk_size(16 << 10, 4 << 10), 1 << 30);
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut ids: HashMap<Vec<FrameAddr>, StackId> = HashMap::new();
        for t in 0..30_000u64 {
            // Depth 1-12 over a small alphabet: many shared prefixes, some whole repeats.
            let depth = 1 + next(12) as usize;
            let frames: Vec<FrameAddr> = (0..depth)
                .map(|i| match next(3) {
                    0 => FrameAddr::Kernel(i as u64),
                    1 => FrameAddr::User { module: ModuleId(next(2) as u32), offset: next(4) },
                    _ => FrameAddr::Unmapped(1000 + next(3)),
                })
                .collect();
            let id = s.intern_stack(&frames).unwrap();
            assert_eq!(stack_path(&s, id), frames, "sample {t}");
            let pruned_before = s.stats.pruned_stack_nodes;
            s.push_sample(
                key(1, 1),
                StoredSample { time_ns: t, cpu_delta_ns: 1, stack: Some(id), off_cpu: None },
            );
            if s.stats.pruned_stack_nodes != pruned_before {
                ids.clear();
            }
            assert_eq!(*ids.entry(frames).or_insert(id), id, "sample {t}: one id per stack");
        }
        assert!(s.stats.pruned_stack_nodes > 0, "recycling pruned nodes");
    }

    #[test]
    fn samples_round_trip_in_order() {
        let mut s = ChunkedStore::new(1 << 20);
        let st = s.intern_stack(&[FrameAddr::Kernel(7)]);
        for t in 0..1000u64 {
            s.push_sample(
                key(1, 1 + (t % 3) as u32),
                StoredSample { time_ns: t * 1000, cpu_delta_ns: t, stack: st, off_cpu: None },
            );
        }
        let evs = events_of(&s);
        assert_eq!(evs.len(), 1000);
        assert!(evs.iter().enumerate().all(|(i, e)| e.time_ns() == i as u64 * 1000));
    }

    /// Windows read every event exactly once, release what they read without counting it as
    /// recycled, and count what was recycled before a window read it.
    #[test]
    fn windows_read_each_event_once() {
        let mut s =
            ChunkedStore::with_buffer(ChunkedBuffer::with_chunk_size(32 << 10, 4 << 10), 1 << 30);
        let st = s.intern_stack(&[FrameAddr::Kernel(1)]);
        let mut cursor = None;
        let mut seen = Vec::new();
        let mut t = 0u64;
        for n in [0u64, 1, 700, 3, 1500, 0, 2] {
            for _ in 0..n {
                s.push_sample(
                    key(1, 1),
                    StoredSample { time_ns: t, cpu_delta_ns: 1, stack: st, off_cpu: None },
                );
                t += 1;
            }
            let w = s.window_snapshot(cursor);
            cursor = Some(w.next);
            let mut got = vec![];
            read_events(&w.snapshot, |e| got.push(e.time_ns()), |e| panic!("{e}"));
            assert_eq!(got.len() as u64, n, "window of {n}");
            seen.extend(got);
            assert_eq!((w.lost, w.snapshot.recycled.blocks), (0, 0), "nothing lost");
            assert!(s.buffer().allocated_bytes() <= 2 * (4 << 10), "read chunks released");
        }
        assert_eq!(seen, (0..t).collect::<Vec<_>>());
        // 40,000 events in one window overflow 32 KiB: the window holds the newest, the rest
        // is counted as recycled.
        for _ in 0..40_000 {
            s.push_sample(
                key(1, 1),
                StoredSample { time_ns: t, cpu_delta_ns: 1, stack: st, off_cpu: None },
            );
            t += 1;
        }
        let w = s.window_snapshot(cursor);
        let mut got = 0u64;
        read_events(&w.snapshot, |_| got += 1, |e| panic!("{e}"));
        assert!(w.lost > 0);
        assert_eq!(got + w.lost, 40_000);
        // The next window starts where this one ended.
        s.push_sample(
            key(1, 1),
            StoredSample { time_ns: t, cpu_delta_ns: 1, stack: st, off_cpu: None },
        );
        let w = s.window_snapshot(Some(w.next));
        let mut times = vec![];
        read_events(&w.snapshot, |e| times.push(e.time_ns()), |e| panic!("{e}"));
        assert_eq!((times, w.lost), (vec![t], 0));
    }

    /// An agent's windows on a quiet host fill a small part of a chunk each. What a window read
    /// must still be let go by the next one, not when its chunk fills many windows later: the
    /// processes, threads and stacks it refers to are released, so memory stays flat.
    #[test]
    fn windows_release_what_they_read_before_the_chunk_fills() {
        let mut s = ChunkedStore::new(16 << 20);
        let mut cursor = None;
        let mut released = Vec::new();
        for w in 0..20u32 {
            // One process per window (a short-lived one), with its own stack.
            let stack = s.intern_stack(&[FrameAddr::Kernel(1), FrameAddr::Kernel(100 + w as u64)]);
            for t in 0..10u64 {
                let time_ns = u64::from(w) * 1_000 + t;
                s.push_sample(
                    key(w + 1, w + 1),
                    StoredSample { time_ns, cpu_delta_ns: 1, stack, off_cpu: None },
                );
            }
            let win = s.window_snapshot(cursor);
            cursor = Some(win.next);
            let mut n = 0;
            read_events(&win.snapshot, |_| n += 1, |e| panic!("{e}"));
            assert_eq!((n, win.lost), (10, 0), "window {w}");
            released.extend(s.take_released_pids());
            assert!(s.buffer().live_chunks().count() <= 2, "window {w}");
            // The shared root frame, and the newest one or two windows' leaves.
            assert!(s.stack_nodes() <= 3, "window {w}: {} stack nodes", s.stack_nodes());
        }
        released.sort();
        assert_eq!(released, (1..=19).map(Pid).collect::<Vec<_>>(), "all but the last window's");
        assert!(s.holds_pid(Pid(20)));
    }

    /// With a retention (the agent's flight recorder), windows still read each event once,
    /// chunks read stay as long as the retention asks, `snapshot_since` holds exactly the
    /// events from its time on, and chunks recycled by the byte bound after a window read
    /// them are not that window's loss.
    #[test]
    fn retention_keeps_read_chunks_and_counts_only_unread_losses() {
        let mut s =
            ChunkedStore::with_buffer(ChunkedBuffer::with_chunk_size(256 << 10, 4 << 10), 1 << 30);
        s.set_retention(Some(5_000));
        let st = s.intern_stack(&[FrameAddr::Kernel(1)]);
        let push = |s: &mut ChunkedStore, t: u64| {
            s.push_sample(
                key(1, 1),
                StoredSample { time_ns: t, cpu_delta_ns: 1, stack: st, off_cpu: None },
            )
        };
        let mut cursor = None;
        let mut t = 0u64;
        let mut seen = 0u64;
        for _ in 0..4 {
            for _ in 0..1000 {
                push(&mut s, t);
                t += 1;
            }
            let w = s.window_snapshot(cursor);
            cursor = Some(w.next);
            let mut n = 0;
            read_events(&w.snapshot, |_| n += 1, |e| panic!("{e}"));
            assert_eq!((n, w.lost), (1000, 0));
            seen += n;
        }
        assert_eq!(seen, t);
        // 4,000 events of ~7 bytes span several 4 KiB chunks, all within the 5,000 ns kept.
        let oldest = s.buffer().live_chunks().next().unwrap().header.first_time_ns;
        assert_eq!(oldest, 0, "read chunks kept");
        let mut since = vec![];
        read_events(&s.snapshot_since(2500), |e| since.push(e.time_ns()), |e| panic!("{e}"));
        assert_eq!(since, (2500..t).collect::<Vec<_>>());
        // Past the retention: read chunks older than 5,000 ns before the newest event go.
        for _ in 0..6000 {
            push(&mut s, t);
            t += 1;
        }
        let w = s.window_snapshot(cursor);
        cursor = Some(w.next);
        assert_eq!(w.lost, 0);
        let oldest = s.buffer().live_chunks().next().unwrap().header.last_time_ns;
        assert!(oldest >= t - 1 - 5000, "{oldest} kept past the retention");
        assert_eq!(s.buffer().recycled().blocks, 0, "released by age, not recycled");
        // The byte bound still holds: 256 KiB take ~35,000 events, so with a retention longer
        // than everything, read chunks are recycled (counted) and unread ones are the
        // window's loss.
        s.set_retention(Some(u64::MAX));
        for _ in 0..60_000 {
            push(&mut s, t);
            t += 1;
            assert!(s.buffer().allocated_bytes() <= 256 << 10);
        }
        let w = s.window_snapshot(cursor);
        let mut n = 0u64;
        read_events(&w.snapshot, |_| n += 1, |e| panic!("{e}"));
        assert!(w.lost > 0 && s.buffer().recycled().blocks > w.lost);
        assert_eq!(n + w.lost, 60_000, "each unread event read or counted lost, once");
    }

    #[test]
    fn recycling_prunes_what_only_old_chunks_used() {
        // 8 chunks of 4 KiB: about 2,500 samples of ~12 bytes fit.
        let mut s =
            ChunkedStore::with_buffer(ChunkedBuffer::with_chunk_size(32 << 10, 4 << 10), 1 << 30);
        for t in 0..20_000u64 {
            // A new stack every 100 samples, so old stacks fall out of use.
            let stack = s.intern_stack(&[FrameAddr::Kernel(1), FrameAddr::Kernel(1000 + t / 100)]);
            s.push_sample(
                key(t as u32 / 5000 + 1, 1),
                StoredSample { time_ns: t * 1_000_000, cpu_delta_ns: 1, stack, off_cpu: None },
            );
            assert!(s.buffer().allocated_bytes() <= 32 << 10);
        }
        let snap = s.snapshot();
        let evs = events_of(&s);
        let oldest = evs.first().unwrap().time_ns();
        assert!(oldest > 15_000 * 1_000_000, "only the newest window is left: {oldest}");
        assert_eq!(evs.last().unwrap().time_ns(), 19_999 * 1_000_000);
        assert!(snap.recycled.first_time_ns == Some(0) && snap.recycled.last_time_ns < oldest);
        // Every referenced stack is alive; dead ones are gone.
        for e in &evs {
            let StoredEvent::Sample(_, smp) = e else { panic!() };
            let mut cur = smp.stack;
            while let Some(id) = cur {
                cur = snap.stack(id).expect("live sample references a pruned stack").0;
            }
        }
        assert!(s.stack_nodes() < 60, "{} nodes", s.stack_nodes());
        assert!(s.stats.pruned_stack_nodes > 100);
        // Processes 1..=3 have no events left.
        let mut released = s.take_released_pids();
        released.sort();
        assert_eq!(released, vec![Pid(1), Pid(2), Pid(3)]);
    }

    #[test]
    fn table_budget_recycles_early() {
        // Each sample adds two nodes; a 4 KiB chunk holds ~450 samples, i.e. ~900 nodes.
        let budget = 3000 * STACK_NODE_BYTES;
        let mut s =
            ChunkedStore::with_buffer(ChunkedBuffer::with_chunk_size(64 << 10, 4 << 10), budget);
        for t in 0..20_000u64 {
            let stack = s.intern_stack(&[FrameAddr::Kernel(t), FrameAddr::Kernel(t + 1)]);
            s.push_sample(
                key(1, 1),
                StoredSample { time_ns: t, cpu_delta_ns: 0, stack, off_cpu: None },
            );
            // The budget holds up to what the chunk being written refers to.
            assert!(s.table_bytes() <= budget + 1000 * STACK_NODE_BYTES, "{}", s.stack_nodes());
        }
        assert!(s.stats.table_pressure_recycles > 0);
        let snap = s.snapshot();
        for e in events_of(&s) {
            let StoredEvent::Sample(_, smp) = e else { panic!() };
            assert!(snap.stack(smp.stack.unwrap()).is_some());
        }
    }

    mod props {
        use proptest::prelude::*;

        use super::*;
        use crate::store::codec::MarkerPhase;

        /// An event as the collector hands it over, with stacks and strings spelled out.
        #[derive(Clone, Debug, PartialEq)]
        enum Input {
            Sample {
                thread: (u32, u32),
                time: u64,
                cpu: u64,
                frames: Vec<u64>,
            },
            Marker {
                thread: (u32, u32),
                phase: u8,
                start: u64,
                len: u64,
                name: String,
                text: String,
                n: i64,
            },
        }

        fn input() -> impl Strategy<Value = Input> {
            let thread = (0u32..4, 0u32..4);
            prop_oneof![
                4 => (thread.clone(), any::<u64>(), 0u64..10_000_000, prop::collection::vec(0u64..50, 0..40))
                    .prop_map(|(thread, time, cpu, frames)| Input::Sample { thread, time, cpu, frames }),
                1 => (thread, 0u8..4, any::<u64>(), 0u64..1 << 40, "[a-c]{0,3}", "\\PC{0,12}", any::<i64>())
                    .prop_map(|(thread, phase, start, len, name, text, n)| Input::Marker {
                        thread, phase, start, len, name, text, n
                    }),
            ]
        }

        fn key((pid, tid): (u32, u32)) -> ThreadKey {
            ThreadKey::Task { pid: Pid(pid), tid: Tid(tid) }
        }

        fn store(s: &mut ChunkedStore, i: &Input) {
            match i {
                Input::Sample { thread, time, cpu, frames } => {
                    let frames: Vec<FrameAddr> =
                        frames.iter().map(|&f| FrameAddr::Kernel(f)).collect();
                    let stack = s.intern_stack(&frames);
                    s.push_sample(
                        key(*thread),
                        StoredSample { time_ns: *time, cpu_delta_ns: *cpu, stack, off_cpu: None },
                    );
                }
                Input::Marker { thread, phase, start, len, name, text, n } => {
                    let phase = [
                        MarkerPhase::Instant,
                        MarkerPhase::Interval,
                        MarkerPhase::IntervalStart,
                        MarkerPhase::IntervalEnd,
                    ][*phase as usize];
                    let end = if phase == MarkerPhase::Interval {
                        start.saturating_add(*len)
                    } else {
                        *start
                    };
                    let m = StoredMarker {
                        phase,
                        start_ns: *start,
                        end_ns: end,
                        name: s.intern_string(name),
                        schema: s.intern_string("Schema"),
                        fields: vec![MarkerField::Str(s.intern_string(text)), MarkerField::Int(*n)],
                    };
                    s.push_marker(key(*thread), m);
                }
            }
        }

        /// Reads a snapshot back into inputs, resolving every id (a pruned id fails the test).
        fn read_back(snap: &StoreSnapshot) -> Vec<Input> {
            let mut out = vec![];
            read_events(
                snap,
                |ev| {
                    out.push(match ev {
                        StoredEvent::Sample(t, smp) => {
                            let mut frames = vec![];
                            let mut cur = smp.stack;
                            while let Some(id) = cur {
                                let (parent, FrameAddr::Kernel(f)) =
                                    snap.stack(id).expect("pruned stack")
                                else {
                                    panic!()
                                };
                                frames.push(f);
                                cur = parent;
                            }
                            frames.reverse();
                            Input::Sample {
                                thread: pair(t),
                                time: smp.time_ns,
                                cpu: smp.cpu_delta_ns,
                                frames,
                            }
                        }
                        StoredEvent::Marker(t, m) => {
                            let [MarkerField::Str(text), MarkerField::Int(n)] = m.fields[..] else {
                                panic!()
                            };
                            assert_eq!(snap.string(m.schema), Some("Schema"));
                            let phase = m.phase as u8;
                            let start = if m.phase == MarkerPhase::IntervalEnd {
                                m.end_ns
                            } else {
                                m.start_ns
                            };
                            Input::Marker {
                                thread: pair(t),
                                phase,
                                start,
                                len: m.end_ns - m.start_ns,
                                name: snap.string(m.name).expect("pruned name").to_owned(),
                                text: snap.string(text).expect("pruned text").to_owned(),
                                n,
                            }
                        }
                    })
                },
                |e| panic!("{e}"),
            );
            out
        }

        fn normalized(i: &Input) -> Input {
            match i.clone() {
                Input::Marker { phase, start, len: _, thread, name, text, n } if phase != 1 => {
                    Input::Marker { phase, start, len: 0, thread, name, text, n }
                }
                Input::Marker { phase, start, len, thread, name, text, n } => Input::Marker {
                    len: start.saturating_add(len) - start,
                    phase,
                    start,
                    thread,
                    name,
                    text,
                    n,
                },
                other => other,
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(300))]

            /// Whatever the chunk size (so recycling happens at every possible point), the
            /// store reads back exactly the newest events it was given, every id resolvable,
            /// and never holds more chunk bytes than its limit.
            #[test]
            fn round_trip_keeps_the_newest_suffix(
                inputs in prop::collection::vec(input(), 1..300),
                chunk in 200usize..1200,
                chunks in 2usize..6,
            ) {
                let mut s = ChunkedStore::with_buffer(ChunkedBuffer::with_chunk_size(chunk * chunks, chunk), usize::MAX);
                for i in &inputs {
                    store(&mut s, i);
                    prop_assert!(s.buffer().allocated_bytes() <= chunk * chunks);
                }
                let snap = s.snapshot();
                let dropped = snap.recycled.blocks as usize + s.stats.oversized as usize;
                prop_assert_eq!(s.stats.oversized, 0);
                let expected: Vec<Input> = inputs[dropped..].iter().map(normalized).collect();
                prop_assert_eq!(read_back(&snap), expected);
                prop_assert_eq!(read_back(&s.into_snapshot()).len(), inputs.len() - dropped);
            }
        }
    }
}
