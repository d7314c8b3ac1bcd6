#![no_std]
// The BPF programs live in main.rs; this empty library only lets profiler-user declare a
// build-dependency on this crate so cargo rebuilds the loader when the BPF code changes.
