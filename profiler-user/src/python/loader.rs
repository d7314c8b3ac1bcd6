//! Tells the kernel which processes run CPython: after each drain, the processes whose
//! mappings changed (or that forked) are looked at for an interpreter file (`detect`, once per
//! file), and each found gets its walker config (`PyProc`) in `PY_PROCS`; one that exits or
//! execs something else loses it.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
};

use anyhow::{Result, bail};
use aya::maps::{HashMap as BpfHashMap, MapData};
use profiler_common::{PY_NO_FIELD, PyFile, PyFileKey, PyProc};

use super::{
    ProcessPython, PyProcess,
    detect::{self, NotPython, PyElf},
};
use crate::{collect::collector::Collector, model::ids::Pid, store::SampleSink};

/// How long after a process is found running CPython drains follow each other closely, so
/// that its code objects are read while it lives (a short script's whole life).
const FOUND_FOLLOW_NS: u64 = 250_000_000;

/// `PY_PROCS` and `PY_FILES`.
pub type PyMaps = (BpfHashMap<MapData, u32, PyProc>, BpfHashMap<MapData, PyFileKey, PyFile>);

pub struct PyLoader {
    procs: BpfHashMap<MapData, u32, PyProc>,
    /// Interpreter files, for the kernel to configure processes that map them at once.
    kernel_files: BpfHashMap<MapData, PyFileKey, PyFile>,
    /// See `PyProc::tls_specific`.
    tls_specific: u32,
    /// Interpreter files looked at, by module (and the module's serial: ids are reused).
    files: HashMap<(crate::model::ids::ModuleId, u64), Result<Arc<PyElf>, NotPython>>,
    loaded: HashSet<Pid>,
}

impl PyLoader {
    pub fn new((procs, kernel_files): PyMaps) -> Result<Self> {
        let Some(tls_specific) = glibc_specific_offset() else {
            bail!("glibc's thread-specific data was not where it was looked for")
        };
        let mut loader = Self {
            procs,
            kernel_files,
            tls_specific,
            files: HashMap::new(),
            loaded: HashSet::new(),
        };
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
        use std::os::unix::fs::MetadataExt as _;
        let (Ok(meta), Some((exec_vaddr, exec_offset))) = (std::fs::metadata(path), elf.exec)
        else {
            return;
        };
        let Some(config) = self.config(elf, 0) else { return };
        let dev = meta.dev();
        let key = PyFileKey {
            inode: meta.ino(),
            dev: ((libc::major(dev) as u32) << 20) | libc::minor(dev) as u32,
            _pad: 0,
        };
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
        Some(PyProc {
            tss_key: bias.wrapping_add(elf.runtime).wrapping_add(u64::from(o.runtime_tss_key)),
            tls_specific: self.tls_specific,
            minor: elf.minor,
            tstate_frame: o.tstate_frame,
            cframe_frame: o.cframe_frame.unwrap_or(PY_NO_FIELD),
            frame_back: o.frame_back,
            frame_code: o.frame_code,
            frame_ip: o.frame_ip,
            frame_owner: o.frame_owner.unwrap_or(PY_NO_FIELD),
            frame_is_entry: o.frame_is_entry.unwrap_or(PY_NO_FIELD),
            _pad: 0,
        })
    }

    /// Looks at the processes the collector says may have changed, and drops those gone.
    pub fn after_drain<S: SampleSink>(&mut self, c: &mut Collector<S>) {
        for pid in c.outbox.take_python_checks() {
            self.check(pid, c);
        }
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

    fn check<S: SampleSink>(&mut self, pid: Pid, c: &mut Collector<S>) {
        let Some(p) = c.processes.processes.get_mut(&pid) else { return };
        if p.exited {
            return;
        }
        let mut found = None;
        let mut unsupported = None;
        for m in p.space.mappings() {
            let module = c.modules.get(m.module);
            if !detect::plausible_name(&module.path) {
                continue;
            }
            let key = (m.module, c.modules.serial(m.module));
            let mut new_file = None;
            let det = self.files.entry(key).or_insert_with(|| {
                let r = match module.readable_path() {
                    Some(path) => {
                        let r = detect::read(&path).map(Arc::new);
                        if let Ok(elf) = &r {
                            new_file = Some((path, elf.clone()));
                        }
                        r
                    }
                    None => Err(NotPython::Unreadable),
                };
                if matches!(r, Err(NotPython::Unreadable | NotPython::UnknownVersion)) {
                    c.stats.python.unsupported_files += 1;
                }
                r
            });
            let det = det.clone();
            if let Some((path, elf)) = new_file {
                self.tell_kernel(&path, &elf);
            }
            match det {
                Ok(elf) => {
                    if let Some(bias) = elf.bias(m.start, m.file_offset) {
                        found = Some((m.module, elf.clone(), bias));
                        break;
                    }
                }
                Err(NotPython::NotInterpreter) => {}
                Err(e) => unsupported = Some(e),
            }
        }
        let Some((module, elf, bias)) = found else {
            if self.loaded.remove(&pid) {
                let _ = self.procs.remove(&pid.0);
            }
            p.python = unsupported.map_or(ProcessPython::NotFound, ProcessPython::Unsupported);
            return;
        };
        if let ProcessPython::Python(py) = &p.python
            && py.module == module
            && py.bias == bias
        {
            return;
        }
        let Some(py) = PyProcess::new(module, bias, &elf) else { return };
        let Some(config) = self.config(&elf, bias) else { return };
        if self.procs.insert(pid.0, config, 0).is_err() {
            c.stats.python.map_full += 1;
            return;
        }
        p.python = ProcessPython::Python(Box::new(py));
        self.loaded.insert(pid);
        c.stats.python.processes += 1;
        let until = crate::model::time::MonoNs::now().0 + FOUND_FOLLOW_NS;
        c.drain_soon_until = c.drain_soon_until.max(crate::model::time::MonoNs(until));
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
