//! The Firefox Profiler's Gecko format (version 36), the only code that produces Gecko JSON:
//! `writer` (the [`GeckoWriter`](writer::GeckoWriter): events into per-thread tables, then
//! processes and metadata), `tables` (per-thread tables and the file layout), `markers`
//! (schemas and payloads), `container` (how container identity is shown), `process` (executable and command line).

pub mod container;
pub mod markers;
pub mod process;
pub mod tables;
pub mod writer;

pub use writer::GeckoWriter;
