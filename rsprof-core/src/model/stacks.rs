//! What writers see of stacks: named frames, and the stack tree with every node's frames
//! resolved. Writers never see BPF records or addresses to resolve.

use std::{collections::HashMap, ops::Range};

use super::{address::FrameAddr, ids::StackId};

/// Which part of the system a frame ran in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrameKind {
    User,
    Kernel,
    /// An `rsprof:label_push` label: the text is `function`, the module `rsprof label`.
    Label,
    /// The root pseudo-frame of a user stack whose walk did not reach the outermost frame
    /// (`FrameAddr::Truncated`): `function` says why.
    Truncated,
    /// JIT-compiled code named from its process's perf map: `function` is the name the runtime
    /// wrote, the module `[jit]`.
    Jit(JitLanguage),
}

/// The language of a JIT frame, for its category in profiles that show one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum JitLanguage {
    JavaScript,
    Java,
    Python,
    /// .NET and any other runtime writing a perf map.
    Other,
}

/// One symbolized frame. An address whose function could not be named keeps its module and
/// offset in `function` (e.g. `0x1234`) so it never disappears.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Frame {
    pub kind: FrameKind,
    /// Demangled function name, or `0x<offset>` when unknown.
    pub function: String,
    /// Module file name (`libc.so.6`, `[kernel.kallsyms]`, `[unknown]`).
    pub module: String,
    pub file: Option<String>,
    pub line: Option<u32>,
    pub column: Option<u32>,
    /// True for a frame of a function inlined into the next-outer frame (same address).
    pub inlined: bool,
    /// A frame left unnamed in a file with a build-id: where it is in that file, to name it
    /// elsewhere later from the file's debug file (`query`).
    pub elf: Option<Box<ElfAddress>>,
}

/// A place in an ELF file known by its GNU build-id (lower-case hex): its virtual address, as
/// the file's symbols and its debug file's DWARF give them.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ElfAddress {
    pub build_id: String,
    pub address: u64,
}

/// Index into [`SymbolizedStacks::frames`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FrameIndex(pub u32);

/// The stored stack tree with each node's address expanded into its frames (one, or several
/// for inlined functions, outermost first).
#[derive(Clone, Debug, Default)]
pub struct SymbolizedStacks {
    pub frames: Vec<Frame>,
    /// By `StackId`: parent and the node's range in `frame_lists`.
    nodes: Vec<Option<(Option<StackId>, Range<u32>)>>,
    frame_lists: Vec<FrameIndex>,
    /// By frame: the first frame equal to it but for `inlined` (they display the same).
    same_display: Vec<FrameIndex>,
    /// GNU build-id (hex) of modules by the name frames carry, where known and unambiguous.
    pub module_build_ids: HashMap<String, String>,
}

impl SymbolizedStacks {
    /// `nodes` is the stored tree by `StackId` (parent and address; None for a pruned slot);
    /// `symbols` maps each address to its frames, and an address missing from it contributes
    /// none.
    pub fn new(
        nodes: &[Option<(Option<StackId>, FrameAddr)>],
        symbols: &HashMap<FrameAddr, Vec<Frame>>,
    ) -> Self {
        let mut out = Self::default();
        let mut frame_ids: HashMap<&Frame, FrameIndex> = HashMap::new();
        let mut addr_ranges: HashMap<FrameAddr, Range<u32>> = HashMap::new();
        out.nodes = nodes
            .iter()
            .map(|node| {
                let &(parent, addr) = node.as_ref()?;
                let range = addr_ranges
                    .entry(addr)
                    .or_insert_with(|| {
                        let start = out.frame_lists.len() as u32;
                        for f in symbols.get(&addr).map(Vec::as_slice).unwrap_or_default() {
                            let next = FrameIndex(out.frames.len() as u32);
                            let id = *frame_ids.entry(f).or_insert_with(|| {
                                out.frames.push(f.clone());
                                next
                            });
                            out.frame_lists.push(id);
                        }
                        start..out.frame_lists.len() as u32
                    })
                    .clone();
                Some((parent, range))
            })
            .collect();
        out.same_display = same_display(&out.frames);
        out
    }

    /// Builds the tree directly, for writers' tests: `nodes[i]` is (parent, frames) of StackId(i).
    pub fn from_parts(frames: Vec<Frame>, nodes: Vec<(Option<StackId>, Vec<FrameIndex>)>) -> Self {
        let mut frame_lists = Vec::new();
        let nodes = nodes
            .into_iter()
            .map(|(parent, fs)| {
                let start = frame_lists.len() as u32;
                frame_lists.extend(fs);
                Some((parent, start..frame_lists.len() as u32))
            })
            .collect();
        let same_display = same_display(&frames);
        Self { frames, nodes, frame_lists, same_display, module_build_ids: HashMap::new() }
    }

    /// Frames that display the same (equal but for `inlined`) share this index.
    pub fn display_key(&self, f: FrameIndex) -> FrameIndex {
        self.same_display.get(f.0 as usize).copied().unwrap_or(f)
    }

    /// None for an unknown or pruned id.
    pub fn node(&self, id: StackId) -> Option<(Option<StackId>, &[FrameIndex])> {
        let (parent, r) = self.nodes.get(id.0 as usize)?.as_ref()?;
        Some((*parent, &self.frame_lists[r.start as usize..r.end as usize]))
    }

    pub fn frame(&self, i: FrameIndex) -> Option<&Frame> {
        self.frames.get(i.0 as usize)
    }

    /// The innermost frame of a stack (its leaf node's last frame, or the nearest ancestor's).
    pub fn leaf(&self, id: StackId) -> Option<FrameIndex> {
        let mut cur = Some(id);
        while let Some((parent, frames)) = cur.and_then(|i| self.node(i)) {
            if let Some(&f) = frames.last() {
                return Some(f);
            }
            cur = parent;
        }
        None
    }
}

fn same_display(frames: &[Frame]) -> Vec<FrameIndex> {
    let mut first: HashMap<Frame, FrameIndex> = HashMap::new();
    frames
        .iter()
        .enumerate()
        .map(|(i, f)| {
            *first.entry(Frame { inlined: false, ..f.clone() }).or_insert(FrameIndex(i as u32))
        })
        .collect()
}
