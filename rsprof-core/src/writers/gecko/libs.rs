//! A process's `libs`: the native modules its frames name, with the identifiers symbol
//! servers and the Firefox Profiler key libraries by. The profile is presymbolicated and its
//! frames are `"function (in module)"` strings (no addresses), so no frame points into these
//! entries and their address range stays 0..0: they say which file, not where it was mapped.

use serde_json::{Value, json};

/// `codeId` and `breakpadId` of an ELF file with GNU build-id `hex` (lowercase hex, as
/// `readelf -n` prints it): the code id is the whole build-id; the Breakpad id reads its first
/// 16 bytes (zero-padded) as a little-endian GUID — the first three fields byte-swapped, the
/// last 8 bytes as they are — in uppercase hex, followed by the age, 0 for ELF.
pub fn elf_ids(hex: &str) -> Option<(String, String)> {
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok())
        .collect::<Option<_>>()?;
    if bytes.is_empty() || !hex.len().is_multiple_of(2) {
        return None;
    }
    let mut guid = [0u8; 16];
    let n = bytes.len().min(16);
    guid[..n].copy_from_slice(&bytes[..n]);
    guid[0..4].reverse();
    guid[4..6].reverse();
    guid[6..8].reverse();
    let mut breakpad: String = guid.iter().map(|b| format!("{b:02X}")).collect();
    breakpad.push('0');
    Some((hex.to_ascii_lowercase(), breakpad))
}

/// The `libs` entry of module `name` (a file name, as frames carry it), with build-id `hex`
/// if known (else empty ids: nothing to look the file up by).
pub fn lib_entry(name: &str, build_id: Option<&str>) -> Value {
    let (code_id, breakpad_id) = build_id.and_then(elf_ids).unwrap_or_default();
    json!({
        "start": 0,
        "end": 0,
        "offset": 0,
        "name": name,
        "path": name,
        "debugName": name,
        "debugPath": name,
        "breakpadId": breakpad_id,
        "codeId": if code_id.is_empty() { Value::Null } else { Value::String(code_id) },
        "arch": std::env::consts::ARCH,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breakpad_id_swaps_the_guid_fields_and_appends_age_zero() {
        // A 20-byte GNU build-id (SHA-1).
        let (code, breakpad) = elf_ids("0123456789abcdef00112233445566778899aabb").unwrap();
        assert_eq!(code, "0123456789abcdef00112233445566778899aabb");
        assert_eq!(breakpad, "67452301AB89EFCD00112233445566770");
        // A short (8-byte) build-id is zero-padded to the GUID's 16 bytes.
        let (_, short) = elf_ids("0123456789abcdef").unwrap();
        assert_eq!(short, "67452301AB89EFCD00000000000000000");
        assert!(elf_ids("").is_none() && elf_ids("abc").is_none() && elf_ids("zz").is_none());
    }
}
