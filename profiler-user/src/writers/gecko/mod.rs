//! The Firefox Profiler's Gecko format (version 36), the only code that produces Gecko JSON:
//! `writer` (the [`GeckoWriter`](writer::GeckoWriter): events into per-thread tables, then
//! processes and metadata), `tables` (per-thread tables and the file layout), `markers`
//! (schemas and payloads), `container` (how container identity is shown).

pub mod container;
pub mod markers;
pub mod tables;
pub mod writer;

pub use writer::GeckoWriter;
