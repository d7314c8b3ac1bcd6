//! The cgroup filter: is the current task in one of the selected cgroups or below one?
//! Checked before any stack is taken, so a filtered-out sample costs one helper call and one
//! hash lookup per selected level (usually one), and cgroups created under a selected one
//! during the recording match without userspace doing anything.

use aya_ebpf::{
    helpers::generated::bpf_get_current_ancestor_cgroup_id, macros::map, maps::HashMap,
};
use profiler_common::{CgroupFilter, MAX_CGROUP_LEVEL, MAX_SELECTED_CGROUPS};

#[unsafe(no_mangle)]
static CGROUP_FILTER: CgroupFilter = CgroupFilter { enabled: 0, _pad: 0, levels: 0 };

/// cgroup v2 ids (directory inode numbers) of the selected cgroups; value unused.
#[map]
static SELECTED_CGROUPS: HashMap<u64, u8> = HashMap::with_max_entries(MAX_SELECTED_CGROUPS, 0);

#[inline(always)]
pub fn selected() -> bool {
    // SAFETY: read-only global patched by the loader; volatile keeps the defaults out.
    let f = unsafe { core::ptr::read_volatile(&CGROUP_FILTER) };
    if f.enabled == 0 {
        return true;
    }
    let mut level: u32 = 0;
    while level <= MAX_CGROUP_LEVEL {
        if f.levels >> level == 0 {
            return false;
        }
        if f.levels & (1u64 << level) != 0 {
            // SAFETY: plain helper call; 0 means the task's cgroup is above this level.
            let id = unsafe { bpf_get_current_ancestor_cgroup_id(level as i32) };
            if id == 0 {
                return false;
            }
            if unsafe { SELECTED_CGROUPS.get(&id) }.is_some() {
                return true;
            }
        }
        level += 1;
    }
    false
}
