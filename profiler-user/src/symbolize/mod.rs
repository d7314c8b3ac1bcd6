//! Names frames with blazesym. The blazesym `Symbolizer` is not `Send`, so it lives on its own
//! thread; callers hand it the distinct frame addresses and get back one or more frames per
//! address (inlined functions expand to several, outermost first). Each address is resolved
//! once: results are cached by (module, offset) or kernel address.

use std::{collections::HashMap, path::PathBuf, sync::mpsc, thread};

use anyhow::{Context as _, Result, anyhow};
use blazesym::symbolize::{
    Input, Symbolized, Symbolizer,
    source::{Elf, Kernel, Source},
};

use crate::{
    collect::modules::ModuleTable,
    model::{
        address::FrameAddr,
        ids::ModuleId,
        process::ProcessesMeta,
        stacks::{Frame, FrameKind},
    },
};

pub const KERNEL_MODULE: &str = "[kernel.kallsyms]";
/// The "library" of the root pseudo-frame of a truncated user stack.
pub const TRUNCATED_MODULE: &str = "rsprof unwind";

/// What the symbolizer thread needs to know about a module.
#[derive(Clone, Debug)]
pub struct ModuleSource {
    pub name: String,
    /// Readable path to the file, if any (`[vdso]`, anonymous memory have none).
    pub open_path: Option<PathBuf>,
}

pub type Symbols = HashMap<FrameAddr, Vec<Frame>>;

/// The modules of `table`, indexed by `ModuleId`. Their `open_path` stays valid while the
/// table lives: it keeps each file open for the whole run.
pub fn module_sources(table: &ModuleTable) -> Vec<ModuleSource> {
    (0..table.len())
        .map(|i| {
            let m = table.get(ModuleId(i as u32));
            ModuleSource { name: m.name.clone(), open_path: m.readable_path() }
        })
        .collect()
}

/// What symbolizing could not do: the frames stay as addresses, and the summary says why.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SymbolizeErrors {
    /// Files blazesym failed on, with its error (each once).
    pub modules: Vec<(String, String)>,
    /// Kernel addresses left unnamed because kallsyms could not be read.
    pub kernel: Option<String>,
    /// Frames of files that could not be opened at all (deleted before we held them).
    pub unreadable_frames: u64,
}

/// Symbolizes `addrs` on a dedicated thread. `modules` is indexed by `ModuleId`.
pub fn symbolize(
    addrs: Vec<FrameAddr>,
    modules: Vec<ModuleSource>,
) -> Result<(Symbols, SymbolizeErrors)> {
    let (tx, rx) = mpsc::channel();
    thread::Builder::new()
        .name("symbolizer".into())
        .spawn(move || {
            let _ = tx.send(SymbolizerThread::new().run(&addrs, &modules));
        })
        .context("start symbolizer thread")?;
    rx.recv().map_err(|_| anyhow!("symbolizer thread panicked"))
}

/// The "library" of label frames. Their location is then `text (in rsprof label)`, which the
/// front-end reads as a native function whatever the text: a bare `shard:3` would be taken
/// for a JavaScript location.
pub const LABEL_MODULE: &str = "rsprof label";

/// Adds a frame for every label address, named by the text its process sent with its first
/// `rsprof:label_push`.
pub fn name_labels(symbols: &mut Symbols, addrs: &[FrameAddr], processes: &ProcessesMeta) {
    for &a in addrs {
        let FrameAddr::Label { pid, label } = a else { continue };
        let text = processes.get(&pid).and_then(|p| p.labels.get(&label));
        let function = match text {
            Some(t) => t.clone(),
            // The naming hit was lost (ring buffer full) and no later push resent it.
            None => format!("label {:#x}", label.0),
        };
        symbols.insert(
            a,
            vec![Frame {
                kind: FrameKind::Label,
                function,
                module: LABEL_MODULE.into(),
                file: None,
                line: None,
                column: None,
                inlined: false,
            }],
        );
    }
}

struct SymbolizerThread {
    sym: Symbolizer,
    out: Symbols,
    errors: SymbolizeErrors,
}

impl SymbolizerThread {
    fn new() -> Self {
        let sym = Symbolizer::builder()
            .enable_code_info(true)
            .enable_inlined_fns(true)
            .enable_demangling(true)
            .build();
        Self { sym, out: HashMap::new(), errors: SymbolizeErrors::default() }
    }

    fn run(mut self, addrs: &[FrameAddr], modules: &[ModuleSource]) -> (Symbols, SymbolizeErrors) {
        let mut kernel = Vec::new();
        let mut by_module: HashMap<ModuleId, Vec<u64>> = HashMap::new();
        for &a in addrs {
            match a {
                FrameAddr::Kernel(addr) => kernel.push(addr),
                FrameAddr::User { module, offset } => {
                    by_module.entry(module).or_default().push(offset)
                }
                FrameAddr::Unmapped(addr) => {
                    self.out.insert(a, vec![unknown(FrameKind::User, addr, "[unknown]")]);
                }
                // Named from the process's label texts, see `name_labels`.
                FrameAddr::Label { .. } => {}
                FrameAddr::Truncated { end, module } => {
                    let name = module.map(|m| modules[m.0 as usize].name.as_str());
                    self.out.insert(
                        a,
                        vec![Frame {
                            kind: FrameKind::Truncated,
                            function: end.describe(name),
                            module: TRUNCATED_MODULE.into(),
                            file: None,
                            line: None,
                            column: None,
                            inlined: false,
                        }],
                    );
                }
            }
        }
        self.kernel(&kernel);
        for (module, offsets) in by_module {
            let m = &modules[module.0 as usize];
            self.user(module, m, &offsets);
        }
        (self.out, self.errors)
    }

    fn kernel(&mut self, addrs: &[u64]) {
        if addrs.is_empty() {
            return;
        }
        // kallsyms only: vmlinux DWARF costs seconds to load for line numbers we don't show.
        let src = Source::Kernel(Kernel {
            vmlinux: blazesym::MaybeDefault::None,
            debug_syms: false,
            ..Default::default()
        });
        let results = match self.sym.symbolize(&src, Input::AbsAddr(addrs)) {
            Ok(r) => Some(r),
            Err(e) => {
                self.errors.kernel = Some(e.to_string());
                None
            }
        };
        for (i, &addr) in addrs.iter().enumerate() {
            let frames = match results.as_ref().map(|r| &r[i]) {
                Some(Symbolized::Sym(s)) => vec![Frame {
                    kind: FrameKind::Kernel,
                    function: s.name.to_string(),
                    module: KERNEL_MODULE.into(),
                    file: None,
                    line: None,
                    column: None,
                    inlined: false,
                }],
                _ => vec![unknown(FrameKind::Kernel, addr, KERNEL_MODULE)],
            };
            self.out.insert(FrameAddr::Kernel(addr), frames);
        }
    }

    fn user(&mut self, module: ModuleId, m: &ModuleSource, offsets: &[u64]) {
        let results = match &m.open_path {
            Some(p) => {
                match self.sym.symbolize(&Source::Elf(Elf::new(p)), Input::FileOffset(offsets)) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        self.errors.modules.push((m.name.clone(), e.to_string()));
                        None
                    }
                }
            }
            // Anonymous memory (JIT code) has no file to read; only count real files.
            None => {
                if !m.name.starts_with('[') {
                    self.errors.unreadable_frames += offsets.len() as u64;
                }
                None
            }
        };
        for (i, &offset) in offsets.iter().enumerate() {
            let frames = match results.as_ref().map(|r| &r[i]) {
                Some(Symbolized::Sym(s)) => {
                    // blazesym reports the innermost location on the symbol and, for each
                    // inlined function, the call site in its caller: shift them so each frame
                    // carries the line executing in that function.
                    let mut names: Vec<String> = vec![s.name.to_string()];
                    names.extend(s.inlined.iter().map(|f| f.name.to_string()));
                    let mut locs: Vec<_> = s.inlined.iter().map(|f| f.code_info.clone()).collect();
                    locs.push(s.code_info.as_deref().cloned());
                    names
                        .into_iter()
                        .zip(locs)
                        .enumerate()
                        .map(|(depth, (name, loc))| Frame {
                            kind: FrameKind::User,
                            function: name,
                            module: m.name.clone(),
                            file: loc.as_ref().map(|c| c.to_path().display().to_string()),
                            line: loc.as_ref().and_then(|c| c.line),
                            column: loc.as_ref().and_then(|c| c.column.map(u32::from)),
                            inlined: depth > 0,
                        })
                        .collect()
                }
                _ => vec![unknown(FrameKind::User, offset, &m.name)],
            };
            self.out.insert(FrameAddr::User { module, offset }, frames);
        }
    }
}

/// A frame that could not be named keeps its module and address.
fn unknown(kind: FrameKind, addr: u64, module: &str) -> Frame {
    Frame {
        kind,
        function: format!("0x{addr:x}"),
        module: module.into(),
        file: None,
        line: None,
        column: None,
        inlined: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{collect::modules, model::ids::Pid};

    #[inline(never)]
    fn marker_function_for_symbolizer_test() -> u64 {
        std::hint::black_box(7)
    }

    #[test]
    fn names_own_function_through_module_and_offset() {
        let mut mods = modules::ModuleTable::default();
        let space = modules::read_address_space(Pid(std::process::id()), &mut mods).unwrap();
        let addr = marker_function_for_symbolizer_test as *const () as usize as u64;
        assert_eq!(marker_function_for_symbolizer_test(), 7);
        let (module, offset) = space.lookup(addr).unwrap();
        let sources = module_sources(&mods);
        let fa = FrameAddr::User { module, offset };
        let out = symbolize(vec![fa, FrameAddr::Unmapped(0x1234)], sources).unwrap().0;
        let f = out[&fa].last().unwrap();
        assert!(f.function.contains("marker_function_for_symbolizer_test"), "{f:?}");
        assert_eq!(out[&FrameAddr::Unmapped(0x1234)][0].function, "0x1234");
    }

    #[test]
    fn names_vdso_functions() {
        // clock_gettime's vDSO entry, found through libc's own lookup of the symbol.
        let name = c"__vdso_clock_gettime";
        let mut mods = modules::ModuleTable::default();
        let space = modules::read_address_space(Pid(std::process::id()), &mut mods).unwrap();
        // SAFETY: plain libc calls; the handle of the already loaded vDSO is not closed.
        let addr = unsafe {
            let h = libc::dlopen(c"linux-vdso.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
            assert!(!h.is_null(), "vDSO not loaded");
            libc::dlsym(h, name.as_ptr()) as u64
        };
        assert_ne!(addr, 0);
        let (module, offset) = space.lookup(addr).expect("vDSO mapped");
        assert_eq!(mods.get(module).name, "[vdso]");
        let sources = module_sources(&mods);
        let fa = FrameAddr::User { module, offset: offset + 4 };
        let out = symbolize(vec![fa], sources).unwrap().0;
        let f = &out[&fa][0];
        assert!(f.function.contains("clock_gettime"), "{f:?}");
        assert_eq!(f.module, "[vdso]");
    }

    #[test]
    fn names_kernel_addresses() {
        let kallsyms = std::fs::read_to_string("/proc/kallsyms").unwrap();
        let line = kallsyms.lines().find(|l| l.ends_with(" do_sys_openat2")).unwrap();
        let addr = u64::from_str_radix(line.split(' ').next().unwrap(), 16).unwrap();
        assert_ne!(addr, 0, "kallsyms addresses are hidden: run as root");
        let out = symbolize(vec![FrameAddr::Kernel(addr + 4)], vec![]).unwrap().0;
        assert_eq!(out[&FrameAddr::Kernel(addr + 4)][0].function, "do_sys_openat2");
    }
}
