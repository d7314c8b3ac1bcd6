//! Turns decoded kernel records into stored events and process metadata: `collector`
//! dispatches, `processes` is the process and thread table, `modules` maps user addresses to
//! (file, offset) while the process is alive.

pub mod collector;
pub mod modules;
pub mod processes;
