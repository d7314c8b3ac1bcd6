//! CPython frames: the root-free parts (interpreter detection, struct offsets, code objects,
//! merging into native stacks) are the core's; `loader` hands each interpreter to the kernel.

pub mod loader;

pub use rsprof_core::collect::python::*;
