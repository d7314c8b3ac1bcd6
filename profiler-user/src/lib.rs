//! rsprof-bpf, the binary's crate: the kernel side (`bpf`: load, attach, drain the ring;
//! `unwind`: unwind tables written to the kernel; `usdt`: probes found and attached; `python`:
//! interpreters handed to the kernel), `session` (a recording: event loop, signals, snapshots,
//! the summary and all stderr output), `cli` (arguments parsed and validated once), `cmd` (one
//! file per subcommand) and `agent` (continuous profiling: windows, sinks, metrics).
//!
//! The root-free stages (decode -> collect -> store -> export -> symbolize -> writers) live in
//! `rsprof-core`; they are re-exported here under the names the binary has always used.

pub mod agent;
pub mod bpf;
pub mod cli;
pub mod cmd;
pub mod python;
pub mod session;
pub mod system;
pub mod unwind;
pub mod usdt;

pub use rsprof_core::{collect, export, model, store, symbolize, writers};
