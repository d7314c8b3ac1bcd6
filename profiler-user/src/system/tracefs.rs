//! tracefs: the kernel names each tracepoint by an id read from tracefs, so attaching the
//! mapping-tracking tracepoints needs it mounted. systemd mounts it, but minimal hosts, VMs and
//! containers often do not; like perf, mount it ourselves rather than fail.

use std::ffi::CString;
use std::path::Path;

use anyhow::{Result, bail};

/// Where aya looks for tracefs, in its order.
const MOUNT_POINTS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// What `ensure_mounted` found.
#[derive(Debug, PartialEq, Eq)]
pub enum Tracefs {
    AlreadyMounted,
    /// It was not mounted; we mounted it here (and leave it mounted: other tools and other
    /// rsprof-bpf runs may be using it by the time we exit).
    MountedAt(&'static str),
}

/// A mounted tracefs has entries; the bare directory the kernel creates for it has none.
fn is_mounted(path: &str) -> bool {
    Path::new(path).read_dir().is_ok_and(|mut d| d.next().is_some())
}

/// Makes sure tracefs is mounted where aya will find it. Call before the first attach: aya
/// looks it up once and remembers the answer.
pub fn ensure_mounted() -> Result<Tracefs> {
    if MOUNT_POINTS.iter().any(|p| is_mounted(p)) {
        return Ok(Tracefs::AlreadyMounted);
    }
    let target = MOUNT_POINTS[0];
    let (src, dst, fstype) = (c"nodev", CString::new(target)?, c"tracefs");
    // SAFETY: valid NUL-terminated strings; no mount data.
    let rc =
        unsafe { libc::mount(src.as_ptr(), dst.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        bail!(
            "tracefs is not mounted and mounting it at {target} failed ({err}); the mapping \
             tracepoints need it: mount it with `mount -t tracefs nodev {target}`"
        );
    }
    if !is_mounted(target) {
        bail!("mounted tracefs at {target}, but it is empty: is tracefs enabled in this kernel?");
    }
    Ok(Tracefs::MountedAt(target))
}
