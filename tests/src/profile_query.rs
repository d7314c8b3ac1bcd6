//! Read-only queries over a Gecko profile JSON for integration tests: which threads exist and
//! what their samples' stacks look like. Tables are read through their `schema`, never by a
//! fixed column position.

use std::collections::HashMap;

use serde_json::Value;

/// A thread of the profile, from the root or from a sub-process.
#[derive(Clone, Debug)]
pub struct ThreadInfo<'v> {
    pub pid: u64,
    pub tid: u64,
    pub name: &'v str,
    pub process_name: &'v str,
    pub thread: &'v Value,
}

fn as_id(v: &Value) -> u64 {
    v.as_u64().or_else(|| v.as_str()?.parse().ok()).unwrap_or(u64::MAX)
}

/// Every thread: root `threads` first, then each `processes[i].threads`, like the importer.
pub fn threads(profile: &Value) -> Vec<ThreadInfo<'_>> {
    let root = profile["threads"].as_array().into_iter().flatten();
    let subs = profile["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|p| p["threads"].as_array().into_iter().flatten());
    root.chain(subs)
        .map(|t| ThreadInfo {
            pid: as_id(&t["pid"]),
            tid: as_id(&t["tid"]),
            name: t["name"].as_str().unwrap_or(""),
            process_name: t["processName"].as_str().unwrap_or(""),
            thread: t,
        })
        .collect()
}

pub fn threads_of_pid(profile: &Value, pid: u32) -> Vec<ThreadInfo<'_>> {
    threads(profile).into_iter().filter(|t| t.pid == u64::from(pid)).collect()
}

/// Column `name` of every row of `thread[table]`.
fn column<'v>(thread: &'v Value, table: &str, name: &str) -> Vec<&'v Value> {
    let t = &thread[table];
    let (Some(i), Some(rows)) = (t["schema"][name].as_u64(), t["data"].as_array()) else {
        return Vec::new();
    };
    rows.iter().map(|r| r.get(i as usize).unwrap_or(&Value::Null)).collect()
}

/// Sample times (ms), in table order.
pub fn sample_times(thread: &Value) -> Vec<f64> {
    column(thread, "samples", "time").into_iter().map(|v| v.as_f64().unwrap_or(f64::NAN)).collect()
}

/// Each sample's `threadCPUDelta` (in `meta.sampleUnits.threadCPUDelta` units), None when null.
pub fn sample_cpu_deltas(thread: &Value) -> Vec<Option<u64>> {
    column(thread, "samples", "threadCPUDelta").into_iter().map(Value::as_u64).collect()
}

/// For each sample, its frame location strings from root to leaf (empty for a null stack).
/// Panics on dangling indices: run `gecko_schema::validate` first for a readable report.
pub fn sample_stacks(thread: &Value) -> Vec<Vec<String>> {
    let strings = thread["stringTable"].as_array().map(Vec::as_slice).unwrap_or_default();
    let locations: Vec<&str> = column(thread, "frameTable", "location")
        .into_iter()
        .map(|v| strings[v.as_u64().expect("frame location") as usize].as_str().unwrap_or(""))
        .collect();
    let prefixes: Vec<Option<usize>> = column(thread, "stackTable", "prefix")
        .into_iter()
        .map(|v| v.as_u64().map(|x| x as usize))
        .collect();
    let frames: Vec<usize> = column(thread, "stackTable", "frame")
        .into_iter()
        .map(|v| v.as_u64().expect("stack frame") as usize)
        .collect();
    let mut memo: HashMap<usize, Vec<String>> = HashMap::new();
    column(thread, "samples", "stack")
        .into_iter()
        .map(|s| {
            let Some(leaf) = s.as_u64() else { return Vec::new() };
            memo.entry(leaf as usize)
                .or_insert_with(|| {
                    let mut stack = Vec::new();
                    let mut cur = Some(leaf as usize);
                    while let Some(i) = cur {
                        stack.push(locations[frames[i]].to_string());
                        cur = prefixes[i];
                    }
                    stack.reverse();
                    stack
                })
                .clone()
        })
        .collect()
}

/// The function part of a location string, as the front-end splits native locations
/// `"f (in lib)"`, `"f (in lib) + 18"` (decimal only) and `"f (in lib) (file:line)"`; any other
/// string (a label frame for the front-end) is returned whole.
pub fn function_name(location: &str) -> &str {
    split_native(location).map_or(location, |(f, _)| f)
}

/// The library part of a native location string (`"[kernel.kallsyms]"` for kernel frames).
pub fn module_name(location: &str) -> Option<&str> {
    split_native(location).map(|(_, m)| m)
}

/// Rightmost `" (in M)"` whose remainder is empty, `" + N"` or `" (…:…)"`, matching the
/// front-end's greedy `^(.*) \(in ([^)]*)\)…$` patterns.
fn split_native(s: &str) -> Option<(&str, &str)> {
    s.rmatch_indices(" (in ").find_map(|(i, m)| {
        let rest = &s[i + m.len()..];
        let close = rest.find(')')?;
        let tail = &rest[close + 1..];
        let ok = tail.is_empty()
            || tail
                .strip_prefix(" + ")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            || (tail.starts_with(" (") && tail.ends_with(')') && tail.contains(':'));
        ok.then(|| (&s[..i], &rest[..close]))
    })
}

/// Number of samples with `function` anywhere on their stack (counted once per sample).
pub fn count_samples_with_frame(thread: &Value, function: &str) -> usize {
    sample_stacks(thread)
        .iter()
        .filter(|st| st.iter().any(|l| function_name(l) == function))
        .count()
}

/// Leaf ("self") function of each sample, counted.
pub fn self_function_counts(thread: &Value) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for st in sample_stacks(thread) {
        if let Some(leaf) = st.last() {
            *counts.entry(function_name(leaf).to_string()).or_insert(0) += 1;
        }
    }
    counts
}

/// True if `functions` appear consecutively, root→leaf, somewhere in `stack` (module suffixes
/// ignored). An empty `functions` matches every stack.
pub fn contains_path<S: AsRef<str>>(stack: &[S], functions: &[&str]) -> bool {
    functions.is_empty()
        || stack
            .windows(functions.len())
            .any(|w| w.iter().zip(functions).all(|(l, f)| function_name(l.as_ref()) == *f))
}

/// Number of samples whose stack contains the `functions` path.
pub fn count_samples_with_path(thread: &Value, functions: &[&str]) -> usize {
    sample_stacks(thread).iter().filter(|st| contains_path(st, functions)).count()
}

/// A marker row of a thread, read through the markers schema.
#[derive(Clone, Debug)]
pub struct Marker<'v> {
    pub name: &'v str,
    pub start: Option<f64>,
    pub end: Option<f64>,
    pub phase: u64,
    /// Index into `meta.categories`.
    pub category: u64,
    pub data: &'v Value,
}

pub fn markers(thread: &Value) -> Vec<Marker<'_>> {
    let strings = thread["stringTable"].as_array().map(Vec::as_slice).unwrap_or_default();
    let names = column(thread, "markers", "name");
    let starts = column(thread, "markers", "startTime");
    let ends = column(thread, "markers", "endTime");
    let phases = column(thread, "markers", "phase");
    let data = column(thread, "markers", "data");
    let categories = column(thread, "markers", "category");
    (0..names.len())
        .map(|i| Marker {
            name: names[i]
                .as_u64()
                .and_then(|n| strings.get(n as usize)?.as_str())
                .unwrap_or("<bad name>"),
            start: starts[i].as_f64(),
            end: ends[i].as_f64(),
            phase: phases[i].as_u64().unwrap_or(u64::MAX),
            category: categories[i].as_u64().unwrap_or(u64::MAX),
            data: data[i],
        })
        .collect()
}

/// (name, colour) of category `index` of the profile.
pub fn category(profile: &Value, index: u64) -> (&str, &str) {
    let c = &profile["meta"]["categories"][index as usize];
    (c["name"].as_str().unwrap_or("<none>"), c["color"].as_str().unwrap_or("<none>"))
}

/// Name of the category of every frame of `function` (module ignored).
pub fn frame_categories(profile: &Value, thread: &Value, function: &str) -> Vec<String> {
    let strings = thread["stringTable"].as_array().map(Vec::as_slice).unwrap_or_default();
    let locs = column(thread, "frameTable", "location");
    let cats = column(thread, "frameTable", "category");
    locs.iter()
        .zip(cats)
        .filter(|(l, _)| {
            l.as_u64().and_then(|i| strings.get(i as usize)?.as_str()).map(function_name)
                == Some(function)
        })
        .map(|(_, c)| {
            let i = c.as_u64().unwrap_or(u64::MAX) as usize;
            profile["meta"]["categories"][i]["name"].as_str().unwrap_or("<none>").to_owned()
        })
        .collect()
}

/// Each sample's leaf frame category name (`meta.categories`), None for a null stack.
pub fn sample_leaf_categories(profile: &Value, thread: &Value) -> Vec<Option<String>> {
    let cats = column(thread, "frameTable", "category");
    let frames = column(thread, "stackTable", "frame");
    column(thread, "samples", "stack")
        .into_iter()
        .map(|s| {
            let frame = frames.get(s.as_u64()? as usize)?.as_u64()? as usize;
            let cat = cats.get(frame)?.as_u64()? as usize;
            profile["meta"]["categories"][cat]["name"].as_str().map(str::to_owned)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn thread(pid: u32, tid: u32, name: &str) -> Value {
        json!({
            "name": name, "pid": pid, "tid": tid, "processName": "app",
            // Non-default column order, to check tables are read through their schema.
            "stringTable": ["main (in app)", "work (in app) (src/a.rs:3)", "hot_a (in libx.so)",
                            "do_syscall_64 (in [kernel.kallsyms])"],
            "frameTable": {"schema": {"category": 0, "location": 1}, "data": [[2, 0], [2, 1], [2, 2], [3, 3]]},
            "stackTable": {"schema": {"frame": 0, "prefix": 1}, "data": [[0, null], [1, 0], [2, 1], [3, 2]]},
            "samples": {"schema": {"time": 0, "stack": 1}, "data": [[1.0, 2], [2.0, 3], [3.0, null], [4.0, 1]]}
        })
    }

    fn profile() -> Value {
        json!({
            "threads": [thread(1, 1, "root")],
            "processes": [{"threads": [thread(7, 7, "app"), thread(7, 8, "worker")]},
                          {"threads": [thread(9, 9, "other")]}]
        })
    }

    #[test]
    fn lists_threads() {
        let p = profile();
        let all: Vec<_> = threads(&p).iter().map(|t| (t.pid, t.tid, t.name)).collect();
        assert_eq!(all, [(1, 1, "root"), (7, 7, "app"), (7, 8, "worker"), (9, 9, "other")]);
        let of7: Vec<_> = threads_of_pid(&p, 7).iter().map(|t| (t.name, t.process_name)).collect();
        assert_eq!(of7, [("app", "app"), ("worker", "app")]);
        assert!(threads_of_pid(&p, 5).is_empty());
    }

    #[test]
    fn resolves_stacks() {
        let t = thread(1, 1, "t");
        let stacks = sample_stacks(&t);
        assert_eq!(stacks.len(), 4);
        assert_eq!(
            stacks[0],
            ["main (in app)", "work (in app) (src/a.rs:3)", "hot_a (in libx.so)"]
        );
        assert_eq!(stacks[1].last().unwrap(), "do_syscall_64 (in [kernel.kallsyms])");
        assert!(stacks[2].is_empty());
        assert_eq!(stacks[3].len(), 2);
        assert_eq!(sample_times(&t), [1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn splits_locations() {
        assert_eq!(function_name("main (in app)"), "main");
        assert_eq!(function_name("work (in app) (src/a.rs:3:1)"), "work");
        assert_eq!(function_name("f (in lib) + 18"), "f");
        assert_eq!(function_name("f (in lib) + 0x12"), "f (in lib) + 0x12");
        assert_eq!(
            function_name("<T as core::fmt::Debug>::fmt (in libstd.so)"),
            "<T as core::fmt::Debug>::fmt"
        );
        assert_eq!(function_name("weird (in x) name (in lib)"), "weird (in x) name");
        assert_eq!(function_name("0x1234"), "0x1234");
        assert_eq!(function_name("label frame"), "label frame");
        assert_eq!(function_name("f (in lib) trailing"), "f (in lib) trailing");
        assert_eq!(module_name("do_syscall_64 (in [kernel.kallsyms])"), Some("[kernel.kallsyms]"));
        assert_eq!(module_name("js (http://x/:1:2)"), None);
    }

    #[test]
    fn counts_and_paths() {
        let t = thread(1, 1, "t");
        assert_eq!(count_samples_with_frame(&t, "work"), 3);
        assert_eq!(count_samples_with_frame(&t, "do_syscall_64"), 1);
        assert_eq!(count_samples_with_frame(&t, "nothing"), 0);
        let selfs = self_function_counts(&t);
        assert_eq!(selfs.get("hot_a"), Some(&1));
        assert_eq!(selfs.get("do_syscall_64"), Some(&1));
        assert_eq!(selfs.get("work"), Some(&1));
        assert_eq!(selfs.values().sum::<usize>(), 3);
        let st = &sample_stacks(&t)[1];
        assert!(contains_path(st, &["main", "work", "hot_a"]));
        assert!(contains_path(st, &["hot_a", "do_syscall_64"]));
        assert!(!contains_path(st, &["main", "hot_a"]), "must be consecutive");
        assert!(!contains_path(st, &["work", "main"]), "must be root to leaf");
        assert!(contains_path(st, &[]));
        assert!(contains_path(&["a (in x)", "b"], &["a", "b"]));
        assert_eq!(count_samples_with_path(&t, &["work", "hot_a"]), 2);
    }
}
