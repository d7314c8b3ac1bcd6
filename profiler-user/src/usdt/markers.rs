//! Turns typed USDT hits into stored markers as they arrive, so markers live in the bounded
//! chunked storage like samples (recycled with them, in snapshots too):
//!
//! * `rsprof:marker` → an instant marker named by its first argument, its text as payload;
//! * `rsprof:begin`/`rsprof:end` → one interval per (process, id), on the beginning thread;
//! * `rsprof:counter` → an instant marker with the value, graphed per counter name;
//! * `--usdt` probes → instant markers named `provider:name` with the probe's arguments;
//! * `--usdt-interval` → intervals from a start hit to the next end hit on the same thread.
//!
//! An end without its begin and a begin never ended are kept as IntervalEnd / IntervalStart
//! markers, which the Firefox Profiler shows as incomplete intervals.

use std::collections::HashMap;

use super::{IntervalId, ProbeInfo, ProbeRegistry, ProbeRole, UsdtArg, UsdtHit};
use crate::{
    model::{
        ids::{Pid, ThreadKey, Tid},
        markers::{
            FieldFormat, Marker, MarkerPhase, MarkerSchema, MarkerSource, MarkerValue, MarkerView,
            SchemaField,
        },
        time::MonoNs,
    },
    store::{
        SampleSink,
        codec::{MarkerField, StoredMarker},
    },
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
    Absent,
}

#[derive(Default)]
pub struct MarkerMaker {
    /// `rsprof:begin` by process, then id.
    open: HashMap<Pid, HashMap<u64, Open>>,
    /// `--usdt-interval` starts by thread, then interval, innermost last.
    user_open: HashMap<Tid, HashMap<IntervalId, Vec<Open>>>,
    open_count: usize,
    /// Argument counts already looked up (a lookup scans every site).
    arity: HashMap<Arity, usize>,
    pub stats: MarkerStats,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Arity {
    Instant(String),
    Start(IntervalId),
    End(IntervalId),
}

/// A probe's integer arguments as fields, exactly `n` of them (the probe's arity as first
/// attached: the schema's keys are positional). An argument that could not be read, or one a
/// site lacks, is left out of the payload.
fn int_fields(args: &[UsdtArg], n: usize) -> Vec<Field> {
    (0..n)
        .map(|i| match args.get(i) {
            Some(UsdtArg::Int(v)) => Field::Int(*v),
            Some(UsdtArg::Uint(v)) => Field::Uint(*v),
            _ => Field::Absent,
        })
        .collect()
}

impl Field {
    fn value(&self) -> Option<MarkerValue> {
        match self {
            Field::Str(s) => Some(MarkerValue::Str(s.clone())),
            Field::Int(v) => Some(MarkerValue::Int(*v)),
            Field::Uint(v) => Some(MarkerValue::Uint(*v)),
            Field::Absent => None,
        }
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

fn user_interval_schema(reg: &ProbeRegistry, id: IntervalId) -> String {
    interval_schema(reg.intervals.get(id.0 as usize).map_or("", String::as_str))
}

/// Marker name of a `--usdt-interval` request: the spec without its path.
fn interval_name(spec: &str) -> &str {
    spec.split_once('@').map_or(spec, |(s, _)| s)
}

impl MarkerMaker {
    /// Stores the markers `hit` completes (none for a begin, which waits for its end).
    pub fn hit<S: SampleSink>(&mut self, reg: &ProbeRegistry, hit: &UsdtHit, sink: &mut S) {
        let Some(probe) = reg.probe(hit.probe) else { return };
        let thread = ThreadKey::Task { pid: hit.pid, tid: hit.tid };
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
            ProbeRole::RsprofBegin => self.rsprof_begin(sink, hit, thread),
            ProbeRole::RsprofEnd => self.rsprof_end(sink, hit, thread),
            ProbeRole::UserInstant => {
                self.stats.instants += 1;
                let name = probe.full_name();
                let fields = int_fields(a, self.arity(reg, Arity::Instant(name.clone())));
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
            ProbeRole::UserIntervalStart(id) => self.user_start(reg, sink, hit, thread, id),
            ProbeRole::UserIntervalEnd(id) => self.user_end(reg, sink, hit, thread, id),
            ProbeRole::RsprofLabelPush | ProbeRole::RsprofLabelPop => {}
        }
    }

    /// `rsprof:begin(name, id)`: an interval opened, per process and id (bounded).
    fn rsprof_begin<S: SampleSink>(&mut self, sink: &mut S, hit: &UsdtHit, thread: ThreadKey) {
        let t = hit.time_ns;
        let a = &hit.args;
        let id = a.get(1).and_then(UsdtArg::as_u64).unwrap_or(0);
        let open =
            Open { thread, start_ns: t, name: text(a.first()), fields: vec![Field::Uint(id)] };
        if self.open_count >= MAX_OPEN_INTERVALS {
            self.unended(sink, SCHEMA_INTERVAL, open);
        } else if let Some(prev) = self.open.entry(hit.pid).or_default().insert(id, open) {
            // The same id begun again before its end: the first one never ended.
            self.unended(sink, SCHEMA_INTERVAL, prev);
        } else {
            self.open_count += 1;
        }
    }

    /// `rsprof:end(id)`: the process's interval `id` closed, or an end with no begin (counted).
    fn rsprof_end<S: SampleSink>(&mut self, sink: &mut S, hit: &UsdtHit, thread: ThreadKey) {
        let t = hit.time_ns;
        let a = &hit.args;
        let id = a.first().and_then(UsdtArg::as_u64).unwrap_or(0);
        let of_pid = self.open.get_mut(&hit.pid);
        let found = of_pid.and_then(|m| m.remove(&id));
        if self.open.get(&hit.pid).is_some_and(HashMap::is_empty) {
            self.open.remove(&hit.pid);
        }
        match found {
            Some(o) => {
                self.open_count -= 1;
                self.stats.intervals += 1;
                let phase = MarkerPhase::Interval;
                store(sink, o.thread, phase, o.start_ns, t, &o.name, SCHEMA_INTERVAL, &o.fields);
            }
            None => {
                self.stats.unbegun += 1;
                let fields = [Field::Uint(id)];
                let phase = MarkerPhase::IntervalEnd;
                store(sink, thread, phase, t, t, UNMATCHED_END, SCHEMA_INTERVAL, &fields);
            }
        }
    }

    /// A start probe of a `--usdt-interval`: opened per thread, nesting as a stack (bounded).
    fn user_start<S: SampleSink>(
        &mut self,
        reg: &ProbeRegistry,
        sink: &mut S,
        hit: &UsdtHit,
        thread: ThreadKey,
        id: IntervalId,
    ) {
        let t = hit.time_ns;
        let a = &hit.args;
        let Some(spec) = reg.intervals.get(id.0 as usize) else { return };
        let open = Open {
            thread,
            start_ns: t,
            name: interval_name(spec).to_owned(),
            fields: int_fields(a, self.arity(reg, Arity::Start(id))),
        };
        if self.open_count >= MAX_OPEN_INTERVALS {
            self.unended(sink, &interval_schema(spec), open);
        } else {
            self.user_open.entry(hit.tid).or_default().entry(id).or_default().push(open);
            self.open_count += 1;
        }
    }

    /// An end probe of a `--usdt-interval`: the thread's innermost open one closed, or an end
    /// with no start (counted), its start arguments absent.
    fn user_end<S: SampleSink>(
        &mut self,
        reg: &ProbeRegistry,
        sink: &mut S,
        hit: &UsdtHit,
        thread: ThreadKey,
        id: IntervalId,
    ) {
        let t = hit.time_ns;
        let a = &hit.args;
        let Some(spec) = reg.intervals.get(id.0 as usize) else { return };
        let schema = interval_schema(spec);
        let end_fields = int_fields(a, self.arity(reg, Arity::End(id)));
        let starts = self.user_open.get_mut(&hit.tid).and_then(|m| m.get_mut(&id));
        match starts.and_then(Vec::pop) {
            Some(mut o) => {
                self.open_count -= 1;
                self.stats.intervals += 1;
                // Start arguments first, then the end's, as the schema lists them.
                o.fields.extend(end_fields);
                let phase = MarkerPhase::Interval;
                store(sink, o.thread, phase, o.start_ns, t, &o.name, &schema, &o.fields);
            }
            None => {
                self.stats.unbegun += 1;
                let mut fields = vec![Field::Absent; self.arity(reg, Arity::Start(id))];
                fields.extend(end_fields);
                let name = interval_name(spec);
                let phase = MarkerPhase::IntervalEnd;
                store(sink, thread, phase, t, t, name, &schema, &fields);
            }
        }
        if let Some(m) = self.user_open.get_mut(&hit.tid) {
            if m.get(&id).is_some_and(Vec::is_empty) {
                m.remove(&id);
            }
            if m.is_empty() {
                self.user_open.remove(&hit.tid);
            }
        }
    }

    fn arity(&mut self, reg: &ProbeRegistry, key: Arity) -> usize {
        if let Some(&n) = self.arity.get(&key) {
            return n;
        }
        let n = match &key {
            Arity::Instant(name) => instant_arg_count(reg, name),
            Arity::Start(id) => start_arg_count(reg, *id),
            Arity::End(id) => end_arg_count(reg, *id),
        };
        // 0 may mean "no site attached yet" (an end probe found before its start probe).
        if n > 0 {
            self.arity.insert(key, n);
        }
        n
    }

    fn unended<S: SampleSink>(&mut self, sink: &mut S, schema: &str, o: Open) {
        self.stats.unended += 1;
        let phase = MarkerPhase::IntervalStart;
        store(sink, o.thread, phase, o.start_ns, o.start_ns, &o.name, schema, &o.fields);
    }

    /// Stores every interval still open as an incomplete one (at the end of a recording).
    pub fn finish<S: SampleSink>(&mut self, reg: &ProbeRegistry, sink: &mut S) {
        let pids: Vec<Pid> = self.open.keys().copied().collect();
        let tids: Vec<Tid> = self.user_open.keys().copied().collect();
        self.exited(reg, sink, &pids, &tids);
    }

    /// Threads and processes that exited: their open intervals can no longer end (and their
    /// ids may be reused), so they are stored now as incomplete ones.
    pub fn exited<S: SampleSink>(
        &mut self,
        reg: &ProbeRegistry,
        sink: &mut S,
        pids: &[Pid],
        tids: &[Tid],
    ) {
        let mut open: Vec<(String, Open)> = Vec::new();
        for pid in pids {
            let ids = self.open.remove(pid).unwrap_or_default();
            open.extend(ids.into_values().map(|o| (SCHEMA_INTERVAL.to_owned(), o)));
        }
        for tid in tids {
            for (id, starts) in self.user_open.remove(tid).unwrap_or_default() {
                let schema = user_interval_schema(reg, id);
                open.extend(starts.into_iter().map(|o| (schema.clone(), o)));
            }
        }
        open.sort_by_key(|(_, o)| o.start_ns);
        self.open_count -= open.len();
        for (schema, o) in open {
            self.unended(sink, &schema, o);
        }
    }

    /// The intervals waiting for their end, for a snapshot: IntervalStart markers.
    pub fn open_markers(&self, reg: &ProbeRegistry) -> Vec<(ThreadKey, Marker)> {
        let pending = |schema: &str, o: &Open| {
            let start = MonoNs(o.start_ns);
            let marker = Marker {
                name: o.name.clone(),
                schema: schema.to_owned(),
                phase: MarkerPhase::IntervalStart,
                start,
                end: start,
                fields: o.fields.iter().map(Field::value).collect(),
            };
            (o.thread, marker)
        };
        let mut out: Vec<(ThreadKey, Marker)> = self
            .open
            .values()
            .flat_map(|m| m.values())
            .map(|o| pending(SCHEMA_INTERVAL, o))
            .collect();
        for by_id in self.user_open.values() {
            for (id, starts) in by_id {
                let schema = user_interval_schema(reg, *id);
                out.extend(starts.iter().map(|o| pending(&schema, o)));
            }
        }
        out.sort_by_key(|(_, m)| m.start);
        out
    }

    /// Intervals waiting for their end.
    pub fn open_intervals(&self) -> usize {
        self.open_count
    }
}

/// Arguments of a `--usdt-interval`'s start probe.
fn start_arg_count(reg: &ProbeRegistry, id: IntervalId) -> usize {
    first_arity(reg, |p| p.role == ProbeRole::UserIntervalStart(id))
}

fn instant_arg_count(reg: &ProbeRegistry, name: &str) -> usize {
    first_arity(reg, |p| p.role == ProbeRole::UserInstant && p.full_name() == name)
}

fn end_arg_count(reg: &ProbeRegistry, id: IntervalId) -> usize {
    first_arity(reg, |p| p.role == ProbeRole::UserIntervalEnd(id))
}

/// Arguments of the first site attached of the probes `which` selects. Sites are only ever
/// appended, so this never changes during a recording and fields stay under the keys the
/// schema gives them, even if a later site (another build of the file) has more or fewer.
fn first_arity(reg: &ProbeRegistry, which: impl Fn(&ProbeInfo) -> bool) -> usize {
    reg.sites.iter().find(|s| reg.probe(s.probe).is_some_and(&which)).map_or(0, |s| s.args.len())
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
            Field::Absent => MarkerField::Absent,
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

fn arg_fields(prefix: &str, label: &str, n: usize) -> Vec<SchemaField> {
    (0..n)
        .map(|i| {
            SchemaField::new(&format!("{prefix}{i}"), &format!("{label} {i}"), FieldFormat::Integer)
        })
        .collect()
}

/// Schemas of every marker this registry's probes can produce. Field order is the order of
/// the stored fields.
pub fn schemas(reg: &ProbeRegistry) -> Vec<MarkerSchema> {
    use MarkerView::*;
    let note = |source: &str| vec![("Source".to_owned(), source.to_owned())];
    let label = |s: &str| Some(s.to_owned());
    let mut marker = MarkerSchema::new(SCHEMA_MARKER, MarkerSource::Usdt, &[Chart, Table]);
    marker.chart_label = label("{text}");
    marker.table_label = label("{text}");
    marker.tooltip_label = label("{name}: {text}");
    marker.fields = vec![SchemaField {
        searchable: true,
        ..SchemaField::new("text", "Text", FieldFormat::String)
    }];
    marker.notes = note("rsprof:marker USDT probe");
    let mut interval =
        MarkerSchema::new(SCHEMA_INTERVAL, MarkerSource::Usdt, &[Chart, Table, Timeline]);
    interval.chart_label = label("{name}");
    interval.table_label = label("{name} (id {id})");
    interval.tooltip_label = label("{name}");
    interval.fields = vec![SchemaField::new("id", "Id", FieldFormat::Integer)];
    interval.notes = note("rsprof:begin / rsprof:end USDT probes");
    let mut counter = MarkerSchema::new(SCHEMA_COUNTER, MarkerSource::Usdt, &[Chart, Table]);
    counter.chart_label = label("{value}");
    counter.table_label = label("{name} = {value}");
    counter.tooltip_label = label("{name} = {value}");
    counter.fields = vec![SchemaField::new("value", "Value", FieldFormat::Integer)];
    counter.notes = note("rsprof:counter USDT probe");
    counter.graphs = vec!["value".to_owned()];
    let mut out = vec![marker, interval, counter];
    let mut seen = std::collections::HashSet::new();
    for p in &reg.probes {
        if p.role != ProbeRole::UserInstant {
            continue;
        }
        let name = p.full_name();
        if !seen.insert(name.clone()) {
            continue;
        }
        let n = instant_arg_count(reg, &name);
        let labels: Vec<String> = (0..n).map(|i| format!("{{arg{i}}}")).collect();
        let mut s = MarkerSchema::new(&probe_schema(&name), MarkerSource::Usdt, &[Chart, Table]);
        s.table_label = Some(labels.join(" "));
        s.tooltip_label = Some(format!("{name} {}", labels.join(" ")));
        s.fields = arg_fields("arg", "Argument", n);
        out.push(s);
    }
    for (i, spec) in reg.intervals.iter().enumerate() {
        let id = IntervalId(i as u32);
        let mut s = MarkerSchema::new(
            &interval_schema(spec),
            MarkerSource::Usdt,
            &[Chart, Table, Timeline],
        );
        s.chart_label = label("{name}");
        s.table_label = label("{name}");
        s.tooltip_label = label("{name}");
        s.fields = arg_fields("start", "Start argument", start_arg_count(reg, id));
        s.fields.extend(arg_fields("end", "End argument", end_arg_count(reg, id)));
        out.push(s);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        store::codec::StoredEvent,
        store::{ChunkedStore, snapshot::read_events},
        usdt::{ProbeId, SiteInfo, UsdtString},
    };

    /// A marker read back from storage: (tid, phase, name, start, end, fields as text).
    type Row = (u32, MarkerPhase, String, u64, u64, Vec<String>);

    fn registry() -> ProbeRegistry {
        let roles = [
            ProbeRole::RsprofMarker,
            ProbeRole::RsprofBegin,
            ProbeRole::RsprofEnd,
            ProbeRole::RsprofCounter,
            ProbeRole::UserIntervalStart(IntervalId(0)),
            ProbeRole::UserIntervalEnd(IntervalId(0)),
            ProbeRole::UserInstant,
        ];
        let mut reg =
            ProbeRegistry { intervals: vec!["py:start:done@/bin/py".into()], ..Default::default() };
        for (i, role) in roles.into_iter().enumerate() {
            reg.probes.push(ProbeInfo {
                provider: "p".into(),
                name: format!("n{i}"),
                path: "/x".into(),
                role,
            });
            let args = crate::usdt::args::parse_args("-4@%edi", 0, &HashMap::new()).unwrap();
            reg.sites.push(SiteInfo {
                probe: ProbeId(i as u32),
                file_offset: 0,
                args,
                strings: vec![],
            });
        }
        reg
    }

    fn s(t: &str) -> UsdtArg {
        UsdtArg::Str(Ok(UsdtString { text: t.into(), truncated: false }))
    }

    fn hit(t: u64, tid: u32, probe: u32, args: Vec<UsdtArg>) -> UsdtHit {
        UsdtHit { time_ns: t, pid: Pid(1), tid: Tid(tid), cpu: 0, probe: ProbeId(probe), args }
    }

    fn run(hits: &[UsdtHit]) -> (Vec<Row>, MarkerStats) {
        let reg = registry();
        let mut store = ChunkedStore::new(1 << 20);
        let mut mm = MarkerMaker::default();
        for h in hits {
            mm.hit(&reg, h, &mut store);
        }
        mm.finish(&reg, &mut store);
        let snap = store.into_snapshot();
        let mut rows = Vec::new();
        read_events(
            &snap,
            |ev| {
                let StoredEvent::Marker(key, m) = ev else { return };
                let text = |id| snap.string(id).unwrap().to_owned();
                let fields = m
                    .fields
                    .iter()
                    .map(|f| match *f {
                        MarkerField::Str(id) => text(id),
                        MarkerField::Int(v) => v.to_string(),
                        MarkerField::Uint(v) => v.to_string(),
                        MarkerField::Absent => "-".into(),
                    })
                    .collect();
                let ThreadKey::Task { tid, .. } = key else { panic!("USDT markers are on tasks") };
                rows.push((tid.0, m.phase, text(m.name), m.start_ns, m.end_ns, fields));
            },
            |e| panic!("{e}"),
        );
        (rows, mm.stats)
    }

    #[test]
    fn begin_end_pair_by_id_on_the_beginning_thread() {
        use MarkerPhase::*;
        let (rows, stats) = run(&[
            hit(10, 7, 1, vec![s("outer"), UsdtArg::Uint(1)]),
            hit(20, 7, 1, vec![s("inner"), UsdtArg::Uint(2)]),
            hit(30, 7, 2, vec![UsdtArg::Uint(2)]),
            // Ended on another thread of the process: still drawn on the beginning thread.
            hit(40, 8, 2, vec![UsdtArg::Uint(1)]),
            hit(50, 8, 2, vec![UsdtArg::Uint(9)]),
            hit(60, 7, 1, vec![s("left open"), UsdtArg::Uint(3)]),
        ]);
        let row = |tid, phase, name: &str, a, b, f: &str| {
            (tid, phase, name.to_owned(), a, b, vec![f.to_owned()])
        };
        assert_eq!(
            rows,
            vec![
                row(7, Interval, "inner", 20, 30, "2"),
                row(7, Interval, "outer", 10, 40, "1"),
                row(8, IntervalEnd, UNMATCHED_END, 50, 50, "9"),
                row(7, IntervalStart, "left open", 60, 60, "3"),
            ]
        );
        assert_eq!((stats.intervals, stats.unbegun, stats.unended), (2, 1, 1));
    }

    #[test]
    fn instants_counters_and_user_probes() {
        use MarkerPhase::*;
        let (rows, stats) = run(&[
            hit(1, 7, 0, vec![s("tick"), UsdtArg::Str(Err(crate::usdt::StrError::Null))]),
            hit(2, 7, 3, vec![s("depth"), UsdtArg::Int(-4)]),
            hit(3, 7, 6, vec![UsdtArg::Uint(5), UsdtArg::Int(-1)]),
        ]);
        let r = |phase, name: &str, t, f: &[&str]| {
            (7, phase, name.to_owned(), t, t, f.iter().map(|s| s.to_string()).collect())
        };
        assert_eq!(
            rows,
            vec![
                r(Instant, "tick", 1, &["<null>"]),
                r(Instant, "depth", 2, &["-4"]),
                // Its first site has one argument: the schema lists one.
                r(Instant, "p:n6", 3, &["5"]),
            ]
        );
        assert_eq!((stats.instants, stats.counters), (2, 1));
    }

    #[test]
    fn user_intervals_pair_per_thread_innermost_first() {
        use MarkerPhase::*;
        let (rows, stats) = run(&[
            hit(10, 7, 4, vec![UsdtArg::Int(2)]),
            hit(11, 8, 4, vec![UsdtArg::Int(0)]),
            hit(12, 7, 4, vec![UsdtArg::Int(1)]),
            hit(13, 7, 5, vec![UsdtArg::Int(100)]),
            hit(14, 7, 5, vec![UsdtArg::Int(200)]),
            hit(15, 7, 5, vec![UsdtArg::Int(300)]),
        ]);
        let r = |tid, phase, a, b, f: &[&str]| {
            (
                tid,
                phase,
                "py:start:done".to_owned(),
                a,
                b,
                f.iter().map(|s| s.to_string()).collect(),
            )
        };
        assert_eq!(
            rows,
            vec![
                r(7, Interval, 12, 13, &["1", "100"]),
                r(7, Interval, 10, 14, &["2", "200"]),
                r(7, IntervalEnd, 15, 15, &["-", "300"]),
                r(8, IntervalStart, 11, 11, &["0"]),
            ]
        );
        assert_eq!((stats.intervals, stats.unbegun, stats.unended), (2, 1, 1));
    }

    #[test]
    fn exits_close_what_they_left_open() {
        use MarkerPhase::*;
        let reg = registry();
        let mut store = ChunkedStore::new(1 << 20);
        let mut mm = MarkerMaker::default();
        mm.hit(&reg, &hit(10, 7, 1, vec![s("req"), UsdtArg::Uint(1)]), &mut store);
        mm.hit(&reg, &hit(11, 8, 4, vec![UsdtArg::Int(2)]), &mut store);
        mm.hit(&reg, &hit(12, 9, 4, vec![UsdtArg::Int(0)]), &mut store);
        // Thread 8 exits: its gc start is closed, thread 9's stays open.
        mm.exited(&reg, &mut store, &[], &[Tid(8)]);
        assert_eq!((mm.open_intervals(), mm.stats.unended), (2, 1));
        // The process exits: its rsprof interval is closed; a reused id no longer pairs.
        mm.exited(&reg, &mut store, &[Pid(1)], &[Tid(9)]);
        assert_eq!((mm.open_intervals(), mm.stats.unended), (0, 3));
        mm.hit(&reg, &hit(20, 7, 2, vec![UsdtArg::Uint(1)]), &mut store);
        assert_eq!(mm.stats.unbegun, 1);
        let snap = store.into_snapshot();
        let mut phases = Vec::new();
        read_events(
            &snap,
            |ev| {
                if let StoredEvent::Marker(_, m) = ev {
                    phases.push(m.phase)
                }
            },
            |e| panic!("{e}"),
        );
        assert_eq!(phases, [IntervalStart, IntervalStart, IntervalStart, IntervalEnd]);
    }

    #[test]
    fn open_intervals_are_bounded() {
        let reg = registry();
        let mut store = ChunkedStore::new(64 << 20);
        let mut mm = MarkerMaker::default();
        for id in 0..MAX_OPEN_INTERVALS as u64 + 10 {
            mm.hit(&reg, &hit(id, 7, 1, vec![s("b"), UsdtArg::Uint(id)]), &mut store);
        }
        assert_eq!(mm.open_intervals(), MAX_OPEN_INTERVALS);
        assert_eq!(mm.stats.unended, 10);
    }

    #[test]
    fn schemas_list_fields_in_stored_order() {
        let schemas = schemas(&registry());
        let by_name = |n: &str| schemas.iter().find(|s| s.name == n).unwrap().clone();
        let keys = |s: &MarkerSchema| -> Vec<String> { s.keys().map(str::to_owned).collect() };
        assert_eq!(keys(&by_name(SCHEMA_MARKER)), ["text"]);
        assert_eq!(keys(&by_name(SCHEMA_INTERVAL)), ["id"]);
        assert_eq!(by_name(SCHEMA_COUNTER).graphs, ["value"]);
        assert_eq!(keys(&by_name("USDT p:n6")), ["arg0"]);
        let iv = by_name("USDT interval py:start:done@/bin/py");
        assert_eq!(keys(&iv), ["start0", "end0"]);
        assert!(iv.views.contains(&MarkerView::Timeline));
        assert!(schemas.iter().all(|s| s.source == MarkerSource::Usdt));
    }
}
