//! The text summary printed when a recording ends.

use std::{collections::HashMap, fmt::Write as _};

use crate::{collector::CollectorStats, loader::KernelCounters, profile::Profile};

pub struct SummaryInput<'a> {
    pub profile: &'a Profile,
    pub counters: &'a KernelCounters,
    pub stats: &'a CollectorStats,
    pub duration_s: f64,
    pub frequency: u64,
    pub cpus: usize,
    pub output: &'a str,
    pub output_bytes: u64,
    pub stop_reason: &'a str,
}

/// Self samples per leaf function ("name (in module)"), most first; idle samples excluded.
pub fn top_functions(profile: &Profile, n: usize) -> Vec<(String, u64)> {
    let mut counts: HashMap<u32, u64> = HashMap::new();
    for p in profile.processes.iter().filter(|p| !p.is_idle) {
        for t in &p.threads {
            for s in &t.samples {
                if let Some(&leaf) = s.stack.and_then(|st| profile.stacks[st.0 as usize].last()) {
                    *counts.entry(leaf.0).or_default() += 1;
                }
            }
        }
    }
    // Inlined frames of one address share a leaf; merge by name so a function counts once.
    let mut by_name: HashMap<String, u64> = HashMap::new();
    for (f, c) in counts {
        let fr = &profile.frames[f as usize];
        *by_name.entry(format!("{} (in {})", fr.function, fr.module)).or_default() += c;
    }
    let mut v: Vec<_> = by_name.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    v.truncate(n);
    v
}

pub fn render(i: &SummaryInput) -> String {
    let c = i.counters;
    let recorded = i.stats.samples;
    let lost = c.lost_samples();
    let mut s = String::new();
    let threads: usize = i.profile.processes.iter().map(|p| p.threads.len()).sum();
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
        "  stack errors: kernel {}, user {}; cpu-time read errors {}; unmapped user frames {}",
        c.kernel_stack_errors, c.user_stack_errors, c.cpu_time_errors, i.stats.unmapped_frames
    );
    if recorded > 0 {
        let _ = writeln!(
            s,
            "  idle: {:.1}% of samples ({} on idle CPUs)",
            100.0 * i.stats.idle_samples as f64 / recorded as f64,
            i.stats.idle_samples
        );
    }
    let _ = writeln!(s, "processes: {}, threads: {}", i.profile.processes.len(), threads);
    let busy = recorded - i.stats.idle_samples;
    let top = top_functions(i.profile, 10);
    if !top.is_empty() {
        let _ = writeln!(s, "top functions by self samples:");
        for (name, n) in top {
            let _ =
                writeln!(s, "  {:5.1}%  {:>7}  {}", 100.0 * n as f64 / busy.max(1) as f64, n, name);
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
