//! The text summary printed when a recording ends.

use std::fmt::Write as _;

use crate::{
    assemble::ProfileStats, collector::CollectorStats, loader::KernelCounters, storage::StoreStats,
};

pub struct SummaryInput<'a> {
    pub profile: &'a ProfileStats,
    pub store: &'a StoreStats,
    pub buffer_bytes: usize,
    pub counters: &'a KernelCounters,
    pub stats: &'a CollectorStats,
    pub duration_s: f64,
    pub frequency: u64,
    pub cpus: usize,
    pub output: &'a str,
    pub output_bytes: u64,
    pub stop_reason: &'a str,
}

pub fn render(i: &SummaryInput) -> String {
    let c = i.counters;
    let recorded = i.stats.samples;
    let lost = c.lost_samples();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "rsprof-bpf: {:.1} s on {} CPUs at {} Hz, stopped by {}",
        i.duration_s, i.cpus, i.frequency, i.stop_reason
    );
    let _ = writeln!(s, "samples: {recorded} recorded, {lost} lost");
    let expected = i.frequency as f64 * i.cpus as f64 * i.duration_s;
    let _ = writeln!(
        s,
        "  lost by cause: ring buffer full {}, no scratch buffer {}; lifecycle events lost {}",
        c.lost_ringbuf_full, c.lost_no_scratch, c.lost_task_events
    );
    let _ = writeln!(
        s,
        "  kernel: {} sent, {} filtered out; expected about {:.0} system-wide",
        c.samples_sent, c.samples_filtered, expected
    );
    if c.samples_sent != recorded {
        let _ = writeln!(
            s,
            "  warning: kernel sent {} samples but {} arrived ({} undecodable)",
            c.samples_sent, recorded, i.stats.decode_errors
        );
    }
    let _ = writeln!(
        s,
        "  stack errors: kernel {}, user {}; cpu-time read errors {}, as of last tick {}; \
         unmapped user frames {}",
        c.kernel_stack_errors,
        c.user_stack_errors,
        c.cpu_time_errors,
        c.cpu_time_stale,
        i.stats.unmapped_frames
    );
    if recorded > 0 {
        let _ = writeln!(
            s,
            "  idle: {:.1}% of samples ({} on idle CPUs)",
            100.0 * i.stats.idle_samples as f64 / recorded as f64,
            i.stats.idle_samples
        );
    }
    let p = i.profile;
    match p.dropped_ms {
        Some((a, b)) => {
            let _ = writeln!(
                s,
                "buffer: {} full, recycled {} events from {:.3}s to {:.3}s; the profile holds the \
                 newest {} samples",
                human_bytes(i.buffer_bytes),
                p.dropped_events,
                a / 1e3,
                b / 1e3,
                p.samples
            );
        }
        None => {
            let _ = writeln!(
                s,
                "buffer: {} samples, {} markers kept in {} (nothing recycled)",
                p.samples,
                p.markers,
                human_bytes(i.buffer_bytes)
            );
        }
    }
    if i.store.table_pressure_recycles > 0 {
        let _ = writeln!(
            s,
            "  {} of those chunks were recycled early: stack and string tables reached half the \
             buffer size (many distinct stacks); a larger --buffer-size keeps more",
            i.store.table_pressure_recycles
        );
    }
    if i.store.oversized > 0 {
        let _ =
            writeln!(s, "  warning: {} events too large to store were dropped", i.store.oversized);
    }
    for c in &p.corrupt {
        let _ = writeln!(s, "  warning: corrupt storage skipped: {c}");
    }
    let _ = writeln!(s, "processes: {}, threads: {}", p.processes, p.threads);
    let busy = p.samples - p.idle_samples;
    if !p.top_functions.is_empty() {
        let _ = writeln!(s, "top functions by self samples:");
        for (name, n) in &p.top_functions {
            let _ = writeln!(
                s,
                "  {:5.1}%  {:>7}  {}",
                100.0 * *n as f64 / busy.max(1) as f64,
                n,
                name
            );
        }
    }
    let _ = writeln!(
        s,
        "wrote {} ({:.1} MB): open it at https://profiler.firefox.com (\"Load a profile from file\")",
        i.output,
        i.output_bytes as f64 / 1e6
    );
    s
}

fn human_bytes(b: usize) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b} B"),
    }
}
