//! Fixture for the integration tests: the rsprof provider from Rust.
//!
//!   rsprof_demo labels SECONDS   two threads: main → work → [label "rust-hot"] → hot half
//!                                the time, unlabelled() the other half
//!   rsprof_demo markers N        N markers "tick"/"marker i", N intervals "step", N counters;
//!                                meanwhile a thread named "worker" fires N "worker-tick"

use std::{
    hint::black_box,
    time::{Duration, Instant},
};

use rsprof_probes::{counter, interval, label, marker};

fn spin(d: Duration) {
    let end = Instant::now() + d;
    let mut x = 0u64;
    while Instant::now() < end {
        for i in 0..1000 {
            x = black_box(x.wrapping_add(i));
        }
    }
    black_box(x);
}

// The two bodies differ so that the linker cannot fold them into one function.
#[inline(never)]
fn hot() {
    spin(Duration::from_millis(10));
    black_box("hot");
}

#[inline(never)]
fn unlabelled() {
    spin(Duration::from_millis(10));
    black_box("unlabelled");
}

#[inline(never)]
fn work(seconds: f64) {
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < end {
        {
            let _l = label!("rust-hot");
            hot();
        }
        unlabelled();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map(String::as_str).unwrap_or("labels");
    match mode {
        "labels" => {
            let seconds: f64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2.0);
            let t = std::thread::spawn(move || work(seconds));
            work(seconds);
            t.join().unwrap();
        }
        "markers" => {
            let n: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10);
            let worker = std::thread::Builder::new()
                .name("worker".into())
                .spawn(move || {
                    for _ in 0..n {
                        marker!("worker-tick", "w");
                        spin(Duration::from_micros(500));
                    }
                })
                .unwrap();
            for i in 0..n {
                marker!("tick", "marker {i}");
                let t0 = Instant::now();
                {
                    let _i = interval!("step", i);
                    spin(Duration::from_millis(1));
                }
                println!("interval {i} {}", t0.elapsed().as_nanos());
                counter!("progress", i as i64);
            }
            worker.join().unwrap();
        }
        m => {
            eprintln!("unknown mode {m}");
            std::process::exit(2);
        }
    }
}
