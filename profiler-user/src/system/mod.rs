//! The host: launching `-- CMD`, /proc, cgroups and container identity.

pub mod cgroup;
pub mod launch;
