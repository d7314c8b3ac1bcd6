//! Uprobe perf events with a kernel-maintained semaphore, linked to a BPF program.
//!
//! Each site is one uprobe perf event opened here rather than through aya, because aya 0.14
//! cannot pass a semaphore (`ref_ctr_offset`): the kernel then increments the probe's u16
//! semaphore in every process mapping the file, now and later, and decrements it when the
//! event closes. The event is linked to the shared `on_usdt` program with `BPF_LINK_CREATE`,
//! whose BPF cookie is the site's spec index.

use std::{
    ffi::CString,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

use anyhow::{Context as _, Result, anyhow};

const UPROBE_PMU: &str = "/sys/bus/event_source/devices/uprobe";

/// `struct perf_event_attr` up to `config2` plus the zeroed rest of PERF_ATTR_SIZE_VER7.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    type_: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
    config2: u64,
    rest: [u64; 7],
}

/// `union bpf_attr` for `BPF_LINK_CREATE` with a perf event target.
#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    bpf_cookie: u64,
    rest: [u64; 4],
}

const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PERF_EVENT: u32 = 41;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;

/// The uprobe PMU's perf event type.
pub fn pmu_type() -> Result<u32> {
    let t =
        read_sys(&format!("{UPROBE_PMU}/type")).context("this kernel has no uprobe perf PMU")?;
    t.parse().map_err(|_| anyhow!("bad {UPROBE_PMU}/type '{t}'"))
}

/// Whether uprobe events can carry a semaphore offset (`ref_ctr_offset`, Linux 4.20+).
pub fn ref_ctr_supported() -> bool {
    Path::new(&format!("{UPROBE_PMU}/format/ref_ctr_offset")).exists()
}

fn read_sys(path: &str) -> Result<String> {
    Ok(std::fs::read_to_string(path).with_context(|| format!("read {path}"))?.trim().to_owned())
}

/// Opens a system-wide uprobe at `offset` in `path`, with the kernel maintaining the
/// semaphore at `ref_ctr_offset` (0: none).
pub fn open_uprobe(
    pmu_type: u32,
    path: &Path,
    offset: u64,
    ref_ctr_offset: u64,
) -> Result<OwnedFd> {
    let cpath = CString::new(path.as_os_str().as_bytes()).context("path contains NUL")?;
    let attr = PerfEventAttr {
        type_: pmu_type,
        size: size_of::<PerfEventAttr>() as u32,
        config: ref_ctr_offset << 32,
        sample_period: 1,
        wakeup_events: 1,
        config1: cpath.as_ptr() as u64,
        config2: offset,
        ..Default::default()
    };
    // SAFETY: attr and the path it points to outlive the call. pid -1 + cpu 0 is the
    // system-wide form for uprobes: the program runs on whichever CPU hits the probe.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const PerfEventAttr,
            -1 as libc::pid_t,
            0 as libc::c_int,
            -1 as libc::c_int,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("perf_event_open(uprobe)");
    }
    // SAFETY: fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

pub fn link_create(prog: &OwnedFd, perf: &OwnedFd, cookie: u64) -> Result<OwnedFd> {
    let attr = LinkCreateAttr {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: perf.as_raw_fd() as u32,
        attach_type: BPF_PERF_EVENT,
        bpf_cookie: cookie,
        ..Default::default()
    };
    // SAFETY: valid attr of the size passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_CREATE,
            &attr as *const LinkCreateAttr,
            size_of::<LinkCreateAttr>() as u32,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("BPF_LINK_CREATE(perf_event)");
    }
    // SAFETY: fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}
