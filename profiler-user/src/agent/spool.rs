//! The spool: a directory of windows, each a gzipped pprof profile `STEM.pb.gz` and its labels
//! in `STEM.json`. Both files are written atomically (`export::output`), the profile first:
//! a window exists once its labels file does, so an agent killed between the two leaves a
//! profile without labels, which the next start deletes (and counts). Bounded by a size: the
//! oldest windows (stems sort by time) are deleted first, and counted. Files are 0600, the
//! directory 0700: profiles show what every process on the host runs.

use std::{
    collections::VecDeque,
    fs,
    os::unix::fs::{DirBuilderExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};
use serde::{Deserialize, Serialize};

use crate::{
    agent::{labels::WindowLabels, windows::WindowProfile},
    export::output::PendingOutput,
};

const PROFILE_EXT: &str = ".pb.gz";
const LABELS_EXT: &str = ".json";

/// A window's labels file.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WindowMeta {
    /// Unique per host: `START_MS-PID-HASH`, also the file stem.
    pub window_id: String,
    pub start_ms: u64,
    pub end_ms: u64,
    pub samples: u64,
    #[serde(flatten)]
    pub labels: WindowLabels,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct SpoolStats {
    pub written: u64,
    pub bytes_written: u64,
    /// Windows deleted to stay within the size limit.
    pub deleted_for_size: u64,
    /// Profiles without labels (an agent killed while writing), deleted at start.
    pub incomplete_removed: u64,
}

pub struct Spool {
    dir: PathBuf,
    limit: u64,
    /// (stem, bytes of both files), oldest first.
    entries: VecDeque<(String, u64)>,
    total: u64,
    pub stats: SpoolStats,
}

impl Spool {
    /// Opens (creating) the spool and finds the windows earlier runs left.
    pub fn open(dir: &Path, limit: u64) -> Result<Self> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("create spool {}", dir.display()))?;
        let mut spool = Self {
            dir: dir.to_owned(),
            limit,
            entries: VecDeque::new(),
            total: 0,
            stats: Default::default(),
        };
        let mut stems = Vec::new();
        for e in fs::read_dir(dir).with_context(|| format!("read spool {}", dir.display()))? {
            let name = e?.file_name().to_string_lossy().into_owned();
            if let Some(stem) = name.strip_suffix(PROFILE_EXT) {
                if dir.join(format!("{stem}{LABELS_EXT}")).is_file() {
                    stems.push(stem.to_owned());
                } else {
                    let _ = fs::remove_file(dir.join(&name));
                    spool.stats.incomplete_removed += 1;
                }
            } else if name.starts_with('.') && name.ends_with(".tmp") {
                // A named temp file (filesystems without O_TMPFILE) of a killed run.
                let _ = fs::remove_file(dir.join(&name));
            }
        }
        stems.sort();
        for stem in stems {
            let bytes = spool.bytes_of(&stem);
            spool.total += bytes;
            spool.entries.push_back((stem, bytes));
        }
        Ok(spool)
    }

    /// Windows and bytes held.
    pub fn held(&self) -> (usize, u64) {
        (self.entries.len(), self.total)
    }

    fn bytes_of(&self, stem: &str) -> u64 {
        [PROFILE_EXT, LABELS_EXT]
            .iter()
            .filter_map(|ext| fs::metadata(self.dir.join(format!("{stem}{ext}"))).ok())
            .map(|m| m.len())
            .sum()
    }

    /// Writes a window, then deletes the oldest ones beyond the size limit.
    pub fn write(&mut self, w: &WindowProfile) -> Result<()> {
        let meta = WindowMeta {
            window_id: window_id(w),
            start_ms: w.start_ms,
            end_ms: w.end_ms,
            samples: w.samples,
            labels: w.labels.clone(),
        };
        let stem = &meta.window_id;
        let profile = self.dir.join(format!("{stem}{PROFILE_EXT}"));
        PendingOutput::create_with_mode(&profile, 0o600)?
            .commit(|out: &mut dyn std::io::Write| out.write_all(&w.pprof))?;
        let labels = self.dir.join(format!("{stem}{LABELS_EXT}"));
        let json = serde_json::to_vec(&meta)?;
        PendingOutput::create_with_mode(&labels, 0o600)?
            .commit(|out: &mut dyn std::io::Write| out.write_all(&json))?;
        let bytes = self.bytes_of(stem);
        self.stats.written += 1;
        self.stats.bytes_written += bytes;
        self.total += bytes;
        self.entries.push_back((stem.clone(), bytes));
        while self.total > self.limit {
            let Some((old, b)) = self.entries.pop_front() else { break };
            // Labels first: a window without them is never read, and its profile is removed
            // at the next start should this stop halfway.
            let _ = fs::remove_file(self.dir.join(format!("{old}{LABELS_EXT}")));
            let _ = fs::remove_file(self.dir.join(format!("{old}{PROFILE_EXT}")));
            self.total -= b;
            self.stats.deleted_for_size += 1;
        }
        Ok(())
    }
}

/// `START_MS-PID-HASH`: the start time first (zero-padded) so names sort by time; the hash of
/// the labels tells apart two processes that had the same pid in one window.
fn window_id(w: &WindowProfile) -> String {
    let json = serde_json::to_vec(&w.labels).unwrap_or_default();
    format!("{:013}-{}-{:08x}", w.start_ms, w.labels.pid, crc32fast::hash(&json))
}

/// Every complete window in `dir`, oldest first, with the path of its profile.
pub fn read_windows(dir: &Path) -> Result<Vec<(WindowMeta, PathBuf)>> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).with_context(|| format!("read spool {}", dir.display()))? {
        let path = e?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(LABELS_EXT) else { continue };
        if name.starts_with('.') {
            continue;
        }
        let text = fs::read(&path).with_context(|| format!("read {}", path.display()))?;
        let meta: WindowMeta = serde_json::from_slice(&text)
            .with_context(|| format!("bad window labels {}", path.display()))?;
        out.push((meta, dir.join(format!("{stem}{PROFILE_EXT}"))));
    }
    out.sort_by(|a, b| a.0.window_id.cmp(&b.0.window_id));
    Ok(out)
}

/// Whether the spool's files are private (for tests and a start-up check).
pub fn mode_of(path: &Path) -> Option<u32> {
    fs::metadata(path).ok().map(|m| m.permissions().mode() & 0o777)
}
