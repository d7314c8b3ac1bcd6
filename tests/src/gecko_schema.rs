//! Checks a Gecko profile (format version 36) against what the Firefox Profiler importer
//! (`src/profile-logic/process-profile.ts` and friends) requires, plus what it accepts
//! silently but then mis-displays (out-of-range indices, missing grey category, samples outside
//! the root range, ...).

use std::collections::{HashMap, HashSet};
use std::fmt::Display;
use std::io::Read;
use std::path::Path;

use anyhow::Context as _;
use serde_json::{Map, Value};

pub const GECKO_VERSION: u64 = 36;

/// At most this many problems are listed per table; the rest are summarised in one line.
const MAX_PER_TABLE: usize = 20;

const COLORS: &[&str] = &[
    "transparent",
    "purple",
    "green",
    "orange",
    "yellow",
    "lightblue",
    "blue",
    "brown",
    "magenta",
    "red",
    "lightred",
    "darkgrey",
    "grey",
];
const FORMATS: &[&str] = &[
    "url",
    "file-path",
    "sanitized-string",
    "string",
    "unique-string",
    "flow-id",
    "terminating-flow-id",
    "duration",
    "time",
    "seconds",
    "milliseconds",
    "microseconds",
    "nanoseconds",
    "bytes",
    "percentage",
    "integer",
    "decimal",
    "hexadecimal",
    "pid",
    "tid",
    "list",
];
const DISPLAYS: &[&str] = &[
    "marker-chart",
    "marker-table",
    "timeline-overview",
    "timeline-memory",
    "timeline-ipc",
    "timeline-fileio",
    "timeline-network",
    "stack-chart",
];

/// Reads a profile file like [`read`], then imports it with the Firefox Profiler's own code
/// ([`crate::firefox_import::check`]): every profile a test loads must import cleanly there.
pub fn load(path: impl AsRef<Path>) -> anyhow::Result<Value> {
    let path = path.as_ref();
    let profile = read(path)?;
    crate::firefox_import::check(path, &profile)?;
    Ok(profile)
}

/// Reads a profile file, gunzipping it if it starts with the gzip magic (like the front-end,
/// which ignores the file name).
pub fn read(path: impl AsRef<Path>) -> anyhow::Result<Value> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let json = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&bytes[..])
            .read_to_end(&mut out)
            .with_context(|| format!("gunzipping {}", path.display()))?;
        out
    } else {
        bytes
    };
    serde_json::from_slice(&json).with_context(|| format!("parsing {}", path.display()))
}

/// Returns every problem found, each prefixed with a JSON path.
pub fn validate(profile: &Value) -> Result<(), Vec<String>> {
    let mut c = Checker::default();
    c.profile(profile);
    if c.errs.is_empty() { Ok(()) } else { Err(c.errs) }
}

#[derive(Default)]
struct Checker {
    errs: Vec<String>,
    /// Subcategory count of each root category (the importer only uses the root list).
    categories: Vec<usize>,
    /// Marker schema name → payload keys holding string-table indices.
    string_fields: HashMap<String, Vec<String>>,
    /// Root range from profilingStartTime/EndTime; samples outside it are not shown.
    range: Option<(f64, f64)>,
    root_start: f64,
    threads: usize,
}

static NULL: Value = Value::Null;

fn uint(v: &Value) -> Option<u64> {
    v.as_u64()
}

fn finite(v: &Value) -> Option<f64> {
    v.as_f64().filter(|f| f.is_finite())
}

impl Checker {
    fn err(&mut self, path: &str, msg: impl Display) {
        self.errs.push(format!("{path}: {msg}"));
    }

    fn obj<'v>(&mut self, v: &'v Value, path: &str) -> Option<&'v Map<String, Value>> {
        let o = v.as_object();
        if o.is_none() {
            self.err(path, "must be an object");
        }
        o
    }

    fn arr<'v>(&mut self, v: &'v Value, path: &str) -> Option<&'v Vec<Value>> {
        let a = v.as_array();
        if a.is_none() {
            self.err(path, format!("must be an array, got {}", brief(v)));
        }
        a
    }

    /// Keeps at most MAX_PER_TABLE of the problems added since `start`.
    fn cap(&mut self, start: usize, path: &str) {
        let n = self.errs.len() - start;
        if n > MAX_PER_TABLE {
            self.errs.truncate(start + MAX_PER_TABLE);
            self.err(path, format!("... and {} more problems", n - MAX_PER_TABLE));
        }
    }

    fn profile(&mut self, p: &Value) {
        let Some(root) = self.obj(p, "profile") else { return };
        if root.contains_key("meta") && root["meta"].get("preprocessedProfileVersion").is_some() {
            self.err(
                "meta",
                "has preprocessedProfileVersion: this is a processed profile, not a Gecko one",
            );
        }
        let meta = p.get("meta").unwrap_or(&NULL);
        if self.obj(meta, "meta").is_some() {
            self.root_meta(meta);
        }
        self.process(p, "", true);
        if self.threads == 0 {
            self.err(
                "threads",
                "no thread in the profile or its processes (\"No threads were captured\")",
            );
        }
    }

    fn root_meta(&mut self, m: &Value) {
        match uint(&m["version"]) {
            Some(GECKO_VERSION) => {}
            _ => self.err(
                "meta.version",
                format!("must be {GECKO_VERSION}, got {}", brief(&m["version"])),
            ),
        }
        if !finite(&m["interval"]).is_some_and(|i| i > 0.0) {
            self.err(
                "meta.interval",
                format!("must be a positive number, got {}", brief(&m["interval"])),
            );
        }
        match finite(&m["startTime"]) {
            Some(t) => self.root_start = t,
            None => self
                .err("meta.startTime", format!("must be a number, got {}", brief(&m["startTime"]))),
        }
        self.marker_schema(&m["markerSchema"], "meta.markerSchema");
        if let Some(cats) = self.arr(&m["categories"], "meta.categories") {
            for (i, cat) in cats.iter().enumerate() {
                let path = format!("meta.categories[{i}]");
                if !cat["name"].is_string() {
                    self.err(&path, "name must be a string");
                }
                if !cat["color"].as_str().is_some_and(|c| COLORS.contains(&c)) {
                    self.err(&path, format!("unknown color {}", brief(&cat["color"])));
                }
                let subs =
                    cat["subcategories"].as_array().filter(|s| s.iter().all(Value::is_string));
                match subs {
                    Some(s) if s.first().and_then(Value::as_str) == Some("Other") => {}
                    _ => self.err(&path, "subcategories must be strings starting with \"Other\""),
                }
                self.categories.push(subs.map_or(0, Vec::len));
            }
            if !cats.iter().any(|c| c["color"] == "grey") {
                self.err(
                    "meta.categories",
                    "needs a grey category (the default for uncategorized stacks)",
                );
            }
        }
        if let Some(u) = m.get("sampleUnits") {
            if !matches!(u["time"].as_str(), Some("ms" | "bytes")) {
                self.err("meta.sampleUnits.time", "must be \"ms\" or \"bytes\"");
            }
            if u["eventDelay"] != "ms" {
                self.err("meta.sampleUnits.eventDelay", "must be \"ms\"");
            }
            if !matches!(u["threadCPUDelta"].as_str(), Some("ns" | "µs" | "variable CPU cycles")) {
                self.err(
                    "meta.sampleUnits.threadCPUDelta",
                    "must be \"ns\", \"µs\" or \"variable CPU cycles\"",
                );
            }
        }
        let (start, end) = (m.get("profilingStartTime"), m.get("profilingEndTime"));
        for (k, v) in [("profilingStartTime", start), ("profilingEndTime", end)] {
            if v.is_some_and(|v| finite(v).is_none()) {
                self.err(&format!("meta.{k}"), "must be a number");
            }
        }
        // The front-end uses this pair as the whole profile's range when the end is non-zero.
        if let (Some(s), Some(e)) = (start.and_then(finite), end.and_then(finite))
            && e != 0.0
        {
            if e < s {
                self.err("meta.profilingEndTime", "is before profilingStartTime");
            }
            self.range = Some((s, e));
        }
    }

    fn marker_schema(&mut self, v: &Value, path: &str) {
        let Some(schemas) = self.arr(v, path) else { return };
        for (i, s) in schemas.iter().enumerate() {
            let path = format!("{path}[{i}]");
            let Some(name) = s["name"].as_str() else {
                self.err(&path, "name must be a string");
                continue;
            };
            match s["display"].as_array() {
                Some(d) if d.iter().all(|d| d.as_str().is_some_and(|d| DISPLAYS.contains(&d))) => {}
                _ => self.err(&path, "display must be an array of known locations"),
            }
            let Some(fields) = s["data"].as_array() else {
                self.err(&path, "data must be an array");
                continue;
            };
            for (j, f) in fields.iter().enumerate() {
                let fpath = format!("{path}.data[{j}]");
                if let Some(key) = f.get("key") {
                    let fmt = &f["format"];
                    let ok = fmt.as_str().is_some_and(|f| FORMATS.contains(&f))
                        || (fmt["type"] == "table" && fmt["columns"].is_array());
                    if !key.is_string() || !ok {
                        self.err(
                            &fpath,
                            format!("needs a string key and a known format, got {}", brief(fmt)),
                        );
                    }
                    if matches!(
                        fmt.as_str(),
                        Some("unique-string" | "flow-id" | "terminating-flow-id")
                    ) && let Some(k) = key.as_str()
                    {
                        self.string_fields.entry(name.into()).or_default().push(k.into());
                    }
                } else if !(f["label"].is_string() && f["value"].is_string()) {
                    self.err(&fpath, "a static field needs string label and value");
                }
            }
        }
    }

    fn process(&mut self, p: &Value, path: &str, root: bool) {
        let at = |k: &str| if path.is_empty() { k.to_string() } else { format!("{path}.{k}") };
        let mut shift = 0.0;
        if !root {
            let meta = &p["meta"];
            if self.obj(meta, &at("meta")).is_none() {
                return;
            }
            self.marker_schema(&meta["markerSchema"], &at("meta.markerSchema"));
            match finite(&meta["startTime"]) {
                // The importer shifts this process' times by the difference.
                Some(t) => shift = t - self.root_start,
                None => self.err(&at("meta.startTime"), "must be a number"),
            }
        }
        if let Some(libs) = self.arr(&p["libs"], &at("libs")) {
            for (i, lib) in libs.iter().enumerate() {
                for k in ["start", "end", "offset"] {
                    if !lib[k].is_number() {
                        self.err(
                            &at(&format!("libs[{i}].{k}")),
                            "must be a number (the importer BigInt()s it)",
                        );
                    }
                }
            }
        }
        for k in ["pages", "pausedRanges"] {
            if let Some(v) = p.get(k) {
                self.arr(v, &at(k));
            }
        }
        if let Some(threads) = self.arr(&p["threads"], &at("threads")) {
            for (i, t) in threads.iter().enumerate() {
                self.thread(t, &at(&format!("threads[{i}]")), shift);
            }
        }
        // Only one level of nesting is imported, but upgraders walk every `processes` array.
        if let Some(subs) = self.arr(&p["processes"], &at("processes"))
            && root
        {
            for (i, sub) in subs.iter().enumerate() {
                if self.obj(sub, &format!("processes[{i}]")).is_some() {
                    self.process(sub, &format!("processes[{i}]"), false);
                }
            }
        }
    }

    fn thread(&mut self, t: &Value, path: &str, shift: f64) {
        if self.obj(t, path).is_none() {
            return;
        }
        self.threads += 1;
        let at = |k: &str| format!("{path}.{k}");
        if !t["name"].is_string() {
            self.err(&at("name"), "must be a string");
        }
        if !t["processType"].is_string() {
            self.err(&at("processType"), "must be a string");
        }
        for k in ["pid", "tid"] {
            if uint(&t[k]).is_none() {
                self.err(&at(k), format!("must be a non-negative integer, got {}", brief(&t[k])));
            }
        }
        let register = finite(&t["registerTime"]);
        if register.is_none() {
            self.err(&at("registerTime"), "must be a number");
        }
        let unregister = &t["unregisterTime"];
        match (finite(unregister), register) {
            (Some(u), Some(r)) if u < r => {
                self.err(&at("unregisterTime"), "is before registerTime")
            }
            (None, _) if !unregister.is_null() => {
                self.err(&at("unregisterTime"), "must be a number or null")
            }
            _ => {}
        }
        let strings = match self.arr(&t["stringTable"], &at("stringTable")) {
            Some(s) => {
                if !s.iter().all(Value::is_string) {
                    self.err(&at("stringTable"), "must contain only strings");
                }
                s.len()
            }
            None => 0,
        };

        let frames = self.table(
            t,
            path,
            "frameTable",
            &[
                "location",
                "relevantForJS",
                "innerWindowID",
                "line",
                "column",
                "category",
                "subcategory",
            ],
        );
        let stacks = self.table(t, path, "stackTable", &["prefix", "frame"]);
        let samples = self.table(t, path, "samples", &["stack", "time"]);
        let markers = self.table(
            t,
            path,
            "markers",
            &["name", "startTime", "endTime", "phase", "category", "data"],
        );

        let n_frames = frames.as_ref().map_or(0, |f| f.rows.len());
        if let Some(f) = &frames {
            let start = self.errs.len();
            for (i, row) in f.rows.iter().enumerate() {
                let p = format!("{path}.frameTable.data[{i}]");
                self.index(f.get(row, "location"), strings, false, &p, "location (string index)");
                if let Some(v) = f.col(row, "implementation") {
                    self.index(v, strings, true, &p, "implementation (string index)");
                }
                let js = f.get(row, "relevantForJS");
                if !(js.is_boolean() || js.is_null()) {
                    self.err(&p, "relevantForJS must be a boolean");
                }
                for k in ["line", "column", "innerWindowID"] {
                    let v = f.get(row, k);
                    if !(v.is_null() || uint(v).is_some()) {
                        self.err(
                            &p,
                            format!("{k} must be null or a non-negative integer, got {}", brief(v)),
                        );
                    }
                }
                self.category(f.get(row, "category"), Some(f.get(row, "subcategory")), true, &p);
            }
            self.cap(start, &at("frameTable"));
        }

        let n_stacks = stacks.as_ref().map_or(0, |s| s.rows.len());
        if let Some(s) = &stacks {
            let start = self.errs.len();
            for (i, row) in s.rows.iter().enumerate() {
                let p = format!("{path}.stackTable.data[{i}]");
                let prefix = s.get(row, "prefix");
                if !(prefix.is_null() || uint(prefix).is_some_and(|x| (x as usize) < i)) {
                    self.err(
                        &p,
                        format!("prefix must be null or an earlier row, got {}", brief(prefix)),
                    );
                }
                self.index(s.get(row, "frame"), n_frames, false, &p, "frame (frameTable index)");
            }
            self.cap(start, &at("stackTable"));
        }

        if let Some(s) = &samples {
            let start = self.errs.len();
            let delay =
                ["eventDelay", "responsiveness"].into_iter().find(|k| s.cols.contains_key(k));
            if delay.is_none() {
                self.err(&at("samples.schema"), "needs an eventDelay (or responsiveness) column");
            }
            let mut prev = f64::NEG_INFINITY;
            let (mut first, mut outside) = (None, 0);
            for (i, row) in s.rows.iter().enumerate() {
                let p = format!("{path}.samples.data[{i}]");
                self.index(s.get(row, "stack"), n_stacks, true, &p, "stack (stackTable index)");
                match finite(s.get(row, "time")) {
                    Some(time) => {
                        if time < prev {
                            self.err(
                                &p,
                                format!("time {time} is before the previous sample's {prev}"),
                            );
                        }
                        prev = prev.max(time);
                        first.get_or_insert(time);
                        if self.range.is_some_and(|(a, b)| time + shift < a || time + shift > b) {
                            outside += 1;
                        }
                    }
                    None => self.err(
                        &p,
                        format!("time must be a finite number, got {}", brief(s.get(row, "time"))),
                    ),
                }
                if let Some(k) = delay {
                    let v = s.get(row, k);
                    if !(v.is_null() || finite(v).is_some()) {
                        self.err(&p, format!("{k} must be a number or null"));
                    }
                }
                if let Some(v) = s.col(row, "threadCPUDelta")
                    && !(v.is_null() || finite(v).is_some_and(|d| d >= 0.0))
                {
                    self.err(&p, format!("threadCPUDelta must be null or >= 0, got {}", brief(v)));
                }
            }
            self.cap(start, &at("samples"));
            if outside > 0 {
                let (a, b) = self.range.unwrap_or_default();
                self.err(
                    &at("samples"),
                    format!("{outside} samples lie outside the profile range {a}..{b} ms"),
                );
            }
            if let (Some(r), Some(f)) = (register, first)
                && r > f
            {
                self.err(&at("registerTime"), format!("{r} is after the first sample ({f})"));
            }
        }

        if let Some(m) = &markers {
            let start = self.errs.len();
            for (i, row) in m.rows.iter().enumerate() {
                let p = format!("{path}.markers.data[{i}]");
                self.index(m.get(row, "name"), strings, false, &p, "name (string index)");
                self.category(m.get(row, "category"), None, false, &p);
                let (st, et) = (m.get(row, "startTime"), m.get(row, "endTime"));
                for (k, v) in [("startTime", st), ("endTime", et)] {
                    if !(v.is_null() || finite(v).is_some()) {
                        self.err(&p, format!("{k} must be a number or null"));
                    }
                }
                // Instant, Interval, IntervalStart, IntervalEnd: which times must be present.
                let needs = match uint(m.get(row, "phase")) {
                    Some(0 | 2) => (true, false),
                    Some(1) => (true, true),
                    Some(3) => (false, true),
                    _ => {
                        self.err(
                            &p,
                            format!("phase must be 0..=3, got {}", brief(m.get(row, "phase"))),
                        );
                        continue;
                    }
                };
                if (needs.0 && st.is_null()) || (needs.1 && et.is_null()) {
                    self.err(
                        &p,
                        format!(
                            "phase {} needs startTime/endTime {:?}",
                            m.get(row, "phase"),
                            needs
                        ),
                    );
                }
                if let (Some(s), Some(e)) = (finite(st), finite(et))
                    && needs == (true, true)
                    && e < s
                {
                    self.err(&p, "endTime is before startTime");
                }
                let data = m.get(row, "data");
                if !(data.is_null() || data.is_object()) {
                    self.err(&p, "data must be null or an object");
                }
                let fields =
                    data["type"].as_str().and_then(|ty| self.string_fields.get(ty)).cloned();
                for k in fields.unwrap_or_default() {
                    if let Some(v) = data.get(&k) {
                        self.index(v, strings, false, &p, &format!("data.{k} (string index)"));
                    }
                }
            }
            self.cap(start, &at("markers"));
        }
    }

    /// Checks that `v` is an integer index below `len` (or null when allowed).
    fn index(&mut self, v: &Value, len: usize, nullable: bool, path: &str, what: &str) {
        if v.is_null() && nullable {
            return;
        }
        if uint(v).is_none_or(|x| x as usize >= len) {
            self.err(path, format!("{what} out of range 0..{len}: {}", brief(v)));
        }
    }

    fn category(&mut self, cat: &Value, sub: Option<&Value>, nullable: bool, path: &str) {
        let n = self.categories.len();
        if cat.is_null() && nullable {
            return;
        }
        let Some(c) = uint(cat).filter(|&c| (c as usize) < n) else {
            self.err(path, format!("category out of range 0..{n}: {}", brief(cat)));
            return;
        };
        let subs = self.categories[c as usize];
        if let Some(s) = sub
            && !(s.is_null() || uint(s).is_some_and(|s| (s as usize) < subs))
        {
            self.err(
                path,
                format!("subcategory out of range 0..{subs} of category {c}: {}", brief(s)),
            );
        }
    }

    /// Checks a `{schema, data}` table's shape; returns it if rows can be read through it.
    fn table<'v>(
        &mut self,
        t: &'v Value,
        path: &str,
        key: &str,
        required: &[&str],
    ) -> Option<Table<'v>> {
        let path = format!("{path}.{key}");
        let tab = &t[key];
        self.obj(tab, &path)?;
        let schema = self.obj(&tab["schema"], &format!("{path}.schema"))?;
        let mut cols = HashMap::new();
        let mut seen = HashSet::new();
        for (name, idx) in schema {
            match uint(idx) {
                Some(i) if seen.insert(i) => {
                    cols.insert(name.as_str(), i as usize);
                }
                _ => self.err(
                    &format!("{path}.schema.{name}"),
                    format!("must be a unique column index, got {idx}"),
                ),
            }
        }
        for c in required {
            if !cols.contains_key(c) {
                self.err(&format!("{path}.schema"), format!("missing column {c}"));
            }
        }
        let width = cols.values().max().map_or(0, |m| m + 1);
        let rows = self.arr(&tab["data"], &format!("{path}.data"))?;
        let start = self.errs.len();
        for (i, row) in rows.iter().enumerate() {
            // Shorter rows are fine (missing trailing values read as null); longer ones are not.
            match row.as_array() {
                Some(r) if r.len() <= width => {}
                Some(r) => self.err(
                    &format!("{path}.data[{i}]"),
                    format!("has {} values, schema has {width}", r.len()),
                ),
                None => self.err(&format!("{path}.data[{i}]"), "must be an array"),
            }
        }
        self.cap(start, &path);
        Some(Table { cols, rows })
    }
}

struct Table<'v> {
    cols: HashMap<&'v str, usize>,
    rows: &'v [Value],
}

impl<'v> Table<'v> {
    /// The row's value in column `name`, None if the schema lacks the column.
    fn col(&self, row: &'v Value, name: &str) -> Option<&'v Value> {
        let i = *self.cols.get(name)?;
        Some(row.get(i).unwrap_or(&NULL))
    }

    fn get(&self, row: &'v Value, name: &str) -> &'v Value {
        self.col(row, name).unwrap_or(&NULL)
    }
}

fn brief(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 40 { format!("{}…", &s[..s.floor_char_boundary(40)]) } else { s }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// A small valid profile: one root thread and one sub-process thread.
    pub(crate) fn valid() -> Value {
        let thread = |tid: u32| {
            json!({
                "name": "main", "processType": "default", "processName": "app", "pid": 7, "tid": tid,
                "registerTime": 0.0, "unregisterTime": null,
                "stringTable": ["main (in app)", "work (in app)", "Marker"],
                "frameTable": {
                    "schema": {"location": 0, "relevantForJS": 1, "innerWindowID": 2, "implementation": 3,
                               "line": 4, "column": 5, "category": 6, "subcategory": 7},
                    "data": [[0, false, null, null, 3, null, 1, 0], [1, false, null, null, null, null, 1, 0]]
                },
                "stackTable": {"schema": {"prefix": 0, "frame": 1}, "data": [[null, 0], [0, 1]]},
                "samples": {
                    "schema": {"stack": 0, "time": 1, "eventDelay": 2, "threadCPUDelta": 3},
                    "data": [[1, 1.0, 0, 0], [0, 2.0, 0, 1000], [null, 2.0, 0, null]]
                },
                "markers": {
                    "schema": {"name": 0, "startTime": 1, "endTime": 2, "phase": 3, "category": 4, "data": 5},
                    "data": [[2, 1.0, null, 0, 0, null], [2, 1.0, 2.0, 1, 0, {"type": "T", "s": 0}],
                             [2, null, 2.0, 3, 0, null]]
                }
            })
        };
        let cats = json!([
            {"name": "Other", "color": "grey", "subcategories": ["Other"]},
            {"name": "User", "color": "yellow", "subcategories": ["Other"]}
        ]);
        let schema = json!([{"name": "T", "display": ["marker-chart"],
                             "data": [{"key": "s", "format": "unique-string"}, {"label": "Description", "value": "x"}]}]);
        json!({
            "meta": {"version": 36, "interval": 1.0, "startTime": 1000.0, "categories": cats,
                     "markerSchema": schema, "profilingStartTime": 0, "profilingEndTime": 10,
                     "sampleUnits": {"time": "ms", "eventDelay": "ms", "threadCPUDelta": "ns"}},
            "libs": [{"start": 0, "end": 10, "offset": 0, "name": "app"}],
            "threads": [thread(7)],
            "processes": [{
                "meta": {"version": 36, "startTime": 1000.0, "shutdownTime": null, "categories": cats,
                         "markerSchema": []},
                "libs": [], "threads": [thread(8)], "processes": [], "pausedRanges": []
            }],
            "pages": [], "pausedRanges": []
        })
    }

    /// Applies `f` to a copy of the valid profile and returns the problems found.
    fn errors(f: impl FnOnce(&mut Value)) -> Vec<String> {
        let mut p = valid();
        f(&mut p);
        validate(&p).expect_err("broken profile passed validation")
    }

    fn has(errs: &[String], needle: &str) -> bool {
        errs.iter().any(|e| e.contains(needle))
    }

    fn del(v: &mut Value, key: &str) {
        v.as_object_mut().unwrap().remove(key);
    }

    fn t0(p: &mut Value) -> &mut Value {
        &mut p["threads"][0]
    }

    #[test]
    fn valid_profile_passes() {
        assert_eq!(validate(&valid()), Ok(()));
    }

    #[test]
    fn threads_only_in_subprocesses_are_enough() {
        let mut p = valid();
        p["threads"] = json!([]);
        assert_eq!(validate(&p), Ok(()));
        p["processes"][0]["threads"] = json!([]);
        assert!(has(&validate(&p).unwrap_err(), "no thread"));
    }

    #[test]
    fn meta_problems() {
        assert!(has(&errors(|p| p["meta"]["version"] = json!(35)), "meta.version"));
        assert!(has(&errors(|p| del(&mut p["meta"], "version")), "meta.version"));
        assert!(has(&errors(|p| p["meta"]["markerSchema"] = json!(null)), "meta.markerSchema"));
        assert!(has(
            &errors(|p| p["processes"][0]["meta"]["markerSchema"] = json!(null)),
            "processes[0].meta.markerSchema"
        ));
        assert!(has(
            &errors(|p| p["processes"][0]["meta"]["startTime"] = json!(null)),
            "processes[0].meta.startTime"
        ));
        assert!(has(&errors(|p| p["meta"]["categories"][0]["color"] = json!("blue")), "grey"));
        assert!(has(
            &errors(|p| p["meta"]["categories"][1]["color"] = json!("pink")),
            "unknown color"
        ));
        assert!(has(
            &errors(|p| p["meta"]["categories"][1]["subcategories"] = json!([])),
            "subcategories"
        ));
        assert!(has(&errors(|p| p["meta"]["interval"] = json!(0)), "meta.interval"));
        assert!(has(
            &errors(|p| p["meta"]["sampleUnits"]["threadCPUDelta"] = json!("ms")),
            "threadCPUDelta"
        ));
        assert!(has(
            &errors(|p| p["meta"]["markerSchema"][0]["data"][0]["format"] = json!("nope")),
            "known format"
        ));
        assert!(has(&errors(|p| del(&mut p["libs"][0], "offset")), "libs[0].offset"));
        assert!(has(&errors(|p| p["processes"] = json!({})), "processes: must be an array"));
        assert!(has(
            &errors(|p| p["processes"][0]["processes"] = json!(null)),
            "processes[0].processes"
        ));
    }

    #[test]
    fn table_shape_problems() {
        assert!(has(&errors(|p| t0(p)["stringTable"] = json!({})), "stringTable"));
        let e = errors(|p| del(&mut t0(p)["samples"]["schema"], "eventDelay"));
        assert!(has(&e, "eventDelay"));
        let e = errors(|p| del(&mut t0(p)["frameTable"]["schema"], "line"));
        assert!(has(&e, "missing column line"));
        let e = errors(|p| del(&mut t0(p)["markers"]["schema"], "data"));
        assert!(has(&e, "missing column data"));
        assert!(has(
            &errors(|p| t0(p)["stackTable"]["data"][0] = json!([null, 0, 5])),
            "has 3 values"
        ));
        assert!(has(&errors(|p| t0(p)["stackTable"]["data"][0] = json!(5)), "must be an array"));
        assert!(has(&errors(|p| t0(p)["tid"] = json!("x")), "threads[0].tid"));
    }

    #[test]
    fn index_problems() {
        let e = errors(|p| t0(p)["frameTable"]["data"][0][0] = json!(3));
        assert!(has(&e, "threads[0].frameTable.data[0]: location"));
        assert!(has(
            &errors(|p| t0(p)["frameTable"]["data"][0][6] = json!(2)),
            "category out of range"
        ));
        assert!(has(
            &errors(|p| t0(p)["frameTable"]["data"][0][7] = json!(1)),
            "subcategory out of range"
        ));
        assert!(has(&errors(|p| t0(p)["stackTable"]["data"][0][0] = json!(0)), "prefix"));
        assert!(has(&errors(|p| t0(p)["stackTable"]["data"][0][0] = json!(1)), "prefix"));
        assert!(has(
            &errors(|p| t0(p)["stackTable"]["data"][1][1] = json!(2)),
            "frame (frameTable index)"
        ));
        assert!(has(
            &errors(|p| t0(p)["samples"]["data"][0][0] = json!(2)),
            "stack (stackTable index)"
        ));
        // Sub-process threads are checked too.
        let e = errors(|p| p["processes"][0]["threads"][0]["samples"]["data"][0][0] = json!(9));
        assert!(has(&e, "processes[0].threads[0].samples.data[0]"));
    }

    #[test]
    fn sample_problems() {
        assert!(has(
            &errors(|p| t0(p)["samples"]["data"][1][1] = json!(0.5)),
            "before the previous"
        ));
        assert!(has(&errors(|p| t0(p)["samples"]["data"][1][1] = json!(null)), "finite"));
        assert!(has(&errors(|p| t0(p)["samples"]["data"][1][3] = json!(-1)), "threadCPUDelta"));
        assert!(has(&errors(|p| t0(p)["registerTime"] = json!(1.5)), "after the first sample"));
        assert!(has(&errors(|p| t0(p)["unregisterTime"] = json!(-1)), "before registerTime"));
        assert!(has(
            &errors(|p| p["meta"]["profilingEndTime"] = json!(1.5)),
            "outside the profile range"
        ));
        // A sub-process with a later startTime shifts its samples out of the range.
        assert!(has(
            &errors(|p| p["processes"][0]["meta"]["startTime"] = json!(1009.0)),
            "outside"
        ));
    }

    #[test]
    fn marker_problems() {
        assert!(has(&errors(|p| t0(p)["markers"]["data"][0][0] = json!(3)), "name (string index)"));
        assert!(has(&errors(|p| t0(p)["markers"]["data"][0][3] = json!(4)), "phase must be"));
        assert!(has(&errors(|p| t0(p)["markers"]["data"][0][1] = json!(null)), "phase 0 needs"));
        assert!(has(&errors(|p| t0(p)["markers"]["data"][1][2] = json!(null)), "phase 1 needs"));
        assert!(has(&errors(|p| t0(p)["markers"]["data"][2][2] = json!(null)), "phase 3 needs"));
        assert!(has(&errors(|p| t0(p)["markers"]["data"][1][2] = json!(0.5)), "endTime is before"));
        assert!(has(
            &errors(|p| t0(p)["markers"]["data"][0][4] = json!(9)),
            "category out of range"
        ));
        assert!(has(
            &errors(|p| t0(p)["markers"]["data"][1][5]["s"] = json!(7)),
            "data.s (string index)"
        ));
        assert!(has(&errors(|p| t0(p)["markers"]["data"][0][5] = json!(3)), "data must be"));
    }

    #[test]
    fn reports_all_problems_and_caps_per_table() {
        let e = errors(|p| {
            p["meta"]["version"] = json!(1);
            t0(p)["samples"]["data"][0][0] = json!(99);
            t0(p)["markers"]["data"][0][3] = json!(9);
        });
        assert_eq!(e.len(), 3, "{e:?}");
        let e = errors(|p| t0(p)["stackTable"]["data"] = json!(vec![json!([null, 99]); 100]));
        assert!(e.len() < 30 && has(&e, "more problems"), "{e:?}");
    }

    #[test]
    fn load_plain_and_gzip() {
        use std::io::Write;
        let dir = std::env::temp_dir().join(format!("gecko-schema-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let text = serde_json::to_vec(&valid()).unwrap();
        std::fs::write(dir.join("p.json"), &text).unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&text).unwrap();
        std::fs::write(dir.join("p.json.notgz"), gz.finish().unwrap()).unwrap();
        assert_eq!(load(dir.join("p.json")).unwrap(), valid());
        assert_eq!(load(dir.join("p.json.notgz")).unwrap(), valid());
        assert!(load(dir.join("missing.json")).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
