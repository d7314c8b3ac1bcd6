//! The GNU build-id of an ELF file (`NT_GNU_BUILD_ID` note), read once per module when it is
//! first opened: a few small reads (the ELF header, the program headers, the note segments),
//! never the whole file.

use std::{fs::File, os::unix::fs::FileExt as _};

/// Bytes of program headers and of note segments read at most: linkers put the build-id note
/// first, in a segment of a few dozen bytes.
const MAX_PHDRS_BYTES: usize = 64 << 10;
const MAX_NOTE_BYTES: usize = 64 << 10;
const NT_GNU_BUILD_ID: u32 = 3;

/// The build-id of the 64-bit little-endian ELF `file`; None for any other file, or one
/// without the note.
pub fn read(file: &File) -> Option<Vec<u8>> {
    use object::{
        Endianness, elf,
        read::elf::{FileHeader as _, ProgramHeader as _},
    };
    let mut ehdr = [0u8; 64];
    file.read_exact_at(&mut ehdr, 0).ok()?;
    let hdr = elf::FileHeader64::<Endianness>::parse(&ehdr[..]).ok()?;
    let endian = hdr.endian().ok()?;
    let phoff = hdr.e_phoff(endian);
    let phsize = usize::from(hdr.e_phentsize(endian)) * usize::from(hdr.e_phnum(endian));
    if phsize == 0 || phsize > MAX_PHDRS_BYTES {
        return None;
    }
    // `program_headers` wants the headers at `e_phoff` of its buffer: a copy of the header
    // that says they follow it, then the headers. (Laying them out at the file's own `e_phoff`
    // allocated up to the file's size: some files keep their headers near the end.)
    let mut data = vec![0u8; 64 + phsize];
    data[..64].copy_from_slice(&ehdr);
    let moved = elf::FileHeader64::<Endianness> {
        e_phoff: object::U64::new(endian, 64),
        ..*hdr
    };
    data[..64].copy_from_slice(object::pod::bytes_of(&moved));
    file.read_exact_at(&mut data[64..], phoff).ok()?;
    let hdr = &moved;
    for ph in hdr.program_headers(endian, &*data).ok()? {
        if ph.p_type(endian) != elf::PT_NOTE {
            continue;
        }
        let size = (ph.p_filesz(endian) as usize).min(MAX_NOTE_BYTES);
        let mut notes = vec![0u8; size];
        file.read_exact_at(&mut notes, ph.p_offset(endian)).ok()?;
        let align = ph.p_align(endian).max(4) as usize;
        if let Some(id) = find_build_id(&notes, align, endian == Endianness::Little) {
            return Some(id);
        }
    }
    None
}

/// Walks ELF notes (`namesz`, `descsz`, `type`, name and desc each padded to `align`).
fn find_build_id(mut notes: &[u8], align: usize, little: bool) -> Option<Vec<u8>> {
    let word = |b: &[u8]| {
        let w = [b[0], b[1], b[2], b[3]];
        if little { u32::from_le_bytes(w) } else { u32::from_be_bytes(w) }
    };
    let pad = |n: usize| n.checked_add(align - 1).map(|n| n & !(align - 1));
    while notes.len() >= 12 {
        let (namesz, descsz, kind) =
            (word(notes) as usize, word(&notes[4..]) as usize, word(&notes[8..]));
        let name_end = 12usize.checked_add(pad(namesz)?)?;
        let desc_end = name_end.checked_add(descsz)?;
        if desc_end > notes.len() {
            return None;
        }
        if kind == NT_GNU_BUILD_ID && &notes[12..12 + namesz] == b"GNU\0" && descsz > 0 {
            return Some(notes[name_end..desc_end].to_vec());
        }
        notes = notes.get(name_end.checked_add(pad(descsz)?)?..)?;
    }
    None
}

/// Lower-case hex, as `readelf -n` and `file` print it.
pub fn hex(id: &[u8]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `readelf -n FILE`'s "Build ID: …" line.
    fn readelf_build_id(path: &str) -> String {
        let out = std::process::Command::new("readelf")
            .args(["-n", path])
            .output()
            .expect("readelf (binutils) must be installed to check build-ids");
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().find_map(|l| l.trim().strip_prefix("Build ID: "));
        line.unwrap_or_else(|| panic!("readelf shows no build-id for {path}:\n{text}")).to_owned()
    }

    #[test]
    fn build_id_of_real_binaries_matches_readelf() {
        let exe = std::env::current_exe().unwrap();
        let exe = exe.to_str().unwrap();
        let mut checked = Vec::new();
        for path in ["/bin/true", "/lib/x86_64-linux-gnu/libc.so.6", exe] {
            if path != exe && !std::path::Path::new(path).exists() {
                continue;
            }
            let id = read(&File::open(path).unwrap()).expect(path);
            assert_eq!(hex(&id), readelf_build_id(path), "{path}");
            checked.push(path);
        }
        assert!(checked.contains(&"/bin/true"), "/bin/true is missing: {checked:?}");
    }

    #[test]
    fn no_build_id_in_non_elf_or_noteless_files() {
        let f = File::open("/proc/self/cmdline").unwrap();
        assert_eq!(read(&f), None);
        // A note list with another note only.
        let mut notes = Vec::new();
        for w in [4u32, 4, 1] {
            notes.extend(w.to_le_bytes());
        }
        notes.extend(b"GNU\0abcd");
        assert_eq!(find_build_id(&notes, 4, true), None);
        notes.extend([4u32, 3, 3].iter().flat_map(|w| w.to_le_bytes()));
        notes.extend(b"GNU\0\x01\x02\x03\0");
        assert_eq!(find_build_id(&notes, 4, true), Some(vec![1, 2, 3]));
        // Cut short: no read past the end.
        assert_eq!(find_build_id(&notes[..notes.len() - 2], 4, true), None);
    }

    /// Program headers far from the ELF header (BOLT-processed libraries such as Rust's
    /// libLLVM keep them 140 MB into the file): the same build-id, read with small buffers.
    #[test]
    fn program_headers_at_the_end_of_the_file() {
        let path = "/bin/true";
        let mut bytes = std::fs::read(path).expect("/bin/true is missing");
        let phoff = u64::from_le_bytes(bytes[32..40].try_into().unwrap()) as usize;
        let phsize = usize::from(u16::from_le_bytes([bytes[54], bytes[55]]))
            * usize::from(u16::from_le_bytes([bytes[56], bytes[57]]));
        // Move the headers 64 MiB out (a sparse file) and point e_phoff at them.
        let far = 64usize << 20;
        let headers = bytes[phoff..phoff + phsize].to_vec();
        bytes[32..40].copy_from_slice(&(far as u64).to_le_bytes());
        let dir = std::env::temp_dir().join(format!("rsprof-buildid-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let moved = dir.join("moved");
        let f = File::create(&moved).unwrap();
        f.write_all_at(&bytes, 0).unwrap();
        f.write_all_at(&headers, far as u64).unwrap();
        drop(f);
        let id = read(&File::open(&moved).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(id.map(|id| hex(&id)), Some(readelf_build_id(path)));
    }
}
