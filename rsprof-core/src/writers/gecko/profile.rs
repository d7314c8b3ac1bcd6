//! The profile's file: `meta`, then each process with its `libs` and threads. [`write_gecko`]
//! splices the threads' tables (`thread`) into the output, freeing each one as it goes; no
//! whole-profile JSON tree is ever built.
//!
//! Layout decisions (checked against the firefox-devtools/profiler importer,
//! `src/profile-logic/process-profile.ts`):
//! - Root `threads` is empty and every process is a `processes[i]` sub-process: the importer
//!   flattens root threads and sub-process threads into one list and treats them alike; it only
//!   refuses a profile with no thread at all.
//! - Main threads keep their `comm` as name. The importer makes a thread the process' main
//!   thread only if it is named `GeckoMain` (which would show "GeckoMain" wherever the thread
//!   name is used); without one it still builds one process track per pid, labelled with the
//!   threads' `processName`, and lists every thread (main included) under it.
//! - Native frames are `"function (in module)"`, plus `" (file:line[:col])"` when known: the
//!   importer takes the function and the library resource from that string and ignores the
//!   file part, so functions still merge across lines. Line and column also go into the frame
//!   table's `line`/`column` columns, which is where the front-end reads frame lines from.

use std::{
    collections::hash_map::Entry,
    io::{self, Write},
};

use serde::Serialize;
use serde_json::{Value, json, value::RawValue};

use super::{
    FastMap, GECKO_VERSION,
    categories::categories,
    frame_table, marker_table, sample_table, stack_table,
    string_table::Locations,
    thread::{GeckoThread, write_thread},
    to_raw_value,
};
use crate::model::{ids::Pid, stacks::SymbolizedStacks};

/// The Gecko type requires a `sources` table (JS sources); ours is always empty.
fn sources() -> Value {
    json!({"schema": {"id": 0, "filename": 1, "startLine": 2, "startColumn": 3, "sourceMapURL": 4},
           "data": []})
}

/// Profile-wide values for `meta`.
#[derive(Clone, Debug, Default)]
pub struct GeckoMeta {
    /// Wall-clock time of the profile's zero, ms since the Unix epoch.
    pub start_time_ms: f64,
    /// Sampling interval, ms.
    pub interval_ms: f64,
    /// The recorded range, ms since start: where the oldest kept data begins and where
    /// recording ended. Widened to cover every sample written.
    pub profiling_start_ms: f64,
    pub profiling_end_ms: f64,
    pub logical_cpus: u32,
    pub physical_cpus: u32,
    /// e.g. `rsprof-bpf 0.1.0`.
    pub product: String,
    /// `uname -srm`-like string.
    pub oscpu: String,
    /// `meta.markerSchema` entries, one per marker `data.type` written.
    pub marker_schema: Vec<Value>,
    /// Written as `meta.rsprof`: recording details the front-end has no field for.
    pub extra: Value,
}

pub struct GeckoProcess {
    pub pid: Pid,
    /// Shown as the process track's name.
    pub name: String,
    pub end_time_ms: Option<f64>,
    pub threads: Vec<GeckoThread>,
}

impl GeckoProcess {
    fn busy_samples(&self) -> u64 {
        self.threads.iter().map(|t| t.tables.samples.busy).sum()
    }
}

/// Writes the profile as uncompressed Gecko JSON; wrap `out` in a gzip encoder to compress.
/// Processes are written busiest first and each thread is freed once written.
pub fn write_gecko<W: Write>(
    meta: &GeckoMeta,
    mut processes: Vec<GeckoProcess>,
    tree: &SymbolizedStacks,
    out: W,
) -> io::Result<()> {
    let mut w = io::BufWriter::with_capacity(1 << 16, out);
    // Samples drained after the stop (and off-CPU time spread past it) must stay inside the root
    // range, or the UI hides them; the range is half-open, so it ends one interval after the
    // last sample (the front-end gives each sample that duration too).
    let last_sample = processes
        .iter()
        .flat_map(|p| &p.threads)
        .filter(|t| t.tables.sample_count() > 0)
        .map(|t| t.tables.last_sample_ms())
        .fold(f64::MIN, f64::max);
    let last_sample = if last_sample >= meta.profiling_end_ms {
        last_sample + meta.interval_ms
    } else {
        meta.profiling_end_ms
    };
    let first_sample = processes
        .iter()
        .flat_map(|p| &p.threads)
        .filter(|t| t.tables.sample_count() > 0)
        .map(|t| t.tables.first_sample_ms())
        .fold(meta.profiling_start_ms, f64::min);
    let root_meta = json!({
        "version": GECKO_VERSION,
        "interval": meta.interval_ms,
        "startTime": meta.start_time_ms,
        "shutdownTime": null,
        "profilingStartTime": first_sample,
        "profilingEndTime": last_sample,
        "product": meta.product,
        "platform": "Linux",
        "oscpu": meta.oscpu,
        "processType": 0,
        "stackwalk": 1,
        "debug": 0,
        "gcpoison": 0,
        "asyncstack": 0,
        "presymbolicated": true,
        "physicalCPUs": meta.physical_cpus,
        "logicalCPUs": meta.logical_cpus,
        "categories": categories(),
        "markerSchema": meta.marker_schema,
        "sampleUnits": {"time": "ms", "eventDelay": "ms", "threadCPUDelta": "ns"},
        "rsprof": meta.extra,
    });
    // Without a GeckoMain thread the front-end keeps process tracks in file order, so put
    // the busiest processes first, as it would do by activity.
    processes.sort_by_key(|p| (std::cmp::Reverse(p.busy_samples()), p.pid));
    let mut shared = Shared::new(meta)?;
    w.write_all(b"{\"meta\":")?;
    serde_json::to_writer(&mut w, &root_meta)?;
    w.write_all(b",\"libs\":[],\"threads\":[],\"processes\":[")?;
    for (i, p) in processes.into_iter().enumerate() {
        if i > 0 {
            w.write_all(b",")?;
        }
        write_process(&mut w, &mut shared, tree, p)?;
    }
    w.write_all(b"],\"pages\":[],\"pausedRanges\":[],\"sources\":")?;
    w.write_all(shared.sources.get().as_bytes())?;
    w.write_all(b"}")?;
    w.flush()
}

/// What every process or thread repeats, serialized once. An exec storm's profile holds tens
/// of thousands of short-lived processes; building, writing and freeing these trees for each
/// of them was most of the time spent writing it.
pub(super) struct Shared<'t> {
    start_time_ms: f64,
    categories: Box<RawValue>,
    marker_schema: Box<RawValue>,
    sources: Box<RawValue>,
    pub(super) frame_schema: Box<RawValue>,
    pub(super) stack_schema: Box<RawValue>,
    pub(super) sample_schema: Box<RawValue>,
    pub(super) marker_columns: Box<RawValue>,
    /// `libs` entries by module name.
    libs: FastMap<&'t str, Box<RawValue>>,
    pub(super) locations: Locations,
}

impl<'t> Shared<'t> {
    fn new(meta: &GeckoMeta) -> io::Result<Self> {
        Ok(Self {
            start_time_ms: meta.start_time_ms,
            categories: to_raw_value(&categories())?,
            marker_schema: to_raw_value(&meta.marker_schema)?,
            sources: to_raw_value(&sources())?,
            frame_schema: to_raw_value(&schema_json(frame_table::SCHEMA))?,
            stack_schema: to_raw_value(&schema_json(stack_table::SCHEMA))?,
            sample_schema: to_raw_value(&schema_json(sample_table::SCHEMA))?,
            marker_columns: to_raw_value(&schema_json(marker_table::SCHEMA))?,
            libs: FastMap::default(),
            locations: Locations::default(),
        })
    }
}

/// A sub-process's `meta`.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SubprocessMeta<'a> {
    version: u32,
    /// Same startTime as the root, so no time shifting happens on import.
    start_time: f64,
    shutdown_time: Option<f64>,
    categories: &'a RawValue,
    marker_schema: &'a RawValue,
}

fn write_process<'t, W: Write>(
    w: &mut W,
    shared: &mut Shared<'t>,
    tree: &'t SymbolizedStacks,
    mut p: GeckoProcess,
) -> io::Result<()> {
    let sub_meta = SubprocessMeta {
        version: GECKO_VERSION,
        start_time: shared.start_time_ms,
        shutdown_time: p.end_time_ms,
        categories: &shared.categories,
        marker_schema: &shared.marker_schema,
    };
    w.write_all(b"{\"meta\":")?;
    serde_json::to_writer(&mut *w, &sub_meta)?;
    w.write_all(b",\"libs\":[")?;
    for (i, name) in process_libs(tree, &p).into_iter().enumerate() {
        if i > 0 {
            w.write_all(b",")?;
        }
        let entry = match shared.libs.entry(name) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                let id = tree.module_build_ids.get(name).map(String::as_str);
                e.insert(to_raw_value(&super::libs::lib_entry(name, id))?)
            }
        };
        w.write_all(entry.get().as_bytes())?;
    }
    w.write_all(b"],\"threads\":[")?;
    p.threads.sort_by_key(|t| (!t.is_main, t.tid));
    for (i, t) in p.threads.into_iter().enumerate() {
        if i > 0 {
            w.write_all(b",")?;
        }
        write_thread(w, shared, tree, p.pid, &p.name, t)?;
    }
    w.write_all(b"],\"processes\":[],\"pages\":[],\"pausedRanges\":[],\"sources\":")?;
    w.write_all(shared.sources.get().as_bytes())?;
    w.write_all(b"}")
}

/// The names of the files `p`'s native user frames are in, in order, that get a `libs` entry:
/// pseudo-modules such as `[unknown]` and `[anon]` only with a build-id, i.e. the vDSO.
fn process_libs<'t>(tree: &'t SymbolizedStacks, p: &GeckoProcess) -> Vec<&'t str> {
    let names: std::collections::BTreeSet<&str> =
        p.threads.iter().flat_map(|t| t.tables.frames.user_modules(tree)).collect();
    names
        .into_iter()
        .filter(|name| tree.module_build_ids.contains_key(*name) || !name.starts_with('['))
        .collect()
}

fn schema_json(cols: &[&str]) -> Value {
    Value::Object(cols.iter().enumerate().map(|(i, c)| ((*c).to_owned(), json!(i))).collect())
}
