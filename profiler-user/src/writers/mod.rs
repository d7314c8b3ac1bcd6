//! Profile writers. `gecko` is the only code that produces Gecko (Firefox Profiler) JSON;
//! `summary` is the text summary printed at the end of a recording.

pub mod gecko;
pub mod summary;
