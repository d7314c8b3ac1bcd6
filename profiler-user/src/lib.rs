//! rsprof-bpf userspace. Data flows one way:
//! kernel (BPF) → ring buffer → `collector` → `storage` → `symbolize` → writers (`gecko`).
//! `record` wires the stages together; `assemble` joins samples, metadata and symbols into the
//! writer-facing `profile` model.

pub mod assemble;
pub mod cgroup_filter;
pub mod cgroupfs;
pub mod cli;
pub mod collector;
pub mod container;
pub mod gecko;
pub mod gecko_container;
pub mod ids;
pub mod intern;
pub mod kernel_btf;
pub mod launch;
pub mod loader;
pub mod output;
pub mod process_cgroup;
pub mod processes;
pub mod procmaps;
pub mod profile;
pub mod record;
pub mod records;
pub mod storage;
pub mod summary;
pub mod symbolize;
