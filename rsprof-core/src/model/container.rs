//! Who a process's cgroup belongs to: a container runtime and id, or a systemd service.
//! Parsed from cgroup paths by `system::cgroup::container`.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Runtime {
    Docker,
    Containerd,
    CriO,
    Podman,
    Lxc,
    /// A Kubernetes container in a cgroupfs-driver layout, which does not name the runtime.
    Kubernetes,
    /// Not a container: a systemd service unit.
    Service,
}

impl Runtime {
    pub fn name(self) -> &'static str {
        match self {
            Runtime::Docker => "docker",
            Runtime::Containerd => "containerd",
            Runtime::CriO => "cri-o",
            Runtime::Podman => "podman",
            Runtime::Lxc => "lxc",
            Runtime::Kubernetes => "kubernetes",
            Runtime::Service => "systemd",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Qos {
    Guaranteed,
    Burstable,
    BestEffort,
}

impl Qos {
    pub fn name(self) -> &'static str {
        match self {
            Qos::Guaranteed => "Guaranteed",
            Qos::Burstable => "Burstable",
            Qos::BestEffort => "BestEffort",
        }
    }
}

/// Who a cgroup belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    pub runtime: Runtime,
    /// Container id (lowercase hex), LXC container name, or systemd unit name.
    pub id: String,
    /// Kubernetes pod UID as the API shows it (dashes, not the systemd underscores).
    pub pod_uid: Option<String>,
    pub qos: Option<Qos>,
    /// The cgroup the identity was read from (the process's own cgroup).
    pub cgroup: String,
    /// The ancestor of `cgroup` (or `cgroup` itself) that is the container's root.
    pub container_cgroup: String,
}

impl Identity {
    pub fn is_container(&self) -> bool {
        self.runtime != Runtime::Service
    }

    /// First 8 characters of a hex id; names (LXC, services) in full.
    pub fn short_id(&self) -> &str {
        if is_hex(&self.id) && self.id.len() > 8 { &self.id[..8] } else { &self.id }
    }

    /// The suffix for a process name, e.g. `[docker 3f2a9c1b]`. None for services: every
    /// process on a systemd host is in some unit, so tagging them all would only add noise.
    pub fn process_label(&self) -> Option<String> {
        self.is_container().then(|| format!("[{} {}]", self.runtime.name(), self.short_id()))
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.runtime.name(), self.short_id())?;
        if let Some(pod) = &self.pod_uid {
            write!(f, " pod {pod}")?;
        }
        Ok(())
    }
}

fn is_hex(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit())
}
