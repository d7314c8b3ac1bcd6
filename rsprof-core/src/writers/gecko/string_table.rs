//! A thread's `stringTable`. Location strings are kept as frame references and formatted when
//! written, once per profile (`Locations`): the same location in 400 threads costs 400 small
//! entries, not 400 strings.

use std::io::{self, Write};

use serde_json::value::RawValue;

use super::{FastMap, to_raw_value};
use crate::model::stacks::{FrameIndex, SymbolizedStacks};

enum StrRef {
    /// The location string of this frame.
    Frame(FrameIndex),
    Own(String),
}

#[derive(Default)]
pub(super) struct StringTable {
    strings: Vec<StrRef>,
    frame_strings: FastMap<FrameIndex, u32>,
    own_strings: FastMap<String, u32>,
}

impl StringTable {
    /// The index of `s`.
    pub(super) fn own(&mut self, s: &str) -> u32 {
        if let Some(&id) = self.own_strings.get(s) {
            return id;
        }
        let id = self.strings.len() as u32;
        self.strings.push(StrRef::Own(s.to_owned()));
        self.own_strings.insert(s.to_owned(), id);
        id
    }

    /// The index of frame `key`'s location string (frames that display alike share a key).
    pub(super) fn location(&mut self, key: FrameIndex) -> u32 {
        let next = self.strings.len() as u32;
        *self.frame_strings.entry(key).or_insert_with(|| {
            self.strings.push(StrRef::Frame(key));
            next
        })
    }

    pub(super) fn write<W: Write>(
        &self,
        w: &mut W,
        locations: &mut Locations,
        tree: &SymbolizedStacks,
    ) -> io::Result<()> {
        w.write_all(b"[")?;
        for (i, s) in self.strings.iter().enumerate() {
            if i > 0 {
                w.write_all(b",")?;
            }
            match s {
                StrRef::Own(s) => serde_json::to_writer(&mut *w, s)?,
                StrRef::Frame(f) => w.write_all(locations.get(tree, *f)?.get().as_bytes())?,
            }
        }
        w.write_all(b"]")
    }
}

/// Location strings as JSON, by frame, formatted once however many threads name the frame.
#[derive(Default)]
pub(super) struct Locations(Vec<Option<Box<RawValue>>>);

impl Locations {
    fn get(&mut self, tree: &SymbolizedStacks, f: FrameIndex) -> io::Result<&RawValue> {
        let i = f.0 as usize;
        if i >= self.0.len() {
            self.0.resize(tree.frames.len().max(i + 1), None);
        }
        if self.0[i].is_none() {
            let loc = tree.frame(f).map_or_else(String::new, |f| {
                location(&f.function, &f.module, f.file.as_deref(), f.line, f.column)
            });
            self.0[i] = Some(to_raw_value(&loc)?);
        }
        Ok(self.0[i].as_deref().expect("just set"))
    }
}

/// `"function (in module)"` with `" (file:line[:col])"` when the line is known. The front-end
/// parses the module with `\(in ([^)]*)\)`, so parentheses in it (e.g. "x.so (deleted)") would
/// make it a label frame with no function/library split; they become brackets.
pub(super) fn location(
    function: &str,
    module: &str,
    file: Option<&str>,
    line: Option<u32>,
    column: Option<u32>,
) -> String {
    let module: String = module
        .chars()
        .map(|c| match c {
            '(' => '[',
            ')' => ']',
            c => c,
        })
        .collect();
    let mut s = format!("{function} (in {module})");
    if let (Some(file), Some(line)) = (file, line) {
        s += &format!(" ({file}:{line}");
        if let Some(col) = column {
            s += &format!(":{col}");
        }
        s.push(')');
    }
    s
}
