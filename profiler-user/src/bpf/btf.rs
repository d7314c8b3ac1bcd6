//! Byte offsets of the few kernel struct fields the BPF programs read, taken from the running
//! kernel's BTF. aya-ebpf has no CO-RE relocations, so the loader resolves them and passes them
//! in the program's config.

use std::{collections::HashMap, path::Path};

use anyhow::{Context as _, Result, anyhow, bail};
use btf_rs::{Btf, Type};
use profiler_common::Config;

pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

/// Fills the struct-offset fields of `config` from the kernel BTF at `path`.
pub fn fill_offsets(path: &Path, config: &mut Config) -> Result<()> {
    if !path.exists() {
        bail!(
            "kernel BTF not found at {}: rsprof-bpf needs a kernel built with CONFIG_DEBUG_INFO_BTF=y",
            path.display()
        );
    }
    // Mmap backend: we look up six fields, not worth parsing (and holding) all of vmlinux BTF.
    let btf = Btf::from_file_with_backend(path, btf_rs::Backend::Mmap)
        .with_context(|| format!("parse kernel BTF {}", path.display()))?;
    let btf = &mut Structs { btf, found: HashMap::new() };
    config.task_sum_exec_runtime = offset_of(btf, "task_struct", &["se", "sum_exec_runtime"])?;
    config.task_pid = offset_of(btf, "task_struct", &["pid"])?;
    config.task_tgid = offset_of(btf, "task_struct", &["tgid"])?;
    config.task_mm = offset_of(btf, "task_struct", &["mm"])?;
    config.mm_arg_start = offset_of(btf, "mm_struct", &["arg_start"])?;
    config.mm_arg_end = offset_of(btf, "mm_struct", &["arg_end"])?;
    // x86-64's name; an off-CPU block's site is then unknown (0) elsewhere.
    config.pt_regs_ip = offset_of(btf, "pt_regs", &["ip"]).unwrap_or(0);
    // x86-64's thread pointer; without it no Python frames are read (0: none).
    config.task_fsbase = offset_of(btf, "task_struct", &["thread", "fsbase"]).unwrap_or(0);
    fill_maptrack_offsets(btf, config)
}

/// Offsets for mapping tracking (profiler-ebpf maptrack.rs).
fn fill_maptrack_offsets(btf: &mut Structs, c: &mut Config) -> Result<()> {
    // x86-64 keeps the vDSO address in the arch mm context; elsewhere the vDSO stays unknown.
    c.mm_vdso = offset_of(btf, "mm_struct", &["context", "vdso"]).unwrap_or(0);
    c.file_inode = offset_of(btf, "file", &["f_inode"])?;
    c.file_path_mnt = offset_of(btf, "file", &["f_path", "mnt"])?;
    c.file_path_dentry = offset_of(btf, "file", &["f_path", "dentry"])?;
    c.inode_ino = offset_of(btf, "inode", &["i_ino"])?;
    c.inode_sb = offset_of(btf, "inode", &["i_sb"])?;
    // 6.7+ names; elsewhere 0, and the kernel adds no early mappings (see `UnwindFile`).
    if let (Ok(size), Ok(sec), Ok(nsec)) = (
        offset_of(btf, "inode", &["i_size"]),
        offset_of(btf, "inode", &["i_mtime_sec"]),
        offset_of(btf, "inode", &["i_mtime_nsec"]),
    ) {
        (c.inode_size, c.inode_mtime_sec, c.inode_mtime_nsec) = (size, sec, nsec);
    }
    c.sb_dev = offset_of(btf, "super_block", &["s_dev"])?;
    c.dentry_parent = offset_of(btf, "dentry", &["d_parent"])?;
    c.dentry_name = offset_of(btf, "dentry", &["d_name", "name"])?;
    c.vfsmount_root = offset_of(btf, "vfsmount", &["mnt_root"])?;
    c.mount_mnt = offset_of(btf, "mount", &["mnt"])?;
    c.mount_parent = offset_of(btf, "mount", &["mnt_parent"])?;
    c.mount_mountpoint = offset_of(btf, "mount", &["mnt_mountpoint"])?;
    c.mm_start_code = offset_of(btf, "mm_struct", &["start_code"])?;
    c.mm_end_code = offset_of(btf, "mm_struct", &["end_code"])?;
    c.mm_exe_file = offset_of(btf, "mm_struct", &["exe_file"])?;
    c.mm_saved_auxv = offset_of(btf, "mm_struct", &["saved_auxv"])?;
    c.task_files = offset_of(btf, "task_struct", &["files"])?;
    c.files_fdt = offset_of(btf, "files_struct", &["fdt"])?;
    c.fdtable_fd = offset_of(btf, "fdtable", &["fd"])?;
    c.fdtable_max_fds = offset_of(btf, "fdtable", &["max_fds"])?;
    c.vma_start = offset_of(btf, "vm_area_struct", &["vm_start"])?;
    c.vma_end = offset_of(btf, "vm_area_struct", &["vm_end"])?;
    c.vma_pgoff = offset_of(btf, "vm_area_struct", &["vm_pgoff"])?;
    c.vma_file = offset_of(btf, "vm_area_struct", &["vm_file"])?;
    // A union of `vm_flags` and `__vm_flags` since 6.3; the plain field before.
    c.vma_flags = offset_of(btf, "vm_area_struct", &["vm_flags"])?;
    Ok(())
}

/// The kernel BTF and the structs looked up so far: a lookup by name is a scan of every type
/// name in vmlinux (about 10 ms for the 13 structs here), so each struct is looked up once.
struct Structs {
    btf: Btf,
    found: HashMap<&'static str, Type>,
}

/// Byte offset of `path` (nested by-value members) inside `struct name`.
fn offset_of(structs: &mut Structs, name: &'static str, path: &[&str]) -> Result<u32> {
    let btf = &structs.btf;
    let mut ty = match structs.found.get(name) {
        Some(t) => t.clone(),
        None => {
            let t = btf
                .resolve_types_by_name(name)
                .with_context(|| format!("struct {name} not in kernel BTF"))?
                .into_iter()
                .find(|t| matches!(t, Type::Struct(_)))
                .ok_or_else(|| anyhow!("struct {name} not in kernel BTF"))?;
            structs.found.insert(name, t.clone());
            t
        }
    };
    let mut total_bits = 0u32;
    for field in path {
        let (bits, member_ty) = find_member(btf, &ty, field)?
            .ok_or_else(|| anyhow!("kernel BTF: {name} has no field {}", path.join(".")))?;
        total_bits += bits;
        ty = member_ty;
    }
    if !total_bits.is_multiple_of(8) {
        bail!("kernel BTF: {name}.{} is a bitfield", path.join("."));
    }
    Ok(total_bits / 8)
}

/// Finds `field` in a struct or union, descending into anonymous members (the kernel wraps
/// many fields in unnamed structs for layout randomization). Returns its bit offset and type,
/// with typedefs and qualifiers stripped.
fn find_member(btf: &Btf, ty: &Type, field: &str) -> Result<Option<(u32, Type)>> {
    let (Type::Struct(s) | Type::Union(s)) = ty else {
        return Ok(None);
    };
    for m in &s.members {
        let name = btf.resolve_name(m).unwrap_or_default();
        let member_ty = strip(btf, btf.resolve_chained_type(m)?)?;
        if name == field {
            return Ok(Some((m.bit_offset(), member_ty)));
        }
        if name.is_empty()
            && let Some((bits, t)) = find_member(btf, &member_ty, field)?
        {
            return Ok(Some((m.bit_offset() + bits, t)));
        }
    }
    Ok(None)
}

fn strip(btf: &Btf, mut ty: Type) -> Result<Type> {
    loop {
        ty = match &ty {
            Type::Typedef(t) => btf.resolve_chained_type(t)?,
            Type::Const(t) | Type::Volatile(t) | Type::Restrict(t) => {
                btf.resolve_chained_type(t)?
            }
            _ => return Ok(ty),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_offsets_from_running_kernel() {
        let mut c = Config::default();
        fill_offsets(Path::new(VMLINUX_BTF), &mut c).expect("kernel BTF must be readable");
        assert!(c.task_sum_exec_runtime > 0 && c.task_sum_exec_runtime % 8 == 0);
        assert!(c.task_pid > 0 && c.task_tgid == c.task_pid + 4, "pid and tgid are adjacent");
        assert!(c.mm_arg_end == c.mm_arg_start + 8);
        assert!(c.mm_end_code == c.mm_start_code + 8 && c.file_inode > 0 && c.mount_parent > 0);
        assert!(c.vma_end == c.vma_start + 8 && c.vma_file > c.vma_pgoff && c.vma_flags > 0);
    }

    #[test]
    fn missing_btf_is_a_clear_error() {
        let err = fill_offsets(Path::new("/nonexistent/vmlinux"), &mut Config::default());
        assert!(err.unwrap_err().to_string().contains("CONFIG_DEBUG_INFO_BTF"));
    }
}
