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

/// Reads how full the ring is, for metrics: the kernel's consumer and producer positions,
/// mapped read-only from the ring's fd (a second mapping beside aya's; the kernel allows any
/// number of read-only ones).
pub struct RingFill {
    pages: *const u8,
    page: usize,
}

// SAFETY: the mapping is read-only and only read with atomic loads.
unsafe impl Send for RingFill {}

impl RingFill {
    pub fn new(ring: &impl std::os::fd::AsRawFd) -> std::io::Result<Self> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        // SAFETY: maps the consumer and producer position pages of a ring buffer map fd,
        // read-only and shared; unmapped in Drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                2 * page,
                libc::PROT_READ,
                libc::MAP_SHARED,
                ring.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { pages: p.cast(), page })
    }

    /// Bytes written by the BPF programs and not yet consumed (headers included).
    pub fn used_bytes(&self) -> u64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        // SAFETY: both positions are 8-byte aligned u64s at the start of their pages, which
        // stay mapped while self lives; the kernel updates them atomically.
        let (consumer, producer) = unsafe {
            (
                (*self.pages.cast::<AtomicU64>()).load(Ordering::Acquire),
                (*self.pages.add(self.page).cast::<AtomicU64>()).load(Ordering::Acquire),
            )
        };
        producer.saturating_sub(consumer)
    }
}

impl Drop for RingFill {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what new() mapped.
        unsafe { libc::munmap(self.pages as *mut _, 2 * self.page) };
    }
}
