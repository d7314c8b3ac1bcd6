//! The kernel side: loading the BPF object and attaching its programs (`object`), the kernel
//! struct offsets they need (`btf`), naming kernel addresses through the kernel (`ksym`), the one table of kernel counters (`counters`), and
//! draining (`ring`) and decoding (`decode`) what they send through the ring buffer.

pub mod btf;
pub mod counters;
pub mod decode;
pub mod ksym;
pub mod object;
pub mod ring;
