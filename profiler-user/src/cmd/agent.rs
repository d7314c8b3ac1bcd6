//! `rsprof-bpf agent`: samples until SIGTERM/SIGINT and, every window, hands the window's
//! events to a writer thread that symbolizes them and spools one pprof profile per process.
//! Sampling and draining go on while a window is written; the last window is written before
//! exit.

use std::sync::mpsc;

use anyhow::Result;

use crate::{
    agent::{config::AgentPlan, spool::Spool, windows},
    cli::args::AgentArgs,
    export::ExportJob,
    session::{Recorder, Signals, messages::Messages},
    symbolize::Service,
    system::host,
};

/// Windows waiting for the writer thread; more are dropped (and counted) rather than let
/// memory grow while symbolizing falls behind.
const QUEUED_WINDOWS: usize = 2;

struct Window {
    job: ExportJob,
    /// Events recycled before the window was read.
    lost: u64,
}

pub fn run(args: AgentArgs) -> Result<()> {
    let plan = AgentPlan::from_args(args)?;
    let msgs = Messages::new(plan.record.quiet);
    let mut spool = Spool::open(&plan.spool, plan.spool_bytes)?;
    host::check_privileges()?;
    let (held, bytes) = spool.held();
    msgs.info(format_args!(
        "spool {}: {held} windows ({bytes} bytes) kept from earlier runs, {} incomplete removed",
        plan.spool.display(),
        spool.stats.incomplete_removed
    ));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let _guard = rt.enter();
    let mut signals = Signals::install()?;
    let mut recorder = Recorder::start(&plan.record, msgs)?;

    let (tx, rx) = mpsc::sync_channel::<Window>(QUEUED_WINDOWS);
    let host = plan.host.clone();
    let symbolizer = Service::start()?;
    let writer = std::thread::Builder::new().name("agent-writer".into()).spawn(move || {
        let mut samples = 0u64;
        for w in rx {
            match windows::profiles(w.job, &host, &symbolizer) {
                Ok((profiles, report)) => {
                    for (module, why) in report.symbolize_errors {
                        msgs.warn(format_args!("symbolizing {module}: {why}"));
                    }
                    for c in report.corrupt {
                        msgs.warn(format_args!("corrupt storage skipped: {c}"));
                    }
                    let before = spool.stats.deleted_for_size;
                    let n: u64 = profiles.iter().map(|p| p.samples).sum();
                    samples += n;
                    for p in &profiles {
                        if let Err(e) = spool.write(p) {
                            msgs.warn(format_args!("spool write failed: {e:#}"));
                        }
                    }
                    let deleted = spool.stats.deleted_for_size - before;
                    msgs.info(format_args!(
                        "window: {} profiles, {n} samples, {} lost (buffer full); spool {} \
                         windows, {deleted} oldest deleted for --spool-size",
                        profiles.len(),
                        w.lost,
                        spool.held().0
                    ));
                }
                Err(e) => msgs.warn(format_args!("window failed: {e:#}")),
            }
        }
        (spool.stats, samples)
    })?;

    let mut cursor = None;
    let mut start = recorder.started();
    let mut dropped = 0u64;
    let stop_reason = loop {
        let until = tokio::time::Instant::now() + plan.window;
        let stop = rt.block_on(recorder.run_until(&mut signals, Some(until)))?;
        if stop.is_some() {
            recorder.stop();
        }
        let (job, w) = recorder.window(cursor, start);
        cursor = Some(w.next);
        start = job.info.end;
        match tx.try_send(Window { job, lost: w.lost }) {
            Ok(()) => {}
            Err(mpsc::TrySendError::Full(_)) => {
                dropped += 1;
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
    let (stats, samples) =
        writer.join().map_err(|_| anyhow::anyhow!("agent writer thread panicked"))?;
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
    Ok(())
}
