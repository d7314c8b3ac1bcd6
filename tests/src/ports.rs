//! Loopback ports for the real servers tests start (ClickHouse, Prometheus).
//!
//! Asking the kernel for port 0 and handing the number to a server races: the port is free
//! when we look and taken when the server binds. It is taken most often by an outgoing
//! connection of a concurrent test, because port 0 and outgoing connections draw from the
//! same ephemeral range. So ports come from below that range, probed by binding, and a
//! server that still finds its port taken is started again on new ones (`in_use`).

use std::{
    net::TcpListener,
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::{Result, bail};

/// How often a server start is retried on new ports after "address already in use".
pub const START_ATTEMPTS: usize = 5;

/// The first port of the kernel's ephemeral range (32768 when it cannot be read).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// A port on 127.0.0.1 that nothing listens on now, below the ephemeral range.
pub fn free_port() -> Result<u16> {
    static N: AtomicU32 = AtomicU32::new(0);
    let hi = u32::from(ephemeral_start().max(12_000));
    let lo = 10_000u32;
    // Different test processes start at different places, so they rarely probe the same port.
    let seed = std::process::id().wrapping_mul(7919)
        ^ N.fetch_add(1, Ordering::Relaxed).wrapping_mul(104_729);
    let span = hi - lo;
    for i in 0..span {
        let port = (lo + (seed.wrapping_add(i * 31)) % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free loopback port between {lo} and {hi}")
}

/// Whether a server's log says it could not bind its port.
pub fn in_use(log: &str) -> bool {
    log.to_ascii_lowercase().contains("address already in use")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_free_and_below_the_ephemeral_range() {
        for _ in 0..20 {
            let p = free_port().unwrap();
            assert!(p < ephemeral_start().max(12_000), "{p}");
            TcpListener::bind(("127.0.0.1", p)).unwrap();
        }
        assert!(in_use("<Error> Application: Net Exception: Address already in use: 1"));
        assert!(in_use("listen tcp 127.0.0.1:9: bind: address already in use"));
        assert!(!in_use("Ready."));
    }
}
