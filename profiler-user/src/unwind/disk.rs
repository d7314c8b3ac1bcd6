//! Compiled unwind tables kept on disk, so that the next run (a `record` of the same command,
//! an agent restarted) loads a file's table in milliseconds instead of compiling its CFI again:
//! `librustc_driver`'s 154 MB took over a second. Keyed by the file's identity (device, inode,
//! mtime, size: a file replaced in place has a new mtime), in a bounded directory shared by runs
//! (`/var/cache/rsprof-bpf/unwind`, `RSPROF_UNWIND_CACHE`). A file is checked whole on load
//! (magic, layout version, row size, its own identity, length, CRC of the rows); one that fails
//! is deleted and compiled afresh.

use std::io::Read as _;

use profiler_common::UnwindRow;

use super::FileIdentity;
use crate::system::cache_dir::CacheDir;

const CACHE_ENV: &str = "RSPROF_UNWIND_CACHE";
const DEFAULT_DIR: &str = "/var/cache/rsprof-bpf/unwind";
/// Tables of every library of a big desktop or server host fit (libxul's is ~40 MiB).
const CACHE_BYTES: u64 = 1 << 30;
/// Smaller files are compiled afresh each run, not kept.
pub const MIN_FILE_BYTES: u64 = 64 << 10;
const MAGIC: &[u8; 8] = b"RSPUNW\0\x01";
/// Bumped whenever what the compiler emits changes meaning (2: frames over 64 KiB became
/// `UNWIND_CFA_RSP_LARGE` rows, no longer unsupported).
const VERSION: u32 = 2;
const HEADER: usize = 8 + 4 + 4 + 8 * 4 + 8 + 4 + 4;
const ROW: usize = std::mem::size_of::<UnwindRow>();

/// A table read back: its rows and the separate-debug-file FDEs it was built with.
pub struct Cached {
    pub rows: Vec<UnwindRow>,
    pub debug_fdes: u64,
}

/// What a load found.
pub enum Loaded {
    Hit(Cached),
    Miss,
    /// Present but not a good table (deleted): why.
    Rejected(String),
}

pub struct DiskTables {
    dir: CacheDir,
}

impl DiskTables {
    /// The cache, unless `RSPROF_UNWIND_CACHE` is `off`.
    pub fn from_env() -> Option<Self> {
        let dir = crate::system::host::dir_from_env(CACHE_ENV, DEFAULT_DIR);
        (dir.as_os_str() != "off").then(|| Self { dir: CacheDir::new(dir, CACHE_BYTES) })
    }

    /// The directory, which also holds each command's launch list (`launch`).
    pub fn dir(&self) -> &CacheDir {
        &self.dir
    }

    fn name(id: &FileIdentity) -> String {
        format!("{:x}-{:x}-{:x}-{:x}.rows", id.0, id.1, id.2, id.3)
    }

    pub fn load(&self, id: &FileIdentity) -> Loaded {
        let name = Self::name(id);
        let Some(mut f) = self.dir.open(&name) else { return Loaded::Miss };
        let mut bytes = Vec::new();
        let checked =
            f.read_to_end(&mut bytes).map_err(|e| e.to_string()).and_then(|_| decode(&bytes, id));
        match checked {
            Ok(c) => Loaded::Hit(c),
            Err(why) => {
                self.dir.remove(&name);
                Loaded::Rejected(format!("{}: {why}", self.dir.path(&name).display()))
            }
        }
    }

    /// Stores a table; returns the files deleted to stay within the bound.
    pub fn store(
        &self,
        id: &FileIdentity,
        rows: &[UnwindRow],
        debug_fdes: u64,
    ) -> std::io::Result<u64> {
        let body = encode_rows(rows);
        let header = header(id, rows.len() as u64, debug_fdes, crc32fast::hash(&body));
        self.dir.write(&Self::name(id), &[&header, &body])
    }
}

fn encode_rows(rows: &[UnwindRow]) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows.len() * ROW);
    for r in rows {
        out.extend_from_slice(&r.pc.to_le_bytes());
        out.extend_from_slice(&r.cfa_offset.to_le_bytes());
        out.push(r.aux as u8);
        out.push(r.kinds);
    }
    out
}

fn header(id: &FileIdentity, rows: u64, debug_fdes: u64, crc: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&(ROW as u32).to_le_bytes());
    for v in [id.0, id.1, id.2 as u64, id.3] {
        h.extend_from_slice(&v.to_le_bytes());
    }
    h.extend_from_slice(&rows.to_le_bytes());
    h.extend_from_slice(&crc.to_le_bytes());
    h.extend_from_slice(&(debug_fdes as u32).to_le_bytes());
    h
}

fn decode(bytes: &[u8], id: &FileIdentity) -> Result<Cached, String> {
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return Err("not a table file".into());
    }
    if u32_at(8) != VERSION || u32_at(12) as usize != ROW {
        return Err(format!("layout version {} row size {}", u32_at(8), u32_at(12)));
    }
    let stored = (u64_at(16), u64_at(24), u64_at(32) as i64, u64_at(40));
    if stored != *id {
        return Err(format!("made for file {stored:?}"));
    }
    let rows = u64_at(48) as usize;
    let body = &bytes[HEADER..];
    if rows == 0 || rows.checked_mul(ROW) != Some(body.len()) {
        return Err(format!("{} bytes for {rows} rows", body.len()));
    }
    if crc32fast::hash(body) != u32_at(56) {
        return Err("CRC mismatch".into());
    }
    let rows = body
        .chunks_exact(ROW)
        .map(|c| UnwindRow {
            pc: u32::from_le_bytes(c[0..4].try_into().unwrap()),
            cfa_offset: u16::from_le_bytes(c[4..6].try_into().unwrap()),
            aux: c[6] as i8,
            kinds: c[7],
        })
        .collect();
    Ok(Cached { rows, debug_fdes: u64::from(u32_at(60)) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tables(dir: &std::path::Path) -> DiskTables {
        DiskTables { dir: CacheDir::new(dir.to_owned(), CACHE_BYTES) }
    }

    #[test]
    fn a_table_comes_back_and_a_damaged_one_is_rejected_and_deleted() {
        let dir = std::env::temp_dir().join(format!("rsprof-disktables-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let t = tables(&dir);
        let id = (1, 2, -3, 4);
        let rows: Vec<UnwindRow> = (0..100)
            .map(|i| UnwindRow { pc: i * 16, cfa_offset: 8 + i as u16, aux: -2, kinds: 0x21 })
            .collect();
        assert!(matches!(t.load(&id), Loaded::Miss));
        t.store(&id, &rows, 7).unwrap();
        let Loaded::Hit(c) = t.load(&id) else { panic!("not read back") };
        assert_eq!((c.rows, c.debug_fdes), (rows.clone(), 7));
        // Another file's identity never reads it.
        assert!(matches!(t.load(&(1, 2, -3, 5)), Loaded::Miss));
        // One flipped bit in the rows: rejected, deleted, then a miss.
        let path = dir.join(DiskTables::name(&id));
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(t.load(&id), Loaded::Rejected(w) if w.contains("CRC")));
        assert!(matches!(t.load(&id), Loaded::Miss));
        // Cut short.
        t.store(&id, &rows, 0).unwrap();
        std::fs::write(&path, &std::fs::read(&path).unwrap()[..HEADER + 10]).unwrap();
        assert!(matches!(t.load(&id), Loaded::Rejected(_)));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
