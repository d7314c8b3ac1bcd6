//! Names code of Go programs from their `.gopclntab`, the table the Go runtime itself reads for
//! tracebacks: `-ldflags=-s -w` strips the symbol table and DWARF but must keep it. It has, per
//! function, its name, and pc-value tables giving the file and line at each instruction and
//! which inlined call it belongs to (the inline tree is in the function's funcdata, found
//! through the runtime's `moduledata`).
//!
//! Layouts are those of Go 1.18 and 1.19 (`pcHeader` magic 0xfffffff0) and Go 1.20 and later
//! (0xfffffff1: `_func` gains `startLine`, the inline tree's entries change); older tables are
//! refused with a reason. See the Go sources' runtime/symtab.go and cmd/link/internal/ld/pcln.go.

use std::{ops::Range, path::Path};

use object::{Object as _, ObjectSection as _, ObjectSegment as _};

const MAGIC_GO118: u32 = 0xffff_fff0;
const MAGIC_GO120: u32 = 0xffff_fff1;
/// `_PCDATA_InlTreeIndex` and `_FUNCDATA_InlTree` of runtime/symtab.go.
const PCDATA_INL_TREE_INDEX: u32 = 2;
const FUNCDATA_INL_TREE: u32 = 3;
/// Inlining depth followed at most (a corrupt tree could loop).
const MAX_INLINE_DEPTH: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Version {
    Go118,
    Go120,
}

/// One frame at an address: a function, and where in it the address is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoFrame {
    pub function: String,
    pub file: Option<String>,
    pub line: Option<u32>,
    pub inlined: bool,
}

/// A Go program's `.gopclntab`, read in place from its mapped file.
pub struct GoTable {
    data: memmap2::Mmap,
    /// The section's bytes in `data`.
    pcln: Range<usize>,
    version: Version,
    quantum: u64,
    nfunc: usize,
    text_start: u64,
    /// Offsets in the section of its sub-tables.
    funcname: usize,
    cutab: usize,
    filetab: usize,
    pctab: usize,
    functab: usize,
    /// Where `go:func.*` (the base of funcdata offsets) is in the file, when found.
    gofunc: Option<usize>,
    /// Loadable segments: (file offset, virtual address, file size).
    loads: Vec<(u64, u64, u64)>,
}

impl GoTable {
    /// The table of the ELF file at `path`: `Ok(None)` when it is not a Go program.
    pub fn open(path: &Path) -> Result<Option<Self>, String> {
        let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
        // SAFETY: a read-only private mapping of a program's file; a file truncated meanwhile
        // faults this read as it would the processes running it.
        let data = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| e.to_string())?;
        let elf = object::File::parse(&*data).map_err(|e| e.to_string())?;
        let Some(section) = elf.section_by_name(".gopclntab") else { return Ok(None) };
        let (at, size) = section.file_range().ok_or(".gopclntab has no contents")?;
        let pcln_addr = section.address();
        let pcln = at as usize..(at + size) as usize;
        let loads: Vec<(u64, u64, u64)> = elf
            .segments()
            .filter_map(|s| {
                let (at, size) = s.file_range();
                (size > 0).then_some((at, s.address(), size))
            })
            .collect();
        let text_addr = elf.section_by_name(".text").map(|s| s.address());
        let rodata = elf.section_by_name(".rodata").map(|s| s.address());
        let noptrdata = elf.section_by_name(".noptrdata").and_then(|s| s.file_range());
        drop(elf);
        let p = data.get(pcln.clone()).ok_or(".gopclntab outside the file")?;
        let magic = u32_at(p, 0).ok_or("short .gopclntab")?;
        let version = match magic {
            MAGIC_GO118 => Version::Go118,
            MAGIC_GO120 => Version::Go120,
            m => return Err(format!(".gopclntab of a Go release before 1.18 (magic {m:#x})")),
        };
        if p.get(7) != Some(&8) {
            return Err(".gopclntab not of a 64-bit program".into());
        }
        let word = |i: usize| u64_at(p, 8 + 8 * i).ok_or("short .gopclntab header");
        let off = |i: usize| -> Result<usize, String> {
            let v = word(i)? as usize;
            if v >= p.len() {
                return Err(format!(".gopclntab header offset {v} past its end"));
            }
            Ok(v)
        };
        let nfunc = word(0)? as usize;
        // PIE programs have it relocated at load, 0 in the file.
        let text_start = match word(2)? {
            0 => text_addr.ok_or("no .text")?,
            t => t,
        };
        let mut table = Self {
            version,
            quantum: u64::from(p[6].max(1)),
            nfunc,
            text_start,
            funcname: off(3)?,
            cutab: off(4)?,
            filetab: off(5)?,
            pctab: off(6)?,
            functab: off(7)?,
            gofunc: None,
            loads,
            pcln,
            data,
        };
        if table.functab + (nfunc + 1) * 8 > table.pcln.len() {
            return Err(format!(".gopclntab too short for {nfunc} functions"));
        }
        table.gofunc = table.find_gofunc(pcln_addr, rodata, noptrdata);
        Ok(Some(table))
    }

    /// `go:func.*`, from the runtime's `firstmoduledata` in `.noptrdata`: it starts with the
    /// address of the pcHeader, then the funcname table's; its `rodata` field (the address of
    /// `.rodata`) is followed by `gofunc`. The fields before moved across releases (Go 1.20
    /// added two), so the `rodata` field is looked for rather than counted to.
    fn find_gofunc(
        &self,
        pcln_addr: u64,
        rodata: Option<u64>,
        noptrdata: Option<(u64, u64)>,
    ) -> Option<usize> {
        let rodata = rodata?;
        let (at, size) = noptrdata?;
        let d = self.data.get(at as usize..(at + size) as usize)?;
        let funcname_addr = pcln_addr + self.funcname as u64;
        for i in (0..d.len().saturating_sub(16)).step_by(8) {
            if u64_at(d, i) != Some(pcln_addr) || u64_at(d, i + 8) != Some(funcname_addr) {
                continue;
            }
            // `types` may be the address of `.rodata` too: the last field that is.
            let w = (30..48).rev().find(|w| u64_at(d, i + 8 * w) == Some(rodata))?;
            return self.file_offset(u64_at(d, i + 8 * (w + 1))?);
        }
        None
    }

    fn file_offset(&self, vaddr: u64) -> Option<usize> {
        self.loads
            .iter()
            .find(|&&(_, va, size)| vaddr >= va && vaddr - va < size)
            .map(|&(at, va, _)| (vaddr - va + at) as usize)
    }

    /// The virtual address of file offset `offset`.
    pub fn address(&self, offset: u64) -> Option<u64> {
        self.loads
            .iter()
            .find(|&&(at, _, size)| offset >= at && offset - at < size)
            .map(|&(at, va, _)| offset - at + va)
    }

    fn pcln(&self) -> &[u8] {
        &self.data[self.pcln.clone()]
    }

    /// The frames at virtual address `pc`, outermost first (inlined calls after the function
    /// they were inlined into); None outside every function.
    pub fn frames(&self, pc: u64) -> Option<Vec<GoFrame>> {
        let f = self.func(pc)?;
        let mut frames = Vec::new();
        let mut at = pc;
        let inl = self.inline_tree(&f);
        for _ in 0..MAX_INLINE_DEPTH {
            let (file, line) = self.position(&f, at);
            let ix = inl.and_then(|_| self.pcdata(&f, PCDATA_INL_TREE_INDEX, at));
            match (inl, ix) {
                (Some(tree), Some(ix)) if ix >= 0 => {
                    let (name_off, parent_pc) = self.inlined_call(tree, ix as usize)?;
                    frames.push(GoFrame {
                        function: self.name(name_off)?,
                        file,
                        line,
                        inlined: true,
                    });
                    at = f.entry + u64::from(parent_pc);
                }
                _ => {
                    frames.push(GoFrame {
                        function: self.name(f.name_off)?,
                        file,
                        line,
                        inlined: false,
                    });
                    frames.reverse();
                    return Some(frames);
                }
            }
        }
        None
    }

    /// The function holding `pc`: a binary search of the function table.
    fn func(&self, pc: u64) -> Option<Func> {
        let rel = pc.checked_sub(self.text_start)?;
        let p = self.pcln();
        let entry = |i: usize| u32_at(p, self.functab + 8 * i).map(u64::from);
        if rel < entry(0)? || rel >= entry(self.nfunc)? {
            return None;
        }
        let (mut lo, mut hi) = (0, self.nfunc);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if entry(mid)? <= rel {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let func_off = u32_at(p, self.functab + 8 * lo + 4)? as usize;
        let at = self.functab + func_off;
        let field = |i: usize| u32_at(p, at + 4 * i);
        let header = match self.version {
            Version::Go118 => 40,
            Version::Go120 => 44,
        };
        Some(Func {
            at,
            header,
            entry: self.text_start + u64::from(field(0)?),
            name_off: field(1)? as usize,
            pcfile: field(5)?,
            pcln: field(6)?,
            npcdata: field(7)?,
            cu: field(8)? as usize,
            nfuncdata: u32::from(*p.get(at + header - 1)?),
        })
    }

    fn name(&self, off: usize) -> Option<String> {
        c_string(self.pcln(), self.funcname.checked_add(off)?)
    }

    /// File and line at `pc` in `f`.
    fn position(&self, f: &Func, pc: u64) -> (Option<String>, Option<u32>) {
        let file = self.pcvalue(f.pcfile, f.entry, pc).and_then(|n| {
            let n = usize::try_from(n).ok()?;
            let p = self.pcln();
            let off = u32_at(p, self.cutab + 4 * (f.cu + n))?;
            c_string(p, self.filetab + off as usize)
        });
        let line = self.pcvalue(f.pcln, f.entry, pc).and_then(|l| u32::try_from(l).ok());
        (file, line)
    }

    fn pcdata(&self, f: &Func, table: u32, pc: u64) -> Option<i32> {
        if table >= f.npcdata {
            return None;
        }
        let off = u32_at(self.pcln(), f.at + f.header + 4 * table as usize)?;
        self.pcvalue(off, f.entry, pc)
    }

    /// Where `f`'s inline tree is in the file.
    fn inline_tree(&self, f: &Func) -> Option<usize> {
        if FUNCDATA_INL_TREE >= f.nfuncdata {
            return None;
        }
        let at = f.at + f.header + 4 * (f.npcdata + FUNCDATA_INL_TREE) as usize;
        let off = u32_at(self.pcln(), at)?;
        if off == u32::MAX {
            return None;
        }
        self.gofunc?.checked_add(off as usize)
    }

    /// The name offset and `parentPc` of entry `ix` of the inline tree at `tree`.
    fn inlined_call(&self, tree: usize, ix: usize) -> Option<(usize, u32)> {
        let (size, name, parent_pc) = match self.version {
            // parent i16, funcID u8, _ u8, file i32, line i32, func_ i32, parentPc i32
            Version::Go118 => (20, 12, 16),
            // funcID u8, _ [3]u8, nameOff i32, parentPc i32, startLine i32
            Version::Go120 => (16, 4, 8),
        };
        let at = tree.checked_add(ix.checked_mul(size)?)?;
        Some((u32_at(&self.data, at + name)? as usize, u32_at(&self.data, at + parent_pc)?))
    }

    /// The value of the pc-value table at `off` for `pc` in a function starting at `entry`:
    /// pairs of a zig-zag value delta and a pc delta (in quanta), from the value -1 at
    /// `entry`; each value holds up to its pc.
    fn pcvalue(&self, off: u32, entry: u64, pc: u64) -> Option<i32> {
        if off == 0 {
            return None;
        }
        let p = self.pcln();
        let mut at = self.pctab.checked_add(off as usize)?;
        let mut val: i32 = -1;
        let mut cur = entry;
        let mut first = true;
        loop {
            let (uv, n) = varint(p, at)?;
            at += n;
            if uv == 0 && !first {
                return None;
            }
            first = false;
            let delta = if uv & 1 != 0 { !(uv >> 1) as i32 } else { (uv >> 1) as i32 };
            val = val.wrapping_add(delta);
            let (pcd, n) = varint(p, at)?;
            at += n;
            cur += u64::from(pcd) * self.quantum;
            if pc < cur {
                return Some(val);
            }
        }
    }
}

/// What `frames` needs of a function's `_func`.
struct Func {
    /// Where it is in the section, and the size of its fixed fields.
    at: usize,
    header: usize,
    entry: u64,
    name_off: usize,
    pcfile: u32,
    pcln: u32,
    npcdata: u32,
    cu: usize,
    nfuncdata: u32,
}

fn u32_at(d: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(d.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

fn u64_at(d: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(d.get(at..at.checked_add(8)?)?.try_into().ok()?))
}

/// An unsigned LEB128 of at most 32 bits, and its length.
fn varint(d: &[u8], at: usize) -> Option<(u32, usize)> {
    let mut v: u32 = 0;
    for i in 0..5 {
        let b = *d.get(at + i)?;
        v |= u32::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

fn c_string(d: &[u8], at: usize) -> Option<String> {
    let s = d.get(at..)?;
    let end = s.iter().position(|&b| b == 0)?;
    Some(String::from_utf8_lossy(&s[..end]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use object::ObjectSymbol as _;

    fn line_of(source: &str, needle: &str) -> u32 {
        source.lines().position(|l| l.contains(needle)).unwrap() as u32 + 1
    }

    /// Debian's Go builds the fixture twice, with and without `-s -w`: every function of the
    /// full build's symbol table is named alike from the stripped build's `.gopclntab`, and
    /// hotA's loop carries the inlined `accumulate` with its file and line.
    #[test]
    fn names_a_stripped_go_program_as_its_symbol_table_does() {
        let full = ::tests::fixtures::build_go("gosplit", "", "gosplit_full").unwrap();
        let stripped = ::tests::fixtures::build_go("gosplit", "-s -w", "gosplit_go").unwrap();
        let data = std::fs::read(&full).unwrap();
        let elf = object::File::parse(&*data).unwrap();
        let table = GoTable::open(&stripped).unwrap().expect("a Go program");
        assert!(table.gofunc.is_some(), "moduledata not found");
        let text = elf.section_by_name(".text").unwrap();
        let range = text.address()..text.address() + text.size();
        let (mut same, mut other) = (0, Vec::new());
        for s in elf.symbols().filter(|s| s.kind() == object::SymbolKind::Text) {
            if !range.contains(&s.address()) || s.size() == 0 {
                continue;
            }
            // The symbol table marks assembly functions' ABI (`.abi0`); both shorten array
            // lengths in generated equality functions' names differently.
            let name = s.name().unwrap().trim_end_matches(".abi0");
            if name.starts_with("type..eq.[") {
                continue;
            }
            // The outermost frame at a function's first byte: a leaf without a stack check
            // may start in code inlined into it.
            match table.frames(s.address()) {
                Some(f) if f[0].function == name && !f[0].inlined => same += 1,
                got => other.push((name.to_owned(), got)),
            }
        }
        assert!(same > 1000 && other.is_empty(), "{same} named alike, not: {other:?}");

        let source =
            std::fs::read_to_string(::tests::fixtures::source_dir().join("gosplit.go")).unwrap();
        let call = line_of(&source, "acc = accumulate(acc, i)");
        let body = line_of(&source, "return acc + i*i");
        let hot_a = elf.symbols().find(|s| s.name() == Ok("main.hotA")).unwrap();
        let inlined: Vec<Vec<GoFrame>> = (hot_a.address()..hot_a.address() + hot_a.size())
            .filter_map(|pc| table.frames(pc))
            .filter(|f| f.len() == 2)
            .collect();
        assert!(!inlined.is_empty(), "no inlined frame in main.hotA");
        for f in &inlined {
            assert_eq!((f[0].function.as_str(), f[0].inlined), ("main.hotA", false), "{f:?}");
            assert_eq!((f[1].function.as_str(), f[1].inlined), ("main.accumulate", true), "{f:?}");
            assert_eq!((f[0].line, f[1].line), (Some(call), Some(body)), "{f:?}");
            assert!(f[1].file.as_deref().is_some_and(|p| p.ends_with("/gosplit.go")), "{f:?}");
        }
        // Outside every function: nothing.
        assert_eq!(table.frames(range.start - 1), None);
        assert_eq!(table.frames(u64::MAX), None);
    }

    #[test]
    fn refuses_files_that_are_not_go_programs() {
        let me = std::env::current_exe().unwrap();
        assert!(GoTable::open(&me).unwrap().is_none());
        assert!(GoTable::open(Path::new("/nonexistent")).is_err());
    }
}
