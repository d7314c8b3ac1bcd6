//! Locating the CFI sections of an x86-64 ELF file.

use gimli::{BaseAddresses, EhFrameHdr, LittleEndian};
use object::elf::{
    EM_X86_64, PF_X, PT_GNU_EH_FRAME, PT_LOAD, SHF_ALLOC, SHF_EXECINSTR, SHT_NOBITS,
};
use object::read::elf::SectionHeader;
use object::read::elf::{ElfFile64, ProgramHeader};
use object::{Endianness, FileKind, Object, ObjectSection};

use crate::{CfiSections, Error};

/// Where a separate debug file for an ELF file may be found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DebugLinks {
    /// The `NT_GNU_BUILD_ID` note: `<debug root>/.build-id/xx/rest.debug`.
    pub build_id: Option<Vec<u8>>,
    /// `.gnu_debuglink`: the debug file's name and the CRC-32 of its contents.
    pub gnu_debuglink: Option<(Vec<u8>, u32)>,
}

/// The build-id and `.gnu_debuglink` of a 64-bit ELF file (either may be missing).
pub fn debug_links(data: &[u8]) -> Result<DebugLinks, Error> {
    let elf = ElfFile64::<Endianness>::parse(data)?;
    Ok(DebugLinks {
        build_id: elf.build_id()?.map(<[u8]>::to_vec),
        gnu_debuglink: elf.gnu_debuglink()?.map(|(name, crc)| (name.to_vec(), crc)),
    })
}

/// The file's code: allocated executable sections with contents, or executable `PT_LOAD`
/// segments when there are no section headers. Sorted, disjoint.
pub(crate) fn code_ranges(data: &[u8]) -> Result<Vec<(u64, u64)>, Error> {
    let elf = ElfFile64::<Endianness>::parse(data)?;
    let endian = elf.endian();
    let mut ranges: Vec<(u64, u64)> = elf
        .elf_section_table()
        .iter()
        .filter(|sh| {
            let flags = sh.sh_flags(endian);
            flags & u64::from(SHF_ALLOC | SHF_EXECINSTR) == u64::from(SHF_ALLOC | SHF_EXECINSTR)
                && sh.sh_type(endian) != SHT_NOBITS
        })
        .map(|sh| (sh.sh_addr(endian), sh.sh_addr(endian) + sh.sh_size(endian)))
        .collect();
    if ranges.is_empty() {
        ranges = elf
            .elf_program_headers()
            .iter()
            .filter(|ph| ph.p_type(endian) == PT_LOAD && ph.p_flags(endian) & PF_X != 0)
            .map(|ph| (ph.p_vaddr(endian), ph.p_vaddr(endian) + ph.p_memsz(endian)))
            .collect();
    }
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (start, end) in ranges {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    Ok(out)
}

pub(crate) fn cfi_sections(data: &[u8]) -> Result<CfiSections<'_>, Error> {
    match FileKind::parse(data)? {
        FileKind::Elf64 => {}
        FileKind::Elf32 => return Err(Error::UnsupportedFormat("32-bit ELF")),
        _ => return Err(Error::UnsupportedFormat("not an ELF file")),
    }
    let elf = ElfFile64::<Endianness>::parse(data)?;
    let endian = elf.endian();
    let machine = elf.elf_header().e_machine.get(endian);
    if machine != EM_X86_64 {
        return Err(Error::UnsupportedMachine(machine));
    }

    // Sections with file contents (SHT_NOBITS copies in debug files read as empty).
    let section = |name: &str| -> Result<Option<(u64, &[u8])>, Error> {
        match elf.section_by_name(name) {
            Some(s) => {
                let bytes = s.data()?;
                Ok((!bytes.is_empty()).then_some((s.address(), bytes)))
            }
            None => Ok(None),
        }
    };
    let mut sections = CfiSections {
        eh_frame: section(".eh_frame")?,
        eh_frame_hdr: section(".eh_frame_hdr")?,
        debug_frame: section(".debug_frame")?.map(|(_, bytes)| bytes),
        separate_debug_frame: None,
        text_address: elf.section_by_name(".text").map(|s| s.address()),
        got_address: elf.section_by_name(".got").map(|s| s.address()),
    };

    // Without section headers (stripped with `sstrip`, or a memory image), the loader's own
    // pointer still finds the CFI: PT_GNU_EH_FRAME -> .eh_frame_hdr -> .eh_frame.
    if sections.eh_frame.is_none() {
        let segments = elf.elf_program_headers();
        let hdr = segments.iter().find(|ph| ph.p_type(endian) == PT_GNU_EH_FRAME);
        if let Some(hdr) = hdr {
            let hdr_addr = hdr.p_vaddr(endian);
            let hdr_bytes = hdr
                .data(endian, data)
                .map_err(|()| Error::Malformed("PT_GNU_EH_FRAME segment outside the file"))?;
            let bases = BaseAddresses::default().set_eh_frame_hdr(hdr_addr);
            let parsed = EhFrameHdr::new(hdr_bytes, LittleEndian)
                .parse(&bases, 8)
                .map_err(|error| Error::Cfi { section: ".eh_frame_hdr", error })?;
            let eh_addr = parsed
                .eh_frame_ptr()
                .direct()
                .map_err(|error| Error::Cfi { section: ".eh_frame_hdr", error })?;
            // .eh_frame's length is unknown: take the rest of its PT_LOAD segment.
            let eh_bytes = segments
                .iter()
                .filter(|ph| ph.p_type(endian) == PT_LOAD)
                .find_map(|ph| {
                    let start = ph.p_vaddr(endian);
                    let bytes = ph.data(endian, data).ok()?;
                    let skip = usize::try_from(eh_addr.checked_sub(start)?).ok()?;
                    bytes.get(skip..).filter(|rest| !rest.is_empty())
                })
                .ok_or(Error::EhFrameNotFound(eh_addr))?;
            sections.eh_frame = Some((eh_addr, eh_bytes));
            sections.eh_frame_hdr = Some((hdr_addr, hdr_bytes));
        }
    }
    Ok(sections)
}
