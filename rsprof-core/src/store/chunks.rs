//! Fixed-size chunks of length-prefixed blocks under a byte budget, recycled oldest first (the
//! model of the Firefox profiler's ProfileChunkedBuffer).
//!
//! A block never straddles two chunks: one that does not fit in the current chunk starts the
//! next. Each chunk therefore decodes on its own once older chunks are recycled, at the cost
//! of the unused tail of each chunk (under one block, i.e. a few dozen bytes).
//!
//! Readers get chunks in their serialized form ([`Chunk::to_bytes`]: header, data, CRC-32),
//! parsed back with [`ChunkView::parse`]. Snapshots and anything written to disk use the same
//! path, so a truncated or bit-flipped chunk is always detected, never read past its end.

use std::collections::VecDeque;

/// Block lengths are LEB128; this is the most a length prefix takes for a block that fits.
const MAX_LEN_PREFIX: usize = 5;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChunkHeader {
    /// Position of this chunk in the sequence of all chunks ever started (0, 1, …).
    pub seq: u64,
    /// Index of this chunk's first data byte in the stream of all bytes ever written.
    pub global_start: u64,
    /// Offset of the first complete block (always 0: blocks never straddle chunks).
    pub first_block: u32,
    /// Offset just past the last complete block.
    pub end: u32,
    pub block_count: u32,
    /// Time of the first block written; decoders start their per-thread deltas from it.
    pub base_time_ns: u64,
    pub first_time_ns: u64,
    pub last_time_ns: u64,
}

#[derive(Debug)]
pub struct Chunk {
    pub header: ChunkHeader,
    data: Box<[u8]>,
}

impl Chunk {
    fn new(capacity: usize) -> Self {
        // Zeroed allocation: pages are committed when first written, not here.
        Self { header: ChunkHeader::default(), data: vec![0; capacity].into_boxed_slice() }
    }

    fn reset(&mut self, seq: u64, global_start: u64, base_time_ns: u64) {
        self.header = ChunkHeader {
            seq,
            global_start,
            first_block: 0,
            end: 0,
            block_count: 0,
            base_time_ns,
            first_time_ns: base_time_ns,
            last_time_ns: base_time_ns,
        };
    }

    fn room(&self) -> usize {
        self.data.len() - self.header.end as usize
    }

    fn push(&mut self, block: &[u8], time_ns: u64) -> bool {
        let mut prefix = [0u8; MAX_LEN_PREFIX];
        let n = {
            let mut w = &mut prefix[..];
            leb128::write::unsigned(&mut w, block.len() as u64).expect("5 bytes hold a u32");
            MAX_LEN_PREFIX - w.len()
        };
        if n + block.len() > self.room() {
            return false;
        }
        let at = self.header.end as usize;
        self.data[at..at + n].copy_from_slice(&prefix[..n]);
        self.data[at + n..at + n + block.len()].copy_from_slice(block);
        // The end moves only once the block is complete: readers never see half a block.
        let h = &mut self.header;
        h.end += (n + block.len()) as u32;
        h.block_count += 1;
        h.first_time_ns = h.first_time_ns.min(time_ns);
        h.last_time_ns = h.last_time_ns.max(time_ns);
        true
    }

    pub fn used(&self) -> &[u8] {
        &self.data[..self.header.end as usize]
    }

    /// `MAGIC`, the header fields little-endian, the used data, then a CRC-32 of all of it.
    pub fn to_bytes(&self) -> Vec<u8> {
        let h = &self.header;
        let mut out = Vec::with_capacity(HEADER_LEN + h.end as usize + 4);
        out.extend_from_slice(MAGIC);
        for v in [h.seq, h.global_start, h.base_time_ns, h.first_time_ns, h.last_time_ns] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for v in [h.first_block, h.end, h.block_count] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(self.used());
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }
}

const MAGIC: &[u8; 4] = b"RSC1";
const HEADER_LEN: usize = 4 + 5 * 8 + 3 * 4;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CorruptChunk {
    /// Shorter than its header and checksum, or than the data length it declares.
    Truncated {
        len: usize,
        needed: usize,
    },
    BadMagic,
    ChecksumMismatch {
        stored: u32,
        computed: u32,
    },
    /// A block's length prefix is malformed or runs past the chunk's end.
    BadBlock {
        offset: usize,
    },
    /// The header's block count disagrees with the blocks found.
    BlockCount {
        header: u32,
        found: u32,
    },
}

impl std::fmt::Display for CorruptChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Truncated { len, needed } => {
                write!(f, "chunk truncated: {len} bytes, needs {needed}")
            }
            Self::BadMagic => write!(f, "not a chunk (bad magic)"),
            Self::ChecksumMismatch { stored, computed } => {
                write!(f, "chunk checksum mismatch: stored {stored:08x}, computed {computed:08x}")
            }
            Self::BadBlock { offset } => write!(f, "malformed block at offset {offset}"),
            Self::BlockCount { header, found } => {
                write!(f, "chunk declares {header} blocks but holds {found}")
            }
        }
    }
}

impl std::error::Error for CorruptChunk {}

/// A verified serialized chunk.
#[derive(Clone, Copy, Debug)]
pub struct ChunkView<'a> {
    pub header: ChunkHeader,
    data: &'a [u8],
}

impl<'a> ChunkView<'a> {
    pub fn parse(bytes: &'a [u8]) -> Result<Self, CorruptChunk> {
        if bytes.len() < HEADER_LEN + 4 {
            return Err(CorruptChunk::Truncated { len: bytes.len(), needed: HEADER_LEN + 4 });
        }
        if &bytes[..4] != MAGIC {
            return Err(CorruptChunk::BadMagic);
        }
        let u64_at =
            |i: usize| u64::from_le_bytes(bytes[4 + 8 * i..12 + 8 * i].try_into().unwrap());
        let u32_at =
            |i: usize| u32::from_le_bytes(bytes[44 + 4 * i..48 + 4 * i].try_into().unwrap());
        let header = ChunkHeader {
            seq: u64_at(0),
            global_start: u64_at(1),
            base_time_ns: u64_at(2),
            first_time_ns: u64_at(3),
            last_time_ns: u64_at(4),
            first_block: u32_at(0),
            end: u32_at(1),
            block_count: u32_at(2),
        };
        let needed = HEADER_LEN + header.end as usize + 4;
        if bytes.len() < needed {
            return Err(CorruptChunk::Truncated { len: bytes.len(), needed });
        }
        let body = &bytes[..needed - 4];
        let stored = u32::from_le_bytes(bytes[needed - 4..needed].try_into().unwrap());
        let computed = crc32fast::hash(body);
        if stored != computed {
            return Err(CorruptChunk::ChecksumMismatch { stored, computed });
        }
        let view = Self { header, data: &body[HEADER_LEN..] };
        // Walk the blocks once so iteration afterwards cannot fail half way.
        let mut found = 0u32;
        for b in view.raw_blocks() {
            b?;
            found += 1;
        }
        if found != header.block_count {
            return Err(CorruptChunk::BlockCount { header: header.block_count, found });
        }
        Ok(view)
    }

    fn raw_blocks(&self) -> impl Iterator<Item = Result<&'a [u8], CorruptChunk>> + use<'a> {
        let data = self.data;
        let mut at = self.header.first_block as usize;
        std::iter::from_fn(move || {
            if at >= data.len() {
                return None;
            }
            let mut r = &data[at..];
            let res = match leb128::read::unsigned(&mut r) {
                Ok(len) if (len as usize) <= r.len() => {
                    let start = data.len() - r.len();
                    let block = &data[start..start + len as usize];
                    at = start + len as usize;
                    Ok(block)
                }
                _ => {
                    let bad = at;
                    at = data.len();
                    Err(CorruptChunk::BadBlock { offset: bad })
                }
            };
            Some(res)
        })
    }

    /// The chunk's blocks in write order (verified by `parse`).
    pub fn blocks(&self) -> impl Iterator<Item = &'a [u8]> + use<'a> {
        self.raw_blocks().map_while(Result::ok)
    }
}

/// What the buffer has recycled since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recycled {
    pub chunks: u64,
    pub blocks: u64,
    /// Oldest and newest time in any recycled chunk.
    pub first_time_ns: Option<u64>,
    pub last_time_ns: u64,
}

/// A chunk that was just recycled; its contents are gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecycledChunk {
    pub seq: u64,
    pub last_time_ns: u64,
    pub blocks: u32,
    /// Counted as recycled (lost), not released after it was read.
    pub lost: bool,
}

/// Chunks in write order, holding at most `max_chunks × chunk_size` bytes.
#[derive(Debug)]
pub struct ChunkedBuffer {
    chunk_size: usize,
    max_chunks: usize,
    /// Oldest first; the last one is being written.
    live: VecDeque<Chunk>,
    /// Allocated ahead so starting a chunk never waits for the allocator.
    spare: Option<Chunk>,
    next_seq: u64,
    next_global: u64,
    recycled: Recycled,
}

#[derive(Debug, PartialEq, Eq)]
pub enum PushError {
    /// The current chunk is full (or there is none): start a new one and re-encode.
    NeedChunk,
    /// Larger than an empty chunk could ever hold.
    TooLarge { len: usize, max: usize },
}

impl ChunkedBuffer {
    /// `total` bytes split into chunks: `total / 8` each, between 4 KiB and 1 MiB, so a recycle
    /// drops at most an eighth of the window (fewer on small buffers would drop too much).
    pub fn new(total: usize) -> Self {
        let chunk_size = (total / 8).clamp(4 << 10, 1 << 20);
        Self::with_chunk_size(total, chunk_size)
    }

    pub fn with_chunk_size(total: usize, chunk_size: usize) -> Self {
        let max_chunks = (total / chunk_size).max(2);
        Self {
            chunk_size,
            max_chunks,
            live: VecDeque::with_capacity(max_chunks),
            spare: Some(Chunk::new(chunk_size)),
            next_seq: 0,
            next_global: 0,
            recycled: Recycled::default(),
        }
    }

    /// The most chunk memory this buffer will ever allocate.
    pub fn limit_bytes(&self) -> usize {
        self.max_chunks * self.chunk_size
    }

    /// Bytes of chunk memory allocated (live chunks plus the spare); never above the limit.
    pub fn allocated_bytes(&self) -> usize {
        (self.live.len() + usize::from(self.spare.is_some())) * self.chunk_size
    }

    pub fn recycled(&self) -> Recycled {
        self.recycled
    }

    /// The largest block an empty chunk can take.
    pub fn max_block(&self) -> usize {
        self.chunk_size - MAX_LEN_PREFIX
    }

    /// Appends a block to the current chunk.
    pub fn push(&mut self, block: &[u8], time_ns: u64) -> Result<(), PushError> {
        if block.len() > self.max_block() {
            return Err(PushError::TooLarge { len: block.len(), max: self.max_block() });
        }
        match self.live.back_mut() {
            Some(c) => {
                if c.push(block, time_ns) {
                    Ok(())
                } else {
                    Err(PushError::NeedChunk)
                }
            }
            None => Err(PushError::NeedChunk),
        }
    }

    /// Closes the current chunk and starts the next, recycling the oldest one if the limit
    /// is reached. Returns the recycled chunk, whose data is gone.
    pub fn start_chunk(&mut self, base_time_ns: u64) -> Option<RecycledChunk> {
        if let Some(c) = self.live.back() {
            self.next_global = c.header.global_start + c.header.end as u64;
        }
        let recycled = if self.spare.is_none() { self.recycle_oldest() } else { None };
        let mut chunk = self.spare.take().expect("a spare exists or was just recycled");
        chunk.reset(self.next_seq, self.next_global, base_time_ns);
        self.next_seq += 1;
        self.live.push_back(chunk);
        if self.live.len() < self.max_chunks {
            self.spare = Some(Chunk::new(self.chunk_size));
        }
        recycled
    }

    /// Sequence number of the chunk being written, if any.
    pub fn current_seq(&self) -> Option<u64> {
        self.live.back().map(|c| c.header.seq)
    }

    /// Drops the oldest chunk now (used when the interned tables outgrow their budget).
    pub fn recycle_oldest(&mut self) -> Option<RecycledChunk> {
        self.drop_oldest(true)
    }

    /// Drops the oldest chunk if it is older than chunk `seq` (and not the one being written)
    /// and its newest event older than `time_ns`, without counting it as recycled: its events
    /// were already read (an agent's past windows, beyond what its flight recorder keeps).
    pub fn release_oldest_before(&mut self, seq: u64, time_ns: u64) -> Option<RecycledChunk> {
        let h = self.live.front()?.header;
        if h.seq >= seq || h.last_time_ns >= time_ns {
            return None;
        }
        self.drop_oldest(false)
    }

    fn drop_oldest(&mut self, lost: bool) -> Option<RecycledChunk> {
        if self.live.len() < 2 {
            return None;
        }
        let old = self.live.pop_front().expect("len >= 2");
        let h = old.header;
        if lost {
            self.recycled.chunks += 1;
            self.recycled.blocks += h.block_count as u64;
            self.recycled.first_time_ns = Some(
                self.recycled.first_time_ns.map_or(h.first_time_ns, |t| t.min(h.first_time_ns)),
            );
            self.recycled.last_time_ns = self.recycled.last_time_ns.max(h.last_time_ns);
        }
        if self.spare.is_none() {
            self.spare = Some(old);
        }
        Some(RecycledChunk {
            seq: h.seq,
            last_time_ns: h.last_time_ns,
            blocks: h.block_count,
            lost,
        })
    }

    pub fn live_chunks(&self) -> impl Iterator<Item = &Chunk> {
        self.live.iter()
    }

    /// Every live chunk serialized, oldest first: a consistent copy for a reader on another
    /// thread while writing goes on.
    pub fn snapshot(&self) -> Vec<Vec<u8>> {
        self.live.iter().filter(|c| c.header.block_count > 0).map(Chunk::to_bytes).collect()
    }

    /// The time of the newest event written, if any.
    pub fn newest_time_ns(&self) -> Option<u64> {
        self.live.iter().filter(|c| c.header.block_count > 0).map(|c| c.header.last_time_ns).max()
    }

    /// Like `snapshot`, but only chunks holding an event at or after `time_ns`.
    pub fn snapshot_since(&self, time_ns: u64) -> Vec<Vec<u8>> {
        (self.live.iter())
            .filter(|c| c.header.last_time_ns >= time_ns && c.header.block_count > 0)
            .map(Chunk::to_bytes)
            .collect()
    }

    /// Like `snapshot`, but only chunks from `seq` on.
    pub fn snapshot_from(&self, seq: u64) -> Vec<Vec<u8>> {
        (self.live.iter())
            .filter(|c| c.header.seq >= seq && c.header.block_count > 0)
            .map(Chunk::to_bytes)
            .collect()
    }

    /// (sequence number, blocks written) of the chunk being written.
    pub fn position(&self) -> Option<(u64, u32)> {
        self.live.back().map(|c| (c.header.seq, c.header.block_count))
    }

    /// Like `snapshot`, but takes the chunks out, freeing each once copied, so memory does
    /// not double. The buffer is left empty (its recycling record stays).
    pub fn drain_snapshot(&mut self) -> Vec<Vec<u8>> {
        self.spare = None;
        std::iter::from_fn(|| self.live.pop_front())
            .filter(|c| c.header.block_count > 0)
            .map(|c| c.to_bytes())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(buf: &mut ChunkedBuffer, blocks: &[(Vec<u8>, u64)]) -> Vec<RecycledChunk> {
        let mut recycled = vec![];
        for (b, t) in blocks {
            if buf.push(b, *t) == Err(PushError::NeedChunk) {
                recycled.extend(buf.start_chunk(*t));
                buf.push(b, *t).unwrap();
            }
        }
        recycled
    }

    fn read_all(buf: &ChunkedBuffer) -> Vec<Vec<u8>> {
        let snap = buf.snapshot();
        snap.iter()
            .flat_map(|c| {
                ChunkView::parse(c).unwrap().blocks().map(<[u8]>::to_vec).collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn blocks_round_trip_across_chunks_and_recycle_oldest_first() {
        let mut buf = ChunkedBuffer::with_chunk_size(4 * 64, 64);
        let blocks: Vec<(Vec<u8>, u64)> = (0..40u8).map(|i| (vec![i; 20], i as u64)).collect();
        let recycled = fill(&mut buf, &blocks);
        // 3 blocks of 21 bytes per 64-byte chunk; 4 chunks hold the newest 10..12 blocks.
        let back = read_all(&buf);
        assert_eq!(back.last().unwrap(), &vec![39u8; 20]);
        let first = back[0][0] as usize;
        assert_eq!(back, blocks[first..].iter().map(|b| b.0.clone()).collect::<Vec<_>>());
        assert!(buf.allocated_bytes() <= 4 * 64);
        assert_eq!(recycled.len() as u64, buf.recycled().chunks);
        assert_eq!(buf.recycled().blocks, first as u64);
        assert!(recycled.windows(2).all(|w| w[0].seq + 1 == w[1].seq));
        // Global positions are contiguous.
        let hs: Vec<ChunkHeader> = buf.live_chunks().map(|c| c.header).collect();
        for w in hs.windows(2) {
            assert_eq!(w[0].global_start + w[0].end as u64, w[1].global_start);
            assert_eq!(w[0].seq + 1, w[1].seq);
        }
    }

    #[test]
    fn oversized_block_is_refused() {
        let mut buf = ChunkedBuffer::with_chunk_size(256, 64);
        buf.start_chunk(0);
        assert!(matches!(buf.push(&[0; 64], 0), Err(PushError::TooLarge { .. })));
        assert!(buf.push(&[0; 59], 0).is_ok());
    }

    #[test]
    fn corruption_is_detected_never_read_past() {
        let mut buf = ChunkedBuffer::with_chunk_size(1024, 256);
        fill(&mut buf, &(0..5u8).map(|i| (vec![i; 30], i as u64)).collect::<Vec<_>>());
        let good = buf.snapshot().remove(0);
        assert_eq!(ChunkView::parse(&good).unwrap().blocks().count(), 5);
        for cut in 0..good.len() {
            assert!(ChunkView::parse(&good[..cut]).is_err(), "truncated at {cut}");
        }
        for i in 0..good.len() {
            for bit in 0..8 {
                let mut bad = good.clone();
                bad[i] ^= 1 << bit;
                assert!(ChunkView::parse(&bad).is_err(), "flip byte {i} bit {bit}");
            }
        }
    }
}
