//! Storage and Gecko-writer throughput on a synthetic but realistic event mix; run by
//! `cargo xtask bench-storage`, which records the numbers in BENCHMARKS.md.
//!
//! Fills a `--buffer-size`-sized store (default 64 MiB) until it first recycles, with samples
//! from 400 threads in 100 processes whose stacks (2–40 frames, kernel and user) are drawn
//! from a pool of call paths sharing prefixes, as real programs' do (each process has its own
//! 200 paths; its threads sample among them). Then writes the whole
//! buffer as a gzipped Gecko profile. Prints one JSON object.

use std::{
    collections::HashMap,
    io::{self, Write},
    time::Instant,
};

use rsprof_core::{
    export::write_profile,
    model::{
        address::FrameAddr,
        ids::{ModuleId, Pid, ThreadKey, Tid},
        recording::RecordingInfo,
        stacks::{Frame, FrameKind},
        time::MonoNs,
    },
    store::{ChunkedStore, SampleSink, codec::StoredSample},
    writers::Format,
};

/// xorshift64*: deterministic and dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Call paths: each extends a random earlier one (shared prefixes), 2..=40 frames.
fn stack_pool(rng: &mut Rng, n: usize) -> Vec<Vec<FrameAddr>> {
    let mut pool: Vec<Vec<FrameAddr>> = Vec::with_capacity(n);
    for i in 0..n {
        // Extend a path of the same process (200 per process), or start a new one.
        let first = i - i % 200;
        let mut s = if i > first && rng.below(4) != 0 {
            let base = &pool[first + rng.below((i - first) as u64) as usize];
            base[..(1 + rng.below(base.len() as u64) as usize).min(base.len())].to_vec()
        } else {
            vec![]
        };
        let target = 2 + rng.below(39) as usize;
        while s.len() < target {
            let module = ModuleId(rng.below(30) as u32);
            s.push(FrameAddr::User { module, offset: rng.below(1 << 20) });
        }
        // A third of samples are in the kernel: a few kernel frames on top.
        if rng.below(3) == 0 {
            for _ in 0..1 + rng.below(6) {
                s.push(FrameAddr::Kernel(0xffff_ffff_8100_0000 + rng.below(1 << 22)));
            }
        }
        s.truncate(40);
        pool.push(s);
    }
    pool
}

struct Counting<W>(W, u64);

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.0.write(buf)?;
        self.1 += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

fn max_rss_kib() -> u64 {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid rusage pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    ru.ru_maxrss as u64
}

fn main() {
    let buffer: usize = std::env::args()
        .skip_while(|a| a != "--buffer-size")
        .nth(1)
        .map(|s| s.parse().expect("--buffer-size BYTES"))
        .unwrap_or(64 << 20);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let pool = stack_pool(&mut rng, 20_000);
    let threads: Vec<ThreadKey> =
        (0..400).map(|i| ThreadKey::Task { pid: Pid(1000 + i / 4), tid: Tid(1000 + i) }).collect();
    let rss_before = max_rss_kib();

    let mut store = ChunkedStore::new(buffer);
    let mut time = 1_000_000_000u64;
    let mut n = 0u64;
    let t0 = Instant::now();
    while store.buffer().recycled().chunks == 0 {
        time += 50_000 + rng.below(10_000);
        let t = rng.below(threads.len() as u64) as usize;
        let per_process = pool.len() / (threads.len() / 4);
        let path = (t / 4) * per_process + rng.below(per_process as u64) as usize;
        let stack = store.intern_stack(&pool[path]);
        let thread = threads[t];
        let cpu = 900_000 + rng.below(100_000);
        store.push_sample(
            thread,
            StoredSample { time_ns: time, cpu_delta_ns: cpu, stack, off_cpu: None },
        );
        n += 1;
    }
    let encode_s = t0.elapsed().as_secs_f64();
    let data_bytes: u64 = store.buffer().live_chunks().map(|c| c.header.end as u64).sum();
    let kept = n - store.buffer().recycled().blocks;
    let rss_filled = max_rss_kib();
    let table_bytes = store.table_bytes();

    // Symbols as the symbolizer would return them: one frame per address.
    let snap = store.into_snapshot();
    let symbols: HashMap<FrameAddr, Vec<Frame>> = snap
        .unique_frames()
        .into_iter()
        .map(|a| {
            let (kind, function, module) = match a {
                FrameAddr::Kernel(x) => (
                    FrameKind::Kernel,
                    format!("kfunc_{:x}", x & 0xfff0),
                    "[kernel.kallsyms]".to_owned(),
                ),
                FrameAddr::User { module, offset } => (
                    FrameKind::User,
                    format!("function_{}_{:x}", module.0, offset & 0xfff00),
                    format!("lib{}.so", module.0),
                ),
                FrameAddr::Unmapped(x) => {
                    (FrameKind::User, format!("0x{x:x}"), "[unknown]".to_owned())
                }
                FrameAddr::Label { label, .. } => {
                    (FrameKind::Label, format!("label {:x}", label.0), String::new())
                }
                FrameAddr::Anon { addr, .. } => {
                    (FrameKind::User, format!("0x{addr:x}"), "[anon]".to_owned())
                }
                FrameAddr::Jit { symbol, .. } => (
                    FrameKind::Jit(rsprof_core::model::stacks::JitLanguage::Other),
                    format!("jit {}", symbol.0),
                    "[jit]".to_owned(),
                ),
                FrameAddr::OffCpuNotCaptured => (
                    FrameKind::User,
                    "[off-CPU: stack not captured]".to_owned(),
                    "rsprof-bpf".to_owned(),
                ),
                FrameAddr::Truncated { end, .. } => {
                    (FrameKind::User, format!("[truncated: {end:?}]"), "rsprof-bpf".to_owned())
                }
            };
            (
                a,
                vec![Frame {
                    kind,
                    function,
                    module,
                    file: None,
                    line: None,
                    column: None,
                    inlined: false,
                    elf: None,
                }],
            )
        })
        .collect();
    let procs = HashMap::new();
    let info = RecordingInfo {
        start: MonoNs(1_000_000_000),
        start_wall_ms: 1.7e12,
        end: MonoNs(time),
        frequency: 999,
        logical_cpus: 2,
        physical_cpus: 2,
        product: "bench".into(),
        oscpu: "Linux".into(),
    };
    let note = rsprof_core::model::markers::Marker {
        name: "unused".into(),
        schema: "unused".into(),
        phase: rsprof_core::model::markers::MarkerPhase::Instant,
        start: MonoNs(time),
        end: MonoNs(time),
        fields: vec![],
    };
    let path = std::env::temp_dir().join(format!("rsprof-bench-{}.json.gz", std::process::id()));
    let file = std::fs::File::create(&path).expect("temp file");
    let gz = flate2::write::GzEncoder::new(io::BufWriter::new(file), flate2::Compression::fast());
    let mut counting = Counting(gz, 0);
    let t1 = Instant::now();
    let stats = write_profile(
        Format::Gecko,
        &snap,
        &procs,
        (&symbols, &Default::default()),
        &info,
        &[],
        &[],
        (threads[0], &note),
        None,
        &mut counting,
    )
    .expect("write")
    .0;
    let json_bytes = counting.1;
    counting.0.finish().expect("gzip").flush().expect("flush");
    let write_s = t1.elapsed().as_secs_f64();
    let gz_bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    let _ = std::fs::remove_file(&path);
    assert_eq!(stats.samples, kept, "every kept sample is written");
    let rss_peak = max_rss_kib();

    println!(
        "{}",
        serde_json::json!({
            "buffer_bytes": buffer,
            "events": n,
            "events_kept": kept,
            "encode_events_per_s": n as f64 / encode_s,
            "bytes_per_sample": data_bytes as f64 / kept as f64,
            "stack_nodes_bytes": table_bytes,
            "write_samples_per_s": kept as f64 / write_s,
            "write_json_mb_per_s": json_bytes as f64 / 1e6 / write_s,
            "write_seconds": write_s,
            "json_bytes": json_bytes,
            "gzip_bytes": gz_bytes,
            "rss_start_kib": rss_before,
            "rss_filled_kib": rss_filled,
            "rss_peak_kib": rss_peak,
        })
    );
}
