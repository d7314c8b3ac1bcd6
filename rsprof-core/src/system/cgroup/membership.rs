//! Which cgroup (and so which container) each profiled process is in. Samples carry the task's
//! cgroup id. The path behind an id is read from `/proc/PID/cgroup` the first time the id is
//! seen, then remembered: cgroup ids are not reused while the host runs, so every later process
//! in that cgroup (an exec storm starts a thousand a second in one) needs no read. A process is
//! looked at again only when its main thread shows up in a different cgroup. (A cgroup renamed
//! after its path was read keeps its old path here.)

use crate::{
    model::ids::{CgroupId, Pid},
    system::cgroup::container::{self, Identity},
    system::cgroup::fs::PathCache,
};

#[derive(Debug, Default)]
pub struct ProcessCgroup {
    /// cgroup v2 id of the latest sample that set `path`; 0 = not seen yet.
    pub id: CgroupId,
    /// Path below the cgroup v2 mount, when known.
    pub path: Option<String>,
    pub identity: Option<Identity>,
}

impl ProcessCgroup {
    /// Called for every sample; a comparison unless the cgroup changed.
    pub fn observe(
        &mut self,
        pid: Pid,
        main_thread: bool,
        cgroup_id: CgroupId,
        cache: &mut PathCache,
    ) {
        if cgroup_id == self.id || cgroup_id.0 == 0 || (self.id.0 != 0 && !main_thread) {
            return;
        }
        self.id = cgroup_id;
        if let Some(p) = cache.known(cgroup_id.0) {
            self.path = Some(p.to_owned());
            self.identity = container::parse(p);
            return;
        }
        if cache.is_offline() {
            self.path = None;
            self.identity = None;
            return;
        }
        let from_proc = std::fs::read_to_string(format!("/proc/{}/cgroup", pid.0))
            .ok()
            .and_then(|t| container::v2_path_from_proc(&t).map(str::to_owned));
        self.path = match from_proc {
            Some(p) => {
                cache.remember(cgroup_id.0, &p);
                Some(p)
            }
            // Gone already: find the cgroup by id (it may still exist).
            None => cache.lookup(cgroup_id.0),
        };
        self.identity = self.path.as_deref().and_then(container::parse);
    }
}

impl ProcessCgroup {
    /// A replay's: the path of the cgroup last observed, from the paths the recording
    /// resolved (`cache`), which come at its end.
    pub fn resolve_recorded(&mut self, cache: &PathCache) {
        if self.path.is_none()
            && let Some(p) = cache.known(self.id.0)
        {
            self.path = Some(p.to_owned());
            self.identity = container::parse(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt as _;

    #[test]
    fn own_process_resolves_to_its_cgroup() {
        let m = crate::system::cgroup::fs::V2Mount::find().expect("test host has cgroup v2");
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let path = container::v2_path_from_proc(&own).unwrap().to_owned();
        let id = std::fs::metadata(m.cgroup(&path).unwrap().dir).unwrap().ino();
        let mut pc = ProcessCgroup::default();
        let mut cache = PathCache::default();
        pc.observe(Pid(std::process::id()), true, CgroupId(id), &mut cache);
        assert_eq!((pc.id, pc.path.as_deref()), (CgroupId(id), Some(path.as_str())));
        // A dead pid falls back to the id → path cache.
        let mut gone = ProcessCgroup::default();
        gone.observe(Pid(u32::MAX - 1), true, CgroupId(id), &mut cache);
        assert_eq!(gone.path.as_deref(), Some(path.as_str()));
    }
}
