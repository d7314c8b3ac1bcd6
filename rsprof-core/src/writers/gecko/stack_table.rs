//! A thread's `stackTable`: a prefix tree of frame rows, one row per distinct (prefix, frame),
//! made only for the stacks its samples use.

use std::io::{self, Write};

use super::{FastMap, frame_table::FrameTable, string_table::StringTable};
use crate::model::{ids::StackId, stacks::SymbolizedStacks};

/// Column order; rows follow it.
pub(super) const SCHEMA: &[&str] = &["prefix", "frame"];

type Row = (Option<u32>, u32);

#[derive(Default)]
pub(super) struct StackTable {
    rows: Vec<Row>,
    ids: FastMap<Row, u32>,
    /// The row of each (tree node, category override) made so far (None: an empty stack).
    node_ids: FastMap<(StackId, Option<u32>), Option<u32>>,
    path: Vec<(StackId, Option<u32>)>,
}

impl StackTable {
    /// The row of tree node `id`, creating rows for it and any missing ancestors. `over`: the
    /// category every frame gets instead of its own (idle, off-CPU). Idle samples get the Idle
    /// category on every frame, so whichever frame is the leaf the front-end sees an idle
    /// sample, and call-tree nodes of idle time are coloured as idle.
    pub(super) fn row(
        &mut self,
        frames: &mut FrameTable,
        strings: &mut StringTable,
        tree: &SymbolizedStacks,
        id: StackId,
        over: Option<u32>,
    ) -> Option<u32> {
        // Walk up to the nearest node that already has a row, then create rows downwards.
        self.path.clear();
        let mut cur = Some(id);
        let mut prefix = None;
        while let Some(node) = cur {
            if let Some(&row) = self.node_ids.get(&(node, over)) {
                prefix = row;
                break;
            }
            self.path.push((node, over));
            // A pruned or unknown node ends the stack there rather than dropping the sample.
            cur = tree.node(node).and_then(|(parent, _)| parent);
        }
        while let Some((node, _)) = self.path.pop() {
            if let Some((_, node_frames)) = tree.node(node) {
                for &f in node_frames {
                    let Some(frame) = frames.row(strings, tree, f, over) else { continue };
                    let next = self.rows.len() as u32;
                    // A new row is appended after its prefix, so a prefix precedes its users.
                    prefix = Some(*self.ids.entry((prefix, frame)).or_insert_with(|| {
                        self.rows.push((prefix, frame));
                        next
                    }));
                }
            }
            self.node_ids.insert((node, over), prefix);
        }
        prefix
    }

    pub(super) fn write<W: Write>(&self, w: &mut W) -> io::Result<()> {
        serde_json::to_writer(&mut *w, &self.rows)?;
        Ok(())
    }
}
