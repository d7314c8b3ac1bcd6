//! `query`: reads spooled windows back and merges them into one profile for the existing
//! writers. Each window's pprof is decoded into the model (frames, a stack tree, processes,
//! samples); one process per host × service × process name, its samples spread over their
//! window's time span so a timeline shows when each was hot.

use std::{
    collections::HashMap,
    io::Read as _,
    path::Path,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result, bail};
use prost::Message as _;

use crate::{
    agent::spool::{WindowMeta, read_windows},
    cli::{args::QueryArgs, plan::output_format},
    export::output::PendingOutput,
    model::{
        Sample,
        ids::{Pid, StackId, ThreadKey, Tid},
        process::{ProcessMeta, ProcessesMeta},
        recording::RecordingInfo,
        stacks::{Frame, FrameIndex, FrameKind, SymbolizedStacks},
        time::MonoNs,
    },
    symbolize::{KERNEL_MODULE, LABEL_MODULE},
    writers::{Format, ProfileContext, pprof::proto},
};

pub struct Query<'a> {
    args: &'a QueryArgs,
    format: Format,
    /// Wall-clock ms since the epoch.
    from_ms: u64,
    to_ms: u64,
}

pub struct QueryWritten {
    pub windows: usize,
    pub samples: u64,
    pub tracks: usize,
    pub format: Format,
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
        Ok(Self { args, format, from_ms, to_ms })
    }

    fn selects(&self, m: &WindowMeta) -> bool {
        let any = |list: &[String], v: &str| list.is_empty() || list.iter().any(|x| x == v);
        m.end_ms > self.from_ms
            && m.start_ms < self.to_ms
            && any(&self.args.host, &m.labels.host)
            && any(&self.args.service, &m.labels.service_name)
            && any(&self.args.process, &m.labels.process)
    }

    pub fn run(&self) -> Result<QueryWritten> {
        let output = PendingOutput::create(&self.args.output)?;
        let windows: Vec<_> =
            read_windows(&self.args.spool)?.into_iter().filter(|(m, _)| self.selects(m)).collect();
        if windows.is_empty() {
            bail!("no window in {} matches", self.args.spool.display());
        }
        let mut merged = Merged::default();
        for (meta, path) in &windows {
            let profile = read_profile(path)?;
            merged.add(meta, &profile).with_context(|| format!("window {}", path.display()))?;
        }
        merged.events.sort_by_key(|(thread, s)| (s.time, *thread));
        let stacks = SymbolizedStacks::from_parts(merged.frames, merged.nodes);
        let start_ms = windows.iter().map(|w| w.0.start_ms).min().unwrap_or(0);
        let end_ms = windows.iter().map(|w| w.0.end_ms).max().unwrap_or(start_ms);
        let hosts: std::collections::BTreeSet<_> =
            windows.iter().map(|w| w.0.labels.host.as_str()).collect();
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
        };
        let mut writer = self.format.writer(&ctx);
        for (thread, s) in &merged.events {
            writer.sample(*thread, s);
        }
        let samples = merged.events.len() as u64;
        output.commit(|out| writer.write(&[], out))?;
        Ok(QueryWritten {
            windows: windows.len(),
            samples,
            tracks: merged.tracks.len(),
            format: self.format,
        })
    }
}

fn read_profile(path: &Path) -> Result<proto::Profile> {
    let raw = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(raw.as_slice())
        .read_to_end(&mut bytes)
        .with_context(|| format!("gunzip {}", path.display()))?;
    proto::Profile::decode(bytes.as_slice()).with_context(|| format!("decode {}", path.display()))
}

#[derive(Default)]
struct Merged {
    frames: Vec<Frame>,
    frame_ids: HashMap<Frame, FrameIndex>,
    nodes: Vec<(Option<StackId>, Vec<FrameIndex>)>,
    node_ids: HashMap<(Option<StackId>, Vec<FrameIndex>), StackId>,
    /// (host, service, process name) → its track's pid.
    tracks: HashMap<(String, String, String), Pid>,
    processes: ProcessesMeta,
    events: Vec<(ThreadKey, Sample)>,
    frequency: u64,
}

impl Merged {
    fn frame(&mut self, f: Frame) -> FrameIndex {
        let next = FrameIndex(self.frames.len() as u32);
        *self.frame_ids.entry(f).or_insert_with_key(|f| {
            self.frames.push(f.clone());
            next
        })
    }

    fn node(&mut self, parent: Option<StackId>, frames: Vec<FrameIndex>) -> StackId {
        let next = StackId(self.nodes.len() as u32);
        *self.node_ids.entry((parent, frames)).or_insert_with_key(|k| {
            self.nodes.push(k.clone());
            next
        })
    }

    fn add(&mut self, meta: &WindowMeta, p: &proto::Profile) -> Result<()> {
        let s = |i: i64| p.string_table.get(i as usize).map_or("", String::as_str);
        if p.period > 0 {
            self.frequency = self.frequency.max((1e9 / p.period as f64).round() as u64);
        }
        let functions: HashMap<u64, &proto::Function> =
            p.function.iter().map(|f| (f.id, f)).collect();
        let mappings: HashMap<u64, &proto::Mapping> = p.mapping.iter().map(|m| (m.id, m)).collect();
        // Each location's frames, outermost first (pprof lists the innermost inlined first).
        let mut locations: HashMap<u64, Vec<FrameIndex>> = HashMap::new();
        for loc in &p.location {
            let module = mappings.get(&loc.mapping_id).map_or("[unknown]", |m| s(m.filename));
            let kind = match module {
                KERNEL_MODULE => FrameKind::Kernel,
                LABEL_MODULE => FrameKind::Label,
                _ => FrameKind::User,
            };
            let n = loc.line.len();
            let frames = (loc.line.iter().rev().enumerate())
                .map(|(i, l)| {
                    let f = functions.get(&l.function_id);
                    let file = f.map(|f| s(f.filename)).filter(|x| !x.is_empty());
                    self.frame(Frame {
                        kind,
                        function: f.map_or("[unknown]", |f| s(f.name)).to_owned(),
                        module: module.to_owned(),
                        file: file.map(str::to_owned),
                        line: u32::try_from(l.line).ok().filter(|&x| x > 0),
                        column: u32::try_from(l.column).ok().filter(|&x| x > 0),
                        inlined: i + 1 < n,
                    })
                })
                .collect();
            locations.insert(loc.id, frames);
        }
        let value_index = |name: &str| p.sample_type.iter().position(|t| s(t.r#type) == name);
        let (count_i, cpu_i) = (value_index("samples"), value_index("cpu"));
        let Some(count_i) = count_i else { bail!("no `samples` value") };

        let l = &meta.labels;
        let key = (l.host.clone(), l.service_name.clone(), l.process.clone());
        let next_pid = Pid(self.tracks.len() as u32 + 1);
        let pid = *self.tracks.entry(key).or_insert(next_pid);
        self.processes.entry(pid).or_insert_with(|| ProcessMeta {
            name: if l.service_name == l.process {
                format!("{} @ {}", l.process, l.host)
            } else {
                format!("{} ({}) @ {}", l.process, l.service_name, l.host)
            },
            ..Default::default()
        });
        // Per thread: (stack, count, cpu ns) of this window.
        let mut by_thread: HashMap<Tid, Vec<(Option<StackId>, u64, u64)>> = HashMap::new();
        for smp in &p.sample {
            let num =
                |k: &str| smp.label.iter().find(|x| s(x.key) == k && x.str == 0).map(|x| x.num);
            let string =
                |k: &str| smp.label.iter().find(|x| s(x.key) == k && x.str != 0).map(|x| s(x.str));
            let tid = Tid(num("tid").unwrap_or(0) as u32);
            let name = string("thread").unwrap_or_default();
            let process = self.processes.get_mut(&pid).expect("inserted above");
            process.threads.entry(tid).or_default().observe_name(name);
            let mut parent = None;
            for loc in smp.location_id.iter().rev() {
                let frames = locations.get(loc).cloned().unwrap_or_default();
                parent = Some(self.node(parent, frames));
            }
            let n = smp.value.get(count_i).copied().unwrap_or(0).max(0) as u64;
            let cpu = cpu_i.and_then(|i| smp.value.get(i)).copied().unwrap_or(0).max(0) as u64;
            by_thread.entry(tid).or_default().push((parent, n, cpu));
        }
        let (start, span) =
            (meta.start_ms * 1_000_000, (meta.end_ms - meta.start_ms).max(1) * 1_000_000);
        for (tid, stacks) in by_thread {
            // Each stack's samples evenly over the window, interleaved with the others'.
            let mut placed: Vec<(u64, Sample)> = Vec::new();
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
            let thread = ThreadKey::Task { pid, tid };
            self.events.extend(placed.into_iter().map(|(_, s)| (thread, s)));
        }
        Ok(())
    }
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
}
