//! An ELF file's program headers, read with two small reads wherever the file keeps them, never
//! the whole file: linkers put them after the ELF header, but BOLT-processed libraries (Rust's
//! libLLVM and librustc_driver) keep them 80–140 MB into the file.

use std::{fs::File, os::unix::fs::FileExt as _};

use object::{
    Endianness, elf,
    read::elf::{FileHeader as _, ProgramHeader as _},
};

/// Program headers read at most (a few dozen headers of 56 bytes in practice).
const MAX_PHDRS_BYTES: usize = 64 << 10;

/// The program headers of a 64-bit ELF file.
pub struct ProgramHeaders {
    pub endian: Endianness,
    /// A copy of the file's header that says the headers follow it, then the headers: the
    /// layout `object`'s `program_headers` reads.
    header: elf::FileHeader64<Endianness>,
    data: Vec<u8>,
}

impl ProgramHeaders {
    /// None for a file that is not 64-bit ELF, or has no (or implausibly many) headers.
    pub fn read(file: &File) -> Option<ProgramHeaders> {
        let mut ehdr = [0u8; 64];
        file.read_exact_at(&mut ehdr, 0).ok()?;
        let hdr = elf::FileHeader64::<Endianness>::parse(&ehdr[..]).ok()?;
        let endian = hdr.endian().ok()?;
        let size = usize::from(hdr.e_phentsize(endian)) * usize::from(hdr.e_phnum(endian));
        if size == 0 || size > MAX_PHDRS_BYTES {
            return None;
        }
        let header = elf::FileHeader64 { e_phoff: object::U64::new(endian, 64), ..*hdr };
        let mut data = vec![0u8; 64 + size];
        data[..64].copy_from_slice(object::pod::bytes_of(&header));
        file.read_exact_at(&mut data[64..], hdr.e_phoff(endian)).ok()?;
        Some(ProgramHeaders { endian, header, data })
    }

    pub fn iter(&self) -> impl Iterator<Item = &elf::ProgramHeader64<Endianness>> {
        self.header.program_headers(self.endian, &*self.data).unwrap_or(&[]).iter()
    }

    /// The file bytes of segment `ph`, at most `max` of them.
    pub fn segment_bytes(
        &self,
        file: &File,
        ph: &elf::ProgramHeader64<Endianness>,
        max: usize,
    ) -> Option<Vec<u8>> {
        let mut bytes = vec![0u8; (ph.p_filesz(self.endian) as usize).min(max)];
        file.read_exact_at(&mut bytes, ph.p_offset(self.endian)).ok()?;
        Some(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collect::{buildid, modules::ElfLayout};

    /// A copy of `path` whose program headers sit 64 MiB into the file (a sparse file), as in
    /// BOLT-processed libraries: the same layout, interpreter and build-id are read from it.
    #[test]
    fn program_headers_far_into_the_file() {
        let path = "/bin/true";
        let mut bytes = std::fs::read(path).expect("/bin/true is missing");
        let phoff = u64::from_le_bytes(bytes[32..40].try_into().unwrap()) as usize;
        let phsize = usize::from(u16::from_le_bytes([bytes[54], bytes[55]]))
            * usize::from(u16::from_le_bytes([bytes[56], bytes[57]]));
        let far = 64u64 << 20;
        let headers = bytes[phoff..phoff + phsize].to_vec();
        bytes[32..40].copy_from_slice(&far.to_le_bytes());
        let dir = std::env::temp_dir().join(format!("rsprof-elf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let moved = dir.join("moved");
        let f = File::create(&moved).unwrap();
        f.write_all_at(&bytes, 0).unwrap();
        f.write_all_at(&headers, far).unwrap();
        drop(f);
        let (a, b) = (ElfLayout::read(path.as_ref()), ElfLayout::read(&moved));
        let id = |p: &std::path::Path| buildid::read(&File::open(p).unwrap());
        let (id_a, id_b) = (id(path.as_ref()), id(&moved));
        std::fs::remove_dir_all(&dir).unwrap();
        let (a, b) = (a.expect("layout of /bin/true"), b.expect("layout of the moved copy"));
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        assert!(a.interp.is_some(), "/bin/true names its interpreter: {a:?}");
        assert!(id_a.is_some());
        assert_eq!(id_a, id_b);
    }
}
