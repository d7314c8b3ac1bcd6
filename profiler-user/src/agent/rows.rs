//! Windows as rows: the form `query` merges and the ClickHouse sink stores. A window is its
//! labels plus one row per (thread, stack) with the sample count, CPU and off-CPU time; stacks
//! are kept once, by a content hash, as frames root → leaf. A spooled window's gzipped pprof
//! decodes into this form; ClickHouse stores it as it is.

use std::{collections::HashMap, io::Read as _};

use anyhow::{Context as _, Result, bail};
use prost::Message as _;

use crate::{
    agent::spool::WindowMeta,
    model::stacks::{ElfAddress, Frame, FrameKind, JitLanguage},
    symbolize::{JIT_MODULE, JITDUMP_MODULE, KERNEL_MODULE, LABEL_MODULE, unnamed_offset},
    writers::pprof::proto,
};

/// One window: its labels and its rows.
#[derive(Clone, Debug)]
pub struct WindowRows {
    pub meta: WindowMeta,
    /// The sampling period (0 when unknown).
    pub period_ns: i64,
    pub rows: Vec<StackRow>,
}

/// A thread's samples of one stack in one window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackRow {
    /// The thread's process (its pid and name): a window holds all of a service's processes.
    /// 0 for the idle tasks.
    pub pid: u32,
    pub process: String,
    /// 0 for the idle tasks.
    pub tid: u32,
    pub thread: String,
    /// Key into [`Stacks`]; 0 for a sample without a stack.
    pub stack: u64,
    pub samples: u64,
    pub cpu_ns: u64,
    pub off_cpu_ns: u64,
}

/// Stacks by hash: frames root → leaf, a function inlined into the frame before it marked
/// `inlined`.
pub type Stacks = HashMap<u64, Vec<Frame>>;

/// The frame kind a module name implies (pprof and ClickHouse keep only the module).
pub fn kind_of(module: &str) -> FrameKind {
    match module {
        KERNEL_MODULE => FrameKind::Kernel,
        LABEL_MODULE => FrameKind::Label,
        JIT_MODULE | JITDUMP_MODULE => FrameKind::Jit(JitLanguage::Other),
        _ => FrameKind::User,
    }
}

/// A stable 64-bit hash of a stack (FNV-1a over length-prefixed fields): the same frames give
/// the same hash on every host and agent version, which is what deduplicates stacks in a
/// shared database. Never 0 (that means "no stack").
pub fn stack_hash(frames: &[Frame]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in (bytes.len() as u32).to_le_bytes().iter().chain(bytes) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for f in frames {
        eat(f.function.as_bytes());
        eat(f.module.as_bytes());
        eat(f.file.as_deref().unwrap_or("").as_bytes());
        eat(&f.line.unwrap_or(0).to_le_bytes());
        eat(&f.column.unwrap_or(0).to_le_bytes());
        eat(&[u8::from(f.inlined)]);
        // Only unnamed frames have one, so the hashes of other stacks stay as they were.
        if let Some(e) = &f.elf {
            eat(e.build_id.as_bytes());
            eat(&e.address.to_le_bytes());
        }
    }
    h.max(1)
}

/// Gunzips and decodes a spooled window's profile.
pub fn read_pprof_gz(pprof_gz: &[u8]) -> Result<proto::Profile> {
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(pprof_gz).read_to_end(&mut bytes).context("gunzip")?;
    proto::Profile::decode(bytes.as_slice()).context("decode pprof")
}

/// A spooled window as rows; its stacks are added to `stacks`.
pub fn from_pprof(meta: WindowMeta, p: &proto::Profile, stacks: &mut Stacks) -> Result<WindowRows> {
    let s = |i: i64| p.string_table.get(i as usize).map_or("", String::as_str);
    let functions: HashMap<u64, &proto::Function> = p.function.iter().map(|f| (f.id, f)).collect();
    let mappings: HashMap<u64, &proto::Mapping> = p.mapping.iter().map(|m| (m.id, m)).collect();
    // Each location's frames, outermost first (pprof lists the innermost inlined first).
    let mut locations: HashMap<u64, Vec<Frame>> = HashMap::new();
    for loc in &p.location {
        let mapping = mappings.get(&loc.mapping_id);
        let module = mapping.map_or("[unknown]", |m| s(m.filename));
        let build_id = mapping.map_or("", |m| s(m.build_id));
        let mut frames: Vec<Frame> = (loc.line.iter().rev().enumerate())
            .map(|(i, l)| {
                let f = functions.get(&l.function_id);
                Frame {
                    kind: kind_of(module),
                    function: f.map_or("[unknown]", |f| s(f.name)).to_owned(),
                    module: module.to_owned(),
                    file: f.map(|f| s(f.filename)).filter(|x| !x.is_empty()).map(str::to_owned),
                    line: u32::try_from(l.line).ok().filter(|&x| x > 0),
                    column: u32::try_from(l.column).ok().filter(|&x| x > 0),
                    // All but the outermost of a location were inlined into the one before.
                    inlined: i > 0,
                    elf: None,
                }
            })
            .collect();
        // A frame its agent left unnamed keeps where it is, to be named later (`query`).
        if let [f] = frames.as_mut_slice()
            && loc.address != 0
            && !build_id.is_empty()
            && unnamed_offset(f).is_some()
        {
            let build_id = build_id.to_owned();
            f.elf = Some(Box::new(ElfAddress { build_id, address: loc.address }));
        }
        locations.insert(loc.id, frames);
    }
    let value_index = |name: &str| p.sample_type.iter().position(|t| s(t.r#type) == name);
    let Some(count_i) = value_index("samples") else { bail!("no `samples` value") };
    let (cpu_i, off_i) = (value_index("cpu"), value_index("off_cpu"));
    // Two pprof samples can have the same frames (different addresses of a function without
    // line information): one row, their values summed, as the row's key is the frames' hash.
    let mut rows: Vec<StackRow> = Vec::with_capacity(p.sample.len());
    let mut index: HashMap<(u32, u32, String, u64), usize> = HashMap::new();
    for smp in &p.sample {
        let num = |k: &str| smp.label.iter().find(|x| s(x.key) == k && x.str == 0).map(|x| x.num);
        let string =
            |k: &str| smp.label.iter().find(|x| s(x.key) == k && x.str != 0).map(|x| s(x.str));
        let frames: Vec<Frame> = (smp.location_id.iter().rev())
            .flat_map(|l| locations.get(l).cloned().unwrap_or_default())
            .collect();
        let stack = if frames.is_empty() { 0 } else { stack_hash(&frames) };
        if stack != 0 {
            stacks.entry(stack).or_insert(frames);
        }
        let value =
            |i: Option<usize>| i.and_then(|i| smp.value.get(i)).copied().unwrap_or(0).max(0) as u64;
        let tid = u32::try_from(num("tid").unwrap_or(0)).unwrap_or(0);
        // A per-service window's samples say whose they are; a per-process window (an older
        // agent's) is one process, as its labels say (and its rows in ClickHouse were stored).
        let per_process = !meta.labels.process.is_empty();
        let pid = match num("pid") {
            _ if per_process => meta.labels.pid,
            Some(p) => u32::try_from(p).unwrap_or(0),
            None => 0,
        };
        let thread = string("thread").unwrap_or_default().to_owned();
        let (samples, cpu_ns, off_cpu_ns) = (value(Some(count_i)), value(cpu_i), value(off_i));
        match index.entry((pid, tid, thread, stack)) {
            std::collections::hash_map::Entry::Occupied(e) => {
                let r = &mut rows[*e.get()];
                r.samples += samples;
                r.cpu_ns += cpu_ns;
                r.off_cpu_ns += off_cpu_ns;
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                let thread = e.key().2.clone();
                let process = match string("process") {
                    _ if per_process => meta.labels.process.clone(),
                    Some(p) => p.to_owned(),
                    None => String::new(),
                };
                e.insert(rows.len());
                rows.push(StackRow {
                    pid,
                    process,
                    tid,
                    thread,
                    stack,
                    samples,
                    cpu_ns,
                    off_cpu_ns,
                });
            }
        }
    }
    Ok(WindowRows { meta, period_ns: p.period.max(0), rows })
}

/// Splits a stack's frames (root → leaf) into its nodes: a frame and those inlined into it.
pub fn nodes(frames: &[Frame]) -> Vec<&[Frame]> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=frames.len() {
        if i == frames.len() || !frames[i].inlined {
            if i > start {
                out.push(&frames[start..i]);
            }
            start = i;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::writers::testdata::frame;

    #[test]
    fn hash_is_stable_and_nodes_follow_inlining() {
        let main = frame(FrameKind::User, "main", "app");
        let mut inl = frame(FrameKind::User, "inl", "app");
        inl.inlined = true;
        let hot = frame(FrameKind::User, "hot", "app");
        let stack = vec![main.clone(), inl.clone(), hot.clone()];
        // A fixed value (computed independently): a change would split every stack stored in
        // a shared database in two.
        assert_eq!(stack_hash(&stack), 0xd258_75d1_119f_8e6c);
        assert_ne!(stack_hash(&stack), stack_hash(&[main.clone(), hot.clone(), inl.clone()]));
        assert_ne!(stack_hash(std::slice::from_ref(&main)), stack_hash(std::slice::from_ref(&inl)));
        let n = nodes(&stack);
        assert_eq!(n.len(), 2);
        assert_eq!(n[0].len(), 2);
        assert_eq!(n[1][0].function, "hot");
    }

    /// A pprof location its agent left unnamed, with an address and its mapping's build-id.
    fn unnamed_window(build_id: &str) -> proto::Profile {
        let strings = ["", "samples", "count", "app", build_id, "0x1130", "main"];
        proto::Profile {
            sample_type: vec![proto::ValueType { r#type: 1, unit: 2 }],
            mapping: vec![proto::Mapping { id: 1, filename: 3, build_id: 4, ..Default::default() }],
            location: vec![
                proto::Location {
                    id: 1,
                    mapping_id: 1,
                    address: 0x401130,
                    line: vec![proto::Line { function_id: 1, line: 0, column: 0 }],
                },
                proto::Location {
                    id: 2,
                    mapping_id: 1,
                    address: 0,
                    line: vec![proto::Line { function_id: 2, line: 3, column: 0 }],
                },
            ],
            function: vec![
                proto::Function { id: 1, name: 5, system_name: 5, ..Default::default() },
                proto::Function { id: 2, name: 6, system_name: 6, ..Default::default() },
            ],
            sample: vec![proto::Sample { location_id: vec![1, 2], value: vec![3], label: vec![] }],
            string_table: strings.map(str::to_owned).to_vec(),
            ..Default::default()
        }
    }

    fn meta() -> WindowMeta {
        WindowMeta {
            window_id: "w".into(),
            start_ms: 0,
            end_ms: 1000,
            samples: 3,
            labels: crate::agent::labels::WindowLabels {
                service_name: "app".into(),
                host: "h".into(),
                pid: 0,
                process: String::new(),
                ..Default::default()
            },
        }
    }

    #[test]
    fn unnamed_frames_keep_build_id_and_address_and_hash_apart_per_build() {
        let mut stacks = Stacks::new();
        let a = from_pprof(meta(), &unnamed_window("aaaa"), &mut stacks).unwrap();
        let b = from_pprof(meta(), &unnamed_window("bbbb"), &mut stacks).unwrap();
        let frames = &stacks[&a.rows[0].stack];
        assert_eq!(frames[0].function, "main");
        assert_eq!(frames[0].elf, None, "a named frame has none");
        let elf = frames[1].elf.as_deref().expect("the unnamed frame keeps its place");
        assert_eq!((elf.build_id.as_str(), elf.address), ("aaaa", 0x401130));
        // The same file offset in two builds is two stacks.
        assert_ne!(a.rows[0].stack, b.rows[0].stack);
    }
}
