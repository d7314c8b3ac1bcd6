//! The text summary printed when a recording ends: the profile's [`ProfileStats`] next to the
//! kernel, collector, store and symbolizer counters.

use std::fmt::Write as _;

use profiler_common::counter;

use crate::{
    bpf::counters::Counters,
    collect::collector::CollectorStats,
    store::StoreStats,
    symbolize::SymbolizeErrors,
    writers::{Format, stats::ProfileStats},
};

pub struct SummaryInput<'a> {
    pub profile: &'a ProfileStats,
    pub store: &'a StoreStats,
    pub buffer_bytes: usize,
    pub counters: &'a Counters,
    pub stats: &'a CollectorStats,
    pub symbolize: &'a SymbolizeErrors,
    pub duration_s: f64,
    pub frequency: u64,
    pub cpus: usize,
    pub output: &'a str,
    pub format: Format,
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
            i.stats.decode_errors
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
        i.stats.unmapped_frames
    );
    let _ = writeln!(
        s,
        "  mappings: {} executable mapping records from the kernel ({} lost, {} paths cut); \
         /proc/PID/maps read {} times ({} after the start)",
        i.stats.map_events,
        c.get(counter::MAP_EVENTS_LOST),
        c.get(counter::MAP_PATH_INCOMPLETE),
        i.stats.maps_reads,
        i.stats.maps_reads_late
    );
    if i.stats.forgotten_processes > 0
        || i.stats.released_modules > 0
        || i.stats.forgotten_threads > 0
    {
        let _ = writeln!(
            s,
            "  tables kept bounded: {} exited processes and {} exited threads forgotten (nothing \
             stored referred to them any more; at most {} threads held at once), {} files no \
             longer mapped or referred to released",
            i.stats.forgotten_processes,
            i.stats.forgotten_threads,
            i.stats.peak_threads,
            i.stats.released_modules
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
        let ((c1, t1), (c2, t2)) = (i.stats.user_stacks_first_second, i.stats.user_stacks_after);
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
    }
    let tracked = c.get(counter::OFF_CPU_SENT)
        + c.get(counter::OFF_CPU_SUMMED)
        + c.get(counter::OFF_CPU_NOT_CAPTURED)
        + c.get(counter::OFF_CPU_LOST_RINGBUF_FULL)
        + c.get(counter::OFF_CPU_LOST_MAP_FULL);
    if tracked > 0 || i.stats.off_cpu_samples > 0 {
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
            i.stats.off_cpu_samples,
            c.get(counter::OFF_CPU_SUMS_SENT),
            c.get(counter::OFF_CPU_SUMS_DEFERRED),
            i.stats.off_cpu_ns as f64 / 1e6,
            i.stats.off_cpu_blocks,
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
                i.stats.off_cpu_copies_used, i.stats.off_cpu_copies_dropped,
            );
        }
        let sent = c.get(counter::OFF_CPU_SENT)
            + c.get(counter::OFF_CPU_SUMS_SENT)
            + c.get(counter::OFF_CPU_NOT_CAPTURED);
        if sent != i.stats.off_cpu_samples {
            let _ = writeln!(
                s,
                "  warning: kernel sent {sent} off-CPU records but {} arrived",
                i.stats.off_cpu_samples
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
    let d = &i.stats.jitdumps;
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
    if let Some(line) = i.stats.python.render() {
        let _ = writeln!(s, "{line}");
        if let Some(line) = i.stats.python_off_cpu.render_off_cpu() {
            let _ = writeln!(s, "{line}");
        }
    }
    let m = &i.stats.perf_maps;
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
    if i.stats.maps_errors > 0 {
        let _ = writeln!(
            s,
            "  warning: reading /proc/PID/maps of a live process failed {} times (frames may be \
             unmapped)",
            i.stats.maps_errors
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
        "wrote {} ({}, {:.1} MB): {}",
        i.output,
        i.format,
        i.output_bytes as f64 / 1e6,
        i.format.viewer_hint()
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
