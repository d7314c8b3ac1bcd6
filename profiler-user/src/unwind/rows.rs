//! The `UNWIND_ROWS` array, written through short-lived mappings of this process (the map is
//! `BPF_F_MMAPABLE`): a table's rows are copied in with one memcpy instead of one map update
//! syscall per row. Only the pages being written are mapped, and only while they are: the
//! whole array (`--unwind-table-mb`, kernel memory either way) mapped for the recording's
//! life made it all count in the profiler's RSS.

use std::os::fd::{AsFd as _, AsRawFd as _};

use anyhow::{Context as _, Result, bail};
use aya::maps::MapData;
use profiler_common::UnwindRow;

pub struct RowsMmap {
    capacity: u32,
    page: usize,
    /// Keeps the map alive; its fd is what `write` maps.
    map: MapData,
}

// SAFETY: writers are handed disjoint row ranges by the allocator (`worker::Shared::alloc`),
// each through its own mapping; the walker reads a range only after the process entry naming
// it is written, after the copy. A range is handed out again only once no entry names it
// (evicted after the loader released it, see `worker::EVICT_GRACE`).
unsafe impl Send for RowsMmap {}
unsafe impl Sync for RowsMmap {}

/// A shared mapping of `len` bytes of the array's values from byte `offset` (page-aligned).
struct Window {
    ptr: *mut libc::c_void,
    len: usize,
}

impl Window {
    fn new(map: &MapData, offset: usize, len: usize) -> std::io::Result<Self> {
        let fd = map.fd().as_fd().as_raw_fd();
        // SAFETY: a fresh shared mapping of the map's pages; unmapped in Drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { ptr, len })
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, with its length.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

impl RowsMmap {
    pub fn new(map: MapData) -> Result<Self> {
        let info = map.info().context("UNWIND_ROWS info")?;
        let capacity = info.max_entries();
        if info.value_size() as usize != size_of::<UnwindRow>() {
            bail!("UNWIND_ROWS value size {} is not {}", info.value_size(), size_of::<UnwindRow>());
        }
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        // Fails here, at start-up, rather than at the first table.
        Window::new(&map, 0, page)
            .context("mmap the UNWIND_ROWS map (needs BPF_F_MMAPABLE, kernel 5.5+)")?;
        Ok(Self { capacity, page, map })
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Copies `rows` to `first..`. The range must come from the allocator (no other writer)
    /// and not be named by any process entry yet.
    pub fn write(&self, first: u32, rows: &[UnwindRow]) -> Result<()> {
        let end = first as usize + rows.len();
        assert!(end <= self.capacity as usize, "rows {first}..{end} beyond {}", self.capacity);
        if rows.is_empty() {
            return Ok(());
        }
        let row = size_of::<UnwindRow>();
        let from = first as usize * row / self.page * self.page;
        let to = (end * row).div_ceil(self.page) * self.page;
        let w = Window::new(&self.map, from, to - from)
            .with_context(|| format!("mmap UNWIND_ROWS rows {first}..{end}"))?;
        // SAFETY: the window holds rows `first..end` (page-aligned around them, within the
        // array as `end <= capacity`); the range is this writer's alone (see above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                rows.as_ptr(),
                w.ptr.cast::<u8>().add(first as usize * row - from).cast::<UnwindRow>(),
                rows.len(),
            )
        };
        Ok(())
    }
}
