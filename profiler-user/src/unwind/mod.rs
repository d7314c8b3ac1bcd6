//! Unwind tables for the BPF stack walker (profiler-ebpf's stack.rs): each mapped file's CFI
//! compiled once per file identity (`profiler-unwind`) into the one `UNWIND_ROWS` array, and
//! each profiled process's executable mappings (runtime range, load bias, rows of its file)
//! written to `UNWIND_PROCS` whenever the collector says its mappings changed. Rows are never
//! freed during a recording: a file unmapped everywhere keeps its rows for when it comes back
//! (a full array is counted, and frames in files not loaded end their walk as "no table").

pub mod copied;

use std::{
    collections::HashMap,
    fmt::Write as _,
    os::unix::fs::MetadataExt as _,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use profiler_common::{
    UNWIND_MAPPING_ANON, UNWIND_MAPPING_NO_CFI, UNWIND_MAPPING_NOT_LOADED, UNWIND_MAX_MAPPINGS,
    UnwindMapping, UnwindProcess, UnwindRow,
};
use profiler_unwind::UnwindTable;

use crate::{
    collect::{
        collector::Collector,
        modules::{ElfLayout, ModuleTable},
    },
    model::ids::{ModuleId, Pid},
    store::SampleSink,
};

/// The walker's binary search does at most 24 halvings.
const MAX_TABLE_ROWS: usize = 1 << 24;

/// A file as the kernel sees it: (device, inode, mtime ns, size). A file replaced in place
/// keeps its inode but not its mtime.
type FileIdentity = (u64, u64, i64, u64);

/// What became of a file's table.
#[derive(Clone, Copy, Debug)]
enum FileTable {
    Loaded {
        first: u32,
        count: u32,
    },
    /// No CFI, not x86-64 ELF, or CFI that failed to compile.
    NoCfi,
    /// The rows array had no room.
    Full,
}

/// What loading did, for the summary.
#[derive(Clone, Debug, Default)]
pub struct UnwindStats {
    pub tables_loaded: u64,
    pub rows_loaded: u64,
    pub rows_capacity: u64,
    /// Files without usable CFI, and the errors of the first few.
    pub files_without_cfi: u64,
    pub cfi_errors: Vec<(String, String)>,
    /// Files whose table did not fit in the rows array.
    pub tables_not_loaded_full: u64,
    /// Files that could not be read (their mappings have no table).
    pub files_unreadable: u64,
    pub compile_time: Duration,
    /// Time writing rows into the kernel map (one update per row).
    pub load_time: Duration,
    /// Writes of a process's mapping table, and processes removed (exit or exec).
    pub process_updates: u64,
    pub processes_removed: u64,
    /// Mappings beyond `UNWIND_MAX_MAPPINGS` in one process (their frames end the walk).
    pub mappings_over_limit: u64,
    /// Process table writes the kernel refused (map full).
    pub process_update_errors: u64,
}

pub struct UnwindLoader {
    rows: Array<MapData, UnwindRow>,
    procs: BpfHashMap<MapData, u32, UnwindProcess>,
    next_row: u32,
    capacity: u32,
    by_identity: HashMap<FileIdentity, FileTable>,
    by_module: HashMap<ModuleId, Option<(FileTable, Option<ElfLayout>)>>,
    loaded_pids: std::collections::HashSet<Pid>,
    scratch: Box<UnwindProcess>,
    pub stats: UnwindStats,
}

impl UnwindLoader {
    pub fn new(
        rows: Array<MapData, UnwindRow>,
        procs: BpfHashMap<MapData, u32, UnwindProcess>,
    ) -> Self {
        let capacity = rows.len();
        Self {
            rows,
            procs,
            next_row: 0,
            capacity,
            by_identity: HashMap::new(),
            by_module: HashMap::new(),
            loaded_pids: Default::default(),
            scratch: Box::new(UnwindProcess {
                count: 0,
                _pad: 0,
                mappings: [UnwindMapping::default(); UNWIND_MAX_MAPPINGS],
            }),
            stats: UnwindStats { rows_capacity: u64::from(capacity), ..Default::default() },
        }
    }

    /// After each drain (before the USDT session takes the mailboxes): rewrites the mapping
    /// table of every process whose mappings changed, loading the tables of files it maps for
    /// the first time, and forgets processes that exited.
    pub fn after_drain<S: SampleSink>(&mut self, collector: &mut Collector<S>) {
        let changed = collector.outbox.take_maps_changed();
        for pid in changed {
            self.sync(collector, pid);
        }
        let exited: Vec<Pid> = collector.outbox.pending_process_exits().to_vec();
        for pid in exited {
            self.remove(pid);
        }
    }

    /// Writes `pid`'s executable mappings to the kernel.
    pub fn sync<S: SampleSink>(&mut self, collector: &mut Collector<S>, pid: Pid) {
        let Some(p) = collector.processes.processes.get(&pid) else { return };
        if p.exited {
            self.remove(pid);
            return;
        }
        let mappings = p.space.mappings().to_vec();
        let mut n = 0usize;
        for m in &mappings {
            if n == UNWIND_MAX_MAPPINGS {
                self.stats.mappings_over_limit += 1;
                continue;
            }
            let entry = self.entry(&collector.modules, m.module, m.start, m.end, m.file_offset);
            self.scratch.mappings[n] = entry;
            n += 1;
        }
        self.scratch.count = n as u32;
        self.stats.process_updates += 1;
        if self.procs.insert(pid.0, self.scratch.as_ref(), 0).is_err() {
            self.stats.process_update_errors += 1;
        } else {
            self.loaded_pids.insert(pid);
        }
    }

    pub fn remove(&mut self, pid: Pid) {
        if self.loaded_pids.remove(&pid) {
            let _ = self.procs.remove(&pid.0);
            self.stats.processes_removed += 1;
        }
    }

    /// The walker's view of one mapping of `module` at `start..end` (file offset `offset`).
    fn entry(
        &mut self,
        modules: &ModuleTable,
        module: ModuleId,
        start: u64,
        end: u64,
        offset: u64,
    ) -> UnwindMapping {
        let mut e = UnwindMapping { start, end, module: module.0, ..Default::default() };
        let m = modules.get(module);
        if m.path == "[anon]" {
            e.flags = UNWIND_MAPPING_ANON | UNWIND_MAPPING_NO_CFI;
            return e;
        }
        // Kernel pseudo mappings other than the vDSO (`[vsyscall]`): no file, no CFI.
        if m.path.starts_with('[') && m.path != "[vdso]" {
            e.flags = UNWIND_MAPPING_NO_CFI;
            return e;
        }
        let Some((table, layout)) = self.module_table(modules, module) else {
            e.flags = UNWIND_MAPPING_NO_CFI;
            return e;
        };
        match table {
            FileTable::Loaded { first, count } => {
                // The executable segment holding this mapping's file offset gives the bias.
                // The kernel maps from the page holding p_offset, which lld does not align
                // (Rust's default linker: p_offset 0x17130 mapped from offset 0x17000).
                let seg = layout.as_ref().and_then(|l| {
                    l.code
                        .iter()
                        .find(|&&(_, memsz, off)| off & !0xfff <= offset && offset < off + memsz)
                });
                match seg {
                    Some(&(vaddr, _, off)) => {
                        e.bias = start.wrapping_sub(vaddr.wrapping_add(offset).wrapping_sub(off));
                        e.first = first;
                        e.count = count;
                    }
                    None => e.flags = UNWIND_MAPPING_NO_CFI,
                }
            }
            FileTable::NoCfi => e.flags = UNWIND_MAPPING_NO_CFI,
            FileTable::Full => e.flags = UNWIND_MAPPING_NOT_LOADED,
        }
        e
    }

    /// The table of a module's file, compiled and loaded the first time any process maps it.
    fn module_table(
        &mut self,
        modules: &ModuleTable,
        module: ModuleId,
    ) -> Option<(FileTable, Option<ElfLayout>)> {
        if let Some(known) = self.by_module.get(&module) {
            return known.clone();
        }
        let found = self.load_module(modules, module);
        self.by_module.insert(module, found.clone());
        found
    }

    fn load_module(
        &mut self,
        modules: &ModuleTable,
        module: ModuleId,
    ) -> Option<(FileTable, Option<ElfLayout>)> {
        let m = modules.get(module);
        let Some(path) = m.readable_path() else {
            self.stats.files_unreadable += 1;
            return None;
        };
        let Ok(meta) = std::fs::metadata(&path) else {
            self.stats.files_unreadable += 1;
            return None;
        };
        let identity =
            (meta.dev(), meta.ino(), meta.mtime_nsec() + meta.mtime() * 1_000_000_000, meta.len());
        let layout = ElfLayout::read(&path);
        if let Some(&t) = self.by_identity.get(&identity) {
            return Some((t, layout));
        }
        let t = self.compile_and_load(&path, &m.path);
        self.by_identity.insert(identity, t);
        Some((t, layout))
    }

    fn compile_and_load(&mut self, path: &Path, name: &str) -> FileTable {
        let started = Instant::now();
        let compiled = std::fs::read(path)
            .map_err(|e| e.to_string())
            .and_then(|data| UnwindTable::from_elf(&data).map_err(|e| e.to_string()));
        self.stats.compile_time += started.elapsed();
        let table = match compiled {
            Ok(t) if !t.rows().is_empty() && t.rows().len() < MAX_TABLE_ROWS => t,
            Ok(_) => {
                self.no_cfi(name, "no rows (or more than 2^24)".into());
                return FileTable::NoCfi;
            }
            Err(e) => {
                self.no_cfi(name, e);
                return FileTable::NoCfi;
            }
        };
        let rows = table.rows();
        let count = rows.len() as u32;
        if u64::from(self.next_row) + u64::from(count) > u64::from(self.capacity) {
            self.stats.tables_not_loaded_full += 1;
            return FileTable::Full;
        }
        let first = self.next_row;
        let started = Instant::now();
        for (i, row) in rows.iter().enumerate() {
            if self.rows.set(first + i as u32, *row, 0).is_err() {
                self.stats.tables_not_loaded_full += 1;
                return FileTable::Full;
            }
        }
        self.stats.load_time += started.elapsed();
        self.next_row += count;
        self.stats.tables_loaded += 1;
        self.stats.rows_loaded += u64::from(count);
        FileTable::Loaded { first, count }
    }

    fn no_cfi(&mut self, name: &str, err: String) {
        self.stats.files_without_cfi += 1;
        if self.stats.cfi_errors.len() < 8 {
            self.stats.cfi_errors.push((name.to_owned(), err));
        }
    }

    /// The summary block.
    pub fn render(&self) -> String {
        let s = &self.stats;
        let mut out = String::new();
        let row = std::mem::size_of::<UnwindRow>() as u64;
        let _ = writeln!(
            out,
            "unwind tables: {} files loaded, {} rows ({:.1} MiB of {:.1} MiB); {} files without \
             CFI, {} not loaded (table full), {} unreadable; compiled in {:.0} ms, loaded in {:.0} \
             ms",
            s.tables_loaded,
            s.rows_loaded,
            (s.rows_loaded * row) as f64 / 1048576.0,
            (s.rows_capacity * row) as f64 / 1048576.0,
            s.files_without_cfi,
            s.tables_not_loaded_full,
            s.files_unreadable,
            s.compile_time.as_secs_f64() * 1e3,
            s.load_time.as_secs_f64() * 1e3
        );
        let _ = writeln!(
            out,
            "  process tables: {} writes ({} refused), {} removed, {} mappings over the {} limit",
            s.process_updates,
            s.process_update_errors,
            s.processes_removed,
            s.mappings_over_limit,
            UNWIND_MAX_MAPPINGS
        );
        for (name, err) in &s.cfi_errors {
            let _ = writeln!(out, "  no CFI: {name}: {err}");
        }
        out
    }
}

/// Takes the walker's maps from the loaded object.
pub fn maps(bpf: &mut crate::bpf::object::BpfObject) -> Result<UnwindLoader> {
    let (rows, procs) = bpf.take_unwind_maps().context("unwind maps")?;
    Ok(UnwindLoader::new(rows, procs))
}
