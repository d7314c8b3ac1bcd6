//! The host: launching `-- CMD` (`launch`), the one /proc reader (`procfs`), host facts
//! (`host`), cgroups and container identity (`cgroup`), tracefs for the tracepoints (`tracefs`).

pub mod cgroup;
pub mod host;
pub mod launch;
pub mod procfs;
pub mod tracefs;
