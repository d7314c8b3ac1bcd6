//! The recording's clock: CLOCK_MONOTONIC, which BPF reads with `bpf_ktime_get_ns`.

/// CLOCK_MONOTONIC nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MonoNs(pub u64);

impl MonoNs {
    /// Now, on the same clock as the kernel's timestamps.
    pub fn now() -> Self {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: valid timespec pointer.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        MonoNs(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
    }

    /// Seconds from `earlier` to `self` (negative if `earlier` is later).
    pub fn secs_since(self, earlier: MonoNs) -> f64 {
        (self.0 as f64 - earlier.0 as f64) / 1e9
    }
}

/// (CLOCK_MONOTONIC, wall-clock ms since the epoch) read as close together as possible: the
/// profile's zero on both clocks.
pub fn clock_pair() -> (MonoNs, f64) {
    let mut best = (u64::MAX, MonoNs(0), 0.0);
    for _ in 0..5 {
        let a = MonoNs::now();
        let wall =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let b = MonoNs::now();
        if b.0 - a.0 < best.0 {
            best = (b.0 - a.0, MonoNs(a.0 + (b.0 - a.0) / 2), wall.as_secs_f64() * 1000.0);
        }
    }
    (best.1, best.2)
}
