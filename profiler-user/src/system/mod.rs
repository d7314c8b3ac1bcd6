//! The host: launching `-- CMD` (`launch`) and tracefs for the tracepoints (`tracefs`); the
//! root-free host readers (`procfs`, `host`, `cgroup`, `cache_dir`) are the core's.

pub mod launch;
pub mod tracefs;

pub use rsprof_core::system::{cache_dir, cgroup, host, procfs};
