//! Tells the kernel which processes run CPython: after each drain, the processes whose
//! mappings changed (or that forked) are looked at (`tracker`), and each found gets its walker
//! config (`PyProc`) in `PY_PROCS`, its interpreter file in `PY_FILES`; one that exits or
//! execs something else loses its entry.

use std::collections::HashSet;

use anyhow::{Result, bail};
use aya::maps::{HashMap as BpfHashMap, MapData};
use profiler_common::{FileKey, PY_NO_FIELD, PyFile, PyProc};

use super::{
    ProcessPython,
    detect::{self, PyElf},
};
use crate::{collect::collector::Collector, model::ids::Pid, store::SampleSink};

/// `PY_PROCS` and `PY_FILES`.
pub type PyMaps = (BpfHashMap<MapData, u32, PyProc>, BpfHashMap<MapData, FileKey, PyFile>);

pub struct PyLoader {
    procs: BpfHashMap<MapData, u32, PyProc>,
    /// Interpreter files, for the kernel to configure processes that map them at once.
    kernel_files: BpfHashMap<MapData, FileKey, PyFile>,
    /// See `PyProc::tls_specific`.
    tls_specific: u32,
    loaded: HashSet<Pid>,
}

impl PyLoader {
    /// Whether processes known to run CPython are being walked.
    pub fn running(&self) -> bool {
        !self.loaded.is_empty()
    }

    pub fn new((procs, kernel_files): PyMaps) -> Result<Self> {
        let Some(tls_specific) = glibc_specific_offset() else {
            bail!("glibc's thread-specific data was not where it was looked for")
        };
        let mut loader = Self { procs, kernel_files, tls_specific, loaded: HashSet::new() };
        loader.scan_path();
        Ok(loader)
    }

    /// Tells the kernel of the interpreters on `PATH` (`python3.X` executables), so that one
    /// started from there is walked from its first sample, not from the first drain after it
    /// mapped the interpreter (most of a short script's life).
    fn scan_path(&mut self) {
        let path = std::env::var_os("PATH").unwrap_or_default();
        let mut seen = HashSet::new();
        for dir in std::env::split_paths(&path) {
            let Ok(entries) = std::fs::read_dir(&dir) else { continue };
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let Some(minor) = name.strip_prefix("python3.") else { continue };
                if minor.parse::<u32>().is_err() {
                    continue;
                }
                let Ok(real) = std::fs::canonicalize(e.path()) else { continue };
                if seen.insert(real.clone())
                    && let Ok(elf) = detect::read(&real)
                {
                    self.tell_kernel(&real, &elf);
                }
            }
        }
    }

    /// Writes interpreter file `path` to `PY_FILES` (a failure only costs the kernel's head
    /// start).
    fn tell_kernel(&mut self, path: &std::path::Path, elf: &PyElf) {
        use crate::collect::modules::{file_identity, kernel_file_key};
        let (Ok(meta), Some((exec_vaddr, exec_offset))) = (std::fs::metadata(path), elf.exec)
        else {
            return;
        };
        let Some(config) = self.config(elf, 0) else { return };
        let key = kernel_file_key(&file_identity(&meta));
        let file = PyFile {
            proc_: config,
            text_vaddr: exec_vaddr,
            exec_offset: exec_offset & !0xfff,
            exec_vaddr: exec_vaddr - (exec_offset & 0xfff),
        };
        let _ = self.kernel_files.insert(key, file, 0);
    }

    /// The walker config of interpreter `elf` loaded with `bias`.
    fn config(&self, elf: &PyElf, bias: u64) -> Option<PyProc> {
        let o = super::offsets::for_minor(elf.minor)?;
        let (code_lo, code_len) = o.code_ident_span();
        Some(PyProc {
            tss_key: bias.wrapping_add(elf.runtime).wrapping_add(u64::from(o.runtime_tss_key)),
            tls_specific: self.tls_specific,
            minor: elf.minor,
            tstate_frame: o.tstate_frame,
            cframe_frame: o.cframe_frame.unwrap_or(PY_NO_FIELD),
            tstate_datastack: o.tstate_datastack.unwrap_or(PY_NO_FIELD),
            frame_len: o.frame_len(),
            code_lo,
            code_len,
            code_firstlineno: o.code_firstlineno,
            code_filename: o.code_filename,
            code_name: o.code_name,
            code_qualname: o.code_qualname.unwrap_or(PY_NO_FIELD),
            code_linetable: o.code_linetable,
            _pad: 0,
            frame_back: o.frame_back,
            frame_code: o.frame_code,
            frame_ip: o.frame_ip,
            frame_owner: o.frame_owner.unwrap_or(PY_NO_FIELD),
            frame_is_entry: o.frame_is_entry.unwrap_or(PY_NO_FIELD),
            announced: 0,
        })
    }

    /// Looks at the processes the collector says may have changed, and drops those gone.
    pub fn after_drain<S: SampleSink>(&mut self, c: &mut Collector<S>) {
        for pid in c.outbox.take_python_checks() {
            c.check_python(pid);
        }
        self.apply(c.python.take_news());
        let procs = &mut self.procs;
        self.loaded.retain(|pid| {
            let alive = c
                .processes
                .get(*pid)
                .is_some_and(|p| !p.exited && matches!(p.python, ProcessPython::Python(_)));
            if !alive {
                let _ = procs.remove(&pid.0);
            }
            alive
        });
    }

    /// Writes what the tracker found: interpreter files for the kernel, and each process's
    /// config (or its removal).
    fn apply(&mut self, news: Vec<super::tracker::News>) {
        for n in news {
            match n {
                super::tracker::News::File(path, elf) => self.tell_kernel(&path, &elf),
                super::tracker::News::Python { pid, elf, bias } => {
                    let Some(config) = self.config(&elf, bias) else { continue };
                    // A refused write leaves the process to be walked never (counted).
                    if self.procs.insert(pid.0, config, 0).is_ok() {
                        self.loaded.insert(pid);
                    }
                }
                super::tracker::News::Gone(pid) => {
                    if self.loaded.remove(&pid) {
                        let _ = self.procs.remove(&pid.0);
                    }
                }
            }
        }
    }
}

/// Where glibc keeps thread-specific values: the offset from the thread pointer
/// (`pthread_self()`, x86-64) of `specific_1stblock`, found by setting a key's value in this
/// process and looking for it. Targets are assumed to run the host's glibc (a container's
/// other libc gives read faults or no thread state, counted).
fn glibc_specific_offset() -> Option<u32> {
    const MARK: u64 = 0x5259_5350_524f_4621;
    // SAFETY: plain pthread calls on this thread; the key is deleted before returning and the
    // thread block is read only within its first 4 KiB (struct pthread is larger).
    unsafe {
        let mut key: libc::pthread_key_t = 0;
        if libc::pthread_key_create(&mut key, None) != 0 {
            return None;
        }
        libc::pthread_setspecific(key, MARK as *const libc::c_void);
        let tp = libc::pthread_self() as *const u64;
        let at = (0..512).find(|&i| *tp.add(i) == MARK);
        libc::pthread_key_delete(key);
        let data = at? * 8;
        // Each entry is (sequence, value).
        u32::try_from(data.checked_sub(16 * key as usize + 8)?).ok()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn finds_glibcs_thread_specific_block() {
        // glibc 2.36 on x86-64 (disassembled pthread_getspecific): 0x310.
        assert_eq!(super::glibc_specific_offset(), Some(0x310));
    }
}
