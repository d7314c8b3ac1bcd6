//! The spool: a directory of windows, each a gzipped pprof profile `STEM.pb.gz` and its labels
//! in `STEM.json`. Both files are written atomically (`export::output`), the profile first:
//! a window exists once its labels file does, so an agent killed between the two leaves a
//! profile without labels, which the next start deletes (and counts). Bounded by a size: the
//! oldest windows (stems sort by time) are deleted first, and counted. Files are 0600, the
//! directory 0700: profiles show what every process on the host runs.
//!
//! With remote sinks the spool is also their queue (`sinks::forward`): a window delivered to
//! (or rejected by) sink NAME gets an empty marker `STEM.sent-NAME`, created after the server
//! answered, so a restarted agent resends only what was not acknowledged. Without `--spool`
//! (queue mode) a window is deleted once every sink is done with it. A window deleted for
//! size before a sink had it is counted as dropped for that sink.

use std::{
    collections::VecDeque,
    fs,
    os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use serde::{Deserialize, Serialize};

use crate::{
    agent::{labels::WindowLabels, windows::WindowProfile},
    export::output::PendingOutput,
};

const PROFILE_EXT: &str = ".pb.gz";
const LABELS_EXT: &str = ".json";
const SENT_EXT: &str = ".sent-";

/// A window's labels file.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WindowMeta {
    /// Unique per host: `START_MS-PID-HASH`, also the file stem (PID 0 in a per-service
    /// window).
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

struct Entry {
    stem: String,
    /// Bytes of both files.
    bytes: u64,
    /// Bit i: sink i is done with it (delivered or rejected).
    done: u64,
}

/// A remote sink's view of the spool.
struct SinkSlot {
    name: &'static str,
    /// The windows its forwarder is delivering: deleting one for size is counted by the
    /// forwarder (as delivered, or dropped if the delivery fails).
    inflight: Vec<String>,
    /// Windows deleted for size before this sink had them.
    dropped: u64,
}

pub struct Spool {
    dir: PathBuf,
    limit: u64,
    /// Oldest first.
    entries: VecDeque<Entry>,
    total: u64,
    sinks: Vec<SinkSlot>,
    /// Keep delivered windows (`--spool` given) rather than use the spool as a queue only.
    keep: bool,
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
            sinks: Vec::new(),
            keep: true,
            stats: Default::default(),
        };
        let mut stems = Vec::new();
        for e in fs::read_dir(dir).with_context(|| format!("read spool {}", dir.display()))? {
            let name = e?.file_name().to_string_lossy().into_owned();
            if let Some(stem) = name.strip_suffix(PROFILE_EXT) {
                if dir.join(format!("{stem}{LABELS_EXT}")).is_file() {
                    stems.push(stem.to_owned());
                } else {
                    remove_regular(&dir.join(&name));
                    spool.stats.incomplete_removed += 1;
                }
            } else if name.starts_with('.') && name.ends_with(".tmp") {
                // A named temp file (filesystems without O_TMPFILE) of a killed run.
                remove_regular(&dir.join(&name));
            }
        }
        stems.sort();
        for stem in stems {
            let bytes = spool.bytes_of(&stem);
            spool.total += bytes;
            spool.entries.push_back(Entry { stem, bytes, done: 0 });
        }
        Ok(spool)
    }

    /// Makes the spool the queue of remote sinks `names` (at most 64): reads their delivery
    /// markers, and when `keep` is false deletes the windows all of them are done with.
    pub fn attach_sinks(&mut self, names: &[&'static str], keep: bool) -> Result<()> {
        anyhow::ensure!(names.len() <= 64, "at most 64 remote sinks");
        self.sinks =
            names.iter().map(|&name| SinkSlot { name, inflight: Vec::new(), dropped: 0 }).collect();
        self.keep = keep;
        let index: std::collections::HashMap<&str, usize> =
            self.entries.iter().enumerate().map(|(i, e)| (e.stem.as_str(), i)).collect();
        let mut marks = Vec::new();
        let mut orphans = Vec::new();
        for e in fs::read_dir(&self.dir)? {
            let name = e?.file_name().to_string_lossy().into_owned();
            let Some((stem, sink)) = name.split_once(SENT_EXT) else { continue };
            match (index.get(stem), names.iter().position(|n| *n == sink)) {
                (Some(&i), Some(s)) => marks.push((i, s)),
                // A marker of a deleted window (killed while deleting it).
                (None, _) => orphans.push(name),
                // A sink no longer configured: its marker goes with its window.
                (Some(_), None) => {}
            }
        }
        for (i, s) in marks {
            self.entries[i].done |= 1 << s;
        }
        for name in orphans {
            remove_regular(&self.dir.join(name));
        }
        if !keep {
            let all = self.all_done_mask();
            let done: Vec<String> = (self.entries.iter())
                .filter(|e| e.done & all == all)
                .map(|e| e.stem.clone())
                .collect();
            for stem in done {
                self.remove(&stem);
            }
        }
        Ok(())
    }

    fn all_done_mask(&self) -> u64 {
        if self.sinks.len() >= 64 { u64::MAX } else { (1u64 << self.sinks.len()) - 1 }
    }

    /// The oldest windows (at most `max`) sink `sink` is not done with, now in flight.
    pub fn pending(&mut self, sink: usize, max: usize) -> Vec<String> {
        let stems: Vec<String> = (self.entries.iter())
            .filter(|e| e.done & (1 << sink) == 0)
            .take(max)
            .map(|e| e.stem.clone())
            .collect();
        self.sinks[sink].inflight.clone_from(&stems);
        stems
    }

    /// Whether window `stem` is still spooled.
    pub fn contains(&self, stem: &str) -> bool {
        self.entries.iter().any(|e| e.stem == stem)
    }

    /// The paths of window `stem`'s labels and profile.
    pub fn paths(&self, stem: &str) -> (PathBuf, PathBuf) {
        (
            self.dir.join(format!("{stem}{LABELS_EXT}")),
            self.dir.join(format!("{stem}{PROFILE_EXT}")),
        )
    }

    /// Sink `sink` is done with an in-flight window `stem`: `delivered` (or rejected: not to
    /// be sent again), else dropped (unreadable, or deleted for size while being retried) and
    /// counted. A done window is marked, or deleted in queue mode once every sink is done.
    pub fn finish(&mut self, sink: usize, stem: &str, delivered: bool) -> Result<()> {
        let marked = self.finish_one(sink, stem, delivered);
        self.sync_dir();
        marked
    }

    /// `finish(sink, stem, true)` for each of `stems` (a delivered batch), with one directory
    /// sync for all their markers rather than one each; the first error, after trying all.
    pub fn finish_delivered(&mut self, sink: usize, stems: &[String]) -> Result<()> {
        let mut first = Ok(());
        for stem in stems {
            let r = self.finish_one(sink, stem, true);
            if first.is_ok() {
                first = r;
            }
        }
        self.sync_dir();
        first
    }

    /// The markers must survive a crash, or their windows are sent again.
    fn sync_dir(&self) {
        fs::File::open(&self.dir).and_then(|d| d.sync_all()).ok();
    }

    /// `finish` without the directory sync.
    fn finish_one(&mut self, sink: usize, stem: &str, delivered: bool) -> Result<()> {
        self.sinks[sink].inflight.retain(|s| s != stem);
        if !delivered {
            self.sinks[sink].dropped += 1;
        }
        let Some(i) = self.entries.iter().position(|e| e.stem == stem) else { return Ok(()) };
        self.entries[i].done |= 1 << sink;
        let all = self.all_done_mask();
        if !self.keep && self.entries[i].done & all == all {
            self.remove(stem);
            return Ok(());
        }
        let marker = self.dir.join(format!("{stem}{SENT_EXT}{}", self.sinks[sink].name));
        // An empty file; never through a symlink, nor blocking on a FIFO planted by that name.
        let file = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .mode(0o600)
            .open(&marker)
            .with_context(|| format!("create {}", marker.display()))?;
        if !file.metadata()?.is_file() {
            bail!("{} exists and is not a regular file", marker.display());
        }
        Ok(())
    }

    /// Windows spooled that sink `sink` is not done with.
    pub fn backlog(&self, sink: usize) -> usize {
        self.entries.iter().filter(|e| e.done & (1 << sink) == 0).count()
    }

    /// Windows deleted for size before sink `sink` had them.
    pub fn dropped(&self, sink: usize) -> u64 {
        self.sinks.get(sink).map_or(0, |s| s.dropped)
    }

    /// Deletes window `stem` (labels first: a window without them is never read, and its
    /// profile is removed at the next start should this stop halfway), then its markers.
    fn remove(&mut self, stem: &str) {
        let Some(i) = self.entries.iter().position(|e| e.stem == stem) else { return };
        let e = self.entries.remove(i).expect("index found");
        remove_regular(&self.dir.join(format!("{stem}{LABELS_EXT}")));
        remove_regular(&self.dir.join(format!("{stem}{PROFILE_EXT}")));
        for (i, s) in self.sinks.iter().enumerate() {
            if e.done & (1 << i) != 0 {
                remove_regular(&self.dir.join(format!("{stem}{SENT_EXT}{}", s.name)));
            }
        }
        self.total -= e.bytes;
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

    /// Writes a window, then deletes the oldest ones beyond the size limit. Returns its stem.
    pub fn write(&mut self, w: &WindowProfile) -> Result<String> {
        let meta = WindowMeta {
            window_id: window_id(w),
            start_ms: w.start_ms,
            end_ms: w.end_ms,
            samples: w.samples,
            labels: w.labels.clone(),
        };
        let stem = &meta.window_id;
        let profile = self.dir.join(format!("{stem}{PROFILE_EXT}"));
        PendingOutput::create_file(&profile, 0o600)?
            .commit(|out: &mut dyn std::io::Write| out.write_all(&w.pprof))?;
        let labels = self.dir.join(format!("{stem}{LABELS_EXT}"));
        let json = serde_json::to_vec(&meta)?;
        PendingOutput::create_file(&labels, 0o600)?
            .commit(|out: &mut dyn std::io::Write| out.write_all(&json))?;
        let bytes = self.bytes_of(stem);
        self.stats.written += 1;
        self.stats.bytes_written += bytes;
        self.total += bytes;
        self.entries.push_back(Entry { stem: stem.clone(), bytes, done: 0 });
        while self.total > self.limit {
            let Some(old) = self.entries.front() else { break };
            let (old, done) = (old.stem.clone(), old.done);
            for (i, s) in self.sinks.iter_mut().enumerate() {
                if done & (1 << i) == 0 && !s.inflight.contains(&old) {
                    s.dropped += 1;
                }
            }
            self.remove(&old);
            self.stats.deleted_for_size += 1;
        }
        Ok(stem.clone())
    }
}

/// `START_MS-PID-HASH`: the start time first (zero-padded) so names sort by time; the hash of
/// the labels tells apart the services of one window. PID is 0 since windows are per service
/// (the form is kept so the windows of older agents sort and read alike).
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

/// Removes a file of the spool's own, unless something else (a FIFO, a device, a directory)
/// stands under its name: the spool deletes only what it could have written.
fn remove_regular(path: &std::path::Path) {
    if fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_file()) {
        let _ = fs::remove_file(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(start_ms: u64, bytes: usize) -> WindowProfile {
        WindowProfile {
            labels: WindowLabels {
                service_name: "s".into(),
                host: "h".into(),
                pid: 7,
                process: "p".into(),
                ..Default::default()
            },
            start_ms,
            end_ms: start_ms + 1000,
            samples: 1,
            // Incompressible, so the gzipped file keeps about `bytes`.
            pprof: (0..bytes).map(|i| (i as u32).wrapping_mul(2_654_435_761) as u8).collect(),
        }
    }

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rsprof-spool-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn queue_markers_survive_reopen_and_evictions_count_per_sink() {
        let d = dir("queue");
        let mut s = Spool::open(&d, 1 << 20).unwrap();
        s.attach_sinks(&["a", "b"], true).unwrap();
        let w1 = s.write(&window(1000, 100)).unwrap();
        let w2 = s.write(&window(2000, 100)).unwrap();
        assert_eq!(s.pending(0, 1).into_iter().next().as_deref(), Some(w1.as_str()));
        s.finish(0, &w1, true).unwrap();
        assert_eq!(
            s.pending(0, 1).into_iter().next().as_deref(),
            Some(w2.as_str()),
            "oldest not done first"
        );
        // Reopened (a restart): a's delivery of w1 is remembered, b has both to do.
        drop(s);
        let mut s = Spool::open(&d, 1 << 20).unwrap();
        s.attach_sinks(&["a", "b"], true).unwrap();
        assert_eq!(s.pending(0, 1).into_iter().next().as_deref(), Some(w2.as_str()));
        assert_eq!(s.pending(1, 1).into_iter().next().as_deref(), Some(w1.as_str()));
        // b's in-flight w1 deleted for size: counted by its forwarder, not twice.
        let mut s = Spool { limit: s.total + 10, ..s };
        s.write(&window(3000, 100)).unwrap();
        assert!(!s.contains(&w1));
        assert_eq!((s.dropped(0), s.dropped(1)), (0, 0), "a had w1; b's is in flight");
        s.finish(1, &w1, false).unwrap();
        assert_eq!(s.dropped(1), 1);
        s.write(&window(4000, 100)).unwrap();
        assert!(!s.contains(&w2));
        assert_eq!((s.dropped(0), s.dropped(1)), (0, 2), "a's w2 in flight, b's pending");
        s.finish(0, &w2, false).unwrap();
        assert_eq!(s.dropped(0), 1);
        assert!(!d.join(format!("{w1}.sent-a")).exists(), "markers go with their window");
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn queue_mode_deletes_windows_every_sink_is_done_with() {
        let d = dir("drain");
        let mut s = Spool::open(&d, 1 << 20).unwrap();
        s.attach_sinks(&["a", "b"], false).unwrap();
        let w = s.write(&window(1000, 100)).unwrap();
        s.pending(0, 1).into_iter().next();
        s.finish(0, &w, true).unwrap();
        assert!(s.contains(&w) && d.join(format!("{w}.sent-a")).exists());
        s.pending(1, 1).into_iter().next();
        s.finish(1, &w, true).unwrap();
        assert!(!s.contains(&w));
        let left: Vec<_> = fs::read_dir(&d).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
        // A window done with before a restart is deleted at the next start.
        let w = s.write(&window(2000, 100)).unwrap();
        fs::write(d.join(format!("{w}.sent-b")), b"").unwrap();
        fs::write(d.join(format!("{w}.sent-a")), b"").unwrap();
        drop(s);
        let mut s = Spool::open(&d, 1 << 20).unwrap();
        s.attach_sinks(&["a", "b"], false).unwrap();
        assert_eq!(s.held().0, 0);
        let _ = fs::remove_dir_all(&d);
    }
}
