//! Draining the ring buffer the BPF programs write to.

use aya::maps::{MapData, RingBuf};

/// Hands every record now in the ring to `on_record`, oldest first; returns how many.
pub fn drain(ring: &mut RingBuf<MapData>, mut on_record: impl FnMut(&[u8])) -> usize {
    let mut n = 0;
    while let Some(item) = ring.next() {
        on_record(&item);
        n += 1;
    }
    n
}
