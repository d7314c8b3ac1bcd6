//! CPython's struct layouts per minor version: data, checked against each installed
//! interpreter's own headers by the test below (`offsetof` compiled with `Py_BUILD_CORE`), so
//! no offset here is a guess. Release (non-debug, GIL) builds of x86-64 only.

/// Byte offsets of what the kernel walker and the code-object reader use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyOffsets {
    pub minor: u32,
    /// `_PyRuntime` → the pthread key (`…autoTSSkey._key`).
    pub runtime_tss_key: u32,
    /// `PyThreadState` → `frame` (≤3.10), `cframe` (3.11, 3.12) or `current_frame` (3.13).
    pub tstate_frame: u32,
    /// `_PyCFrame` → `current_frame` (3.11, 3.12).
    pub cframe_frame: Option<u32>,
    /// `PyThreadState` → `datastack_chunk`, followed by `datastack_top` (3.11+): the thread's
    /// frames live in that chunk below the top, so the walker reads them in one piece.
    pub tstate_datastack: Option<u32>,
    /// Frame → previous frame, code object (`f_code`, 3.13 `f_executable`), instruction
    /// (`f_lasti`, `prev_instr`, 3.13 `instr_ptr`).
    pub frame_back: u32,
    pub frame_code: u32,
    pub frame_ip: u32,
    /// `_PyInterpreterFrame.owner` (3.11+), `.is_entry` (3.11).
    pub frame_owner: Option<u32>,
    pub frame_is_entry: Option<u32>,
    /// `PyCodeObject` fields.
    pub code_firstlineno: u32,
    pub code_filename: u32,
    pub code_name: u32,
    pub code_qualname: Option<u32>,
    /// `co_lnotab` (≤3.9) or `co_linetable` (3.10+).
    pub code_linetable: u32,
    /// `co_code_adaptive` and `_co_firsttraceable` (3.11+).
    pub code_adaptive: Option<u32>,
    pub code_firsttraceable: Option<u32>,
    /// `PyObject.ob_type`, `PyVarObject.ob_size`.
    pub object_type: u32,
    pub var_size: u32,
    /// `PyASCIIObject.length`, `.state`, and where a compact ASCII / non-ASCII string's
    /// characters start (`sizeof(PyASCIIObject)`, `sizeof(PyCompactUnicodeObject)`).
    pub str_length: u32,
    pub str_state: u32,
    pub str_ascii_data: u32,
    pub str_compact_data: u32,
    /// `PyBytesObject.ob_sval`.
    pub bytes_data: u32,
}

const BASE: PyOffsets = PyOffsets {
    minor: 8,
    runtime_tss_key: 1396,
    tstate_frame: 24,
    cframe_frame: None,
    tstate_datastack: None,
    frame_back: 24,
    frame_code: 32,
    frame_ip: 104,
    frame_owner: None,
    frame_is_entry: None,
    code_firstlineno: 40,
    code_filename: 104,
    code_name: 112,
    code_qualname: None,
    code_linetable: 120,
    code_adaptive: None,
    code_firsttraceable: None,
    object_type: 8,
    var_size: 16,
    str_length: 16,
    str_state: 32,
    str_ascii_data: 48,
    str_compact_data: 72,
    bytes_data: 32,
};

/// `_PyStackChunk.data` (3.11+): after `previous`, `size` and `top`.
pub const STACK_CHUNK_DATA: u32 = 24;

/// Oldest and newest minor versions supported.
pub const MINORS: std::ops::RangeInclusive<u32> = 8..=13;

pub const TABLE: [PyOffsets; 6] = [
    BASE,
    PyOffsets { minor: 9, runtime_tss_key: 588, ..BASE },
    PyOffsets { minor: 10, runtime_tss_key: 588, frame_ip: 96, ..BASE },
    PyOffsets {
        minor: 11,
        runtime_tss_key: 596,
        tstate_frame: 56,
        cframe_frame: Some(8),
        tstate_datastack: Some(296),
        frame_back: 48,
        frame_code: 32,
        frame_ip: 56,
        frame_owner: Some(69),
        frame_is_entry: Some(68),
        code_firstlineno: 72,
        code_filename: 112,
        code_name: 120,
        code_qualname: Some(128),
        code_linetable: 136,
        code_adaptive: Some(184),
        code_firsttraceable: Some(168),
        ..BASE
    },
    PyOffsets {
        minor: 12,
        runtime_tss_key: 1548,
        tstate_frame: 56,
        cframe_frame: Some(0),
        tstate_datastack: Some(232),
        frame_back: 8,
        frame_code: 0,
        frame_ip: 56,
        frame_owner: Some(70),
        frame_is_entry: None,
        code_firstlineno: 68,
        code_filename: 112,
        code_name: 120,
        code_qualname: Some(128),
        code_linetable: 136,
        code_adaptive: Some(192),
        code_firsttraceable: Some(176),
        str_ascii_data: 40,
        str_compact_data: 56,
        ..BASE
    },
    PyOffsets {
        minor: 13,
        runtime_tss_key: 2164,
        tstate_frame: 72,
        cframe_frame: None,
        tstate_datastack: Some(232),
        frame_back: 8,
        frame_code: 0,
        frame_ip: 56,
        frame_owner: Some(70),
        frame_is_entry: None,
        code_firstlineno: 68,
        code_filename: 112,
        code_name: 120,
        code_qualname: Some(128),
        code_linetable: 136,
        code_adaptive: Some(200),
        code_firsttraceable: Some(184),
        str_ascii_data: 40,
        str_compact_data: 56,
        ..BASE
    },
];

/// The layout of CPython 3.`minor`, if supported.
pub fn for_minor(minor: u32) -> Option<&'static PyOffsets> {
    TABLE.iter().find(|o| o.minor == minor)
}

impl PyOffsets {
    /// (start, length) of the code object's bytes that hold the fields of its identity
    /// (`profiler_common::py_code_ident`), as the kernel walker reads them.
    pub fn code_ident_span(&self) -> (u32, u32) {
        let fields = [self.code_filename, self.code_name, self.code_linetable];
        let words = fields.into_iter().chain(self.code_qualname);
        let lo = words.clone().chain([self.code_firstlineno]).min().unwrap_or(0) & !7;
        let hi = words.map(|o| o + 8).chain([self.code_firstlineno + 4]).max().unwrap_or(0);
        (lo, hi - lo)
    }

    /// Bytes from a frame's start that hold what the kernel walker reads of it.
    pub fn frame_len(&self) -> u32 {
        let words = [self.frame_back, self.frame_code, self.frame_ip].map(|o| o + 8);
        let bytes = [self.frame_owner, self.frame_is_entry].map(|o| o.map_or(0, |o| o + 1));
        let end = words.into_iter().chain(bytes).max().unwrap_or(0);
        end.div_ceil(8) * 8
    }

    /// Every entry by the name the header check prints it under (None: the version lacks it).
    pub fn entries(&self) -> Vec<(&'static str, Option<u32>)> {
        vec![
            ("runtime_tss_key", Some(self.runtime_tss_key)),
            ("tstate_frame", Some(self.tstate_frame)),
            ("cframe_frame", self.cframe_frame),
            ("tstate_datastack", self.tstate_datastack),
            ("stack_chunk_data", self.tstate_datastack.map(|_| STACK_CHUNK_DATA)),
            ("frame_back", Some(self.frame_back)),
            ("frame_code", Some(self.frame_code)),
            ("frame_ip", Some(self.frame_ip)),
            ("frame_owner", self.frame_owner),
            ("frame_is_entry", self.frame_is_entry),
            ("code_firstlineno", Some(self.code_firstlineno)),
            ("code_filename", Some(self.code_filename)),
            ("code_name", Some(self.code_name)),
            ("code_qualname", self.code_qualname),
            ("code_linetable", Some(self.code_linetable)),
            ("code_adaptive", self.code_adaptive),
            ("code_firsttraceable", self.code_firsttraceable),
            ("object_type", Some(self.object_type)),
            ("var_size", Some(self.var_size)),
            ("str_length", Some(self.str_length)),
            ("str_state", Some(self.str_state)),
            ("str_ascii_data", Some(self.str_ascii_data)),
            ("str_compact_data", Some(self.str_compact_data)),
            ("bytes_data", Some(self.bytes_data)),
        ]
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, path::PathBuf, process::Command};

    use super::*;

    /// Prints `name=offset` for every table entry of the version it is compiled against.
    const CHECK_C: &str = include_str!("offsets_check.c");

    /// The header directories of every CPython the table must match: Debian's 3.11 and each
    /// pyenv 3.8–3.13. A missing one fails, naming it.
    fn installed_headers() -> Vec<(String, u32, PathBuf)> {
        let pyenv = crate::collect::python::tests_pyenv_root();
        let mut found =
            vec![("/usr/include/python3.11".to_owned(), 11, "/usr/include/python3.11".into())];
        let mut missing = Vec::new();
        for minor in MINORS {
            let versions = pyenv.join("versions");
            let dir = std::fs::read_dir(&versions).ok().and_then(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| {
                        let name = p.file_name().unwrap_or_default().to_string_lossy();
                        name.starts_with(&format!("3.{minor}."))
                    })
                    .map(|p| p.join(format!("include/python3.{minor}")))
                    .find(|inc| inc.join("Python.h").is_file())
            });
            match dir {
                Some(inc) => found.push((inc.display().to_string(), minor, inc)),
                None => missing.push(format!("3.{minor} (pyenv install 3.{minor})")),
            }
        }
        assert!(
            PathBuf::from("/usr/include/python3.11/Python.h").is_file(),
            "/usr/include/python3.11 is missing: install Debian's python3.11-dev"
        );
        assert!(
            missing.is_empty(),
            "CPython headers missing under {}/versions: {missing:?}",
            pyenv.display()
        );
        found
    }

    #[test]
    fn offsets_match_each_installed_cpythons_headers() {
        let dir = std::env::temp_dir().join(format!("rsprof-pyoffsets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("check.c");
        std::fs::write(&src, CHECK_C).unwrap();
        for (name, minor, inc) in installed_headers() {
            let exe = dir.join(format!("check{minor}"));
            let out = Command::new("cc")
                .arg("-o")
                .arg(&exe)
                .arg(&src)
                .arg(format!("-I{}", inc.display()))
                .arg(format!("-I{}", inc.join("internal").display()))
                .output()
                .expect("run cc");
            assert!(
                out.status.success(),
                "compiling the offset check against {name} failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let out = Command::new(&exe).output().expect("run the offset check");
            let printed: HashMap<String, u32> = String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter_map(|l| {
                    let (k, v) = l.split_once('=')?;
                    Some((k.to_owned(), v.parse().ok()?))
                })
                .collect();
            let table = for_minor(minor).unwrap_or_else(|| panic!("no table entry for 3.{minor}"));
            for (entry, value) in table.entries() {
                assert_eq!(
                    value,
                    printed.get(entry).copied(),
                    "3.{minor} {entry}: the table says {value:?}, {name}'s headers {:?}",
                    printed.get(entry)
                );
            }
            assert_eq!(printed.len(), table.entries().iter().filter(|e| e.1.is_some()).count());
            // The kernel walker reads these with aligned loads (profiler-ebpf's python.rs).
            for word in [table.frame_back, table.frame_code, table.frame_ip] {
                assert_eq!(word % 8, 0, "3.{minor}: a frame word at {word} is not 8-aligned");
            }
            if let Some(d) = table.tstate_datastack {
                // Read in one piece, with aligned loads, by the kernel walker.
                let f = table.tstate_frame;
                let span = (f + 8).max(d + 16) - f.min(d);
                assert!(span as usize <= profiler_common::PY_TSTATE_READ, "3.{minor}: {span}");
                assert_eq!((f % 8, d % 8), (0, 0), "3.{minor}: thread state fields not aligned");
            }
            let (lo, len) = table.code_ident_span();
            assert!(len as usize <= profiler_common::PY_CODE_READ, "3.{minor}: {lo}+{len}");
            for word in [table.code_filename, table.code_name, table.code_linetable] {
                assert_eq!(word % 8, 0, "3.{minor}: a code object word at {word} is not aligned");
            }
            assert_eq!(table.code_firstlineno % 4, 0, "3.{minor}: co_firstlineno not aligned");
            let frame_len = table.frame_len() as usize;
            assert!(frame_len <= profiler_common::PY_FRAME_READ, "3.{minor}: {frame_len} bytes");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
