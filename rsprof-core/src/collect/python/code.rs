//! A CPython code object read from its process's memory (`process_vm_readv`): its qualified
//! name, file, first line and line table, and the line of an instruction by the version's
//! table format (`co_lnotab` ≤3.9, the 3.10 `co_linetable`, the 3.11+ location table).

use super::offsets::PyOffsets;

/// Longest string or line table read: a longer one is garbage or not worth the bytes.
const MAX_STR: usize = 4096;
const MAX_LINETABLE: usize = 1 << 16;

/// Reads `buf.len()` bytes at `addr` of process `pid`; false if any could not be read.
pub fn read_mem(pid: u32, addr: u64, buf: &mut [u8]) -> bool {
    if buf.is_empty() {
        return true;
    }
    let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: buf.len() };
    // SAFETY: `local` describes `buf`, which outlives the call; the remote side is only read.
    let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
    n == buf.len() as isize
}

fn u64_at(b: &[u8], off: u32) -> u64 {
    let o = off as usize;
    b.get(o..o + 8).map_or(0, |s| u64::from_le_bytes(s.try_into().unwrap()))
}

fn u32_at(b: &[u8], off: u32) -> u32 {
    let o = off as usize;
    b.get(o..o + 4).map_or(0, |s| u32::from_le_bytes(s.try_into().unwrap()))
}

/// What a code object says of itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodeInfo {
    /// `co_qualname` (3.11+) or `co_name`.
    pub name: String,
    pub file: String,
    pub first_line: u32,
    linetable: Vec<u8>,
    /// Address of its bytecode (`co_code_adaptive`, 3.11+).
    code_start: u64,
    /// `_co_firsttraceable` (3.11+): instructions before it set the frame up.
    first_traceable: u32,
    /// The fields that identify it: a freed object reused for another code object, or for
    /// anything else, changes them.
    pub fingerprint: [u64; 6],
}

/// Why a code object could not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodeError {
    /// Its memory (or that of a string it points to) could not be read: the process exited,
    /// or the address is no object.
    Unreadable,
    /// Readable but no code object (`ob_type` is not `PyCode_Type`): a frame in flux, or
    /// memory that is not what the layout says.
    NotCode,
}

/// The fields of the code object at `addr` that identify it (see `CodeInfo::fingerprint`).
fn header(pid: u32, addr: u64, o: &PyOffsets) -> Result<(Vec<u8>, [u64; 6]), CodeError> {
    let len = o.code_firsttraceable.unwrap_or(0).max(o.code_linetable).max(o.code_firstlineno) + 8;
    let mut h = vec![0u8; len as usize];
    if !read_mem(pid, addr, &mut h) {
        return Err(CodeError::Unreadable);
    }
    let fp = [
        u64_at(&h, o.object_type),
        u64_at(&h, o.code_filename),
        u64_at(&h, o.code_name),
        o.code_qualname.map_or(0, |q| u64_at(&h, q)),
        u64_at(&h, o.code_linetable),
        u64::from(u32_at(&h, o.code_firstlineno)),
    ];
    Ok((h, fp))
}

impl CodeInfo {
    /// Its identity as the kernel computes it for a sample (`py_code_ident`).
    pub fn ident(&self) -> u64 {
        let fp = self.fingerprint;
        profiler_common::py_code_ident([fp[1], fp[2], fp[3], fp[4], fp[5]])
            & profiler_common::PY_FRAME_IDENT_MASK
    }
}

/// Reads the code object at `addr` of `pid`. `code_type`: `PyCode_Type`'s address there.
pub fn read_code(
    pid: u32,
    addr: u64,
    o: &PyOffsets,
    code_type: Option<u64>,
) -> Result<CodeInfo, CodeError> {
    let (h, fingerprint) = header(pid, addr, o)?;
    if code_type.is_some_and(|t| t != fingerprint[0]) {
        return Err(CodeError::NotCode);
    }
    let name_ptr = o.code_qualname.map_or(fingerprint[2], |_| fingerprint[3]);
    let name = read_str(pid, name_ptr, o).ok_or(CodeError::Unreadable)?;
    let file = read_str(pid, fingerprint[1], o).ok_or(CodeError::Unreadable)?;
    let linetable = read_bytes(pid, fingerprint[4], o).ok_or(CodeError::Unreadable)?;
    Ok(CodeInfo {
        name,
        file,
        first_line: u32_at(&h, o.code_firstlineno),
        linetable,
        code_start: o.code_adaptive.map_or(0, |a| addr + u64::from(a)),
        first_traceable: o.code_firsttraceable.map_or(0, |f| u32_at(&h, f)),
        fingerprint,
    })
}

/// A `str` (compact: every identifier and file name the compiler makes).
fn read_str(pid: u32, addr: u64, o: &PyOffsets) -> Option<String> {
    let mut h = [0u8; 40];
    if addr == 0 || !read_mem(pid, addr, &mut h) {
        return None;
    }
    let len = u64_at(&h, o.str_length) as usize;
    let state = u32_at(&h, o.str_state);
    let (kind, compact, ascii) = ((state >> 2) & 7, state >> 5 & 1 == 1, state >> 6 & 1 == 1);
    if !compact || len > MAX_STR || !matches!(kind, 1 | 2 | 4) {
        return None;
    }
    let at = if ascii { o.str_ascii_data } else { o.str_compact_data };
    let mut data = vec![0u8; len * kind as usize];
    if !read_mem(pid, addr + u64::from(at), &mut data) {
        return None;
    }
    Some(match kind {
        1 => data.iter().map(|&b| char::from(b)).collect(),
        2 => data
            .chunks_exact(2)
            .map(|c| {
                char::from_u32(u32::from(u16::from_le_bytes([c[0], c[1]]))).unwrap_or('\u{fffd}')
            })
            .collect(),
        _ => data
            .chunks_exact(4)
            .map(|c| {
                char::from_u32(u32::from_le_bytes(c.try_into().unwrap())).unwrap_or('\u{fffd}')
            })
            .collect(),
    })
}

/// A `bytes` object's data.
fn read_bytes(pid: u32, addr: u64, o: &PyOffsets) -> Option<Vec<u8>> {
    let mut h = [0u8; 24];
    if addr == 0 || !read_mem(pid, addr, &mut h) {
        return None;
    }
    let len = u64_at(&h, o.var_size) as usize;
    if len > MAX_LINETABLE {
        return None;
    }
    let mut data = vec![0u8; len];
    read_mem(pid, addr + u64::from(o.bytes_data), &mut data).then_some(data)
}

impl CodeInfo {
    /// The byte offset into the bytecode of a frame's instruction word (`f_lasti` ≤3.10,
    /// the instruction pointer 3.11+); negative before the first instruction.
    pub fn instr_offset(&self, minor: u32, ip: u64) -> i64 {
        match minor {
            // Bytes in 3.8 and 3.9, code units in 3.10; an int, -1 before the start.
            ..=9 => i64::from(ip as u32 as i32),
            10 => i64::from(ip as u32 as i32) * 2,
            _ => ip.wrapping_sub(self.code_start) as i64,
        }
    }

    /// Whether a 3.11+ frame at byte offset `at` is still setting itself up (tracebacks skip
    /// such frames). `owner` 1 is a generator's frame, which is never incomplete.
    pub fn incomplete(&self, minor: u32, at: i64, owner: u64) -> bool {
        minor >= 11 && owner != 1 && at.div_euclid(2) < i64::from(self.first_traceable)
    }

    /// The source line of the instruction at byte offset `at`.
    pub fn line(&self, minor: u32, at: i64) -> Option<u32> {
        if at < 0 {
            return Some(self.first_line);
        }
        let first = i64::from(self.first_line);
        let line = match minor {
            ..=9 => lnotab_line(&self.linetable, first, at),
            10 => linetable_310_line(&self.linetable, first, at),
            _ => locations_line(&self.linetable, first, at),
        };
        line.and_then(|l| u32::try_from(l).ok())
    }
}

/// `co_lnotab`: (byte delta, signed line delta) pairs (`Objects/lnotab_notes.txt`, 3.8).
pub fn lnotab_line(table: &[u8], first: i64, at: i64) -> Option<i64> {
    let (mut line, mut addr) = (first, 0i64);
    for pair in table.chunks_exact(2) {
        addr += i64::from(pair[0]);
        if addr > at {
            break;
        }
        line += i64::from(pair[1] as i8);
    }
    Some(line)
}

/// 3.10 `co_linetable`: (range length, signed line delta) pairs; -128 is a range without a
/// line.
pub fn linetable_310_line(table: &[u8], first: i64, at: i64) -> Option<i64> {
    let (mut line, mut start) = (first, 0i64);
    for pair in table.chunks_exact(2) {
        let end = start + i64::from(pair[0]);
        let delta = pair[1] as i8;
        let this = if delta == -128 {
            None
        } else {
            line += i64::from(delta);
            Some(line)
        };
        if start <= at && at < end {
            return this;
        }
        start = end;
    }
    None
}

/// 3.11+ location table (`Objects/locations.md`): entries of a first byte (bit 7 set, code
/// in bits 3–6, length − 1 in code units in bits 0–2) and the code's varints.
pub fn locations_line(table: &[u8], first: i64, at: i64) -> Option<i64> {
    let (mut line, mut start, mut i) = (first, 0i64, 0usize);
    while i < table.len() {
        let b = table[i];
        if b & 0x80 == 0 {
            return None;
        }
        let code = (b >> 3) & 15;
        let end = start + 2 * (i64::from(b & 7) + 1);
        let delta = match code {
            13 | 14 => signed_varint(table, i + 1)?,
            10..=12 => i64::from(code - 10),
            _ => 0,
        };
        // Varints of garbage can sum past i64: such a table has no line.
        line = line.checked_add(delta)?;
        if start <= at && at < end {
            return (code != 15).then_some(line);
        }
        start = end;
        i += 1;
        while i < table.len() && table[i] & 0x80 == 0 {
            i += 1;
        }
    }
    None
}

fn signed_varint(t: &[u8], mut i: usize) -> Option<i64> {
    let mut b = *t.get(i)?;
    let mut v = u64::from(b & 63);
    let mut shift = 0;
    while b & 64 != 0 && shift < 60 {
        i += 1;
        b = *t.get(i)?;
        shift += 6;
        v |= u64::from(b & 63) << shift;
    }
    Some(if v & 1 != 0 { -((v >> 1) as i64) } else { (v >> 1) as i64 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_tables_decode() {
        // lnotab: +2 bytes → line +1, +4 bytes → line −1 (a loop back).
        let t = [2, 1, 4, 0xff];
        assert_eq!(lnotab_line(&t, 10, 0), Some(10));
        assert_eq!(lnotab_line(&t, 10, 2), Some(11));
        assert_eq!(lnotab_line(&t, 10, 6), Some(10));
        // 3.10: [0,4) line+1, [4,6) no line, [6,10) line+2 from the last line.
        let t = [4, 1, 2, 0x80, 4, 2];
        assert_eq!(linetable_310_line(&t, 10, 0), Some(11));
        assert_eq!(linetable_310_line(&t, 10, 4), None);
        assert_eq!(linetable_310_line(&t, 10, 8), Some(13));
        // 3.11: a one-line entry (code 11: +1, 2 units + 2 column bytes), a no-column entry
        // (code 13) with varint −1 (3), a no-location entry (code 15).
        let t = [0x80 | 11 << 3 | 1, 4, 5, 0x80 | 13 << 3, 3, 0x80 | 15 << 3];
        assert_eq!(locations_line(&t, 10, 0), Some(11));
        assert_eq!(locations_line(&t, 10, 2), Some(11));
        assert_eq!(locations_line(&t, 10, 4), Some(10));
        assert_eq!(locations_line(&t, 10, 6), None);
        // Line deltas whose sum overflows (11-byte varints near 2^62 each): no line, no panic.
        let huge = [0x7e, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 0x3f];
        let t: Vec<u8> = [&[0x80 | 14 << 3][..], &huge, &[0x80 | 14 << 3], &huge].concat();
        assert_eq!(locations_line(&t, 10, 2), None);
        // Garbage never panics.
        for n in 0..64u8 {
            let junk: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37) ^ n).collect();
            let _ = (lnotab_line(&junk, 1, 9), linetable_310_line(&junk, 1, 9));
            let _ = locations_line(&junk, 1, 9);
        }
    }
}
