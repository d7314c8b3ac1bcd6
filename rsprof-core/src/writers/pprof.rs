//! The pprof writer: a `perftools.profiles.Profile` protobuf, as `pprof` and `go tool pprof`
//! read it (gzip comes from the file name, see `export::output`).
//!
//! Samples are aggregated per (thread, stack): each gets two values, `samples`/`count` and
//! `cpu`/`nanoseconds` (the CPU time the thread used since its previous sample, or the sampling
//! period when that is unknown) — plus `off_cpu`/`nanoseconds`, the time spent blocked, when
//! the recording has off-CPU samples (`--off-cpu`, `--mode wall`; those count as no CPU
//! sample) — and labels saying whose it is: `pid`, `tid` (numbers), `process`, `thread`
//! (strings), `cmdline` (argv, shell-quoted) and `exe`, `container_runtime`/`container_id` or `service`, and `pod_uid`/`pod_qos`, when
//! known; an agent adds its own (`service_name`, `host`, …).
//! The idle tasks are kept as process `[idle]`, threads `swapper/N`, with a `cpu` string label
//! and no pid/tid (0, which readers take for no label), so they can be filtered out
//! (`-tagignore 'process=\[idle\]'`). A location is one stored stack node:
//! its frames are its lines, the innermost inlined function first. Every module, including the
//! kernel and `rsprof label` (label frames), is a mapping marked as already symbolized.
//! Markers have no pprof equivalent and are left out.

pub mod proto;

use std::{
    collections::HashMap,
    io::{self, Write},
};

use prost::Message as _;

use crate::{
    model::{
        Sample,
        ids::{StackId, ThreadKey},
        markers::Marker,
        process::display_names,
        stacks::{Frame, FrameIndex, SymbolizedStacks},
    },
    writers::{EventSink, ProfileContext, ProfileWriter},
};

pub use proto::Profile;

pub struct PprofWriter<'a> {
    ctx: &'a ProfileContext<'a>,
    /// (samples, cpu ns, off-CPU ns) by thread and stack.
    counts: HashMap<(ThreadKey, Option<StackId>), [i64; 3]>,
    any_off_cpu: bool,
    period_ns: i64,
    /// String labels added to every sample (an agent's `service_name`, `host`, …).
    extra: Vec<(String, String)>,
}

impl<'a> PprofWriter<'a> {
    pub fn new(ctx: &'a ProfileContext<'a>) -> Self {
        let period_ns = (1e9 / ctx.info.frequency.max(1) as f64).round() as i64;
        Self { ctx, counts: HashMap::new(), any_off_cpu: false, period_ns, extra: Vec::new() }
    }

    /// With string labels `extra` on every sample.
    pub fn with_labels(ctx: &'a ProfileContext<'a>, extra: Vec<(String, String)>) -> Self {
        Self { extra, ..Self::new(ctx) }
    }

    /// Samples received.
    pub fn samples(&self) -> i64 {
        self.counts.values().map(|c| c[0]).sum()
    }
}

impl EventSink for PprofWriter<'_> {
    fn sample(&mut self, thread: ThreadKey, s: &Sample) {
        let c = self.counts.entry((thread, s.stack)).or_default();
        if let Some(o) = s.off_cpu {
            self.any_off_cpu = true;
            c[2] = c[2].saturating_add(i64::try_from(o.weight_ns).unwrap_or(i64::MAX));
            return;
        }
        let cpu = match s.cpu_delta_ns {
            0 => self.period_ns,
            d => i64::try_from(d).unwrap_or(i64::MAX),
        };
        c[0] += 1;
        c[1] = c[1].saturating_add(cpu);
    }

    fn marker(&mut self, _: ThreadKey, _: &Marker) {}
}

impl ProfileWriter for PprofWriter<'_> {
    fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    fn write(self: Box<Self>, corrupt: &[String], out: &mut dyn Write) -> io::Result<()> {
        let profile = self.build(corrupt);
        out.write_all(&profile.encode_to_vec())
    }
}

impl PprofWriter<'_> {
    fn build(self, corrupt: &[String]) -> Profile {
        let ctx = self.ctx;
        let info = ctx.info;
        let mut b = Builder::new(ctx.stacks);
        let mut sample_type =
            vec![b.value_type("samples", "count"), b.value_type("cpu", "nanoseconds")];
        if self.any_off_cpu {
            sample_type.push(b.value_type("off_cpu", "nanoseconds"));
        }
        let values = sample_type.len();
        let mut p = Profile {
            sample_type,
            period_type: Some(b.value_type("cpu", "nanoseconds")),
            period: self.period_ns,
            time_nanos: (info.start_wall_ms * 1e6) as i64,
            duration_nanos: info.end.0.saturating_sub(info.start.0) as i64,
            ..Default::default()
        };
        let mut comments = vec![format!(
            "{} on {}, {} Hz per CPU, {} CPUs",
            info.product, info.oscpu, info.frequency, info.logical_cpus
        )];
        if let Some((first, last)) = ctx.recycled.range {
            comments.push(format!(
                "buffer full: {} oldest events ({:.3} s to {:.3} s) were recycled and are missing",
                ctx.recycled.events,
                first.secs_since(info.start),
                last.secs_since(info.start)
            ));
        }
        comments.extend(corrupt.iter().map(|c| format!("corrupt storage skipped: {c}")));
        p.comment = comments.iter().map(|c| b.strings.id(c)).collect();

        // Sorted so the same recording always gives the same file.
        let mut counts: Vec<_> = self.counts.into_iter().collect();
        counts.sort_unstable_by_key(|&(key, _)| key);
        let mut labels: HashMap<ThreadKey, Vec<proto::Label>> = HashMap::new();
        for ((thread, stack), value) in counts {
            let label = (labels.entry(thread))
                .or_insert_with(|| b.labels(ctx, thread, &self.extra))
                .clone();
            let location_id = stack.map(|s| b.stack(s)).unwrap_or_default();
            let value = value[..values].to_vec();
            p.sample.push(proto::Sample { location_id, value, label });
        }
        p.mapping = b.mappings;
        p.location = b.locations;
        p.function = b.functions;
        p.string_table = b.strings.table;
        p
    }
}

#[derive(Default)]
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    fn id(&mut self, s: &str) -> i64 {
        if let Some(&i) = self.index.get(s) {
            return i;
        }
        let i = self.table.len() as i64;
        self.table.push(s.to_owned());
        self.index.insert(s.to_owned(), i);
        i
    }
}

/// The profile's tables, each entry added once (ids are 1-based indices).
struct Builder<'a> {
    stacks: &'a SymbolizedStacks,
    strings: Strings,
    mappings: Vec<proto::Mapping>,
    mapping_ids: HashMap<&'a str, u64>,
    locations: Vec<proto::Location>,
    /// By a stack node's frames: the same address always expands to the same frames.
    location_ids: HashMap<&'a [FrameIndex], u64>,
    functions: Vec<proto::Function>,
    function_ids: HashMap<(&'a str, Option<&'a str>), u64>,
}

impl<'a> Builder<'a> {
    fn new(stacks: &'a SymbolizedStacks) -> Self {
        let mut strings = Strings::default();
        strings.id("");
        Self {
            stacks,
            strings,
            mappings: Vec::new(),
            mapping_ids: HashMap::new(),
            locations: Vec::new(),
            location_ids: HashMap::new(),
            functions: Vec::new(),
            function_ids: HashMap::new(),
        }
    }

    fn value_type(&mut self, ty: &str, unit: &str) -> proto::ValueType {
        proto::ValueType { r#type: self.strings.id(ty), unit: self.strings.id(unit) }
    }

    fn labels(
        &mut self,
        ctx: &ProfileContext,
        thread: ThreadKey,
        extra: &[(String, String)],
    ) -> Vec<proto::Label> {
        let (process, thread_name) = display_names(ctx.processes, thread);
        let mut out = Vec::new();
        let mut strs = vec![("process", process), ("thread", thread_name)];
        match thread {
            // Readers take a numeric label of 0 without unit for no label (Go's pprof drops
            // it), so the idle tasks (pid 0, tid 0) get no pid/tid and their CPU as a string.
            ThreadKey::Idle { cpu } => strs.push(("cpu", cpu.to_string())),
            ThreadKey::Task { pid, tid } => {
                for (key, v) in [("pid", pid.0), ("tid", tid.0)] {
                    let key = self.strings.id(key);
                    out.push(proto::Label { key, num: v.into(), ..Default::default() });
                }
            }
        }
        let meta = thread.pid().and_then(|p| ctx.processes.get(&p));
        if let Some(m) = meta.filter(|m| !m.argv.is_empty()) {
            strs.push(("cmdline", m.command_line()));
        }
        if let Some(m) = meta.filter(|m| !m.exe.is_empty()) {
            strs.push(("exe", m.exe.clone()));
        }
        let container = meta.and_then(|m| m.container.as_ref());
        if let Some(c) = container {
            if c.is_container() {
                strs.push(("container_runtime", c.runtime.name().to_owned()));
                strs.push(("container_id", c.id.clone()));
            } else {
                strs.push(("service", c.id.clone()));
            }
            strs.extend(c.pod_uid.clone().map(|u| ("pod_uid", u)));
            strs.extend(c.qos.map(|q| ("pod_qos", q.name().to_owned())));
        }
        let extra = extra.iter().map(|(k, v)| (k.as_str(), v.clone()));
        for (key, v) in strs.into_iter().chain(extra) {
            let (key, str) = (self.strings.id(key), self.strings.id(&v));
            out.push(proto::Label { key, str, ..Default::default() });
        }
        out
    }

    /// Location ids of a stack, leaf first.
    fn stack(&mut self, leaf: StackId) -> Vec<u64> {
        let stacks = self.stacks;
        let mut ids = Vec::new();
        let mut cur = Some(leaf);
        while let Some((parent, frames)) = cur.and_then(|id| stacks.node(id)) {
            if !frames.is_empty() {
                ids.push(self.location(frames));
            }
            cur = parent;
        }
        ids
    }

    /// `frames`: one address's frames, outermost first, not empty.
    fn location(&mut self, frames: &'a [FrameIndex]) -> u64 {
        if let Some(&id) = self.location_ids.get(frames) {
            return id;
        }
        let stacks = self.stacks;
        let frames_of: Vec<&'a Frame> = frames.iter().filter_map(|&f| stacks.frame(f)).collect();
        let mapping_id = frames_of.first().map_or(0, |f| self.mapping(f));
        let line = frames_of
            .iter()
            .rev()
            .map(|f| proto::Line {
                function_id: self.function(f),
                line: f.line.map_or(0, i64::from),
                column: f.column.map_or(0, i64::from),
            })
            .collect::<Vec<_>>();
        if let Some(m) = mapping_id.checked_sub(1).and_then(|i| self.mappings.get_mut(i as usize)) {
            m.has_inline_frames |= line.len() > 1;
            m.has_filenames |= frames_of.iter().any(|f| f.file.is_some());
            m.has_line_numbers |= frames_of.iter().any(|f| f.line.is_some());
        }
        let id = self.locations.len() as u64 + 1;
        // An unnamed frame's ELF address: with its mapping's build-id, named at read time.
        let address = frames_of.first().and_then(|f| f.elf.as_ref()).map_or(0, |e| e.address);
        self.locations.push(proto::Location { id, mapping_id, address, line });
        self.location_ids.insert(frames, id);
        id
    }

    fn mapping(&mut self, f: &'a Frame) -> u64 {
        if let Some(&id) = self.mapping_ids.get(f.module.as_str()) {
            return id;
        }
        let id = self.mappings.len() as u64 + 1;
        self.mappings.push(proto::Mapping {
            id,
            filename: self.strings.id(&f.module),
            build_id: self
                .stacks
                .module_build_ids
                .get(f.module.as_str())
                .map_or(0, |id| self.strings.id(id)),
            // Already symbolized: readers must not look for the file to do it again.
            has_functions: true,
            ..Default::default()
        });
        self.mapping_ids.insert(&f.module, id);
        id
    }

    fn function(&mut self, f: &'a Frame) -> u64 {
        let key = (f.function.as_str(), f.file.as_deref());
        if let Some(&id) = self.function_ids.get(&key) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        let name = self.strings.id(&f.function);
        let filename = f.file.as_deref().map_or(0, |s| self.strings.id(s));
        self.functions.push(proto::Function {
            id,
            name,
            system_name: name,
            filename,
            start_line: 0,
        });
        self.function_ids.insert(key, id);
        id
    }
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;
    use crate::writers::{Format, testdata::*};

    fn decode(events: &[(ThreadKey, Sample)]) -> Profile {
        Profile::decode(write(Format::Pprof, events).as_slice()).expect("decodes")
    }

    /// A decoded profile read back by name.
    struct Read<'p>(&'p Profile);

    impl<'p> Read<'p> {
        fn s(&self, i: i64) -> &'p str {
            &self.0.string_table[i as usize]
        }
        fn location(&self, id: u64) -> &'p proto::Location {
            &self.0.location[id as usize - 1]
        }
        fn function(&self, id: u64) -> &'p proto::Function {
            &self.0.function[id as usize - 1]
        }
        /// A sample's function names, root first, inlined ones included.
        fn names(&self, s: &proto::Sample) -> Vec<&'p str> {
            let mut v: Vec<_> = (s.location_id.iter())
                .flat_map(|&l| self.location(l).line.iter())
                .map(|l| self.s(self.function(l.function_id).name))
                .collect();
            v.reverse();
            v
        }
        fn str_label(&self, s: &proto::Sample, key: &str) -> Option<&'p str> {
            let l = s.label.iter().find(|l| self.s(l.key) == key && l.str != 0)?;
            Some(self.s(l.str))
        }
        fn num_label(&self, s: &proto::Sample, key: &str) -> Option<i64> {
            s.label.iter().find(|l| self.s(l.key) == key && l.str == 0).map(|l| l.num)
        }
        fn sample_with(&self, names: &[&str]) -> Vec<&'p proto::Sample> {
            self.0.sample.iter().filter(|s| self.names(s) == names).collect()
        }
    }

    #[test]
    fn off_cpu_time_is_a_third_value_not_a_cpu_sample() {
        let mut blocked = sample(4, 0, Some(S_SYSCALL));
        let off_cpu =
            crate::model::OffCpu { weight_ns: 2_500_000, block_ns: 2_500_000, blocks: 1, state: 1 };
        blocked.off_cpu = Some(off_cpu);
        let p = decode(&[(MAIN, sample(1, 700_000, Some(S_HOT))), (MAIN, blocked)]);
        let r = Read(&p);
        let types: Vec<_> = p.sample_type.iter().map(|t| (r.s(t.r#type), r.s(t.unit))).collect();
        assert_eq!(
            types,
            [("samples", "count"), ("cpu", "nanoseconds"), ("off_cpu", "nanoseconds")]
        );
        let mut values: Vec<_> = p.sample.iter().map(|s| s.value.clone()).collect();
        values.sort();
        assert_eq!(values, [vec![0, 0, 2_500_000], vec![1, 700_000, 0]]);
    }

    #[test]
    fn header_and_values() {
        let p = decode(&[
            (MAIN, sample(1, 0, Some(S_HOT))),
            (MAIN, sample(2, 700_000, Some(S_HOT))),
            (MAIN, sample(3, 300_000, Some(S_HOT))),
        ]);
        let r = Read(&p);
        assert_eq!(p.string_table[0], "");
        let types: Vec<_> = p.sample_type.iter().map(|t| (r.s(t.r#type), r.s(t.unit))).collect();
        assert_eq!(types, [("samples", "count"), ("cpu", "nanoseconds")]);
        let pt = p.period_type.as_ref().unwrap();
        assert_eq!((r.s(pt.r#type), r.s(pt.unit), p.period), ("cpu", "nanoseconds", 1_000_000));
        assert_eq!(p.time_nanos, 1_700_000_000_000_000_000);
        assert_eq!(p.duration_nanos, 2_500_000_000);
        // One sample for one (thread, stack); an unknown CPU delta counts as one period.
        assert_eq!(p.sample.len(), 1);
        assert_eq!(p.sample[0].value, [3, 1_000_000 + 700_000 + 300_000]);
        assert!(r.s(p.comment[0]).contains("1000 Hz"));
    }

    #[test]
    fn locations_functions_mappings_are_shared_and_inlines_are_lines() {
        let p = decode(&[
            (MAIN, sample(1, 0, Some(S_HOT))),
            (WORKER, sample(1, 0, Some(S_SYSCALL))),
            (WORKER, sample(2, 0, Some(S_WORK))),
        ]);
        let r = Read(&p);
        assert_eq!(p.sample.len(), 3);
        // main, work(+inl), hot, do_syscall_64: each once.
        assert_eq!(p.location.len(), 4);
        let fnames: Vec<_> = p.function.iter().map(|f| r.s(f.name)).collect();
        assert_eq!(fnames.len(), 5, "{fnames:?}");
        for (i, f) in p.function.iter().enumerate() {
            assert_eq!(f.id, i as u64 + 1);
        }
        let [hot] = r.sample_with(&["main", "work", "inl", "hot"])[..] else { panic!() };
        // Leaf first; the inlined function is the first line of work's location.
        let work = r.location(hot.location_id[1]);
        let lines: Vec<_> = work
            .line
            .iter()
            .map(|l| (r.s(r.function(l.function_id).name), l.line, l.column))
            .collect();
        assert_eq!(lines, [("inl", 3, 0), ("work", 12, 5)]);
        let f = r.function(work.line[1].function_id);
        assert_eq!(r.s(f.filename), "src/main.c");
        let mapping = |l: &proto::Location| &p.mapping[l.mapping_id as usize - 1];
        let m = mapping(work);
        assert_eq!(r.s(m.filename), "app");
        assert_eq!(r.s(m.build_id), "0123abcd");
        assert!(m.has_functions && m.has_inline_frames && m.has_line_numbers && m.has_filenames);
        let [sys] = r.sample_with(&["main", "work", "inl", "hot", "do_syscall_64"])[..] else {
            panic!()
        };
        let k = mapping(r.location(sys.location_id[0]));
        assert_eq!(r.s(k.filename), "[kernel.kallsyms]");
        assert_eq!(k.build_id, 0, "no build-id known");
        assert!(k.has_functions && !k.has_inline_frames);
        assert_eq!(sys.location_id[1..], hot.location_id[..], "shared locations");
        assert_eq!(p.mapping.len(), 2);
    }

    #[test]
    fn labels_say_whose_and_idle_is_kept_apart() {
        let p = decode(&[
            (MAIN, sample(1, 0, Some(S_LABEL))),
            (WORKER, sample(1, 0, Some(S_UNNAMED))),
            (STRANGER, sample(1, 0, None)),
            (IDLE, sample(1, 0, None)),
        ]);
        let r = Read(&p);
        let [m] = r.sample_with(&["main", "a;b", "phase 1"])[..] else { panic!() };
        assert_eq!((r.num_label(m, "pid"), r.num_label(m, "tid")), (Some(100), Some(100)));
        assert_eq!(r.str_label(m, "process"), Some("app"));
        assert_eq!(r.str_label(m, "thread"), Some("app"));
        assert_eq!(r.str_label(m, "cmdline"), Some("app --serve 'port 80'"));
        assert_eq!(r.str_label(m, "exe"), Some("/opt/app/bin/app"));
        assert_eq!(r.str_label(m, "container_runtime"), Some("docker"));
        assert_eq!(r.str_label(m, "container_id"), Some("3f2a9c1b0d4e"));
        let label = r.location(m.location_id[0]);
        assert_eq!(r.s(p.mapping[label.mapping_id as usize - 1].filename), "rsprof label");
        let [w] = r.sample_with(&["main", "0x1234"])[..] else { panic!() };
        assert_eq!(r.str_label(w, "thread"), Some("worker;1"));
        assert_eq!(r.num_label(w, "tid"), Some(101));
        let empty: Vec<_> = p.sample.iter().filter(|s| s.location_id.is_empty()).collect();
        assert_eq!(empty.len(), 2);
        let idle = empty.iter().find(|s| r.str_label(s, "process") == Some("[idle]")).unwrap();
        assert_eq!(r.str_label(idle, "thread"), Some("swapper/1"));
        assert_eq!((r.num_label(idle, "pid"), r.str_label(idle, "cpu")), (None, Some("1")));
        let other = empty.iter().find(|s| r.num_label(s, "pid") == Some(7)).unwrap();
        assert_eq!(
            (r.str_label(other, "process"), r.str_label(other, "thread")),
            (Some("7"), Some("8"))
        );
        assert_eq!(r.str_label(other, "container_id"), None);
    }

    #[test]
    fn same_events_same_bytes() {
        let events = [
            (WORKER, sample(1, 5, Some(S_SYSCALL))),
            (MAIN, sample(1, 0, Some(S_HOT))),
            (IDLE, sample(1, 0, None)),
            (MAIN, sample(2, 0, Some(S_LABEL))),
        ];
        let a = write(Format::Pprof, &events);
        let mut rev = events;
        rev.reverse();
        assert_eq!(a, write(Format::Pprof, &rev));
    }

    #[test]
    fn nothing_recorded_is_a_valid_empty_profile() {
        let p = decode(&[]);
        assert!(p.sample.is_empty() && p.location.is_empty());
        assert_eq!(p.sample_type.len(), 2);
    }
}
