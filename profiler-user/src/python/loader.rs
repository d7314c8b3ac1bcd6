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
use profiler_common::{PY_NO_FIELD, PyProc};

use super::{
    ProcessPython, PyProcess,
    detect::{self, NotPython, PyElf},
};
use crate::{collect::collector::Collector, model::ids::Pid, store::SampleSink};

/// How long after a process is found running CPython drains follow each other closely, so
/// that its code objects are read while it lives (a short script's whole life).
const FOUND_FOLLOW_NS: u64 = 250_000_000;

pub struct PyLoader {
    procs: BpfHashMap<MapData, u32, PyProc>,
    /// See `PyProc::tls_specific`.
    tls_specific: u32,
    /// Interpreter files looked at, by module (and the module's serial: ids are reused).
    files: HashMap<(crate::model::ids::ModuleId, u64), Result<Arc<PyElf>, NotPython>>,
    loaded: HashSet<Pid>,
}

impl PyLoader {
    pub fn new(procs: BpfHashMap<MapData, u32, PyProc>) -> Result<Self> {
        let Some(tls_specific) = glibc_specific_offset() else {
            bail!("glibc's thread-specific data was not where it was looked for")
        };
        Ok(Self { procs, tls_specific, files: HashMap::new(), loaded: HashSet::new() })
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
            let det = self.files.entry(key).or_insert_with(|| {
                let r = match module.readable_path() {
                    Some(path) => detect::read(&path).map(Arc::new),
                    None => Err(NotPython::Unreadable),
                };
                if matches!(r, Err(NotPython::Unreadable | NotPython::UnknownVersion)) {
                    c.stats.python.unsupported_files += 1;
                }
                r
            });
            match det {
                Ok(elf) => {
                    if let Some(bias) = elf.bias(m.start, m.file_offset) {
                        found = Some((m.module, elf.clone(), bias));
                        break;
                    }
                }
                Err(NotPython::NotInterpreter) => {}
                Err(e) => unsupported = Some(*e),
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
        let o = py.offsets;
        let config = PyProc {
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
        };
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
