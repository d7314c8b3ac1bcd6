//! The host, read without privileges beyond /proc: the one /proc reader (`procfs`), host facts
//! (`host`), cgroups and container identity (`cgroup`), bounded cache directories shared by
//! runs (`cache_dir`).

pub mod cache_dir;
pub mod cgroup;
pub mod host;
pub mod procfs;
