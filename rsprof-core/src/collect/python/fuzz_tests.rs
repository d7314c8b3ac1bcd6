//! Garbage in, no panic out: random and corrupted bytes fed to the code-object reader (through
//! real `process_vm_readv` reads of this test's own memory), the three line-table decoders and
//! the merge step, for every version's layout. Failures must come back as errors or counters.
//! proptest drives the decoders (and shrinks what breaks them); the reader and merge take their
//! garbage from its deterministic ChaCha stream, the same on every run.

use std::collections::HashSet;

use profiler_common::{
    PY_FRAME_ENTRY, PY_FRAME_IDENT_MASK, PY_FRAME_IDENT_SHIFT, PY_FRAME_NO_IDENT, PY_WALK_FRAMES,
    SAMPLE_PY_MASK, SAMPLE_PY_SHIFT, SAMPLE_PY_TRUNCATED,
};
use proptest::{
    prelude::*,
    test_runner::{RngAlgorithm, TestRng},
};

use super::{
    ProcessPython, PyProcess, PyStats,
    code::{self, CodeError, CodeInfo},
    detect::PyElf,
    merge::{GONE, UNREADABLE, merge},
    offsets::{PyOffsets, TABLE},
};
use crate::{
    collect::processes::ProcessInfo,
    decode::Sample,
    model::{
        OffCpu,
        address::{FrameAddr, UserStackEnd},
        ids::{ModuleId, Pid},
    },
};

/// Proptest's deterministic ChaCha stream: the same garbage on every run.
struct Noise(TestRng);

impl Noise {
    fn new() -> Self {
        Noise(TestRng::deterministic_rng(RngAlgorithm::ChaCha))
    }

    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// `PyCode_Type` as the fake interpreter says it is: no random word equals it by chance here.
const CODE_TYPE: u64 = 0x5eed_c0de_0000_0010;

fn put(buf: &mut [u8], at: u32, v: &[u8]) {
    buf[at as usize..at as usize + v.len()].copy_from_slice(v);
}

fn addr(buf: &[u8]) -> u64 {
    buf.as_ptr() as u64
}

/// Objects laid out in this process's memory as CPython `o` would have them; each buffer lives
/// as long as the `Heap`, so their addresses stay valid.
#[derive(Default)]
struct Heap(Vec<Vec<u8>>);

impl Heap {
    fn keep(&mut self, b: Vec<u8>) -> u64 {
        let a = addr(&b);
        self.0.push(b);
        a
    }

    /// A compact ASCII `str`.
    fn str(&mut self, o: &PyOffsets, s: &str) -> u64 {
        let mut b = vec![0u8; o.str_ascii_data as usize + s.len() + 1];
        put(&mut b, o.str_length, &(s.len() as u64).to_le_bytes());
        put(&mut b, o.str_state, &(1u32 << 2 | 1 << 5 | 1 << 6).to_le_bytes());
        put(&mut b, o.str_ascii_data, s.as_bytes());
        self.keep(b)
    }

    fn bytes(&mut self, o: &PyOffsets, data: &[u8]) -> u64 {
        let mut b = vec![0u8; o.bytes_data as usize + data.len() + 1];
        put(&mut b, o.var_size, &(data.len() as u64).to_le_bytes());
        put(&mut b, o.bytes_data, data);
        self.keep(b)
    }

    /// A code object's header whose pointers are `name`, `file`, `table`.
    fn code(&mut self, o: &PyOffsets, name: u64, file: u64, table: u64, first: u32) -> u64 {
        let len = o.code_adaptive.unwrap_or(o.code_linetable + 8) as usize + 64;
        let mut b = vec![0u8; len];
        put(&mut b, o.object_type, &CODE_TYPE.to_le_bytes());
        put(&mut b, o.code_name, &name.to_le_bytes());
        if let Some(q) = o.code_qualname {
            put(&mut b, q, &name.to_le_bytes());
        }
        put(&mut b, o.code_filename, &file.to_le_bytes());
        put(&mut b, o.code_linetable, &table.to_le_bytes());
        put(&mut b, o.code_firstlineno, &first.to_le_bytes());
        if let Some(f) = o.code_firsttraceable {
            put(&mut b, f, &2u32.to_le_bytes());
        }
        self.keep(b)
    }
}

/// Addresses no object is at: null, unmapped, the top of the address space, a byte short
/// of the end of a mapping.
fn unreadable_addresses(garbage: &[u8]) -> Vec<u64> {
    vec![
        0,
        8,
        0x1000,
        0x7fff_ffff_f000,
        u64::MAX - 3,
        u64::MAX,
        addr(garbage) + garbage.len() as u64 - 1,
    ]
}

/// A table of 3.11+ entry bytes (codes 13 and 14: a varint line delta follows) and varint
/// continuation bytes: long varints, deltas near i64's edge.
fn varint_heavy() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..64).prop_map(|mut t| {
        for (i, b) in t.iter_mut().enumerate() {
            *b = if i % 9 == 0 { 0x80 | (13 + (*b & 1)) << 3 } else { (*b | 0x40) & 0x7f };
        }
        t
    })
}

/// An instruction offset as `CodeInfo::instr_offset` can make it from a garbage word.
fn offset() -> impl Strategy<Value = i64> {
    prop_oneof![0..256i64, -64..0i64, any::<i64>(), Just(i64::MAX), Just(i64::MIN)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(5000))]

    /// Decoders: any table, any first line (a C int read as u32), any offset. Never a panic;
    /// a line from `lnotab`/3.10 tables stays within what the deltas can reach.
    #[test]
    fn line_table_decoders_take_any_bytes(
        t in prop_oneof![proptest::collection::vec(any::<u8>(), 0..600), varint_heavy()],
        first in any::<u32>(),
        at in offset(),
    ) {
        let first = i64::from(first);
        let reach = 128 * (t.len() as i64 / 2);
        if let Some(l) = code::lnotab_line(&t, first, at) {
            prop_assert!((l - first).abs() <= reach, "lnotab: {} from {}", l, first);
        }
        if let Some(l) = code::linetable_310_line(&t, first, at) {
            prop_assert!((l - first).abs() <= reach, "3.10: {} from {}", l, first);
        }
        let _ = code::locations_line(&t, first, at);
    }
}

/// The code-object reader over garbage: random memory, objects with random pointers, and
/// well-formed objects with one byte corrupted at a time. Every failure is an error; nothing
/// read is longer than the reader's bounds.
#[test]
fn code_reader_takes_garbage_memory() {
    let mut rng = Noise::new();
    let pid = std::process::id();
    let garbage = rng.bytes(1 << 16);
    for o in &TABLE {
        for &a in &unreadable_addresses(&garbage) {
            let r = code::read_code(pid, a, o, Some(CODE_TYPE));
            assert!(r.is_err(), "3.{} at {a:#x}: {r:?}", o.minor);
        }
        // Random memory is no code object.
        for _ in 0..2000 {
            let a = addr(&garbage) + rng.below(garbage.len() as u64);
            let r = code::read_code(pid, a, o, Some(CODE_TYPE));
            assert!(matches!(r, Err(CodeError::NotCode | CodeError::Unreadable)), "{r:?}");
        }
        // The code type, with pointers anywhere in the garbage (random string headers).
        let mut heap = Heap::default();
        for _ in 0..2000 {
            let mut p = || addr(&garbage) + rng.below(garbage.len() as u64);
            let (name, file, table) = (p(), p(), p());
            let c = heap.code(o, name, file, table, rng.next() as u32);
            check_read(pid, c, o, false);
        }
        // Well-formed objects, each with one byte of the code header, a string or the table
        // changed (a length, a state bit, a pointer byte).
        for round in 0..3000 {
            let mut heap = Heap::default();
            let name = heap.str(o, &format!("fuzz_fn_{round}"));
            let file = heap.str(o, "fuzz.py");
            let len = rng.below(64) as usize;
            let t = rng.bytes(len);
            let table = heap.bytes(o, &t);
            let c = heap.code(o, name, file, table, rng.below(10_000) as u32);
            let info = code::read_code(pid, c, o, Some(CODE_TYPE)).expect("well formed");
            assert_eq!(info.name, format!("fuzz_fn_{round}"));
            let which = rng.below(heap.0.len() as u64) as usize;
            let buf = &mut heap.0[which];
            let at = rng.below(buf.len() as u64) as u32;
            buf[at as usize] ^= 1 << rng.below(8);
            // The code object is the last buffer: a changed type makes it no code object.
            let typed =
                which + 1 == heap.0.len() && (o.object_type..o.object_type + 8).contains(&at);
            check_read(pid, c, o, typed);
            // Garbage instruction offsets through the version's decoder.
            if let Ok(info) = code::read_code(pid, c, o, Some(CODE_TYPE)) {
                for _ in 0..8 {
                    let ip = rng.next() & profiler_common::PY_FRAME_INSTR_MASK;
                    let at = info.instr_offset(o.minor, ip);
                    let _ = info.incomplete(o.minor, at, rng.below(4));
                    let _ = info.line(o.minor, at);
                }
            }
        }
    }
}

/// A read of `c` either fails with an error or stays within the reader's bounds; NotCode only
/// if its type was changed.
fn check_read(pid: u32, c: u64, o: &PyOffsets, retyped: bool) {
    match code::read_code(pid, c, o, Some(CODE_TYPE)) {
        Ok(CodeInfo { name, file, .. }) => {
            assert!(name.chars().count() <= 4096 && file.chars().count() <= 4096);
        }
        Err(CodeError::Unreadable) => {}
        Err(CodeError::NotCode) => {
            assert!(retyped, "3.{}: the code type was read as another", o.minor)
        }
    }
}

/// The merge step over random samples of a process whose frames point at garbage, unmapped
/// memory and well-formed code objects, with random walk states, flags and native stacks:
/// no panic; every sample counted once, with Python frames or under a reason; every code
/// address read counted once; no frame named but by a well-formed code object.
#[test]
fn merge_takes_garbage_samples() {
    let mut rng = Noise::new();
    let pid = Pid(std::process::id());
    let garbage = rng.bytes(1 << 16);
    let module = ModuleId(7);
    let (eval_lo, eval_hi) = (0x1000u64, 0x2000u64);
    for o in &TABLE {
        let mut heap = Heap::default();
        let mut names = HashSet::new();
        let mut codes = unreadable_addresses(&garbage);
        // The identity the sampler would have sent for each well-formed object.
        let mut idents = std::collections::HashMap::new();
        for i in 0..40 {
            codes.push(addr(&garbage) + rng.below(garbage.len() as u64));
            let n = format!("fuzz_fn_{i}");
            let (name, file) = (heap.str(o, &n), heap.str(o, "fuzz.py"));
            let len = rng.below(64) as usize;
            let t = rng.bytes(len);
            let table = heap.bytes(o, &t);
            let c = heap.code(o, name, file, table, rng.below(10_000) as u32);
            let info = code::read_code(pid.0, c, o, Some(CODE_TYPE)).expect("well formed");
            idents.insert(c, info.ident());
            codes.push(c);
            names.insert(format!("py::{n}"));
        }
        let elf = PyElf {
            minor: o.minor,
            runtime: 0,
            code_type: Some(CODE_TYPE),
            eval: vec![(eval_lo, eval_hi)],
            loads: vec![(0, 0x10000, 0)],
            exec: Some((0, 0)),
        };
        let mut p = ProcessInfo::default();
        let py = PyProcess::new(module, 0, &elf).expect("a supported version");
        p.python = ProcessPython::Python(Box::new(py));
        let (mut on, mut off) = (PyStats::default(), PyStats::default());
        let (mut on_n, mut off_n) = (0u64, 0u64);
        let mut asked = HashSet::new();
        for round in 0..3000u64 {
            let walk = if rng.below(4) == 0 { rng.below(8) as u32 } else { PY_WALK_FRAMES };
            let mut s = Sample {
                pid,
                time: crate::model::time::MonoNs(round * 1_000_000),
                flags: (walk << SAMPLE_PY_SHIFT) & SAMPLE_PY_MASK,
                ..Default::default()
            };
            if rng.below(8) == 0 {
                s.flags |= SAMPLE_PY_TRUNCATED;
            }
            if rng.below(5) == 0 {
                s.off_cpu = Some(OffCpu { weight_ns: 1, block_ns: 1, blocks: 1, state: 1 });
            }
            for _ in 0..rng.below(if round % 50 == 0 { 200 } else { 12 }) {
                let code = codes[rng.below(codes.len() as u64) as usize];
                let mut word = rng.next();
                if rng.below(3) != 0 {
                    word &= !PY_FRAME_ENTRY;
                }
                // Mostly the object's own identity, else a random one (a freed object's).
                if let Some(&ident) = idents.get(&code)
                    && rng.below(4) != 0
                {
                    word &= !(PY_FRAME_IDENT_MASK << PY_FRAME_IDENT_SHIFT | PY_FRAME_NO_IDENT);
                    word |= ident << PY_FRAME_IDENT_SHIFT;
                }
                s.python.push((code, word));
            }
            let mut frames = Vec::new();
            if rng.below(4) == 0 {
                frames.push(FrameAddr::Truncated { end: UserStackEnd::NoTable, module: None });
            }
            for _ in 0..rng.below(16) {
                frames.push(match rng.below(4) {
                    0 => FrameAddr::User { module, offset: eval_lo + rng.below(eval_hi - eval_lo) },
                    1 => FrameAddr::User { module, offset: rng.below(0x10000) },
                    2 => FrameAddr::User { module: ModuleId(8), offset: eval_lo },
                    _ => FrameAddr::Kernel(rng.next()),
                });
            }
            let before = frames.clone();
            merge(&mut frames, &s, &mut p, &mut on, &mut off);
            *(if s.off_cpu.is_some() { &mut off_n } else { &mut on_n }) += 1;
            if walk == PY_WALK_FRAMES {
                asked.extend(s.python.iter().map(|&(c, _)| c));
            }
            // Native frames other than the eval loop's are all kept, in order.
            let not_eval = |f: &&FrameAddr| match **f {
                FrameAddr::User { module: m, offset } => {
                    m != module || !(eval_lo..eval_hi).contains(&offset)
                }
                _ => true,
            };
            let not_python = |f: &&FrameAddr| !matches!(f, FrameAddr::Jit { .. });
            let native: Vec<_> = frames.iter().filter(not_python).filter(not_eval).collect();
            let want: Vec<_> = before.iter().filter(not_eval).collect();
            assert_eq!(native, want, "3.{} round {round}", o.minor);
            assert!(frames.len() <= before.len() + s.python.len());
        }
        for (what, st, n) in [("on-CPU", on, on_n), ("off-CPU", off, off_n)] {
            assert_eq!(st.samples_with + st.without(), n, "3.{} {what}: {st:?}", o.minor);
        }
        let read = |st: PyStats| st.code_objects + st.code_unreadable + st.not_code;
        let ProcessPython::Python(py) = &p.python else { unreachable!() };
        // Each address a frame asked for was read (again only for a later sample whose
        // identity the read did not match), counted as read, unreadable or no code object.
        assert!(read(on) + read(off) >= asked.len() as u64, "3.{}: {on:?} {off:?}", o.minor);
        assert_eq!(py.codes.len(), asked.len());
        // This memory never changes: no object is ever found replaced.
        assert_eq!(on.code_reused + off.code_reused, 0);
        assert!(on.code_gone + off.code_gone > 0, "3.{}: random identities unnoticed", o.minor);
        for s in &p.meta.jit_symbols {
            let placeholder = s.name == UNREADABLE || s.name == GONE;
            assert!(placeholder || names.contains(&s.name), "named {:?}", s.name);
        }
    }
}
