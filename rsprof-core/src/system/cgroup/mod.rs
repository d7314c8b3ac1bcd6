//! cgroup v2: the mount and tree (`fs`), `--cgroup`/`--container` selection for the kernel
//! filter (`filter`), container identity parsed from cgroup paths (`container`), and each
//! process's cgroup (`membership`).

pub mod container;
pub mod filter;
pub mod fs;
pub(crate) mod membership;
