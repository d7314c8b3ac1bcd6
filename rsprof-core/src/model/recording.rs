//! What is known about a recording as a whole.

use super::time::MonoNs;

/// The recording's time base and description.
#[derive(Clone, Debug)]
pub struct RecordingInfo {
    /// The profile's zero.
    pub start: MonoNs,
    /// Wall-clock ms since the epoch at the same instant.
    pub start_wall_ms: f64,
    pub end: MonoNs,
    /// Samples per second per CPU.
    pub frequency: u64,
    pub logical_cpus: u32,
    pub physical_cpus: u32,
    /// e.g. `rsprof-bpf 0.1.0`.
    pub product: String,
    /// `uname -srm`-like string.
    pub oscpu: String,
}

impl RecordingInfo {
    /// Milliseconds from the profile's zero to `t`.
    pub fn ms(&self, t: MonoNs) -> f64 {
        (t.0 as f64 - self.start.0 as f64) / 1e6
    }
}

/// Data dropped to stay within the buffer size: the oldest events, as whole chunks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recycled {
    pub chunks: u64,
    pub events: u64,
    /// Time range of the recycled events; None if nothing was recycled.
    pub range: Option<(MonoNs, MonoNs)>,
}
