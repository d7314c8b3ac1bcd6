//! Where a long-lived symbolizer reads a file's DWARF from, so that it can parse it afresh for
//! each call instead of holding it.
//!
//! blazesym parses DWARF lazily and keeps what it parsed: libc's (libc6-dbg), looked up at 50
//! spread addresses, held 3.0 MiB of heap; at 1,000, 23 MiB; at 80,000, 40 MiB. An agent held
//! it for its whole life, and its RSS grew as the host's programs reached new code. Parsing per
//! call keeps only the names (in `cache::FrameCache`). Debian's debug files have
//! zlib-compressed sections, which blazesym inflates into the heap on every parse (33 ms and
//! 9.5 MiB for libc's): a call reads an uncompressed copy instead, made once into a cache
//! directory, where the parse costs 6 ms for 50 addresses and the file's pages stay in the page
//! cache, not in our heap.

use std::{
    hash::{Hash as _, Hasher as _},
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use object::{
    Object as _, ObjectSection as _, ObjectSegment as _,
    build::elf::{Builder, SectionData},
    elf,
};

use crate::system::cache_dir::CacheDir;

/// Overrides the cache directory (tests).
const CACHE_ENV: &str = "RSPROF_DEBUG_CACHE";
const DEFAULT_CACHE: &str = "/var/cache/rsprof-bpf/debug";
/// The cache directory's bound: copies beyond it are deleted, least recently used first.
const CACHE_BYTES: u64 = 512 << 20;
/// A debug file whose sections inflate to more than this is not copied (read as blazesym does).
const MAX_COPY_BYTES: u64 = 256 << 20;

pub fn cache_dir() -> PathBuf {
    crate::system::host::dir_from_env(CACHE_ENV, DEFAULT_CACHE)
}

/// Where a file's DWARF is read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DwarfSource {
    /// The file to hand blazesym: the file itself, its debug file, or an uncompressed copy of
    /// either.
    pub path: PathBuf,
    /// For a file other than the module's own: the module's loadable segments (file offset,
    /// virtual address, size), to turn its file offsets into the addresses the DWARF uses.
    /// `None`: the module's own file, asked by file offset.
    pub loads: Option<Vec<(u64, u64, u64)>>,
}

impl DwarfSource {
    /// The virtual address of file offset `offset` of the module, for `path`.
    pub fn address(&self, offset: u64) -> Option<u64> {
        let Some(loads) = &self.loads else { return Some(offset) };
        loads
            .iter()
            .find(|&&(at, _, size)| offset >= at && offset - at < size)
            .map(|&(at, vaddr, _)| offset - at + vaddr)
    }
}

/// Where the DWARF of the ELF file `path` is read from: `Ok(None)` when it has none, neither
/// in itself nor in a debug file found under `debug_root` (or either cannot be read here:
/// blazesym then reads the file as before, and says what failed); `Err` when it has compressed
/// DWARF that could not be copied uncompressed into `cache`.
pub fn source(path: &Path, debug_root: &Path, cache: &Path) -> Result<Option<DwarfSource>, String> {
    let Some(data) = map(path) else { return Ok(None) };
    let Ok(elf) = object::File::parse(&*data) else { return Ok(None) };
    let loads = || {
        elf.segments()
            .filter_map(|s| {
                let (at, size) = s.file_range();
                (size > 0).then_some((at, s.address(), size))
            })
            .collect::<Vec<_>>()
    };
    if has_dwarf(&elf) {
        if !compressed(&elf) {
            return Ok(Some(DwarfSource { path: path.to_owned(), loads: None }));
        }
        let copy = uncompressed_copy(path, &data, cache)?;
        return Ok(Some(DwarfSource { path: copy, loads: Some(loads()) }));
    }
    let Ok(links) = profiler_unwind::debug_links(&data) else { return Ok(None) };
    let Some(debug) = crate::debugfile::find_path(debug_root, &path.to_string_lossy(), &links)
    else {
        return Ok(None);
    };
    let Some(ddata) = map(&debug) else { return Ok(None) };
    let Ok(delf) = object::File::parse(&*ddata) else { return Ok(None) };
    if !has_dwarf(&delf) {
        return Ok(None);
    }
    let read = if compressed(&delf) { uncompressed_copy(&debug, &ddata, cache)? } else { debug };
    Ok(Some(DwarfSource { path: read, loads: Some(loads()) }))
}

/// The module at `path` named from `debug`, a debug file found for it elsewhere (fetched from
/// debuginfod), addressed through the module's loadable segments.
pub fn with_debug_file(path: &Path, debug: &Path) -> Option<DwarfSource> {
    let data = map(path)?;
    let elf = object::File::parse(&*data).ok()?;
    let loads = elf
        .segments()
        .filter_map(|s| {
            let (at, size) = s.file_range();
            (size > 0).then_some((at, s.address(), size))
        })
        .collect();
    Some(DwarfSource { path: debug.to_owned(), loads: Some(loads) })
}

fn map(path: &Path) -> Option<memmap2::Mmap> {
    let file = std::fs::File::open(path).ok()?;
    // SAFETY: a read-only private mapping of a file we only read; a file truncated meanwhile
    // faults this read as it would the processes running it.
    unsafe { memmap2::Mmap::map(&file) }.ok()
}

fn has_dwarf(elf: &object::File<'_>) -> bool {
    elf.section_by_name(".debug_info")
        .is_some_and(|s| s.kind() != object::SectionKind::UninitializedData)
        || elf.section_by_name(".zdebug_info").is_some()
}

/// Whether a DWARF section is compressed (`SHF_COMPRESSED`, or the older `.zdebug_*`).
fn compressed(elf: &object::File<'_>) -> bool {
    elf.sections().any(|s| {
        let name = s.name().unwrap_or("");
        name.starts_with(".zdebug_")
            || (name.starts_with(".debug_")
                && matches!(s.flags(), object::SectionFlags::Elf { sh_flags }
                    if sh_flags & u64::from(elf::SHF_COMPRESSED) != 0))
    })
}

/// The cached uncompressed copy of the ELF file `path` (contents `data`), made if missing:
/// named by the file's identity, written whole then renamed (agents may share the directory),
/// its mtime renewed on use; the least recently used copies go beyond `CACHE_BYTES`.
fn uncompressed_copy(path: &Path, data: &[u8], cache: &Path) -> Result<PathBuf, String> {
    let m = std::fs::metadata(path).map_err(|e| e.to_string())?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec(), path).hash(&mut h);
    let name = path.file_name().map_or("file".into(), |n| n.to_string_lossy());
    let name = format!("{:016x}-{name}", h.finish());
    let dir = CacheDir::new(cache.to_owned(), CACHE_BYTES);
    if dir.open(&name).is_some() {
        return Ok(dir.path(&name));
    }
    let out = inflate(data)?;
    dir.write(&name, &[&out]).map_err(|e| format!("{}: {e}", dir.path(&name).display()))?;
    Ok(dir.path(&name))
}

/// `data` (an ELF file) with its zlib-compressed sections stored uncompressed.
fn inflate(data: &[u8]) -> Result<Vec<u8>, String> {
    let mut b = Builder::read(data).map_err(|e| e.to_string())?;
    let mut total = data.len() as u64;
    for s in b.sections.iter_mut() {
        if s.sh_flags & u64::from(elf::SHF_COMPRESSED) == 0 {
            if s.name.as_slice().starts_with(b".zdebug_") {
                return Err("old-style .zdebug sections".into());
            }
            continue;
        }
        let SectionData::Data(d) = &s.data else { continue };
        let d = d.as_slice();
        // Elf64_Chdr: ch_type u32, reserved u32, ch_size u64, ch_addralign u64 (little-endian
        // on x86-64, the only machine we read).
        let field = |at: usize, n: usize| d.get(at..at + n).ok_or("short compression header");
        let ch_type = u32::from_le_bytes(field(0, 4)?.try_into().unwrap());
        let size = u64::from_le_bytes(field(8, 8)?.try_into().unwrap());
        let align = u64::from_le_bytes(field(16, 8)?.try_into().unwrap());
        if ch_type != elf::ELFCOMPRESS_ZLIB {
            return Err(format!("sections compressed with type {ch_type}, not zlib"));
        }
        total += size;
        if total > MAX_COPY_BYTES {
            return Err(format!("more than {MAX_COPY_BYTES} bytes uncompressed"));
        }
        let out = crate::debugfile::inflate_zlib(&d[24..], size)
            .map_err(|e| format!("inflating {}: {e}", s.name))?;
        if out.len() as u64 != size {
            return Err(format!("{} inflates to {} bytes, not {size}", s.name, out.len()));
        }
        s.data = SectionData::Data(out.into());
        s.sh_flags &= !u64::from(elf::SHF_COMPRESSED);
        s.sh_addralign = align;
    }
    let mut out = Vec::new();
    b.write(&mut out).map_err(|e| e.to_string())?;
    Ok(out)
}

#[cfg(test)]
pub(super) mod tests {
    use std::process::Command;

    use super::*;
    use crate::debugfile::tests::tool;

    /// A C program built with `-g` in `dir`, then split the way Debian ships it: `stripped`
    /// has no DWARF, its zlib-compressed debug file is under `root`'s `.build-id/`.
    pub(crate) struct Split {
        pub src: PathBuf,
        pub exe: PathBuf,
        pub stripped: PathBuf,
        pub root: PathBuf,
    }

    pub(crate) fn split_program(dir: &Path, c_source: &str) -> Split {
        let src = dir.join("f.c");
        std::fs::write(&src, c_source).unwrap();
        let exe = dir.join("f");
        tool(Command::new("gcc").args(["-O1", "-g", "-o"]).arg(&exe).arg(&src));
        let debug = dir.join("f.debug");
        tool(
            Command::new("objcopy")
                .args(["--only-keep-debug", "--compress-debug-sections=zlib"])
                .arg(&exe)
                .arg(&debug),
        );
        let stripped = dir.join("f.stripped");
        tool(Command::new("objcopy").arg("--strip-debug").arg(&exe).arg(&stripped));
        let root = dir.join("root");
        let links = profiler_unwind::debug_links(&std::fs::read(&stripped).unwrap()).unwrap();
        let at = crate::debugfile::build_id_path(&root, links.build_id.as_deref().unwrap());
        std::fs::create_dir_all(at.parent().unwrap()).unwrap();
        std::fs::copy(&debug, &at).unwrap();
        Split { src, exe, stripped, root }
    }

    /// A program split the way Debian ships it (stripped, with a zlib-compressed debug file
    /// under the debug root's `.build-id/`): its DWARF is read from an uncompressed copy
    /// with the same sections, addressed by virtual address; the copy is made once.
    #[test]
    fn compressed_debug_file_is_read_from_an_uncompressed_copy() {
        let dir = std::env::temp_dir().join(format!("rsprof-dwarf-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let Split { exe, stripped, root, .. } = split_program(
            &dir,
            "int f(int x) { return x * 3; }\nint main(void) { return f(2); }\n",
        );
        let cache = dir.join("cache");

        // No debug file under another root, no DWARF of its own: nothing to parse.
        assert_eq!(source(&stripped, &dir.join("none"), &cache), Ok(None));
        // The unstripped program's own, uncompressed DWARF: the file itself.
        let own = source(&exe, &root, &cache).unwrap().unwrap();
        assert_eq!((own.path.as_path(), own.loads.as_ref()), (exe.as_path(), None));

        let found = source(&stripped, &root, &cache).unwrap().expect("debug file found");
        assert!(found.path.starts_with(&cache), "{found:?}");
        let copy = std::fs::read(&found.path).unwrap();
        let elf = object::File::parse(&*copy).unwrap();
        assert!(!compressed(&elf), "the copy still has compressed sections");
        let plain = dir.join("plain.debug");
        tool(Command::new("objcopy").arg("--only-keep-debug").arg(&exe).arg(&plain));
        let plain_data = std::fs::read(&plain).unwrap();
        let plain_elf = object::File::parse(&*plain_data).unwrap();
        for name in [".debug_info", ".debug_line", ".debug_abbrev"] {
            let a = elf.section_by_name(name).unwrap().data().unwrap();
            let b = plain_elf.section_by_name(name).unwrap().data().unwrap();
            assert_eq!(a, b, "{name} differs from objcopy's uncompressed one");
        }
        // File offsets of the text turn into the addresses the DWARF uses.
        let exe_data = std::fs::read(&stripped).unwrap();
        let exe_elf = object::File::parse(&*exe_data).unwrap();
        let text = exe_elf.section_by_name(".text").unwrap();
        let (off, _) = text.file_range().unwrap();
        assert_eq!(found.address(off), Some(text.address()));
        assert_eq!(found.address(u64::MAX - 1), None);

        // Made once: the second lookup finds the same copy.
        let modified = std::fs::metadata(&found.path).unwrap().len();
        assert_eq!(source(&stripped, &root, &cache).unwrap(), Some(found.clone()));
        assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 1);
        assert_eq!(std::fs::metadata(&found.path).unwrap().len(), modified);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
