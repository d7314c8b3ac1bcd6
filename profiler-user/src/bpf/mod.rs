//! The kernel side: loading the BPF object and attaching its programs (`object`), the kernel
//! struct offsets they need (`btf`), and decoding what they send through the ring buffer
//! (`decode`).

pub mod btf;
pub mod decode;
pub mod object;
