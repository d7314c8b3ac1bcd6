//! The Firefox Profiler's Gecko format: `tables` (per-thread tables and the file layout),
//! `assemble` (one pass over a snapshot into those tables), `container` (how container
//! identity is shown).

pub mod assemble;
pub mod container;
pub mod tables;
