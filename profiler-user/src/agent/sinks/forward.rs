//! The forwarder: one thread per remote sink hands it the spooled windows, oldest first.
//!
//! The agent's writer thread spools every window ([`Queue::write`]) and wakes the forwarders.
//! Each takes the oldest windows its sink is not done with (up to [`BATCH_MAX`]), reads them
//! from disk (so memory holds one batch per sink, whatever the backlog), and delivers them
//! together ([`RemoteSink::deliver_batch`], a result per window): `Retry` errors are retried
//! with capped exponential backoff and jitter until the server takes it or the spool deletes
//! it for size (dropped, counted); `Reject`ed windows are not sent again (counted, the first
//! error of each kind logged with the server's message). On stop, the forwarders get a
//! deadline to deliver what is pending; whatever is left stays spooled for the next start.

use std::{
    collections::HashSet,
    fs,
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use crate::{
    agent::{
        sinks::{RemoteSink, SinkError},
        spool::{Spool, WindowMeta},
        windows::WindowProfile,
    },
    session::messages::Messages,
};

/// Backoff after the first failed attempt, doubled per failure up to [`MAX_BACKOFF`].
pub const MIN_BACKOFF: Duration = Duration::from_secs(1);
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// Upper bounds (seconds) of the delivery latency histogram's buckets (Prometheus' defaults).
pub const LATENCY_BUCKETS: [f64; 11] =
    [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
/// Windows handed to a sink at once (the oldest pending): a sink that batches sends them in
/// one request (ClickHouse: one insert per table, where one per window made a data part per
/// process and window), so a backlog after an outage drains quickly too.
pub const BATCH_MAX: usize = 64;
/// Distinct reject kinds logged per sink; more are only counted.
const LOGGED_KINDS: usize = 32;

/// Latencies of successful batch deliveries, as a cumulative-ready histogram.
#[derive(Clone, Debug, Default)]
pub struct LatencyHistogram {
    /// Per bucket of [`LATENCY_BUCKETS`] (not cumulative), then the +Inf bucket.
    pub counts: [u64; LATENCY_BUCKETS.len() + 1],
    pub sum_secs: f64,
    pub count: u64,
}

impl LatencyHistogram {
    pub fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        let i = LATENCY_BUCKETS.iter().position(|&b| s <= b).unwrap_or(LATENCY_BUCKETS.len());
        self.counts[i] += 1;
        self.sum_secs += s;
        self.count += 1;
    }
}

/// One remote sink's counters (for the exit summary and a metrics endpoint).
#[derive(Clone, Debug, Default)]
pub struct SinkStats {
    pub name: &'static str,
    /// Window delivery attempts, successful or not.
    pub attempts: u64,
    /// Batches handed to the sink (`deliver_batch` calls).
    pub batches: u64,
    pub delivered: u64,
    /// Window attempts that failed with a retryable error.
    pub retries: u64,
    pub rejected: u64,
    /// Windows the sink never had: deleted for `--spool-size` first, or unreadable.
    pub dropped: u64,
    pub last_latency: Option<Duration>,
    pub latency: LatencyHistogram,
}

struct State {
    spool: Spool,
    stats: Vec<SinkStats>,
    /// Set on stop: deliver what is pending until then, without waiting out backoffs.
    deadline: Option<Instant>,
}

/// The spool shared by the writer thread and the forwarders.
pub struct Queue {
    state: Mutex<State>,
    /// Signalled when a window lands and on stop.
    wake: Condvar,
}

impl Queue {
    /// `spool` with `sinks`' delivery markers attached (see [`Spool::attach_sinks`]).
    pub fn new(mut spool: Spool, sinks: &[&'static str], keep: bool) -> Result<Arc<Self>> {
        spool.attach_sinks(sinks, keep)?;
        let stats = sinks.iter().map(|&name| SinkStats { name, ..Default::default() }).collect();
        Ok(Arc::new(Self {
            state: Mutex::new(State { spool, stats, deadline: None }),
            wake: Condvar::new(),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Spools a window. The forwarders wake at [`Queue::written`], once a window pass's
    /// windows are all in: woken at each write, a forwarder could take the first window of a
    /// pass alone (a CI run's Pyroscope test saw no batch of more than one), which costs a
    /// sink that batches a request per window.
    pub fn write(&self, w: &WindowProfile) -> Result<()> {
        self.lock().spool.write(w)?;
        Ok(())
    }

    /// Wakes the forwarders for the windows written since the last call.
    pub fn written(&self) {
        self.wake.notify_all();
    }

    /// Runs `f` on the spool (its stats, what it holds).
    pub fn with_spool<T>(&self, f: impl FnOnce(&Spool) -> T) -> T {
        f(&self.lock().spool)
    }

    /// Every sink's counters now.
    pub fn stats(&self) -> Vec<SinkStats> {
        let st = self.lock();
        let mut v = st.stats.clone();
        for (i, s) in v.iter_mut().enumerate() {
            s.dropped = st.spool.dropped(i);
        }
        v
    }

    /// Every sink's counters and the windows it has yet to be sent, for a metrics scrape.
    pub fn stats_and_backlog(&self) -> Vec<(SinkStats, usize)> {
        let backlog: Vec<usize> = {
            let st = self.lock();
            (0..st.stats.len()).map(|i| st.spool.backlog(i)).collect()
        };
        self.stats().into_iter().zip(backlog).collect()
    }

    /// Asks the forwarders to finish by `deadline`.
    fn stop(&self, deadline: Instant) {
        self.lock().deadline = Some(deadline);
        self.wake.notify_all();
    }
}

/// The running forwarder threads.
pub struct Forwarders {
    queue: Arc<Queue>,
    threads: Vec<JoinHandle<()>>,
}

impl Forwarders {
    /// Starts one thread per sink; `sinks[i]` is sink `i` of the queue.
    pub fn start(
        queue: &Arc<Queue>,
        sinks: Vec<Box<dyn RemoteSink>>,
        msgs: Messages,
    ) -> Result<Self> {
        let mut threads = Vec::new();
        for (i, sink) in sinks.into_iter().enumerate() {
            let q = queue.clone();
            let t = std::thread::Builder::new()
                .name(format!("sink-{}", sink.name()))
                .spawn(move || forward(&q, i, sink, msgs))?;
            threads.push(t);
        }
        Ok(Self { queue: queue.clone(), threads })
    }

    /// Lets the forwarders deliver what is pending until `deadline`, then returns; a thread
    /// still in a request then is abandoned (the process exits), its window stays spooled.
    pub fn finish(self, deadline: Instant) {
        self.queue.stop(deadline);
        for t in self.threads {
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

/// Sink `idx`'s thread.
fn forward(q: &Queue, idx: usize, mut sink: Box<dyn RemoteSink>, msgs: Messages) {
    let name = sink.name();
    let mut logged: HashSet<String> = HashSet::new();
    let mut failing_since: Option<u64> = None;
    // Kept across batches: a server that is down stays backed off from.
    let mut backoff = MIN_BACKOFF;
    loop {
        let stems = {
            let mut st = q.lock();
            loop {
                if st.deadline.is_some_and(|d| Instant::now() >= d) {
                    return;
                }
                let stems = st.spool.pending(idx, BATCH_MAX);
                if !stems.is_empty() {
                    break stems;
                }
                if st.deadline.is_some() {
                    return;
                }
                st = q.wake.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        let mut batch: Vec<(String, (WindowMeta, Vec<u8>))> = Vec::new();
        for stem in stems {
            let (labels, profile) = q.lock().spool.paths(&stem);
            match read_window(&labels, &profile) {
                Ok(w) => batch.push((stem, w)),
                Err(e) => {
                    msgs.warn(format_args!(
                        "{name}: spooled window {stem} unreadable, dropped: {e:#}"
                    ));
                    let _ = q.lock().spool.finish(idx, &stem, false);
                }
            }
        }
        while !batch.is_empty() {
            let (stems, windows): (Vec<String>, Vec<(WindowMeta, Vec<u8>)>) =
                std::mem::take(&mut batch).into_iter().unzip();
            let t = Instant::now();
            let results = sink.deliver_batch(&windows);
            let took = t.elapsed();
            // A window without a result stays pending and is handed over again.
            debug_assert_eq!(results.len(), windows.len(), "{name}: one result per window");
            let mut st = q.lock();
            let mut failed: Option<anyhow::Error> = None;
            let mut finished = Vec::new();
            let mut ok = 0;
            let stats = &mut st.stats[idx];
            stats.batches += 1;
            stats.attempts += windows.len() as u64;
            for ((stem, w), r) in stems.into_iter().zip(windows).zip(results) {
                match r {
                    Ok(()) => {
                        stats.delivered += 1;
                        ok += 1;
                        finished.push(stem);
                    }
                    Err(SinkError::Reject(e)) => {
                        stats.rejected += 1;
                        let kind = sink.error_kind(&e);
                        if logged.len() < LOGGED_KINDS && logged.insert(kind) {
                            msgs.warn(format_args!(
                                "{name}: window {stem} rejected, not retried (further \
                                 rejections of this kind only counted): {e:#}"
                            ));
                        }
                        finished.push(stem);
                    }
                    Err(SinkError::Retry(e)) => {
                        stats.retries += 1;
                        failed.get_or_insert(e);
                        batch.push((stem, w));
                    }
                }
            }
            if ok > 0 {
                // One delivery for the batch: its latency, once.
                stats.last_latency = Some(took);
                stats.latency.observe(took);
                backoff = MIN_BACKOFF;
                if let Some(n) = failing_since.take() {
                    let n = stats.retries - n;
                    msgs.info(format_args!("{name}: delivering again after {n} retries"));
                }
            }
            if let Err(e) = st.spool.finish_delivered(idx, &finished) {
                msgs.warn(format_args!("{name}: {e:#}"));
            }
            let Some(e) = failed else { continue };
            if failing_since.is_none() {
                failing_since = Some(st.stats[idx].retries - batch.len() as u64);
                msgs.warn(format_args!(
                    "{name}: delivery failed, windows wait in the spool and are retried with \
                     backoff: {e:#}"
                ));
            }
            // Deleted for --spool-size meanwhile: the sink will never have them.
            let (kept, gone): (Vec<_>, Vec<_>) =
                batch.into_iter().partition(|(stem, _)| st.spool.contains(stem));
            for (stem, _) in gone {
                let _ = st.spool.finish(idx, &stem, false);
            }
            batch = kept;
            if batch.is_empty() {
                break;
            }
            if st.deadline.is_some() {
                // Stopping: the server is down, leave the rest spooled.
                return;
            }
            let wait = jitter(backoff);
            backoff = (backoff * 2).min(MAX_BACKOFF);
            let (st, _) = q.wake.wait_timeout(st, wait).unwrap_or_else(|p| p.into_inner());
            if st.deadline.is_some_and(|d| Instant::now() >= d) {
                return;
            }
        }
    }
}

/// `d` scaled by a random factor in [0.5, 1): agents restarted together do not retry in step.
fn jitter(d: Duration) -> Duration {
    let mut seed = [0u8; 4];
    // SAFETY: writes at most 4 bytes into `seed`.
    let n = unsafe { libc::getrandom(seed.as_mut_ptr().cast(), seed.len(), 0) };
    let r = if n == 4 { u32::from_ne_bytes(seed) } else { std::process::id() };
    d.mul_f64(0.5 + 0.5 * (r as f64 / (u32::MAX as f64 + 1.0)))
}

fn read_window(
    labels: &std::path::Path,
    profile: &std::path::Path,
) -> Result<(WindowMeta, Vec<u8>)> {
    let text = fs::read(labels).with_context(|| format!("read {}", labels.display()))?;
    let meta = serde_json::from_slice(&text)
        .with_context(|| format!("bad window labels {}", labels.display()))?;
    let pprof_gz = fs::read(profile).with_context(|| format!("read {}", profile.display()))?;
    Ok((meta, pprof_gz))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_buckets_and_jitter() {
        let mut h = LatencyHistogram::default();
        for ms in [1, 7, 7, 300, 60_000] {
            h.observe(Duration::from_millis(ms));
        }
        assert_eq!(h.counts[0], 1);
        assert_eq!(h.counts[1], 2);
        assert_eq!(h.counts[6], 1, "0.3 s in the 0.5 s bucket");
        assert_eq!(h.counts[LATENCY_BUCKETS.len()], 1, "60 s in +Inf");
        assert_eq!(h.count, 5);
        for _ in 0..100 {
            let j = jitter(Duration::from_secs(8));
            assert!(j >= Duration::from_secs(4) && j < Duration::from_secs(8), "{j:?}");
        }
    }
}
