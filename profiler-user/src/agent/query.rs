//! `query`: reads an agent's windows back and merges them into one profile for the existing
//! writers. Two sources give the same windows-with-stacks (`agent::rows`): a spool directory,
//! whose gzipped pprof files are decoded, and a ClickHouse database the agent wrote to. One
//! process per host × service × process name, its samples spread over their window's time span
//! so a timeline shows when each was hot. A window holds a whole service; `--process` and
//! `--pid` select its rows by the process each row's samples came from.

use std::{
    collections::{BTreeMap, HashMap as StdHashMap, hash_map::Entry},
    path::Path,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result, bail};

use crate::{
    agent::{
        labels::WindowLabels,
        names,
        rows::{self, Stacks, WindowRows},
        sinks::clickhouse,
        spool::{WindowMeta, read_windows},
    },
    cli::{args::QueryArgs, plan::output_format},
    export::output::PendingOutput,
    model::{
        Sample,
        ids::{Pid, StackId, ThreadKey, Tid},
        process::{ProcessMeta, ProcessesMeta},
        recording::RecordingInfo,
        stacks::{Frame, FrameIndex, SymbolizedStacks},
        time::MonoNs,
    },
    symbolize::by_build_id::{self, ByBuildId},
    writers::{Format, ProfileContext},
};

/// Looked up for every sample row: a fast hasher (the keys are the query's own data).
type HashMap<K, V> = StdHashMap<K, V, foldhash::fast::RandomState>;

/// Which windows a query reads: a time range and label filters (each empty list: any).
#[derive(Clone, Debug, Default)]
pub struct Selection {
    /// Wall-clock ms since the epoch: windows ending after `from_ms` and starting before
    /// `to_ms`.
    pub from_ms: u64,
    pub to_ms: u64,
    pub hosts: Vec<String>,
    pub services: Vec<String>,
    /// Container ids or unique prefixes of them.
    pub containers: Vec<String>,
    /// Process names and pids: they select rows (`selects_row`); a window of an older agent
    /// (one profile per process) is also selected by its own labels.
    pub processes: Vec<String>,
    pub pids: Vec<u32>,
}

impl Selection {
    /// Whether window `m` is selected (its rows may still be filtered, `selects_row`).
    pub fn selects(&self, m: &WindowMeta) -> bool {
        let any = |list: &[String], v: &str| list.is_empty() || list.iter().any(|x| x == v);
        let l = &m.labels;
        let per_process = !l.process.is_empty();
        m.end_ms > self.from_ms
            && m.start_ms < self.to_ms
            && any(&self.hosts, &l.host)
            && any(&self.services, &l.service_name)
            && (!per_process || any(&self.processes, &l.process))
            && (!per_process || self.pids.is_empty() || self.pids.contains(&l.pid))
            && (self.containers.is_empty()
                || l.container_id.as_deref().is_some_and(|id| {
                    self.containers.iter().any(|c| !c.is_empty() && id.starts_with(c.as_str()))
                }))
    }
}

impl Selection {
    /// Whether rows are selected one by one (`--process`, `--pid`).
    pub fn filters_rows(&self) -> bool {
        !self.processes.is_empty() || !self.pids.is_empty()
    }

    pub fn selects_row(&self, r: &rows::StackRow) -> bool {
        (self.processes.is_empty() || self.processes.contains(&r.process))
            && (self.pids.is_empty() || self.pids.contains(&r.pid))
    }
}

/// Where the windows come from.
pub enum Source<'a> {
    Spool(&'a Path),
    ClickHouse(&'a str),
}

impl Source<'_> {
    /// The selected windows, oldest first, and their stacks.
    pub fn read(&self, sel: &Selection) -> Result<(Vec<WindowRows>, Stacks)> {
        match self {
            Self::Spool(dir) => {
                let mut stacks = Stacks::new();
                let mut out = Vec::new();
                for (meta, path) in read_windows(dir)? {
                    if !sel.selects(&meta) {
                        continue;
                    }
                    let raw =
                        std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
                    let p =
                        rows::read_pprof_gz(&raw).with_context(|| format!("{}", path.display()))?;
                    let mut w = rows::from_pprof(meta, &p, &mut stacks)?;
                    if sel.filters_rows() {
                        w.rows.retain(|r| sel.selects_row(r));
                        if w.rows.is_empty() {
                            continue;
                        }
                    }
                    out.push(w);
                }
                Ok((out, stacks))
            }
            Self::ClickHouse(url) => clickhouse::read_windows(url, sel),
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::Spool(dir) => dir.display().to_string(),
            Self::ClickHouse(url) => url.to_string(),
        }
    }
}

pub struct Query<'a> {
    args: &'a QueryArgs,
    format: Format,
    selection: Selection,
}

pub struct QueryWritten {
    pub windows: usize,
    pub samples: u64,
    pub tracks: usize,
    pub format: Format,
    /// What naming the frames agents left unnamed did.
    pub names: by_build_id::Stats,
}

/// Parses an RFC 3339 time or one relative to `now_ms` (`-1h`, `-90s`, `now`) into ms since
/// the epoch.
pub fn parse_time(s: &str, now_ms: u64) -> Result<u64> {
    let s = s.trim();
    if s == "now" {
        return Ok(now_ms);
    }
    if let Some(rel) = s.strip_prefix('-') {
        let d = humantime::parse_duration(rel)
            .with_context(|| format!("invalid relative time '{s}' (e.g. -1h, -30m)"))?;
        return Ok(now_ms.saturating_sub(d.as_millis() as u64));
    }
    let t = humantime::parse_rfc3339_weak(s)
        .with_context(|| format!("invalid time '{s}' (RFC 3339, e.g. 2026-11-23T14:00:00Z)"))?;
    Ok(t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_millis() as u64)
}

impl<'a> Query<'a> {
    pub fn from_args(args: &'a QueryArgs) -> Result<Self> {
        let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
        let from_ms = args.from.as_deref().map(|t| parse_time(t, now)).transpose()?.unwrap_or(0);
        let to_ms = args.to.as_deref().map(|t| parse_time(t, now)).transpose()?.unwrap_or(u64::MAX);
        if from_ms >= to_ms {
            bail!("--from must be before --to");
        }
        let format = output_format(&args.output, args.format)?;
        let selection = Selection {
            from_ms,
            to_ms,
            hosts: args.host.clone(),
            services: args.service.clone(),
            containers: args.container.clone(),
            processes: args.process.clone(),
            pids: args.pid.clone(),
        };
        Ok(Self { args, format, selection })
    }

    fn source(&self) -> Source<'_> {
        match (&self.args.clickhouse, &self.args.spool) {
            (Some(url), _) => Source::ClickHouse(url),
            (None, Some(dir)) => Source::Spool(dir),
            (None, None) => unreachable!("clap requires --spool or --clickhouse"),
        }
    }

    pub fn run(&self) -> Result<QueryWritten> {
        let output = PendingOutput::create(&self.args.output)?.compress(self.args.compress);
        let source = self.source();
        let debuginfod = self.args.debuginfod.config(self.args.quiet);
        let mut names = ByBuildId::new(self.args.debug_dir.clone(), debuginfod);
        let (windows, mut stacks) = source.read(&self.selection)?;
        // Only the selected rows' stacks are named (a spool's windows hold every process's).
        let used: std::collections::HashSet<u64> =
            windows.iter().flat_map(|w| w.rows.iter().map(|r| r.stack)).collect();
        stacks.retain(|h, _| used.contains(h));
        // A database keeps what queries named, for the next ones.
        if let Source::ClickHouse(url) = source {
            match clickhouse::stored_names(url, &names::unnamed(&stacks)) {
                Ok(known) => names.known(known),
                Err(e) => names.stats.store_error = Some(format!("{e:#}")),
            }
        }
        names::name_stacks(&mut stacks, &mut names);
        if let Source::ClickHouse(url) = source {
            let fresh = names.fresh();
            match clickhouse::store_names(url, &fresh) {
                Ok(()) => names.stats.stored += fresh.len() as u64,
                Err(e) => names.stats.store_error = Some(format!("{e:#}")),
            }
        }
        if windows.is_empty() {
            bail!("no window in {} matches", source.describe());
        }
        let mut merged = Merged::default();
        for (i, w) in windows.iter().enumerate() {
            merged.add(i, w, &stacks);
        }
        let stacks = SymbolizedStacks::from_parts(
            std::mem::take(&mut merged.frames),
            std::mem::take(&mut merged.nodes),
        );
        let start_ms = windows.iter().map(|w| w.meta.start_ms).min().unwrap_or(0);
        let end_ms = windows.iter().map(|w| w.meta.end_ms).max().unwrap_or(start_ms);
        let hosts: std::collections::BTreeSet<_> =
            windows.iter().map(|w| w.meta.labels.host.as_str()).collect();
        let info = RecordingInfo {
            start: MonoNs(start_ms * 1_000_000),
            start_wall_ms: start_ms as f64,
            end: MonoNs(end_ms * 1_000_000),
            frequency: merged.frequency.max(1),
            logical_cpus: 0,
            physical_cpus: 0,
            product: format!("rsprof-bpf {} query", env!("CARGO_PKG_VERSION")),
            oscpu: format!(
                "{} hosts: {}",
                hosts.len(),
                hosts.into_iter().collect::<Vec<_>>().join(", ")
            ),
        };
        let ctx = ProfileContext {
            info: &info,
            stacks: &stacks,
            processes: &merged.processes,
            marker_schemas: &[],
            recycled: Default::default(),
            buffer_bytes: 0,
            report: Default::default(),
        };
        let mut writer = self.format.writer(&ctx);
        let mut samples = 0;
        if merged.overlap {
            // Each thread's samples in time order, as writers want them: a stable sort keeps
            // the order of equal times, as one sort of all samples would.
            let mut events: BTreeMap<ThreadKey, Vec<Sample>> = BTreeMap::new();
            for w in &windows {
                merged.place(w, |thread, s| events.entry(thread).or_default().extend_from_slice(s));
            }
            for (thread, s) in &mut events {
                s.sort_by_key(|s| s.time);
                writer.samples(*thread, s);
                samples += s.len() as u64;
            }
        } else {
            // Windows in time order, none of a thread overlapping another: each thread's
            // samples come in time order, straight to the writer (millions of them, not kept).
            for w in &windows {
                merged.place(w, |thread, s| {
                    writer.samples(thread, s);
                    samples += s.len() as u64;
                });
            }
        }
        output.commit(|out| writer.write(&[], out))?;
        Ok(QueryWritten {
            windows: windows.len(),
            samples,
            tracks: merged.tracks.len(),
            format: self.format,
            names: names.stats,
        })
    }
}

#[derive(Default)]
struct Merged {
    frames: Vec<Frame>,
    frame_ids: HashMap<Frame, FrameIndex>,
    nodes: Vec<(Option<StackId>, Vec<FrameIndex>)>,
    node_ids: HashMap<(Option<StackId>, Vec<FrameIndex>), StackId>,
    /// Stack hash → its leaf node.
    stack_ids: HashMap<u64, Option<StackId>>,
    /// (host, service, process name) → its track's pid.
    tracks: HashMap<(String, String, String), Pid>,
    processes: ProcessesMeta,
    /// Per thread: its latest window so far and the latest end (ns) of its windows.
    thread_end: HashMap<ThreadKey, (usize, u64)>,
    /// Some window starts before an earlier one of the same thread ends.
    overlap: bool,
    frequency: u64,
}

impl Merged {
    fn frame(&mut self, f: &Frame) -> FrameIndex {
        let next = FrameIndex(self.frames.len() as u32);
        if let Some(&i) = self.frame_ids.get(f) {
            return i;
        }
        self.frames.push(f.clone());
        self.frame_ids.insert(f.clone(), next);
        next
    }

    fn node(&mut self, parent: Option<StackId>, frames: Vec<FrameIndex>) -> StackId {
        let next = StackId(self.nodes.len() as u32);
        *self.node_ids.entry((parent, frames)).or_insert_with_key(|k| {
            self.nodes.push(k.clone());
            next
        })
    }

    fn stack(&mut self, hash: u64, stacks: &Stacks) -> Option<StackId> {
        if let Some(&id) = self.stack_ids.get(&hash) {
            return id;
        }
        let mut parent = None;
        if let Some(frames) = stacks.get(&hash) {
            for node in rows::nodes(frames) {
                let ids = node.iter().map(|f| self.frame(f)).collect();
                parent = Some(self.node(parent, ids));
            }
        }
        self.stack_ids.insert(hash, parent);
        parent
    }

    /// The track of `process` in a window labelled `l`, registered if new.
    fn track(&mut self, l: &WindowLabels, process: &str) -> Pid {
        let key = (l.host.clone(), l.service_name.clone(), process.to_owned());
        let next_pid = Pid(self.tracks.len() as u32 + 1);
        let pid = *self.tracks.entry(key).or_insert(next_pid);
        self.processes.entry(pid).or_insert_with(|| ProcessMeta {
            name: if l.service_name == process {
                format!("{process} @ {}", l.host)
            } else {
                format!("{process} ({}) @ {}", l.service_name, l.host)
            },
            ..Default::default()
        });
        pid
    }

    /// The track of an already registered row's process.
    fn track_of(&self, l: &WindowLabels, process: &str) -> Pid {
        self.tracks[&(l.host.clone(), l.service_name.clone(), process.to_owned())]
    }

    /// Registers window `i`'s tracks, threads and stacks (windows in start order).
    fn add(&mut self, i: usize, w: &WindowRows, stacks: &Stacks) {
        if w.period_ns > 0 {
            self.frequency = self.frequency.max((1e9 / w.period_ns as f64).round() as u64);
        }
        let l = &w.meta.labels;
        let (start, end) = window_ns(w);
        for r in &w.rows {
            let pid = self.track(l, &r.process);
            let tid = Tid(r.tid);
            let process = self.processes.get_mut(&pid).expect("inserted above");
            process.threads.entry(tid).or_default().observe_name(&r.thread);
            if r.stack != 0 {
                self.stack(r.stack, stacks);
            }
            match self.thread_end.entry(ThreadKey::Task { pid, tid }) {
                Entry::Vacant(e) => {
                    e.insert((i, end));
                }
                Entry::Occupied(mut e) => {
                    let (last, last_end) = e.get_mut();
                    if *last != i {
                        self.overlap |= start < *last_end;
                        (*last, *last_end) = (i, end.max(*last_end));
                    }
                }
            }
        }
    }

    /// Hands each thread's samples of window `w` (after `add`) to `out`, in time order: each
    /// stack's samples evenly over the window, interleaved with the others'.
    fn place(&self, w: &WindowRows, mut out: impl FnMut(ThreadKey, &[Sample])) {
        let l = &w.meta.labels;
        // Per thread (of a track): (stack, count, cpu ns) of this window.
        type Rows = Vec<(Option<StackId>, u64, u64)>;
        let mut by_thread: HashMap<(Pid, Tid), Rows> = HashMap::default();
        for r in &w.rows {
            let stack = if r.stack == 0 { None } else { self.stack_ids[&r.stack] };
            let key = (self.track_of(l, &r.process), Tid(r.tid));
            by_thread.entry(key).or_default().push((stack, r.samples, r.cpu_ns));
        }
        let (start, end) = window_ns(w);
        let span = end - start;
        let mut threads: Vec<_> = by_thread.into_iter().collect();
        threads.sort_by_key(|t| t.0);
        let (mut placed, mut run) = (Vec::new(), Vec::new());
        for ((pid, tid), stacks) in threads {
            placed.clear();
            for (stack, n, cpu) in stacks {
                for k in 0..n {
                    let at = (2 * k + 1) * span / (2 * n);
                    let s = Sample {
                        time: MonoNs(start + at),
                        cpu_delta_ns: cpu / n.max(1),
                        stack,
                        off_cpu: None,
                    };
                    placed.push((at, s));
                }
            }
            placed.sort_by_key(|p| p.0);
            run.clear();
            run.extend(placed.iter().map(|p| p.1));
            out(ThreadKey::Task { pid, tid }, &run);
        }
    }
}

/// A window's span in ns since the epoch (at least 1 ms).
fn window_ns(w: &WindowRows) -> (u64, u64) {
    let start = w.meta.start_ms * 1_000_000;
    (start, start + w.meta.end_ms.saturating_sub(w.meta.start_ms).max(1) * 1_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times() {
        let now = 1_800_000_000_000;
        assert_eq!(parse_time("-1h", now).unwrap(), now - 3_600_000);
        assert_eq!(parse_time("-90s", now).unwrap(), now - 90_000);
        assert_eq!(parse_time("now", now).unwrap(), now);
        assert_eq!(parse_time("2026-11-23T14:00:00Z", now).unwrap(), 1_795_442_400_000);
        assert!(parse_time("yesterday", now).is_err());
        assert!(parse_time("-1 fortnight", now).is_err());
    }

    fn window(start_ms: u64, pid: u32, rows: &[(u32, u64)]) -> WindowRows {
        let labels = crate::agent::labels::WindowLabels {
            service_name: "svc".into(),
            host: "h".into(),
            pid,
            process: "app".into(),
            ..Default::default()
        };
        let meta = WindowMeta {
            window_id: format!("{start_ms}-{pid}"),
            start_ms,
            end_ms: start_ms + 10_000,
            samples: rows.iter().map(|r| r.1).sum(),
            labels,
        };
        let rows = (rows.iter())
            .map(|&(tid, samples)| rows::StackRow {
                pid,
                process: "app".into(),
                tid,
                thread: "t".into(),
                stack: 0,
                samples,
                cpu_ns: samples * 1_000_000,
                off_cpu_ns: 0,
            })
            .collect();
        WindowRows { meta, period_ns: 10_000_000, rows }
    }

    /// The samples `place` hands over, per thread, in the order the writer would see them.
    fn placed(windows: &[WindowRows]) -> (bool, Vec<(ThreadKey, Vec<u64>)>) {
        let mut m = Merged::default();
        for (i, w) in windows.iter().enumerate() {
            m.add(i, w, &Stacks::new());
        }
        let mut got: Vec<(ThreadKey, Vec<u64>)> = Vec::new();
        for w in windows {
            m.place(w, |t, s| got.push((t, s.iter().map(|s| s.time.0).collect())));
        }
        (m.overlap, got)
    }

    #[test]
    fn consecutive_windows_stream_and_overlapping_ones_are_detected() {
        // One process (two tracks' worth of threads in one track: same host, service, name).
        let (overlap, got) =
            placed(&[window(0, 7, &[(7, 2), (8, 1)]), window(10_000, 7, &[(7, 1), (7, 1)])]);
        assert!(!overlap, "consecutive windows of a thread");
        let main = ThreadKey::Task { pid: Pid(1), tid: Tid(7) };
        let times: Vec<u64> =
            got.iter().filter(|g| g.0 == main).flat_map(|g| g.1.clone()).collect();
        assert!(times.is_sorted() && times.len() == 4, "{times:?}");
        // Two processes of the same name on one host are one track: a tid both have is one
        // thread whose windows overlap, so samples must be sorted before the writer.
        let (overlap, _) = placed(&[window(0, 7, &[(7, 1)]), window(5_000, 9, &[(7, 1)])]);
        assert!(overlap);
        // Different tids in them: no thread overlaps.
        let (overlap, _) = placed(&[window(0, 7, &[(7, 1)]), window(5_000, 9, &[(9, 1)])]);
        assert!(!overlap);
    }

    #[test]
    fn a_service_window_is_one_track_per_process_name_and_rows_select_by_process() {
        // A per-service window (no pid or process of its own) holding two processes' rows.
        let mut w = window(0, 0, &[(7, 2), (9, 1)]);
        w.meta.labels.process.clear();
        w.rows[1].pid = 9;
        w.rows[1].process = "helper".into();
        let (_, got) = placed(std::slice::from_ref(&w));
        let tracks: Vec<(Pid, Tid)> = (got.iter())
            .map(|(t, _)| match t {
                ThreadKey::Task { pid, tid } => (*pid, *tid),
                ThreadKey::Idle { .. } => panic!("{t:?}"),
            })
            .collect();
        assert_eq!(tracks, [(Pid(1), Tid(7)), (Pid(2), Tid(9))], "app and helper apart");
        let sel =
            Selection { to_ms: u64::MAX, processes: vec!["helper".into()], ..Default::default() };
        assert!(sel.selects(&w.meta), "a service window is selected, then its rows");
        let rows: Vec<u32> = w.rows.iter().filter(|r| sel.selects_row(r)).map(|r| r.pid).collect();
        assert_eq!(rows, [9]);
        // A per-process window of an older agent is selected by its own labels.
        let old = window(0, 7, &[(7, 1)]);
        assert!(!sel.selects(&old.meta));
        assert!(Selection { pids: vec![7], ..sel.clone() }.selects(&WindowMeta {
            labels: crate::agent::labels::WindowLabels {
                process: "helper".into(),
                ..old.meta.labels.clone()
            },
            ..old.meta.clone()
        }));
    }
}
