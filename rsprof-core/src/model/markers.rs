//! Markers and their schemas, independent of any file format.
//!
//! A marker names its schema; the schema lists the marker's fields in order (stored marker
//! fields are positional). Label templates use `{name}` for the marker's name and `{KEY}` for
//! a field's value; writers translate them into their own syntax.

use super::time::MonoNs;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MarkerPhase {
    /// A point in time (`start`).
    Instant,
    /// `start` to `end`.
    Interval,
    /// Began at `start`, end not seen (never ended, or not yet).
    IntervalStart,
    /// Ended at `end`, beginning not seen.
    IntervalEnd,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MarkerValue {
    Str(String),
    Int(i64),
    Uint(u64),
}

/// A marker on a thread, as writers see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Marker {
    pub name: String,
    /// The [`MarkerSchema::name`] describing `fields`.
    pub schema: String,
    pub phase: MarkerPhase,
    /// Instant and IntervalStart markers have `end == start`, IntervalEnd ones `start == end`.
    pub start: MonoNs,
    pub end: MonoNs,
    /// In schema order; None leaves the field out.
    pub fields: Vec<Option<MarkerValue>>,
}

/// Where a kind of marker comes from; writers may group or colour by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MarkerSource {
    /// Fired by a USDT probe in the profiled program.
    Usdt,
    /// Said by the profiler about the host (e.g. a process's container).
    Host,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MarkerView {
    /// A timeline of markers per thread.
    Chart,
    /// A table of markers.
    Table,
    /// The thread's track in the overview timeline.
    Timeline,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldFormat {
    String,
    Integer,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchemaField {
    pub key: String,
    pub label: String,
    pub format: FieldFormat,
    /// Found by the marker search box.
    pub searchable: bool,
}

impl SchemaField {
    pub fn new(key: &str, label: &str, format: FieldFormat) -> Self {
        Self { key: key.to_owned(), label: label.to_owned(), format, searchable: false }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MarkerSchema {
    pub name: String,
    pub source: MarkerSource,
    pub views: Vec<MarkerView>,
    pub chart_label: Option<String>,
    pub table_label: Option<String>,
    pub tooltip_label: Option<String>,
    pub description: Option<String>,
    /// The fields markers of this schema carry, in stored order.
    pub fields: Vec<SchemaField>,
    /// Fixed (label, text) pairs shown with every marker of this schema.
    pub notes: Vec<(String, String)>,
    /// Integer fields drawn as a line graph over time (one track per marker name).
    pub graphs: Vec<String>,
}

impl MarkerSchema {
    pub fn new(name: &str, source: MarkerSource, views: &[MarkerView]) -> Self {
        Self {
            name: name.to_owned(),
            source,
            views: views.to_vec(),
            chart_label: None,
            table_label: None,
            tooltip_label: None,
            description: None,
            fields: Vec::new(),
            notes: Vec::new(),
            graphs: Vec::new(),
        }
    }

    /// Field keys in stored order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.fields.iter().map(|f| f.key.as_str())
    }
}
