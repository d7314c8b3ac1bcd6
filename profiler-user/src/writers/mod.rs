//! Profile writers: each turns a recording (its events plus a [`ProfileContext`]) into one
//! output. `gecko` is the only code that produces Gecko (Firefox Profiler) JSON; `summary`
//! tallies the text summary printed at the end of a recording.
//!
//! Export reads storage once and hands every event to each writer through [`EventSink`]
//! (each thread's events in time order), then asks the file writers to write.

pub mod gecko;
pub mod summary;

use std::io::{self, Write};

use crate::model::{
    Sample,
    ids::ThreadKey,
    markers::{Marker, MarkerSchema},
    process::ProcessesMeta,
    recording::{RecordingInfo, Recycled},
    stacks::SymbolizedStacks,
};

/// Everything about a recording that is not an event.
pub struct ProfileContext<'a> {
    pub info: &'a RecordingInfo,
    pub stacks: &'a SymbolizedStacks,
    pub processes: &'a ProcessesMeta,
    pub marker_schemas: &'a [MarkerSchema],
    /// The oldest data dropped to stay within the buffer size.
    pub recycled: Recycled,
    pub buffer_bytes: usize,
}

/// Receives a recording's events.
pub trait EventSink {
    fn sample(&mut self, thread: ThreadKey, sample: &Sample);
    fn marker(&mut self, thread: ThreadKey, marker: &Marker);
}

/// A file format.
pub trait ProfileWriter: EventSink {
    /// Whether what was received can be written as a profile that its readers accept.
    fn is_empty(&self) -> bool;
    /// Writes the profile; `corrupt` lists storage that could not be read (skipped).
    fn write(self: Box<Self>, corrupt: &[String], out: &mut dyn Write) -> io::Result<()>;
}
