//! The Gecko writer's tables and file layout, checked on a small tree.

use serde_json::{Value, json};

use super::{
    categories::*,
    frame_table::SCHEMA as FRAME_SCHEMA,
    marker_table::SCHEMA as MARKER_SCHEMA,
    profile::{GeckoMeta, GeckoProcess, write_gecko},
    sample_table::SCHEMA as SAMPLE_SCHEMA,
    stack_table::SCHEMA as STACK_SCHEMA,
    string_table::location,
    thread::{GeckoThread, ThreadTables},
};
use crate::{
    model::{
        ids::{Pid, StackId, Tid},
        stacks::{Frame, FrameIndex, FrameKind, SymbolizedStacks},
    },
    writers::testdata::frame,
};

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
    assert_eq!(tables.add_off_cpu(&t, 10.0, Some(StackId(1)), 2_500_000, 2_500_000, 1_000_000), 2);
    assert_eq!(tables.add_off_cpu(&t, 20.0, Some(StackId(1)), 400_000, 400_000, 1_000_000), 0);
    assert_eq!(tables.add_off_cpu(&t, 30.0, Some(StackId(1)), 100_000, 100_000, 1_000_000), 1);
    let times: Vec<f64> = tables.samples.rows.iter().map(|r| r.time_ms).collect();
    assert_eq!(times, [10.625, 11.875, 30.05]);
    assert!(tables.samples.rows.iter().all(|r| r.cpu_delta_ns == 0));
    assert_eq!(tables.samples.busy, 0);
    assert!(tables.frames.categories().all(|c| c == CATEGORY_OFF_CPU));
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
    assert_eq!((threads[0]["tid"].as_u64(), threads[0]["name"].as_str()), (Some(10), Some("app")));
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
        .find(|r| strings[r[col(ft, "location")].as_u64().unwrap() as usize].starts_with("work"))
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
        let loc = strings[row[col(ft, "location")].as_u64().unwrap() as usize].as_str().unwrap();
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
    let cpu: Vec<Option<u64>> = rows.iter().map(|r| r[col(s, "threadCPUDelta")].as_u64()).collect();
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
