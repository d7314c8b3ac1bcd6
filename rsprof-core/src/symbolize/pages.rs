//! Gives back the page-table entries of the files blazesym keeps mapped between calls.
//!
//! blazesym maps each ELF file it reads (read-only, shared) and keeps the mapping while the
//! file stays parsed. Every page a lookup touched then counts in our RSS until the file is
//! evicted: next to a big binary (ClickHouse's 18.16 library) an agent's RSS grew by tens of
//! MiB of file pages. Those pages belong to the page cache, not to us; `MADV_DONTNEED` on a
//! shared file mapping only drops our references to them (the data is re-read from the page
//! cache on the next touch, a minor fault), so the parsed state blazesym keeps stays valid.

use std::fs;

/// Advises `MADV_DONTNEED` on every read-only shared mapping of a regular file in this
/// process: the only ones we make are blazesym's (our code and libraries are private
/// mappings; BPF maps are not files on a path). Returns how many were advised; errors are
/// ignored: this only lowers RSS.
pub fn release_file_pages() -> usize {
    let Ok(maps) = fs::read_to_string("/proc/self/maps") else {
        return 0;
    };
    let mut advised = 0;
    for (start, end) in shared_read_only_files(&maps) {
        // SAFETY: the range is a whole mapping of this process as /proc lists it. Only
        // read-only shared file mappings are advised, whose contents the kernel re-reads from
        // the file on the next access, so no data anyone holds a pointer into changes. Should
        // the mapping have gone meanwhile, the call fails or touches nothing.
        let r = unsafe {
            libc::madvise(start as *mut libc::c_void, (end - start) as usize, libc::MADV_DONTNEED)
        };
        if r == 0 {
            advised += 1;
        }
    }
    advised
}

/// (start, end) of the read-only shared mappings of files on a path in a /proc/PID/maps text.
fn shared_read_only_files(maps: &str) -> Vec<(u64, u64)> {
    maps.lines()
        .filter_map(|line| {
            let mut f = line.split_ascii_whitespace();
            let range = f.next()?;
            let perms = f.next()?;
            // offset, dev, inode, then the path
            let path = f.nth(3)?;
            if perms != "r--s" || !path.starts_with('/') {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            Some((u64::from_str_radix(a, 16).ok()?, u64::from_str_radix(b, 16).ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_only_read_only_shared_file_mappings() {
        let maps = "\
55d0a0000000-55d0a0100000 r--p 00000000 fe:01 123 /usr/bin/rsprof-bpf
7f0000000000-7f0000400000 r--s 00000000 fe:01 456 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000400000-7f0000500000 r-xp 00028000 fe:01 456 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000500000-7f0000600000 r--s 00000000 00:0f 1045 anon_inode:bpf-map
7f0000600000-7f0000700000 rw-s 00000000 00:01 77 /dev/shm/x
7f0000700000-7f0000701000 r--s 00000000 00:00 0
";
        assert_eq!(shared_read_only_files(maps), vec![(0x7f0000000000, 0x7f0000400000)]);
    }

    #[test]
    fn pages_of_a_mapped_file_leave_rss_and_its_contents_stay() {
        use std::io::Write as _;
        let path = std::env::temp_dir().join(format!("rsprof-pages-{}", std::process::id()));
        let len = 8 << 20;
        let mut f = fs::File::create(&path).unwrap();
        f.write_all(&vec![7u8; len]).unwrap();
        drop(f);
        let f = fs::File::open(&path).unwrap();
        // SAFETY: a fresh read-only shared mapping of our own temp file.
        let p = unsafe {
            use std::os::fd::AsRawFd as _;
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: reading within the mapping just made.
        let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
        let sum: u64 = bytes.iter().step_by(4096).map(|&b| u64::from(b)).sum();
        assert_eq!(sum, 7 * (len as u64 / 4096));
        let resident = || mapping_rss_kib(p as u64);
        assert!(resident() >= 8 * 1024 - 64, "touched pages are resident: {}", resident());
        let advised = release_file_pages();
        assert!(advised >= 1, "{advised} mappings advised");
        assert!(resident() < 1024, "released: {} KiB left", resident());
        // Still readable, same contents.
        assert!(bytes.iter().step_by(4096).all(|&b| b == 7));
        // SAFETY: unmapping what was mapped above.
        unsafe { libc::munmap(p, len) };
        let _ = fs::remove_file(&path);
    }

    /// Rss of the mapping starting at `start`, from /proc/self/smaps.
    fn mapping_rss_kib(start: u64) -> u64 {
        let smaps = fs::read_to_string("/proc/self/smaps").unwrap();
        let head = format!("{start:x}-");
        let mut inside = false;
        for line in smaps.lines() {
            if line.starts_with(|c: char| c.is_ascii_hexdigit()) && line.contains('-') {
                inside = line.starts_with(&head);
            } else if inside && line.starts_with("Rss:") {
                return line.split_ascii_whitespace().nth(1).unwrap().parse().unwrap();
            }
        }
        panic!("no mapping at {start:x}");
    }
}
