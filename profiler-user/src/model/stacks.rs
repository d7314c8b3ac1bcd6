//! What writers see: named frames, the stack tree with every node's frames resolved, and
//! process and thread metadata. Writers never see BPF records or addresses to resolve.

use std::{collections::HashMap, ops::Range};

use crate::{
    model::ids::{Pid, Tid},
    store::codec::StackId,
    store::{FrameAddr, StoreSnapshot},
};

/// Which part of the system a frame ran in; picks its Gecko category.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrameKind {
    User,
    Kernel,
    /// An `rsprof:label_push` label: the text is `function`, the module `rsprof label`.
    Label,
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
}

impl SymbolizedStacks {
    /// `symbols` maps each address to its frames; an address missing from it contributes none.
    pub fn new(snap: &StoreSnapshot, symbols: &HashMap<FrameAddr, Vec<Frame>>) -> Self {
        let mut out = Self::default();
        let mut frame_ids: HashMap<&Frame, FrameIndex> = HashMap::new();
        let mut addr_ranges: HashMap<FrameAddr, Range<u32>> = HashMap::new();
        out.nodes = snap
            .stacks
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
        Self { frames, nodes, frame_lists, same_display }
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

/// A thread's metadata as recorded.
#[derive(Clone, Debug, Default)]
pub struct ThreadMeta {
    /// Last name the thread had (its `comm`).
    pub name: String,
    /// Earlier names, oldest first, when the thread renamed itself.
    pub previous_names: Vec<String>,
    /// CLOCK_MONOTONIC ns of its creation, if it happened during the recording.
    pub start_ns: Option<u64>,
    pub end_ns: Option<u64>,
}

#[derive(Clone, Debug, Default)]
pub struct ProcessMeta {
    /// Executable name (`comm` of the main thread after exec).
    pub name: String,
    pub argv: Vec<String>,
    pub start_ns: Option<u64>,
    pub end_ns: Option<u64>,
    pub threads: HashMap<Tid, ThreadMeta>,
    /// The container or systemd service it runs in (from its cgroup), if any.
    pub container: Option<crate::system::cgroup::container::Identity>,
    /// `rsprof:label_push` texts by label address.
    pub labels: HashMap<u64, String>,
}

pub type ProcessesMeta = HashMap<Pid, ProcessMeta>;
