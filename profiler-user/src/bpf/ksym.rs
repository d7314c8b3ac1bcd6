//! Kernel addresses named by the kernel itself: profiler-ebpf's `name_kernel_addrs`, run with
//! BPF_PROG_TEST_RUN, formats each address with `%pS` through the kernel's kallsyms lookup.
//! Naming the few hundred kernel frames of a recording this way costs microseconds, where
//! reading /proc/kallsyms costs ~50 ms of CPU (the kernel formats all ~120 k lines) plus its
//! parsing, and a few MiB to hold.

use std::os::fd::{AsRawFd as _, OwnedFd};

use anyhow::{Context as _, Result, bail};
use aya::maps::{Array, MapData};
use profiler_common::ksym::{BATCH, KsymBatch, NAME_BYTES};

use crate::symbolize::{KernelNames, KernelSymbol};

pub struct KernelNamer {
    prog: OwnedFd,
    batch: Array<MapData, KsymBatch>,
}

impl KernelNamer {
    pub fn new(prog: OwnedFd, batch: Array<MapData, KsymBatch>) -> Self {
        Self { prog, batch }
    }

    /// Runs the program once over the map's batch.
    fn run(&self) -> Result<()> {
        // `union bpf_attr`'s `test` member up to `batch_size`, zero but the program: a
        // raw-tracepoint run takes no data, no context and no repeat.
        #[repr(C)]
        #[derive(Default)]
        struct TestRunAttr {
            prog_fd: u32,
            retval: u32,
            data_size_in: u32,
            data_size_out: u32,
            data_in: u64,
            data_out: u64,
            repeat: u32,
            duration: u32,
            ctx_size_in: u32,
            ctx_size_out: u32,
            ctx_in: u64,
            ctx_out: u64,
            flags: u32,
            cpu: u32,
            batch_size: u32,
            _pad: u32,
        }
        const BPF_PROG_TEST_RUN: libc::c_long = 10;
        let mut attr = TestRunAttr { prog_fd: self.prog.as_raw_fd() as u32, ..Default::default() };
        // SAFETY: `attr` is a valid, fully initialized `bpf_attr` prefix of the size passed.
        let r = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_PROG_TEST_RUN,
                &mut attr as *mut TestRunAttr,
                size_of::<TestRunAttr>() as u32,
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error()).context("BPF_PROG_TEST_RUN");
        }
        if attr.retval != 0 {
            bail!("name_kernel_addrs returned {}", attr.retval);
        }
        Ok(())
    }
}

impl KernelNames for KernelNamer {
    fn name(&mut self, addrs: &[u64]) -> Result<Vec<Option<KernelSymbol>>> {
        let mut out = Vec::with_capacity(addrs.len());
        for chunk in addrs.chunks(BATCH) {
            let mut batch = KsymBatch { addrs: [0; BATCH], names: [[0; NAME_BYTES]; BATCH] };
            batch.addrs[..chunk.len()].copy_from_slice(chunk);
            self.batch.set(0, batch, 0).context("fill the kernel-name batch")?;
            self.run()?;
            let batch = self.batch.get(&0, 0).context("read the kernel-name batch")?;
            out.extend(batch.names[..chunk.len()].iter().map(|t| parse_symbol(t)));
        }
        Ok(out)
    }
}

/// The symbol in a `%pS` text (`name+0xoff/0xsize [module]`); None for an address outside
/// every symbol (printed as bare hex), a failed format, or a text cut short.
fn parse_symbol(text: &[u8]) -> Option<KernelSymbol> {
    let end = text.iter().position(|&b| b == 0)?;
    let text = std::str::from_utf8(&text[..end]).ok()?;
    if text.is_empty() || text.starts_with("0x") {
        return None;
    }
    let (name, rest) = text.split_once('+')?;
    let (span, module) = rest.split_once(' ').unwrap_or((rest, ""));
    let hex = |h: &str| u64::from_str_radix(h.strip_prefix("0x")?, 16).ok();
    // The span only serves caching, so a name without one is still the name. Only the core
    // kernel's: a module or BPF program unloaded and another loaded at its addresses would
    // make a cached span name the newcomer's code.
    let (offset, size) = span
        .split_once('/')
        .and_then(|(o, s)| Some((hex(o)?, hex(s)?)))
        .filter(|_| module.is_empty() && !name.starts_with("bpf_prog_"))
        .filter(|_| !name.starts_with("bpf_trampoline_"))
        .unwrap_or((0, 0));
    Some(KernelSymbol { name: name.to_owned(), offset, size })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(s: &str) -> [u8; NAME_BYTES] {
        let mut b = [0; NAME_BYTES];
        b[..s.len()].copy_from_slice(s.as_bytes());
        b
    }

    #[test]
    fn parses_percent_ps_texts() {
        let sym = |name: &str, offset, size| Some(KernelSymbol { name: name.into(), offset, size });
        assert_eq!(
            parse_symbol(&field("do_syscall_64+0x71/0x1a0")),
            sym("do_syscall_64", 0x71, 0x1a0)
        );
        assert_eq!(
            parse_symbol(&field("nf_hook_slow+0x3e/0xb0 [nf_conntrack]")),
            sym("nf_hook_slow", 0, 0)
        );
        assert_eq!(parse_symbol(&field("odd+0x3e")), sym("odd", 0, 0));
        assert_eq!(
            parse_symbol(&field("bpf_prog_6deef7357e7b4530_on_cpu+0x12/0x345")),
            sym("bpf_prog_6deef7357e7b4530_on_cpu", 0, 0)
        );
        assert_eq!(parse_symbol(&field("0xffffffffc0001234")), None);
        assert_eq!(parse_symbol(&field("")), None);
        // Cut short: no NUL, so not trusted.
        assert_eq!(parse_symbol(&[b'a'; NAME_BYTES]), None);
    }

    /// Kernel addresses are named from kallsyms, which shows them to root only (hence here,
    /// not in the root-free core).
    #[test]
    fn names_kernel_addresses() {
        let kallsyms = std::fs::read_to_string("/proc/kallsyms").unwrap();
        let line = kallsyms.lines().find(|l| l.ends_with(" do_sys_openat2")).unwrap();
        let addr = u64::from_str_radix(line.split(' ').next().unwrap(), 16).unwrap();
        assert_ne!(addr, 0, "kallsyms addresses are hidden: run as root");
        use crate::model::address::FrameAddr;
        let out = crate::symbolize::symbolize(
            vec![FrameAddr::Kernel(addr + 4)],
            vec![],
            Default::default(),
        )
        .unwrap()
        .0;
        assert_eq!(out[&FrameAddr::Kernel(addr + 4)][0].function, "do_sys_openat2");
    }
}
