//! The agent's writer thread: each window's events symbolized (through the agent's one
//! symbolizer, so each address is named once) and spooled as one pprof profile per service,
//! with the window's metrics. Sampling goes on while it works; windows it falls behind on are
//! dropped by the loop, not queued without bound.

use std::{
    sync::{Arc, mpsc},
    thread::JoinHandle,
    time::Instant,
};

use crate::{
    agent::{metrics::AgentMetrics, sinks::forward::Queue, windows},
    export::ExportJob,
    session::messages::Messages,
    symbolize::{Service, ServiceStats},
};

/// One window for the writer.
pub struct Window {
    pub job: ExportJob,
    /// Events recycled before the window was read.
    pub lost: u64,
}

/// What the writer thread shares with the loop.
pub struct Context {
    pub queue: Arc<Queue>,
    pub metrics: Arc<AgentMetrics>,
    pub host: String,
    pub symbolizer: Arc<Service>,
    pub msgs: Messages,
}

/// Writes windows from `rx` until the loop drops its sender; the thread returns the samples
/// written.
pub fn spawn(rx: mpsc::Receiver<Window>, cx: Context) -> std::io::Result<JoinHandle<u64>> {
    std::thread::Builder::new().name("agent-writer".into()).spawn(move || {
        let mut samples = 0u64;
        let mut seen = ServiceStats::default();
        for w in rx {
            samples += write(&cx, w, &mut seen);
            release_memory(&cx.metrics);
        }
        samples
    })
}

/// Symbolizes and spools one window; returns its samples.
fn write(cx: &Context, w: Window, seen: &mut ServiceStats) -> u64 {
    let (m, msgs, queue) = (&cx.metrics, cx.msgs, &cx.queue);
    let began = Instant::now();
    m.windows.events_lost.inc_by(w.lost);
    let (profiles, report) = match windows::profiles(w.job, &cx.host, &cx.symbolizer) {
        Ok(done) => done,
        Err(e) => {
            m.windows.failed.inc();
            msgs.warn(format_args!("window failed: {e:#}"));
            return 0;
        }
    };
    for (module, why) in report.symbolize_errors {
        msgs.warn(format_args!("symbolizing {module}: {why}"));
    }
    for c in report.corrupt {
        msgs.warn(format_args!("corrupt storage skipped: {c}"));
    }
    let before = queue.with_spool(|s| s.stats);
    let n: u64 = profiles.iter().map(|p| p.samples).sum();
    for p in &profiles {
        m.services.add(&p.labels.service_name, p.samples);
        let t = Instant::now();
        let written = queue.write(p);
        m.spool_write(written.is_ok(), t.elapsed());
        if let Err(e) = written {
            msgs.warn(format_args!("spool write failed: {e:#}"));
        }
    }
    queue.written();
    let (after, (held, bytes)) = queue.with_spool(|s| (s.stats, s.held()));
    let deleted = after.deleted_for_size - before.deleted_for_size;
    m.windows.produced.inc();
    let st = cx.symbolizer.stats();
    m.symbolizer(&st, seen);
    *seen = st;
    m.windows.symbolize_seconds.observe(report.symbolize_time.as_secs_f64());
    m.windows.profiles.inc_by(profiles.len() as u64);
    m.spool.deleted.inc_by(deleted);
    m.spool.written.inc_by(after.written - before.written);
    m.spool.written_bytes.inc_by(after.bytes_written - before.bytes_written);
    m.spool.windows.set(held as i64);
    m.spool.bytes.set(bytes as i64);
    m.windows.write_seconds.observe(began.elapsed().as_secs_f64());
    msgs.info(format_args!(
        "window: {} profiles, {n} samples, {} lost (buffer full); spool {held} windows, \
         {deleted} oldest deleted for --spool-size",
        profiles.len(),
        w.lost,
    ));
    n
}

/// A window's profiles, and the symbol tables of files no longer mapped, are freed by now;
/// hand the free pages inside the heap back, not only its top (side by side at 99 Hz for 8
/// minutes: heap 10 MiB with this, 11 without; both flat).
fn release_memory(m: &AgentMetrics) {
    // SAFETY: malloc_trim takes the arena lock like any allocation.
    unsafe { libc::malloc_trim(0) };
    // SAFETY: mallinfo2 only reads the arena's statistics (under its lock).
    let heap = unsafe { libc::mallinfo2() };
    m.windows.heap_in_use_bytes.set((heap.uordblks + heap.hblkhd) as i64);
    m.windows.heap_free_bytes.set(heap.fordblks as i64);
}
