//! The cgroup v2 filesystem: finding its mount (from `/proc/self/mountinfo`, so hybrid hosts
//! with v2 at `/sys/fs/cgroup/unified` work), resolving user-given paths to cgroup ids, and
//! walking the tree.
//!
//! A cgroup's id, as `bpf_get_current_cgroup_id` returns it, is the inode number of its
//! directory (the kernfs node id). Its level (root = 0) is what
//! `bpf_get_current_ancestor_cgroup_id` takes.

use std::{
    collections::HashMap,
    fs,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};

/// `readlink /proc/self/ns/cgroup` in the initial cgroup namespace (PROC_CGROUP_INIT_INO).
const INIT_CGROUP_NS: &str = "cgroup:[4026531835]";

#[derive(Clone, Debug)]
pub struct V2Mount {
    /// Where the hierarchy is mounted, e.g. `/sys/fs/cgroup` or `/sys/fs/cgroup/unified`.
    pub path: PathBuf,
    /// Level of the mount's root cgroup; None when unknown (inside a cgroup namespace the
    /// mount root is the namespace's root, whose real depth is not visible).
    pub root_level: Option<u32>,
}

/// One cgroup directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cgroup {
    /// Path below the mount, `/` for the root, as in `/proc/PID/cgroup`.
    pub path: String,
    pub dir: PathBuf,
    pub id: u64,
    /// Level in the kernel's hierarchy (root = 0), when known.
    pub level: Option<u32>,
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// (mount point, mount root) of the first cgroup2 mount in mountinfo text.
pub fn parse_mountinfo(text: &str) -> Option<(PathBuf, String)> {
    text.lines().find_map(|line| {
        // Fields: id parent major:minor root mountpoint options [optional...] - fstype ...
        let (left, right) = line.split_once(" - ")?;
        if right.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let f: Vec<&str> = left.split_whitespace().collect();
        Some((PathBuf::from(unescape(f.get(4)?)), unescape(f.get(3)?)))
    })
}

fn depth(path: &str) -> u32 {
    path.split('/').filter(|c| !c.is_empty()).count() as u32
}

impl V2Mount {
    /// Finds the cgroup v2 mount, or says clearly that the host has none.
    pub fn find() -> Result<Self> {
        let text =
            fs::read_to_string("/proc/self/mountinfo").context("read /proc/self/mountinfo")?;
        let Some((path, root)) = parse_mountinfo(&text) else {
            bail!(
                "this host has no cgroup v2 hierarchy mounted (no cgroup2 entry in \
                 /proc/self/mountinfo); cgroup and container filtering need cgroup v2"
            );
        };
        let init_ns =
            fs::read_link("/proc/self/ns/cgroup").is_ok_and(|l| l.as_os_str() == INIT_CGROUP_NS);
        let root_level = (init_ns && !root.contains("..")).then(|| depth(&root));
        Ok(Self { path, root_level })
    }

    /// The cgroup at `rel` (a path below the mount, leading `/` optional).
    pub fn cgroup(&self, rel: &str) -> Result<Cgroup> {
        let rel = rel.trim_matches('/');
        let dir = if rel.is_empty() { self.path.clone() } else { self.path.join(rel) };
        if rel.split('/').any(|c| c == ".." || c == ".") || !dir.join("cgroup.procs").is_file() {
            bail!("no cgroup '/{rel}' under the cgroup v2 mount {}", self.path.display());
        }
        let id = fs::metadata(&dir).with_context(|| format!("stat {}", dir.display()))?.ino();
        Ok(Cgroup {
            path: format!("/{rel}"),
            dir,
            id,
            level: self.root_level.map(|l| l + depth(rel)),
        })
    }

    /// Resolves `--cgroup ARG`: a directory path under the mount (`/sys/fs/cgroup/x`), or a
    /// path relative to the mount, with or without a leading `/` (`/system.slice/x.service`).
    pub fn resolve(&self, arg: &str) -> Result<Cgroup> {
        let p = Path::new(arg);
        if let Ok(rel) = p.strip_prefix(&self.path) {
            return self.cgroup(&rel.to_string_lossy());
        }
        self.cgroup(arg).map_err(|_| {
            anyhow::anyhow!(
                "no cgroup '{arg}': neither a directory under the cgroup v2 mount {} nor a path \
                 relative to it",
                self.path.display()
            )
        })
    }

    /// Every cgroup, parents before children, with the number of processes directly in it.
    pub fn walk(&self) -> Vec<(Cgroup, usize)> {
        let mut out = Vec::new();
        let mut stack = vec![String::new()];
        while let Some(rel) = stack.pop() {
            let Ok(cg) = self.cgroup(&rel) else { continue };
            let Ok(entries) = child_dirs(&cg.dir) else { continue };
            let mut children: Vec<String> =
                entries.map(|e| format!("{rel}/{}", e.file_name().to_string_lossy())).collect();
            children.sort_unstable_by(|a, b| b.cmp(a));
            stack.extend(children);
            let n = count_procs(&cg.dir);
            out.push((cg, n));
        }
        out
    }
}

/// The directories directly under `dir`: its child cgroups.
pub fn child_dirs(dir: &Path) -> std::io::Result<impl Iterator<Item = fs::DirEntry>> {
    Ok(fs::read_dir(dir)?
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir())))
}

/// Processes directly in the cgroup at `dir` (0 when unreadable, e.g. it was just removed).
pub fn count_procs(dir: &Path) -> usize {
    fs::read_to_string(dir.join("cgroup.procs")).map_or(0, |s| s.lines().count())
}

/// cgroup id → path, for processes that are gone before their `/proc/PID/cgroup` was read.
/// Filled from the paths seen in `/proc`, then by one walk of the tree per unknown id.
#[derive(Debug, Default)]
pub struct PathCache {
    mount: Option<Option<V2Mount>>,
    paths: HashMap<u64, Option<String>>,
    /// See [`PathCache::go_offline`].
    offline: bool,
}

impl PathCache {
    pub fn remember(&mut self, id: u64, path: &str) {
        self.paths.insert(id, Some(path.to_owned()));
    }

    /// The path of `id` if already known (no read, no walk).
    pub fn known(&self, id: u64) -> Option<&str> {
        self.paths.get(&id)?.as_deref()
    }

    /// Paths resolved so far, by cgroup id.
    pub fn resolved(&self) -> impl Iterator<Item = (u64, &str)> {
        self.paths.iter().filter_map(|(&id, p)| Some((id, p.as_deref()?)))
    }

    /// No reads of /proc or walks of the cgroup tree from now on (a replay: only the paths
    /// remembered are known).
    pub fn go_offline(&mut self) {
        self.mount = Some(None);
        self.offline = true;
    }

    pub fn is_offline(&self) -> bool {
        self.offline
    }

    pub fn lookup(&mut self, id: u64) -> Option<String> {
        if let Some(p) = self.paths.get(&id) {
            return p.clone();
        }
        let mount = self.mount.get_or_insert_with(|| V2Mount::find().ok()).clone();
        if let Some(m) = mount {
            for (cg, _) in m.walk() {
                self.paths.entry(cg.id).or_insert(Some(cg.path));
            }
        }
        // Gone from the tree too: remember the miss so the walk is not repeated.
        self.paths.entry(id).or_insert(None).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_hybrid_and_unified() {
        let hybrid = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
        assert_eq!(
            parse_mountinfo(hybrid),
            Some((PathBuf::from("/sys/fs/cgroup/unified"), "/".to_owned()))
        );
        let unified = "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - \
                       cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n";
        assert_eq!(parse_mountinfo(unified).unwrap().0, PathBuf::from("/sys/fs/cgroup"));
        let v1_only = "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n";
        assert_eq!(parse_mountinfo(v1_only), None);
        let escaped = "41 31 0:38 /a\\040b /mnt/my\\040cg rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            parse_mountinfo(escaped),
            Some((PathBuf::from("/mnt/my cg"), "/a b".to_owned()))
        );
    }

    #[test]
    fn depths() {
        assert_eq!(depth("/"), 0);
        assert_eq!(depth(""), 0);
        assert_eq!(depth("/a/b/"), 2);
    }

    /// This host's own cgroup resolves, with the inode as id and a consistent level.
    #[test]
    fn resolves_own_cgroup() {
        let Ok(m) = V2Mount::find() else {
            panic!("test host has no cgroup v2 mount: the cgroup features cannot be tested here")
        };
        let own = fs::read_to_string("/proc/self/cgroup").unwrap();
        let path = crate::system::cgroup::container::v2_path_from_proc(&own).unwrap().to_owned();
        let cg = m.resolve(&path).unwrap();
        assert_eq!(cg.path, if path == "/" { "/".to_owned() } else { path.clone() });
        let by_dir = m.resolve(&cg.dir.to_string_lossy()).unwrap();
        assert_eq!(by_dir, cg);
        assert!(m.resolve("/no/such/cgroup-rsprof").is_err());
        assert!(m.resolve("../..").is_err());
        let root = m.cgroup("/").unwrap();
        assert_eq!(root.path, "/");
        assert!(m.walk().iter().any(|(c, _)| c.id == cg.id));
    }
}
