//! The host: launching `-- CMD` (`launch`), the one /proc reader (`procfs`), host facts
//! (`host`), cgroups and container identity (`cgroup`).

pub mod cgroup;
pub mod host;
pub mod launch;
pub mod procfs;
