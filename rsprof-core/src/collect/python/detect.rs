//! Whether a mapped file is a CPython interpreter, from the file itself: a `python*`
//! executable or `libpython*` library exporting `_PyRuntime`, its version from `Py_Version`
//! (3.11+) or else from which version's API it exports (3.8 `PyCode_NewWithPosOnlyArgs`,
//! 3.9 `PyFrame_GetCode`, 3.10 `PyIter_Send`), never from its name alone.

use std::path::Path;

use object::{Object as _, ObjectSection as _, ObjectSegment as _, ObjectSymbol as _};

/// What the walker and the code reader need from an interpreter file. Addresses are the
/// file's virtual addresses (`p_vaddr` space).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PyElf {
    pub minor: u32,
    pub runtime: u64,
    /// `PyCode_Type`: a code object's `ob_type` points here.
    pub code_type: Option<u64>,
    /// `_PyEval_EvalFrameDefault` and its split-off parts (`.cold`): (start, end).
    pub eval: Vec<(u64, u64)>,
    /// PT_LOAD segments: (p_vaddr, p_filesz, p_offset).
    pub loads: Vec<(u64, u64, u64)>,
    /// Lowest executable segment: (p_vaddr, p_offset).
    pub exec: Option<(u64, u64)>,
}

/// Why a file that looked like CPython is not used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NotPython {
    /// Not a `python*` / `libpython*` file, or no `_PyRuntime`: not an interpreter.
    NotInterpreter,
    /// The file could not be read or parsed.
    Unreadable,
    /// An interpreter whose version this table lacks (or could not be told).
    UnknownVersion,
}

/// Whether the file name is one an interpreter goes by (a cheap filter before parsing).
pub fn plausible_name(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name.starts_with("python") || name.starts_with("libpython")
}

/// Reads `path` (the mapped file, as this process can open it).
pub fn read(path: &Path) -> Result<PyElf, NotPython> {
    let file = std::fs::File::open(path).map_err(|_| NotPython::Unreadable)?;
    // SAFETY: read-only map of a file; a file changed under it gives wrong symbols at worst.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|_| NotPython::Unreadable)?;
    let obj = object::File::parse(&*map).map_err(|_| NotPython::Unreadable)?;
    parse(&obj)
}

pub fn parse(obj: &object::File<'_>) -> Result<PyElf, NotPython> {
    let mut runtime = None;
    let mut py_version = None;
    let mut code_type = None;
    let mut eval = Vec::new();
    let mut api = 0;
    for sym in obj.dynamic_symbols().chain(obj.symbols()) {
        let Ok(name) = sym.name() else { continue };
        if sym.address() == 0 {
            continue;
        }
        match name {
            "_PyRuntime" => runtime = Some(sym.address()),
            "Py_Version" => py_version = Some(sym),
            "PyCode_Type" => code_type = Some(sym.address()),
            "PyCode_NewWithPosOnlyArgs" => api = api.max(8),
            "PyFrame_GetCode" => api = api.max(9),
            "PyIter_Send" => api = api.max(10),
            n if n == "_PyEval_EvalFrameDefault" || n.starts_with("_PyEval_EvalFrameDefault.") => {
                let range = (sym.address(), sym.address() + sym.size().max(1));
                if !eval.contains(&range) {
                    eval.push(range);
                }
            }
            _ => {}
        }
    }
    let runtime = runtime.ok_or(NotPython::NotInterpreter)?;
    // Code objects are told apart from other memory by their type.
    let code_type = Some(code_type.ok_or(NotPython::NotInterpreter)?);
    let minor = match py_version {
        Some(sym) => {
            let hex = read_u32(obj, sym.address()).ok_or(NotPython::UnknownVersion)?;
            if hex >> 24 != 3 {
                return Err(NotPython::UnknownVersion);
            }
            (hex >> 16) & 0xff
        }
        None if api > 0 => api,
        None => return Err(NotPython::UnknownVersion),
    };
    if !super::offsets::MINORS.contains(&minor) {
        return Err(NotPython::UnknownVersion);
    }
    let loads = obj
        .segments()
        .map(|s| {
            let (offset, size) = s.file_range();
            (s.address(), size, offset)
        })
        .collect();
    let exec = obj
        .segments()
        .filter(|s| {
            matches!(s.flags(), object::SegmentFlags::Elf { p_flags } if p_flags & object::elf::PF_X != 0)
        })
        .map(|s| (s.address(), s.file_range().0))
        .min();
    Ok(PyElf { minor, runtime, code_type, eval, loads, exec })
}

/// The u32 at virtual address `addr` of the file's data.
fn read_u32(obj: &object::File<'_>, addr: u64) -> Option<u32> {
    let section =
        obj.sections().find(|s| s.address() <= addr && addr + 4 <= s.address() + s.size())?;
    let data = section.data().ok()?;
    let at = (addr - section.address()) as usize;
    Some(u32::from_le_bytes(data.get(at..at + 4)?.try_into().ok()?))
}

impl PyElf {
    /// File offset of virtual address `vaddr` (in a segment's file bytes).
    pub fn file_offset(&self, vaddr: u64) -> Option<u64> {
        self.loads
            .iter()
            .find(|&&(v, size, _)| v <= vaddr && vaddr < v + size)
            .map(|&(v, _, off)| vaddr - v + off)
    }

    /// The load bias of a mapping of this file at `start` holding file offset `file_offset`
    /// (runtime address − virtual address).
    pub fn bias(&self, start: u64, file_offset: u64) -> Option<u64> {
        let &(v, _, off) = self
            .loads
            .iter()
            .find(|&&(_, size, off)| off <= file_offset && file_offset < off + size)?;
        Some(start.wrapping_sub(v + (file_offset - off)))
    }

    /// `_PyEval_EvalFrameDefault`'s code as file offset ranges (what stack frames hold).
    pub fn eval_offsets(&self) -> Vec<(u64, u64)> {
        self.eval
            .iter()
            .filter_map(|&(s, e)| {
                let start = self.file_offset(s)?;
                Some((start, start + (e - s)))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each installed interpreter file is found, with the version it really is.
    #[test]
    fn finds_each_installed_cpython_and_its_version() {
        let pyenv = crate::collect::python::tests_pyenv_root();
        let mut files = vec![("/usr/bin/python3.11".into(), 11)];
        for (v, minor) in [
            ("3.8.18", 8),
            ("3.9.18", 9),
            ("3.10.13", 10),
            ("3.11.7", 11),
            ("3.12.1", 12),
            ("3.13.0", 13),
        ] {
            files.push((pyenv.join(format!("versions/{v}/lib/libpython3.{minor}.so.1.0")), minor));
        }
        for (path, minor) in files {
            assert!(
                path.is_file(),
                "{} is missing (cargo xtask setup installs it)",
                path.display()
            );
            assert!(plausible_name(&path.display().to_string()));
            let elf = read(&path).unwrap_or_else(|e| panic!("{}: {e:?}", path.display()));
            assert_eq!(elf.minor, minor, "{}", path.display());
            assert!(elf.code_type.is_some() && !elf.eval.is_empty(), "{}: {elf:?}", path.display());
            assert!(!elf.eval_offsets().is_empty());
        }
        // A program that is no interpreter.
        assert_eq!(read(Path::new("/bin/true")), Err(NotPython::NotInterpreter));
    }
}
