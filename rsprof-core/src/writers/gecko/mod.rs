//! The Firefox Profiler's Gecko format (version 36), the only code that produces Gecko JSON.
//! One file per part of the format, as the front-end's `gecko-profile.ts` types it:
//! - `writer`: the [`GeckoWriter`] (events into per-thread tables, then processes and metadata);
//! - `profile`: the file itself: `meta`, processes, their `libs` and threads, in order;
//! - `thread`: one thread's tables, filled in one pass over storage, and its JSON;
//! - `string_table`, `frame_table`, `stack_table`, `sample_table`, `marker_table`: those
//!   tables;
//! - `categories`: the categories and which a frame gets;
//! - `markers` (schemas and payloads), `container` (how container identity is shown),
//!   `process` (executable and command line), `libs` (the modules a process's frames name,
//!   with their build-ids).

pub(crate) mod categories;
pub mod container;
mod frame_table;
pub(crate) mod libs;
mod marker_table;
pub mod markers;
pub mod process;
pub(crate) mod profile;
mod sample_table;
mod stack_table;
mod string_table;
#[cfg(test)]
mod tests;
pub(crate) mod thread;
pub(crate) mod writer;

use std::{collections::HashMap, io};

use serde::Serialize;
use serde_json::value::RawValue;

pub use writer::GeckoWriter;

pub const GECKO_VERSION: u32 = 36;

/// Looked up for every sample (millions in a fleet query): a fast hasher rather than SipHash,
/// which resists flooding that the profiler's own ids cannot cause.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

fn to_raw_value<T: Serialize + ?Sized>(v: &T) -> io::Result<Box<RawValue>> {
    serde_json::value::to_raw_value(v).map_err(io::Error::other)
}
