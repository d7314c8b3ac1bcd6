//! Writing a profile from storage: capture a consistent snapshot (cheap, on the collecting
//! thread), then symbolize it and hand every event to the writers (slow, on any thread) while
//! collection goes on. `output` writes a file atomically, or a stream in place.

pub mod output;

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

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
        codec::{MarkerField, StoredEvent, StoredMarker},
        snapshot::{StoreSnapshot, read_events},
    },
    symbolize::{
        KernelNamer, ModuleSource, SymbolizeErrors, Symbols, keep_unnamed_addresses,
        module_build_ids, module_sources, name_jit, name_labels, symbolize,
    },
    writers::{
        EventSink, Format, ProfileContext,
        stats::{ProfileStats, SummaryCounts},
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
    /// Names kernel addresses when no symbolizer service is given (the recording's namer).
    pub kernel: KernelNamer,
    /// Renders the session's report for the profile to carry, from what writing tallied.
    pub report: Option<ReportFn>,
}

/// The session's full report from what the profile holds and what symbolizing could not do.
pub type ReportFn = Box<dyn Fn(&ProfileStats, &SymbolizeErrors) -> String + Send>;

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
    /// Nothing was recorded. A Gecko profile then holds only a note on rsprof-bpf's own
    /// thread saying so (the Firefox Profiler refuses a profile without threads); the other
    /// formats have no samples.
    pub nothing_recorded: bool,
    pub symbolize_errors: SymbolizeErrors,
    /// Bytes written to the output (compressed, if it was).
    pub bytes: u64,
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

    /// A job over `snapshot` (an agent's window), with the collector's metadata.
    pub fn from_snapshot(
        collector: &Collector<ChunkedStore>,
        snapshot: StoreSnapshot,
        info: RecordingInfo,
    ) -> Self {
        Self::with_snapshot(collector, snapshot, info, Vec::new())
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
            kernel: KernelNamer::default(),
            report: None,
        }
    }

    /// Symbolizes and writes the profile in `format` atomically to `output`. `empty_note` says
    /// why, should nothing have been recorded.
    pub fn write(self, output: PendingOutput, format: Format, empty_note: &str) -> Result<Written> {
        self.write_with(output, format, empty_note, None)
    }

    /// `write`, naming frames as `write_to` does with a symbolizer.
    pub fn write_with(
        self,
        output: PendingOutput,
        format: Format,
        empty_note: &str,
        symbolizer: Option<&crate::symbolize::Service>,
    ) -> Result<Written> {
        let p = self.prepare(empty_note, symbolizer)?;
        let ((stats, nothing_recorded), bytes) = output.commit(|w| p.write(format, w))?;
        Ok(Written { stats, nothing_recorded, symbolize_errors: p.errors, bytes })
    }

    /// Like `write`, to `out` (a flight recorder dump, sent over the agent's socket). With the
    /// agent's `symbolizer`, only the frames of the samples in range are named, through its
    /// cache (a dump's stack table is the whole recording's).
    pub fn write_to(
        self,
        out: &mut dyn std::io::Write,
        format: Format,
        empty_note: &str,
        symbolizer: Option<&crate::symbolize::Service>,
    ) -> Result<Written> {
        let p = self.prepare(empty_note, symbolizer)?;
        let mut counted = output::Counted { inner: out, bytes: 0 };
        let (stats, nothing_recorded) = p.write(format, &mut counted)?;
        Ok(Written { stats, nothing_recorded, symbolize_errors: p.errors, bytes: counted.bytes })
    }

    fn prepare(
        mut self,
        empty_note: &str,
        symbolizer: Option<&crate::symbolize::Service>,
    ) -> Result<Prepared> {
        let frames = match symbolizer {
            Some(_) => self.used_frames(),
            None => self.snapshot.unique_frames(),
        };
        let (labels, addrs): (Vec<FrameAddr>, Vec<FrameAddr>) =
            frames.into_iter().partition(crate::symbolize::named_from_processes);
        let build_ids = module_build_ids(&self.modules);
        let modules = self.modules.clone();
        let (mut symbols, errors) = match symbolizer {
            Some(s) => s.symbolize(addrs, std::mem::take(&mut self.modules))?,
            None => symbolize(addrs, std::mem::take(&mut self.modules), self.kernel.clone())?,
        };
        keep_unnamed_addresses(&mut symbols, &modules);
        name_labels(&mut symbols, &labels, &self.processes);
        name_jit(&mut symbols, &labels, &self.processes);
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
        Ok(Prepared {
            snapshot: self.snapshot,
            processes: self.processes,
            symbols,
            build_ids,
            info: self.info,
            marker_schemas: self.marker_schemas,
            open: self.open,
            note: (ThreadKey::Task { pid: me, tid: Tid(me.0) }, note),
            errors,
            report: self.report,
        })
    }
}

/// A job symbolized for one profile.
struct Prepared {
    snapshot: StoreSnapshot,
    processes: ProcessesMeta,
    symbols: Symbols,
    /// Build-ids by module name, for writers whose mappings carry them.
    build_ids: HashMap<String, String>,
    info: RecordingInfo,
    marker_schemas: Vec<MarkerSchema>,
    open: Vec<(ThreadKey, Marker)>,
    note: (ThreadKey, Marker),
    errors: SymbolizeErrors,
    report: Option<ReportFn>,
}

impl Prepared {
    fn write(
        &self,
        format: Format,
        out: &mut dyn std::io::Write,
    ) -> std::io::Result<(ProfileStats, bool)> {
        let report = self.report.as_ref().map(|f| |stats: &ProfileStats| f(stats, &self.errors));
        write_profile(
            format,
            &self.snapshot,
            &self.processes,
            (&self.symbols, &self.build_ids),
            &self.info,
            &self.marker_schemas,
            &self.open,
            (self.note.0, &self.note.1),
            report.as_ref().map(|f| f as &dyn Fn(&ProfileStats) -> String),
            out,
        )
    }
}

/// A job symbolized for writers other than one file (an agent's per-process profiles).
pub struct Symbolized {
    pub snapshot: StoreSnapshot,
    pub processes: ProcessesMeta,
    pub symbols: Symbols,
    /// Build-ids by module name (see `module_build_ids`).
    pub build_ids: HashMap<String, String>,
    pub info: RecordingInfo,
    pub errors: SymbolizeErrors,
}

impl ExportJob {
    /// Symbolizes only the frames of the stacks that the snapshot's samples use (a window's
    /// snapshot shares its stack table with the whole recording).
    /// The distinct frames of the stacks the snapshot's samples use.
    fn used_frames(&self) -> Vec<FrameAddr> {
        let mut used = std::collections::HashSet::new();
        read_events(
            &self.snapshot,
            |ev| {
                if let StoredEvent::Sample(_, s) = ev {
                    let mut cur = s.stack;
                    while let Some(id) = cur.filter(|id| used.insert(*id)) {
                        cur = self.snapshot.stack(id).and_then(|n| n.0);
                    }
                }
            },
            |_| {},
        );
        let mut frames: Vec<FrameAddr> =
            used.iter().filter_map(|&id| self.snapshot.stack(id)).map(|n| n.1).collect();
        frames.sort_unstable();
        frames.dedup();
        frames
    }

    pub fn symbolize_used(self, service: Option<&crate::symbolize::Service>) -> Result<Symbolized> {
        let frames = self.used_frames();
        let (labels, addrs): (Vec<FrameAddr>, Vec<FrameAddr>) =
            frames.into_iter().partition(crate::symbolize::named_from_processes);
        let build_ids = module_build_ids(&self.modules);
        let modules = self.modules.clone();
        let (mut symbols, errors) = match service {
            Some(s) => s.symbolize(addrs, self.modules)?,
            None => symbolize(addrs, self.modules, self.kernel.clone())?,
        };
        keep_unnamed_addresses(&mut symbols, &modules);
        name_labels(&mut symbols, &labels, &self.processes);
        name_jit(&mut symbols, &labels, &self.processes);
        Ok(Symbolized {
            snapshot: self.snapshot,
            processes: self.processes,
            symbols,
            build_ids,
            info: self.info,
            errors,
        })
    }
}

impl Symbolized {
    pub fn stacks(&self) -> SymbolizedStacks {
        let mut stacks = SymbolizedStacks::new(&self.snapshot.stacks, &self.symbols);
        stacks.module_build_ids.clone_from(&self.build_ids);
        stacks
    }

    /// Hands every event to `sinks`; returns what could not be read.
    pub fn replay(&self, sinks: &mut [&mut dyn EventSink]) -> Vec<String> {
        replay(&self.snapshot, &[], sinks)
    }
}

/// Writes a symbolized snapshot as a `format` profile to `out` in one pass over storage;
/// returns what the summary needs, and whether nothing was recorded: then the writer gets only
/// `empty_note`. `report` renders the session's report from what the profile holds, for the
/// writer to carry (`ProfileContext::report`).
#[allow(clippy::too_many_arguments)]
pub fn write_profile(
    format: Format,
    snapshot: &StoreSnapshot,
    processes: &ProcessesMeta,
    (symbols, build_ids): (&Symbols, &HashMap<String, String>),
    info: &RecordingInfo,
    marker_schemas: &[MarkerSchema],
    open: &[(ThreadKey, Marker)],
    empty_note: (ThreadKey, &Marker),
    report: Option<&dyn Fn(&ProfileStats) -> String>,
    out: &mut dyn std::io::Write,
) -> std::io::Result<(ProfileStats, bool)> {
    let mut stacks = SymbolizedStacks::new(&snapshot.stacks, symbols);
    stacks.module_build_ids.clone_from(build_ids);
    let ctx = ProfileContext {
        info,
        stacks: &stacks,
        processes,
        marker_schemas,
        recycled: snapshot.recycled_range(),
        buffer_bytes: snapshot.buffer_bytes,
        report: Default::default(),
    };
    let mut summary = SummaryCounts::new(&stacks);
    let mut writer = format.writer(&ctx);
    let corrupt = replay(snapshot, open, &mut [&mut summary, &mut *writer]);
    let empty = writer.is_empty();
    if empty {
        writer.marker(empty_note.0, empty_note.1);
    }
    let stats = summary.finish(&ctx, &corrupt);
    if let Some(report) = report {
        let _ = ctx.report.set(report(&stats));
    }
    writer.write(&corrupt, out)?;
    Ok((stats, empty))
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
            StoredEvent::Sample(key, s) => {
                let s = Sample {
                    time: MonoNs(s.time_ns),
                    cpu_delta_ns: s.cpu_delta_ns,
                    stack: s.stack,
                    off_cpu: s.off_cpu,
                };
                sinks.iter_mut().for_each(|w| w.sample(key, &s));
            }
            StoredEvent::Marker(key, m) => {
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

/// Where snapshot `n` of a recording to `output` goes: beside a file output; in the working
/// directory, as `rsprof.snapshot-N.EXT`, when the output is a stream (`-`, a pipe, a device:
/// `output` as resolved at the start), which has no directory of its own to put one in.
pub fn snapshot_dest(
    output: &Path,
    resolved: &output::Destination,
    n: u32,
    format: Format,
    compress: bool,
) -> PathBuf {
    if !resolved.is_stream() {
        return snapshot_path(output, n);
    }
    let gz = if compress { ".gz" } else { "" };
    snapshot_path(Path::new(&format!("rsprof{}{gz}", format.extension())), n)
}

/// `profile.json.gz` → `profile.snapshot-3.json.gz`, `p.pb.gz` → `p.snapshot-3.pb.gz` (the
/// suffixes of [`Format::from_path`], so a snapshot's name implies the same format);
/// otherwise appended.
pub fn snapshot_path(output: &Path, n: u32) -> PathBuf {
    let name = output.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let new = match Format::from_path(output) {
        Some((_, ext)) => format!("{}.snapshot-{n}{ext}", &name[..name.len() - ext.len()]),
        None => format!("{name}.snapshot-{n}"),
    };
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
        assert_eq!(snapshot_path(Path::new("/t/x.pb.gz"), 1), Path::new("/t/x.snapshot-1.pb.gz"));
        assert_eq!(snapshot_path(Path::new("x.pprof"), 4), Path::new("x.snapshot-4.pprof"));
        assert_eq!(snapshot_path(Path::new("x.folded"), 1), Path::new("x.snapshot-1.folded"));
        assert_eq!(snapshot_path(Path::new("x.gz"), 1), Path::new("x.gz.snapshot-1"));
        let dest = |p: &str| {
            (Path::new(p).to_owned(), output::Destination::resolve(Path::new(p)).unwrap())
        };
        let (p, d) = dest("/dev/null");
        let fifo = snapshot_dest(&p, &d, 3, Format::Pprof, true);
        assert_eq!(fifo, Path::new("rsprof.snapshot-3.pb.gz"));
        let (p, d) = dest("-");
        let stdout = snapshot_dest(&p, &d, 1, Format::Gecko, false);
        assert_eq!(stdout, Path::new("rsprof.snapshot-1.json"));
        let (p, d) = dest("/tmp/x.pb");
        let file = snapshot_dest(&p, &d, 1, Format::Pprof, false);
        assert_eq!(file, Path::new("/tmp/x.snapshot-1.pb"));
        for f in ["a.json.gz", "a.pb.gz", "a.pb", "a.pprof.gz", "a.collapsed", "a.folded.gz"] {
            let snap = snapshot_path(Path::new(f), 2);
            assert_eq!(
                Format::from_path(&snap).map(|x| x.0),
                Format::from_path(Path::new(f)).map(|x| x.0)
            );
        }
    }
}
