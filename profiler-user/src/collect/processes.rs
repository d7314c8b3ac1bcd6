//! What is known about each process and thread seen during the recording: names (and
//! renames), command lines, start and exit times, and the current address space.

use std::{
    collections::{BTreeMap, HashMap},
    time::Instant,
};

use crate::{
    collect::modules::AddressSpace,
    model::ids::{Pid, Tid},
    model::stacks::{ProcessMeta, ProcessesMeta, ThreadMeta},
};

#[derive(Debug, Default)]
pub struct ThreadInfo {
    pub name: String,
    pub previous_names: Vec<String>,
    /// CLOCK_MONOTONIC ns of fork, if it happened during the recording.
    pub start_ns: Option<u64>,
    pub end_ns: Option<u64>,
    /// `sum_exec_runtime` at the previous sample, for CPU deltas.
    pub last_cpu_time_ns: Option<u64>,
}

impl ThreadInfo {
    /// Records the thread's current name, keeping earlier ones.
    pub fn observe_name(&mut self, name: &str) {
        if name.is_empty() || self.name == name {
            return;
        }
        if !self.name.is_empty() {
            let old = std::mem::replace(&mut self.name, name.to_owned());
            self.previous_names.push(old);
        } else {
            self.name = name.to_owned();
        }
    }

    /// CPU time used since the previous sample; 0 for the first one. The counter only grows,
    /// but a tid reused by a new thread restarts it, hence the saturating difference.
    pub fn cpu_delta(&mut self, cpu_time_ns: u64) -> u64 {
        let d = self.last_cpu_time_ns.map_or(0, |prev| cpu_time_ns.saturating_sub(prev));
        self.last_cpu_time_ns = Some(cpu_time_ns);
        d
    }
}

#[derive(Debug, Default)]
pub struct ProcessInfo {
    pub name: String,
    pub argv: Vec<String>,
    pub start_ns: Option<u64>,
    pub end_ns: Option<u64>,
    pub threads: BTreeMap<Tid, ThreadInfo>,
    /// Executable mappings of the current image; refreshed on exec and on unknown addresses.
    pub space: AddressSpace,
    pub space_read_at: Option<Instant>,
    /// Exit seen: /proc no longer describes this process.
    pub exited: bool,
    /// Its cgroup and container.
    pub cgroup: crate::system::cgroup::membership::ProcessCgroup,
    /// `rsprof:label_push` texts by label address (the label ids samples carry), capped at
    /// `MAX_LABELS`.
    pub labels: HashMap<u64, String>,
}

/// Distinct labels kept per process: a program pushing computed strings must not grow the
/// table without bound (further labels show as their address).
pub const MAX_LABELS: usize = 4096;

#[derive(Debug, Default)]
pub struct ProcessTable {
    pub processes: BTreeMap<Pid, ProcessInfo>,
    /// cgroup id → path, for processes gone before their cgroup was read.
    pub cgroup_paths: crate::system::cgroup::fs::PathCache,
}

impl ProcessTable {
    pub fn len(&self) -> usize {
        self.processes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.processes.is_empty()
    }

    /// Names, command lines and times of every process, for a profile writer.
    pub fn metadata(&self) -> ProcessesMeta {
        self.processes
            .iter()
            .map(|(&pid, p)| {
                let threads = p
                    .threads
                    .iter()
                    .map(|(&tid, t)| {
                        let meta = ThreadMeta {
                            name: t.name.clone(),
                            previous_names: t.previous_names.clone(),
                            start_ns: t.start_ns,
                            end_ns: t.end_ns,
                        };
                        (tid, meta)
                    })
                    .collect();
                let meta = ProcessMeta {
                    name: p.name.clone(),
                    argv: p.argv.clone(),
                    start_ns: p.start_ns,
                    end_ns: p.end_ns,
                    threads,
                    container: p.cgroup.identity.clone(),
                    labels: p.labels.clone(),
                };
                (pid, meta)
            })
            .collect()
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

/// Reads name and argv of a live process from /proc; empty values if it is gone.
pub fn read_proc_identity(pid: Pid) -> (String, Vec<String>) {
    let comm = std::fs::read_to_string(format!("/proc/{}/comm", pid.0))
        .map(|s| s.trim_end_matches('\n').to_owned())
        .unwrap_or_default();
    let argv = std::fs::read(format!("/proc/{}/cmdline", pid.0))
        .map(|raw| {
            raw.split(|&c| c == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default();
    (comm, argv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renames_keep_history() {
        let mut t = ThreadInfo::default();
        t.observe_name("a");
        t.observe_name("a");
        t.observe_name("b");
        assert_eq!(t.name, "b");
        assert_eq!(t.previous_names, vec!["a".to_owned()]);
    }

    #[test]
    fn cpu_delta_is_difference_of_runtime() {
        let mut t = ThreadInfo::default();
        assert_eq!(t.cpu_delta(1000), 0);
        assert_eq!(t.cpu_delta(1800), 800);
        assert_eq!(t.cpu_delta(100), 0, "a reused tid restarts its counter");
    }

    #[test]
    fn reads_own_identity() {
        let (comm, argv) = read_proc_identity(Pid(std::process::id()));
        assert!(!comm.is_empty());
        assert!(!argv.is_empty());
    }
}
