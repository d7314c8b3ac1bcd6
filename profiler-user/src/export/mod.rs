//! Writing a profile from storage: capture a consistent snapshot (cheap, on the collecting
//! thread), then symbolize and write it (slow, on any thread) while collection goes on.

use std::path::{Path, PathBuf};

use anyhow::Result;
use serde_json::Value;

pub mod output;

use crate::{
    collect::collector::Collector,
    collect::modules::ModuleId,
    export::output::PendingOutput,
    model::stacks::ProcessesMeta,
    store::{ChunkedStore, FrameAddr, StoreSnapshot},
    symbolize::{ModuleSource, name_labels, symbolize},
    writers::gecko::assemble::{OpenInterval, ProfileStats, RecordingInfo, write_profile},
};

/// Everything a profile writer needs, detached from the live collector.
pub struct ExportJob {
    pub snapshot: StoreSnapshot,
    pub processes: ProcessesMeta,
    pub modules: Vec<ModuleSource>,
    pub info: RecordingInfo,
    pub marker_schema: Vec<Value>,
    /// Intervals begun but not ended yet (snapshots only: at the end they are closed).
    pub open: Vec<OpenInterval>,
}

impl ExportJob {
    /// Copies what the profile needs; the collector keeps running afterwards.
    pub fn capture(
        collector: &Collector<ChunkedStore>,
        info: RecordingInfo,
        marker_schema: Vec<Value>,
        open: Vec<OpenInterval>,
    ) -> Self {
        let mut job =
            Self::with_snapshot(collector, collector.store.snapshot(), info, marker_schema);
        job.open = open;
        job
    }

    /// For the final profile: moves the chunks out instead of copying them.
    pub fn finish(
        mut collector: Collector<ChunkedStore>,
        info: RecordingInfo,
        marker_schema: Vec<Value>,
    ) -> Self {
        let snapshot =
            std::mem::replace(&mut collector.store, ChunkedStore::new(0)).into_snapshot();
        Self::with_snapshot(&collector, snapshot, info, marker_schema)
    }

    fn with_snapshot(
        collector: &Collector<ChunkedStore>,
        snapshot: StoreSnapshot,
        info: RecordingInfo,
        marker_schema: Vec<Value>,
    ) -> Self {
        let modules = (0..collector.modules.len())
            .map(|i| {
                let m = collector.modules.get(ModuleId(i as u32));
                // open_path stays valid: the module table keeps its file open for the whole run.
                ModuleSource { name: m.name.clone(), open_path: m.open_path.clone() }
            })
            .collect();
        let processes = collector.processes.metadata();
        Self { snapshot, processes, modules, info, marker_schema, open: Vec::new() }
    }

    /// Symbolizes and writes the profile atomically to `output`.
    pub fn write(self, output: PendingOutput) -> Result<ProfileStats> {
        let (labels, addrs): (Vec<FrameAddr>, Vec<FrameAddr>) = (self.snapshot.unique_frames())
            .into_iter()
            .partition(|a| matches!(a, FrameAddr::Label { .. }));
        let mut symbols = symbolize(addrs, self.modules)?;
        name_labels(&mut symbols, &labels, &self.processes);
        output.commit(|w| {
            write_profile(
                &self.snapshot,
                &self.processes,
                &symbols,
                &self.info,
                self.marker_schema,
                &self.open,
                w,
            )
        })
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
