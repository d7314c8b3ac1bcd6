//! Builds the writer-facing [`Profile`] from stored samples, process metadata and symbols.

use std::collections::HashMap;

use crate::{
    collector::Collector,
    ids::{Pid, Tid},
    intern::Interner,
    profile::{self, Frame, FrameIndex, Profile, StackIndex},
    storage::{MemoryStore, ThreadKey},
    symbolize::Symbols,
};

/// The recording's time base and description.
#[derive(Clone, Debug)]
pub struct RecordingInfo {
    /// CLOCK_MONOTONIC ns at the profile's zero.
    pub start_mono_ns: u64,
    /// Wall-clock ms since the epoch at the same instant.
    pub start_wall_ms: f64,
    pub end_mono_ns: u64,
    pub frequency: u64,
    pub logical_cpus: u32,
    pub physical_cpus: u32,
    pub product: String,
    pub oscpu: String,
}

impl RecordingInfo {
    pub fn ms(&self, mono_ns: u64) -> f64 {
        (mono_ns as f64 - self.start_mono_ns as f64) / 1e6
    }
}

pub fn build_profile(
    collector: &mut Collector<MemoryStore>,
    symbols: &Symbols,
    info: &RecordingInfo,
) -> Profile {
    let mut frames: Interner<Frame> = Interner::default();
    // StackId(i) becomes StackIndex(i).
    let store = &collector.store;
    let stacks: Vec<Vec<FrameIndex>> = (0..store.stack_count())
        .map(|i| {
            store
                .stack(crate::storage::StackId(i as u32))
                .iter()
                .flat_map(|a| symbols.get(a).map(Vec::as_slice).unwrap_or(&[]))
                .map(|f| FrameIndex(frames.intern(f)))
                .collect()
        })
        .collect();

    let mut by_process: HashMap<Pid, Vec<(ThreadKey, Vec<profile::Sample>)>> = HashMap::new();
    for (key, samples) in collector.store.threads() {
        let converted = samples
            .iter()
            .map(|s| profile::Sample {
                time_ms: info.ms(s.time_ns),
                // The idle task's runtime is idle time, not work: don't chart it as CPU use.
                cpu_delta_ns: Some(if key.is_idle() { 0 } else { s.cpu_delta_ns }),
                stack: s.stack.map(|id| StackIndex(id.0)),
                idle: key.is_idle(),
            })
            .collect();
        by_process.entry(key.pid).or_default().push((*key, converted));
    }

    let mut processes: Vec<profile::Process> = by_process
        .into_iter()
        .map(|(pid, mut threads)| {
            threads.sort_by_key(|(k, _)| k.tid);
            let info_p = collector.processes.processes.get(&pid);
            let first_sample = threads
                .iter()
                .filter_map(|(_, s)| s.first())
                .map(|s| s.time_ms)
                .fold(f64::MAX, f64::min);
            let threads: Vec<profile::Thread> = threads
                .into_iter()
                .map(|(key, samples)| {
                    let t = info_p.and_then(|p| p.threads.get(&key.tid));
                    let first = samples.first().map_or(0.0, |s| s.time_ms);
                    profile::Thread {
                        tid: key.tid,
                        name: t.map(|t| t.name.clone()).filter(|n| !n.is_empty()).unwrap_or_else(
                            || {
                                if key.is_idle() {
                                    format!("swapper/{}", key.tid)
                                } else {
                                    key.tid.to_string()
                                }
                            },
                        ),
                        previous_names: t.map(|t| t.previous_names.clone()).unwrap_or_default(),
                        is_main: !key.is_idle() && key.tid == Tid(pid.0),
                        register_time_ms: t
                            .and_then(|t| t.start_ns)
                            .map_or(0.0, |ns| info.ms(ns).max(0.0))
                            .min(first),
                        unregister_time_ms: t.and_then(|t| t.end_ns).map(|ns| info.ms(ns)),
                        samples,
                    }
                })
                .collect();
            profile::Process {
                pid,
                name: info_p
                    .map(|p| p.name.clone())
                    .filter(|n| !n.is_empty())
                    .unwrap_or_else(|| pid.to_string()),
                command_line: info_p.map(|p| p.argv.join(" ")).unwrap_or_default(),
                start_time_ms: info_p
                    .and_then(|p| p.start_ns)
                    .map_or(0.0, |ns| info.ms(ns).max(0.0))
                    .min(first_sample),
                end_time_ms: info_p.and_then(|p| p.end_ns).map(|ns| info.ms(ns)),
                is_idle: pid.0 == 0,
                container: info_p.and_then(|p| p.cgroup.identity.clone()),
                threads,
            }
        })
        .collect();
    processes.sort_by_key(|p| p.pid);

    Profile {
        start_time_ms: info.start_wall_ms,
        interval_ms: 1000.0 / info.frequency as f64,
        end_time_ms: info.ms(info.end_mono_ns),
        logical_cpus: info.logical_cpus,
        physical_cpus: info.physical_cpus,
        product: info.product.clone(),
        oscpu: info.oscpu.clone(),
        frames: frames.into_items(),
        stacks,
        processes,
    }
}
