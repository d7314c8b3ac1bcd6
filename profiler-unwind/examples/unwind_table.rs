//! Compiles the unwind tables of the given ELF files and prints their stats and the time
//! compilation took (best of 5, file already in memory): `cargo run --release -p
//! profiler-unwind --example unwind_table -- FILE...`. `--rows` also prints every row.

use std::time::{Duration, Instant};

use profiler_unwind::UnwindTable;

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let print_rows = args.iter().any(|a| a == "--rows");
    args.retain(|a| a != "--rows");
    if args.is_empty() {
        eprintln!("usage: unwind_table [--rows] FILE...");
        std::process::exit(2);
    }
    let mut total_bytes = 0;
    let mut total_time = Duration::ZERO;
    for path in &args {
        let data = std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let mut best = Duration::MAX;
        let mut table = None;
        for _ in 0..5 {
            let start = Instant::now();
            let compiled = UnwindTable::from_elf(&data);
            best = best.min(start.elapsed());
            table = Some(compiled.unwrap_or_else(|e| panic!("{path}: {e}")));
        }
        let table = table.unwrap();
        let stats = table.stats();
        println!(
            "{path}: {:.1} ms, {} rows, {} bytes, {} FDEs",
            best.as_secs_f64() * 1e3,
            stats.rows,
            stats.bytes,
            stats.fdes()
        );
        println!("  {stats:?}");
        if print_rows {
            for row in table.rows() {
                let offset = if row.cfa_kind() == profiler_common::UNWIND_CFA_RSP_LARGE {
                    row.large_cfa_offset()
                } else {
                    u64::from(row.cfa_offset)
                };
                println!(
                    "  {:#x} cfa {} +{offset} rbp {} aux {}",
                    row.pc,
                    row.cfa_kind(),
                    row.rbp_kind(),
                    row.aux
                );
            }
        }
        total_bytes += stats.bytes;
        total_time += best;
    }
    println!("total: {:.1} ms, {total_bytes} bytes", total_time.as_secs_f64() * 1e3);
}
