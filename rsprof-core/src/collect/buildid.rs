//! The GNU build-id of an ELF file (`NT_GNU_BUILD_ID` note), read once per module when it is
//! first opened: a few small reads (the ELF header, the program headers, the note segments),
//! never the whole file.

use std::fs::File;

use object::{elf, read::elf::ProgramHeader as _};

use super::elf::ProgramHeaders;

/// Bytes of a note segment read at most: linkers put the build-id note first, in a segment of
/// a few dozen bytes.
const MAX_NOTE_BYTES: usize = 64 << 10;
const NT_GNU_BUILD_ID: u32 = 3;

/// The build-id of the 64-bit ELF `file`; None for any other file, or one without the note.
pub fn read(file: &File) -> Option<Vec<u8>> {
    let headers = ProgramHeaders::read(file)?;
    let endian = headers.endian;
    for ph in headers.iter().filter(|ph| ph.p_type(endian) == elf::PT_NOTE) {
        let notes = headers.segment_bytes(file, ph, MAX_NOTE_BYTES)?;
        let align = ph.p_align(endian).max(4) as usize;
        if let Some(id) = find_build_id(&notes, align, endian == object::Endianness::Little) {
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
}
