//! Walks the kernel could not finish for want of a table (a process that just exec'd, a
//! library just mapped, a file whose table is not loaded yet) arrive with a copy of the user
//! stack from where they stopped (`SAMPLE_STACK_COPY`). By the time the collector handles such
//! a sample, the mapping records before it in the ring have been applied, so the process's
//! address space is current: the walk continues here over the copy, with the same tables
//! (compiled from the same files by `profiler-unwind`) and the same rules
//! (`profiler_unwind::walk`). The sample's end reason becomes the one this walk reached.

use std::{
    collections::HashMap,
    fmt::Write as _,
    sync::Arc,
    time::{Duration, Instant},
};

use profiler_common::{
    MAX_STACK_DEPTH, SAMPLE_UNWIND_MASK, SAMPLE_UNWIND_SHIFT, SAMPLE_UNWIND_USED_FP,
    STACK_COPY_BP_KNOWN, STACK_COPY_PC_IS_RETURN, UNWIND_END_COMPLETE, UNWIND_END_COUNT,
    UNWIND_END_NO_MAPPING, UNWIND_END_NO_PROCESS, UNWIND_END_NO_TABLE, counter,
};
use profiler_unwind::{
    UnwindTable,
    walk::{self, Regs, Rule, StackCopy},
};

use crate::{
    collect::modules::FileIdentity,
    collect::modules::{AddressSpace, ElfLayout, ModuleTable},
    counters::Counters,
    decode::Sample,
    model::ids::ModuleId,
};

/// Rows kept compiled for this (8 bytes each: 16 MiB); past it the cache starts afresh. Only
/// files up to `COMPILE_WHILE_DRAINING_MAX_BYTES` are compiled here, so this holds many.
const MAX_CACHED_ROWS: usize = 2 << 20;
/// Tables compiled here serve processes whose kernel tables have not landed yet, so each is
/// needed for a short while. Before compiling another file, a cache older than this starts
/// afresh. Otherwise an agent's heap would keep, up to `MAX_CACHED_ROWS`, the table of every
/// file that some short-lived program once needed. A file still in use costs one compile a
/// minute.
const CACHE_LIFETIME: Duration = Duration::from_secs(60);

/// Files larger than this are not compiled here: compiling runs on the event loop, and a
/// 100 MB compiler library takes seconds (more on a busy machine), during which the ring
/// buffer fills and samples are lost. Each of their frames is looked up alone instead
/// (`profiler_unwind::rule_at`: the FDE found through `.eh_frame_hdr`, in the mapped file),
/// while the kernel's table for them is built by the worker threads. The unwind loader's
/// urgent lane uses the same bound: what is small enough to compile while samples wait.
pub const COMPILE_WHILE_DRAINING_MAX_BYTES: u64 = 16 << 20;
/// Rules looked up one address at a time kept (16 bytes each); past it they start afresh.
const MAX_LOOKED_UP: usize = 1 << 16;

/// `UNWIND_END_*` as the summary names them.
const END_NAMES: [&str; UNWIND_END_COUNT as usize] = [
    "not walked",
    "complete",
    "depth limit",
    "process not loaded",
    "no mapping",
    "no table",
    "no CFI",
    "unsupported rule",
    "read fault",
    "frame pointers ended",
];

/// A module's file as the walk needs it.
#[derive(Clone)]
enum FileRules {
    /// Compiled table (None: no usable CFI) and the executable segments for file offset →
    /// table address.
    Table(Option<Arc<UnwindTable>>, ElfLayout),
    /// The file cannot be read now: its frames end the walk as "no table".
    Unreadable,
    /// Too large to compile while draining: each frame's rule is looked up alone in the
    /// mapped file (its identity keys those already looked up).
    LookedUp(Arc<memmap2::Mmap>, ElfLayout, FileIdentity),
}

/// The table address (file-relative virtual address) of file offset `offset`: the executable
/// segment holding it maps one to the other.
fn table_address(layout: &ElfLayout, offset: u64) -> Option<u64> {
    let &(vaddr, _, off) =
        layout.code.iter().find(|&&(_, memsz, off)| off <= offset && offset < off + memsz)?;
    Some(vaddr + (offset - off))
}

/// What continuing walks over stack copies did, for the summary.
#[derive(Clone, Debug, Default)]
pub struct CopyStats {
    /// Samples that arrived with a copy, and the stack bytes they carried.
    pub copies: u64,
    pub bytes: u64,
    /// Walks that reached the outermost frame here.
    pub completed: u64,
    /// Walks still not complete, by `UNWIND_END_*`.
    pub truncated: [u64; UNWIND_END_COUNT as usize],
    /// Of those, walks that needed stack beyond the copy.
    pub beyond_copy: u64,
    /// Copies whose stopped frame was not the sample's last user frame (not continued).
    pub mismatched: u64,
    pub files_compiled: u64,
    pub compile_time: Duration,
    /// Times the compiled-table cache was emptied for being over its size, and for being
    /// older than `CACHE_LIFETIME`.
    pub cache_resets: u64,
    pub cache_expiries: u64,
    /// Frames looked up alone in files too large to compile while draining, the time that
    /// took, and how many such files.
    pub looked_up: u64,
    pub lookup_time: Duration,
    pub large_files: u64,
}

#[derive(Default)]
pub struct CopiedStacks {
    /// Follow frame pointers through code without a table (`--unwind dwarf-fp`).
    pub fp_fallback: bool,
    tables: HashMap<FileIdentity, Option<Arc<UnwindTable>>>,
    /// Per module slot (with its creation serial, as slots are reused for other files).
    by_module: HashMap<(ModuleId, u64), FileRules>,
    cached_rows: usize,
    /// Rules looked up alone (`FileRules::LookedUp`), by file and table address.
    looked_up: HashMap<(FileIdentity, u64), Option<profiler_common::UnwindRow>>,
    /// When the first table now cached was compiled.
    cached_since: Option<Instant>,
    pub stats: CopyStats,
}

impl CopiedStacks {
    /// Continues the walk of `s` over its stack copy, if it has one: its user stack becomes the
    /// frames walked in the kernel plus those found here, its end reason the one reached here.
    pub fn complete(&mut self, s: &mut Sample, space: &AddressSpace, modules: &ModuleTable) {
        let Some(copy) = s.stack_copy.take() else { return };
        self.stats.copies += 1;
        self.stats.bytes += copy.bytes.len() as u64;
        if s.user_stack.last() != Some(&copy.pc) {
            self.stats.mismatched += 1;
            return;
        }
        let keep = s.user_stack.len() - 1;
        let w = self.walk_copy(&copy, MAX_STACK_DEPTH - keep, space, modules);
        s.user_stack.truncate(keep);
        s.user_stack.extend_from_slice(&w.frames);
        s.flags = (s.flags & !SAMPLE_UNWIND_MASK) | (w.end << SAMPLE_UNWIND_SHIFT);
        if w.used_fp {
            s.flags |= SAMPLE_UNWIND_USED_FP;
        }
        if w.end == UNWIND_END_COMPLETE {
            self.stats.completed += 1;
        } else {
            self.stats.truncated[w.end as usize] += 1;
            self.stats.beyond_copy += u64::from(w.beyond_copy);
        }
    }

    /// How many user frames a stack had, from the `frames` the kernel walked (the last being
    /// where it stopped, `copy.pc`) and the walk continued over `copy`. A walk that ends
    /// where a sample's would too (the outermost frame, code without CFI, the end of a frame
    /// pointer chain) counts, as the kernel's depths do; None when it ended for want of
    /// something a later sample would have (a table, a mapping, stack past the copy).
    pub fn depth(
        &mut self,
        frames: u32,
        copy: &crate::decode::StackCopy,
        space: &AddressSpace,
        modules: &ModuleTable,
    ) -> Option<u32> {
        let keep = (frames as usize).checked_sub(1)?;
        let w = self.walk_copy(copy, MAX_STACK_DEPTH.checked_sub(keep)?, space, modules);
        let wanting =
            matches!(w.end, UNWIND_END_NO_PROCESS | UNWIND_END_NO_MAPPING | UNWIND_END_NO_TABLE);
        (!wanting && !w.beyond_copy).then_some((keep + w.frames.len()) as u32)
    }

    /// The walk from where the kernel's stopped (`copy`'s registers) over the copied stack, up
    /// to `max` frames, with the rules of the process whose address space is `space`.
    fn walk_copy(
        &mut self,
        copy: &crate::decode::StackCopy,
        max: usize,
        space: &AddressSpace,
        modules: &ModuleTable,
    ) -> walk::Walk {
        let regs = Regs {
            pc: copy.pc,
            sp: copy.sp,
            bp: copy.bp,
            bp_known: copy.flags & STACK_COPY_BP_KNOWN != 0,
            pc_is_return: copy.flags & STACK_COPY_PC_IS_RETURN != 0,
        };
        let stack = StackCopy { base: copy.sp, bytes: &copy.bytes };
        let fp = self.fp_fallback;
        walk::walk(regs, stack, max, fp, |addr| self.rule(space, modules, addr))
    }

    /// The rule covering `addr` in the process whose address space is `space`.
    fn rule(&mut self, space: &AddressSpace, modules: &ModuleTable, addr: u64) -> Rule {
        let Some((module, offset)) = space.lookup(addr) else { return Rule::NoMapping };
        let key = (module, modules.serial(module));
        if !self.by_module.contains_key(&key) {
            let rules = self.file_rules(modules, module);
            self.by_module.insert(key, rules);
        }
        match &self.by_module[&key] {
            FileRules::Unreadable => Rule::NoTable,
            FileRules::LookedUp(data, layout, identity) => {
                let Some(addr) = table_address(layout, offset) else { return Rule::NoCfi };
                let key = (*identity, addr);
                if let Some(&row) = self.looked_up.get(&key) {
                    return row.map_or(Rule::NoCfi, Rule::Row);
                }
                let started = Instant::now();
                let row = profiler_unwind::rule_at(data, addr).ok().flatten();
                self.stats.lookup_time += started.elapsed();
                self.stats.looked_up += 1;
                if self.looked_up.len() >= MAX_LOOKED_UP {
                    self.looked_up.clear();
                }
                self.looked_up.insert(key, row);
                row.map_or(Rule::NoCfi, Rule::Row)
            }
            FileRules::Table(None, _) => Rule::NoCfi,
            FileRules::Table(Some(table), layout) => {
                let Some(addr) = table_address(layout, offset) else { return Rule::NoCfi };
                match table.lookup(addr) {
                    Some(row) => Rule::Row(row),
                    None => Rule::NoCfi,
                }
            }
        }
    }

    /// A module's table, compiled now if no module of the same file was compiled before.
    fn file_rules(&mut self, modules: &ModuleTable, module: ModuleId) -> FileRules {
        let m = modules.get(module);
        // Anonymous code (JIT) and kernel pseudo mappings other than the vDSO have no CFI.
        if m.path == "[anon]" || (m.path.starts_with('[') && m.path != "[vdso]") {
            return FileRules::Table(None, ElfLayout::default());
        }
        let Some(path) = m.readable_path() else { return FileRules::Unreadable };
        let Ok(meta) = std::fs::metadata(&path) else { return FileRules::Unreadable };
        let Some(layout) = ElfLayout::read(&path) else {
            return FileRules::Table(None, ElfLayout::default());
        };
        let identity = crate::collect::modules::file_identity(&meta);
        if let Some(t) = self.tables.get(&identity) {
            return FileRules::Table(t.clone(), layout);
        }
        if meta.len() > COMPILE_WHILE_DRAINING_MAX_BYTES {
            // SAFETY: read-only; a file truncated meanwhile faults the walk's reads (SIGBUS),
            // the same risk every profiler reading mapped binaries takes; the identity was
            // just checked.
            let Ok(data) =
                std::fs::File::open(&path).and_then(|f| unsafe { memmap2::Mmap::map(&f) })
            else {
                return FileRules::Unreadable;
            };
            self.stats.large_files += 1;
            return FileRules::LookedUp(Arc::new(data), layout, identity);
        }
        let started = Instant::now();
        if self.cached_since.is_some_and(|t| started.duration_since(t) > CACHE_LIFETIME) {
            self.clear_cache();
            self.stats.cache_expiries += 1;
        }
        self.cached_since.get_or_insert(started);
        // With the separate debug file's .debug_frame, as the kernel's tables (worker.rs).
        let root = crate::debugfile::debug_root();
        let table = std::fs::read(&path)
            .ok()
            .and_then(|data| crate::debugfile::with_debug_file(&data, &m.path, &root).0.ok())
            .filter(|t| !t.rows().is_empty())
            .map(Arc::new);
        self.stats.compile_time += started.elapsed();
        self.stats.files_compiled += 1;
        let rows = table.as_ref().map_or(0, |t| t.rows().len());
        if self.cached_rows + rows > MAX_CACHED_ROWS {
            self.clear_cache();
            self.cached_since = Some(started);
            self.stats.cache_resets += 1;
        }
        self.cached_rows += rows;
        self.tables.insert(identity, table.clone());
        FileRules::Table(table, layout)
    }

    /// Module entries hold tables too: both go, and are rebuilt on demand.
    fn clear_cache(&mut self) {
        self.tables.clear();
        self.looked_up.clear();
        self.by_module.clear();
        self.cached_rows = 0;
        self.cached_since = None;
    }

    /// The summary line: copies the kernel sent and how their walks ended here.
    pub fn render(&self, counters: &Counters) -> String {
        let s = &self.stats;
        let sent = counters.get(counter::STACK_COPIES);
        let not_sent = counters.get(counter::STACK_COPY_FAILED)
            + counters.get(counter::STACK_COPY_OVER_BUDGET);
        if sent == 0 && s.copies == 0 && not_sent == 0 {
            return String::new();
        }
        let mut out = String::new();
        let _ = write!(
            out,
            "stack copies: {sent} samples sent with a copy of their user stack ({:.1} KiB on \
             average; {} walks stopped for want of a table had no readable stack, {} were over \
             the CPU's copy budget); {} arrived: completed in userspace {}, still truncated {}",
            counters.get(counter::STACK_COPY_BYTES) as f64 / sent.max(1) as f64 / 1024.0,
            counters.get(counter::STACK_COPY_FAILED),
            counters.get(counter::STACK_COPY_OVER_BUDGET),
            s.copies,
            s.completed,
            s.truncated.iter().sum::<u64>(),
        );
        let mut reasons = Vec::new();
        for (end, &n) in s.truncated.iter().enumerate() {
            if n > 0 {
                reasons.push(format!("{} {n}", END_NAMES[end]));
            }
        }
        if !reasons.is_empty() {
            let _ = write!(out, " ({})", reasons.join(", "));
        }
        let _ = write!(
            out,
            "; {} needed more stack than copied, {} not continued; {} files compiled in {:.0} ms \
             (cache emptied {} times when full, {} after a minute)",
            s.beyond_copy,
            s.mismatched,
            s.files_compiled,
            s.compile_time.as_secs_f64() * 1e3,
            s.cache_resets,
            s.cache_expiries
        );
        if s.large_files > 0 {
            let _ = write!(
                out,
                "; {} frames in {} files over {} MiB looked up one at a time in {:.0} ms (too \
                 large to compile while draining)",
                s.looked_up,
                s.large_files,
                COMPILE_WHILE_DRAINING_MAX_BYTES >> 20,
                s.lookup_time.as_secs_f64() * 1e3
            );
        }
        out.push('\n');
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{collect::modules::read_address_space, model::ids::Pid};

    /// This test's own libc and dynamic loader, as modules of its address space.
    fn own_libs(modules: &mut ModuleTable) -> (ModuleId, ModuleId) {
        let space = read_address_space(Pid(std::process::id()), modules).unwrap();
        let find = |name: &str| {
            space
                .modules()
                .find(|&m| modules.get(m).path.contains(name))
                .unwrap_or_else(|| panic!("no module named {name} in this test's address space"))
        };
        (find("libc.so"), find("ld-linux"))
    }

    #[test]
    fn compiled_tables_expire_after_a_minute_when_another_file_is_compiled() {
        let mut modules = ModuleTable::default();
        let (libc, ld) = own_libs(&mut modules);
        let table = |r: FileRules| matches!(r, FileRules::Table(Some(_), _));
        let mut c = CopiedStacks::default();
        assert!(table(c.file_rules(&modules, libc)));
        assert_eq!((c.stats.files_compiled, c.tables.len()), (1, 1));
        // Asked again while young: served from the cache.
        assert!(table(c.file_rules(&modules, libc)));
        assert_eq!(c.stats.files_compiled, 1);
        // A minute on, the next file compiled finds the cache old: it starts afresh.
        c.cached_since = Some(Instant::now() - CACHE_LIFETIME - Duration::from_secs(1));
        assert!(table(c.file_rules(&modules, ld)));
        assert_eq!((c.stats.files_compiled, c.tables.len(), c.stats.cache_expiries), (2, 1, 1));
        assert_eq!(
            c.cached_rows,
            c.tables.values().flatten().map(|t| t.rows().len()).sum::<usize>()
        );
        // So libc's table was let go and is compiled again when asked; nothing expires now.
        assert!(table(c.file_rules(&modules, libc)));
        assert_eq!((c.stats.files_compiled, c.tables.len(), c.stats.cache_expiries), (3, 2, 1));
    }
}
