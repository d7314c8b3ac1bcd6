//! One window of a running agent: its events, symbolized, as one pprof profile per service
//! (`labels`): all the processes of a service fold into one profile, their samples labelled
//! with their pid, tid and names.

use std::collections::HashMap;

use anyhow::Result;

use crate::{
    agent::labels::WindowLabels,
    export::ExportJob,
    model::{Sample, ids::ThreadKey, markers::Marker},
    symbolize::Service,
    writers::{EventSink, ProfileContext, ProfileWriter, pprof::PprofWriter},
};

/// A window's profile of one service.
pub struct WindowProfile {
    pub labels: WindowLabels,
    /// Wall-clock ms since the epoch.
    pub start_ms: u64,
    pub end_ms: u64,
    pub samples: u64,
    /// Encoded pprof `Profile` (not compressed).
    pub pprof: Vec<u8>,
}

/// What a window held besides its profiles.
#[derive(Default)]
pub struct WindowReport {
    pub corrupt: Vec<String>,
    /// Modules that could not be symbolized, with why.
    pub symbolize_errors: Vec<(String, String)>,
    /// Time spent naming the window's frames.
    pub symbolize_time: std::time::Duration,
}

/// Routes each thread's events to the writer of its service.
struct ByService<'a> {
    ctx: &'a ProfileContext<'a>,
    host: &'a str,
    writers: Vec<(WindowLabels, PprofWriter<'a>)>,
    services: HashMap<WindowLabels, usize>,
    /// pid (0: idle) → its service's writer, so the labels are worked out once per process.
    by_pid: HashMap<u32, usize>,
}

impl EventSink for ByService<'_> {
    fn sample(&mut self, thread: ThreadKey, s: &Sample) {
        let pid = thread.pid().map_or(0, |p| p.0);
        let i = match self.by_pid.get(&pid) {
            Some(&i) => i,
            None => {
                let labels = WindowLabels::of(self.ctx.processes, thread, self.host);
                let i = *self.services.entry(labels.clone()).or_insert_with(|| {
                    let w = PprofWriter::with_labels(self.ctx, labels.extra_sample_labels());
                    self.writers.push((labels, w));
                    self.writers.len() - 1
                });
                self.by_pid.insert(pid, i);
                i
            }
        };
        self.writers[i].1.sample(thread, s);
    }

    fn marker(&mut self, _: ThreadKey, _: &Marker) {}
}

/// Symbolizes the window's events and writes one profile per service that was sampled.
pub fn profiles(
    job: ExportJob,
    host: &str,
    symbolizer: &Service,
) -> Result<(Vec<WindowProfile>, WindowReport)> {
    let began = std::time::Instant::now();
    let sym = job.symbolize_used(Some(symbolizer))?;
    let symbolize_time = began.elapsed();
    let stacks = sym.stacks();
    let info = &sym.info;
    let ctx = ProfileContext {
        info,
        stacks: &stacks,
        processes: &sym.processes,
        marker_schemas: &[],
        // Events lost before the window was read are the agent's to report (per window).
        recycled: Default::default(),
        buffer_bytes: sym.snapshot.buffer_bytes,
        report: Default::default(),
    };
    let mut router = ByService {
        ctx: &ctx,
        host,
        writers: Vec::new(),
        services: HashMap::new(),
        by_pid: HashMap::new(),
    };
    let corrupt = sym.replay(&mut [&mut router]);
    let start_ms = info.start_wall_ms.round() as u64;
    let end_ms = start_ms + (info.end.0.saturating_sub(info.start.0) / 1_000_000);
    let mut out = Vec::new();
    for (labels, w) in router.writers {
        let samples = w.samples() as u64;
        let mut pprof = Vec::new();
        Box::new(w).write(&corrupt, &mut pprof)?;
        out.push(WindowProfile { labels, start_ms, end_ms, samples, pprof });
    }
    out.sort_by(|a, b| a.labels.cmp(&b.labels));
    Ok((out, WindowReport { corrupt, symbolize_errors: sym.errors.modules, symbolize_time }))
}
