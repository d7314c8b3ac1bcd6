//! SystemTap SDT notes (`.note.stapsdt`, owner "stapsdt", type 3): one note per probe site
//! with its pc, the link-time address of `.stapsdt.base`, its semaphore and its argument
//! string. Addresses are turned into the file offsets uprobes attach by.

use std::{fs::File, path::Path};

use anyhow::{Context as _, Result, bail};
use object::{
    LittleEndian as LE,
    elf::{PF_X, PT_LOAD, SHT_NOTE},
    read::elf::{ElfFile64, FileHeader as _, ProgramHeader as _, SectionHeader as _, Sym as _},
};

const NT_STAPSDT: u32 = 3;

/// One probe site as found in an ELF file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    pub provider: String,
    pub name: String,
    /// Link-time address of the probe instruction, after the `.stapsdt.base` adjustment.
    pub pc: u64,
    /// File offset of the probe instruction (uprobe offset).
    pub pc_offset: u64,
    /// Link-time address and file offset of the u16 semaphore (0 when there is none).
    pub semaphore: u64,
    pub semaphore_offset: u64,
    /// The semaphore's file page is mapped by two PT_LOAD segments (lld's RELRO and data
    /// segments share one). The kernel finds semaphores by file offset and, in a process
    /// exec'd while the probe is attached, may increment the copy in the RELRO mapping: the
    /// probe then stays disabled there. Processes already running are not affected.
    pub semaphore_page_shared: bool,
    /// The argument string, e.g. `-4@%edi 8@-16(%rbp)`; empty when the probe has none.
    pub args: String,
}

impl Note {
    pub fn full_name(&self) -> String {
        format!("{}:{}", self.provider, self.name)
    }
}

/// The probes of one file, plus what argument parsing needs from it (symbols for
/// `sym(%rip)` arguments).
#[derive(Debug, Default)]
pub struct ElfProbes {
    pub notes: Vec<Note>,
    /// Symbol name → link-time address, from `.symtab` and `.dynsym`; filled only when some
    /// argument names a symbol.
    pub symbols: std::collections::HashMap<String, u64>,
}

struct Segment {
    vaddr: u64,
    memsz: u64,
    offset: u64,
    filesz: u64,
    exec: bool,
}

const PAGE: u64 = 4096;

fn page_shared(segs: &[Segment], offset: u64) -> bool {
    let page = offset & !(PAGE - 1);
    segs.iter()
        .filter(|s| {
            s.filesz > 0
                && s.offset & !(PAGE - 1) <= page
                && page < (s.offset + s.filesz).div_ceil(PAGE) * PAGE
        })
        .count()
        > 1
}

fn vaddr_to_offset(segs: &[Segment], addr: u64, exec: bool) -> Option<u64> {
    segs.iter()
        .find(|s| (!exec || s.exec) && addr >= s.vaddr && addr < s.vaddr + s.memsz)
        .map(|s| addr - s.vaddr + s.offset)
}

fn cstr(b: &[u8]) -> Option<(&[u8], &[u8])> {
    let end = b.iter().position(|&c| c == 0)?;
    Some((&b[..end], &b[end + 1..]))
}

/// Reads the SDT notes of `path` (mmapped: libraries can be large and only headers, notes
/// and symbols are touched). A file without notes gives an empty list.
pub fn read_probes(path: &Path) -> Result<ElfProbes> {
    let file = File::open(path).with_context(|| format!("open {}", path.display()))?;
    // SAFETY: read-only mapping; a file truncated under us can fault, as for any ELF reader.
    let map =
        unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("map {}", path.display()))?;
    parse_probes(&map).with_context(|| format!("read SDT notes of {}", path.display()))
}

/// Like [`read_probes`], but `None` for a file that is no 64-bit ELF file (a script run
/// through its interpreter, a 32-bit program): such files simply carry no probes we attach.
pub fn read_probes_if_elf(path: &Path) -> Result<Option<ElfProbes>> {
    use std::io::Read as _;
    let mut ident = [0u8; 5];
    let mut f = File::open(path).with_context(|| format!("open {}", path.display()))?;
    if f.read_exact(&mut ident).is_err() || &ident[..4] != b"\x7fELF" || ident[4] != 2 {
        return Ok(None);
    }
    read_probes(path).map(Some)
}

pub fn parse_probes(data: &[u8]) -> Result<ElfProbes> {
    if data.get(..4) != Some(b"\x7fELF") {
        bail!("not an ELF file");
    }
    if data.get(4) != Some(&2) {
        bail!("not a 64-bit ELF file");
    }
    let elf = ElfFile64::<LE>::parse(data).context("parse ELF")?;
    let endian = elf.endian();
    let header = elf.elf_header();
    let segs: Vec<Segment> = header
        .program_headers(endian, data)
        .context("program headers")?
        .iter()
        .filter(|p| p.p_type(endian) == PT_LOAD)
        .map(|p| Segment {
            vaddr: p.p_vaddr(endian),
            memsz: p.p_memsz(endian),
            offset: p.p_offset(endian),
            filesz: p.p_filesz(endian),
            exec: p.p_flags(endian) & PF_X != 0,
        })
        .collect();
    let sections = elf.elf_section_table();
    let base_addr =
        sections.section_by_name(endian, b".stapsdt.base").map(|(_, s)| s.sh_addr(endian));
    let mut out = ElfProbes::default();
    let Some((_, notes_sec)) = sections.section_by_name(endian, b".note.stapsdt") else {
        return Ok(out);
    };
    if notes_sec.sh_type(endian) != SHT_NOTE {
        return Ok(out);
    }
    let mut notes =
        notes_sec.notes(endian, data).context("note section")?.context("note section")?;
    while let Some(n) = notes.next().context("malformed SDT note")? {
        if n.name() != b"stapsdt" || n.n_type(endian) != NT_STAPSDT {
            continue;
        }
        let d = n.desc();
        if d.len() < 24 {
            bail!("SDT note too short ({} bytes)", d.len());
        }
        let word = |i: usize| u64::from_le_bytes(d[i * 8..i * 8 + 8].try_into().unwrap());
        let (mut pc, note_base, mut semaphore) = (word(0), word(1), word(2));
        let rest = &d[24..];
        let (provider, rest) = cstr(rest).context("SDT note without provider")?;
        let (name, rest) = cstr(rest).context("SDT note without name")?;
        let (args, _) = cstr(rest).unwrap_or((rest, &[]));
        // Prelinked or otherwise moved images: shift by how far .stapsdt.base moved. Notes
        // that do not reference the base (0) must not be shifted.
        if let Some(base) = base_addr
            && note_base != 0
        {
            let delta = base.wrapping_sub(note_base);
            pc = pc.wrapping_add(delta);
            if semaphore != 0 {
                semaphore = semaphore.wrapping_add(delta);
            }
        }
        let provider = String::from_utf8_lossy(provider).into_owned();
        let name = String::from_utf8_lossy(name).into_owned();
        let pc_offset = vaddr_to_offset(&segs, pc, true).with_context(|| {
            format!("probe {provider}:{name} at {pc:#x} is in no executable segment")
        })?;
        let semaphore_offset = if semaphore == 0 {
            0
        } else {
            vaddr_to_offset(&segs, semaphore, false).with_context(|| {
                format!("semaphore of {provider}:{name} at {semaphore:#x} is in no segment")
            })?
        };
        let args = String::from_utf8_lossy(args).into_owned();
        // "" or ":…" mean no arguments.
        let args = if args.starts_with(':') { String::new() } else { args };
        let semaphore_page_shared = semaphore != 0 && page_shared(&segs, semaphore_offset);
        out.notes.push(Note {
            provider,
            name,
            pc,
            pc_offset,
            semaphore,
            semaphore_offset,
            semaphore_page_shared,
            args,
        });
    }
    if out.notes.iter().any(|n| n.args.contains("(%rip)") || n.args.contains("@$")) {
        for table in [elf.elf_symbol_table(), elf.elf_dynamic_symbol_table()] {
            let strings = table.strings();
            for sym in table.iter() {
                if sym.st_value(endian) == 0 {
                    continue;
                }
                if let Ok(name) = sym.name(endian, strings) {
                    out.symbols
                        .entry(String::from_utf8_lossy(name).into_owned())
                        .or_insert(sym.st_value(endian));
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests_paths {
    pub const PYTHON: &str = "/usr/bin/python3.11";
    pub const LIBJVM: &str = "/usr/lib/jvm/java-17-openjdk-amd64/lib/server/libjvm.so";
}

#[cfg(test)]
mod tests {
    use super::{tests_paths::*, *};

    #[test]
    fn python_gc_probes_have_semaphores_and_file_offsets() {
        let p = read_probes(Path::new(PYTHON)).unwrap();
        let start = p.notes.iter().find(|n| n.full_name() == "python:gc__start").unwrap();
        assert_ne!(start.semaphore, 0);
        assert_ne!(start.semaphore_offset, 0);
        assert_eq!(start.args, "-4@112(%rsp)");
        assert!(!start.semaphore_page_shared);
        // The offset must point at the probe's nop in the file.
        let bytes = std::fs::read(PYTHON).unwrap();
        assert_eq!(bytes[start.pc_offset as usize], 0x90, "nop at {:#x}", start.pc_offset);
        assert!(p.notes.iter().any(|n| n.full_name() == "python:gc__done"));
    }

    #[test]
    fn libjvm_has_hotspot_probes() {
        let p = read_probes(Path::new(LIBJVM)).unwrap();
        assert!(p.notes.len() > 100, "{} notes", p.notes.len());
        assert!(p.notes.iter().any(|n| n.full_name() == "hotspot:class__loaded"));
        assert!(p.notes.iter().any(|n| n.provider == "hotspot_jni"));
        let bytes = std::fs::read(LIBJVM).unwrap();
        for n in &p.notes {
            assert_eq!(bytes[n.pc_offset as usize], 0x90, "{} at {:#x}", n.full_name(), n.pc);
        }
    }

    #[test]
    fn compiled_rsprof_fixture_probes() {
        let exe = ::tests::fixtures::build("usdt_app").unwrap();
        let p = read_probes(&exe).unwrap();
        let bytes = std::fs::read(&exe).unwrap();
        for name in ["marker", "begin", "end", "counter", "label_push", "label_pop"] {
            let sites: Vec<&Note> =
                p.notes.iter().filter(|n| n.full_name() == format!("rsprof:{name}")).collect();
            assert!(!sites.is_empty(), "rsprof:{name}");
            for n in sites {
                assert_eq!(bytes[n.pc_offset as usize], 0x90, "{name}");
                assert_ne!(n.semaphore, 0, "{name}");
                assert!(!n.semaphore_page_shared, "{name}");
                // The semaphore's bytes in the file are the initial 0.
                assert_eq!(&bytes[n.semaphore_offset as usize..][..2], &[0, 0]);
                crate::usdt::args::parse_args(&n.args, n.pc, &p.symbols).unwrap();
            }
        }
        let marker = p.notes.iter().find(|n| n.name == "marker").unwrap();
        assert_eq!(marker.args.split_whitespace().count(), 2);
    }

    #[test]
    fn non_elf_and_noteless_files() {
        assert!(parse_probes(b"#!/bin/sh\n").is_err());
        // The test binary itself has no SDT notes.
        let me = std::env::current_exe().unwrap();
        assert!(read_probes(&me).unwrap().notes.is_empty());
    }
}
