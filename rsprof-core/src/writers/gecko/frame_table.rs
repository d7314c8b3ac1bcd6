//! A thread's `frameTable`: one row per (frame, category) its samples use.

use std::io::{self, Write};

use super::{FastMap, categories, string_table::StringTable};
use crate::model::stacks::{FrameIndex, FrameKind, SymbolizedStacks};

/// Column order; rows follow it.
pub(super) const SCHEMA: &[&str] = &[
    "location",
    "relevantForJS",
    "innerWindowID",
    "implementation",
    "line",
    "column",
    "category",
    "subcategory",
];

/// (location string, frame, category): the rest of the row is read from the frame when written.
type Row = (u32, FrameIndex, u32);
/// A row as written, in `SCHEMA` order.
type RowJson = (u32, bool, Option<u32>, Option<u32>, Option<u32>, Option<u32>, u32, u32);

#[derive(Default)]
pub(super) struct FrameTable {
    rows: Vec<Row>,
    // The category is part of the key: a frame seen in idle and non-idle samples needs two rows.
    ids: FastMap<(FrameIndex, u32), u32>,
}

impl FrameTable {
    /// The row of frame `f`, in its own category or `over`.
    pub(super) fn row(
        &mut self,
        strings: &mut StringTable,
        tree: &SymbolizedStacks,
        f: FrameIndex,
        over: Option<u32>,
    ) -> Option<u32> {
        let frame = tree.frame(f)?;
        let category = over.unwrap_or(categories::of_frame(frame.kind));
        if let Some(&id) = self.ids.get(&(f, category)) {
            return Some(id);
        }
        let location = strings.location(tree.display_key(f));
        let id = self.rows.len() as u32;
        self.rows.push((location, f, category));
        self.ids.insert((f, category), id);
        Some(id)
    }

    /// The files of the native user frames, for the process's `libs`.
    pub(super) fn user_modules<'t>(
        &self,
        tree: &'t SymbolizedStacks,
    ) -> impl Iterator<Item = &'t str> {
        self.rows.iter().filter_map(move |&(_, fi, _)| {
            let f = &tree.frames[fi.0 as usize];
            (f.kind == FrameKind::User).then_some(f.module.as_str())
        })
    }

    #[cfg(test)]
    pub(super) fn categories(&self) -> impl Iterator<Item = u32> + '_ {
        self.rows.iter().map(|&(_, _, c)| c)
    }

    pub(super) fn write<W: Write>(&self, w: &mut W, tree: &SymbolizedStacks) -> io::Result<()> {
        w.write_all(b"[")?;
        for (i, &(loc, f, category)) in self.rows.iter().enumerate() {
            if i > 0 {
                w.write_all(b",")?;
            }
            let (line, column) = tree.frame(f).map_or((None, None), |f| (f.line, f.column));
            let row: RowJson = (loc, false, None, None, line, column, category, 0);
            serde_json::to_writer(&mut *w, &row)?;
        }
        w.write_all(b"]")
    }
}
