//! The agent's loop: samples until SIGTERM/SIGINT and, every window, hands the window's
//! events to the writer thread (`writer`) that symbolizes them and spools one pprof profile
//! per service.
//! Sampling and draining go on while a window is written; the last window is written before
//! exit. Remote sinks each have a forwarder thread delivering spooled windows
//! (`agent::sinks::forward`); on stop they get what is left of the exit budget.

use std::{
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::Result;

use crate::{
    agent::{
        config::AgentPlan,
        flight,
        metrics::AgentMetrics,
        sinks::{
            RemoteSink,
            clickhouse::ClickHouseSink,
            forward::{Forwarders, Queue, SinkStats},
            pyroscope::PyroscopeSink,
        },
        spool::Spool,
        writer,
    },
    session::{Recorder, Signals, messages::Messages},
    symbolize::Service,
    system::host,
};

/// Windows waiting for the writer thread; more are dropped (and counted) rather than let
/// memory grow while symbolizing falls behind.
const QUEUED_WINDOWS: usize = 2;
/// From the stop signal to the end of the last deliveries: SIGTERM must exit within 5 s.
const EXIT_BUDGET: Duration = Duration::from_millis(4500);

/// Runs the agent of `plan` until SIGTERM/SIGINT.
pub fn run(plan: AgentPlan) -> Result<()> {
    let msgs = Messages::new(plan.record.quiet);
    let sinks = remote_sinks(&plan)?;
    let spool = Spool::open(&plan.spool, plan.spool_bytes)?;
    host::check_privileges()?;
    host::check_kernel()?;
    let names: Vec<&'static str> = sinks.iter().map(|s| s.name()).collect();
    let queue = Queue::new(spool, &names, plan.keep_spool)?;
    let (held, bytes, incomplete) =
        queue.with_spool(|s| (s.held().0, s.held().1, s.stats.incomplete_removed));
    msgs.info(format_args!(
        "spool {}: {held} windows ({bytes} bytes) kept from earlier runs, {incomplete} \
         incomplete removed{}",
        plan.spool.display(),
        match (names.is_empty(), plan.keep_spool) {
            (true, _) => "",
            (false, true) => "; remote sinks are sent what they lack",
            (false, false) => "; a queue for the remote sinks, delivered windows deleted",
        }
    ));
    let metrics = AgentMetrics::new(&plan.host, Some(queue.clone()));
    metrics.spool.incomplete_removed.inc_by(incomplete);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let _guard = rt.enter();
    let mut signals = Signals::install()?;
    // Bound before loading BPF so a taken port fails the start at once.
    let listener = match plan.metrics {
        Some(addr) => Some(rt.block_on(crate::agent::metrics::bind(addr))?),
        None => None,
    };
    ignore_sighup(msgs)?;
    let wake = std::sync::Arc::new(tokio::sync::Notify::new());
    let mut recorder = Recorder::start(&plan.record, msgs, None)?;
    // One symbolizer for windows and dumps: each address is named once.
    let symbolizer = std::sync::Arc::new(Service::start(recorder.kernel_namer())?);
    let flight = (plan.flight.as_ref())
        .map(|f| flight::FlightServer::start(f, wake.clone(), symbolizer.clone(), msgs))
        .transpose()?;
    let mut windows = recorder.windows(wake, plan.flight.as_ref().map(|f| f.keep));
    if let Some(listener) = listener {
        let (req_tx, req_rx) = tokio::sync::mpsc::channel(4);
        recorder.serve(req_rx);
        msgs.info(format_args!("metrics on http://{}/metrics", listener.local_addr()?));
        rt.spawn(crate::agent::metrics::serve(listener, metrics.clone(), req_tx));
    }

    let (tx, rx) = mpsc::sync_channel::<writer::Window>(QUEUED_WINDOWS);
    let forwarders = Forwarders::start(&queue, sinks, msgs)?;
    let writer = writer::spawn(
        rx,
        writer::Context {
            queue: queue.clone(),
            metrics: metrics.clone(),
            host: plan.host.clone(),
            symbolizer: symbolizer.clone(),
            msgs,
        },
    )?;

    let mut dropped = 0u64;
    let mut stopped_at = Instant::now();
    let stop_reason = loop {
        let until = tokio::time::Instant::now() + plan.window;
        let stop = flight::run_window(
            &rt,
            &mut recorder,
            &windows,
            &mut signals,
            until,
            flight.as_ref(),
            msgs,
        )?;
        if stop.is_some() {
            stopped_at = Instant::now();
            recorder.stop();
        }
        let (job, lost) = windows.next(&mut recorder);
        match tx.try_send(writer::Window { job, lost }) {
            Ok(()) => {}
            Err(mpsc::TrySendError::Full(_)) => {
                dropped += 1;
                metrics.windows.dropped.inc();
                msgs.warn(format_args!(
                    "window dropped: the writer is {QUEUED_WINDOWS} windows behind ({dropped} \
                     dropped so far)"
                ));
            }
            Err(mpsc::TrySendError::Disconnected(_)) => anyhow::bail!("agent writer thread died"),
        }
        if let Some(reason) = stop {
            break reason;
        }
    };
    drop(tx);
    let samples = writer.join().map_err(|_| anyhow::anyhow!("agent writer thread panicked"))?;
    // The last window is spooled: deliver what the budget allows, leave the rest spooled.
    forwarders.finish(stopped_at + EXIT_BUDGET);
    let stats = queue.with_spool(|s| s.stats);
    let counters = recorder.counters()?;
    msgs.notice(format_args!(
        "agent stopped by {stop_reason}: {} windows written ({} bytes, {samples} samples), {} \
         deleted for --spool-size, {dropped} dropped (writer behind), {} samples lost in the \
         kernel",
        stats.written,
        stats.bytes_written,
        stats.deleted_for_size,
        counters.lost_samples()
    ));
    msgs.notice(format_args!("{}", symbolizer_summary(&symbolizer.stats())));
    for s in queue.stats() {
        msgs.notice(format_args!("{}", sink_summary(&s)));
    }
    Ok(())
}

/// The remote sinks configured, in a fixed order (their index in the spool's markers).
fn remote_sinks(plan: &AgentPlan) -> Result<Vec<Box<dyn RemoteSink>>> {
    let mut sinks: Vec<Box<dyn RemoteSink>> = Vec::new();
    if let Some((url, days)) = &plan.clickhouse {
        sinks.push(Box::new(ClickHouseSink::new(url, *days)?));
    }
    if let Some((url, auth)) = &plan.pyroscope {
        sinks.push(Box::new(PyroscopeSink::new(url, auth.clone())?));
    }
    Ok(sinks)
}

/// The symbolizer's line of the exit summary: how well its caches did and what they evicted.
fn symbolizer_summary(s: &crate::symbolize::ServiceStats) -> String {
    let pct = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 * 100.0 / b as f64 };
    format!(
        "symbolizer: {} lookups, {:.1}% named from the cache, {} names held ({} KiB), {} \
         evicted; {} files held parsed, {} evicted, {} rebuilds; DWARF parsed {} times, {} \
         copies failed; {:.3} s over {} calls",
        s.asked,
        pct(s.cached, s.asked),
        s.entries,
        s.bytes / 1024,
        s.evicted,
        s.files,
        s.files_evicted,
        s.rebuilds,
        s.dwarf_reads,
        s.dwarf_copy_failures,
        s.seconds,
        s.calls
    )
}

/// One line of the exit summary per sink.
fn sink_summary(s: &SinkStats) -> String {
    let latency = match s.last_latency {
        Some(l) if s.latency.count > 0 => format!(
            ", batch latency last {:.1} ms mean {:.1} ms",
            l.as_secs_f64() * 1e3,
            s.latency.sum_secs * 1e3 / s.latency.count as f64
        ),
        _ => String::new(),
    };
    format!(
        "sink {}: {} windows delivered in {} batches, {} rejected, {} dropped (--spool-size), {} \
         attempts, {} retries{latency}",
        s.name, s.delivered, s.batches, s.rejected, s.dropped, s.attempts, s.retries
    )
}

/// SIGHUP (a closed terminal, or `systemctl reload` habits) must not end the agent. The
/// configuration is read once at start; say so rather than pretend to reload.
fn ignore_sighup(msgs: Messages) -> Result<()> {
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            msgs.warn(format_args!(
                "SIGHUP ignored: the configuration is read only at start; restart the agent to \
                 apply changes"
            ));
        }
    });
    Ok(())
}
