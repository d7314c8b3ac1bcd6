//! The Gecko writer: every event goes to its thread's tables as it arrives (one pass over
//! storage), then the threads are spliced into the output with their process and thread
//! metadata.

use std::{
    collections::HashMap,
    io::{self, Write},
};

use serde_json::json;

use crate::{
    model::{
        OffCpu, Sample,
        ids::{Pid, ThreadKey, Tid},
        markers::{Marker, MarkerPhase, MarkerSource},
        process::{IDLE_PROCESS_NAME, idle_thread_name},
        time::MonoNs,
    },
    writers::{
        EventSink, ProfileContext, ProfileWriter,
        gecko::{
            categories, container,
            markers::{field_keys, payload, schema_json},
            process,
            profile::{GeckoMeta, GeckoProcess, write_gecko},
            thread::{GeckoThread, ThreadTables},
        },
    },
};

pub struct GeckoWriter<'a> {
    ctx: &'a ProfileContext<'a>,
    /// Field keys by schema name.
    keys: HashMap<String, Vec<String>>,
    /// Marker category by schema name.
    categories: HashMap<String, u32>,
    threads: HashMap<ThreadKey, ThreadTables>,
}

impl<'a> GeckoWriter<'a> {
    pub fn new(ctx: &'a ProfileContext<'a>) -> Self {
        let categories = ctx
            .marker_schemas
            .iter()
            .map(|s| {
                let c = match s.source {
                    MarkerSource::Usdt => categories::CATEGORY_USDT,
                    MarkerSource::Host => categories::CATEGORY_OTHER,
                };
                (s.name.clone(), c)
            })
            .collect();
        Self { ctx, keys: field_keys(ctx.marker_schemas), categories, threads: HashMap::new() }
    }
}

/// Blocks at least this long also get an interval marker.
pub const OFF_CPU_MARKER_MIN_NS: u64 = 10_000_000;
const OFF_CPU_MARKER: &str = "Off-CPU";

fn off_cpu_marker_schema() -> serde_json::Value {
    json!({
        "name": OFF_CPU_MARKER,
        "display": ["marker-chart", "marker-table", "timeline-overview"],
        "chartLabel": "{marker.data.state}",
        "tableLabel": "{marker.data.state}",
        "tooltipLabel": "Off-CPU: {marker.data.state}",
        "description": "The thread was off the CPU (blocked, or with --mode wall waiting for a CPU) for this long; its stack at the switch-out is in the Off-CPU samples",
        "data": [{"key": "state", "label": "Task state", "format": "string"}],
    })
}

fn off_cpu_marker_data(o: &OffCpu) -> serde_json::Value {
    json!({"type": OFF_CPU_MARKER, "state": o.state_name()})
}

/// Gecko's marker phase numbers.
fn phase_number(p: MarkerPhase) -> u8 {
    match p {
        MarkerPhase::Instant => 0,
        MarkerPhase::Interval => 1,
        MarkerPhase::IntervalStart => 2,
        MarkerPhase::IntervalEnd => 3,
    }
}

impl EventSink for GeckoWriter<'_> {
    fn sample(&mut self, thread: ThreadKey, s: &Sample) {
        let time = self.ctx.info.ms(s.time);
        if let Some(o) = s.off_cpu {
            let interval_ns = 1_000_000_000 / self.ctx.info.frequency.max(1);
            let tables = self.threads.entry(thread).or_default();
            tables.add_off_cpu(
                self.ctx.stacks,
                time,
                s.stack,
                o.weight_ns,
                o.block_ns,
                interval_ns,
            );
            if o.blocks == 1 && o.block_ns >= OFF_CPU_MARKER_MIN_NS {
                let end = self.ctx.info.ms(MonoNs(s.time.0 + o.block_ns));
                let data = off_cpu_marker_data(&o);
                tables.add_marker(
                    OFF_CPU_MARKER,
                    Some(time),
                    Some(end),
                    1,
                    categories::CATEGORY_OFF_CPU,
                    &data,
                );
            }
            return;
        }
        self.threads.entry(thread).or_default().add_sample(
            self.ctx.stacks,
            time,
            s.stack,
            Some(s.cpu_delta_ns),
            thread.is_idle(),
        );
    }

    /// One table lookup for the run (`query` hands over millions of a thread's samples).
    fn samples(&mut self, thread: ThreadKey, samples: &[Sample]) {
        if samples.is_empty() || samples.iter().any(|s| s.off_cpu.is_some()) {
            return samples.iter().for_each(|s| self.sample(thread, s));
        }
        let tables = self.threads.entry(thread).or_default();
        for s in samples {
            let time = self.ctx.info.ms(s.time);
            tables.add_sample(
                self.ctx.stacks,
                time,
                s.stack,
                Some(s.cpu_delta_ns),
                thread.is_idle(),
            );
        }
    }

    fn marker(&mut self, thread: ThreadKey, m: &Marker) {
        let info = self.ctx.info;
        use MarkerPhase::*;
        let (start, end) = match m.phase {
            Instant | IntervalStart => (Some(info.ms(m.start)), None),
            Interval => (Some(info.ms(m.start)), Some(info.ms(m.end))),
            IntervalEnd => (None, Some(info.ms(m.end))),
        };
        let category =
            self.categories.get(&m.schema).copied().unwrap_or(categories::CATEGORY_OTHER);
        let data = payload(&self.keys, &m.schema, &m.fields);
        let tables = self.threads.entry(thread).or_default();
        tables.add_marker(&m.name, start, end, phase_number(m.phase), category, &data);
    }
}

impl ProfileWriter for GeckoWriter<'_> {
    /// The front-end refuses a profile without threads.
    fn is_empty(&self) -> bool {
        self.threads.is_empty()
    }

    fn write(self: Box<Self>, corrupt: &[String], out: &mut dyn Write) -> io::Result<()> {
        let ctx = self.ctx;
        let info = ctx.info;
        let mut marker_schema: Vec<_> = ctx.marker_schemas.iter().map(schema_json).collect();
        marker_schema.push(container::marker_schema());
        marker_schema.push(process::marker_schema());
        marker_schema.push(off_cpu_marker_schema());
        let r = ctx.recycled;
        let dropped_ms = r.range.map(|(a, b)| (info.ms(a), info.ms(b)));
        let extra = json!({
            "bufferBytes": ctx.buffer_bytes,
            "recycled": dropped_ms.map(|(a, b)| json!({
                "startTime": a, "endTime": b, "chunks": r.chunks, "events": r.events,
            })),
            "corruptChunks": corrupt,
            // The Firefox Profiler does not show it; `jq -r .meta.rsprof.report` does.
            "report": ctx.report.get(),
        });
        let meta = GeckoMeta {
            start_time_ms: info.start_wall_ms,
            interval_ms: 1000.0 / info.frequency as f64,
            // Recycled data leaves the range: it starts where the kept window does.
            profiling_start_ms: dropped_ms.map_or(0.0, |(_, end)| end.max(0.0)),
            profiling_end_ms: info.ms(info.end),
            logical_cpus: info.logical_cpus,
            physical_cpus: info.physical_cpus,
            product: info.product.clone(),
            oscpu: info.oscpu.clone(),
            marker_schema,
            extra,
        };
        let procs = group_processes(self.threads, ctx);
        write_gecko(&meta, procs, ctx.stacks, out)
    }
}

/// The idle tasks form one pseudo-process, keyed by pid 0 as the kernel numbers them.
const IDLE_PID: Pid = Pid(0);

fn group_processes(
    threads: HashMap<ThreadKey, ThreadTables>,
    ctx: &ProfileContext,
) -> Vec<GeckoProcess> {
    let (processes, info) = (ctx.processes, ctx.info);
    let mut by_pid: HashMap<Pid, Vec<(Tid, ThreadTables)>> = HashMap::new();
    for (key, tables) in threads {
        let (pid, tid) = match key {
            ThreadKey::Idle { cpu } => (IDLE_PID, Tid(cpu)),
            ThreadKey::Task { pid, tid } => (pid, tid),
        };
        by_pid.entry(pid).or_default().push((tid, tables));
    }
    by_pid
        .into_iter()
        .map(|(pid, threads)| {
            let idle = pid == IDLE_PID;
            let meta = processes.get(&pid);
            let mut threads: Vec<GeckoThread> = threads
                .into_iter()
                .map(|(tid, tables)| {
                    let t = meta.and_then(|p| p.threads.get(&tid));
                    let first =
                        if tables.sample_count() > 0 { tables.first_sample_ms() } else { 0.0 };
                    let name =
                        t.map(|t| t.name.clone()).filter(|n| !n.is_empty()).unwrap_or_else(|| {
                            if idle { idle_thread_name(tid.0) } else { tid.to_string() }
                        });
                    GeckoThread {
                        tid,
                        name,
                        is_main: !idle && tid.0 == pid.0,
                        register_time_ms: t
                            .and_then(|t| t.start)
                            .map_or(0.0, |t| info.ms(t).max(0.0))
                            .min(first),
                        unregister_time_ms: t.and_then(|t| t.end).map(|t| info.ms(t)),
                        tables,
                    }
                })
                .collect();
            let name = meta
                .map(|p| p.name.clone())
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| if idle { IDLE_PROCESS_NAME.into() } else { pid.to_string() });
            let container = meta.and_then(|p| p.container.as_ref());
            let end_time_ms = meta.and_then(|p| p.end).map(|t| info.ms(t));
            // Identity markers span the process's life, on its main thread.
            threads.sort_by_key(|t| (!t.is_main, t.tid));
            let start = threads.iter().map(|t| t.register_time_ms).fold(f64::MAX, f64::min);
            let end = end_time_ms.unwrap_or(info.ms(info.end)).max(start);
            let mut markers = Vec::new();
            if let Some(data) = meta.and_then(|p| process::marker(pid, p)) {
                markers.push((process::MARKER_NAME, data));
            }
            if let Some(c) = container {
                markers.push(container::marker(c));
            }
            if let Some(t) = threads.first_mut() {
                for (marker_name, data) in markers {
                    let other = categories::CATEGORY_OTHER;
                    t.tables.add_marker(marker_name, Some(start), Some(end), 1, other, &data);
                }
            }
            GeckoProcess {
                pid,
                name: container::process_name(&name, container),
                end_time_ms,
                threads,
            }
        })
        .collect()
}
