//! rsprof-bpf userspace. Data flows one way:
//! kernel (BPF) → ring buffer → `collector` → `storage` → `symbolize` → writers (`gecko`).
//! `storage` keeps events in memory-bounded `chunks` (encoded by `events`); `export` takes a
//! snapshot of it through `symbolize` and `assemble` (one pass into the `gecko` writer) to an
//! `output` file. `record` wires the stages together.

pub mod assemble;
pub mod cgroup_filter;
pub mod cgroupfs;
pub mod chunks;
pub mod cli;
pub mod collector;
pub mod container;
pub mod events;
pub mod export;
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
pub mod usdt;
