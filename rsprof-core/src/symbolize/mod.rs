//! Names frames with blazesym. The blazesym `Symbolizer` is not `Send`, so it lives on its own
//! thread; callers hand it the distinct frame addresses and get back one or more frames per
//! address (inlined functions expand to several, outermost first). Each address is resolved
//! once: results are cached by (module, offset) or kernel address.

pub mod by_build_id;
pub(crate) mod cache;
pub mod debuginfod;
mod dwarf;
pub(crate) mod gopclntab;
pub(crate) mod pages;
pub mod recorded_names;

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{Arc, Mutex, mpsc},
    thread,
};

use anyhow::{Context as _, Result, anyhow};
use blazesym::symbolize::{
    Input, Symbolized, Symbolizer,
    evict::{self, Evict},
    source::{Elf, Kernel, Source},
};

use crate::{
    collect::modules::ModuleTable,
    model::{
        address::FrameAddr,
        ids::ModuleId,
        process::ProcessesMeta,
        stacks::{ElfAddress, Frame, FrameKind, JitLanguage},
    },
};

pub const KERNEL_MODULE: &str = "[kernel.kallsyms]";
/// The "library" of JIT frames named from perf maps.
pub const JIT_MODULE: &str = "[jit]";
/// The "library" of JIT frames named from jitdumps.
pub const JITDUMP_MODULE: &str = "[jitdump]";
/// The "library" of the root pseudo-frame of a truncated user stack.
pub const TRUNCATED_MODULE: &str = "rsprof unwind";

/// What the symbolizer thread needs to know about a module.
#[derive(Clone, Debug)]
pub struct ModuleSource {
    pub name: String,
    /// Which module its id stands for now (ids of released modules are reused).
    pub serial: u64,
    /// Readable path to the file, if any (`[vdso]`, anonymous memory have none).
    pub open_path: Option<PathBuf>,
    /// GNU build-id, lower-case hex.
    pub build_id: Option<String>,
    /// Keeps `open_path` readable when it is `/proc/self/fd/N`, even after the collector
    /// released the module.
    pub hold: Option<std::sync::Arc<std::fs::File>>,
}

/// Build-id of each module name, for writers whose mappings are keyed by name (profiles
/// name modules by file name); a name shared by files with different build-ids gets none.
pub fn module_build_ids(modules: &[ModuleSource]) -> HashMap<String, String> {
    let mut ids: HashMap<String, Option<String>> = HashMap::new();
    for m in modules {
        let Some(id) = &m.build_id else { continue };
        ids.entry(m.name.clone())
            .and_modify(|known| {
                if known.as_ref() != Some(id) {
                    *known = None;
                }
            })
            .or_insert_with(|| Some(id.clone()));
    }
    ids.into_iter().filter_map(|(name, id)| Some((name, id?))).collect()
}

pub type Symbols = HashMap<FrameAddr, Vec<Frame>>;

/// The modules of `table`, indexed by `ModuleId`. Their `open_path` stays valid while the
/// table lives: it keeps each file open for the whole run.
pub fn module_sources(table: &ModuleTable) -> Vec<ModuleSource> {
    (0..table.len())
        .map(|i| {
            let m = table.get(ModuleId(i as u32));
            ModuleSource {
                name: m.name.clone(),
                serial: table.serial(ModuleId(i as u32)),
                open_path: m.readable_path(),
                build_id: m.build_id.as_deref().map(crate::collect::buildid::hex),
                hold: m.hold(),
            }
        })
        .collect()
}

/// Names kernel addresses without reading /proc/kallsyms (see `bpf::ksym`): one symbol per
/// address, None where it has none.
pub trait KernelNames: Send {
    fn name(&mut self, addrs: &[u64]) -> Result<Vec<Option<KernelSymbol>>>;
    /// Whether an address this namer leaves unnamed stays unnamed, rather than going to
    /// /proc/kallsyms (a replay's namer: kallsyms there is another time's, or hidden).
    fn only_source(&self) -> bool {
        false
    }
}

/// The kallsyms symbol holding a kernel address: its name, and the address's offset in it and
/// its size (kallsyms's own: up to the next symbol, so every address of
/// `addr - offset .. addr - offset + size` has this name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSymbol {
    pub name: String,
    pub offset: u64,
    pub size: u64,
}

/// A recording's kernel namer: its BPF object's (the binary's `bpf::ksym`) once loaded, shared
/// by the recording's exports and the agent's symbolizer. Unset, or once it failed, kernel
/// addresses are named from /proc/kallsyms: the same names, only slower to get.
#[derive(Clone, Default)]
pub struct KernelNamer(Arc<Mutex<Option<Box<dyn KernelNames>>>>);

impl KernelNamer {
    /// Makes `names` name kernel addresses from now on.
    pub fn set(&self, names: Box<dyn KernelNames>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(names);
    }

    /// Names `addrs`, if there is a namer and it works: None otherwise; with whether the
    /// namer is the only source (`KernelNames::only_source`).
    fn name(&self, addrs: &[u64]) -> Option<(Vec<Option<KernelSymbol>>, bool)> {
        let mut namer = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let only = namer.as_ref()?.only_source();
        match namer.as_mut()?.name(addrs) {
            Ok(names) => Some((names, only)),
            Err(_) => {
                *namer = None;
                None
            }
        }
    }
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
    /// Debug files asked of debuginfod for files named from their `.dynsym` alone.
    pub debuginfod: debuginfod::Stats,
}

/// Symbolizes `addrs` on a dedicated thread. `modules` is indexed by `ModuleId`.
pub fn symbolize(
    addrs: Vec<FrameAddr>,
    modules: Vec<ModuleSource>,
    kernel: KernelNamer,
) -> Result<(Symbols, SymbolizeErrors)> {
    let (tx, rx) = mpsc::channel();
    thread::Builder::new()
        .name("symbolizer".into())
        .spawn(move || {
            let mut worker = SymbolizerThread::new(false, None, kernel);
            let errors = worker.run(&addrs, &modules);
            let _ = tx.send((worker.out, errors));
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
                elf: None,
            }],
        );
    }
}

/// Whether `a` is named from its process's metadata (`name_labels`, `name_jit`), not by the
/// symbolizer.
pub fn named_from_processes(a: &FrameAddr) -> bool {
    matches!(a, FrameAddr::Label { .. } | FrameAddr::Jit { .. } | FrameAddr::Anon { .. })
}

/// The "library" of Python frames read from the interpreter (`crate::collect::python`).
pub const PYTHON_MODULE: &str = "[python]";

/// The "library" of frames in anonymous executable memory no perf map named.
pub const ANON_MODULE: &str = "[anon]";

/// Adds a frame for every JIT address, named as its process's jitdump or perf map named it (at
/// the sample, or by a record or line read later), or `0x… (in [anon])`.
pub fn name_jit(symbols: &mut Symbols, addrs: &[FrameAddr], processes: &ProcessesMeta) {
    for &a in addrs {
        let (pid, symbol) = match a {
            FrameAddr::Jit { pid, symbol } => (pid, symbol),
            FrameAddr::Anon { pid, addr } => {
                let late = processes.get(&pid).and_then(|p| p.jit_late.get(&addr));
                match late {
                    Some(&symbol) => (pid, symbol),
                    None => {
                        symbols.insert(a, vec![unknown(FrameKind::User, addr, ANON_MODULE)]);
                        continue;
                    }
                }
            }
            _ => continue,
        };
        let named = processes.get(&pid).and_then(|p| p.jit_symbols.get(symbol.0 as usize));
        let frame = match named {
            Some(s) => Frame {
                kind: FrameKind::Jit(s.language),
                function: s.name.clone(),
                module: match (s.interpreter, s.from_dump) {
                    (true, _) => PYTHON_MODULE,
                    (false, true) => JITDUMP_MODULE,
                    (false, false) => JIT_MODULE,
                }
                .into(),
                file: s.file.clone(),
                line: s.line,
                column: None,
                inlined: false,
                elf: None,
            },
            // Its process was forgotten while the frame was stored (not expected).
            None => Frame {
                kind: FrameKind::Jit(JitLanguage::Other),
                function: format!("jit {}", symbol.0),
                module: JIT_MODULE.into(),
                file: None,
                line: None,
                column: None,
                inlined: false,
                elf: None,
            },
        };
        symbols.insert(a, vec![frame]);
    }
}

/// Bounds of what a `Service` keeps between calls. Names: 64 Ki addresses or ~16 MiB, a fourth
/// of the agent's 64 MiB RSS budget (an address takes ~260 bytes; on an idle host the agent
/// had named ~1,400 after eight minutes). Files blazesym holds parsed: 32 files or 512 MiB of
/// them (their parsed symbol tables and DWARF grow with them: 56 files, a busy build host's
/// rustc libraries among them, held 170 MiB more RSS than a symbolizer per window).
const SERVICE_CACHE_ENTRIES: usize = 64 * 1024;
const SERVICE_CACHE_BYTES: usize = 16 << 20;
const SERVICE_HELD_FILES: usize = 32;
const SERVICE_HELD_FILE_BYTES: u64 = 512 << 20;
/// Files evicted from blazesym before its `Symbolizer` is rebuilt: evicting a file leaves what
/// blazesym found through it (e.g. a `.gnu_debuglink` file), so start clean now and then.
const REBUILD_AFTER_EVICTIONS: u64 = 256;

/// A symbolizer that outlives one call. The agent symbolizes every window with it: each address
/// is named once, and the files blazesym parsed (symbol tables, DWARF) stay parsed, instead of
/// re-reading every library every window (which was most of an agent's CPU time). Both caches
/// are bounded (least recently used go first) and keyed by the file's identity
/// (`cache::FileId`), so a module whose file changed never gets another file's names.
pub struct Service {
    tx: mpsc::Sender<Request>,
    stats: Arc<Mutex<ServiceStats>>,
}

struct Request {
    addrs: Vec<FrameAddr>,
    modules: Vec<ModuleSource>,
    reply: mpsc::Sender<(Symbols, SymbolizeErrors)>,
}

/// What a `Service` did over its life.
#[derive(Clone, Copy, Debug, Default)]
pub struct ServiceStats {
    /// Addresses asked for, and how many of them were already named.
    pub asked: u64,
    pub cached: u64,
    /// Names evicted to stay within the cache's bound.
    pub evicted: u64,
    /// Addresses held named now, and their estimated heap bytes.
    pub entries: u64,
    pub bytes: u64,
    /// Files blazesym holds parsed now; evicted from it (released, changed or least recently
    /// used); times it was rebuilt from nothing.
    pub files: u64,
    pub files_evicted: u64,
    pub rebuilds: u64,
    /// Files whose DWARF was parsed for a call (each call parses afresh), and files with
    /// compressed DWARF that could not be copied uncompressed (then held parsed, as others).
    pub dwarf_reads: u64,
    pub dwarf_copy_failures: u64,
    /// Calls served, and the time they took (seconds).
    pub calls: u64,
    pub seconds: f64,
}

impl Service {
    pub fn start(kernel: KernelNamer) -> Result<Self> {
        Self::with_bounds(
            kernel,
            cache::FrameCache::new(SERVICE_CACHE_ENTRIES, SERVICE_CACHE_BYTES),
            cache::HeldFiles::new(SERVICE_HELD_FILES, SERVICE_HELD_FILE_BYTES),
            Some(PerCall::new(crate::debugfile::debug_root(), dwarf::cache_dir())),
        )
    }

    fn with_bounds(
        kernel: KernelNamer,
        mut names: cache::FrameCache,
        mut held: cache::HeldFiles,
        per_call: Option<PerCall>,
    ) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Request>();
        let stats = Arc::new(Mutex::new(ServiceStats::default()));
        let shared = Arc::clone(&stats);
        thread::Builder::new()
            .name("symbolizer".into())
            .spawn(move || {
                let mut worker = SymbolizerThread::new(true, per_call, kernel);
                let mut total = ServiceStats::default();
                let mut evicted_since_rebuild = 0;
                for req in rx {
                    let began = std::time::Instant::now();
                    let window = names.next_window();
                    let asked = req.addrs.len() as u64;
                    let (out, errors) =
                        serve(&mut worker, &mut names, &mut held, window, &req.addrs, &req.modules);
                    // Files no module reads any more leave blazesym, as do the least recently
                    // used past the bound.
                    let live: std::collections::HashSet<&std::path::Path> =
                        req.modules.iter().filter_map(|m| m.open_path.as_deref()).collect();
                    // Files read for their DWARF leave blazesym after each call: what it parsed
                    // of them would otherwise stay, growing with every new address.
                    if let Some(per_call) = worker.per_call.as_mut() {
                        per_call.read.sort_unstable();
                        per_call.read.dedup();
                        total.dwarf_reads += per_call.read.len() as u64;
                        for p in per_call.read.drain(..) {
                            let _ = worker.sym.evict(&Evict::Elf(evict::Elf::new(p)));
                        }
                        for p in per_call.modules.drain(..) {
                            held.forget(&p);
                        }
                        total.dwarf_copy_failures = per_call.copy_failures;
                    }
                    let gone = held.take_evictions(&live);
                    evicted_since_rebuild += gone.len() as u64;
                    if evicted_since_rebuild >= REBUILD_AFTER_EVICTIONS {
                        worker.sym = new_symbolizer();
                        held.clear();
                        evicted_since_rebuild = 0;
                        total.rebuilds += 1;
                    } else {
                        for p in gone {
                            let _ = worker.sym.evict(&Evict::Elf(evict::Elf::new(p)));
                        }
                    }
                    names.trim();
                    // The files stay parsed; the pages this call touched leave our RSS.
                    pages::release_file_pages();
                    total.asked += asked;
                    total.cached = names.stats.hits;
                    total.evicted = names.stats.evicted;
                    total.entries = names.len() as u64;
                    total.bytes = names.bytes() as u64;
                    total.files = held.len() as u64;
                    total.files_evicted = held.evicted;
                    total.calls += 1;
                    total.seconds += began.elapsed().as_secs_f64();
                    if let Ok(mut s) = shared.lock() {
                        *s = total;
                    }
                    let _ = req.reply.send((out, errors));
                }
            })
            .context("start symbolizer thread")?;
        Ok(Self { tx, stats })
    }

    pub fn stats(&self) -> ServiceStats {
        self.stats.lock().map(|s| *s).unwrap_or_default()
    }

    pub fn symbolize(
        &self,
        addrs: Vec<FrameAddr>,
        modules: Vec<ModuleSource>,
    ) -> Result<(Symbols, SymbolizeErrors)> {
        let (reply, rx) = mpsc::channel();
        self.tx
            .send(Request { addrs, modules, reply })
            .map_err(|_| anyhow!("symbolizer thread is gone"))?;
        rx.recv().map_err(|_| anyhow!("symbolizer thread panicked"))
    }
}

/// One call of a `Service`: names from `names` where it has them, the rest from `worker`
/// (whose blazesym `Symbolizer` keeps its parsed files), then remembered.
fn serve(
    worker: &mut SymbolizerThread,
    names: &mut cache::FrameCache,
    held: &mut cache::HeldFiles,
    window: u64,
    addrs: &[FrameAddr],
    modules: &[ModuleSource],
) -> (Symbols, SymbolizeErrors) {
    // Each used module's file as it is now: stat'ed every call, as a path may name another
    // file by now.
    let mut files: HashMap<ModuleId, Option<cache::FileId>> = HashMap::new();
    let mut file_of = |module: ModuleId| {
        *files.entry(module).or_insert_with(|| {
            let m = &modules[module.0 as usize];
            cache::FileId::of(m.open_path.as_deref()?, m.build_id.as_deref())
        })
    };
    let key = |a: FrameAddr, file_of: &mut dyn FnMut(ModuleId) -> Option<cache::FileId>| match a {
        FrameAddr::Kernel(addr) => Some(cache::Key::Kernel(addr)),
        FrameAddr::User { module, offset } => Some(cache::Key::File(file_of(module)?, offset)),
        // The others are named without reading anything.
        _ => None,
    };
    let mut out = Symbols::with_capacity(addrs.len());
    let mut missing = Vec::new();
    for &a in addrs {
        let Some(k) = key(a, &mut file_of) else {
            missing.push(a);
            continue;
        };
        match names.lookup(&k) {
            Some(mut frames) => {
                // One file may be mapped under several names (links, other mount namespaces).
                if let FrameAddr::User { module, .. } = a {
                    let name = &modules[module.0 as usize].name;
                    for f in frames.iter_mut().filter(|f| f.module != *name) {
                        f.module.clone_from(name);
                    }
                }
                out.insert(a, frames);
            }
            None => missing.push(a),
        }
    }
    // The files about to be read: one that changed at its path leaves blazesym first.
    let mut reading: Vec<ModuleId> = missing
        .iter()
        .filter_map(|a| match a {
            FrameAddr::User { module, .. } => Some(*module),
            _ => None,
        })
        .collect();
    reading.sort_unstable();
    reading.dedup();
    for &module in &reading {
        let m = &modules[module.0 as usize];
        if let (Some(p), Some(id)) = (&m.open_path, file_of(module))
            && held.use_file(p, id, window)
        {
            let _ = worker.sym.evict(&Evict::Elf(evict::Elf::new(p.clone())));
        }
    }
    let errors = worker.run(&missing, modules);
    // Names of a file that changed while it was read may be either file's: used, not kept.
    let unchanged: std::collections::HashSet<ModuleId> = reading
        .into_iter()
        .filter(|&module| {
            let m = &modules[module.0 as usize];
            let now =
                m.open_path.as_deref().and_then(|p| cache::FileId::of(p, m.build_id.as_deref()));
            now.is_some() && now == file_of(module)
        })
        .collect();
    for (a, frames) in worker.out.drain() {
        let keep = match a {
            FrameAddr::User { module, .. } => unchanged.contains(&module),
            _ => true,
        };
        match (keep, key(a, &mut file_of), worker.function_starts.get(&a)) {
            (true, Some(cache::Key::File(file, _)), Some(&(start, last))) => {
                names.insert_function(file, last, start, &frames)
            }
            (true, Some(cache::Key::Kernel(_)), Some(&(start, last))) => {
                names.insert_function(cache::FileId::KERNEL, last, start, &frames)
            }
            (true, Some(k), _) => names.insert(k, &frames),
            _ => {}
        }
        out.insert(a, frames);
    }
    (out, errors)
}

struct SymbolizerThread {
    /// For files.
    sym: Symbolizer,
    /// Whether to fill `function_starts` (for a `Service`'s cache; a one-off call has none).
    function_entries: bool,
    /// Files checked by `dynsym_only`, with their identity then.
    dynsym_only: HashMap<PathBuf, (cache::FileId, bool)>,
    /// Of the addresses in `out` named from symbol tables alone (no line, no inlined frame),
    /// where their function starts and the last address known to be in it (see
    /// `FrameCache::insert_function`): for a file, the offset asked; for the kernel, the
    /// symbol's end.
    function_starts: HashMap<FrameAddr, (u64, u64)>,
    /// Names kernel addresses through BPF when the recording has a namer.
    kernel: KernelNamer,
    /// For kernel addresses: its parsed kallsyms (a few MiB) is worth keeping, reading
    /// /proc/kallsyms again costs ~100 ms of CPU.
    ksym: Symbolizer,
    /// A `Service`'s: files with DWARF are parsed afresh each call (see `dwarf`).
    per_call: Option<PerCall>,
    /// This call's debug files from debuginfod, by build-id.
    fetched: HashMap<String, PathBuf>,
    /// `.gopclntab` of stripped Go programs, with their file's identity then (None: not Go,
    /// or a table we cannot read).
    go_tables: HashMap<PathBuf, (cache::FileId, Option<Arc<gopclntab::GoTable>>)>,
    out: Symbols,
    errors: SymbolizeErrors,
}

/// Files whose DWARF a `Service` parses per call, and what it read this call.
struct PerCall {
    debug_root: PathBuf,
    cache: PathBuf,
    /// By the module's path: its identity then, and where its DWARF is (None: it has none,
    /// or it could not be copied; blazesym holds such a file as before).
    plans: HashMap<PathBuf, (cache::FileId, Option<Arc<dwarf::DwarfSource>>)>,
    /// The files handed to blazesym this call for DWARF, to evict after it, and the modules'
    /// own paths (not held by blazesym).
    read: Vec<PathBuf>,
    modules: Vec<PathBuf>,
    /// Files with compressed DWARF that could not be copied uncompressed, and the last reason.
    copy_failures: u64,
    last_failure: Option<String>,
}

impl PerCall {
    fn new(debug_root: PathBuf, cache: PathBuf) -> Self {
        Self {
            debug_root,
            cache,
            plans: HashMap::new(),
            read: Vec::new(),
            modules: Vec::new(),
            copy_failures: 0,
            last_failure: None,
        }
    }

    /// Where the DWARF of the file at `path` is, if it has any (checked once per identity).
    fn plan(&mut self, path: &std::path::Path) -> Option<Arc<dwarf::DwarfSource>> {
        let stamp = cache::FileId::of(path, None)?;
        // A copy gone from the cache (another agent sharing it deleted it for its bound) is
        // made again.
        if let Some((s, plan)) = self.plans.get(path)
            && *s == stamp
            && plan.as_ref().is_none_or(|p| p.path.exists())
        {
            return plan.clone();
        }
        let plan = match dwarf::source(path, &self.debug_root, &self.cache) {
            Ok(p) => p.map(Arc::new),
            Err(e) => {
                self.copy_failures += 1;
                self.last_failure = Some(format!("{}: {e}", path.display()));
                None
            }
        };
        if self.plans.len() >= 4096 {
            self.plans.clear();
        }
        self.plans.insert(path.to_owned(), (stamp, plan.clone()));
        plan
    }
}

fn new_symbolizer() -> Symbolizer {
    Symbolizer::builder()
        .enable_code_info(true)
        .enable_inlined_fns(true)
        .enable_demangling(true)
        .build()
}

impl SymbolizerThread {
    fn new(function_entries: bool, per_call: Option<PerCall>, kernel: KernelNamer) -> Self {
        Self {
            kernel,
            sym: new_symbolizer(),
            function_entries,
            function_starts: HashMap::new(),
            dynsym_only: HashMap::new(),
            ksym: new_symbolizer(),
            per_call,
            fetched: HashMap::new(),
            go_tables: HashMap::new(),
            out: HashMap::new(),
            errors: Default::default(),
        }
    }

    /// Names `addrs` into `self.out`; returns what failed on the way.
    fn run(&mut self, addrs: &[FrameAddr], modules: &[ModuleSource]) -> SymbolizeErrors {
        self.function_starts.clear();
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
                // Named from the process's label texts and JIT names, see `name_labels`.
                FrameAddr::Label { .. } | FrameAddr::Jit { .. } | FrameAddr::Anon { .. } => {}
                FrameAddr::OffCpuNotCaptured => {
                    self.out.insert(a, vec![off_cpu_not_captured()]);
                }
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
                            elf: None,
                        }],
                    );
                }
            }
        }
        self.kernel(&kernel);
        self.fetch_debug_files(by_module.keys().map(|m| &modules[m.0 as usize]));
        for (module, offsets) in by_module {
            let m = &modules[module.0 as usize];
            self.user(module, m, &offsets);
        }
        std::mem::take(&mut self.errors)
    }

    fn kernel(&mut self, addrs: &[u64]) {
        if addrs.is_empty() {
            return;
        }
        let mut left = addrs.to_vec();
        if let Some((names, only)) = self.kernel.name(addrs) {
            left.clear();
            for (&addr, name) in addrs.iter().zip(names) {
                match name {
                    Some(sym) => {
                        if self.function_entries
                            && let Some(start) = addr.checked_sub(sym.offset)
                            && sym.offset < sym.size
                        {
                            let last = start + (sym.size - 1);
                            self.function_starts.insert(FrameAddr::Kernel(addr), (start, last));
                        }
                        self.out.insert(FrameAddr::Kernel(addr), vec![kernel_frame(sym.name)]);
                    }
                    None if only => {
                        let frame = unknown(FrameKind::Kernel, addr, KERNEL_MODULE);
                        self.out.insert(FrameAddr::Kernel(addr), vec![frame]);
                    }
                    // Cut short or unknown: kallsyms decides.
                    None => left.push(addr),
                }
            }
            if left.is_empty() {
                return;
            }
        }
        let addrs = &left[..];
        // kallsyms only: vmlinux DWARF costs seconds to load for line numbers we don't show.
        let src = Source::Kernel(Kernel {
            vmlinux: blazesym::MaybeDefault::None,
            debug_syms: false,
            ..Default::default()
        });
        let results = match self.ksym.symbolize(&src, Input::AbsAddr(addrs)) {
            Ok(r) => Some(r),
            Err(e) => {
                self.errors.kernel = Some(e.to_string());
                None
            }
        };
        for (i, &addr) in addrs.iter().enumerate() {
            let frames = match results.as_ref().map(|r| &r[i]) {
                Some(Symbolized::Sym(s)) => vec![kernel_frame(s.name.to_string())],
                _ => vec![unknown(FrameKind::Kernel, addr, KERNEL_MODULE)],
            };
            self.out.insert(FrameAddr::Kernel(addr), frames);
        }
    }

    /// Debug files for the `modules` named from their `.dynsym` alone, from debuginfod when
    /// it is configured (into `fetched`).
    fn fetch_debug_files<'a>(&mut self, modules: impl Iterator<Item = &'a ModuleSource>) {
        self.fetched.clear();
        let Some(config) = debuginfod::current() else { return };
        let mut ids: Vec<String> = Vec::new();
        for m in modules {
            if let (Some(p), Some(id)) = (&m.open_path, &m.build_id)
                && self.dynsym_only(p)
            {
                ids.push(id.clone());
            }
        }
        ids.sort_unstable();
        ids.dedup();
        if !ids.is_empty() {
            self.fetched = debuginfod::debug_files(&config, &ids, &mut self.errors.debuginfod);
        }
    }

    /// The `.gopclntab` of the Go program at `path`, read once per file identity; a table that
    /// cannot be read is said once, for `name`.
    fn go_table(&mut self, path: &std::path::Path, name: &str) -> Option<Arc<gopclntab::GoTable>> {
        let stamp = cache::FileId::of(path, None)?;
        if let Some((s, table)) = self.go_tables.get(path)
            && *s == stamp
        {
            return table.clone();
        }
        let table = match gopclntab::GoTable::open(path) {
            Ok(t) => t.map(Arc::new),
            Err(e) => {
                self.errors.modules.push((name.to_owned(), e));
                None
            }
        };
        if self.go_tables.len() >= 256 {
            self.go_tables.clear();
        }
        self.go_tables.insert(path.to_owned(), (stamp, table.clone()));
        table
    }

    /// Whether `path` is named from its `.dynsym` alone (see `dynsym_only`), cached per file.
    fn dynsym_only(&mut self, path: &std::path::Path) -> bool {
        let Some(stamp) = cache::FileId::of(path, None) else { return false };
        if let Some(&(s, only)) = self.dynsym_only.get(path)
            && s == stamp
        {
            return only;
        }
        let only = dynsym_only(path);
        if self.dynsym_only.len() >= 4096 {
            self.dynsym_only.clear();
        }
        self.dynsym_only.insert(path.to_owned(), (stamp, only));
        only
    }

    fn user(&mut self, module: ModuleId, m: &ModuleSource, offsets: &[u64]) {
        let fetched = m.build_id.as_ref().is_some_and(|id| self.fetched.contains_key(id));
        let by_function = self.function_entries
            && !fetched
            && m.open_path.as_deref().is_some_and(|p| self.dynsym_only(p));
        let dwarf = match (&m.open_path, self.per_call.as_mut()) {
            (Some(p), Some(per_call)) => {
                let plan = per_call.plan(p);
                // Said once: the file's plan is kept.
                if let Some(e) = per_call.last_failure.take() {
                    let why = format!("its DWARF stays held parsed (no uncompressed copy: {e})");
                    self.errors.modules.push((m.name.clone(), why));
                }
                plan
            }
            _ => None,
        };
        // A file with no DWARF of its own nor installed: the debug file debuginfod gave.
        let dwarf = dwarf.or_else(|| {
            let debug = self.fetched.get(m.build_id.as_ref()?)?;
            dwarf::with_debug_file(m.open_path.as_deref()?, debug).map(Arc::new)
        });
        // A Go program without symbols (`-ldflags=-s -w`) is named from its own table.
        let go = match &m.open_path {
            Some(p) if !fetched && self.dynsym_only(p) => self.go_table(p, &m.name),
            _ => None,
        };
        let results = match &m.open_path {
            Some(p) if let Some(src) = dwarf => {
                if let Some(per_call) = self.per_call.as_mut() {
                    per_call.read.push(src.path.clone());
                    per_call.modules.push(p.clone());
                }
                // Offsets outside the module's loadable segments name nothing.
                let at: Vec<Option<u64>> = offsets.iter().map(|&o| src.address(o)).collect();
                let asked: Vec<u64> = at.iter().flatten().copied().collect();
                let input = match src.loads {
                    Some(_) => Input::VirtOffset(&asked[..]),
                    None => Input::FileOffset(&asked[..]),
                };
                match self.sym.symbolize(&Source::Elf(Elf::new(&src.path)), input) {
                    Ok(r) => {
                        let mut r = r.into_iter();
                        Some(
                            at.iter()
                                .map(|a| match a {
                                    Some(_) => r.next().unwrap_or(Symbolized::Unknown(
                                        blazesym::symbolize::Reason::UnknownAddr,
                                    )),
                                    None => Symbolized::Unknown(
                                        blazesym::symbolize::Reason::InvalidFileOffset,
                                    ),
                                })
                                .collect::<Vec<_>>(),
                        )
                    }
                    Err(e) => {
                        self.errors.modules.push((m.name.clone(), e.to_string()));
                        if let Some(per_call) = self.per_call.as_mut() {
                            per_call.plans.remove(p);
                        }
                        None
                    }
                }
            }
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
            if let Some(frames) = go.as_ref().and_then(|g| go_frames(g, offset, &m.name)) {
                self.out.insert(FrameAddr::User { module, offset }, frames);
                continue;
            }
            let frames = match results.as_ref().map(|r| &r[i]) {
                Some(Symbolized::Sym(s)) => {
                    if by_function
                        && s.code_info.is_none()
                        && s.inlined.is_empty()
                        && s.size.is_some_and(|n| n > 0)
                        && let Some(start) = offset.checked_sub(s.offset as u64)
                    {
                        self.function_starts
                            .insert(FrameAddr::User { module, offset }, (start, offset));
                    }
                    sym_frames(s, &m.name)
                }
                _ => vec![unknown(FrameKind::User, offset, &m.name)],
            };
            self.out.insert(FrameAddr::User { module, offset }, frames);
        }
    }
}

/// The frames of a user address blazesym named, outermost first.
fn sym_frames(s: &blazesym::symbolize::Sym<'_>, module: &str) -> Vec<Frame> {
    // blazesym reports the innermost location on the symbol and, for each inlined function,
    // the call site in its caller: shift them so each frame carries the line executing in
    // that function.
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
            module: module.to_owned(),
            file: loc.as_ref().map(|c| c.to_path().display().to_string()),
            line: loc.as_ref().and_then(|c| c.line),
            column: loc.as_ref().and_then(|c| c.column.map(u32::from)),
            inlined: depth > 0,
            elf: None,
        })
        .collect()
}

/// Whether blazesym names the ELF file at `path` from its `.dynsym` alone: it has no
/// `.symtab` (blazesym falls back from it to `.dynsym` where a `.symtab` symbol starts between
/// a `.dynsym` function's start and the address), no DWARF, and no separate debug file where
/// blazesym looks for one (by build-id, or by `.gnu_debuglink` in the debug directories, in the
/// file's own directory and in the debug directories' copies of its ancestors). Only then does
/// a name hold for every address from its function's start up to one named after it. Any
/// doubt says no: names are then held per address, as before.
fn dynsym_only(path: &std::path::Path) -> bool {
    use object::Object as _;
    const DEBUG_DIRS: [&str; 2] = ["/usr/lib/debug", "/lib/debug"];
    let Ok(file) = std::fs::File::open(path) else { return false };
    // SAFETY: a read-only private mapping; a file truncated meanwhile faults only this read
    // of its headers, as it would fault the processes running it.
    let Ok(data) = (unsafe { memmap2::Mmap::map(&file) }) else { return false };
    let Ok(elf) = object::File::parse(&*data) else { return false };
    if elf.section_by_name(".symtab").is_some()
        || elf.section_by_name(".debug_info").is_some()
        || elf.section_by_name(".zdebug_info").is_some()
    {
        return false;
    }
    let Ok(links) = profiler_unwind::debug_links(&data) else { return false };
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(id) = links.build_id.as_deref().filter(|id| id.len() >= 2) {
        for dir in DEBUG_DIRS {
            candidates.push(crate::debugfile::build_id_path(std::path::Path::new(dir), id));
        }
    }
    let Ok(real) = std::fs::canonicalize(path) else { return false };
    if let Some((name, _)) = &links.gnu_debuglink {
        let Ok(name) = std::str::from_utf8(name) else { return false };
        let dir = real.parent().unwrap_or(std::path::Path::new("/"));
        candidates.extend([dir.join(name), dir.join(".debug").join(name)]);
        let relative = dir.strip_prefix("/").unwrap_or(dir);
        for root in DEBUG_DIRS {
            candidates.push(PathBuf::from(root).join(name));
            for ancestor in relative.ancestors() {
                candidates.push(PathBuf::from(root).join(ancestor).join(name));
            }
        }
    }
    // The file itself may be named by its own link; any other candidate may be a debug file.
    !candidates.iter().any(|c| c.exists() && *c != real && c != path)
}

/// The frames at file offset `offset` of a Go program, outermost first.
fn go_frames(table: &gopclntab::GoTable, offset: u64, module: &str) -> Option<Vec<Frame>> {
    let frames = table.frames(table.address(offset)?)?;
    Some(
        frames
            .into_iter()
            .map(|f| Frame {
                kind: FrameKind::User,
                function: f.function,
                module: module.to_owned(),
                file: f.file,
                line: f.line,
                column: None,
                inlined: f.inlined,
                elf: None,
            })
            .collect(),
    )
}

/// A frame that could not be named keeps its module and address.
/// Name of the frame standing for an off-CPU stack the kernel did not take.
pub const OFF_CPU_NOT_CAPTURED: &str = "[off-CPU: stack not captured]";

fn off_cpu_not_captured() -> Frame {
    Frame {
        kind: FrameKind::User,
        function: OFF_CPU_NOT_CAPTURED.into(),
        module: "rsprof-bpf".into(),
        file: None,
        line: None,
        column: None,
        inlined: false,
        elf: None,
    }
}

fn kernel_frame(function: String) -> Frame {
    Frame {
        kind: FrameKind::Kernel,
        function,
        module: KERNEL_MODULE.into(),
        file: None,
        line: None,
        column: None,
        inlined: false,
        elf: None,
    }
}

/// The file offset an unnamed frame of a module's file keeps in its name (see `unknown`).
pub fn unnamed_offset(f: &Frame) -> Option<u64> {
    if f.kind != FrameKind::User || f.file.is_some() || f.module.starts_with('[') {
        return None;
    }
    u64::from_str_radix(f.function.strip_prefix("0x")?, 16).ok()
}

/// Gives each frame left unnamed in a file with a build-id its ELF virtual address (`elf`):
/// its file offset through the file's loadable segments, read here where the file is. With
/// the build-id it names the frame from the file's debug file anywhere, later (`query`), as a
/// debug file made by `objcopy --only-keep-debug` keeps addresses but not file offsets.
pub fn keep_unnamed_addresses(symbols: &mut Symbols, modules: &[ModuleSource]) {
    let mut loads: HashMap<ModuleId, Option<dwarf::DwarfSource>> = HashMap::new();
    for (addr, frames) in symbols.iter_mut() {
        let (FrameAddr::User { module, offset }, [f]) = (addr, frames.as_mut_slice()) else {
            continue;
        };
        if unnamed_offset(f) != Some(*offset) {
            continue;
        }
        let Some(m) = modules.get(module.0 as usize) else { continue };
        let Some(build_id) = &m.build_id else { continue };
        let segments = loads
            .entry(*module)
            .or_insert_with(|| m.open_path.as_deref().and_then(|p| dwarf::with_debug_file(p, p)));
        if let Some(address) = segments.as_ref().and_then(|s| s.address(*offset)) {
            f.elf = Some(Box::new(ElfAddress { build_id: build_id.clone(), address }));
        }
    }
}

fn unknown(kind: FrameKind, addr: u64, module: &str) -> Frame {
    Frame {
        kind,
        function: format!("0x{addr:x}"),
        module: module.into(),
        file: None,
        line: None,
        column: None,
        inlined: false,
        elf: None,
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
        let out = symbolize(vec![fa, FrameAddr::Unmapped(0x1234)], sources, KernelNamer::default())
            .unwrap()
            .0;
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
        let out = symbolize(vec![fa], sources, KernelNamer::default()).unwrap().0;
        let f = &out[&fa][0];
        assert!(f.function.contains("clock_gettime"), "{f:?}");
        assert_eq!(f.module, "[vdso]");
    }

    /// A copy of a library of this process at a path of the test's own, and the file offset
    /// of `getpid` in it.
    fn libc_and_getpid() -> (PathBuf, u64) {
        let mut mods = modules::ModuleTable::default();
        let space = modules::read_address_space(Pid(std::process::id()), &mut mods).unwrap();
        // SAFETY: dlsym on the default namespace for a libc function.
        let addr = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"getpid".as_ptr()) } as u64;
        let (module, offset) = space.lookup(addr).expect("getpid mapped");
        (mods.get(module).readable_path().expect("libc readable"), offset)
    }

    fn source(path: &std::path::Path) -> ModuleSource {
        let name = "lib.so".to_owned();
        ModuleSource {
            name,
            serial: 0,
            open_path: Some(path.to_owned()),
            build_id: None,
            hold: None,
        }
    }

    fn replace_with(src: &std::path::Path, dst: &std::path::Path) {
        let tmp = dst.with_extension("new");
        std::fs::copy(src, &tmp).unwrap();
        std::fs::rename(&tmp, dst).unwrap();
    }

    fn function(out: &Symbols, a: FrameAddr) -> String {
        out[&a].iter().map(|f| f.function.as_str()).collect::<Vec<_>>().join(";")
    }

    #[test]
    fn service_never_names_a_replaced_file_from_the_old_one() {
        let (libc_path, offset) = libc_and_getpid();
        let other = ["/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6"]
            .into_iter()
            .map(std::path::PathBuf::from)
            .find(|p| p.is_file())
            .expect("no libm.so.6 to stand for another library");
        let dir = cache::tests::TempDir::new("symservice-replaced");
        let lib = dir.path().join("lib.so");
        replace_with(&libc_path, &lib);
        let service = Service::start(KernelNamer::default()).unwrap();
        let a = FrameAddr::User { module: ModuleId(0), offset };
        let first = service.symbolize(vec![a], vec![source(&lib)]).unwrap().0;
        assert!(function(&first, a).contains("getpid"), "{first:?}");
        // The same module id and serial now reads another file at the same path.
        replace_with(&other, &lib);
        let second = service.symbolize(vec![a], vec![source(&lib)]).unwrap().0;
        let fresh = symbolize(vec![a], vec![source(&other)], KernelNamer::default()).unwrap().0;
        assert_eq!(function(&second, a), function(&fresh, a));
        assert!(!function(&second, a).contains("getpid"), "{second:?}");
        let st = service.stats();
        assert_eq!((st.asked, st.cached, st.entries), (2, 0, 2), "{st:?}");
        // Unchanged, it is named from the cache.
        let third = service.symbolize(vec![a], vec![source(&lib)]).unwrap().0;
        assert_eq!(third, second);
        assert_eq!(service.stats().cached, 1);
    }

    /// Names held per function give every address the name naming it alone gives: thousands
    /// of addresses across the code of a library named from its symbol tables (libstdc++,
    /// no debug file installed: its functions, the gaps and aliases between them), asked in
    /// an order that reaches functions from their middle first, then asked again.
    #[test]
    fn service_names_from_function_entries_as_blazesym_names_each_address() {
        use object::{Object as _, ObjectSection as _};
        let path = std::path::Path::new("/usr/lib/x86_64-linux-gnu/libstdc++.so.6");
        let data = std::fs::read(path)
            .unwrap_or_else(|e| panic!("{}: {e} (Debian package libstdc++6)", path.display()));
        let file = object::File::parse(&*data).unwrap();
        let (text, _) = file.section_by_name(".text").unwrap().file_range().unwrap();
        drop(file);
        let dir = cache::tests::TempDir::new("symservice-functions");
        let lib = dir.path().join("lib.so");
        replace_with(path, &lib);
        let addrs: Vec<FrameAddr> = (text..text + 600_000)
            .step_by(37)
            .map(|offset| FrameAddr::User { module: ModuleId(0), offset })
            .collect();
        let alone = symbolize(addrs.clone(), vec![source(&lib)], KernelNamer::default()).unwrap().0;
        let service = Service::start(KernelNamer::default()).unwrap();
        // Every 7th address, from 7 starting points: later windows fill in around earlier ones.
        for phase in [3, 6, 0, 5, 1, 4, 2] {
            let ask: Vec<FrameAddr> = addrs.iter().skip(phase).step_by(7).copied().collect();
            let out = service.symbolize(ask.clone(), vec![source(&lib)]).unwrap().0;
            for a in ask {
                assert_eq!(function(&out, a), function(&alone, a), "{a:?}");
            }
        }
        // Named addresses share their function's entry; the unnamed are held one by one.
        let unnamed = addrs.iter().filter(|a| function(&alone, **a).starts_with("0x")).count();
        let named = (addrs.len() - unnamed) as u64;
        let st = service.stats();
        assert!(named > 5_000, "{named} of {} addresses named", addrs.len());
        assert!(
            st.entries < unnamed as u64 + named / 4,
            "{} entries for {named} named and {unnamed} unnamed addresses",
            st.entries,
        );
        let out = service.symbolize(addrs.clone(), vec![source(&lib)]).unwrap().0;
        for &a in &addrs {
            assert_eq!(function(&out, a), function(&alone, a), "{a:?}");
        }
        assert_eq!(service.stats().cached - st.cached, addrs.len() as u64, "all from the cache");
    }

    /// Function entries only for files named from their `.dynsym` alone: libstdc++ (no debug
    /// file installed here), but not a copy of it next to a file of its `.gnu_debuglink`
    /// name, nor this test binary (it has a `.symtab`).
    #[test]
    fn only_files_named_from_their_dynsym_alone_get_function_entries() {
        let libstdcxx = std::path::Path::new("/usr/lib/x86_64-linux-gnu/libstdc++.so.6");
        assert!(dynsym_only(libstdcxx), "{}", libstdcxx.display());
        let data = std::fs::read(libstdcxx).unwrap();
        let (link, _) = profiler_unwind::debug_links(&data).unwrap().gnu_debuglink.unwrap();
        let dir = cache::tests::TempDir::new("symservice-dynsym");
        let copy = dir.path().join("libstdc++.so.6");
        std::fs::write(&copy, &data).unwrap();
        assert!(dynsym_only(&copy));
        std::fs::write(dir.path().join(std::str::from_utf8(&link).unwrap()), b"debug").unwrap();
        assert!(!dynsym_only(&copy), "a debug file next to it");
        assert!(!dynsym_only(&std::env::current_exe().unwrap()), "this test has a .symtab");
        assert!(!dynsym_only(std::path::Path::new("/nonexistent")));
    }

    #[test]
    fn service_keeps_blazesym_within_its_file_bound() {
        let (libc_path, offset) = libc_and_getpid();
        let dir = cache::tests::TempDir::new("symservice-files");
        let paths: Vec<PathBuf> = (0..3).map(|i| dir.path().join(format!("lib{i}.so"))).collect();
        for p in &paths {
            replace_with(&libc_path, p);
        }
        let service = Service::with_bounds(
            KernelNamer::default(),
            cache::FrameCache::new(2, usize::MAX),
            cache::HeldFiles::new(1, u64::MAX),
            // libc may have a debug file (libc6-dbg): this test is about the files held.
            None,
        )
        .unwrap();
        let modules: Vec<ModuleSource> = paths.iter().map(|p| source(p)).collect();
        for round in 0..3u64 {
            for i in 0..3u32 {
                let a = FrameAddr::User { module: ModuleId(i), offset: offset + round };
                let out = service.symbolize(vec![a], modules.clone()).unwrap().0;
                assert!(function(&out, a).contains("getpid"), "{out:?}");
                let st = service.stats();
                assert!(st.files <= 1 && st.entries <= 2, "{st:?}");
            }
        }
        let st = service.stats();
        assert_eq!(st.files_evicted, 8, "{st:?}");
        assert_eq!(st.evicted + st.entries, 9, "{st:?}");
    }

    /// A program whose DWARF is in a zlib-compressed debug file (as Debian ships them): the
    /// service names it with file and line from an uncompressed copy, parses it for each call
    /// without holding it, and names what it named before from its cache.
    #[test]
    fn service_parses_dwarf_per_call_from_an_uncompressed_copy() {
        use object::{Object as _, ObjectSegment as _, ObjectSymbol as _};
        let dir = cache::tests::TempDir::new("symservice-dwarf");
        let dwarf::tests::Split { src, exe, stripped, root } = dwarf::tests::split_program(
            dir.path(),
            "int g(int x) { return x + 1; }\n__attribute__((noinline)) int scale(int x) {\n  return g(x) * 3;\n}\nint main(int c, char **v) { return scale(c); }\n",
        );
        let data = std::fs::read(&exe).unwrap();
        let elf = object::File::parse(&*data).unwrap();
        // The file offset of scale's first byte.
        let vaddr = elf.symbols().find(|s| s.name() == Ok("scale")).unwrap().address();
        let seg = elf.segments().find(|s| (s.address()..s.address() + s.size()).contains(&vaddr));
        let seg = seg.unwrap();
        let offset = vaddr - seg.address() + seg.file_range().0;

        let cache_dir = dir.path().join("cache");
        let service = Service::with_bounds(
            KernelNamer::default(),
            cache::FrameCache::new(1024, usize::MAX),
            cache::HeldFiles::new(8, u64::MAX),
            Some(PerCall::new(root.clone(), cache_dir.clone())),
        )
        .unwrap();
        let modules = vec![source(&stripped)];
        let a = FrameAddr::User { module: ModuleId(0), offset };
        let b = FrameAddr::User { module: ModuleId(0), offset: offset + 1 };
        let (first, errors) = service.symbolize(vec![a], modules.clone()).unwrap();
        assert!(errors.modules.is_empty(), "{errors:?}");
        let leaf = first[&a].last().unwrap();
        assert_eq!(leaf.function, "scale", "{first:?}");
        assert_eq!(leaf.file.as_deref(), Some(src.to_str().unwrap()), "{first:?}");
        assert!(matches!(leaf.line, Some(2..=4)), "{first:?}");
        // The one-off symbolizer, reading the unstripped program itself, agrees.
        let direct = symbolize(vec![a], vec![source(&exe)], KernelNamer::default()).unwrap().0;
        assert_eq!(first[&a], direct[&a]);
        let st = service.stats();
        assert_eq!((st.dwarf_reads, st.files, st.dwarf_copy_failures), (1, 0, 0), "{st:?}");
        assert_eq!(std::fs::read_dir(&cache_dir).unwrap().count(), 1, "one uncompressed copy");

        // A new address parses again; the known one comes from the cache.
        let (second, _) = service.symbolize(vec![a, b], modules).unwrap();
        assert_eq!(second[&a], first[&a]);
        assert_eq!(second[&b].last().unwrap().function, "scale");
        let st = service.stats();
        assert_eq!((st.dwarf_reads, st.files, st.cached), (2, 0, 1), "{st:?}");

        // A copy deleted from the shared cache (another agent's bound) is made again.
        std::fs::remove_dir_all(&cache_dir).unwrap();
        let c = FrameAddr::User { module: ModuleId(0), offset: offset + 2 };
        let (third, errors) = service.symbolize(vec![c], vec![source(&stripped)]).unwrap();
        assert!(errors.modules.is_empty(), "{errors:?}");
        assert!(matches!(third[&c].last().unwrap().line, Some(2..=4)), "{third:?}");
        assert_eq!(std::fs::read_dir(&cache_dir).unwrap().count(), 1, "copy made again");
    }
}
