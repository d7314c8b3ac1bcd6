//! rsprof-bpf userspace. The folders are the pipeline, data flowing one way:
//!
//! ```text
//! bpf (load, attach, counters, ring drain, record decoding)
//!   -> collect (process table, mappings, stack normalization)
//!   -> store (bounded chunks of encoded events, tables pruned with their chunks)
//!   -> export (snapshot -> symbolize -> model)
//!   -> writers (gecko | pprof | collapsed, and summary) -> export::output (atomic file)
//! ```
//!
//! `model` is the writer-neutral vocabulary every stage shares (ids, frames, stacks, process
//! metadata, markers, recording info); `system` talks to the host (/proc, cgroups, launching a
//! command); `usdt` finds and attaches USDT probes and turns their hits into model markers;
//! `cli` parses and validates arguments once; `cmd` has one file per subcommand and `session`
//! runs a recording (event loop, signals, snapshots, all stderr output).

pub mod agent;
pub mod bpf;
pub mod cli;
pub mod cmd;
pub mod collect;
pub mod export;
pub mod model;
pub mod python;
pub mod session;
pub mod store;
pub mod symbolize;
pub mod system;
pub mod unwind;
pub mod usdt;
pub mod writers;
