use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

/// Compiles profiler-ebpf for the BPF target with the nightly toolchain; the loader embeds the
/// object from OUT_DIR.
fn main() -> anyhow::Result<()> {
    let meta = cargo_metadata::MetadataCommand::new().no_deps().exec().context("cargo metadata")?;
    let ebpf = meta
        .packages
        .into_iter()
        .find(|p| p.name.as_str() == "profiler-ebpf")
        .ok_or_else(|| anyhow!("profiler-ebpf package not found"))?;
    let root_dir = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("profiler-ebpf has no directory"))?
        .as_str()
        .to_owned();
    aya_build::build_ebpf(
        [Package { name: ebpf.name.as_str(), root_dir: &root_dir, ..Default::default() }],
        Toolchain::default(),
    )
}
