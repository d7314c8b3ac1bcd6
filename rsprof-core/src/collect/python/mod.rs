//! CPython frames read from the interpreter itself (issue 34): which file of a process is
//! CPython and of which version (`detect`), the per-version struct layouts (`offsets`), code objects read from the
//! process (`code`), and the kernel's Python frames put into the native stack (`merge`).

pub(crate) mod code;
pub mod detect;
#[cfg(test)]
mod fuzz_tests;
pub(crate) mod merge;
pub mod offsets;
pub mod tracker;

use std::collections::HashMap;

use crate::model::ids::{JitSymbolId, ModuleId};

/// What is known of a process's interpreter.
#[derive(Debug, Default)]
pub enum ProcessPython {
    /// No CPython file mapped (or not looked at yet).
    #[default]
    NotFound,
    Python(Box<PyProcess>),
    /// A file that looked like CPython could not be used.
    Unsupported(detect::NotPython),
}

/// A process running CPython, as the collector needs it to merge its frames.
#[derive(Debug)]
pub struct PyProcess {
    /// The interpreter's file and its load bias in the process.
    pub module: ModuleId,
    pub bias: u64,
    pub minor: u32,
    pub offsets: &'static offsets::PyOffsets,
    /// `_PyEval_EvalFrameDefault` as file offset ranges of `module`.
    pub eval: Vec<(u64, u64)>,
    /// `PyCode_Type`'s address in the process.
    pub code_type: Option<u64>,
    /// Code objects read, by address.
    codes: HashMap<u64, CodeEntry>,
    /// The frame shown for a code object gone before it was read (see `merge::GONE`).
    gone: Option<JitSymbolId>,
    /// The frame shown for a code object unreadable (`merge::UNREADABLE`).
    unreadable: Option<JitSymbolId>,
}

/// A code object as read, and the frame symbols given to its lines.
#[derive(Debug)]
struct CodeEntry {
    info: Result<code::CodeInfo, code::CodeError>,
    /// Time of the sample that had it read: the read came after it, so a sample no later
    /// than this cannot find a newer object by reading again.
    read_for_ns: u64,
    lines: HashMap<Option<u32>, JitSymbolId>,
}

/// Code objects kept per process; past it the cache starts afresh.
const MAX_CODES: usize = 1 << 16;

impl PyProcess {
    pub fn new(module: ModuleId, bias: u64, elf: &detect::PyElf) -> Option<Self> {
        Some(PyProcess {
            module,
            bias,
            minor: elf.minor,
            offsets: offsets::for_minor(elf.minor)?,
            eval: elf.eval_offsets(),
            code_type: elf.code_type.map(|t| t.wrapping_add(bias)),
            codes: HashMap::new(),
            gone: None,
            unreadable: None,
        })
    }

    /// Whether a native frame at `offset` of `module` is the eval loop.
    pub fn is_eval(&self, module: ModuleId, offset: u64) -> bool {
        module == self.module && self.eval.iter().any(|&(s, e)| s <= offset && offset < e)
    }
}

/// What reading Python frames did, for the summary (`python:` line).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyStats {
    /// Processes found running CPython (an exec into it again counts again).
    pub processes: u64,
    /// Interpreter files of a version without a layout here, or unreadable.
    pub unsupported_files: u64,
    /// Samples of CPython processes with Python frames in their stacks.
    pub samples_with: u64,
    /// Samples of CPython processes without, by reason: the thread has no thread state (not
    /// a Python thread); no current frame (start-up, exit); a read faulted; the sample came
    /// before the kernel knew the process; no eval-loop frame in the native stack to put them
    /// at.
    pub no_thread_state: u64,
    pub no_frame: u64,
    pub read_fault: u64,
    pub not_loaded: u64,
    pub unplaced: u64,
    /// Samples whose native eval-loop frames and Python activations did not pair up
    /// one to one (a cut stack on either side): placed from the leaf.
    pub mismatched: u64,
    /// Samples whose native walk was cut before any loop frame: the Python frames went
    /// right under the truncation marker.
    pub above_cut: u64,
    /// Samples with more than `PY_MAX_FRAMES` Python frames (outermost ones cut).
    pub truncated: u64,
    /// Code objects read, unreadable (memory gone: the process exited first), not code
    /// objects (a frame in flux or memory not as the layout says), and reused (a freed code
    /// object's memory holding another, read anew).
    pub code_objects: u64,
    pub code_unreadable: u64,
    pub not_code: u64,
    pub code_reused: u64,
    /// Frames whose code object was gone when read (freed, its memory holding another object
    /// or none; or a pointer that was never one): shown as `merge::GONE`, not named as what
    /// is there now.
    pub code_gone: u64,
    /// Frames skipped as still setting up (3.11+ incomplete frames).
    pub incomplete: u64,
    /// Processes whose walker config the kernel refused (map full).
    pub map_full: u64,
}

impl PyStats {
    pub fn without(&self) -> u64 {
        self.no_thread_state + self.no_frame + self.read_fault + self.not_loaded + self.unplaced
    }

    /// Records (`unit`) with Python frames and those without, by why (both summary lines).
    fn with_and_without(&self, unit: &str) -> String {
        format!(
            "{}{unit} with Python frames, {} without: {} in threads without a Python thread state, {} \
             between frames, {} unreadable, {} before the process was known, {} with no eval \
             loop frame to place them at",
            self.samples_with,
            self.without(),
            self.no_thread_state,
            self.no_frame,
            self.read_fault,
            self.not_loaded,
            self.unplaced
        )
    }

    /// The summary's line on off-CPU records (these stats counting them), None without any.
    pub fn render_off_cpu(&self) -> Option<String> {
        let n = self.samples_with + self.without();
        (n > 0).then(|| format!("  python off-CPU records: {}", self.with_and_without("")))
    }

    /// The summary's line, None when no CPython ran.
    pub fn render(&self) -> Option<String> {
        if self.processes == 0 && self.unsupported_files == 0 {
            return None;
        }
        Some(format!(
            "python: {} processes, {}; {} placed from the leaf (stacks cut), {} \
             under a cut native stack, {} cut at {} frames; code objects: {} read, {} \
             unreadable, {} not code objects, {} reused; {} frames whose code object was \
             gone when read; {} frames still setting up skipped; {} interpreter files \
             unsupported",
            self.processes,
            self.with_and_without(" samples"),
            self.mismatched,
            self.above_cut,
            self.truncated,
            profiler_common::PY_MAX_FRAMES,
            self.code_objects,
            self.code_unreadable,
            self.not_code,
            self.code_reused,
            self.code_gone,
            self.incomplete,
            self.unsupported_files,
        ))
    }
}

/// Where the tests find the pyenv CPythons: `$PYENV_ROOT` as pyenv reads it, else `~/.pyenv`.
#[cfg(test)]
pub(crate) fn tests_pyenv_root() -> std::path::PathBuf {
    std::env::var_os("PYENV_ROOT").map(Into::into).unwrap_or_else(|| {
        std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or("/root".into())).join(".pyenv")
    })
}
