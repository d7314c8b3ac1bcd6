//! Whose a window's profile is: the labels every sink stores with it. A window is one profile
//! per service (container, systemd unit, else executable name), not per process: a storm of
//! short-lived processes of one program is one profile, one spool window, one Pyroscope series
//! and one set of ClickHouse rows, and the number of series per host is bounded by its services.
//! Whose each sample is (pid, tid, process and thread names) stays in the profile, as pprof
//! sample labels (`writers::pprof`), which `query --process/--pid` select on.

use serde::{Deserialize, Serialize};

use crate::model::{
    container::Runtime,
    ids::ThreadKey,
    process::{IDLE_PROCESS_NAME, ProcessesMeta, display_names},
};

/// One profile's labels: a service on a host.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WindowLabels {
    /// The container's id (LXC: name), else the systemd unit, else the process name.
    pub service_name: String,
    pub host: String,
    /// Only in windows of agents that wrote one profile per process (before per-service
    /// windows), which still read back: their process's pid (0 for the idle tasks) and name.
    /// A per-service window leaves them 0 and empty; its samples say whose they are.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pid: u32,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub process: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_runtime: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub systemd_unit: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_qos: Option<String>,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

impl WindowLabels {
    /// The labels of the service `thread` belongs to.
    pub fn of(processes: &ProcessesMeta, thread: ThreadKey, host: &str) -> Self {
        let (process, _) = display_names(processes, thread);
        let identity = thread.pid().and_then(|p| processes.get(&p)?.container.clone());
        let mut l = Self {
            service_name: process,
            host: host.to_owned(),
            pid: 0,
            process: String::new(),
            container_runtime: None,
            container_id: None,
            systemd_unit: None,
            pod_uid: None,
            pod_qos: None,
        };
        if thread.is_idle() {
            l.service_name = IDLE_PROCESS_NAME.into();
        }
        if let Some(c) = identity {
            l.service_name = c.id.clone();
            if c.runtime == Runtime::Service {
                l.systemd_unit = Some(c.id);
            } else {
                l.container_runtime = Some(c.runtime.name().into());
                l.container_id = Some(c.id);
            }
            l.pod_uid = c.pod_uid;
            l.pod_qos = c.qos.map(|q| q.name().into());
        }
        l
    }

    /// The labels pprof samples carry beyond what the pprof writer adds itself (pid, process,
    /// container runtime/id or service, pod).
    pub fn extra_sample_labels(&self) -> Vec<(String, String)> {
        vec![("service_name".into(), self.service_name.clone()), ("host".into(), self.host.clone())]
    }
}
