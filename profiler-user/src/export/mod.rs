//! Writing a profile from storage: capture a consistent snapshot (cheap, on the collecting
//! thread), then symbolize it and hand every event to the writers (slow, on any thread) while
//! collection goes on. `output` writes the file atomically.

pub mod output;

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::{
    collect::collector::Collector,
    model::{
        Sample,
        address::FrameAddr,
        ids::{Pid, ThreadKey, Tid},
        markers::{Marker, MarkerPhase, MarkerSchema, MarkerValue},
        process::{ProcessMeta, ProcessesMeta},
        recording::RecordingInfo,
        stacks::SymbolizedStacks,
        time::MonoNs,
    },
    store::{
        ChunkedStore,
        codec::{Event, MarkerField, StoredMarker},
        snapshot::{StoreSnapshot, read_events},
    },
    symbolize::{ModuleSource, SymbolizeErrors, Symbols, module_sources, name_labels, symbolize},
    writers::{
        EventSink, ProfileContext, ProfileWriter,
        gecko::GeckoWriter,
        summary::{ProfileStats, SummaryCounts},
    },
};
use output::PendingOutput;

/// Everything a profile writer needs, detached from the live collector.
pub struct ExportJob {
    pub snapshot: StoreSnapshot,
    pub processes: ProcessesMeta,
    pub modules: Vec<ModuleSource>,
    pub info: RecordingInfo,
    pub marker_schemas: Vec<MarkerSchema>,
    /// Intervals begun but not ended yet (snapshots only: at the end they are closed).
    pub open: Vec<(ThreadKey, Marker)>,
    /// The final profile's module table, kept until symbolizing is done: `modules` may name
    /// files by the handles it holds (`/proc/self/fd/N`), e.g. a deleted executable.
    pub held_files: Option<crate::collect::modules::ModuleTable>,
}

/// Schema of the note a profile with nothing recorded carries instead.
pub const NOTE_SCHEMA: &str = "RsprofNote";

fn note_schema() -> MarkerSchema {
    use crate::model::markers::{FieldFormat, MarkerSource, MarkerView, SchemaField};
    let views = [MarkerView::Chart, MarkerView::Table];
    let mut s = MarkerSchema::new(NOTE_SCHEMA, MarkerSource::Host, &views);
    s.chart_label = Some("{text}".into());
    s.table_label = Some("{text}".into());
    s.tooltip_label = Some("{text}".into());
    s.fields = vec![SchemaField::new("text", "Text", FieldFormat::String)];
    s
}

/// What writing a profile did.
pub struct Written {
    pub stats: ProfileStats,
    /// Nothing was recorded: the profile holds only a note on rsprof-bpf's own thread saying
    /// so (the Firefox Profiler refuses a profile without threads).
    pub nothing_recorded: bool,
    pub symbolize_errors: SymbolizeErrors,
}

impl ExportJob {
    /// Copies what the profile needs; the collector keeps running afterwards.
    pub fn capture(
        collector: &Collector<ChunkedStore>,
        info: RecordingInfo,
        marker_schemas: Vec<MarkerSchema>,
        open: Vec<(ThreadKey, Marker)>,
    ) -> Self {
        let mut job =
            Self::with_snapshot(collector, collector.store.snapshot(), info, marker_schemas);
        job.open = open;
        job
    }

    /// For the final profile: moves the chunks out instead of copying them.
    pub fn finish(
        mut collector: Collector<ChunkedStore>,
        info: RecordingInfo,
        marker_schemas: Vec<MarkerSchema>,
    ) -> Self {
        let snapshot =
            std::mem::replace(&mut collector.store, ChunkedStore::new(0)).into_snapshot();
        let mut job = Self::with_snapshot(&collector, snapshot, info, marker_schemas);
        job.held_files = Some(std::mem::take(&mut collector.modules));
        job
    }

    fn with_snapshot(
        collector: &Collector<ChunkedStore>,
        snapshot: StoreSnapshot,
        info: RecordingInfo,
        marker_schemas: Vec<MarkerSchema>,
    ) -> Self {
        Self {
            snapshot,
            processes: collector.processes.metadata(),
            modules: module_sources(&collector.modules),
            info,
            marker_schemas,
            open: Vec::new(),
            held_files: None,
        }
    }

    /// Symbolizes and writes the profile atomically to `output`. `empty_note` says why, should
    /// nothing have been recorded.
    pub fn write(mut self, output: PendingOutput, empty_note: &str) -> Result<Written> {
        let (labels, addrs): (Vec<FrameAddr>, Vec<FrameAddr>) = (self.snapshot.unique_frames())
            .into_iter()
            .partition(|a| matches!(a, FrameAddr::Label { .. }));
        let (mut symbols, symbolize_errors) = symbolize(addrs, self.modules)?;
        name_labels(&mut symbols, &labels, &self.processes);
        let me = Pid(std::process::id());
        self.processes
            .entry(me)
            .or_insert_with(|| ProcessMeta { name: "rsprof-bpf".into(), ..Default::default() });
        self.marker_schemas.push(note_schema());
        let note = Marker {
            name: "Nothing recorded".into(),
            schema: NOTE_SCHEMA.into(),
            phase: MarkerPhase::Instant,
            start: self.info.end,
            end: self.info.end,
            fields: vec![Some(MarkerValue::Str(empty_note.to_owned()))],
        };
        let (stats, nothing_recorded) = output.commit(|w| {
            write_gecko(
                &self.snapshot,
                &self.processes,
                &symbols,
                &self.info,
                &self.marker_schemas,
                &self.open,
                (ThreadKey::Task { pid: me, tid: Tid(me.0) }, &note),
                w,
            )
        })?;
        Ok(Written { stats, nothing_recorded, symbolize_errors })
    }
}

/// Writes a symbolized snapshot as a Gecko profile to `out`; returns what the summary needs,
/// and whether nothing was recorded: then the profile holds only `empty_note`.
#[allow(clippy::too_many_arguments)]
pub fn write_gecko(
    snapshot: &StoreSnapshot,
    processes: &ProcessesMeta,
    symbols: &Symbols,
    info: &RecordingInfo,
    marker_schemas: &[MarkerSchema],
    open: &[(ThreadKey, Marker)],
    empty_note: (ThreadKey, &Marker),
    out: &mut dyn std::io::Write,
) -> std::io::Result<(ProfileStats, bool)> {
    let stacks = SymbolizedStacks::new(&snapshot.stacks, symbols);
    let ctx = ProfileContext {
        info,
        stacks: &stacks,
        processes,
        marker_schemas,
        recycled: snapshot.recycled_range(),
        buffer_bytes: snapshot.buffer_bytes,
    };
    let mut summary = SummaryCounts::new(&stacks);
    let mut gecko: Box<dyn ProfileWriter> = Box::new(GeckoWriter::new(&ctx));
    let corrupt = replay(snapshot, open, &mut [&mut summary, &mut *gecko]);
    let empty = gecko.is_empty();
    if empty {
        gecko.marker(empty_note.0, empty_note.1);
    }
    gecko.write(&corrupt, out)?;
    Ok((summary.finish(&ctx, &corrupt), empty))
}

/// Hands every stored event, then the still-open intervals, to each sink; returns what
/// could not be read.
fn replay(
    snap: &StoreSnapshot,
    open: &[(ThreadKey, Marker)],
    sinks: &mut [&mut dyn EventSink],
) -> Vec<String> {
    let mut corrupt = Vec::new();
    read_events(
        snap,
        |ev| match ev {
            Event::Sample(key, s) => {
                let s = Sample {
                    time: MonoNs(s.time_ns),
                    cpu_delta_ns: s.cpu_delta_ns,
                    stack: s.stack,
                };
                sinks.iter_mut().for_each(|w| w.sample(key, &s));
            }
            Event::Marker(key, m) => {
                let m = resolve_marker(snap, &m);
                sinks.iter_mut().for_each(|w| w.marker(key, &m));
            }
        },
        |err| corrupt.push(err),
    );
    for (key, m) in open {
        sinks.iter_mut().for_each(|w| w.marker(*key, m));
    }
    corrupt
}

/// A stored marker with its strings looked up.
fn resolve_marker(snap: &StoreSnapshot, m: &StoredMarker) -> Marker {
    let string = |id| snap.string(id).unwrap_or("<unknown>").to_owned();
    let fields = m
        .fields
        .iter()
        .map(|f| match *f {
            MarkerField::Str(s) => Some(MarkerValue::Str(string(s))),
            MarkerField::Int(v) => Some(MarkerValue::Int(v)),
            MarkerField::Uint(v) => Some(MarkerValue::Uint(v)),
            MarkerField::Absent => None,
        })
        .collect();
    Marker {
        name: string(m.name),
        schema: string(m.schema),
        phase: m.phase,
        start: MonoNs(m.start_ns),
        end: MonoNs(m.end_ns),
        fields,
    }
}

/// `profile.json.gz` → `profile.snapshot-3.json.gz` (also for `.json`; otherwise appended).
pub fn snapshot_path(output: &Path, n: u32) -> PathBuf {
    let name = output.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let new = [".json.gz", ".json"]
        .iter()
        .find_map(|ext| name.strip_suffix(ext).map(|stem| format!("{stem}.snapshot-{n}{ext}")))
        .unwrap_or_else(|| format!("{name}.snapshot-{n}"));
    output.with_file_name(new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_names() {
        assert_eq!(snapshot_path(Path::new("a/p.json.gz"), 2), Path::new("a/p.snapshot-2.json.gz"));
        assert_eq!(snapshot_path(Path::new("p.json"), 1), Path::new("p.snapshot-1.json"));
        assert_eq!(snapshot_path(Path::new("out"), 1), Path::new("out.snapshot-1"));
    }
}
