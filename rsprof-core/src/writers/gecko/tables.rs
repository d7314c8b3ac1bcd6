//! Writes a Firefox Profiler "Gecko profile" (format version 36).
//!
//! Each thread gets its own [`ThreadTables`] — unique strings, frames and stacks, with its
//! sample and marker rows already serialized as JSON text — filled in one pass over storage
//! (the model of Gecko's ThreadStreamingContext). [`write_gecko`] then splices the threads
//! into the output, freeing each one as it goes; no whole-profile JSON tree is ever built.
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

use std::collections::{HashMap as StdHashMap, hash_map::Entry};

/// Looked up for every sample (millions in a fleet query): a fast hasher rather than SipHash,
/// which resists flooding that the profiler's own ids cannot cause.
type HashMap<K, V> = StdHashMap<K, V, foldhash::fast::RandomState>;
use std::io::{self, Write};

use serde::Serialize;
use serde_json::{Value, json, value::RawValue};

use crate::model::{
    ids::{Pid, StackId, Tid},
    stacks::{FrameIndex, FrameKind, JitLanguage, SymbolizedStacks},
};

pub const GECKO_VERSION: u32 = 36;

/// Indices into `meta.categories`. "Other" must be the first grey category: the front-end uses
/// it for stacks whose frames have no category.
pub const CATEGORY_OTHER: u32 = 0;
/// The front-end finds the idle category by its name "Idle"; samples whose leaf frame has it
/// are hidden by "include idle samples" being off and count as inactive.
pub const CATEGORY_IDLE: u32 = 1;
pub const CATEGORY_USER: u32 = 2;
pub const CATEGORY_KERNEL: u32 = 3;
pub const CATEGORY_LABEL: u32 = 4;
/// Markers from USDT probes: their own colour in the Marker Chart, apart from everything else.
pub const CATEGORY_USDT: u32 = 5;
/// Off-CPU time: every frame of an off-CPU sample, and the long-block markers.
pub const CATEGORY_OFF_CPU: u32 = 6;
/// The root pseudo-frame of a user stack that is not complete (see `FrameKind::Truncated`).
pub const CATEGORY_TRUNCATED: u32 = 7;
/// JIT frames named from perf maps, one category per language. JavaScript has the
/// front-end's own colour for it (yellow, as its Firefox categories); the front-end has none
/// for the others, so they take colours no other category here uses.
pub const CATEGORY_JAVASCRIPT: u32 = 8;
pub const CATEGORY_JAVA: u32 = 9;
pub const CATEGORY_PYTHON: u32 = 10;
pub const CATEGORY_JIT_OTHER: u32 = 11;

const CATEGORIES: [(&str, &str); 12] = [
    ("Other", "grey"),
    ("Idle", "transparent"),
    ("User", "yellow"),
    ("Kernel", "orange"),
    ("Label", "lightblue"),
    ("USDT", "magenta"),
    ("Off-CPU", "purple"),
    ("Truncated stack", "red"),
    ("JavaScript", "yellow"),
    ("Java", "green"),
    ("Python", "blue"),
    ("JIT", "brown"),
];

fn categories() -> Value {
    CATEGORIES
        .iter()
        .map(|(name, color)| json!({"name": name, "color": color, "subcategories": ["Other"]}))
        .collect()
}

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

pub struct GeckoThread {
    pub tid: Tid,
    pub name: String,
    /// The process's main thread (tid == pid).
    pub is_main: bool,
    /// ms since profile start.
    pub register_time_ms: f64,
    pub unregister_time_ms: Option<f64>,
    pub tables: ThreadTables,
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
        self.threads.iter().map(|t| t.tables.busy_samples).sum()
    }
}

// Column order of each table; rows follow it.
const FRAME_SCHEMA: &[&str] = &[
    "location",
    "relevantForJS",
    "innerWindowID",
    "implementation",
    "line",
    "column",
    "category",
    "subcategory",
];
const STACK_SCHEMA: &[&str] = &["prefix", "frame"];
const SAMPLE_SCHEMA: &[&str] = &["stack", "time", "eventDelay", "threadCPUDelta"];
const MARKER_SCHEMA: &[&str] = &["name", "startTime", "endTime", "phase", "category", "data"];

/// (location string, frame, category): the rest of the row is read from the frame when written.
type FrameRow = (u32, FrameIndex, u32);
/// A frame table row as written, in `FRAME_SCHEMA` order.
type FrameRowJson = (u32, bool, Option<u32>, Option<u32>, Option<u32>, Option<u32>, u32, u32);
type StackRow = (Option<u32>, u32);

/// A sample row, compact until written; `u32::MAX` / `u64::MAX` stand for null.
#[derive(Clone, Copy)]
struct SampleRow {
    time_ms: f64,
    cpu_delta_ns: u64,
    stack: u32,
}

enum StrRef {
    /// The location string of this frame.
    Frame(FrameIndex),
    Own(String),
}

/// One thread's Gecko tables. Frame and stack rows exist only for what its samples use.
#[derive(Default)]
pub struct ThreadTables {
    /// Location strings are kept as frame references and formatted when written: the same
    /// location in 400 threads costs 400 small entries, not 400 strings.
    strings: Vec<StrRef>,
    frame_strings: HashMap<FrameIndex, u32>,
    own_strings: HashMap<String, u32>,
    frames: Vec<FrameRow>,
    // The category is part of the key: a frame seen in idle and non-idle samples needs two rows.
    frame_ids: HashMap<(FrameIndex, u32), u32>,
    stacks: Vec<StackRow>,
    stack_ids: HashMap<StackRow, u32>,
    node_ids: HashMap<(StackId, Option<u32>), Option<u32>>,
    samples: Vec<SampleRow>,
    sample_count: u64,
    busy_samples: u64,
    first_sample_ms: f64,
    last_sample_ms: f64,
    markers: Vec<u8>,
    marker_count: u64,
    path: Vec<(StackId, Option<u32>)>,
    /// Off-CPU time not yet written as a sample (less than one sampling interval).
    off_cpu_carry_ns: u64,
}

impl ThreadTables {
    pub fn sample_count(&self) -> u64 {
        self.sample_count
    }

    /// Time of the first sample, ms (0 without samples).
    pub fn first_sample_ms(&self) -> f64 {
        self.first_sample_ms
    }

    /// Time of the last sample, ms (0 without samples).
    pub fn last_sample_ms(&self) -> f64 {
        self.last_sample_ms
    }

    /// Appends a sample. Samples must come in time order (storage keeps each thread's events
    /// in order); an earlier time is raised to the previous one so the table stays sorted.
    pub fn add_sample(
        &mut self,
        stacks: &SymbolizedStacks,
        time_ms: f64,
        stack: Option<StackId>,
        cpu_delta_ns: Option<u64>,
        idle: bool,
    ) {
        if !time_ms.is_finite() {
            return;
        }
        let time_ms =
            time_ms.max(if self.sample_count > 0 { self.last_sample_ms } else { f64::MIN });
        let over = idle.then_some(CATEGORY_IDLE);
        let row = stack.and_then(|s| self.stack(stacks, s, over));
        self.push_row(time_ms, cpu_delta_ns, row, !idle);
    }

    /// Appends off-CPU time as the samples a wall-clock sampler with period `interval_ns`
    /// would have taken: the Gecko format has no sample weights (the importer resets them), so
    /// `weight_ns` becomes whole samples (the remainder carries over to the thread's next
    /// off-CPU time), spread over the block `[time, time + block_ns]`. They have no CPU time and
    /// every frame in the Off-CPU category.
    pub fn add_off_cpu(
        &mut self,
        stacks: &SymbolizedStacks,
        time_ms: f64,
        stack: Option<StackId>,
        weight_ns: u64,
        block_ns: u64,
        interval_ns: u64,
    ) -> u64 {
        if !time_ms.is_finite() || interval_ns == 0 {
            return 0;
        }
        self.off_cpu_carry_ns += weight_ns;
        let n = self.off_cpu_carry_ns / interval_ns;
        self.off_cpu_carry_ns -= n * interval_ns;
        if n == 0 {
            return 0;
        }
        let row = stack.and_then(|s| self.stack(stacks, s, Some(CATEGORY_OFF_CPU)));
        let step_ms = block_ns as f64 / 1e6 / n as f64;
        for i in 0..n {
            let t = time_ms + (i as f64 + 0.5) * step_ms;
            let t = t.max(if self.sample_count > 0 { self.last_sample_ms } else { f64::MIN });
            self.push_row(t, Some(0), row, false);
        }
        n
    }

    fn push_row(&mut self, time_ms: f64, cpu_delta_ns: Option<u64>, row: Option<u32>, busy: bool) {
        self.samples.push(SampleRow {
            time_ms,
            cpu_delta_ns: cpu_delta_ns.unwrap_or(u64::MAX),
            stack: row.unwrap_or(u32::MAX),
        });
        if self.sample_count == 0 {
            self.first_sample_ms = time_ms;
        }
        self.sample_count += 1;
        self.busy_samples += u64::from(busy);
        self.last_sample_ms = time_ms;
    }

    /// Appends a marker row; `data` is its payload object (with `type` naming its schema).
    pub fn add_marker(
        &mut self,
        name: &str,
        start_ms: Option<f64>,
        end_ms: Option<f64>,
        phase: u8,
        category: u32,
        data: &Value,
    ) {
        let name = self.own_string(name);
        if self.marker_count > 0 {
            self.markers.push(b',');
        }
        // A tuple is written as the row's array, without cloning `data` into a new tree.
        let row = (name, start_ms, end_ms, phase, category, data);
        let _ = serde_json::to_writer(&mut self.markers, &row);
        self.marker_count += 1;
    }

    fn own_string(&mut self, s: &str) -> u32 {
        if let Some(&id) = self.own_strings.get(s) {
            return id;
        }
        let id = self.strings.len() as u32;
        self.strings.push(StrRef::Own(s.to_owned()));
        self.own_strings.insert(s.to_owned(), id);
        id
    }

    /// The stack row of tree node `id`, creating rows for it and any missing ancestors.
    /// Idle samples get the Idle category on every frame, so whichever frame is the leaf the
    /// front-end sees an idle sample, and call-tree nodes of idle time are coloured as idle.
    /// `over`: the category every frame gets instead of its own (idle, off-CPU).
    fn stack(&mut self, tree: &SymbolizedStacks, id: StackId, over: Option<u32>) -> Option<u32> {
        // Walk up to the nearest node that already has a row, then create rows downwards.
        self.path.clear();
        let mut cur = Some(id);
        let mut prefix = None;
        while let Some(node) = cur {
            if let Some(&row) = self.node_ids.get(&(node, over)) {
                prefix = row;
                break;
            }
            self.path.push((node, over));
            // A pruned or unknown node ends the stack there rather than dropping the sample.
            cur = tree.node(node).and_then(|(parent, _)| parent);
        }
        while let Some((node, _)) = self.path.pop() {
            if let Some((_, frames)) = tree.node(node) {
                for &f in frames {
                    let Some(frame) = self.frame(tree, f, over) else { continue };
                    let next = self.stacks.len() as u32;
                    // A new row is appended after its prefix, so a prefix precedes its users.
                    prefix = Some(*self.stack_ids.entry((prefix, frame)).or_insert_with(|| {
                        self.stacks.push((prefix, frame));
                        next
                    }));
                }
            }
            self.node_ids.insert((node, over), prefix);
        }
        prefix
    }

    fn frame(&mut self, tree: &SymbolizedStacks, f: FrameIndex, over: Option<u32>) -> Option<u32> {
        let frame = tree.frame(f)?;
        let category = over.unwrap_or(match frame.kind {
            FrameKind::User => CATEGORY_USER,
            FrameKind::Kernel => CATEGORY_KERNEL,
            FrameKind::Label => CATEGORY_LABEL,
            FrameKind::Truncated => CATEGORY_TRUNCATED,
            FrameKind::Jit(JitLanguage::JavaScript) => CATEGORY_JAVASCRIPT,
            FrameKind::Jit(JitLanguage::Java) => CATEGORY_JAVA,
            FrameKind::Jit(JitLanguage::Python) => CATEGORY_PYTHON,
            FrameKind::Jit(JitLanguage::Other) => CATEGORY_JIT_OTHER,
        });
        if let Some(&id) = self.frame_ids.get(&(f, category)) {
            return Some(id);
        }
        let key = tree.display_key(f);
        let next = self.strings.len() as u32;
        let location = *self.frame_strings.entry(key).or_insert_with(|| {
            self.strings.push(StrRef::Frame(key));
            next
        });
        let id = self.frames.len() as u32;
        self.frames.push((location, f, category));
        self.frame_ids.insert((f, category), id);
        Some(id)
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
        .filter(|t| t.tables.sample_count > 0)
        .map(|t| t.tables.last_sample_ms)
        .fold(f64::MIN, f64::max);
    let last_sample = if last_sample >= meta.profiling_end_ms {
        last_sample + meta.interval_ms
    } else {
        meta.profiling_end_ms
    };
    let first_sample = processes
        .iter()
        .flat_map(|p| &p.threads)
        .filter(|t| t.tables.sample_count > 0)
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
struct Shared<'t> {
    start_time_ms: f64,
    categories: Box<RawValue>,
    marker_schema: Box<RawValue>,
    sources: Box<RawValue>,
    frame_schema: Box<RawValue>,
    stack_schema: Box<RawValue>,
    sample_schema: Box<RawValue>,
    marker_columns: Box<RawValue>,
    /// `libs` entries by module name.
    libs: HashMap<&'t str, Box<RawValue>>,
    /// Location strings as JSON, by frame, formatted once however many threads name the frame.
    locations: Vec<Option<Box<RawValue>>>,
}

impl<'t> Shared<'t> {
    fn new(meta: &GeckoMeta) -> io::Result<Self> {
        Ok(Self {
            start_time_ms: meta.start_time_ms,
            categories: to_raw_value(&categories())?,
            marker_schema: to_raw_value(&meta.marker_schema)?,
            sources: to_raw_value(&sources())?,
            frame_schema: to_raw_value(&schema_json(FRAME_SCHEMA))?,
            stack_schema: to_raw_value(&schema_json(STACK_SCHEMA))?,
            sample_schema: to_raw_value(&schema_json(SAMPLE_SCHEMA))?,
            marker_columns: to_raw_value(&schema_json(MARKER_SCHEMA))?,
            libs: HashMap::default(),
            locations: Vec::new(),
        })
    }

    fn location(&mut self, tree: &SymbolizedStacks, f: FrameIndex) -> io::Result<&RawValue> {
        let i = f.0 as usize;
        if i >= self.locations.len() {
            self.locations.resize(tree.frames.len().max(i + 1), None);
        }
        if self.locations[i].is_none() {
            let loc = tree.frame(f).map_or_else(String::new, |f| {
                location(&f.function, &f.module, f.file.as_deref(), f.line, f.column)
            });
            self.locations[i] = Some(to_raw_value(&loc)?);
        }
        Ok(self.locations[i].as_deref().expect("just set"))
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

/// A thread's fields before its tables.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ThreadHead<'a> {
    name: &'a str,
    process_type: &'static str,
    process_name: &'a str,
    pid: u32,
    tid: u32,
    /// Ignored by the front-end (it only knows "GeckoMain"); kept for other readers.
    is_main_thread: bool,
    register_time: f64,
    unregister_time: Option<f64>,
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
    let mut names = std::collections::BTreeSet::new();
    for t in &p.threads {
        for &(_, fi, _) in &t.tables.frames {
            let f = &tree.frames[fi.0 as usize];
            if f.kind == FrameKind::User {
                names.insert(f.module.as_str());
            }
        }
    }
    names
        .into_iter()
        .filter(|name| tree.module_build_ids.contains_key(*name) || !name.starts_with('['))
        .collect()
}

fn schema_json(cols: &[&str]) -> Value {
    Value::Object(cols.iter().enumerate().map(|(i, c)| ((*c).to_owned(), json!(i))).collect())
}

fn to_raw_value<T: Serialize + ?Sized>(v: &T) -> io::Result<Box<RawValue>> {
    serde_json::value::to_raw_value(v).map_err(io::Error::other)
}

fn write_thread<W: Write>(
    w: &mut W,
    shared: &mut Shared<'_>,
    tree: &SymbolizedStacks,
    pid: Pid,
    process_name: &str,
    t: GeckoThread,
) -> io::Result<()> {
    let head = ThreadHead {
        name: &t.name,
        process_type: "default",
        process_name,
        pid: pid.0,
        tid: t.tid.0,
        is_main_thread: t.is_main,
        register_time: t.register_time_ms,
        unregister_time: t.unregister_time_ms,
    };
    let head = serde_json::to_string(&head)?;
    // Reopen the header object to append the tables.
    w.write_all(&head.as_bytes()[..head.len() - 1])?;
    let tables = t.tables;
    w.write_all(b",\"stringTable\":")?;
    w.write_all(b"[")?;
    for (i, s) in tables.strings.iter().enumerate() {
        if i > 0 {
            w.write_all(b",")?;
        }
        match s {
            StrRef::Own(s) => serde_json::to_writer(&mut *w, s)?,
            StrRef::Frame(f) => w.write_all(shared.location(tree, *f)?.get().as_bytes())?,
        }
    }
    w.write_all(b"]")?;
    w.write_all(b",\"frameTable\":{\"schema\":")?;
    w.write_all(shared.frame_schema.get().as_bytes())?;
    w.write_all(b",\"data\":")?;
    w.write_all(b"[")?;
    for (i, &(loc, f, category)) in tables.frames.iter().enumerate() {
        if i > 0 {
            w.write_all(b",")?;
        }
        let (line, column) = tree.frame(f).map_or((None, None), |f| (f.line, f.column));
        let row: FrameRowJson = (loc, false, None, None, line, column, category, 0);
        serde_json::to_writer(&mut *w, &row)?;
    }
    w.write_all(b"]")?;
    w.write_all(b"},\"stackTable\":{\"schema\":")?;
    w.write_all(shared.stack_schema.get().as_bytes())?;
    w.write_all(b",\"data\":")?;
    serde_json::to_writer(&mut *w, &tables.stacks)?;
    w.write_all(b"},\"samples\":{\"schema\":")?;
    w.write_all(shared.sample_schema.get().as_bytes())?;
    w.write_all(b",\"data\":[")?;
    for (i, r) in tables.samples.iter().enumerate() {
        if i > 0 {
            w.write_all(b",")?;
        }
        let stack = (r.stack != u32::MAX).then_some(r.stack);
        let cpu = (r.cpu_delta_ns != u64::MAX).then_some(r.cpu_delta_ns);
        serde_json::to_writer(&mut *w, &(stack, r.time_ms, 0, cpu))?;
    }
    w.write_all(b"]},\"markers\":{\"schema\":")?;
    w.write_all(shared.marker_columns.get().as_bytes())?;
    w.write_all(b",\"data\":[")?;
    w.write_all(&tables.markers)?;
    w.write_all(b"]}}")
}

/// `"function (in module)"` with `" (file:line[:col])"` when the line is known. The front-end
/// parses the module with `\(in ([^)]*)\)`, so parentheses in it (e.g. "x.so (deleted)") would
/// make it a label frame with no function/library split; they become brackets.
fn location(
    function: &str,
    module: &str,
    file: Option<&str>,
    line: Option<u32>,
    column: Option<u32>,
) -> String {
    let module: String = module
        .chars()
        .map(|c| match c {
            '(' => '[',
            ')' => ']',
            c => c,
        })
        .collect();
    let mut s = format!("{function} (in {module})");
    if let (Some(file), Some(line)) = (file, line) {
        s += &format!(" ({file}:{line}");
        if let Some(col) = column {
            s += &format!(":{col}");
        }
        s.push(')');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{model::stacks::Frame, writers::testdata::frame};

    /// Frames: 0 main, 1 work (with file/line), 2 hot, 3 kernel, 4 = inlined copy of hot.
    /// Nodes: 0 main, 1 main>work, 2 main>work>hot, 3 …>hot>syscall, 4 main>work>[hot, hot']
    fn tree() -> SymbolizedStacks {
        let mut work = frame(FrameKind::User, "work", "app");
        work.file = Some("src/main.rs".into());
        work.line = Some(12);
        work.column = Some(5);
        let hot = frame(FrameKind::User, "hot", "libc.so.6");
        SymbolizedStacks::from_parts(
            vec![
                frame(FrameKind::User, "main", "app"),
                work,
                hot.clone(),
                frame(FrameKind::Kernel, "do_syscall_64", "[kernel.kallsyms]"),
                Frame { inlined: true, ..hot },
            ],
            vec![
                (None, vec![FrameIndex(0)]),
                (Some(StackId(0)), vec![FrameIndex(1)]),
                (Some(StackId(1)), vec![FrameIndex(2)]),
                (Some(StackId(2)), vec![FrameIndex(3)]),
                (Some(StackId(1)), vec![FrameIndex(2), FrameIndex(4)]),
            ],
        )
    }

    fn thread(tid: u32, name: &str, is_main: bool, tables: ThreadTables) -> GeckoThread {
        GeckoThread {
            tid: Tid(tid),
            name: name.into(),
            is_main,
            register_time_ms: 0.0,
            unregister_time_ms: None,
            tables,
        }
    }

    /// Process 1 "x" whose main thread has `tables`.
    fn one_thread_process(tables: ThreadTables) -> Vec<GeckoProcess> {
        vec![GeckoProcess {
            pid: Pid(1),
            name: "x".into(),
            end_time_ms: None,
            threads: vec![thread(1, "x", true, tables)],
        }]
    }

    fn meta() -> GeckoMeta {
        GeckoMeta {
            start_time_ms: 1_700_000_000_000.0,
            interval_ms: 1.0,
            profiling_start_ms: 0.0,
            profiling_end_ms: 100.0,
            logical_cpus: 4,
            physical_cpus: 2,
            product: "rsprof-bpf test".into(),
            oscpu: "Linux 6.8".into(),
            marker_schema: vec![],
            extra: json!({"buffer": 1}),
        }
    }

    fn sample_processes(t: &SymbolizedStacks) -> Vec<GeckoProcess> {
        let mut main = ThreadTables::default();
        main.add_sample(t, 1.0, Some(StackId(2)), Some(0), false);
        main.add_sample(t, 2.0, Some(StackId(3)), Some(900_000), false);
        main.add_sample(t, 3.0, Some(StackId(2)), Some(1_000_000), false);
        main.add_sample(t, 4.0, None, None, false);
        main.add_marker("m", Some(1.0), Some(2.0), 1, CATEGORY_OTHER, &json!({"type": "T"}));
        let mut worker = ThreadTables::default();
        worker.add_sample(t, 2.0, Some(StackId(1)), Some(1_000_000), false);
        let mut idle = ThreadTables::default();
        idle.add_sample(t, 1.5, Some(StackId(1)), Some(0), true);
        vec![
            GeckoProcess {
                pid: Pid(0),
                name: "[idle]".into(),
                end_time_ms: None,
                threads: vec![thread(0, "swapper/0", false, idle)],
            },
            GeckoProcess {
                pid: Pid(10),
                name: "app".into(),
                end_time_ms: None,
                threads: vec![thread(11, "worker", false, worker), thread(10, "app", true, main)],
            },
        ]
    }

    fn to_json(meta: &GeckoMeta, p: Vec<GeckoProcess>) -> Value {
        let mut buf = Vec::new();
        write_gecko(meta, p, &tree(), &mut buf).unwrap();
        serde_json::from_slice(&buf).unwrap()
    }

    fn sample_json() -> Value {
        to_json(&meta(), sample_processes(&tree()))
    }

    fn thread_of(j: &Value, tid: u64) -> &Value {
        j["processes"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|p| p["threads"].as_array().unwrap())
            .find(|t| t["tid"] == tid)
            .unwrap()
    }

    fn col(table: &Value, name: &str) -> usize {
        table["schema"][name].as_u64().unwrap() as usize
    }

    #[test]
    fn validates() {
        assert_eq!(::tests::gecko_schema::validate(&sample_json()), Ok(()));
        // Unknown or pruned nodes end the stack there instead of dangling.
        let t = tree();
        let mut tables = ThreadTables::default();
        tables.add_sample(&t, 1.0, Some(StackId(77)), None, false);
        let p = one_thread_process(tables);
        assert_eq!(::tests::gecko_schema::validate(&to_json(&meta(), p)), Ok(()));
        // No threads at all is the one thing the front-end refuses; everything else is valid.
        let errs = ::tests::gecko_schema::validate(&to_json(&meta(), vec![])).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
    }

    #[test]
    fn offcpu_time_becomes_interval_samples_with_carry() {
        let t = tree();
        let mut tables = ThreadTables::default();
        // 2.5 ms at a 1 ms interval: 2 samples spread over the block, 0.5 ms carried over.
        assert_eq!(
            tables.add_off_cpu(&t, 10.0, Some(StackId(1)), 2_500_000, 2_500_000, 1_000_000),
            2
        );
        assert_eq!(tables.add_off_cpu(&t, 20.0, Some(StackId(1)), 400_000, 400_000, 1_000_000), 0);
        assert_eq!(tables.add_off_cpu(&t, 30.0, Some(StackId(1)), 100_000, 100_000, 1_000_000), 1);
        let times: Vec<f64> = tables.samples.iter().map(|r| r.time_ms).collect();
        assert_eq!(times, [10.625, 11.875, 30.05]);
        assert!(tables.samples.iter().all(|r| r.cpu_delta_ns == 0));
        assert_eq!(tables.busy_samples, 0);
        assert!(tables.frames.iter().all(|&(_, _, c)| c == CATEGORY_OFF_CPU));
    }

    #[test]
    fn meta_and_layout() {
        let j = sample_json();
        assert_eq!(j["meta"]["version"], 36);
        assert_eq!(j["meta"]["presymbolicated"], true);
        assert_eq!(j["meta"]["sampleUnits"]["threadCPUDelta"], "ns");
        assert_eq!(j["meta"]["profilingEndTime"], 100.0);
        assert_eq!(j["meta"]["rsprof"]["buffer"], 1);
        let cats: Vec<_> =
            j["meta"]["categories"].as_array().unwrap().iter().map(|c| c["name"].clone()).collect();
        assert_eq!(
            cats,
            [
                "Other",
                "Idle",
                "User",
                "Kernel",
                "Label",
                "USDT",
                "Off-CPU",
                "Truncated stack",
                "JavaScript",
                "Java",
                "Python",
                "JIT"
            ]
        );
        assert_eq!(j["threads"].as_array().unwrap().len(), 0);
        // One sub-process per process, busiest first, main thread first.
        let procs = j["processes"].as_array().unwrap();
        assert_eq!(procs.len(), 2);
        let app = &procs[0];
        assert_eq!(app["meta"]["startTime"], j["meta"]["startTime"]);
        let threads = app["threads"].as_array().unwrap();
        assert_eq!(
            (threads[0]["tid"].as_u64(), threads[0]["name"].as_str()),
            (Some(10), Some("app"))
        );
        assert_eq!(threads[1]["name"], "worker");
        for t in threads {
            assert_eq!(t["pid"], 10);
            assert_eq!(t["processName"], "app");
            assert_eq!(t["processType"], "default");
            assert_eq!(t["unregisterTime"], Value::Null);
        }
        assert_eq!(procs[1]["threads"][0]["name"], "swapper/0");
    }

    #[test]
    fn table_schemas() {
        let j = sample_json();
        let t = thread_of(&j, 10);
        for (table, schema) in [
            ("frameTable", FRAME_SCHEMA),
            ("stackTable", STACK_SCHEMA),
            ("samples", SAMPLE_SCHEMA),
            ("markers", MARKER_SCHEMA),
        ] {
            for (i, c) in schema.iter().enumerate() {
                assert_eq!(t[table]["schema"][c], i, "{table}.{c}");
            }
            let rows = t[table]["data"].as_array().unwrap();
            assert!(!rows.is_empty(), "{table}");
            for row in rows {
                assert_eq!(row.as_array().unwrap().len(), schema.len());
            }
        }
    }

    #[test]
    fn stacks_are_a_deduplicated_prefix_tree() {
        let j = sample_json();
        let t = thread_of(&j, 10);
        let stacks = t["stackTable"]["data"].as_array().unwrap();
        // main, main>work, main>work>hot, main>work>hot>syscall.
        assert_eq!(stacks.len(), 4);
        let mut seen = std::collections::HashSet::new();
        for (i, row) in stacks.iter().enumerate() {
            if let Some(p) = row[0].as_u64() {
                assert!((p as usize) < i);
            }
            assert!(seen.insert(row.to_string()), "duplicate stack row {row}");
        }
        let samples = t["samples"]["data"].as_array().unwrap();
        assert_eq!(samples[0][0], samples[2][0]);
        assert_eq!(samples[3][0], Value::Null);
        // Only frames this thread uses, once each.
        assert_eq!(t["frameTable"]["data"].as_array().unwrap().len(), 4);
        let worker = thread_of(&j, 11);
        assert_eq!(worker["frameTable"]["data"].as_array().unwrap().len(), 2);
        assert_eq!(worker["stringTable"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn inlined_frames_expand_and_strings_stay_unique() {
        let t = tree();
        let mut tables = ThreadTables::default();
        tables.add_sample(&t, 1.0, Some(StackId(4)), None, false);
        tables.add_sample(&t, 2.0, Some(StackId(2)), None, false);
        let p = one_thread_process(tables);
        let j = to_json(&meta(), p);
        let th = thread_of(&j, 1);
        let strings: Vec<&str> =
            th["stringTable"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
        let unique: std::collections::HashSet<_> = strings.iter().collect();
        assert_eq!(unique.len(), strings.len());
        assert!(strings.contains(&"work (in app) (src/main.rs:12:5)"));
        // hot and its inlined twin share a location string but not a frame row.
        assert_eq!(strings.iter().filter(|s| s.starts_with("hot ")).count(), 1);
        assert_eq!(th["frameTable"]["data"].as_array().unwrap().len(), 4);
        // Node 4 is main>work>hot>hot': 4 stack rows, the second sample reuses a prefix.
        assert_eq!(th["stackTable"]["data"].as_array().unwrap().len(), 4);
        let s = th["samples"]["data"].as_array().unwrap();
        assert_eq!((s[0][0].as_u64(), s[1][0].as_u64()), (Some(3), Some(2)));
        let ft = &th["frameTable"];
        let work = ft["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| {
                strings[r[col(ft, "location")].as_u64().unwrap() as usize].starts_with("work")
            })
            .unwrap();
        assert_eq!(
            (work[col(ft, "line")].as_u64(), work[col(ft, "column")].as_u64()),
            (Some(12), Some(5))
        );
        assert_eq!(location("f", "x.so (deleted)", None, None, None), "f (in x.so [deleted])");
        assert_eq!(location("f", "m", Some("a.c"), None, None), "f (in m)");
    }

    #[test]
    fn categories_by_kind_and_idle() {
        let j = sample_json();
        let t = thread_of(&j, 10);
        let ft = &t["frameTable"];
        let strings = t["stringTable"].as_array().unwrap();
        for row in ft["data"].as_array().unwrap() {
            let loc =
                strings[row[col(ft, "location")].as_u64().unwrap() as usize].as_str().unwrap();
            let expected =
                if loc.contains("[kernel.kallsyms]") { CATEGORY_KERNEL } else { CATEGORY_USER };
            assert_eq!(row[col(ft, "category")], expected, "{loc}");
            assert_eq!(row[col(ft, "subcategory")], 0);
        }
        let idle = thread_of(&j, 0);
        for row in idle["frameTable"]["data"].as_array().unwrap() {
            assert_eq!(row[col(ft, "category")], CATEGORY_IDLE);
        }
        let cats = j["meta"]["categories"].as_array().unwrap();
        assert_eq!(cats[CATEGORY_IDLE as usize]["name"], "Idle");
        assert_eq!(cats[CATEGORY_KERNEL as usize]["name"], "Kernel");
        assert_eq!(cats[CATEGORY_LABEL as usize]["name"], "Label");
        assert_eq!(cats.iter().position(|c| c["color"] == "grey"), Some(CATEGORY_OTHER as usize));
    }

    #[test]
    fn samples_with_cpu_deltas_and_markers() {
        let j = sample_json();
        let th = thread_of(&j, 10);
        let s = &th["samples"];
        let rows = s["data"].as_array().unwrap();
        let times: Vec<f64> = rows.iter().map(|r| r[col(s, "time")].as_f64().unwrap()).collect();
        assert_eq!(times, [1.0, 2.0, 3.0, 4.0]);
        let cpu: Vec<Option<u64>> =
            rows.iter().map(|r| r[col(s, "threadCPUDelta")].as_u64()).collect();
        assert_eq!(cpu, [Some(0), Some(900_000), Some(1_000_000), None]);
        assert!(rows.iter().all(|r| r[col(s, "eventDelay")] == 0));
        let m = &th["markers"]["data"][0];
        let strings = th["stringTable"].as_array().unwrap();
        assert_eq!(strings[m[0].as_u64().unwrap() as usize], "m");
        assert_eq!((m[1].as_f64(), m[2].as_f64(), m[3].as_u64()), (Some(1.0), Some(2.0), Some(1)));
        // An out-of-order sample is raised to keep the table sorted.
        let mut tb = ThreadTables::default();
        tb.add_sample(&tree(), 5.0, None, None, false);
        tb.add_sample(&tree(), 4.0, None, None, false);
        assert_eq!(tb.last_sample_ms(), 5.0);
    }

    #[test]
    fn root_range_covers_every_sample() {
        let mut m = meta();
        m.profiling_start_ms = 1.2;
        m.profiling_end_ms = 3.5;
        let j = to_json(&m, sample_processes(&tree()));
        // The last sample is at 4.0; the front-end's range is half-open, so the profile's ends
        // one interval (1 ms) after it.
        assert_eq!(j["meta"]["interval"], 1.0);
        assert_eq!(j["meta"]["profilingEndTime"], 5.0);
        assert_eq!(j["meta"]["profilingStartTime"], 1.0);
        assert_eq!(::tests::gecko_schema::validate(&j), Ok(()));
    }
}
