//! How container identity appears in the Gecko profile, in the two places the Firefox Profiler
//! front-end shows it for imported profiles (checked against firefox-devtools/profiler):
//!
//! - the thread's `processName`, which labels the process track (processes without a
//!   `GeckoMain` thread are labelled with it, `getGlobalTrackName` in `tracks.ts`):
//!   `nginx [docker 3f2a9c1b]`;
//! - a `ContainerIdentity` interval marker spanning the process's life on its main thread, with
//!   runtime, full id, pod UID, QoS class and cgroup path as fields: shown in the Marker Chart
//!   (as a bar), the Marker Table and their tooltips and sidebar.
//!
//! `meta.extra` (the "Show more" section of the profile info panel) would fit too, but the
//! Gecko importer (`process-profile.ts`) does not copy it into the processed profile, so it
//! would never be seen.

use serde_json::{Value, json};

use crate::{
    gecko::CATEGORY_OTHER,
    intern::Interner,
    profile::{Process, Profile, Thread},
};

pub const MARKER_TYPE: &str = "ContainerIdentity";

/// `name [runtime shortid]` for containers; the plain name otherwise.
pub fn process_name(pr: &Process) -> String {
    match pr.container.as_ref().and_then(|c| c.process_label()) {
        Some(label) => format!("{} {label}", pr.name),
        None => pr.name.clone(),
    }
}

pub fn marker_schema() -> Value {
    let field = |key: &str, label: &str| json!({"key": key, "label": label, "format": "string"});
    json!({
        "name": MARKER_TYPE,
        "display": ["marker-chart", "marker-table"],
        "chartLabel": "{marker.data.runtime} {marker.data.id}",
        "tableLabel": "{marker.data.runtime} {marker.data.id} {marker.data.cgroup}",
        "tooltipLabel": "{marker.name}: {marker.data.runtime} {marker.data.id}",
        "description": "The container or systemd service this process runs in, from its cgroup",
        "data": [
            field("runtime", "Runtime"),
            field("id", "ID"),
            field("podUid", "Kubernetes pod UID"),
            field("qos", "QoS class"),
            field("cgroup", "cgroup"),
        ],
    })
}

/// (name, startTime, endTime, phase, category, data), in `MARKER_SCHEMA` column order.
pub type MarkerRow = (u32, f64, f64, u32, u32, Value);

/// The identity marker for thread `t`: one per process, on its main thread (or its first
/// thread when the main thread has no samples).
pub fn markers(
    p: &Profile,
    pr: &Process,
    t: &Thread,
    strings: &mut Interner<String>,
) -> Vec<MarkerRow> {
    let Some(c) = &pr.container else { return Vec::new() };
    let carrier = pr.threads.iter().find(|t| t.is_main).or(pr.threads.first());
    if carrier.is_none_or(|m| m.tid != t.tid) {
        return Vec::new();
    }
    let name = if c.is_container() { "Container" } else { "Service" };
    let end = pr.end_time_ms.unwrap_or(p.end_time_ms).max(pr.start_time_ms);
    let mut data = json!({
        "type": MARKER_TYPE,
        "runtime": c.runtime.name(),
        "id": c.id,
        "cgroup": c.cgroup,
    });
    if let Some(pod) = &c.pod_uid {
        data["podUid"] = json!(pod);
    }
    if let Some(q) = c.qos {
        data["qos"] = json!(q.name());
    }
    vec![(strings.intern(name), pr.start_time_ms, end, 1, CATEGORY_OTHER, data)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        ids::{Pid, Tid},
        profile::Sample,
    };

    fn thread(tid: u32, is_main: bool) -> Thread {
        Thread {
            tid: Tid(tid),
            name: "nginx".into(),
            previous_names: vec![],
            is_main,
            register_time_ms: 0.0,
            unregister_time_ms: None,
            samples: vec![Sample { time_ms: 1.0, cpu_delta_ns: Some(0), stack: None, idle: false }],
        }
    }

    fn profile(cgroup: &str) -> Profile {
        Profile {
            start_time_ms: 1_700_000_000_000.0,
            interval_ms: 1.0,
            end_time_ms: 10.0,
            processes: vec![Process {
                pid: Pid(7),
                name: "nginx".into(),
                command_line: String::new(),
                start_time_ms: 0.5,
                end_time_ms: None,
                is_idle: false,
                container: crate::container::parse(cgroup),
                threads: vec![thread(7, true), thread(8, false)],
            }],
            ..Default::default()
        }
    }

    fn written(p: &Profile) -> Value {
        let mut out = Vec::new();
        crate::gecko::write_gecko(p, &mut out).unwrap();
        serde_json::from_slice(&out).unwrap()
    }

    #[test]
    fn process_name_and_identity_marker() {
        let id = "3f2a9c1b4e5d6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8";
        let cg = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod55c6c714_b240_4dec_\
             9a45_57b61696ab6e.slice/cri-containerd-{id}.scope"
        );
        let j = written(&profile(&cg));
        assert_eq!(::tests::gecko_schema::validate(&j), Ok(()));
        let threads = j["processes"][0]["threads"].as_array().unwrap();
        assert_eq!(threads[0]["processName"], "nginx [containerd 3f2a9c1b]");
        let rows = threads[0]["markers"]["data"].as_array().unwrap();
        assert_eq!(rows.len(), 1, "one marker, on the main thread");
        assert!(threads[1]["markers"]["data"].as_array().unwrap().is_empty());
        let strings = threads[0]["stringTable"].as_array().unwrap();
        assert_eq!(strings[rows[0][0].as_u64().unwrap() as usize], "Container");
        let (start, end, phase) = (&rows[0][1], &rows[0][2], &rows[0][3]);
        assert_eq!(
            (start.as_f64(), end.as_f64(), phase.as_u64()),
            (Some(0.5), Some(10.0), Some(1))
        );
        let data = &rows[0][5];
        assert_eq!(data["type"], MARKER_TYPE);
        assert_eq!(data["id"], id);
        assert_eq!(data["podUid"], "55c6c714-b240-4dec-9a45-57b61696ab6e");
        assert_eq!(data["qos"], "Burstable");
        assert_eq!(data["cgroup"], cg.as_str());
        assert!(
            j["meta"]["markerSchema"].as_array().unwrap().iter().any(|s| s["name"] == MARKER_TYPE)
        );
    }

    #[test]
    fn services_get_a_marker_but_no_name_suffix_and_plain_cgroups_neither() {
        let j = written(&profile("/system.slice/nginx.service"));
        assert_eq!(::tests::gecko_schema::validate(&j), Ok(()));
        let t0 = &j["processes"][0]["threads"][0];
        assert_eq!(t0["processName"], "nginx");
        assert_eq!(t0["markers"]["data"][0][5]["id"], "nginx.service");
        let j = written(&profile("/user.slice/user-1000.slice/session-2.scope"));
        let t0 = &j["processes"][0]["threads"][0];
        assert_eq!(t0["processName"], "nginx");
        assert!(t0["markers"]["data"].as_array().unwrap().is_empty());
    }
}
