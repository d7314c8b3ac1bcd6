//! Turns decoded kernel records into stored events and process metadata: `collector`
//! dispatches, `processes` is the process and thread table, `modules` maps user addresses to
//! (file, offset) while the process is alive, `stack` normalizes a sample's stack,
//! `stack_cache` skips that for a stack seen moments before, and `outbox` holds what other
//! parts act on after each drain. `facts` is where processes that existed before the
//! recording are read (/proc, or a raw stream); `raw` is that stream's format (`--save-raw`);
//! the crate's `replay` feeds a collector from one.

pub(crate) mod buildid;
pub mod collector;
pub mod copied;
pub(crate) mod elf;
pub mod facts;
pub mod jitdump;
pub mod modules;
pub mod outbox;
pub mod perfmap;
pub mod processes;
pub mod python;
pub mod raw;
pub(crate) mod stack;
pub(crate) mod stack_cache;
