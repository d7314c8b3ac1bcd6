//! The `UNWIND_ROWS` array mapped into this process (the map is `BPF_F_MMAPABLE`): a table's
//! rows are copied in with one memcpy instead of one map update syscall per row.

use std::{
    os::fd::{AsFd as _, AsRawFd as _},
    ptr::NonNull,
};

use anyhow::{Context as _, Result, bail};
use aya::maps::MapData;
use profiler_common::UnwindRow;

pub struct RowsMmap {
    ptr: NonNull<UnwindRow>,
    capacity: u32,
    len_bytes: usize,
    /// Keeps the map (and so the mapping's pages) alive.
    _map: MapData,
}

// SAFETY: the mapping is plain shared memory; writers are handed disjoint row ranges by the
// allocator (`worker::Shared::alloc`), and the walker reads a range only after the process
// entry naming it is written, after the copy. A range is handed out again only once no entry
// names it (evicted after the loader released it, see `worker::EVICT_GRACE`).
unsafe impl Send for RowsMmap {}
unsafe impl Sync for RowsMmap {}

impl RowsMmap {
    pub fn new(map: MapData) -> Result<Self> {
        let info = map.info().context("UNWIND_ROWS info")?;
        let capacity = info.max_entries();
        if info.value_size() as usize != size_of::<UnwindRow>() {
            bail!("UNWIND_ROWS value size {} is not {}", info.value_size(), size_of::<UnwindRow>());
        }
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let len_bytes = (capacity as usize * size_of::<UnwindRow>()).div_ceil(page) * page;
        let fd = map.fd().as_fd().as_raw_fd();
        // SAFETY: a fresh shared mapping of the map's pages; unmapped in Drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error())
                .context("mmap the UNWIND_ROWS map (needs BPF_F_MMAPABLE, kernel 5.5+)");
        }
        let ptr = NonNull::new(ptr.cast::<UnwindRow>()).context("mmap returned null")?;
        Ok(Self { ptr, capacity, len_bytes, _map: map })
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Copies `rows` to `first..`. The range must come from the allocator (no other writer)
    /// and not be named by any process entry yet.
    pub fn write(&self, first: u32, rows: &[UnwindRow]) {
        let end = first as usize + rows.len();
        assert!(end <= self.capacity as usize, "rows {first}..{end} beyond {}", self.capacity);
        // SAFETY: in bounds (checked above); the range is this writer's alone (see above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                rows.as_ptr(),
                self.ptr.as_ptr().add(first as usize),
                rows.len(),
            )
        };
    }
}

impl Drop for RowsMmap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, with its length.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len_bytes) };
    }
}
