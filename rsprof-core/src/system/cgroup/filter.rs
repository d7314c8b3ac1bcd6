//! `--cgroup` / `--container`: resolves the user's choices to cgroup v2 ids for the kernel
//! filter, and lists candidate containers (`rsprof-bpf list-containers`).

use std::fmt::Write as _;

use anyhow::{Result, bail};
use profiler_common::{CgroupFilter, MAX_CGROUP_LEVEL, MAX_SELECTED_CGROUPS};

use crate::{
    system::cgroup::container::{self, Identity},
    system::cgroup::fs::{Cgroup, V2Mount},
};

/// The cgroups a recording is restricted to.
#[derive(Clone, Debug)]
pub struct Selection {
    pub mount: V2Mount,
    /// Each selected cgroup, with how the user named it (for messages).
    pub cgroups: Vec<(Cgroup, String)>,
}

/// A container found on the host: its root cgroup, identity and process count (subtree).
#[derive(Clone, Debug)]
pub struct Found {
    pub cgroup: Cgroup,
    pub identity: Option<Identity>,
    pub nprocs: usize,
}

/// Cgroups worth showing: containers and services (at their root cgroup), and any other
/// cgroup that holds processes. `nprocs` counts the cgroup and everything below it, i.e. what
/// `--cgroup` on it would profile.
pub fn survey(mount: &V2Mount) -> Vec<Found> {
    let all = mount.walk();
    // Subtree counts: walk is parents-first, so add each count to all its ancestors.
    let mut totals: std::collections::HashMap<&str, usize> = Default::default();
    for (cg, n) in &all {
        let mut p = cg.path.as_str();
        loop {
            *totals.entry(p).or_default() += n;
            if p == "/" {
                break;
            }
            p = match p.rfind('/') {
                Some(0) => "/",
                Some(i) => &p[..i],
                None => break,
            };
        }
    }
    all.iter()
        .filter_map(|(cg, own)| {
            let identity = container::parse(&cg.path);
            let is_root = identity.as_ref().is_some_and(|i| i.container_cgroup == cg.path);
            // Sub-cgroups of a container are part of it: list the container once.
            let inside = identity.is_some() && !is_root;
            if inside || (identity.is_none() && *own == 0) {
                return None;
            }
            let nprocs = if identity.is_some() { totals[cg.path.as_str()] } else { *own };
            Some(Found { cgroup: cg.clone(), identity, nprocs })
        })
        .collect()
}

/// The id as shown in listings and messages: 12 hex digits, or the whole name.
pub fn display_id(i: &Identity) -> &str {
    if i.is_container() && i.id.len() > 12 && i.id.bytes().all(|b| b.is_ascii_hexdigit()) {
        &i.id[..12]
    } else {
        &i.id
    }
}

fn describe(found: &Found) -> String {
    match &found.identity {
        Some(i) => format!("{} {} ({})", i.runtime.name(), display_id(i), found.cgroup.path),
        None => found.cgroup.path.clone(),
    }
}

/// The container whose id (or LXC name) starts with `arg`, among `found`.
pub fn match_container<'f>(found: &'f [Found], arg: &str) -> Result<&'f Found> {
    let want = arg.to_ascii_lowercase();
    let containers: Vec<&Found> =
        found.iter().filter(|f| f.identity.as_ref().is_some_and(|i| i.is_container())).collect();
    let id = |f: &Found| f.identity.as_ref().map(|i| i.id.to_ascii_lowercase()).unwrap();
    if let Some(exact) = containers.iter().find(|f| id(f) == want) {
        return Ok(exact);
    }
    let hits: Vec<&Found> = containers
        .iter()
        .copied()
        .filter(|f| !want.is_empty() && id(f).starts_with(&want))
        .collect();
    let list = |v: &[&Found]| v.iter().map(|f| describe(f)).collect::<Vec<_>>().join(", ");
    match hits.len() {
        1 => Ok(hits[0]),
        0 if containers.is_empty() => {
            bail!("no container matches '{arg}': no containers found on this host")
        }
        0 => bail!("no container matches '{arg}'; containers on this host: {}", list(&containers)),
        _ => bail!("container id '{arg}' is ambiguous, it matches: {}", list(&hits)),
    }
}

impl Selection {
    /// Resolves `--cgroup` and `--container` arguments; None when neither was given.
    pub fn from_args(cgroups: &[String], containers: &[String]) -> Result<Option<Self>> {
        if cgroups.is_empty() && containers.is_empty() {
            return Ok(None);
        }
        let mount = V2Mount::find()?;
        let mut sel = Vec::new();
        for arg in cgroups {
            let cg = mount.resolve(arg)?;
            let what = format!("cgroup {}", cg.path);
            sel.push((cg, what));
        }
        if !containers.is_empty() {
            let found = survey(&mount);
            for arg in containers {
                let f = match_container(&found, arg)?;
                sel.push((f.cgroup.clone(), format!("container {}", describe(f))));
            }
        }
        if sel.len() > MAX_SELECTED_CGROUPS as usize {
            bail!("too many cgroups selected ({}; at most {MAX_SELECTED_CGROUPS})", sel.len());
        }
        if let Some((cg, _)) =
            sel.iter().find(|(c, _)| c.level.is_some_and(|l| l > MAX_CGROUP_LEVEL))
        {
            bail!("cgroup {} is nested too deeply (more than {MAX_CGROUP_LEVEL} levels)", cg.path);
        }
        Ok(Some(Self { mount, cgroups: sel }))
    }

    /// The kernel-side settings: which ancestor levels to look at.
    pub fn kernel_config(&self) -> CgroupFilter {
        let mut levels = 0u64;
        for (cg, _) in &self.cgroups {
            match cg.level {
                Some(l) => levels |= 1 << l,
                // Unknown depth (cgroup namespace): look at every level.
                None => levels = u64::MAX,
            }
        }
        CgroupFilter { enabled: 1, _pad: 0, levels }
    }

    pub fn ids(&self) -> Vec<u64> {
        self.cgroups.iter().map(|(c, _)| c.id).collect()
    }

    /// The processes in the selected cgroups and below them now (their `cgroup.procs`), as the
    /// kernel's filter selects them: what a recording's start-up pass needs to read.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids = Vec::new();
        let mut dirs: Vec<std::path::PathBuf> =
            self.cgroups.iter().map(|(c, _)| c.dir.clone()).collect();
        while let Some(dir) = dirs.pop() {
            if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                pids.extend(procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
            }
            let Ok(entries) = super::fs::child_dirs(&dir) else { continue };
            dirs.extend(entries.map(|e| e.path()));
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// e.g. `cgroup /a/b, container docker 3f2a9c1b4e5d (/system.slice/…)`.
    pub fn describe(&self) -> String {
        self.cgroups.iter().map(|(_, d)| d.as_str()).collect::<Vec<_>>().join(", ")
    }

    /// Printed after the recording: how the filter did, and a clear warning when it matched
    /// nothing (instead of an unexplained empty profile).
    pub fn end_note(&self, samples: u64, filtered: u64) -> String {
        let mut s = String::new();
        if samples == 0 {
            let _ = writeln!(
                s,
                "rsprof-bpf: warning: no sample matched the filter ({}), so the profile is \
                 empty; {filtered} samples were filtered out in the kernel. Nothing selected \
                 ran on a CPU during the recording: check the cgroup with \
                 `rsprof-bpf list-containers`.",
                self.describe()
            );
        } else {
            let _ = writeln!(
                s,
                "filter: {}: {samples} samples kept, {filtered} filtered out in the kernel",
                self.describe()
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn found(path: &str) -> Found {
        Found {
            cgroup: Cgroup { path: path.into(), dir: PathBuf::new(), id: 1, level: Some(1) },
            identity: container::parse(path),
            nprocs: 1,
        }
    }

    #[test]
    fn container_prefixes() {
        let a = "3f2a9c1b4e5d6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8";
        let b = "3f2a9c1bffff6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8";
        let all = vec![
            found(&format!("/system.slice/docker-{a}.scope")),
            found(&format!("/system.slice/docker-{b}.scope")),
            found("/lxc/web01"),
            found("/system.slice/ssh.service"),
        ];
        assert_eq!(match_container(&all, "3f2a9c1b4e").unwrap().identity.as_ref().unwrap().id, a);
        assert_eq!(match_container(&all, "3F2A9C1BFF").unwrap().identity.as_ref().unwrap().id, b);
        assert_eq!(match_container(&all, "web01").unwrap().cgroup.path, "/lxc/web01");
        let e = match_container(&all, "3f2a9c1b").unwrap_err().to_string();
        assert!(
            e.contains("ambiguous") && e.contains("3f2a9c1b4e5d") && e.contains("3f2a9c1bffff")
        );
        assert!(!e.contains("web01"), "only the matching ones: {e}");
        let e = match_container(&all, "deadbeef").unwrap_err().to_string();
        assert!(e.contains("no container matches") && e.contains("lxc web01"), "{e}");
        assert!(!e.contains("ssh.service"), "services are not containers: {e}");
        let e = match_container(&all[3..], "x").unwrap_err().to_string();
        assert!(e.contains("no containers found"), "{e}");
    }
}
