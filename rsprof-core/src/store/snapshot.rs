//! A consistent copy of the store, taken on the collecting thread (cheap) and read on any
//! other: the chunks as bytes plus the stack and string tables they refer to.

use crate::{
    model::{
        address::FrameAddr,
        ids::{StackId, StringId},
        recording::Recycled,
        time::MonoNs,
    },
    store::{
        StackNode, StoreStats,
        chunks::ChunkView,
        codec::{self, ChunkTimes, StoredEvent},
    },
};

/// A consistent copy of the store, for writing a profile on another thread while recording
/// goes on.
#[derive(Clone, Debug, Default)]
pub struct StoreSnapshot {
    /// Serialized chunks, oldest first.
    pub chunks: Vec<Vec<u8>>,
    /// Stack nodes by `StackId`; None for pruned slots.
    pub stacks: Vec<Option<StackNode>>,
    pub strings: Vec<Option<String>>,
    /// What was recycled before the snapshot (times in ns as stored).
    pub recycled: crate::store::chunks::Recycled,
    pub stats: StoreStats,
    pub buffer_bytes: usize,
    /// Blocks of the first chunk that an earlier window already read (decoded for their
    /// time deltas, not handed out).
    pub skip_blocks: u32,
    /// Events before this time are skipped (a flight recorder dump's range); intervals count
    /// by their end.
    pub from_ns: u64,
}

impl StoreSnapshot {
    pub fn stack(&self, id: StackId) -> Option<StackNode> {
        self.stacks.get(id.0 as usize).copied().flatten()
    }

    pub fn string(&self, id: StringId) -> Option<&str> {
        self.strings.get(id.0 as usize).and_then(|s| s.as_deref())
    }

    /// What was recycled before this snapshot, on the model's clock.
    pub fn recycled_range(&self) -> Recycled {
        let r = self.recycled;
        Recycled {
            chunks: r.chunks,
            events: r.blocks,
            range: r.first_time_ns.map(|first| (MonoNs(first), MonoNs(r.last_time_ns))),
        }
    }

    /// Every distinct frame address in a live stack node.
    pub fn unique_frames(&self) -> Vec<FrameAddr> {
        let mut v: Vec<FrameAddr> = self.stacks.iter().flatten().map(|n| n.1).collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// Decodes every event of a snapshot, oldest chunk first. A corrupt chunk or block is
/// reported through `on_error` and skipped; the rest is still read.
pub fn read_events(
    snap: &StoreSnapshot,
    mut on_event: impl FnMut(StoredEvent),
    mut on_error: impl FnMut(String),
) {
    for (i, bytes) in snap.chunks.iter().enumerate() {
        let view = match ChunkView::parse(bytes) {
            Ok(v) => v,
            Err(e) => {
                on_error(format!("chunk {i}: {e}"));
                continue;
            }
        };
        let mut times = ChunkTimes::new(view.header.base_time_ns);
        let skip = if i == 0 { snap.skip_blocks as usize } else { 0 };
        for (j, block) in view.blocks().enumerate() {
            match codec::decode(block, &mut times) {
                Ok(_) if j < skip => {}
                Ok(ev) if end_ns(&ev) < snap.from_ns => {}
                Ok(ev) => on_event(ev),
                Err(e) => on_error(format!("chunk {} block {j}: {e}", view.header.seq)),
            }
        }
    }
}

/// An event's latest time: a sample's, an interval marker's end.
fn end_ns(ev: &StoredEvent) -> u64 {
    match ev {
        StoredEvent::Sample(_, s) => s.time_ns,
        StoredEvent::Marker(_, m) => m.start_ns.max(m.end_ns),
    }
}
