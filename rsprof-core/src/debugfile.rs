//! Separate debug files, found the way gdb finds them, for files whose own CFI leaves some of
//! their code undescribed (built with `-fno-asynchronous-unwind-tables`, then split with
//! `objcopy --only-keep-debug` + `strip`: the `.debug_frame` went to the debug file):
//! 1. `<root>/.build-id/xx/rest.debug` from the file's GNU build-id (the debug file's own
//!    build-id must match);
//! 2. the `.gnu_debuglink` name in the file's directory, its `.debug/` subdirectory, and
//!    `<root>/<dir>/`, accepted only when the CRC-32 of its contents matches.
//!
//! `<root>` is `/usr/lib/debug`, or `$RSPROF_DEBUG_ROOT` (meant for tests, which must not
//! write to the real one). Only the ELF header, the section headers, their names, the
//! build-id note and `.debug_frame` are read from a debug file (which can be hundreds of MiB),
//! except that a `.gnu_debuglink` candidate is read once through for its CRC.

use std::{
    fs::File,
    io::Read as _,
    path::{Path, PathBuf},
};

use object::{
    Endianness, ReadRef as _,
    elf::{self, FileHeader64},
    read::{
        ReadCache,
        elf::{CompressionHeader as _, FileHeader as _, SectionHeader as _},
    },
};
use profiler_unwind::{DebugLinks, UnwindTable};

/// Overrides the debug root (tests).
const DEBUG_ROOT_ENV: &str = "RSPROF_DEBUG_ROOT";
const DEFAULT_DEBUG_ROOT: &str = "/usr/lib/debug";
/// A `.debug_frame` larger than this (uncompressed) is not read: libc's is under 1 MiB.
const MAX_DEBUG_FRAME_BYTES: u64 = 64 << 20;
/// A `.gnu_debuglink` candidate larger than this is not checksummed.
const MAX_CRC_BYTES: u64 = 4 << 30;

pub fn debug_root() -> PathBuf {
    crate::system::host::dir_from_env(DEBUG_ROOT_ENV, DEFAULT_DEBUG_ROOT)
}

/// How a debug file was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum How {
    BuildId,
    DebugLink,
}

/// A matching debug file and its `.debug_frame` (None: it has none, or only a `NOBITS` one).
pub struct Found {
    pub path: PathBuf,
    pub how: How,
    pub debug_frame: Option<Vec<u8>>,
}

/// The outcome of a lookup: the first matching debug file, and why candidates that exist were
/// not taken (wrong build-id or CRC, unreadable, too large).
#[derive(Default)]
pub struct Lookup {
    pub found: Option<Found>,
    pub rejected: Vec<String>,
}

/// `<root>/.build-id/xx/rest.debug` for a build-id of at least 2 bytes.
pub fn build_id_path(root: &Path, id: &[u8]) -> PathBuf {
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    root.join(".build-id").join(&hex[..2]).join(format!("{}.debug", &hex[2..]))
}

/// Looks for the debug file of the file mapped at `mapped_path` (its path as the process sees
/// it: `.gnu_debuglink` is relative to its directory).
pub fn find(root: &Path, mapped_path: &str, links: &DebugLinks) -> Lookup {
    let mut lookup = Lookup::default();
    lookup.found = search(root, mapped_path, links, &mut lookup.rejected, read_debug_frame)
        .map(|(path, how, debug_frame)| Found { path, how, debug_frame });
    lookup
}

/// The path of the debug file of the file at `path` (build-id checked, or CRC-32 for a
/// `.gnu_debuglink`), found as [`find`] finds it; `None` when there is none.
pub fn find_path(root: &Path, path: &str, links: &DebugLinks) -> Option<PathBuf> {
    let check = |p: &Path, id: Option<&[u8]>| match id {
        Some(id) => check_build_id(p, id),
        None => Ok(()),
    };
    search(root, path, links, &mut Vec::new(), check).map(|(p, _, ())| p)
}

/// The first candidate `read` accepts (given the build-id it must have, for the build-id
/// path), and why candidates that exist were not taken.
fn search<T>(
    root: &Path,
    mapped_path: &str,
    links: &DebugLinks,
    rejected: &mut Vec<String>,
    read: impl Fn(&Path, Option<&[u8]>) -> Result<T, String>,
) -> Option<(PathBuf, How, T)> {
    if let Some(id) = links.build_id.as_deref().filter(|id| id.len() >= 2) {
        let path = build_id_path(root, id);
        if path.exists() {
            match read(&path, Some(id)) {
                Ok(t) => return Some((path, How::BuildId, t)),
                Err(e) => rejected.push(format!("{}: {e}", path.display())),
            }
        }
    }
    let (name, crc) = links.gnu_debuglink.as_ref()?;
    // A bare file name: never a path that could lead out of the searched directories.
    let name = std::str::from_utf8(name).ok()?;
    if name.is_empty() || name.contains('/') {
        return None;
    }
    let dir = Path::new(mapped_path).parent().filter(|d| d.is_absolute())?;
    let under_root = root.join(dir.strip_prefix("/").unwrap_or(dir));
    for candidate in [dir.join(name), dir.join(".debug").join(name), under_root.join(name)] {
        // The file itself when the link names it (a debug file linking to itself).
        if !candidate.is_file() || candidate == Path::new(mapped_path) {
            continue;
        }
        let checked = crc32(&candidate).and_then(|actual| {
            if actual == *crc {
                read(&candidate, None)
            } else {
                Err(format!("CRC-32 {actual:08x}, .gnu_debuglink says {crc:08x}"))
            }
        });
        match checked {
            Ok(t) => return Some((candidate, How::DebugLink, t)),
            Err(e) => rejected.push(format!("{}: {e}", candidate.display())),
        }
    }
    None
}

/// CRC-32 (the `.gnu_debuglink` one: IEEE, as zlib's) of a file's contents, read in chunks.
fn crc32(path: &Path) -> Result<u32, String> {
    let mut file = File::open(path).map_err(|e| e.to_string())?;
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    if len > MAX_CRC_BYTES {
        return Err(format!("{len} bytes, more than the {MAX_CRC_BYTES} checksummed"));
    }
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 256 << 10];
    loop {
        match file.read(&mut buf) {
            Ok(0) => return Ok(hasher.finalize()),
            Ok(n) => hasher.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Whether the x86-64 ELF file at `path` has the GNU build-id `want`.
fn check_build_id(path: &Path, want: &[u8]) -> Result<(), String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    let cache = ReadCache::new(file);
    let err = |e: object::Error| e.to_string();
    let header = FileHeader64::<Endianness>::parse(&cache).map_err(err)?;
    let endian = header.endian().map_err(err)?;
    let sections = header.sections(endian, &cache).map_err(err)?;
    same_build_id(&sections, endian, &cache, want)
}

fn same_build_id<'a>(
    sections: &object::read::elf::SectionTable<'a, FileHeader64<Endianness>, &'a ReadCache<File>>,
    endian: Endianness,
    cache: &'a ReadCache<File>,
    want: &[u8],
) -> Result<(), String> {
    let err = |e: object::Error| e.to_string();
    let mut have = None;
    for sh in sections.iter().filter(|sh| sh.sh_type(endian) == elf::SHT_NOTE) {
        let Some(mut notes) = sh.notes(endian, cache).map_err(err)? else { continue };
        while let Some(note) = notes.next().map_err(err)? {
            if note.name() == elf::ELF_NOTE_GNU && note.n_type(endian) == elf::NT_GNU_BUILD_ID {
                have = Some(note.desc().to_vec());
            }
        }
    }
    if have.as_deref() != Some(want) {
        return Err("its build-id differs".into());
    }
    Ok(())
}

/// The `.debug_frame` of an x86-64 debug file, reading only the headers it needs and that
/// section; with `build_id`, the file's build-id note must match it.
fn read_debug_frame(path: &Path, build_id: Option<&[u8]>) -> Result<Option<Vec<u8>>, String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    let cache = ReadCache::new(file);
    let err = |e: object::Error| e.to_string();
    let header = FileHeader64::<Endianness>::parse(&cache).map_err(err)?;
    let endian = header.endian().map_err(err)?;
    if header.e_machine(endian) != elf::EM_X86_64 {
        return Err("not an x86-64 ELF file".into());
    }
    let sections = header.sections(endian, &cache).map_err(err)?;
    if let Some(want) = build_id {
        same_build_id(&sections, endian, &cache, want)?;
    }
    let Some((_, sh)) = sections.section_by_name(endian, b".debug_frame") else {
        return Ok(None);
    };
    if sh.sh_type(endian) == elf::SHT_NOBITS {
        return Ok(None);
    }
    let too_big = |n: u64| format!(".debug_frame of {n} bytes, more than {MAX_DEBUG_FRAME_BYTES}");
    match sh.compression(endian, &cache).map_err(err)? {
        None => {
            let size = sh.sh_size(endian);
            if size > MAX_DEBUG_FRAME_BYTES {
                return Err(too_big(size));
            }
            Ok(Some(sh.data(endian, &cache).map_err(err)?.to_vec()).filter(|d| !d.is_empty()))
        }
        Some((chdr, offset, size)) => {
            let out_size = chdr.ch_size(endian);
            if out_size > MAX_DEBUG_FRAME_BYTES {
                return Err(too_big(out_size));
            }
            if chdr.ch_type(endian) != elf::ELFCOMPRESS_ZLIB {
                return Err(format!("compressed .debug_frame of type {}", chdr.ch_type(endian)));
            }
            let compressed = cache
                .read_bytes_at(offset, size)
                .map_err(|()| "compressed .debug_frame outside the file".to_string())?;
            let out = inflate_zlib(compressed, out_size)
                .map_err(|e| format!("decompressing .debug_frame: {e}"))?;
            Ok(Some(out).filter(|d| !d.is_empty()))
        }
    }
}

/// A zlib stream (an `ELFCOMPRESS_ZLIB` section's data after its header), inflated to at
/// most `size` bytes, the size its header gives.
pub fn inflate_zlib(compressed: &[u8], size: u64) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(size as usize);
    flate2::read::ZlibDecoder::new(compressed).take(size).read_to_end(&mut out)?;
    Ok(out)
}

/// What a separate debug file did for a file.
#[derive(Debug, Default)]
pub enum DebugUse {
    /// The file's own CFI covers all its code (or it is not a readable ELF file).
    #[default]
    NotNeeded,
    /// Looked for, not found (with why candidates that exist were rejected).
    NotFound { rejected: Vec<String> },
    /// Found, but its `.debug_frame` is absent or adds nothing (e.g. libc's: its `.eh_frame`
    /// covers what it can).
    NoNewCfi,
    /// Its `.debug_frame` filled `fdes` functions of the table.
    Used { how: How, fdes: usize },
    /// Found, but its `.debug_frame` does not compile.
    Failed(String),
}

/// Compiles a file's own CFI and, when that leaves some of its code undescribed, adds the
/// `.debug_frame` of its separate debug file if one is installed.
pub fn with_debug_file(
    data: &[u8],
    mapped_path: &str,
    root: &std::path::Path,
) -> (Result<UnwindTable, String>, DebugUse) {
    let own = UnwindTable::from_elf(data);
    let lacks_cfi = match &own {
        Ok(t) => t.stats().code_bytes_without_cfi > 0,
        Err(profiler_unwind::Error::NoCfi) => true,
        Err(_) => false,
    };
    let own = own.map_err(|e| e.to_string());
    let Some(links) = lacks_cfi.then(|| profiler_unwind::debug_links(data).ok()).flatten() else {
        return (own, DebugUse::NotNeeded);
    };
    let lookup = find(root, mapped_path, &links);
    let Some(found) = lookup.found else {
        return (own, DebugUse::NotFound { rejected: lookup.rejected });
    };
    let Some(frame) = found.debug_frame else {
        return (own, DebugUse::NoNewCfi);
    };
    match UnwindTable::from_elf_with_debug_frame(data, Some(&frame)) {
        Ok(t) if t.stats().separate_debug_frame_fdes > 0 => {
            let fdes = t.stats().separate_debug_frame_fdes;
            (Ok(t), DebugUse::Used { how: found.how, fdes })
        }
        Ok(_) => (own, DebugUse::NoNewCfi),
        Err(e) => (own, DebugUse::Failed(format!("{}: {e}", found.path.display()))),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::process::Command;

    use super::*;

    /// Runs a build tool of the tests (gcc, objcopy), which must succeed.
    pub(crate) fn tool(cmd: &mut Command) {
        let st = cmd.status().unwrap_or_else(|e| panic!("{cmd:?}: {e} (`cargo xtask setup`)"));
        assert!(st.success(), "{cmd:?}");
    }

    /// A zlib-compressed `.debug_frame` (what `dh_strip` ships) reads as the plain one; the
    /// build-id must match; the file is found under `<root>/.build-id/`.
    #[test]
    fn compressed_debug_frame_and_build_id_lookup() {
        let dir = std::env::temp_dir().join(format!("rsprof-debugfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("f.c");
        std::fs::write(&src, "int f(int x) { return x * 3; }\nint main(void) { return f(2); }\n")
            .unwrap();
        let exe = dir.join("f");
        tool(
            Command::new("gcc")
                .args(["-O2", "-g", "-fno-asynchronous-unwind-tables", "-o"])
                .arg(&exe)
                .arg(&src),
        );
        let plain = dir.join("plain.debug");
        let zlib = dir.join("zlib.debug");
        tool(Command::new("objcopy").arg("--only-keep-debug").arg(&exe).arg(&plain));
        tool(Command::new("objcopy").arg("--compress-debug-sections=zlib").arg(&plain).arg(&zlib));
        let frame = read_debug_frame(&plain, None).unwrap().expect(".debug_frame");
        assert!(!frame.is_empty());
        assert_eq!(read_debug_frame(&zlib, None).unwrap().as_deref(), Some(&frame[..]));

        let links = profiler_unwind::debug_links(&std::fs::read(&exe).unwrap()).unwrap();
        let id = links.build_id.clone().expect("gcc links with --build-id");
        assert!(read_debug_frame(&plain, Some(b"other")).is_err(), "build-id not checked");
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        let root = dir.join("root");
        let at = root.join(".build-id").join(&hex[..2]).join(format!("{}.debug", &hex[2..]));
        std::fs::create_dir_all(at.parent().unwrap()).unwrap();
        std::fs::copy(&zlib, &at).unwrap();
        let found = find(&root, exe.to_str().unwrap(), &links).found.expect("found by build-id");
        assert_eq!((found.how, found.path), (How::BuildId, at));
        assert_eq!(found.debug_frame.as_deref(), Some(&frame[..]));

        // .gnu_debuglink in the binary's directory, accepted while its CRC-32 matches.
        let linked = dir.join("linked");
        tool(
            Command::new("objcopy")
                .arg("--add-gnu-debuglink=plain.debug")
                .arg(&exe)
                .arg(&linked)
                .current_dir(&dir),
        );
        let links = profiler_unwind::debug_links(&std::fs::read(&linked).unwrap()).unwrap();
        let empty = dir.join("empty-root");
        let found = find(&empty, linked.to_str().unwrap(), &links).found.expect("found by link");
        assert_eq!((found.how, found.path), (How::DebugLink, plain.clone()));
        assert_eq!(found.debug_frame.as_deref(), Some(&frame[..]));
        let mut f = std::fs::OpenOptions::new().append(true).open(&plain).unwrap();
        std::io::Write::write_all(&mut f, b"\0").unwrap();
        let lookup = find(&empty, linked.to_str().unwrap(), &links);
        assert!(lookup.found.is_none(), "a debug file with another CRC-32 was taken");
        assert_eq!(lookup.rejected.len(), 1);
        assert!(lookup.rejected[0].contains("CRC-32"), "{:?}", lookup.rejected);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
