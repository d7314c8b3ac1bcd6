//! What the collector noticed that other parts act on after each drain (the USDT session,
//! the unwinder's table loader): typed mailboxes instead of public vectors to empty by hand.

use crate::{
    decode::RawUsdtHit,
    model::{
        ids::{ModuleId, Pid, Tid},
        time::MonoNs,
    },
};

#[derive(Debug, Default)]
pub struct Outbox {
    usdt_hits: Vec<RawUsdtHit>,
    /// The processes those hits are of.
    usdt_pids: std::collections::HashSet<Pid, foldhash::fast::RandomState>,
    exited_threads: Vec<Tid>,
    exited_processes: Vec<Pid>,
    /// Processes whose executable mappings changed (the unwinder's tables follow them).
    maps_changed: Vec<Pid>,
    /// New processes forked without exec, in order (the loader adopts their walker entries).
    forks: Vec<Forked>,
    /// Processes whose mappings changed or that forked (the Python loader looks for CPython).
    python_checks: Vec<Pid>,
    /// Processes with samples whose walk ended at a file whose table is not loaded yet (the
    /// loader compiles their files first).
    tables_wanted: Vec<Pid>,
    /// The files those walks stopped in, with the sample's time (the loader times how long
    /// a file's first sample waited for its table).
    files_wanted: Vec<(ModuleId, MonoNs)>,
}

/// A new process: a fork of `parent` (not a thread), at `time`; `walker_copied`: the kernel
/// gave it its parent's walker entry then.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Forked {
    pub child: Pid,
    pub parent: Pid,
    pub time: MonoNs,
    pub walker_copied: bool,
}

/// Threads and processes that exited since the last look.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Exits {
    pub threads: Vec<Tid>,
    pub processes: Vec<Pid>,
}

impl Outbox {
    pub fn usdt_hit(&mut self, hit: RawUsdtHit) {
        self.usdt_pids.insert(hit.pid);
        self.usdt_hits.push(hit);
    }

    /// Whether hits of `pid` wait to be taken: they become markers with its mappings (for
    /// strings) and labels, so it must stay known until then.
    pub fn usdt_hits_pending_for(&self, pid: Pid) -> bool {
        !self.usdt_pids.is_empty() && self.usdt_pids.contains(&pid)
    }

    pub fn thread_exited(&mut self, tid: Tid) {
        self.exited_threads.push(tid);
    }

    pub fn maps_changed(&mut self, pid: Pid) {
        self.maps_changed.push(pid);
        self.python_checks.push(pid);
    }

    pub fn forked(&mut self, fork: Forked) {
        self.forks.push(fork);
        self.python_checks.push(fork.child);
    }

    /// Processes to look at for CPython, each once (taken after every drain, Python frames on
    /// or off, so it never grows).
    pub fn take_python_checks(&mut self) -> Vec<Pid> {
        let mut pids = std::mem::take(&mut self.python_checks);
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// The processes forked since the last take, in order.
    pub fn take_forks(&mut self) -> Vec<Forked> {
        std::mem::take(&mut self.forks)
    }

    /// Bounded: only a hint for ordering the loader's queue.
    pub fn table_wanted(&mut self, pid: Pid) {
        if self.tables_wanted.len() < 4096 {
            self.tables_wanted.push(pid);
        }
    }

    /// A sample at `time` stopped in `module` for want of its table. Bounded, like
    /// `table_wanted`.
    pub fn file_wanted(&mut self, module: ModuleId, time: MonoNs) {
        if self.files_wanted.len() < 4096 {
            self.files_wanted.push((module, time));
        }
    }

    pub fn take_files_wanted(&mut self) -> Vec<(ModuleId, MonoNs)> {
        std::mem::take(&mut self.files_wanted)
    }

    /// Processes sampled without a table since the last take, once per sample.
    pub fn take_tables_wanted(&mut self) -> Vec<Pid> {
        std::mem::take(&mut self.tables_wanted)
    }

    pub fn process_exited(&mut self, pid: Pid) {
        self.exited_processes.push(pid);
    }

    /// The hits received since the last take, in arrival order, to amend in place.
    pub fn usdt_hits_mut(&mut self) -> &mut [RawUsdtHit] {
        &mut self.usdt_hits
    }

    /// Takes the hits; hand the emptied vector back with [`Outbox::reuse_hits`].
    pub fn take_usdt_hits(&mut self) -> Vec<RawUsdtHit> {
        self.usdt_pids.clear();
        std::mem::take(&mut self.usdt_hits)
    }

    /// Keeps the allocation of a taken hit vector for the next drain.
    pub fn reuse_hits(&mut self, mut hits: Vec<RawUsdtHit>) {
        if self.usdt_hits.is_empty() {
            hits.clear();
            self.usdt_hits = hits;
        }
    }

    /// Processes that exited since the last take, without taking them.
    pub fn pending_process_exits(&self) -> &[Pid] {
        &self.exited_processes
    }

    /// Processes whose mappings changed, each once.
    pub fn take_maps_changed(&mut self) -> Vec<Pid> {
        let mut pids = std::mem::take(&mut self.maps_changed);
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    pub fn take_exits(&mut self) -> Exits {
        Exits {
            threads: std::mem::take(&mut self.exited_threads),
            processes: std::mem::take(&mut self.exited_processes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exits_are_taken_once() {
        let mut o = Outbox::default();
        o.thread_exited(Tid(5));
        o.process_exited(Pid(5));
        assert_eq!(o.take_exits(), Exits { threads: vec![Tid(5)], processes: vec![Pid(5)] });
        assert_eq!(o.take_exits(), Exits::default());
    }
}
