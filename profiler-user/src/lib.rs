//! rsprof-bpf userspace. Data flows one way:
//! kernel (BPF) → ring buffer → `collector` → `storage` → `symbolize` → writers (`gecko`).

pub mod gecko;
pub mod ids;
pub mod profile;
