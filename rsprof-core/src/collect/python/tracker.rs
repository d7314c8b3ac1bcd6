//! Which processes run CPython, as the collector knows them: a process whose mappings changed
//! is looked at for an interpreter file (`detect`, once per file), and gets its `PyProcess`
//! (what merging its frames needs). What the kernel must be told goes out as `News` for the
//! loader. Samples that carry Python frames of a process not looked at yet (the kernel knew
//! its interpreter file first) have it looked at then, so a script whose whole life fits in
//! one drain is merged too.

use std::{collections::HashMap, path::PathBuf, sync::Arc};

use super::{
    ProcessPython, PyProcess, PyStats,
    detect::{self, NotPython, PyElf},
};
use crate::{
    collect::{modules::ModuleTable, processes::ProcessInfo},
    model::{
        ids::{ModuleId, Pid},
        time::MonoNs,
    },
};

/// How long after a process is found running CPython drains follow each other closely, so
/// that its code objects are read while it lives (a short script's whole life).
pub const FOUND_FOLLOW_NS: u64 = 250_000_000;

/// What the kernel's maps must learn.
#[derive(Debug)]
pub enum News {
    /// An interpreter file (its path as this process opens it).
    File(PathBuf, Arc<PyElf>),
    /// A process runs `elf` with load bias `bias`.
    Python { pid: Pid, elf: Arc<PyElf>, bias: u64 },
    /// A process no longer runs a CPython known here.
    Gone(Pid),
}

#[derive(Debug, Default)]
pub struct PyTracker {
    /// Interpreter files looked at, by module (and the module's serial: ids are reused).
    files: HashMap<(ModuleId, u64), Result<Arc<PyElf>, NotPython>>,
    news: Vec<News>,
}

impl PyTracker {
    pub fn take_news(&mut self) -> Vec<News> {
        std::mem::take(&mut self.news)
    }

    /// Looks for CPython in `p`'s mappings; true when it was found anew (drains should then
    /// follow closely for a while).
    pub fn check(
        &mut self,
        pid: Pid,
        p: &mut ProcessInfo,
        modules: &ModuleTable,
        stats: &mut PyStats,
    ) -> bool {
        p.python_checked = p.space.version();
        if p.exited {
            return false;
        }
        let mut found = None;
        let mut unsupported = None;
        for m in p.space.mappings() {
            let module = modules.get(m.module);
            if !detect::plausible_name(&module.path) {
                continue;
            }
            let key = (m.module, modules.serial(m.module));
            let news = &mut self.news;
            let det = self.files.entry(key).or_insert_with(|| {
                let r = match module.readable_path() {
                    Some(path) => {
                        let r = detect::read(&path).map(Arc::new);
                        if let Ok(elf) = &r {
                            news.push(News::File(path, elf.clone()));
                        }
                        r
                    }
                    None => Err(NotPython::Unreadable),
                };
                if matches!(r, Err(NotPython::Unreadable | NotPython::UnknownVersion)) {
                    stats.unsupported_files += 1;
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
            if matches!(p.python, ProcessPython::Python(_)) {
                self.news.push(News::Gone(pid));
            }
            p.python = unsupported.map_or(ProcessPython::NotFound, ProcessPython::Unsupported);
            return false;
        };
        if let ProcessPython::Python(py) = &p.python
            && py.module == module
            && py.bias == bias
        {
            return false;
        }
        let Some(py) = PyProcess::new(module, bias, &elf) else { return false };
        p.python = ProcessPython::Python(Box::new(py));
        self.news.push(News::Python { pid, elf, bias });
        stats.processes += 1;
        true
    }
}

/// When drains should follow closely until, after a process was found at `now`.
pub fn follow_until(now: MonoNs) -> MonoNs {
    MonoNs(now.0 + FOUND_FOLLOW_NS)
}
