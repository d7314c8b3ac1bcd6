//! What is known about each process and thread seen during the recording: the metadata a
//! profile shows (`model::process`), plus what collecting needs: the current address space,
//! each thread's last CPU time, and the process's cgroup.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::Arc,
};

use crate::{
    collect::modules::AddressSpace,
    collect::{
        jitdump::{self, JitDumpStats, ProcessJitDump},
        perfmap::{self, PerfMapStats, ProcessPerfMap},
    },
    decode::LabelRef,
    model::{
        ids::{JitSymbolId, LabelId, ModuleId, Pid, Tid},
        process::{JitSymbol, ProcessMeta, ProcessesMeta},
        time::MonoNs,
    },
    system::cgroup::{fs::PathCache, membership::ProcessCgroup},
};

/// Distinct labels kept per process: a program pushing computed strings must not grow the
/// table without bound (further labels show as their address).
pub const MAX_LABELS: usize = 4096;
/// Distinct JIT functions kept per process (~100 bytes each): a map naming more code than
/// this has its further functions shown as addresses.
pub const MAX_JIT_SYMBOLS: usize = 1 << 18;
/// Unnamed JIT addresses kept per process for lines read later to name (an address is 8
/// bytes, plus the set's overhead).
pub const MAX_UNNAMED_JIT: usize = 1 << 16;

/// How a process's address space became known.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpaceSource {
    /// Not yet: the next event about the process reads /proc/PID/maps once.
    #[default]
    Unknown,
    /// Read once from /proc/PID/maps: the process existed before the recording began.
    Proc,
    /// Followed from its fork or exec by the kernel's mapping records; never read from /proc.
    Kernel,
}

#[derive(Debug, Default)]
pub struct ProcessInfo {
    /// Names, argv, times, threads and label texts, as the profile shows them.
    pub meta: ProcessMeta,
    /// `sum_exec_runtime` of each thread at its previous sample, for CPU deltas.
    last_cpu_time_ns: HashMap<Tid, u64, foldhash::fast::RandomState>,
    /// Executable mappings of the current image, kept current by the kernel's mapping records.
    pub space: AddressSpace,
    /// The kernel address space (`mm_struct`) `space` describes; 0 when not known yet (read
    /// from /proc): the first mapping record then names it.
    pub mm: u64,
    /// Where `space` came from.
    pub space_source: SpaceSource,
    /// The current image's executable, once its exec mapping record came.
    pub exe_module: Option<crate::model::ids::ModuleId>,
    /// Exit seen: /proc no longer describes this process.
    pub exited: bool,
    /// Its cgroup and container.
    pub cgroup: ProcessCgroup,
    /// Depths of labels pushed before the kernel could walk the pusher's stack, found from a
    /// copy of it: (thread, index in its label stack) → (label address, depth).
    label_depths: HashMap<(Tid, u32), (u64, u32)>,
    /// Its perf map and jitdump, once it has JIT code to name (None behaves as both empty):
    /// boxed apart so the entry of a process that runs no JIT stays under 1 KiB, which the
    /// allocator hands out from its per-thread cache; an exec storm creates thousands a second.
    jit: Option<Box<JitFiles>>,
    /// `meta.jit_symbols` by what they name, to give a name sampled again its id.
    jit_ids: HashMap<JitKey, JitSymbolId>,
    /// Addresses in anonymous executable memory stored unnamed, for lines or records read
    /// later to name (`meta.jit_late`), with the first and last time a sample held them and
    /// when their memory was mapped (u64::MAX once that changed between the samples): a
    /// jitdump names them only if one code was there all that time; at most
    /// `MAX_UNNAMED_JIT`.
    unnamed_jit: HashMap<u64, (u64, u64, u64)>,
    /// When each of its anonymous code mappings was made, as the kernel's records said (none
    /// for mappings read from /proc): start → (end, time). Code a jitdump loaded before the
    /// memory at its address was mapped lived in memory unmapped since, so it names nothing
    /// there, even while the record of the code there now is still in the JIT's buffer.
    anon_since: BTreeMap<u64, (u64, u64)>,
    /// Starts of its anonymous executable mappings that hold CPython perf trampolines (the
    /// perf map names their first one `py::…`), flagged to the walker, sorted.
    pub py_trampoline_arenas: Vec<u64>,
    /// It mapped anonymous code (JIT) since its exec.
    pub made_code: bool,
    /// Its CPython interpreter, if it runs one, and the space version last looked at for it.
    pub python: crate::collect::python::ProcessPython,
    pub python_checked: u64,
}

/// A process's JIT records.
#[derive(Debug, Default)]
pub struct JitFiles {
    /// Its perf map, followed from its first JIT address on (see `collect::perfmap`).
    pub perf_map: ProcessPerfMap,
    /// Its jitdump, followed from its mapping on (see `collect::jitdump`).
    pub jit_dump: ProcessJitDump,
}

/// What a JIT symbol stands for: its name, where the jitdump placed the sampled instruction,
/// and which file named it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct JitKey {
    name: Arc<str>,
    line: Option<(Arc<str>, u32)>,
    from_dump: bool,
}

impl ProcessInfo {
    /// Its perf map and jitdump, made empty at first use.
    pub fn jit_files(&mut self) -> &mut JitFiles {
        self.jit.get_or_insert_default()
    }

    /// Its perf map and jitdump if it has any.
    pub fn jit_files_if_any(&mut self) -> Option<&mut JitFiles> {
        self.jit.as_deref_mut()
    }

    /// What its jitdump says was at `addr` at time `t` (see `ProcessJitDump::at`).
    pub fn jit_dump_at(&self, addr: u64, t: u64, floor: u64) -> jitdump::At<'_> {
        self.jit.as_ref().map_or(jitdump::At::NotCovered, |j| j.jit_dump.at(addr, t, floor))
    }

    /// Its jitdump is open: it may still name code for samples of earlier times.
    pub fn jit_dump_open(&self) -> bool {
        self.jit.as_ref().is_some_and(|j| j.jit_dump.is_open())
    }

    /// Adds what its perf map and jitdump read since the last call (nothing if it has none).
    pub fn take_jit_stats(&mut self, maps: &mut PerfMapStats, dumps: &mut JitDumpStats) {
        if let Some(j) = self.jit.as_deref_mut() {
            maps.add(&j.perf_map.take_stats());
            dumps.add(&j.jit_dump.take_stats());
        }
    }

    /// The id of JIT function `name`, as a perf map names it (None past `MAX_JIT_SYMBOLS`).
    pub fn jit_symbol(&mut self, name: &Arc<str>) -> Option<JitSymbolId> {
        self.jit_key_symbol(JitKey { name: name.clone(), line: None, from_dump: false })
    }

    /// The id of the code a jitdump placed at `addr`, with the line there.
    pub fn jit_dump_symbol(&mut self, code: &jitdump::Code, addr: u64) -> Option<JitSymbolId> {
        let line = code.line_at(addr).map(|(f, l)| (f.clone(), l));
        self.jit_key_symbol(JitKey { name: code.name.clone(), line, from_dump: true })
    }

    fn jit_key_symbol(&mut self, key: JitKey) -> Option<JitSymbolId> {
        if let Some(&id) = self.jit_ids.get(&key) {
            return Some(id);
        }
        if self.jit_ids.len() >= MAX_JIT_SYMBOLS {
            return None;
        }
        let id = JitSymbolId(self.meta.jit_symbols.len() as u32);
        let language = perfmap::language(&key.name, &self.meta.exe);
        self.meta.jit_symbols.push(JitSymbol {
            name: key.name.to_string(),
            language,
            file: key.line.as_ref().map(|(f, _)| f.to_string()),
            line: key.line.as_ref().map(|&(_, l)| l),
            from_dump: key.from_dump,
            interpreter: false,
        });
        self.jit_ids.insert(key, id);
        Some(id)
    }

    /// A new image: its JIT code, perf map and jitdump are new (ids already given stay
    /// valid).
    pub fn forget_perf_map(&mut self) {
        self.jit = None;
        self.anon_since.clear();
        self.jit_ids.clear();
        self.unnamed_jit.clear();
        self.py_trampoline_arenas.clear();
    }

    /// The name the process's records give `addr` now, whatever the time: its jitdump's
    /// latest code there, else its perf map's line.
    fn jit_name_now(&self, addr: u64) -> Option<&Arc<str>> {
        let j = self.jit.as_deref()?;
        match j.jit_dump.latest(addr) {
            Some(code) => Some(&code.name),
            None => j.perf_map.lookup(addr),
        }
    }

    /// Its perf map named more code: stacks cached with the old names are stale (a new space
    /// version), addresses stored unnamed may be named now, and a new CPython trampoline
    /// arena may be known. True when the walker's entry needs rewriting for that.
    pub fn perf_map_named_more(&mut self, anon: ModuleId) -> bool {
        self.space.touch();
        self.name_late();
        self.find_py_trampoline_arenas(anon)
    }

    /// Anonymous code was mapped. The perf map is read when samples are collected, so it may
    /// already name this mapping's trampolines (CPython writes them right after mapping it)
    /// when a sample ahead of this record read it: look again (the mapping rewrites the
    /// walker's entry anyway).
    pub fn anon_code_mapped(&mut self, anon: ModuleId) {
        if self.jit.is_some() {
            self.find_py_trampoline_arenas(anon);
        }
    }

    /// Finds the anonymous mappings (module `anon`) whose first trampoline the perf map names
    /// `py::…` (CPython fills an arena with trampolines from its start); true when that set
    /// changed.
    fn find_py_trampoline_arenas(&mut self, anon: ModuleId) -> bool {
        let mut arenas: Vec<u64> = self
            .space
            .mappings()
            .iter()
            .filter(|m| m.module == anon)
            .filter(|m| self.jit_name_now(m.start).is_some_and(|n| n.starts_with("py::")))
            .map(|m| m.start)
            .collect();
        arenas.sort_unstable();
        if arenas == self.py_trampoline_arenas {
            return false;
        }
        self.py_trampoline_arenas = arenas;
        true
    }

    /// Remembers an address in anonymous executable memory stored unnamed by a sample at
    /// time `t`, its memory mapped at `since`.
    pub fn unnamed_jit(&mut self, addr: u64, t: u64, since: u64) {
        if let Some(span) = self.unnamed_jit.get_mut(&addr) {
            let since = if span.2 == since { since } else { u64::MAX };
            *span = (span.0.min(t), span.1.max(t), since);
        } else if self.unnamed_jit.len() < MAX_UNNAMED_JIT {
            self.unnamed_jit.insert(addr, (t, t, since));
        }
    }

    /// New anonymous code was mapped at `start..end` at `time`.
    pub fn anon_mapped(&mut self, start: u64, end: u64, time: u64) {
        self.anon_unmapped(start, end);
        self.anon_since.insert(start, (end, time));
    }

    /// `start..end` no longer holds anonymous code.
    pub fn anon_unmapped(&mut self, start: u64, end: u64) {
        let cut: Vec<(u64, (u64, u64))> = self
            .anon_since
            .range(..end)
            .rev()
            .take_while(|(_, (e, _))| *e > start)
            .map(|(&s, &v)| (s, v))
            .collect();
        for (s, (e, t)) in cut {
            self.anon_since.remove(&s);
            if s < start {
                self.anon_since.insert(s, (start, t));
            }
            if e > end {
                self.anon_since.insert(end, (e, t));
            }
        }
    }

    /// When the anonymous code mapping holding `addr` was made (0: not known).
    pub fn anon_since_at(&self, addr: u64) -> u64 {
        match self.anon_since.range(..=addr).next_back() {
            Some((_, &(end, time))) if addr < end => time,
            _ => 0,
        }
    }

    /// Names the unnamed addresses that the records read so far name: the jitdump where one
    /// code was there all the time samples held the address (an address whose code changed
    /// meanwhile stays unnamed), else the perf map's line (the first one read after their
    /// samples); called when new lines or records were read.
    pub fn name_late(&mut self) {
        let Some(j) = self.jit.as_deref() else { return };
        if self.unnamed_jit.is_empty() {
            return;
        }
        enum Late {
            Dump(Arc<jitdump::Code>),
            Map(Arc<str>),
        }
        let named: Vec<(u64, Late)> = self
            .unnamed_jit
            .iter()
            .filter_map(|(&a, &(t0, t1, since))| match j.jit_dump.over(a, t0, t1, since) {
                jitdump::Over::Named(code) => Some((a, Late::Dump(code.clone()))),
                jitdump::Over::Ambiguous => None,
                jitdump::Over::NotCovered => Some((a, Late::Map(j.perf_map.lookup(a)?.clone()))),
            })
            .collect();
        for (addr, late) in named {
            let id = match late {
                Late::Dump(code) => self.jit_dump_symbol(&code, addr),
                Late::Map(name) => self.jit_symbol(&name),
            };
            if let Some(id) = id {
                self.meta.jit_late.insert(addr, id);
                self.unnamed_jit.remove(&addr);
            }
        }
    }

    /// CPU time thread `tid` used since its previous sample; 0 for the first one. The counter
    /// only grows, but a tid reused by a new thread restarts it, hence the saturating
    /// difference.
    pub fn cpu_delta(&mut self, tid: Tid, cpu_time_ns: u64) -> u64 {
        let prev = self.last_cpu_time_ns.insert(tid, cpu_time_ns);
        prev.map_or(0, |prev| cpu_time_ns.saturating_sub(prev))
    }

    /// Forgets what only a running thread needs (a process running for months starts and
    /// ends many threads).
    pub fn thread_exited(&mut self, tid: Tid) {
        self.last_cpu_time_ns.remove(&tid);
        self.label_depths.retain(|&(t, _), _| t != tid);
    }

    /// A new image: its threads' label stacks start empty (the kernel drops them at exec).
    pub fn forget_label_depths(&mut self) {
        self.label_depths.clear();
    }

    /// What a copy of the pusher's stack said of the depth of label `index` of thread `tid`
    /// (None: still unknown).
    pub fn set_label_depth(&mut self, tid: Tid, index: u32, label: u64, depth: Option<u32>) {
        match depth {
            Some(d) => self.label_depths.insert((tid, index), (label, d)),
            None => self.label_depths.remove(&(tid, index)),
        };
    }

    /// Fills in the depths of `labels` (a sample's, of thread `tid`) that the kernel did not
    /// know at the push, where a copy of the pusher's stack told them.
    pub fn resolve_label_depths(&self, tid: Tid, labels: &mut [LabelRef]) {
        for (i, l) in labels.iter_mut().enumerate().filter(|(_, l)| l.depth == 0) {
            if let Some(&(addr, depth)) = self.label_depths.get(&(tid, i as u32))
                && addr == l.addr
            {
                l.depth = depth;
            }
        }
    }
}

/// What [`ProcessTable::name_label`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LabelNaming {
    /// First time this text is known for the label.
    Named,
    /// Already known with this text (two threads pushed it first at once: both sent it).
    AlreadyNamed,
    /// The process has `MAX_LABELS` names already.
    OverLimit,
}

#[derive(Debug, Default)]
pub struct ProcessTable {
    /// Hashed, and boxed (a `ProcessInfo` is over 1.5 KiB): an exec storm adds and forgets
    /// hundreds of processes a second, and looks one up per record.
    pub processes: hashbrown::HashMap<Pid, Box<ProcessInfo>, foldhash::fast::RandomState>,
    /// cgroup id → path, for processes gone before their cgroup was read.
    pub cgroup_paths: PathCache,
    /// Processes that exited, by exit time: forgotten a grace period later unless stored
    /// events refer to them (those are forgotten when the last such event is recycled). Those
    /// whose every thread had exited (`LAST_THREAD_EXIT_GRACE_NS`) apart from the others
    /// (`EXIT_GRACE_NS`).
    pub pending_exits: VecDeque<(MonoNs, Pid)>,
    pub pending_exits_threads_left: VecDeque<(MonoNs, Pid)>,
    /// Threads (not main threads) that exited, by exit time: forgotten like processes.
    pub pending_thread_exits: VecDeque<(MonoNs, Pid, Tid)>,
}

impl ProcessTable {
    /// Where an exited process waits to be forgotten: apart when its last thread exited.
    pub fn exit_queue(&mut self, last_thread: bool) -> &mut VecDeque<(MonoNs, Pid)> {
        match last_thread {
            true => &mut self.pending_exits,
            false => &mut self.pending_exits_threads_left,
        }
    }

    pub fn len(&self) -> usize {
        self.processes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.processes.is_empty()
    }

    pub fn get(&self, pid: Pid) -> Option<&ProcessInfo> {
        self.processes.get(&pid).map(|p| &**p)
    }

    /// The process, created empty if unknown.
    pub fn entry(&mut self, pid: Pid) -> &mut ProcessInfo {
        self.processes.entry(pid).or_default()
    }

    /// Pids of the processes not known to have exited.
    pub fn live_pids(&self) -> Vec<Pid> {
        let mut pids: Vec<Pid> =
            self.processes.iter().filter(|(_, p)| !p.exited).map(|(&pid, _)| pid).collect();
        pids.sort_unstable();
        pids
    }

    /// Records the text of label `label` of `pid` (at most `MAX_LABELS` per process).
    pub fn name_label(&mut self, pid: Pid, label: LabelId, text: String) -> LabelNaming {
        let labels = &mut self.entry(pid).meta.labels;
        if labels.get(&label) == Some(&text) {
            LabelNaming::AlreadyNamed
        } else if labels.len() < MAX_LABELS || labels.contains_key(&label) {
            labels.insert(label, text);
            LabelNaming::Named
        } else {
            LabelNaming::OverLimit
        }
    }

    /// Names, command lines and times of every process, for a profile writer.
    pub fn metadata(&self) -> ProcessesMeta {
        self.processes
            .iter()
            .map(|(&pid, p)| {
                let mut meta = p.meta.clone();
                meta.container.clone_from(&p.cgroup.identity);
                (pid, meta)
            })
            .collect()
    }

    /// Adds the modules that processes still known may look up.
    pub fn referenced_modules(&self, out: &mut std::collections::HashSet<ModuleId>) {
        for p in self.processes.values() {
            out.extend(p.space.modules());
            out.extend(p.exe_module);
        }
    }

    /// Threads known, over all processes (a pass over the processes).
    pub fn thread_count(&self) -> usize {
        self.processes.values().map(|p| p.meta.threads.len()).sum()
    }

    /// Forgets thread `tid` of `pid` if it has exited (no stored event refers to it any
    /// more). A main thread goes with its process.
    pub fn forget_exited_thread(&mut self, pid: Pid, tid: Tid) -> bool {
        if pid.0 == tid.0 {
            return false;
        }
        let Some(p) = self.processes.get_mut(&pid) else { return false };
        // Not a reused tid that runs again (its entry has no end then).
        if p.meta.threads.get(&tid).is_some_and(|t| t.end.is_some()) {
            p.meta.threads.remove(&tid);
            return true;
        }
        false
    }

    /// Forgets processes that have exited, among `pids` (whose stored events are all gone).
    pub fn forget_exited(&mut self, pids: &[Pid]) -> usize {
        let mut n = 0;
        for pid in pids {
            if self.processes.get(pid).is_some_and(|p| p.exited) {
                self.processes.remove(pid);
                n += 1;
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    /// Anonymous code mapping times: a mapping cut by an unmap keeps its time for what is
    /// left, memory mapped again takes the new time, and addresses outside know none.
    #[test]
    fn anonymous_code_remembers_when_it_was_mapped() {
        let mut p = ProcessInfo::default();
        p.anon_mapped(0x1000, 0x5000, 10);
        assert_eq!(p.anon_since_at(0x1000), 10);
        assert_eq!(p.anon_since_at(0x4fff), 10);
        assert_eq!(p.anon_since_at(0x5000), 0);
        p.anon_unmapped(0x2000, 0x3000);
        assert_eq!(p.anon_since_at(0x2800), 0);
        assert_eq!((p.anon_since_at(0x1fff), p.anon_since_at(0x3000)), (10, 10));
        p.anon_mapped(0x2000, 0x3000, 20);
        assert_eq!([0x1000, 0x2000, 0x2fff, 0x3000].map(|a| p.anon_since_at(a)), [10, 20, 20, 10]);
        p.anon_mapped(0x0, 0x10000, 30);
        assert_eq!(p.anon_since_at(0x2000), 30);
        assert_eq!(p.anon_since.len(), 1);
        // Samples of one address in two mappings of it: no one mapping time.
        p.unnamed_jit(0x2000, 100, 20);
        p.unnamed_jit(0x2000, 200, 20);
        assert_eq!(p.unnamed_jit[&0x2000], (100, 200, 20));
        p.unnamed_jit(0x2000, 300, 30);
        assert_eq!(p.unnamed_jit[&0x2000], (100, 300, u64::MAX));
    }

    use super::*;
    use crate::model::process::ThreadMeta;

    #[test]
    fn label_depths_from_copies_fill_unknown_depths_only() {
        let mut p = ProcessInfo::default();
        let l = |addr, depth| LabelRef { addr, depth };
        p.set_label_depth(Tid(7), 1, 0xb0, Some(4));
        let mut labels = [l(0xa0, 2), l(0xb0, 0)];
        p.resolve_label_depths(Tid(7), &mut labels);
        assert_eq!(labels, [l(0xa0, 2), l(0xb0, 4)]);
        // Another thread, another label at that index, or a depth the kernel knew: untouched.
        let mut other = [l(0xa0, 0), l(0xb0, 0)];
        p.resolve_label_depths(Tid(8), &mut other);
        assert_eq!(other, [l(0xa0, 0), l(0xb0, 0)]);
        let mut moved = [l(0xa0, 0), l(0xc0, 0)];
        p.resolve_label_depths(Tid(7), &mut moved);
        assert_eq!(moved, [l(0xa0, 0), l(0xc0, 0)]);
        // A later push at that index whose copy failed forgets the old depth.
        p.set_label_depth(Tid(7), 1, 0xb0, None);
        let mut again = [l(0xa0, 2), l(0xb0, 0)];
        p.resolve_label_depths(Tid(7), &mut again);
        assert_eq!(again[1].depth, 0);
        // So does the thread's exit.
        p.set_label_depth(Tid(7), 0, 0xa0, Some(3));
        p.thread_exited(Tid(7));
        assert!(p.label_depths.is_empty());
    }

    #[test]
    fn a_rename_keeps_the_last_name() {
        let mut t = ThreadMeta::default();
        t.observe_name("a");
        t.observe_name("");
        assert_eq!(t.name, "a");
        t.observe_name("b");
        assert_eq!(t.name, "b");
    }

    #[test]
    fn cpu_delta_is_difference_of_runtime() {
        let mut p = ProcessInfo::default();
        assert_eq!(p.cpu_delta(Tid(1), 1000), 0);
        assert_eq!(p.cpu_delta(Tid(1), 1800), 800);
        assert_eq!(p.cpu_delta(Tid(2), 5000), 0, "threads are counted apart");
        assert_eq!(p.cpu_delta(Tid(1), 100), 0, "a reused tid restarts its counter");
    }

    #[test]
    fn labels_are_capped_per_process() {
        let mut t = ProcessTable::default();
        assert_eq!(t.name_label(Pid(1), LabelId(1), "a".into()), LabelNaming::Named);
        assert_eq!(t.name_label(Pid(1), LabelId(1), "a".into()), LabelNaming::AlreadyNamed);
        for i in 2..=MAX_LABELS as u64 {
            t.name_label(Pid(1), LabelId(i), format!("l{i}"));
        }
        let over = t.name_label(Pid(1), LabelId(u64::MAX), "x".into());
        assert_eq!(over, LabelNaming::OverLimit);
        assert_eq!(t.name_label(Pid(2), LabelId(u64::MAX), "x".into()), LabelNaming::Named);
    }
}
