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

use crate::model::container::Identity;

pub const MARKER_TYPE: &str = "ContainerIdentity";

/// `name [runtime shortid]` for containers; the plain name otherwise.
pub fn process_name(name: &str, container: Option<&Identity>) -> String {
    match container.and_then(|c| c.process_label()) {
        Some(label) => format!("{name} {label}"),
        None => name.to_owned(),
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

/// The identity marker's name and payload.
pub fn marker(c: &Identity) -> (&'static str, Value) {
    let name = if c.is_container() { "Container" } else { "Service" };
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
    (name, data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_name_and_identity_marker() {
        let id = "3f2a9c1b4e5d6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8";
        let cg = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod55c6c714_b240_4dec_\
             9a45_57b61696ab6e.slice/cri-containerd-{id}.scope"
        );
        let c = crate::system::cgroup::container::parse(&cg).unwrap();
        assert_eq!(process_name("nginx", Some(&c)), "nginx [containerd 3f2a9c1b]");
        let (name, data) = marker(&c);
        assert_eq!(name, "Container");
        assert_eq!(data["type"], MARKER_TYPE);
        assert_eq!(data["id"], id);
        assert_eq!(data["podUid"], "55c6c714-b240-4dec-9a45-57b61696ab6e");
        assert_eq!(data["qos"], "Burstable");
        assert_eq!(data["cgroup"], cg.as_str());
    }

    #[test]
    fn services_get_a_marker_but_no_name_suffix() {
        let c = crate::system::cgroup::container::parse("/system.slice/nginx.service").unwrap();
        assert_eq!(process_name("nginx", Some(&c)), "nginx");
        assert_eq!(marker(&c).1["id"], "nginx.service");
        assert_eq!(process_name("nginx", None), "nginx");
    }
}
