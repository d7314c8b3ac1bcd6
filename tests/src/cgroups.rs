//! Real cgroup v2 trees for the cgroup-filter tests, laid out like container runtimes do, under
//! the v2 mount found in `/proc/self/mountinfo`. Needs root. Everything is removed on drop
//! (processes killed first), also when a test fails.

use std::{
    fs,
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

/// The cgroup v2 mount point (e.g. `/sys/fs/cgroup` or `/sys/fs/cgroup/unified`).
pub fn v2_mount() -> Result<PathBuf> {
    let text = fs::read_to_string("/proc/self/mountinfo")?;
    for line in text.lines() {
        let Some((left, right)) = line.split_once(" - ") else { continue };
        if right.split_whitespace().next() == Some("cgroup2") {
            let mp = left.split_whitespace().nth(4).context("mountinfo mount point")?;
            return Ok(PathBuf::from(mp));
        }
    }
    bail!("no cgroup v2 mount on this host: the cgroup filter tests need cgroup v2")
}

/// A test-owned subtree `<mount>/rsprof-test-<pid>-<name>`.
pub struct CgroupTree {
    pub mount: PathBuf,
    pub root: PathBuf,
}

impl CgroupTree {
    pub fn create(name: &str) -> Result<Self> {
        crate::fixtures::require_root()?;
        let mount = v2_mount()?;
        let root = mount.join(format!("rsprof-test-{}-{name}", std::process::id()));
        let tree = Self { mount, root };
        tree.remove_all();
        fs::create_dir(&tree.root).with_context(|| format!("mkdir {}", tree.root.display()))?;
        Ok(tree)
    }

    /// Creates `rel` (and its parents) below the tree's root; returns its directory.
    pub fn mkdir(&self, rel: &str) -> Result<PathBuf> {
        let dir = self.root.join(rel);
        fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        Ok(dir)
    }

    /// The cgroup path of `dir` as `/proc/PID/cgroup` shows it.
    pub fn cgroup_path(&self, dir: &Path) -> String {
        format!("/{}", dir.strip_prefix(&self.mount).unwrap().display())
    }

    /// All directories of the tree, deepest first.
    fn dirs(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut stack = vec![self.root.clone()];
        while let Some(d) = stack.pop() {
            if let Ok(rd) = fs::read_dir(&d) {
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        stack.push(e.path());
                    }
                }
            }
            out.push(d);
        }
        out.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        out
    }

    fn remove_all(&self) {
        if !self.root.exists() {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let mut busy = false;
            for d in self.dirs() {
                if let Ok(procs) = fs::read_to_string(d.join("cgroup.procs")) {
                    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                        busy = true;
                        // SAFETY: plain syscall; these are the test's own workload processes.
                        unsafe { kill(pid, 9) };
                    }
                }
            }
            for d in self.dirs() {
                let _ = fs::remove_dir(&d);
            }
            if !self.root.exists() || Instant::now() > deadline {
                break;
            }
            if busy {
                thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

impl Drop for CgroupTree {
    fn drop(&mut self) {
        self.remove_all();
        if self.root.exists() {
            eprintln!("warning: could not remove test cgroup {}", self.root.display());
        }
    }
}

unsafe extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}
