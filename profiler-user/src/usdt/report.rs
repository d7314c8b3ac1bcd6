//! What a recording's USDT side saw, for the summary: kernel counters, hits per probe, the
//! markers made, label use and warnings.

use std::fmt::Write as _;

use profiler_common::counter;

use super::{ProbeRegistry, attach::DiscoveryStats, markers::MarkerStats};
use crate::{bpf::counters::Counters, collect::processes::MAX_LABELS};

/// What the recording saw, for the summary. The hits themselves became markers in storage.
#[derive(Debug, Default)]
pub struct UsdtReport {
    pub registry: ProbeRegistry,
    /// Hits received and typed.
    pub hits: u64,
    /// Hits by probe (`provider:name`), sorted by name.
    pub hit_counts: Vec<(String, u64)>,
    /// Hits whose probe/spec ids were not handed out (corrupt records).
    pub unresolved: u64,
    pub markers: MarkerStats,
    /// Samples by innermost label text, most first.
    pub label_samples: Vec<(String, u64)>,
    /// Labels left unnamed because their process already had `MAX_LABELS` names.
    pub labels_over_limit: u64,
    /// Labels pushed before the kernel had the tables to walk the pusher's stack: (depth
    /// found from a copy of that stack, depth unknown: shown right above the leaf).
    pub label_depths: (u64, u64),
    /// Every kernel counter; the USDT ones are reported here.
    pub counters: Counters,
    pub warnings: Vec<String>,
    /// Sites attached over the recording.
    pub sites: usize,
    /// Requests (`--usdt`, `--usdt-interval`) whose probe was never found.
    pub not_found: Vec<String>,
    /// Strings the kernel could not read that were read from read-only mappings afterwards.
    pub strings_recovered: u64,
    /// /proc/PID/maps reads made for that recovery (probes are never found that way).
    pub string_maps_reads: u64,
    pub discovery: DiscoveryStats,
}

impl UsdtReport {
    /// Whether the summary has anything to say.
    pub fn is_empty(&self) -> bool {
        self.sites == 0
            && self.hits == 0
            && self.not_found.is_empty()
            && self.warnings.is_empty()
            // Execs let go before their scan was done are worth a line even without probes.
            && self.discovery.gate.expired == 0
    }

    /// Summary lines (after the sampling summary).
    pub fn render(&self) -> String {
        let mut s = String::new();
        let c = &self.counters;
        let _ = writeln!(
            s,
            "usdt: {} hits recorded, {} lost (ring buffer full {}, other {}); {} probe sites attached",
            self.hits,
            c.get(counter::USDT_LOST_RINGBUF_FULL) + c.get(counter::USDT_LOST_OTHER),
            c.get(counter::USDT_LOST_RINGBUF_FULL),
            c.get(counter::USDT_LOST_OTHER),
            self.sites
        );
        let d = &self.discovery;
        let _ = writeln!(
            s,
            "  probe discovery: {} files scanned (each file once), {} with probes attached, {} of \
             them after a process started during the recording had mapped them (its earlier hits \
             lost), {} probe-less files forgotten (cache full); /proc/PID/maps read 0 times to \
             find probes, {} times to recover strings",
            d.files_scanned,
            d.files_attached,
            d.attached_late,
            d.files_forgotten,
            self.string_maps_reads
        );
        let g = &d.gate;
        if g.filesystems > 0 {
            let _ = writeln!(
                s,
                "  exec gate: {} filesystems watched ({} refused); {} execs answered, {} held while \
                 their new file was scanned (avg {:.0} µs, max {:.0} µs), {} let go at the {} ms \
                 deadline before their scan was done (possibly attached late), {} files skip the \
                 gate (ignore marks), {} errors",
                g.filesystems,
                g.filesystems_failed,
                g.execs,
                g.held,
                g.hold_ns_total as f64 / g.held.max(1) as f64 / 1e3,
                g.hold_ns_max as f64 / 1e3,
                g.expired,
                super::gate::HOLD_DEADLINE.as_millis(),
                g.ignore_marks,
                g.errors
            );
        }
        if !self.hit_counts.is_empty() {
            let list: Vec<String> =
                self.hit_counts.iter().map(|(n, c)| format!("{n} {c}")).collect();
            let _ = writeln!(s, "  hits by probe: {}", list.join(", "));
        }
        let m = &self.markers;
        if self.hits > 0 {
            let _ = writeln!(
                s,
                "  markers: {} instant, {} intervals, {} counter values; incomplete: {} never ended, {} ended without a begin",
                m.instants, m.intervals, m.counters, m.unended, m.unbegun
            );
        }
        let _ = writeln!(
            s,
            "  strings: {} null, {} unreadable ({} of them read later from read-only mappings), {} truncated; argument read errors {}",
            c.get(counter::USDT_STR_NULL),
            c.get(counter::USDT_STR_UNREADABLE),
            self.strings_recovered,
            c.get(counter::USDT_STR_TRUNCATED),
            c.get(counter::USDT_ARG_ERRORS)
        );
        if c.get(counter::LABEL_PUSHES) + c.get(counter::LABEL_POPS) > 0 {
            let _ = writeln!(
                s,
                "  labels: {} pushes, {} pops, {} overflows, {} underflows, {} map full; {} samples labelled",
                c.get(counter::LABEL_PUSHES),
                c.get(counter::LABEL_POPS),
                c.get(counter::LABEL_OVERFLOWS),
                c.get(counter::LABEL_UNDERFLOWS),
                c.get(counter::LABEL_MAP_FULL),
                c.get(counter::SAMPLES_WITH_LABELS)
            );
            let (found, unknown) = self.label_depths;
            if found + unknown > 0 {
                let _ = writeln!(
                    s,
                    "  labels pushed before their process's unwind tables were loaded: {found} placed from a copy of the pusher's stack, {unknown} placed above the leaf (pusher unknown)"
                );
            }
            for (name, n) in self.label_samples.iter().take(10) {
                let _ = writeln!(s, "  label '{name}': {n} samples");
            }
            if self.labels_over_limit > 0 {
                let _ = writeln!(
                    s,
                    "  warning: {} label texts not kept: over {MAX_LABELS} distinct labels in one process",
                    self.labels_over_limit
                );
            }
        }
        for p in &self.not_found {
            let _ = writeln!(s, "  warning: USDT probe {p} was not found in any profiled process");
        }
        for w in self.warnings.iter().take(20) {
            let _ = writeln!(s, "  warning: {w}");
        }
        let more = self.warnings.len().saturating_sub(20) as u64 + d.warnings_dropped;
        if more > 0 {
            let _ = writeln!(s, "  ({more} more warnings)");
        }
        if self.unresolved > 0 {
            let _ = writeln!(s, "  warning: {} hits with unknown probe ids", self.unresolved);
        }
        s
    }
}
