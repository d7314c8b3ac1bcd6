//! Turns typed USDT hits into stored markers as they arrive, so markers live in the bounded
//! chunked storage like samples (recycled with them, in snapshots too):
//!
//! * `rsprof:marker` → an instant marker named by its first argument, its text as payload;
//! * `rsprof:begin`/`rsprof:end` → one interval per (process, id), on the beginning thread;
//! * `rsprof:counter` → an instant marker with the value, graphed per counter name;
//! * `--usdt` probes → instant markers named `provider:name` with the probe's arguments;
//! * `--usdt-interval` → intervals from a start hit to the next end hit on the same thread.
//!
//! An end without its begin and a begin never ended are kept as Gecko IntervalEnd /
//! IntervalStart markers, which the Firefox Profiler shows as incomplete intervals.

use std::collections::HashMap;

use serde_json::{Value, json};

use super::{IntervalId, ProbeInfo, ProbeRegistry, ProbeRole, UsdtArg, UsdtHit};
use crate::{
    events::{MarkerField, MarkerPhase, StoredMarker, ThreadKey},
    ids::{Pid, Tid},
    storage::SampleSink,
};

/// Open intervals kept waiting for their end; past this, a begin is stored at once as an
/// incomplete interval so a program that never ends its intervals cannot grow memory.
pub const MAX_OPEN_INTERVALS: usize = 65536;

pub const SCHEMA_MARKER: &str = "RsprofMarker";
pub const SCHEMA_INTERVAL: &str = "RsprofInterval";
pub const SCHEMA_COUNTER: &str = "RsprofCounter";
/// Name of an `rsprof:end` whose begin was not seen (its name is unknown).
pub const UNMATCHED_END: &str = "rsprof:end without begin";

/// How many markers of each outcome were stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MarkerStats {
    pub instants: u64,
    pub intervals: u64,
    pub counters: u64,
    /// Begins (rsprof or `--usdt-interval` starts) never ended: stored as IntervalStart.
    pub unended: u64,
    /// Ends without a begin: stored as IntervalEnd.
    pub unbegun: u64,
}

struct Open {
    thread: ThreadKey,
    start_ns: u64,
    name: String,
    fields: Vec<Field>,
}

/// A field before its strings are interned.
#[derive(Clone, Debug, PartialEq)]
enum Field {
    Str(String),
    Int(i64),
    Uint(u64),
}

#[derive(Default)]
pub struct MarkerMaker {
    /// `rsprof:begin` by (process, id).
    open: HashMap<(Pid, u64), Open>,
    /// `--usdt-interval` starts by thread, innermost last.
    user_open: HashMap<(Tid, IntervalId), Vec<Open>>,
    open_count: usize,
    pub stats: MarkerStats,
}

fn field(a: &UsdtArg) -> Field {
    match a {
        UsdtArg::Int(v) => Field::Int(*v),
        UsdtArg::Uint(v) => Field::Uint(*v),
        other => Field::Str(other.to_string()),
    }
}

fn text(a: Option<&UsdtArg>) -> String {
    a.map(UsdtArg::to_string).unwrap_or_default()
}

/// Schema name of a `--usdt` probe's instant markers.
pub fn probe_schema(full_name: &str) -> String {
    format!("USDT {full_name}")
}

/// Schema name of a `--usdt-interval` request's markers.
pub fn interval_schema(spec: &str) -> String {
    format!("USDT interval {spec}")
}

/// Marker name of a `--usdt-interval` request: the spec without its path.
fn interval_name(spec: &str) -> &str {
    spec.split_once('@').map_or(spec, |(s, _)| s)
}

impl MarkerMaker {
    /// Stores the markers `hit` completes (none for a begin, which waits for its end).
    pub fn hit<S: SampleSink>(&mut self, reg: &ProbeRegistry, hit: &UsdtHit, sink: &mut S) {
        let Some(probe) = reg.probe(hit.probe) else { return };
        let thread = ThreadKey { pid: hit.pid, tid: hit.tid };
        let t = hit.time_ns;
        let a = &hit.args;
        match probe.role {
            ProbeRole::RsprofMarker => {
                self.stats.instants += 1;
                let fields = [Field::Str(text(a.get(1)))];
                store(
                    sink,
                    thread,
                    MarkerPhase::Instant,
                    t,
                    t,
                    &text(a.first()),
                    SCHEMA_MARKER,
                    &fields,
                );
            }
            ProbeRole::RsprofCounter => {
                self.stats.counters += 1;
                let v = a.get(1).and_then(UsdtArg::as_i64).unwrap_or(0);
                let fields = [Field::Int(v)];
                store(
                    sink,
                    thread,
                    MarkerPhase::Instant,
                    t,
                    t,
                    &text(a.first()),
                    SCHEMA_COUNTER,
                    &fields,
                );
            }
            ProbeRole::RsprofBegin => {
                let id = a.get(1).and_then(UsdtArg::as_u64).unwrap_or(0);
                let open = Open {
                    thread,
                    start_ns: t,
                    name: text(a.first()),
                    fields: vec![Field::Uint(id)],
                };
                if self.open_count >= MAX_OPEN_INTERVALS {
                    self.unended(sink, SCHEMA_INTERVAL, open);
                } else if let Some(prev) = self.open.insert((hit.pid, id), open) {
                    // The same id begun again before its end: the first one never ended.
                    self.unended(sink, SCHEMA_INTERVAL, prev);
                } else {
                    self.open_count += 1;
                }
            }
            ProbeRole::RsprofEnd => {
                let id = a.first().and_then(UsdtArg::as_u64).unwrap_or(0);
                match self.open.remove(&(hit.pid, id)) {
                    Some(o) => {
                        self.open_count -= 1;
                        self.stats.intervals += 1;
                        let phase = MarkerPhase::Interval;
                        store(
                            sink,
                            o.thread,
                            phase,
                            o.start_ns,
                            t,
                            &o.name,
                            SCHEMA_INTERVAL,
                            &o.fields,
                        );
                    }
                    None => {
                        self.stats.unbegun += 1;
                        let fields = [Field::Uint(id)];
                        let phase = MarkerPhase::IntervalEnd;
                        store(sink, thread, phase, t, t, UNMATCHED_END, SCHEMA_INTERVAL, &fields);
                    }
                }
            }
            ProbeRole::UserInstant => {
                self.stats.instants += 1;
                let fields: Vec<Field> = a.iter().map(field).collect();
                let name = probe.full_name();
                store(
                    sink,
                    thread,
                    MarkerPhase::Instant,
                    t,
                    t,
                    &name,
                    &probe_schema(&name),
                    &fields,
                );
            }
            ProbeRole::UserIntervalStart(id) => {
                let Some(spec) = reg.intervals.get(id.0 as usize) else { return };
                let open = Open {
                    thread,
                    start_ns: t,
                    name: interval_name(spec).to_owned(),
                    fields: a.iter().map(field).collect(),
                };
                if self.open_count >= MAX_OPEN_INTERVALS {
                    self.unended(sink, &interval_schema(spec), open);
                } else {
                    self.user_open.entry((hit.tid, id)).or_default().push(open);
                    self.open_count += 1;
                }
            }
            ProbeRole::UserIntervalEnd(id) => {
                let Some(spec) = reg.intervals.get(id.0 as usize) else { return };
                let schema = interval_schema(spec);
                let starts = self.user_open.get_mut(&(hit.tid, id));
                match starts.and_then(Vec::pop) {
                    Some(mut o) => {
                        self.open_count -= 1;
                        self.stats.intervals += 1;
                        // Start arguments first, then the end's, as the schema lists them.
                        let n_start = start_arg_count(reg, id);
                        o.fields.resize(n_start, Field::Str(String::new()));
                        o.fields.extend(a.iter().map(field));
                        let phase = MarkerPhase::Interval;
                        store(sink, o.thread, phase, o.start_ns, t, &o.name, &schema, &o.fields);
                    }
                    None => {
                        self.stats.unbegun += 1;
                        let n_start = start_arg_count(reg, id);
                        let mut fields = vec![Field::Str(String::new()); n_start];
                        fields.extend(a.iter().map(field));
                        let name = interval_name(spec);
                        let phase = MarkerPhase::IntervalEnd;
                        store(sink, thread, phase, t, t, name, &schema, &fields);
                    }
                }
                if self.user_open.get(&(hit.tid, id)).is_some_and(Vec::is_empty) {
                    self.user_open.remove(&(hit.tid, id));
                }
            }
            ProbeRole::RsprofLabelPush | ProbeRole::RsprofLabelPop => {}
        }
    }

    fn unended<S: SampleSink>(&mut self, sink: &mut S, schema: &str, o: Open) {
        self.stats.unended += 1;
        let phase = MarkerPhase::IntervalStart;
        store(sink, o.thread, phase, o.start_ns, o.start_ns, &o.name, schema, &o.fields);
    }

    /// Stores every interval still open as an incomplete one (at the end of a recording).
    pub fn finish<S: SampleSink>(&mut self, reg: &ProbeRegistry, sink: &mut S) {
        let mut open: Vec<(String, Open)> =
            self.open.drain().map(|(_, o)| (SCHEMA_INTERVAL.to_owned(), o)).collect();
        for ((_, id), starts) in self.user_open.drain() {
            let spec = reg.intervals.get(id.0 as usize).map_or("", String::as_str);
            open.extend(starts.into_iter().map(|o| (interval_schema(spec), o)));
        }
        open.sort_by_key(|(_, o)| o.start_ns);
        self.open_count = 0;
        for (schema, o) in open {
            self.unended(sink, &schema, o);
        }
    }

    /// Intervals waiting for their end.
    pub fn open_intervals(&self) -> usize {
        self.open_count
    }
}

/// Arguments of a `--usdt-interval`'s start probe (the most any of its sites has).
fn start_arg_count(reg: &ProbeRegistry, id: IntervalId) -> usize {
    arg_count(reg, |p| p.role == ProbeRole::UserIntervalStart(id))
}

/// The most arguments any site of the probes `which` selects has.
fn arg_count(reg: &ProbeRegistry, which: impl Fn(&ProbeInfo) -> bool) -> usize {
    reg.sites
        .iter()
        .filter(|s| reg.probe(s.probe).is_some_and(&which))
        .map(|s| s.args.len())
        .max()
        .unwrap_or(0)
}

#[allow(clippy::too_many_arguments)]
fn store<S: SampleSink>(
    sink: &mut S,
    thread: ThreadKey,
    phase: MarkerPhase,
    start_ns: u64,
    end_ns: u64,
    name: &str,
    schema: &str,
    fields: &[Field],
) {
    let fields = fields
        .iter()
        .map(|f| match f {
            Field::Str(s) => MarkerField::Str(sink.intern_string(s)),
            Field::Int(v) => MarkerField::Int(*v),
            Field::Uint(v) => MarkerField::Uint(*v),
        })
        .collect();
    let marker = StoredMarker {
        phase,
        start_ns,
        end_ns,
        name: sink.intern_string(name),
        schema: sink.intern_string(schema),
        fields,
    };
    sink.push_marker(thread, marker);
}

fn arg_fields(prefix: &str, label: &str, n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| json!({"key": format!("{prefix}{i}"), "label": format!("{label} {i}"), "format": "integer"}))
        .collect()
}

/// `meta.markerSchema` entries for every marker this registry's probes can produce. Field
/// order is the order of the stored fields.
pub fn schemas(reg: &ProbeRegistry) -> Vec<Value> {
    let mut out = vec![
        json!({
            "name": SCHEMA_MARKER,
            "display": ["marker-chart", "marker-table"],
            "chartLabel": "{marker.data.text}",
            "tableLabel": "{marker.data.text}",
            "tooltipLabel": "{marker.name}: {marker.data.text}",
            "data": [
                {"key": "text", "label": "Text", "format": "string", "searchable": true},
                {"label": "Source", "value": "rsprof:marker USDT probe"},
            ],
        }),
        json!({
            "name": SCHEMA_INTERVAL,
            "display": ["marker-chart", "marker-table", "timeline-overview"],
            "chartLabel": "{marker.name}",
            "tableLabel": "{marker.name} (id {marker.data.id})",
            "tooltipLabel": "{marker.name}",
            "data": [
                {"key": "id", "label": "Id", "format": "integer"},
                {"label": "Source", "value": "rsprof:begin / rsprof:end USDT probes"},
            ],
        }),
        json!({
            "name": SCHEMA_COUNTER,
            "display": ["marker-chart", "marker-table"],
            "chartLabel": "{marker.data.value}",
            "tableLabel": "{marker.name} = {marker.data.value}",
            "tooltipLabel": "{marker.name} = {marker.data.value}",
            "data": [
                {"key": "value", "label": "Value", "format": "integer"},
                {"label": "Source", "value": "rsprof:counter USDT probe"},
            ],
            "graphs": [{"key": "value", "type": "line", "color": "blue"}],
        }),
    ];
    let mut seen = std::collections::HashSet::new();
    for p in &reg.probes {
        if p.role != ProbeRole::UserInstant {
            continue;
        }
        let name = p.full_name();
        if !seen.insert(name.clone()) {
            continue;
        }
        let n = arg_count(reg, |q| q.role == ProbeRole::UserInstant && q.full_name() == name);
        let labels: Vec<String> = (0..n).map(|i| format!("{{marker.data.arg{i}}}")).collect();
        out.push(json!({
            "name": probe_schema(&name),
            "display": ["marker-chart", "marker-table"],
            "tableLabel": labels.join(" "),
            "tooltipLabel": format!("{name} {}", labels.join(" ")),
            "data": arg_fields("arg", "Argument", n),
        }));
    }
    for (i, spec) in reg.intervals.iter().enumerate() {
        let id = IntervalId(i as u32);
        let n_start = start_arg_count(reg, id);
        let n_end = arg_count(reg, |p| p.role == ProbeRole::UserIntervalEnd(id));
        let mut data = arg_fields("start", "Start argument", n_start);
        data.extend(arg_fields("end", "End argument", n_end));
        out.push(json!({
            "name": interval_schema(spec),
            "display": ["marker-chart", "marker-table", "timeline-overview"],
            "chartLabel": "{marker.name}",
            "tableLabel": "{marker.name}",
            "tooltipLabel": "{marker.name}",
            "data": data,
        }));
    }
    out
}
