//! The host: launching `-- CMD` (`launch`), the one /proc reader (`procfs`), host facts
//! (`host`), cgroups and container identity (`cgroup`), tracefs for the tracepoints (`tracefs`),
//! bounded cache directories shared by runs (`cache_dir`).

pub mod cache_dir;
pub mod cgroup;
pub mod host;
pub mod launch;
pub mod procfs;
pub mod tracefs;
