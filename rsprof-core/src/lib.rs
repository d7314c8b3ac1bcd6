//! rsprof-core: the stages of rsprof-bpf that need no kernel, no root and no BPF toolchain,
//! data flowing one way:
//!
//! ```text
//! decode (ring-buffer records -> typed events, counters' table)
//!   -> collect (process table, mappings, stack normalization, stack copies unwound)
//!   -> store (bounded chunks of encoded events, tables pruned with their chunks)
//!   -> export (snapshot -> symbolize -> model)
//!   -> writers (gecko | pprof | collapsed, and the profile's stats) -> export::output
//! ```
//!
//! `model` is the writer-neutral vocabulary every stage shares (ids, frames, stacks, process
//! metadata, markers, recording info); `system` reads the host (/proc, cgroups, cache
//! directories); `python` reads CPython's code objects and merges its frames into stacks;
//! `debugfile` finds a file's separate debug file; `replay` feeds a collector from a raw
//! stream saved by `record --save-raw` (with its recorded kernel names), without a kernel. The binary crate (`profiler-user`) loads the
//! kernel programs, feeds the collector from the ring buffer and runs sessions and the agent.

pub mod collect;
pub mod counters;
pub mod debugfile;
pub mod decode;
pub mod export;
pub mod model;
pub mod replay;
pub mod store;
pub mod symbolize;
pub mod system;
pub mod writers;
