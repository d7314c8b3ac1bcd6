//! An agent's view of a recording: windows read one after another, each releasing the memory
//! of the ones before, and the recent past for flight recorder dumps. The one handle the agent
//! holds on the recording's store, so `Recorder` has no agent-only methods besides `windows`.

use std::time::Duration;

use super::Recorder;
use crate::{
    export::ExportJob,
    model::{recording::RecordingInfo, time::MonoNs},
    store::WindowCursor,
};

/// Where the next window starts.
pub struct Windows {
    cursor: Option<WindowCursor>,
    start: MonoNs,
}

impl Recorder<'_> {
    /// Makes the recording an agent's: `run_until` also returns (None) when `wake` is notified,
    /// and on SIGUSR1 (see `take_usr1`); chunks its windows read are kept for `retain` (its
    /// flight recorder).
    pub fn windows(
        &mut self,
        wake: std::sync::Arc<tokio::sync::Notify>,
        retain: Option<Duration>,
    ) -> Windows {
        self.wake = Some(wake);
        self.collector.store.set_retention(retain.map(|d| d.as_nanos() as u64));
        Windows { cursor: None, start: self.info.start }
    }

    /// The recording's info over `start..end` (an agent's window or dump).
    fn info_over(&self, start: MonoNs, end: MonoNs) -> RecordingInfo {
        RecordingInfo {
            start,
            start_wall_ms: self.info.start_wall_ms
                + (start.0 as f64 - self.info.start.0 as f64) / 1e6,
            end,
            ..self.info.clone()
        }
    }
}

impl Windows {
    /// The events since the last window (since sampling began for the first), ready to
    /// symbolize on another thread, and the events recycled before they were read; memory of
    /// earlier windows is released. Drains first.
    pub fn next(&mut self, rec: &mut Recorder) -> (ExportJob, u64) {
        rec.drain();
        let end = MonoNs::now();
        let mut w = rec.collector.store.window_snapshot(self.cursor.take());
        let info = rec.info_over(self.start, end);
        let snapshot = std::mem::take(&mut w.snapshot);
        let mut job = ExportJob::from_snapshot(&rec.collector, snapshot, info);
        job.kernel = rec.kernel.clone();
        self.cursor = Some(w.next);
        self.start = end;
        (job, w.lost)
    }

    /// The last `last` of what is stored (bounded by what the store still holds), with the
    /// USDT marker schemas and open intervals, for a flight recorder dump. Drains first.
    pub fn recent(&self, rec: &mut Recorder, last: Duration) -> ExportJob {
        rec.drain();
        let end = MonoNs::now();
        let start = MonoNs(end.0.saturating_sub(last.as_nanos() as u64).max(rec.info.start.0));
        let snapshot = rec.collector.store.snapshot_since(start.0);
        let info = rec.info_over(start, end);
        let mut job = ExportJob::from_snapshot(&rec.collector, snapshot, info);
        job.kernel = rec.kernel.clone();
        job.marker_schemas = rec.usdt.marker_schemas();
        job.open = rec.usdt.open_markers();
        job
    }
}
