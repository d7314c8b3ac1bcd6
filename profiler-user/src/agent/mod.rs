//! Continuous profiling: `rsprof-bpf agent` records all the time (`run`: the loop) and, every
//! window, turns what was sampled into one pprof profile per service (`windows`, labelled by
//! `labels`, written by the `writer` thread) for its sinks (`spool`, then `sinks`). `query` reads a spool back as one profile.
//!
//! The agent reuses the recording pipeline: `session::Recorder` samples and collects into the
//! bounded chunked store; each window is the store's events since the previous one
//! (`ChunkedStore::window_snapshot`, which then releases the chunks read), symbolized by
//! `export` and written by `writers::pprof`. With `--flight-recorder`, the chunks read stay
//! for that long, for dumps (`flight`).

pub mod config;
pub mod flight;
pub mod labels;
pub mod metrics;
pub mod names;
pub mod query;
pub mod rows;
pub mod run;
pub mod sinks;
pub mod spool;
pub mod windows;
pub mod writer;
