//! Whose a window's profile is: the labels every sink stores with it.

use serde::{Deserialize, Serialize};

use crate::model::{
    container::Runtime,
    ids::ThreadKey,
    process::{IDLE_PROCESS_NAME, ProcessesMeta, display_names},
};

/// One profile's labels: a (service, process) on a host.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WindowLabels {
    /// The container's id (LXC: name), else the systemd unit, else the process name.
    pub service_name: String,
    pub host: String,
    /// 0 for the idle tasks.
    pub pid: u32,
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

impl WindowLabels {
    pub fn of(processes: &ProcessesMeta, thread: ThreadKey, host: &str) -> Self {
        let (process, _) = display_names(processes, thread);
        let pid = thread.pid().map_or(0, |p| p.0);
        let identity = thread.pid().and_then(|p| processes.get(&p)?.container.clone());
        let mut l = Self {
            service_name: process.clone(),
            host: host.to_owned(),
            pid,
            process,
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
