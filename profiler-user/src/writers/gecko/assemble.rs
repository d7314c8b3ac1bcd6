//! Turns a storage snapshot into a Gecko profile in one pass: every stored event goes to its
//! thread's tables as it is decoded, then the threads are spliced into the output with their
//! process and thread metadata.

use std::{
    collections::HashMap,
    io::{self, Write},
};

use serde_json::{Map, Value, json};

use crate::{
    model::ids::{Pid, Tid},
    model::stacks::{FrameIndex, ProcessesMeta, SymbolizedStacks},
    store::codec::{Event, MarkerField, MarkerPhase, StoredMarker, ThreadKey},
    store::{StoreSnapshot, read_events},
    symbolize::Symbols,
    writers::gecko::container,
    writers::gecko::tables::{self, GeckoMeta, GeckoProcess, GeckoThread, ThreadTables},
};

/// The recording's time base and description.
#[derive(Clone, Debug)]
pub struct RecordingInfo {
    /// CLOCK_MONOTONIC ns at the profile's zero.
    pub start_mono_ns: u64,
    /// Wall-clock ms since the epoch at the same instant.
    pub start_wall_ms: f64,
    pub end_mono_ns: u64,
    pub frequency: u64,
    pub logical_cpus: u32,
    pub physical_cpus: u32,
    pub product: String,
    pub oscpu: String,
}

impl RecordingInfo {
    pub fn ms(&self, mono_ns: u64) -> f64 {
        (mono_ns as f64 - self.start_mono_ns as f64) / 1e6
    }
}

/// What the written profile holds, for the summary.
#[derive(Clone, Debug, Default)]
pub struct ProfileStats {
    pub processes: usize,
    pub threads: usize,
    pub samples: u64,
    pub idle_samples: u64,
    pub markers: u64,
    /// Self samples per leaf function ("name (in module)"), most first; idle excluded.
    pub top_functions: Vec<(String, u64)>,
    /// Time range (ms since start) recycled away to stay within the buffer size.
    pub dropped_ms: Option<(f64, f64)>,
    pub dropped_events: u64,
    /// Corrupt chunks or blocks found while reading storage (skipped).
    pub corrupt: Vec<String>,
}

/// An interval still open when a snapshot is taken (it is in no chunk yet): written as an
/// IntervalStart marker, which the front-end shows as running to the end of the profile.
#[derive(Clone, Debug, PartialEq)]
pub struct OpenInterval {
    pub thread: ThreadKey,
    pub start_ns: u64,
    pub name: String,
    pub schema: String,
    /// In schema order; `None` leaves the field out.
    pub fields: Vec<Option<Value>>,
}

/// Keys of each marker schema's dynamic fields, in order: stored marker fields are positional.
fn field_keys(schemas: &[Value]) -> HashMap<String, Vec<String>> {
    schemas
        .iter()
        .filter_map(|s| {
            let name = s["name"].as_str()?.to_owned();
            let keys = s["data"]
                .as_array()
                .map(|d| d.iter().filter_map(|f| f["key"].as_str().map(str::to_owned)).collect())
                .unwrap_or_default();
            Some((name, keys))
        })
        .collect()
}

pub fn write_profile<W: Write>(
    snap: &StoreSnapshot,
    processes: &ProcessesMeta,
    symbols: &Symbols,
    info: &RecordingInfo,
    marker_schema: Vec<Value>,
    open: &[OpenInterval],
    out: W,
) -> io::Result<ProfileStats> {
    let tree = SymbolizedStacks::new(snap, symbols);
    let mut marker_schema = marker_schema;
    marker_schema.push(container::marker_schema());
    let keys = field_keys(&marker_schema);
    let mut stats = ProfileStats::default();
    let mut threads: HashMap<ThreadKey, ThreadTables> = HashMap::new();
    let mut leaves: HashMap<FrameIndex, u64> = HashMap::new();
    read_events(
        snap,
        |ev| match ev {
            Event::Sample(key, s) => {
                let idle = key.is_idle();
                stats.samples += 1;
                if idle {
                    stats.idle_samples += 1;
                } else if let Some(leaf) = s.stack.and_then(|id| tree.leaf(id)) {
                    *leaves.entry(leaf).or_default() += 1;
                }
                // The idle task's runtime is idle time, not work: don't chart it as CPU use.
                let cpu = if idle { 0 } else { s.cpu_delta_ns };
                threads.entry(key).or_default().add_sample(
                    &tree,
                    info.ms(s.time_ns),
                    s.stack,
                    Some(cpu),
                    idle,
                );
            }
            Event::Marker(key, m) => {
                stats.markers += 1;
                write_marker(threads.entry(key).or_default(), snap, &keys, info, &m);
            }
        },
        |err| stats.corrupt.push(err),
    );
    for o in open {
        stats.markers += 1;
        let fields = o.fields.iter().cloned();
        let (start, phase) = (Some(info.ms(o.start_ns)), MarkerPhase::IntervalStart);
        let tables = threads.entry(o.thread).or_default();
        add_marker(tables, &keys, &o.name, &o.schema, fields, start, None, phase);
    }

    stats.top_functions = top_functions(&tree, leaves, 10);
    let r = snap.recycled;
    if let Some(first) = r.first_time_ns {
        stats.dropped_ms = Some((info.ms(first), info.ms(r.last_time_ns)));
        stats.dropped_events = r.blocks;
    }
    let extra = json!({
        "bufferBytes": snap.buffer_bytes,
        "recycled": stats.dropped_ms.map(|(a, b)| json!({
            "startTime": a, "endTime": b, "chunks": r.chunks, "events": r.blocks,
        })),
        "corruptChunks": stats.corrupt,
    });
    let meta = GeckoMeta {
        start_time_ms: info.start_wall_ms,
        interval_ms: 1000.0 / info.frequency as f64,
        // Recycled data leaves the range: it starts where the kept window does.
        profiling_start_ms: stats.dropped_ms.map_or(0.0, |(_, end)| end.max(0.0)),
        profiling_end_ms: info.ms(info.end_mono_ns),
        logical_cpus: info.logical_cpus,
        physical_cpus: info.physical_cpus,
        product: info.product.clone(),
        oscpu: info.oscpu.clone(),
        marker_schema,
        extra,
    };
    let procs = group_processes(threads, processes, info);
    stats.processes = procs.len();
    stats.threads = procs.iter().map(|p| p.threads.len()).sum();
    tables::write_gecko(&meta, procs, &tree, out)?;
    Ok(stats)
}

fn write_marker(
    tables: &mut ThreadTables,
    snap: &StoreSnapshot,
    keys: &HashMap<String, Vec<String>>,
    info: &RecordingInfo,
    m: &StoredMarker,
) {
    let name = snap.string(m.name).unwrap_or("<unknown>");
    let schema = snap.string(m.schema).unwrap_or("<unknown>");
    let fields = m.fields.iter().map(|f| match *f {
        MarkerField::Str(s) => Some(snap.string(s).unwrap_or("<unknown>").into()),
        MarkerField::Int(v) => Some(v.into()),
        MarkerField::Uint(v) => Some(v.into()),
        MarkerField::Absent => None,
    });
    use MarkerPhase::*;
    let (start, end) = match m.phase {
        Instant | IntervalStart => (Some(info.ms(m.start_ns)), None),
        Interval => (Some(info.ms(m.start_ns)), Some(info.ms(m.end_ns))),
        IntervalEnd => (None, Some(info.ms(m.end_ns))),
    };
    add_marker(tables, keys, name, schema, fields, start, end, m.phase);
}

/// Adds a marker row; `fields` are positional, named by the schema's keys.
#[allow(clippy::too_many_arguments)]
fn add_marker(
    tables: &mut ThreadTables,
    keys: &HashMap<String, Vec<String>>,
    name: &str,
    schema: &str,
    fields: impl Iterator<Item = Option<Value>>,
    start: Option<f64>,
    end: Option<f64>,
    phase: MarkerPhase,
) {
    let mut data = Map::new();
    data.insert("type".into(), schema.into());
    let schema_keys = keys.get(schema);
    for (i, v) in fields.enumerate() {
        let Some(v) = v else { continue };
        let key = schema_keys.and_then(|k| k.get(i)).cloned().unwrap_or_else(|| format!("f{i}"));
        data.insert(key, v);
    }
    tables.add_marker(name, start, end, phase as u8, tables::CATEGORY_OTHER, &Value::Object(data));
}

fn group_processes(
    threads: HashMap<ThreadKey, ThreadTables>,
    processes: &ProcessesMeta,
    info: &RecordingInfo,
) -> Vec<GeckoProcess> {
    let mut by_pid: HashMap<Pid, Vec<(Tid, ThreadTables)>> = HashMap::new();
    for (key, tables) in threads {
        by_pid.entry(key.pid).or_default().push((key.tid, tables));
    }
    by_pid
        .into_iter()
        .map(|(pid, threads)| {
            let idle = pid.0 == 0;
            let meta = processes.get(&pid);
            let mut threads: Vec<GeckoThread> = threads
                .into_iter()
                .map(|(tid, tables)| {
                    let t = meta.and_then(|p| p.threads.get(&tid));
                    let first =
                        if tables.sample_count() > 0 { tables.first_sample_ms() } else { 0.0 };
                    let name =
                        t.map(|t| t.name.clone()).filter(|n| !n.is_empty()).unwrap_or_else(|| {
                            if idle { format!("swapper/{tid}") } else { tid.to_string() }
                        });
                    GeckoThread {
                        tid,
                        name,
                        is_main: !idle && tid.0 == pid.0,
                        register_time_ms: t
                            .and_then(|t| t.start_ns)
                            .map_or(0.0, |ns| info.ms(ns).max(0.0))
                            .min(first),
                        unregister_time_ms: t.and_then(|t| t.end_ns).map(|ns| info.ms(ns)),
                        tables,
                    }
                })
                .collect();
            let name = meta
                .map(|p| p.name.clone())
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| if idle { "[idle]".into() } else { pid.to_string() });
            let container = meta.and_then(|p| p.container.as_ref());
            let end_time_ms = meta.and_then(|p| p.end_ns).map(|ns| info.ms(ns));
            if let Some(c) = container {
                // One identity marker per process, spanning its life, on its main thread.
                threads.sort_by_key(|t| (!t.is_main, t.tid));
                let start = threads.iter().map(|t| t.register_time_ms).fold(f64::MAX, f64::min);
                let end = end_time_ms.unwrap_or(info.ms(info.end_mono_ns)).max(start);
                let (marker_name, data) = container::marker(c);
                if let Some(t) = threads.first_mut() {
                    t.tables.add_marker(
                        marker_name,
                        Some(start),
                        Some(end),
                        1,
                        tables::CATEGORY_OTHER,
                        &data,
                    );
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

fn top_functions(
    tree: &SymbolizedStacks,
    leaves: HashMap<FrameIndex, u64>,
    n: usize,
) -> Vec<(String, u64)> {
    // Inlined frames of one address share a leaf; merge by name so a function counts once.
    let mut by_name: HashMap<String, u64> = HashMap::new();
    for (f, c) in leaves {
        if let Some(fr) = tree.frame(f) {
            *by_name.entry(format!("{} (in {})", fr.function, fr.module)).or_default() += c;
        }
    }
    let mut v: Vec<_> = by_name.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    v.truncate(n);
    v
}
