//! The drain timer: a `timerfd` in the event loop's epoll set.
//!
//! tokio's timer wheel keeps a deadline more than 64 ms away in a coarse slot and wakes the
//! loop when that slot begins, up to 64 ms early, to move it to a finer one: two wakeups per
//! drain period (seen with strace, one at the slot and one at the deadline), where an idle
//! recording's own CPU is mostly its wakeups. A timerfd fires once, at its deadline.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::Duration,
};

use tokio::io::{Interest, unix::AsyncFd};

/// A one-shot timer re-armed by its owner after each expiry or at any time.
pub struct DrainTimer {
    fd: AsyncFd<OwnedFd>,
}

impl DrainTimer {
    /// A timer that first fires `after` from now. Needs a tokio runtime with IO enabled.
    pub fn new(after: Duration) -> io::Result<Self> {
        // SAFETY: a plain syscall; the fd returned is ours alone.
        let raw = unsafe {
            libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new, valid fd owned by nothing else.
        let owned = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: the fd stays open as long as the AsyncFd that owns it.
        let fd = unsafe { AsyncFd::register_with_interest(owned, Interest::READABLE)? };
        let t = Self { fd };
        t.reset_after(after)?;
        Ok(t)
    }

    /// Fires `after` from now (at least 1 ns: zero would disarm it), replacing any deadline.
    pub fn reset_after(&self, after: Duration) -> io::Result<()> {
        let after = after.max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 },
            it_value: libc::timespec {
                tv_sec: after.as_secs() as libc::time_t,
                tv_nsec: after.subsec_nanos() as libc::c_long,
            },
        };
        // SAFETY: a valid timerfd and a valid spec; the old value is not wanted.
        let r =
            unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits for the deadline; the timer is then disarmed until the next `reset_after`.
    pub async fn expired(&self) -> io::Result<()> {
        loop {
            let mut guard = self.fd.readable().await?;
            let mut count = 0u64;
            // SAFETY: reads 8 bytes into `count` from a valid fd.
            let n = unsafe {
                libc::read(self.fd.as_raw_fd(), (&raw mut count).cast(), std::mem::size_of::<u64>())
            };
            if n == 8 {
                // A one-shot timer is not readable again until it is re-armed and fires.
                guard.clear_ready();
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if n < 0 && e.kind() == io::ErrorKind::WouldBlock {
                // Re-armed before it was read: not yet due.
                guard.clear_ready();
                continue;
            }
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    #[tokio::test]
    async fn fires_once_at_its_deadline_and_again_when_reset() {
        let start = Instant::now();
        let t = DrainTimer::new(Duration::from_millis(30)).unwrap();
        t.expired().await.unwrap();
        let first = start.elapsed();
        assert!(first >= Duration::from_millis(30), "{first:?}");
        // Disarmed after firing: nothing arrives without a reset.
        let idle = tokio::time::timeout(Duration::from_millis(60), t.expired()).await;
        assert!(idle.is_err(), "a fired timer stays quiet until reset");
        // A reset moves the deadline, also to earlier than a pending one.
        t.reset_after(Duration::from_secs(10)).unwrap();
        t.reset_after(Duration::from_millis(20)).unwrap();
        let again = Instant::now();
        t.expired().await.unwrap();
        let took = again.elapsed();
        assert!(took >= Duration::from_millis(20) && took < Duration::from_secs(5), "{took:?}");
    }
}
