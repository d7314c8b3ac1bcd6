//! Feeds a collector from a raw stream (`raw`), as the recording's event loop fed its own:
//! ring records in the order they were drained, each /proc fact ahead of the record that
//! read it. What the live loop did with the collector's outbox after a drain — load unwind
//! tables and USDT probes into the kernel, read CPython's memory — needs the live processes:
//! the outbox is emptied, and the USDT hits in it counted (their markers are not replayed).

use std::io::Read;

use anyhow::{Context as _, Result, bail};

use crate::{
    collect::{
        collector::Collector,
        facts::ReplayProc,
        outbox::Outbox,
        raw::{self, Entry, RawReader},
    },
    model::{recording::RecordingInfo, time::MonoNs},
    store::ChunkedStore,
    symbolize::recorded_names::RecordedNames,
};

/// A replayed recording, ready to export.
pub struct Replayed {
    pub collector: Collector<ChunkedStore>,
    pub start: raw::Start,
    pub info: RecordingInfo,
    pub end: raw::End,
    /// For `symbolize::use_kernel_names`.
    pub kernel_names: RecordedNames,
    pub stats: ReplayStats,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct ReplayStats {
    pub entries: u64,
    pub records: u64,
    pub drains: u64,
    /// USDT hits among the records: their markers need the probes' files as the recording
    /// registered them (`usdt`), which a replay does not do.
    pub usdt_hits_not_replayed: u64,
    /// /proc reads the stream held no answer for.
    pub facts_missing: u64,
}

/// Replays the whole stream; an error if it is not a whole recording.
pub fn replay<R: Read>(mut reader: RawReader<R>) -> Result<Replayed> {
    let facts = ReplayProc::default();
    let mut stats = ReplayStats::default();
    let mut collector: Option<(Collector<ChunkedStore>, raw::Start)> = None;
    let (mut info, mut end) = (None, None);
    let mut cgroups = Vec::new();
    let mut kernel_names = RecordedNames::default();
    let no_start = || anyhow::anyhow!("records before the stream's start entry");
    while let Some(e) = reader.next_entry()? {
        if end.is_some() && !matches!(e, Entry::KernelSymbols(_)) {
            bail!("entry {} follows the end of the recording", reader.entries);
        }
        match e {
            Entry::Start(s) => {
                if collector.is_some() {
                    bail!("a second start entry (entry {})", reader.entries);
                }
                let mut c = Collector::new(ChunkedStore::new(s.buffer_bytes));
                c.copies.fp_fallback = s.fp_fallback;
                facts.set_vdso_len(s.vdso_len);
                c.set_facts(Box::new(facts.clone()));
                collector = Some((c, *s));
            }
            Entry::Ring(bytes) => {
                let (c, _) = collector.as_mut().ok_or_else(no_start)?;
                stats.records += 1;
                // Undecodable records are counted in the collector's stats, as live.
                let _ = c.handle_record(&bytes);
            }
            Entry::Drain(_) => {
                let (c, _) = collector.as_mut().ok_or_else(no_start)?;
                stats.drains += 1;
                stats.usdt_hits_not_replayed += c.outbox.take_usdt_hits().len() as u64;
                c.outbox = Outbox::default();
            }
            e @ (Entry::Identity(_) | Entry::Maps(_)) => facts.add(e),
            Entry::Existing(pid) => {
                collector.as_mut().ok_or_else(no_start)?.0.register_existing(pid)
            }
            Entry::ScanDone => collector.as_mut().ok_or_else(no_start)?.0.initial_scan_done(),
            Entry::Info(i) => info = Some(*i),
            Entry::Cgroups(c) => cgroups.extend(c),
            Entry::KernelSymbols(batch) => kernel_names.add(batch),
            Entry::End(e) => end = Some(e),
        }
    }
    stats.entries = reader.entries;
    let Some((mut collector, start)) = collector else { bail!("no start entry: an empty stream") };
    let info = info.context("no recording info: the recording stopped before sampling began")?;
    let Some(end) = end else {
        bail!(
            "the stream ends after {} entries, before the recording did (was the recorder \
             killed?)",
            reader.entries
        )
    };
    stats.usdt_hits_not_replayed += collector.outbox.take_usdt_hits().len() as u64;
    let paths = &mut collector.processes.cgroup_paths;
    for (id, path) in &cgroups {
        paths.remember(*id, path);
    }
    let ps = &mut collector.processes;
    for p in ps.processes.values_mut() {
        p.cgroup.resolve_recorded(&ps.cgroup_paths);
    }
    stats.facts_missing = facts.missing();
    let info = info.at(MonoNs(end.end_ns));
    Ok(Replayed { collector, start, info, end, kernel_names, stats })
}

#[cfg(test)]
mod tests {
    use profiler_common::{
        EVENT_SAMPLE, EventHeader, SAMPLE_RECORD_FIXED, SAMPLE_USER_MODE, SampleHeader,
        SampleRecord,
    };

    use super::*;
    use crate::{
        collect::raw::{Identity, Info, Maps, MapsRead, RawWriter, Start},
        model::{address::FrameAddr, ids::Pid},
    };

    /// Above the kernel's pid limit (2^22): /proc never knows it, so whatever the replay
    /// knows of it came from the stream.
    const PID: u32 = 1 << 23;
    const TEXT: u64 = 0x5555_0000_0000;

    /// The bytes of a ring record: a CPU sample of `PID` with one user frame at `pc`.
    fn sample_record(time_ns: u64, pc: u64) -> Vec<u8> {
        let mut comm = [0u8; 16];
        comm[..4].copy_from_slice(b"busy");
        let mut r = SampleRecord {
            sample: SampleHeader {
                header: EventHeader { kind: EVENT_SAMPLE, cpu: 0, time_ns, pid: PID, tid: PID },
                cgroup_id: 0,
                cpu_time_ns: time_ns,
                comm,
                kernel_frames: 0,
                user_frames: 1,
                flags: SAMPLE_USER_MODE,
                label_count: 0,
                py_frames: 0,
            },
            frames: [0; 2 * profiler_common::MAX_STACK_DEPTH
                + profiler_common::LABEL_MAX_DEPTH
                + 2 * profiler_common::PY_MAX_FRAMES],
        };
        r.frames[0] = pc;
        let len = SAMPLE_RECORD_FIXED + 8;
        // SAFETY: a repr(C) record viewed as its first `len` bytes, as the kernel sends it.
        unsafe { std::slice::from_raw_parts((&raw const r).cast::<u8>(), len).to_vec() }
    }

    /// A recording of one process that existed before it: its facts, then its samples.
    fn recording(end: bool) -> Vec<Entry> {
        let info = RecordingInfo {
            start: MonoNs(1_000),
            start_wall_ms: 1.7e12,
            end: MonoNs(1_000),
            frequency: 999,
            logical_cpus: 2,
            physical_cpus: 2,
            product: "rsprof-bpf test".into(),
            oscpu: "Linux".into(),
        };
        let maps =
            format!("{TEXT:x}-{:x} r-xp 00001000 fd:01 77 /nonexistent/busy\n", TEXT + 0x4000);
        let mut v = vec![
            Entry::Start(Box::new(Start {
                product: info.product.clone(),
                host: "h".into(),
                targets: "all processes".into(),
                buffer_bytes: 8 << 20,
                fp_fallback: false,
                vdso_len: None,
            })),
            Entry::Identity(Identity {
                pid: PID,
                comm: "busy".into(),
                argv: vec!["./busy".into(), "30".into()],
                exe: Some("/nonexistent/busy".into()),
            }),
            Entry::Maps(Maps { pid: PID, read: MapsRead::Text(maps) }),
            Entry::Existing(Pid(PID)),
            Entry::ScanDone,
            Entry::Info(Box::new(Info::new(&info))),
            Entry::Ring(sample_record(2_000, TEXT + 0x10)),
            Entry::Ring(sample_record(3_000, TEXT + 0x20)),
            Entry::Ring(vec![0xde, 0xad]),
            Entry::Drain(MonoNs(4_000)),
        ];
        if end {
            let counters = vec![0; profiler_common::counter::COUNT as usize];
            v.push(Entry::End(raw::End { end_ns: 5_000, stop_reason: "test".into(), counters }));
        }
        v
    }

    fn reader(entries: &[Entry]) -> RawReader<flate2::read::MultiGzDecoder<std::fs::File>> {
        let dir = std::env::temp_dir().join(format!("rsprof-replay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Tests run in parallel: a file each.
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.join(format!("{n}.raw"));
        let mut w = RawWriter::create(&path).unwrap();
        for e in entries {
            w.write(e);
        }
        w.finish().unwrap();
        let file = std::fs::File::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        RawReader::new(flate2::read::MultiGzDecoder::new(file)).unwrap()
    }

    #[test]
    fn a_process_known_before_the_recording_is_replayed_from_its_facts() {
        let r = replay(reader(&recording(true))).unwrap();
        assert_eq!((r.stats.records, r.stats.drains, r.stats.facts_missing), (3, 1, 0));
        assert_eq!(r.info.start, MonoNs(1_000));
        assert_eq!(r.info.end, MonoNs(5_000));
        let c = &r.collector;
        assert_eq!(c.stats.samples, 2);
        assert_eq!(c.stats.decode_errors, 1, "an undecodable record is counted, as live");
        assert_eq!((c.stats.maps_reads, c.stats.maps_errors), (1, 0));
        let p = c.processes.get(Pid(PID)).expect("the process");
        assert_eq!(p.meta.argv, ["./busy", "30"]);
        assert_eq!(p.meta.exe, "/nonexistent/busy");
        let snap = c.store.snapshot();
        let frames: Vec<_> = snap.stacks.iter().flatten().map(|(_, f)| *f).collect();
        let offsets: Vec<u64> = frames
            .iter()
            .map(|f| match f {
                FrameAddr::User { module, offset } => {
                    assert_eq!(c.modules.get(*module).name, "busy");
                    *offset
                }
                f => panic!("{f:?}"),
            })
            .collect();
        assert_eq!(offsets, [0x1010, 0x1020], "addresses placed by the recorded maps");
    }

    #[test]
    fn a_stream_without_its_end_or_start_is_an_error() {
        let e = replay(reader(&recording(false))).err().unwrap();
        assert!(format!("{e:#}").contains("before the recording did"), "{e:#}");
        let headless = &recording(true)[1..];
        let e = replay(reader(headless)).err().unwrap();
        assert!(format!("{e:#}").contains("before the stream's start"), "{e:#}");
    }
}
