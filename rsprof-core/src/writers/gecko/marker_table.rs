//! A thread's `markers` table, its rows serialized as they arrive (payloads are built by
//! `markers`).

use std::io::{self, Write};

use serde_json::Value;

/// Column order; rows follow it.
pub(super) const SCHEMA: &[&str] = &["name", "startTime", "endTime", "phase", "category", "data"];

#[derive(Default)]
pub(super) struct MarkerTable {
    /// The rows as JSON, comma-separated.
    json: Vec<u8>,
    count: u64,
}

impl MarkerTable {
    /// Appends a row; `name` is its string index, `data` its payload (with `type` naming its
    /// schema).
    pub(super) fn push(
        &mut self,
        name: u32,
        start_ms: Option<f64>,
        end_ms: Option<f64>,
        phase: u8,
        category: u32,
        data: &Value,
    ) {
        if self.count > 0 {
            self.json.push(b',');
        }
        // A tuple is written as the row's array, without cloning `data` into a new tree.
        let row = (name, start_ms, end_ms, phase, category, data);
        let _ = serde_json::to_writer(&mut self.json, &row);
        self.count += 1;
    }

    pub(super) fn write<W: Write>(&self, w: &mut W) -> io::Result<()> {
        w.write_all(b"[")?;
        w.write_all(&self.json)?;
        w.write_all(b"]")
    }
}
