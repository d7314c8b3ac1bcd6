//! The Firefox Profiler's Gecko format (version 36), the only code that produces Gecko JSON:
//! `writer` (the [`GeckoWriter`](writer::GeckoWriter): events into per-thread tables, then
//! processes and metadata), `tables` (per-thread tables and the file layout), `markers`
//! (schemas and payloads), `container` (how container identity is shown), `process` (executable and command line),
//! `libs` (the modules a process's frames name, with their build-ids).

pub mod container;
pub mod libs;
pub mod markers;
pub mod process;
pub mod tables;
pub mod writer;

pub use writer::GeckoWriter;
