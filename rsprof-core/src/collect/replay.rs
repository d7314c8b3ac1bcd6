//! Feeds a collector from a raw stream (`raw`), as the recording's event loop fed its own:
//! ring records in the order they were drained, each /proc fact ahead of the record that
//! read it. What the live loop did with the collector's outbox after a drain — load unwind
//! tables and USDT probes into the kernel, read CPython's memory — needs the live processes:
//! the outbox is emptied, and the USDT hits in it counted (their markers are not replayed).

use std::io::Read;

use anyhow::{Context as _, Result, bail};

use crate::{
    collect::{
        collector::Collector,
        facts::ReplayProc,
        outbox::Outbox,
        raw::{self, Entry, RawReader},
    },
    model::{recording::RecordingInfo, time::MonoNs},
    store::ChunkedStore,
    symbolize::recorded_names::RecordedNames,
};

/// A replayed recording, ready to export.
pub struct Replayed {
    pub collector: Collector<ChunkedStore>,
    pub start: raw::Start,
    pub info: RecordingInfo,
    pub end: raw::End,
    /// For `symbolize::use_kernel_names`.
    pub kernel_names: RecordedNames,
    pub stats: ReplayStats,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct ReplayStats {
    pub entries: u64,
    pub records: u64,
    pub drains: u64,
    /// USDT hits among the records: their markers need the probes' files as the recording
    /// registered them (`usdt`), which a replay does not do.
    pub usdt_hits_not_replayed: u64,
    /// /proc reads the stream held no answer for.
    pub facts_missing: u64,
}

/// Replays the whole stream; an error if it is not a whole recording.
pub fn replay<R: Read>(mut reader: RawReader<R>) -> Result<Replayed> {
    let facts = ReplayProc::default();
    let mut stats = ReplayStats::default();
    let mut collector: Option<(Collector<ChunkedStore>, raw::Start)> = None;
    let (mut info, mut end) = (None, None);
    let mut cgroups = Vec::new();
    let mut kernel_names = RecordedNames::default();
    let no_start = || anyhow::anyhow!("records before the stream's start entry");
    while let Some(e) = reader.next_entry()? {
        if end.is_some() && !matches!(e, Entry::KernelSymbols(_)) {
            bail!("entry {} follows the end of the recording", reader.entries);
        }
        match e {
            Entry::Start(s) => {
                if collector.is_some() {
                    bail!("a second start entry (entry {})", reader.entries);
                }
                let mut c = Collector::new(ChunkedStore::new(s.buffer_bytes));
                c.copies.fp_fallback = s.fp_fallback;
                facts.set_vdso_len(s.vdso_len);
                c.set_facts(Box::new(facts.clone()));
                collector = Some((c, *s));
            }
            Entry::Ring(bytes) => {
                let (c, _) = collector.as_mut().ok_or_else(no_start)?;
                stats.records += 1;
                // Undecodable records are counted in the collector's stats, as live.
                let _ = c.handle_record(&bytes);
            }
            Entry::Drain(_) => {
                let (c, _) = collector.as_mut().ok_or_else(no_start)?;
                stats.drains += 1;
                stats.usdt_hits_not_replayed += c.outbox.take_usdt_hits().len() as u64;
                c.outbox = Outbox::default();
            }
            e @ (Entry::Identity(_) | Entry::Maps(_)) => facts.add(e),
            Entry::Existing(pid) => {
                collector.as_mut().ok_or_else(no_start)?.0.register_existing(pid)
            }
            Entry::ScanDone => collector.as_mut().ok_or_else(no_start)?.0.initial_scan_done(),
            Entry::Info(i) => info = Some(*i),
            Entry::Cgroups(c) => cgroups.extend(c),
            Entry::KernelSymbols(batch) => kernel_names.add(batch),
            Entry::End(e) => end = Some(e),
        }
    }
    stats.entries = reader.entries;
    let Some((mut collector, start)) = collector else { bail!("no start entry: an empty stream") };
    let info = info.context("no recording info: the recording stopped before sampling began")?;
    let Some(end) = end else {
        bail!(
            "the stream ends after {} entries, before the recording did (was the recorder \
             killed?)",
            reader.entries
        )
    };
    stats.usdt_hits_not_replayed += collector.outbox.take_usdt_hits().len() as u64;
    let paths = &mut collector.processes.cgroup_paths;
    for (id, path) in &cgroups {
        paths.remember(*id, path);
    }
    let ps = &mut collector.processes;
    for p in ps.processes.values_mut() {
        p.cgroup.resolve_recorded(&ps.cgroup_paths);
    }
    stats.facts_missing = facts.missing();
    let info = info.at(MonoNs(end.end_ns));
    Ok(Replayed { collector, start, info, end, kernel_names, stats })
}
