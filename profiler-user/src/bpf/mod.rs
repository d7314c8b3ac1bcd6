//! The kernel side: loading the BPF object and attaching its programs (`object`), the kernel
//! struct offsets they need (`btf`), naming kernel addresses through the kernel (`ksym`) and draining (`ring`) what they send
//! through the ring buffer. The records' decoding and the kernel counters' table are the core's
//! (`rsprof_core::decode`, `rsprof_core::counters`): a replay needs them without a kernel.

pub mod btf;
pub mod ksym;
pub mod object;
pub mod ring;
pub mod unsent;

// The kernel's record layouts and counters are decoded by the root-free core.
pub use rsprof_core::{counters, decode};
