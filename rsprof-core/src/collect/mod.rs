//! Turns decoded kernel records into stored events and process metadata: `collector`
//! dispatches, `processes` is the process and thread table, `modules` maps user addresses to
//! (file, offset) while the process is alive, `stack` normalizes a sample's stack,
//! `stack_cache` skips that for a stack seen moments before, and `outbox` holds what other
//! parts act on after each drain.

pub(crate) mod buildid;
pub mod collector;
pub mod copied;
pub(crate) mod elf;
pub mod jitdump;
pub mod modules;
pub mod outbox;
pub mod perfmap;
pub mod processes;
pub mod python;
pub(crate) mod stack;
pub(crate) mod stack_cache;
