//! Writes a [`Profile`] as a Firefox Profiler "Gecko profile" (format version 36), streamed
//! thread by thread: only one thread's tables are held in memory at a time.
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

use std::collections::HashMap;
use std::io::{self, Write};

use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{Value, json};

use crate::{
    intern::Interner,
    profile::{Frame, FrameKind, Process, Profile, StackIndex, Thread},
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

const CATEGORIES: [(&str, &str); 5] = [
    ("Other", "grey"),
    ("Idle", "transparent"),
    ("User", "yellow"),
    ("Kernel", "orange"),
    ("Label", "lightblue"),
];

/// Marker payload schemas (`meta.markerSchema`); add an entry per marker `data.type` we emit.
fn marker_schema() -> Value {
    json!([crate::gecko_container::marker_schema()])
}

fn categories() -> Value {
    CATEGORIES
        .iter()
        .map(|(name, color)| json!({"name": name, "color": color, "subcategories": ["Other"]}))
        .collect()
}

/// Writes `profile` as uncompressed Gecko JSON; wrap `out` in a gzip encoder to compress.
pub fn write_gecko<W: Write>(profile: &Profile, out: W) -> io::Result<()> {
    let mut out = io::BufWriter::new(out);
    serde_json::to_writer(&mut out, &Root(profile))?;
    out.flush()
}

const EMPTY: [(); 0] = [];

/// The Gecko type requires a `sources` table (JS sources); ours is always empty.
fn sources() -> Value {
    json!({"schema": {"id": 0, "filename": 1, "startLine": 2, "startColumn": 3, "sourceMapURL": 4},
           "data": []})
}

struct Root<'a>(&'a Profile);

impl Serialize for Root<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let p = self.0;
        // Samples drained after the stop must stay inside the root range, or the UI hides them.
        let last_sample = p
            .processes
            .iter()
            .flat_map(|pr| &pr.threads)
            .filter_map(|t| {
                t.samples.iter().map(|s| s.time_ms).filter(|t| t.is_finite()).reduce(f64::max)
            })
            .fold(0.0, f64::max);
        let meta = json!({
            "version": GECKO_VERSION,
            "interval": p.interval_ms,
            "startTime": p.start_time_ms,
            "shutdownTime": null,
            "profilingStartTime": 0,
            "profilingEndTime": p.end_time_ms.max(last_sample),
            "product": p.product,
            "platform": "Linux",
            "oscpu": p.oscpu,
            "processType": 0,
            "stackwalk": 1,
            "debug": 0,
            "gcpoison": 0,
            "asyncstack": 0,
            "presymbolicated": true,
            "physicalCPUs": p.physical_cpus,
            "logicalCPUs": p.logical_cpus,
            "categories": categories(),
            "markerSchema": marker_schema(),
            "sampleUnits": {"time": "ms", "eventDelay": "ms", "threadCPUDelta": "ns"},
        });
        // Without a GeckoMain thread the front-end keeps process tracks in file order, so put
        // the busiest processes first, as it would do by activity.
        let mut processes: Vec<&Process> = p.processes.iter().collect();
        processes.sort_by_key(|pr| {
            std::cmp::Reverse(
                pr.threads.iter().flat_map(|t| &t.samples).filter(|s| !s.idle).count(),
            )
        });
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("meta", &meta)?;
        m.serialize_entry("libs", &EMPTY)?;
        m.serialize_entry("threads", &EMPTY)?;
        m.serialize_entry("processes", &lazy(processes.iter().map(|pr| SubProcess(p, pr))))?;
        m.serialize_entry("pages", &EMPTY)?;
        m.serialize_entry("pausedRanges", &EMPTY)?;
        m.serialize_entry("sources", &sources())?;
        m.end()
    }
}

/// Serializes an iterator as a JSON array without collecting it (consumed on first use).
struct Lazy<I>(std::cell::Cell<Option<I>>);

fn lazy<I>(it: I) -> Lazy<I> {
    Lazy(std::cell::Cell::new(Some(it)))
}

impl<I: Iterator<Item = T>, T: Serialize> Serialize for Lazy<I> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.take().expect("Lazy serialized twice"))
    }
}

struct SubProcess<'a>(&'a Profile, &'a Process);

impl Serialize for SubProcess<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (p, pr) = (self.0, self.1);
        // Same startTime as the root, so no time shifting happens on import.
        let meta = json!({
            "version": GECKO_VERSION,
            "startTime": p.start_time_ms,
            "shutdownTime": pr.end_time_ms,
            "categories": categories(),
            "markerSchema": marker_schema(),
        });
        let threads =
            pr.threads.iter().filter(|t| t.is_main).chain(pr.threads.iter().filter(|t| !t.is_main));
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("meta", &meta)?;
        m.serialize_entry("libs", &EMPTY)?;
        m.serialize_entry("threads", &lazy(threads.map(|t| GeckoThread(p, pr, t))))?;
        m.serialize_entry("processes", &EMPTY)?;
        m.serialize_entry("pages", &EMPTY)?;
        m.serialize_entry("pausedRanges", &EMPTY)?;
        m.serialize_entry("sources", &sources())?;
        m.end()
    }
}

struct GeckoThread<'a>(&'a Profile, &'a Process, &'a Thread);

impl Serialize for GeckoThread<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (p, pr, t) = (self.0, self.1, self.2);
        let mut tables = Tables::build(p, t);
        let markers = crate::gecko_container::markers(p, pr, t, &mut tables.strings);
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("name", &t.name)?;
        m.serialize_entry("processType", "default")?;
        m.serialize_entry("processName", &crate::gecko_container::process_name(pr))?;
        m.serialize_entry("pid", &pr.pid.0)?;
        m.serialize_entry("tid", &t.tid.0)?;
        // Ignored by the front-end (it only knows "GeckoMain"); kept for other readers.
        m.serialize_entry("isMainThread", &t.is_main)?;
        m.serialize_entry("registerTime", &t.register_time_ms)?;
        m.serialize_entry("unregisterTime", &t.unregister_time_ms)?;
        m.serialize_entry("stringTable", tables.strings.items())?;
        m.serialize_entry("frameTable", &Table(FRAME_SCHEMA, &tables.frames))?;
        m.serialize_entry("stackTable", &Table(STACK_SCHEMA, &tables.stacks))?;
        m.serialize_entry("samples", &Table(SAMPLE_SCHEMA, &tables.samples))?;
        m.serialize_entry("markers", &Table(MARKER_SCHEMA, &markers))?;
        m.end()
    }
}

// Column order of each table; the row tuples below follow it.
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

type FrameRow = (u32, bool, Option<u32>, Option<u32>, Option<u32>, Option<u32>, u32, u32);
type StackRow = (Option<u32>, u32);
type SampleRow = (Option<u32>, f64, u32, Option<u64>);

struct Table<'a, R: ?Sized>(&'static [&'static str], &'a R);

impl<R: Serialize + ?Sized> Serialize for Table<'_, R> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(2))?;
        m.serialize_entry("schema", &Schema(self.0))?;
        m.serialize_entry("data", self.1)?;
        m.end()
    }
}

struct Schema(&'static [&'static str]);

impl Serialize for Schema {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().enumerate().map(|(i, c)| (c, i)))
    }
}

/// One thread's Gecko tables. Rows are only created for frames and stacks its samples use.
struct Tables<'a> {
    profile: &'a Profile,
    strings: Interner<String>,
    frames: Vec<FrameRow>,
    // The category is part of the key: a frame seen in idle and non-idle samples needs two rows.
    frame_ids: HashMap<(&'a Frame, u32), u32>,
    stacks: Vec<StackRow>,
    stack_ids: HashMap<StackRow, u32>,
    sample_stack_ids: HashMap<(StackIndex, bool), Option<u32>>,
    samples: Vec<SampleRow>,
}

impl<'a> Tables<'a> {
    fn build(profile: &'a Profile, thread: &Thread) -> Self {
        let mut t = Tables {
            profile,
            strings: Interner::default(),
            frames: Vec::new(),
            frame_ids: HashMap::new(),
            stacks: Vec::new(),
            stack_ids: HashMap::new(),
            sample_stack_ids: HashMap::new(),
            samples: Vec::with_capacity(thread.samples.len()),
        };
        for s in thread.samples.iter().filter(|s| s.time_ms.is_finite()) {
            let stack = s.stack.and_then(|st| t.stack(st, s.idle));
            t.samples.push((stack, s.time_ms, 0, s.cpu_delta_ns));
        }
        // Stable, and linear on the already sorted input the model promises.
        t.samples.sort_by(|a, b| a.1.total_cmp(&b.1));
        t
    }

    fn string(&mut self, s: String) -> u32 {
        self.strings.intern(s.as_str())
    }

    /// Idle samples get the Idle category on every frame, so whichever frame is the leaf the
    /// front-end sees an idle sample, and call-tree nodes of idle time are coloured as idle.
    fn stack(&mut self, index: StackIndex, idle: bool) -> Option<u32> {
        if let Some(&id) = self.sample_stack_ids.get(&(index, idle)) {
            return id;
        }
        let mut prefix = None;
        let profile = self.profile;
        // Dangling indices (a model bug) drop the frame rather than the whole recording.
        let stack = profile.stacks.get(index.0 as usize).map(Vec::as_slice).unwrap_or_default();
        for f in stack.iter().filter_map(|fi| profile.frames.get(fi.0 as usize)) {
            let frame = self.frame(f, idle);
            let next = self.stacks.len() as u32;
            // A new row is appended after its prefix, so a prefix always precedes its users.
            prefix = Some(*self.stack_ids.entry((prefix, frame)).or_insert_with(|| {
                self.stacks.push((prefix, frame));
                next
            }));
        }
        self.sample_stack_ids.insert((index, idle), prefix);
        prefix
    }

    fn frame(&mut self, f: &'a Frame, idle: bool) -> u32 {
        let category = match (idle, f.kind) {
            (true, _) => CATEGORY_IDLE,
            (false, FrameKind::User) => CATEGORY_USER,
            (false, FrameKind::Kernel) => CATEGORY_KERNEL,
        };
        if let Some(&id) = self.frame_ids.get(&(f, category)) {
            return id;
        }
        let location =
            self.string(location(&f.function, &f.module, f.file.as_deref(), f.line, f.column));
        let id = self.frames.len() as u32;
        self.frames.push((location, false, None, None, f.line, f.column, category, 0));
        self.frame_ids.insert((f, category), id);
        id
    }
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
    use crate::ids::{Pid, Tid};
    use crate::profile::{FrameIndex, Sample};

    fn frame(kind: FrameKind, function: &str, module: &str) -> Frame {
        Frame {
            kind,
            function: function.into(),
            module: module.into(),
            file: None,
            line: None,
            column: None,
            inlined: false,
        }
    }

    fn sample(time_ms: f64, stack: Option<u32>, cpu: Option<u64>, idle: bool) -> Sample {
        Sample { time_ms, cpu_delta_ns: cpu, stack: stack.map(StackIndex), idle }
    }

    fn thread(tid: u32, name: &str, is_main: bool, samples: Vec<Sample>) -> Thread {
        Thread {
            tid: Tid(tid),
            name: name.into(),
            previous_names: vec![],
            is_main,
            register_time_ms: 0.0,
            unregister_time_ms: None,
            samples,
        }
    }

    fn process(pid: u32, name: &str, threads: Vec<Thread>) -> Process {
        Process {
            pid: Pid(pid),
            name: name.into(),
            command_line: String::new(),
            start_time_ms: 0.0,
            end_time_ms: None,
            is_idle: false,
            container: None,
            threads,
        }
    }

    /// Frames: 0 main, 1 work (with file/line), 2 hot, 3 kernel; stacks share prefixes.
    fn sample_profile() -> Profile {
        let mut work = frame(FrameKind::User, "work", "app");
        work.file = Some("src/main.rs".into());
        work.line = Some(12);
        work.column = Some(5);
        Profile {
            start_time_ms: 1_700_000_000_000.0,
            interval_ms: 1.0,
            end_time_ms: 100.0,
            logical_cpus: 4,
            physical_cpus: 2,
            product: "rsprof-bpf test".into(),
            oscpu: "Linux 6.8".into(),
            frames: vec![
                frame(FrameKind::User, "main", "app"),
                work,
                frame(FrameKind::User, "hot", "libc.so.6"),
                frame(FrameKind::Kernel, "do_syscall_64", "[kernel.kallsyms]"),
            ],
            stacks: vec![
                vec![FrameIndex(0), FrameIndex(1), FrameIndex(2)],
                vec![FrameIndex(0), FrameIndex(1), FrameIndex(2), FrameIndex(3)],
                vec![FrameIndex(0), FrameIndex(1)],
                vec![FrameIndex(0), FrameIndex(1), FrameIndex(2)], // same as stack 0
            ],
            processes: vec![
                process(
                    10,
                    "app",
                    vec![
                        thread(
                            11,
                            "worker",
                            false,
                            vec![sample(2.0, Some(2), Some(1_000_000), false)],
                        ),
                        thread(
                            10,
                            "app",
                            true,
                            vec![
                                sample(1.0, Some(0), Some(0), false),
                                sample(2.0, Some(1), Some(900_000), false),
                                sample(3.0, Some(3), Some(1_000_000), false),
                                sample(4.0, None, None, false),
                            ],
                        ),
                    ],
                ),
                Process {
                    is_idle: true,
                    container: None,
                    ..process(
                        0,
                        "swapper",
                        vec![thread(
                            0,
                            "swapper/0",
                            true,
                            vec![sample(1.5, Some(2), Some(5), true)],
                        )],
                    )
                },
            ],
        }
    }

    fn to_json(p: &Profile) -> Value {
        let mut buf = Vec::new();
        write_gecko(p, &mut buf).unwrap();
        serde_json::from_slice(&buf).unwrap()
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
        let j = to_json(&sample_profile());
        assert_eq!(::tests::gecko_schema::validate(&j), Ok(()));
        // Dangling model indices are dropped, not written as out-of-range references.
        let mut p = sample_profile();
        p.stacks.push(vec![FrameIndex(0), FrameIndex(99)]);
        p.processes[0].threads[0].samples.push(sample(3.0, Some(4), None, false));
        p.processes[0].threads[0].samples.push(sample(4.0, Some(77), None, false));
        assert_eq!(::tests::gecko_schema::validate(&to_json(&p)), Ok(()));
        let empty = to_json(&Profile { interval_ms: 1.0, ..Default::default() });
        // No threads at all is the one thing the front-end refuses; everything else is valid.
        let errs = ::tests::gecko_schema::validate(&empty).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
    }

    #[test]
    fn meta_and_layout() {
        let j = to_json(&sample_profile());
        assert_eq!(j["meta"]["version"], 36);
        assert_eq!(j["meta"]["presymbolicated"], true);
        assert_eq!(j["meta"]["sampleUnits"]["threadCPUDelta"], "ns");
        assert_eq!(j["meta"]["profilingEndTime"], 100.0);
        let cats: Vec<_> =
            j["meta"]["categories"].as_array().unwrap().iter().map(|c| c["name"].clone()).collect();
        assert_eq!(cats, ["Other", "Idle", "User", "Kernel", "Label"]);
        assert_eq!(j["threads"].as_array().unwrap().len(), 0);
        // One sub-process per process, busiest first, main thread first.
        let procs = j["processes"].as_array().unwrap();
        assert_eq!(procs.len(), 2);
        let app = &procs[0];
        assert_eq!(app["meta"]["startTime"], j["meta"]["startTime"]);
        let threads = app["threads"].as_array().unwrap();
        assert_eq!(threads.len(), 2);
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
        let j = to_json(&sample_profile());
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
            for row in t[table]["data"].as_array().unwrap() {
                assert_eq!(row.as_array().unwrap().len(), schema.len());
            }
        }
    }

    #[test]
    fn stacks_are_a_deduplicated_prefix_tree() {
        let j = to_json(&sample_profile());
        let t = thread_of(&j, 10);
        let stacks = t["stackTable"]["data"].as_array().unwrap();
        // main, main>work, main>work>hot, main>work>hot>syscall: 4 rows for 4 samples' stacks.
        assert_eq!(stacks.len(), 4);
        let mut seen = std::collections::HashSet::new();
        for (i, row) in stacks.iter().enumerate() {
            if let Some(p) = row[0].as_u64() {
                assert!((p as usize) < i);
            }
            assert!(seen.insert(row.to_string()), "duplicate stack row {row}");
        }
        // Model stacks 0 and 3 are identical and share one row.
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
    fn strings_are_unique_and_locations_formatted() {
        let mut p = sample_profile();
        // Frame 4 equals frame 2 and shares its row; frame 5 differs only by `inlined` and
        // gets its own row but shares the location string.
        p.frames.push(p.frames[2].clone());
        p.frames.push(Frame { inlined: true, ..p.frames[2].clone() });
        p.stacks.push(vec![FrameIndex(0), FrameIndex(4), FrameIndex(5)]);
        p.processes[0].threads[1].samples.push(sample(5.0, Some(4), None, false));
        let j = to_json(&p);
        let t = thread_of(&j, 10);
        let strings: Vec<&str> =
            t["stringTable"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
        let unique: std::collections::HashSet<_> = strings.iter().collect();
        assert_eq!(unique.len(), strings.len());
        assert!(strings.contains(&"main (in app)"));
        assert!(strings.contains(&"work (in app) (src/main.rs:12:5)"));
        assert!(strings.contains(&"do_syscall_64 (in [kernel.kallsyms])"));
        assert_eq!(strings.iter().filter(|s| s.starts_with("hot ")).count(), 1);
        assert_eq!(t["frameTable"]["data"].as_array().unwrap().len(), 5);
        let ft = &t["frameTable"];
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
        let j = to_json(&sample_profile());
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
        assert_eq!(cats.iter().position(|c| c["color"] == "grey"), Some(CATEGORY_OTHER as usize));
    }

    #[test]
    fn samples_sorted_with_cpu_deltas() {
        let mut p = sample_profile();
        p.processes[0].threads[1].samples.swap(0, 2);
        let j = to_json(&p);
        let s = &thread_of(&j, 10)["samples"];
        let rows = s["data"].as_array().unwrap();
        let times: Vec<f64> = rows.iter().map(|r| r[col(s, "time")].as_f64().unwrap()).collect();
        assert_eq!(times, [1.0, 2.0, 3.0, 4.0]);
        let cpu: Vec<Option<u64>> =
            rows.iter().map(|r| r[col(s, "threadCPUDelta")].as_u64()).collect();
        assert_eq!(cpu, [Some(0), Some(900_000), Some(1_000_000), None]);
        assert!(rows.iter().all(|r| r[col(s, "eventDelay")] == 0));
    }

    #[test]
    fn root_range_covers_late_samples() {
        let mut p = sample_profile();
        p.end_time_ms = 3.5;
        let j = to_json(&p);
        assert_eq!(j["meta"]["profilingEndTime"], 4.0);
        assert_eq!(::tests::gecko_schema::validate(&j), Ok(()));
    }

    #[test]
    fn output_is_plain_json() {
        let mut buf = Vec::new();
        write_gecko(&sample_profile(), &mut buf).unwrap();
        assert_eq!(buf[0], b'{');
    }
}
