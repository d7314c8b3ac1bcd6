//! Executable mappings from the kernel, so userspace knows every address space without reading
//! /proc/PID/maps, also for a process that exited before its samples were drained.
//!
//! Where to hook: `do_mmap` is the one function both mmap(2) (via `vm_mmap_pgoff`) and the ELF
//! loader at exec (`vm_mmap`) go through, so a fexit there sees the binary, the interpreter and
//! every library with its file, length, protection and the address actually chosen (the return
//! value). The syscall tracepoints cannot: `sys_exit_mmap` has no arguments, `sys_enter_mmap`
//! no address, and neither sees the ELF loader's in-kernel mappings. `do_mmap`'s parameter list
//! changed (6.5 added `vm_flags`), so the loader passes argument positions from BTF.
//!
//! Removals hook `remove_vma`, called once per VMA being torn down by munmap(2), by MAP_FIXED
//! over existing mappings and by mremap; only VMAs with VM_EXEC of the current task's own
//! address space are sent. That skips process exit (its `exit_mmap` runs after `current->mm`
//! was cleared, and userspace drops the process on its exit record anyway), an old image torn
//! down at exec (the task already has its new mm) and an mm torn down by whoever held the last
//! reference. Hooking munmap(2) instead would fire for every large `free()` system-wide.
//!
//! Both programs run in the task making the change, before it can execute code at the new
//! address, and write to the same ring buffer as the samples, whose records are ordered by
//! reservation across CPUs: a mapping record always precedes the samples that depend on it.

use aya_ebpf::{
    helpers::{
        bpf_get_current_pid_tgid, bpf_ktime_get_ns,
        generated::{bpf_get_current_task, bpf_get_smp_processor_id, bpf_probe_read_kernel_str},
    },
    macros::{fentry, fexit, map},
    maps::PerCpuArray,
    programs::{FEntryContext, FExitContext},
};
use profiler_common::{
    Config, EVENT_MMAP, EVENT_MUNMAP, EventHeader, MAP_ANON, MAP_NAME_MAX, MAP_PATH_COMPLETE,
    MAP_PATH_DEPTH, MAP_PATH_MAX, MAP_RECORD_FIXED, MapRecord, counter,
};

use crate::{cgroup, config, count, output, read_kernel_u32, read_kernel_u64, selected};

const PROT_EXEC: u64 = 0x4;
const VM_EXEC: u64 = 0x4;
const PAGE_SIZE: u64 = 4096;
/// Return values of `do_mmap` at or above this are `-errno`.
const MMAP_ERROR_MIN: u64 = (-4095i64) as u64;

#[map]
static MAP_SCRATCH: PerCpuArray<MapRecord> = PerCpuArray::with_max_entries(1, 0);

/// Argument `i` of the traced function (the return value of a fexit sits after the last one).
/// The trampoline context is an array of u64; the verifier wants constant offsets.
#[inline(always)]
fn arg(ctx: &FExitContext, i: u32) -> u64 {
    match i {
        0 => ctx.arg(0),
        1 => ctx.arg(1),
        2 => ctx.arg(2),
        3 => ctx.arg(3),
        4 => ctx.arg(4),
        5 => ctx.arg(5),
        6 => ctx.arg(6),
        7 => ctx.arg(7),
        8 => ctx.arg(8),
        9 => ctx.arg(9),
        10 => ctx.arg(10),
        11 => ctx.arg(11),
        _ => 0,
    }
}

/// The current task's tgid and mm when the filters select it.
#[inline(always)]
fn current_selected(cfg: &Config) -> Option<(u32, u32, u64)> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if tgid == 0 || !selected(cfg, tgid) || !cgroup::selected() {
        return None;
    }
    let task = unsafe { bpf_get_current_task() };
    let mm = unsafe { read_kernel_u64(task + cfg.task_mm as u64) }?;
    Some((tgid, pid_tgid as u32, mm))
}

#[inline(always)]
unsafe fn start_record(kind: u32, tgid: u32, tid: u32, mm: u64) -> Option<*mut MapRecord> {
    let rec = MAP_SCRATCH.get_ptr_mut(0)?;
    unsafe {
        (*rec).header = EventHeader {
            kind,
            cpu: bpf_get_smp_processor_id(),
            time_ns: bpf_ktime_get_ns(),
            pid: tgid,
            tid,
        };
        (*rec).mm = mm;
        (*rec).offset = 0;
        (*rec).inode = 0;
        (*rec).dev = 0;
        (*rec).flags = 0;
        (*rec).path_len = 0;
        (*rec)._pad = 0;
    }
    Some(rec)
}

#[inline(always)]
unsafe fn send(rec: *mut MapRecord, len: u64) {
    // No wakeup: the record carries all userspace needs (no /proc lookup racing the process's
    // exit), and an exec storm would otherwise wake the reader several times per process.
    if unsafe { output(rec, len, false) } {
        count(counter::MAP_EVENTS_SENT);
    } else {
        count(counter::MAP_EVENTS_LOST);
    }
}

/// `unsigned long do_mmap(struct file *file, unsigned long addr, unsigned long len, unsigned
/// long prot, unsigned long flags, [vm_flags_t vm_flags,] unsigned long pgoff, ...)`.
#[fexit(function = "do_mmap")]
pub fn on_do_mmap(ctx: FExitContext) -> i32 {
    let cfg = config();
    let ret = arg(&ctx, cfg.mmap_arg_count);
    if ret >= MMAP_ERROR_MIN || arg(&ctx, cfg.mmap_arg_prot) & PROT_EXEC == 0 {
        return 0;
    }
    let Some((tgid, tid, mm)) = current_selected(&cfg) else { return 0 };
    // SAFETY: per-CPU scratch record; kernel reads are fault-checked.
    unsafe {
        let Some(rec) = start_record(EVENT_MMAP, tgid, tid, mm) else { return 0 };
        let len = arg(&ctx, cfg.mmap_arg_len);
        (*rec).start = ret;
        (*rec).len = (len + PAGE_SIZE - 1) & !(PAGE_SIZE - 1);
        let file = arg(&ctx, cfg.mmap_arg_file);
        if file == 0 {
            (*rec).flags = MAP_ANON;
            send(rec, MAP_RECORD_FIXED as u64);
            return 0;
        }
        (*rec).offset = arg(&ctx, cfg.mmap_arg_pgoff) * PAGE_SIZE;
        if let Some(inode) = read_kernel_u64(file + cfg.file_inode as u64) {
            (*rec).inode = read_kernel_u64(inode + cfg.inode_ino as u64).unwrap_or(0);
            if let Some(sb) = read_kernel_u64(inode + cfg.inode_sb as u64) {
                (*rec).dev = read_kernel_u32(sb + cfg.sb_dev as u64).unwrap_or(0);
            }
        }
        let (len, complete) = walk_path(&cfg, file, rec);
        (*rec).path_len = len as u32;
        if complete {
            (*rec).flags |= MAP_PATH_COMPLETE;
        } else {
            count(counter::MAP_PATH_INCOMPLETE);
        }
        send(rec, MAP_RECORD_FIXED as u64 + len);
    }
    0
}

/// Writes the path of `file` into `rec.path`, leaf component first, each NUL-terminated:
/// dentry names up to the mount's root, then across to the mountpoint in the parent mount,
/// until the root of the mount tree. Returns the bytes written and whether the root was
/// reached (not when a name or the whole path was too long, or the file's mount was detached,
/// e.g. lazily unmounted). Userspace checks the result against (dev, inode) before use.
#[inline(always)]
unsafe fn walk_path(cfg: &Config, file: u64, rec: *mut MapRecord) -> (u64, bool) {
    unsafe {
        let (Some(mut dentry), Some(mut vfsmnt)) = (
            read_kernel_u64(file + cfg.file_path_dentry as u64),
            read_kernel_u64(file + cfg.file_path_mnt as u64),
        ) else {
            return (0, false);
        };
        let buf = (*rec).path.as_mut_ptr();
        let mut off: u64 = 0;
        for _ in 0..MAP_PATH_DEPTH {
            let mnt = vfsmnt - cfg.mount_mnt as u64;
            let (Some(root), Some(parent)) = (
                read_kernel_u64(vfsmnt + cfg.vfsmount_root as u64),
                read_kernel_u64(dentry + cfg.dentry_parent as u64),
            ) else {
                break;
            };
            if dentry == root {
                let Some(mnt_parent) = read_kernel_u64(mnt + cfg.mount_parent as u64) else {
                    break;
                };
                if mnt_parent == mnt {
                    return (off, true);
                }
                let Some(mountpoint) = read_kernel_u64(mnt + cfg.mount_mountpoint as u64) else {
                    break;
                };
                dentry = mountpoint;
                vfsmnt = mnt_parent + cfg.mount_mnt as u64;
                continue;
            }
            if dentry == parent || off >= MAP_PATH_MAX as u64 {
                break;
            }
            let Some(name) = read_kernel_u64(dentry + cfg.dentry_name as u64) else { break };
            // The mask keeps the write inside `path` for the verifier: off < MAP_PATH_MAX here
            // and `path` has MAP_NAME_MAX bytes to spare.
            let dst = buf.add((off & (MAP_PATH_MAX as u64 - 1)) as usize);
            let n = bpf_probe_read_kernel_str(dst.cast(), MAP_NAME_MAX as u32, name as *const _);
            if n <= 0 || n >= MAP_NAME_MAX as i64 {
                break;
            }
            off += n as u64;
            dentry = parent;
        }
        (off, false)
    }
}

/// `void remove_vma(struct vm_area_struct *vma)`: one VMA torn down.
#[fentry(function = "remove_vma")]
pub fn on_remove_vma(ctx: FEntryContext) -> i32 {
    let cfg = config();
    let vma: u64 = ctx.arg(0);
    // SAFETY: `vma` is the traced function's argument; reads are fault-checked.
    unsafe {
        let (Some(vm_mm), Some(flags)) =
            (read_kernel_u64(vma + cfg.vma_mm as u64), read_kernel_u64(vma + cfg.vma_flags as u64))
        else {
            return 0;
        };
        if flags & VM_EXEC == 0 {
            return 0;
        }
        let Some((tgid, tid, mm)) = current_selected(&cfg) else { return 0 };
        if vm_mm != mm {
            return 0;
        }
        let (Some(start), Some(end)) = (
            read_kernel_u64(vma + cfg.vma_start as u64),
            read_kernel_u64(vma + cfg.vma_end as u64),
        ) else {
            return 0;
        };
        let Some(rec) = start_record(EVENT_MUNMAP, tgid, tid, mm) else { return 0 };
        (*rec).start = start;
        (*rec).len = end.saturating_sub(start);
        send(rec, MAP_RECORD_FIXED as u64);
    }
    0
}
