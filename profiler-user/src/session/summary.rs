//! The text summary printed when a recording ends: by default a few lines a user acts on
//! ([`short`]), with `-v` the full report ([`full`]) of the profile's [`ProfileStats`] next to
//! the kernel, collector, store and symbolizer counters and the session's other reports.

use std::fmt::Write as _;

use profiler_common::counter;

use crate::{
    bpf::{counters::Counters, unsent::Unsent},
    collect::collector::CollectorStats,
    store::StoreStats,
    symbolize::SymbolizeErrors,
    writers::{Format, stats::ProfileStats},
};

/// What the session knows when it writes the profile (owned: the profile's copy of the report
/// is rendered while the profile is written).
#[derive(Clone, Debug)]
pub struct Recorded {
    /// What was recorded, as the "sampling" line said (`all processes`, `pid 42`, …).
    pub target: String,
    pub duration_s: f64,
    pub frequency: u64,
    pub cpus: usize,
    pub stop_reason: String,
    pub counters: Counters,
    pub stats: CollectorStats,
    pub store: StoreStats,
    pub buffer_bytes: usize,
    /// Off-CPU time the kernel still held at the stop, sent from userspace then.
    pub off_cpu_at_stop: Unsent,
    /// The session's other reports (event loop, unwind tables, stack copies, USDT, BPF run
    /// times), rendered: the end of the full report.
    pub details: String,
}

pub struct SummaryInput<'a> {
    pub recorded: &'a Recorded,
    pub profile: &'a ProfileStats,
    pub symbolize: &'a SymbolizeErrors,
}

/// Stacks cut short above this share of busy samples get a warning in the short summary.
const TRUNCATED_WARN_PCT: f64 = 10.0;
/// Unnamed JIT frames above this share of all JIT frames get one.
const JIT_UNNAMED_WARN_PCT: f64 = 10.0;
/// Functions in the short summary.
const SHORT_TOP: usize = 5;

/// A few lines a user acts on: what was recorded, samples and losses, how many stacks are
/// complete, the top functions, and the warnings that change how to read the profile. The
/// output's line ([`output_line`]) follows it.
pub fn short(i: &SummaryInput) -> String {
    let (r, p) = (i.recorded, i.profile);
    let c = &r.counters;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "rsprof-bpf: recorded {} for {:.1} s at {} Hz on {} CPUs (stopped by {})",
        r.target, r.duration_s, r.frequency, r.cpus, r.stop_reason
    );
    let (recorded, lost) = (r.stats.samples, c.lost_samples());
    let pct = |n: u64, of: u64| 100.0 * n as f64 / of.max(1) as f64;
    let _ = writeln!(
        s,
        "samples: {recorded} recorded, {lost} lost ({:.1}%); {} on idle CPUs, {} in {} \
         processes and {} threads",
        pct(lost, recorded + lost),
        p.idle_samples,
        p.samples - p.idle_samples,
        p.processes,
        p.threads
    );
    let busy = p.samples - p.idle_samples;
    let cut = p.busy_truncated + p.busy_no_stack;
    if busy > 0 {
        let _ = writeln!(
            s,
            "stacks: {:.1}% complete ({} of {busy}); {} cut short, marked [truncated: …]; {} \
             without a stack",
            pct(busy - cut, busy),
            busy - cut,
            p.busy_truncated,
            p.busy_no_stack
        );
    }
    if !p.top_functions.is_empty() {
        let _ = writeln!(s, "top functions by self samples:");
        for (name, n) in p.top_functions.iter().take(SHORT_TOP) {
            let _ = writeln!(s, "  {:5.1}%  {name}", pct(*n, busy));
        }
    }
    for w in warnings(i) {
        let _ = writeln!(s, "warning: {w}");
    }
    s
}

/// The short summary's warnings: what changes how the profile reads, each pointing at `-v`
/// or the option that helps.
fn warnings(i: &SummaryInput) -> Vec<String> {
    let (r, p, sym) = (i.recorded, i.profile, i.symbolize);
    let (c, stats) = (&r.counters, &r.stats);
    let pct = |n: u64, of: u64| 100.0 * n as f64 / of.max(1) as f64;
    let mut w = Vec::new();
    let lost = c.lost_samples();
    if lost > 0 {
        w.push(format!(
            "{lost} samples lost ({} ring buffer full, {} no scratch buffer): a larger \
             --ring-buffer-size or a lower -F keeps them",
            c.get(counter::LOST_RINGBUF_FULL),
            c.get(counter::LOST_NO_SCRATCH)
        ));
    }
    if c.get(counter::SAMPLES_SENT) != stats.samples {
        w.push(format!(
            "the kernel sent {} samples but {} arrived ({} undecodable)",
            c.get(counter::SAMPLES_SENT),
            stats.samples,
            stats.decode_errors
        ));
    }
    let events_lost = c.get(counter::LOST_TASK_EVENTS) + c.get(counter::MAP_EVENTS_LOST);
    if events_lost > 0 {
        w.push(format!(
            "{events_lost} process or mapping events lost: some frames may be unnamed or \
             misattributed to a process's name (-v)"
        ));
    }
    if c.lost_off_cpu() > 0 {
        w.push(format!("{} off-CPU blocks lost (-v)", c.lost_off_cpu()));
    }
    if let Some((a, b)) = p.dropped_ms {
        w.push(format!(
            "the buffer filled: {} events from {:.1} s to {:.1} s were recycled, the profile \
             holds the newest {} samples (--buffer-size keeps more)",
            p.dropped_events,
            a / 1e3,
            b / 1e3,
            p.samples
        ));
    }
    if r.store.oversized > 0 {
        w.push(format!("{} events too large to store were dropped", r.store.oversized));
    }
    if !p.corrupt.is_empty() {
        w.push(format!("{} corrupt storage chunks skipped (-v)", p.corrupt.len()));
    }
    let busy = p.samples - p.idle_samples;
    let cut = p.busy_truncated + p.busy_no_stack;
    if busy > 0 && pct(cut, busy) > TRUNCATED_WARN_PCT {
        w.push(format!(
            "{:.1}% of stacks are incomplete, marked [truncated: …] (why the walks stopped: \
             -v, the `user stacks:` and `stack copies:` lines)",
            pct(cut, busy)
        ));
    }
    let jit = p.jit_named_frames + p.jit_dump_frames + p.jit_unnamed_frames;
    if jit > 0 && pct(p.jit_unnamed_frames, jit) > JIT_UNNAMED_WARN_PCT {
        w.push(format!(
            "{:.1}% of JIT frames unnamed in {} processes (no perf map or jitdump: e.g. node \
             --perf-basic-prof, JAVA perf-map-agent)",
            pct(p.jit_unnamed_frames, jit),
            p.jit_unnamed_processes
        ));
    }
    let py = &stats.python;
    let py_samples = py.samples_with + py.without();
    if py_samples > 0 && pct(py.without(), py_samples) > JIT_UNNAMED_WARN_PCT {
        w.push(format!(
            "{:.1}% of samples of Python processes have no Python frames (reasons: -v)",
            pct(py.without(), py_samples)
        ));
    }
    if py.unsupported_files > 0 {
        w.push(format!(
            "{} Python interpreters of an unsupported version: their Python frames are not read",
            py.unsupported_files
        ));
    }
    if !sym.modules.is_empty() {
        w.push(format!(
            "{} files could not be symbolized, their frames are addresses (-v)",
            sym.modules.len()
        ));
    }
    if let Some(err) = &sym.kernel {
        w.push(format!("kernel frames left as addresses: {err}"));
    }
    if sym.debuginfod.errors > 0 {
        let last = sym.debuginfod.last_error.as_deref().unwrap_or("");
        w.push(format!("debuginfod: {} requests failed; last: {last}", sym.debuginfod.errors));
    }
    if stats.maps_errors > 0 {
        w.push(format!(
            "reading /proc/PID/maps failed {} times (frames may be unmapped)",
            stats.maps_errors
        ));
    }
    w
}

/// Where the profile went and how to look at it.
pub fn output_line(output: &str, format: Format, bytes: u64) -> String {
    format!("wrote {output} ({format}, {:.1} MB): {}\n", bytes as f64 / 1e6, format.viewer_hint())
}

/// The full report (`-v`, and the copy in the profile): every counter, then the session's
/// `details`. The output's own line is apart ([`output_line`]): the profile's copy is written
/// before its size is known.
pub fn full(i: &SummaryInput) -> String {
    let r = i.recorded;
    let (c, stats) = (&r.counters, &r.stats);
    let recorded = stats.samples;
    let lost = c.lost_samples();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "rsprof-bpf: {:.1} s on {} CPUs at {} Hz, stopped by {}",
        r.duration_s, r.cpus, r.frequency, r.stop_reason
    );
    let _ = writeln!(s, "samples: {recorded} recorded, {lost} lost");
    let expected = r.frequency as f64 * r.cpus as f64 * r.duration_s;
    let _ = writeln!(
        s,
        "  lost by cause: ring buffer full {}, no scratch buffer {}; lifecycle events lost {}",
        c.get(counter::LOST_RINGBUF_FULL),
        c.get(counter::LOST_NO_SCRATCH),
        c.get(counter::LOST_TASK_EVENTS)
    );
    let _ = writeln!(
        s,
        "  kernel: {} sent, {} filtered out; expected about {:.0} system-wide",
        c.get(counter::SAMPLES_SENT),
        c.get(counter::SAMPLES_FILTERED),
        expected
    );
    if c.get(counter::SAMPLES_SENT) != recorded {
        let _ = writeln!(
            s,
            "  warning: kernel sent {} samples but {} arrived ({} undecodable)",
            c.get(counter::SAMPLES_SENT),
            recorded,
            stats.decode_errors
        );
    }
    let _ = writeln!(
        s,
        "  stack errors: kernel {}, user {}; cpu-time read errors {}, as of last tick {}; \
         unmapped user frames {}",
        c.get(counter::KERNEL_STACK_ERRORS),
        c.get(counter::USER_STACK_ERRORS),
        c.get(counter::CPU_TIME_ERRORS),
        c.get(counter::CPU_TIME_STALE),
        stats.unmapped_frames
    );
    let _ = writeln!(
        s,
        "  mappings: {} executable mapping records from the kernel ({} lost, {} paths cut); \
         /proc/PID/maps read {} times ({} after the start)",
        stats.map_events,
        c.get(counter::MAP_EVENTS_LOST),
        c.get(counter::MAP_PATH_INCOMPLETE),
        stats.maps_reads,
        stats.maps_reads_late
    );
    if stats.forgotten_processes > 0 || stats.released_modules > 0 || stats.forgotten_threads > 0 {
        let _ = writeln!(
            s,
            "  tables kept bounded: {} exited processes and {} exited threads forgotten (nothing \
             stored referred to them any more; at most {} threads held at once), {} files no \
             longer mapped or referred to released",
            stats.forgotten_processes,
            stats.forgotten_threads,
            stats.peak_threads,
            stats.released_modules
        );
    }
    let walked: u64 =
        (counter::UNWIND_COMPLETE..=counter::UNWIND_FRAME_POINTER).map(|i| c.get(i)).sum();
    if walked > 0 {
        let pct = |n: u64| 100.0 * n as f64 / walked as f64;
        let _ = writeln!(
            s,
            "  user stacks: {walked} walked with unwind tables: complete {} ({:.1}%), depth limit \
             {}, process not loaded {}, no mapping {}, no table {}, no CFI {}, unsupported rule \
             {}, read fault {}, frame pointers ended {}; frame-pointer fallback in {}",
            c.get(counter::UNWIND_COMPLETE),
            pct(c.get(counter::UNWIND_COMPLETE)),
            c.get(counter::UNWIND_DEPTH),
            c.get(counter::UNWIND_NO_PROCESS),
            c.get(counter::UNWIND_NO_MAPPING),
            c.get(counter::UNWIND_NO_TABLE),
            c.get(counter::UNWIND_NO_CFI),
            c.get(counter::UNWIND_UNSUPPORTED),
            c.get(counter::UNWIND_READ_FAULT),
            c.get(counter::UNWIND_FRAME_POINTER),
            c.get(counter::UNWIND_USED_FP),
        );
        let ((c1, t1), (c2, t2)) = (stats.user_stacks_first_second, stats.user_stacks_after);
        if t1 + t2 > 0 {
            let pct = |c: u64, t: u64| 100.0 * c as f64 / t.max(1) as f64;
            let after = if t2 > 0 { format!("{:.1}%", pct(c2, t2)) } else { "-".to_owned() };
            let _ = writeln!(
                s,
                "  in the profile (stack copies walked): {} of {} user stacks complete ({:.1}%); \
                 first second of samples {:.1}%, after it {after}",
                c1 + c2,
                t1 + t2,
                pct(c1 + c2, t1 + t2),
                pct(c1, t1),
            );
        }
        let (copied, failed) =
            (c.get(counter::FORK_WALKER_COPIES), c.get(counter::FORK_WALKER_COPY_FAILED));
        if copied + failed > 0 {
            let _ = writeln!(
                s,
                "  forked processes: {copied} unwound from their fork on with their parent's \
                 tables, {failed} not (walker map full)"
            );
        }
        let (gone, cleared) =
            (c.get(counter::WALKER_EXIT_DELETES), c.get(counter::WALKER_EXEC_CLEARS));
        if gone + cleared > 0 {
            let _ = writeln!(
                s,
                "  walker entries: {gone} deleted by the kernel at exit, {cleared} emptied at \
                 exec"
            );
        }
        let early = c.get(counter::EARLY_ADDED);
        let (busy, changed) = (c.get(counter::EARLY_BUSY), c.get(counter::EARLY_FILE_CHANGED));
        if early + busy + changed > 0 {
            let _ = writeln!(
                s,
                "  early mappings: {early} code mappings of loaded files walked from the mmap or \
                 exec on, before userspace read them ({} removed again by munmap/mprotect); {busy} \
                 skipped (another thread was adding one), {changed} not (file rewritten in place)",
                c.get(counter::EARLY_REMOVED),
            );
        }
    }
    let tracked = c.get(counter::OFF_CPU_SENT)
        + c.get(counter::OFF_CPU_SUMMED)
        + c.get(counter::OFF_CPU_NOT_CAPTURED)
        + c.get(counter::OFF_CPU_LOST_RINGBUF_FULL)
        + c.get(counter::OFF_CPU_LOST_MAP_FULL);
    if tracked > 0 || stats.off_cpu_samples > 0 {
        let _ = writeln!(
            s,
            "off-CPU: {tracked} blocks ended: {} sent one by one, {} shorter than --off-cpu-min \
             summed per thread, {} long sent without a stack (not walked), {} lost (ring buffer \
             full {}, thread map full {})",
            c.get(counter::OFF_CPU_SENT),
            c.get(counter::OFF_CPU_SUMMED),
            c.get(counter::OFF_CPU_NOT_CAPTURED),
            c.lost_off_cpu(),
            c.get(counter::OFF_CPU_LOST_RINGBUF_FULL),
            c.get(counter::OFF_CPU_LOST_MAP_FULL),
        );
        let _ = writeln!(
            s,
            "  {} records arrived ({} of summed blocks; {} sums deferred, ring buffer full) \
             carrying {:.1} ms off-CPU in {} blocks; stacks walked {}, stack errors {}",
            stats.off_cpu_samples,
            c.get(counter::OFF_CPU_SUMS_SENT),
            c.get(counter::OFF_CPU_SUMS_DEFERRED),
            stats.off_cpu_ns as f64 / 1e6,
            stats.off_cpu_blocks,
            c.get(counter::OFF_CPU_WALKS),
            c.get(counter::OFF_CPU_STACK_ERRORS),
        );
        let (copies, lost) = (c.get(counter::OFF_CPU_COPIES), c.get(counter::OFF_CPU_COPY_LOST));
        if copies + lost > 0 {
            let _ = writeln!(
                s,
                "  user stacks of blocks whose tables were not loaded yet: {copies} sent with a \
                 copy of the stack ({} finished from it in userspace, {} copies dropped), {lost} \
                 without (copy budget, unreadable stack or ring full: cut and flagged)",
                stats.off_cpu_copies_used, stats.off_cpu_copies_dropped,
            );
        }
        let u = &r.off_cpu_at_stop;
        if u.open_blocks + u.sums > 0 {
            let _ = writeln!(
                s,
                "  at the stop: {} blocks still open at the stop, cut there ({:.1} ms), {} sums                  of short blocks not sent yet ({:.1} ms); {} of them without their stack",
                u.open_blocks,
                u.open_ns as f64 / 1e6,
                u.sums,
                u.sum_ns as f64 / 1e6,
                u.without_stack,
            );
        }
        let sent = c.get(counter::OFF_CPU_SENT)
            + c.get(counter::OFF_CPU_SUMS_SENT)
            + c.get(counter::OFF_CPU_NOT_CAPTURED)
            + u.open_blocks
            + u.sums;
        if sent != stats.off_cpu_samples {
            let _ = writeln!(
                s,
                "  warning: kernel sent {sent} off-CPU records but {} arrived",
                stats.off_cpu_samples
            );
        }
    }
    let p = i.profile;
    if p.jit_named_frames + p.jit_dump_frames + p.jit_unnamed_frames > 0 {
        let _ = writeln!(
            s,
            "JIT frames: {} named from perf maps, {} from jitdump, {} unnamed in {} processes",
            p.jit_named_frames, p.jit_dump_frames, p.jit_unnamed_frames, p.jit_unnamed_processes
        );
    }
    let d = &stats.jitdumps;
    if d.opened + d.refused > 0 {
        let _ = writeln!(
            s,
            "  jitdumps: {} read ({} code loads, {} moves, {} debug-info, {} unwinding-info, {} \
             close records; {}), {} refused (not a regular file, another user's, not the file \
             mapped), {} with a bad header, {} stopped at a bad record, {} records of unknown \
             kinds skipped, {} stopped at the {} bound, {} timed by the CPU counter",
            d.opened,
            d.loads,
            d.moves,
            d.debug_info,
            d.unwinding_info,
            d.closes,
            human_bytes(d.bytes as usize).trim(),
            d.refused,
            d.bad_header,
            d.bad_record,
            d.unknown,
            d.over_bound,
            human_bytes(crate::collect::jitdump::MAX_DUMP_BYTES as usize).trim(),
            d.arch_timestamps
        );
    }
    if let Some(line) = stats.python.render() {
        let _ = writeln!(s, "{line}");
        if let Some(line) = stats.python_off_cpu.render_off_cpu() {
            let _ = writeln!(s, "{line}");
        }
    }
    let m = &stats.perf_maps;
    if m.opened + m.refused > 0 {
        let _ = writeln!(
            s,
            "  perf maps: {} read ({} lines, {}), {} garbage lines skipped, {} stopped at the \
             {} bound, {} refused (symlink, not a regular file, or another user's)",
            m.opened,
            m.lines,
            human_bytes(m.bytes as usize).trim(),
            m.garbage,
            m.over_bound,
            human_bytes(crate::collect::perfmap::MAX_MAP_BYTES as usize).trim(),
            m.refused
        );
    }
    if stats.maps_errors > 0 {
        let _ = writeln!(
            s,
            "  warning: reading /proc/PID/maps of a live process failed {} times (frames may be \
             unmapped)",
            stats.maps_errors
        );
    }
    let sym = i.symbolize;
    for (module, err) in sym.modules.iter().take(10) {
        let _ = writeln!(s, "  warning: could not symbolize {module}: {err}");
    }
    if sym.modules.len() > 10 {
        let _ = writeln!(s, "  ({} more files could not be symbolized)", sym.modules.len() - 10);
    }
    if crate::symbolize::debuginfod::current().is_some() || !sym.debuginfod.is_empty() {
        let d = &sym.debuginfod;
        let _ = write!(
            s,
            "  debuginfod: {} files fetched ({:.1} MiB), {} not found, {} errors",
            d.fetched,
            d.bytes as f64 / (1 << 20) as f64,
            d.not_found,
            d.errors
        );
        if d.cached > 0 {
            let _ = write!(s, "; {} from the cache", d.cached);
        }
        let _ = writeln!(s);
        if let Some(e) = &d.last_error {
            let _ = writeln!(s, "  warning: debuginfod: {e}");
        }
    }
    if let Some(err) = &sym.kernel {
        let _ = writeln!(s, "  warning: kernel frames left as addresses: {err}");
    }
    if sym.unreadable_frames > 0 {
        let _ = writeln!(
            s,
            "  {} frames of files that could not be opened are shown as addresses",
            sym.unreadable_frames
        );
    }
    if recorded > 0 {
        let _ = writeln!(
            s,
            "  idle: {:.1}% of samples ({} on idle CPUs)",
            100.0 * stats.idle_samples as f64 / recorded as f64,
            stats.idle_samples
        );
    }
    match p.dropped_ms {
        Some((a, b)) => {
            let _ = writeln!(
                s,
                "buffer: {} full, recycled {} events from {:.3}s to {:.3}s; the profile holds the \
                 newest {} samples",
                human_bytes(r.buffer_bytes),
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
                human_bytes(r.buffer_bytes)
            );
        }
    }
    if r.store.table_pressure_recycles > 0 {
        let _ = writeln!(
            s,
            "  {} of those chunks were recycled early: stack and string tables reached half the \
             buffer size (many distinct stacks); a larger --buffer-size keeps more",
            r.store.table_pressure_recycles
        );
    }
    if r.store.oversized > 0 {
        let _ =
            writeln!(s, "  warning: {} events too large to store were dropped", r.store.oversized);
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
    s.push_str(&r.details);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn recorded(counters: Counters) -> Recorded {
        Recorded {
            target: "pid 42".into(),
            duration_s: 2.0,
            frequency: 999,
            cpus: 2,
            stop_reason: "duration".into(),
            counters,
            stats: CollectorStats { samples: 3000, ..Default::default() },
            store: StoreStats::default(),
            buffer_bytes: 1 << 20,
            off_cpu_at_stop: Unsent::default(),
            details: "event loop: …\n".into(),
        }
    }

    fn profile() -> ProfileStats {
        ProfileStats {
            processes: 1,
            threads: 2,
            samples: 3000,
            top_functions: (0..10).map(|i| (format!("f{i} (in app)"), 10 - i)).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn short_summary_is_a_few_lines_and_warns_of_what_matters() {
        let sent =
            Counters::read(|i| Ok::<_, ()>(if i == counter::SAMPLES_SENT { 3000 } else { 0 }));
        let r = recorded(sent.unwrap());
        let (p, sym) = (profile(), SymbolizeErrors::default());
        let text = short(&SummaryInput { recorded: &r, profile: &p, symbolize: &sym });
        assert_eq!(text.lines().count(), 9, "{text}");
        assert!(text.contains("samples: 3000 recorded, 0 lost"), "{text}");
        assert!(text.contains("stacks: 100.0% complete (3000 of 3000)"), "{text}");
        assert!(text.contains("f4 (in app)") && !text.contains("f5 (in app)"), "five: {text}");
        assert!(!text.contains("warning"), "{text}");

        // Lost samples, a recycled buffer and many cut stacks each get a line.
        let lossy = Counters::read(|i| {
            Ok::<_, ()>(match i {
                counter::SAMPLES_SENT => 3000,
                counter::LOST_RINGBUF_FULL => 7,
                _ => 0,
            })
        });
        let r = recorded(lossy.unwrap());
        let p = ProfileStats {
            busy_truncated: 600,
            dropped_ms: Some((0.0, 500.0)),
            dropped_events: 400,
            ..profile()
        };
        let text = short(&SummaryInput { recorded: &r, profile: &p, symbolize: &sym });
        let warnings: Vec<&str> = text.lines().filter(|l| l.starts_with("warning: ")).collect();
        assert_eq!(warnings.len(), 3, "{text}");
        assert!(warnings[0].contains("7 samples lost"), "{text}");
        assert!(warnings[1].contains("recycled"), "{text}");
        assert!(warnings[2].contains("20.0% of stacks are incomplete"), "{text}");

        // The full report has every counter and the session's details.
        let full = full(&SummaryInput { recorded: &r, profile: &p, symbolize: &sym });
        assert!(full.contains("lost by cause: ring buffer full 7"), "{full}");
        assert!(full.contains("f9 (in app)") && full.ends_with("event loop: …\n"), "{full}");
    }
}
