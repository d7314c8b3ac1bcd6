//! Names, when windows are read (`query`), the frames an agent could not name on its host
//! (a stripped file whose debug file the host lacks): the agent keeps each with its file's
//! build-id and its ELF virtual address (`Frame::elf`, in pprof the location's address and its
//! mapping's build-id); here that pair is named from a debug file found by the build-id
//! (`symbolize::by_build_id`), or from names a ClickHouse database already holds.

use crate::{
    agent::rows::Stacks,
    model::stacks::{ElfAddress, Frame},
    symbolize::by_build_id::ByBuildId,
};

/// The distinct places of the unnamed frames of `stacks`.
pub fn unnamed(stacks: &Stacks) -> Vec<ElfAddress> {
    let mut out: Vec<ElfAddress> =
        stacks.values().flatten().filter_map(|f| f.elf.as_deref().cloned()).collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Replaces each unnamed frame of `stacks` that `names` names by its frames (outermost first,
/// those inlined into it after it); the others stay as they are (counted in its stats).
pub fn name_stacks(stacks: &mut Stacks, names: &mut ByBuildId) {
    let wanted: Vec<(String, u64)> =
        unnamed(stacks).into_iter().map(|e| (e.build_id, e.address)).collect();
    if wanted.is_empty() {
        return;
    }
    names.name(&wanted);
    for frames in stacks.values_mut() {
        if !frames.iter().any(|f| f.elf.is_some()) {
            continue;
        }
        let mut out: Vec<Frame> = Vec::with_capacity(frames.len());
        for f in frames.drain(..) {
            let named = f.elf.as_deref().and_then(|e| names.frames(&e.build_id, e.address));
            match named {
                Some(named) => out.extend(named.iter().enumerate().map(|(i, n)| Frame {
                    module: f.module.clone(),
                    inlined: if i == 0 { f.inlined } else { n.inlined },
                    ..n.clone()
                })),
                None => out.push(f),
            }
        }
        *frames = out;
    }
}
