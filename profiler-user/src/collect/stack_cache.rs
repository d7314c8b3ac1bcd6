//! Stacks as the kernel sent them (addresses) → the stack ids they were stored as.
//!
//! Most samples repeat a stack seen moments before (a hot loop, a thread blocked in the same
//! call). Normalizing such a stack again (each address to its file and offset) and interning
//! it (hashing and comparing its normalized frames) were the larger part of a sample's cost in
//! userspace; a hit here is one hash of the raw addresses instead.
//!
//! A raw stack normalizes the same way for as long as its process's address space keeps its
//! [version](crate::collect::modules::AddressSpace::version), so the version is part of the
//! key; the store's [`StackStamp`] says when a remembered id may have been pruned.

use std::{collections::HashMap, hash::BuildHasher};

use crate::{
    model::ids::StackId,
    store::{SampleSink, StackStamp},
};

/// Bounds the map: at ~30 addresses a key, about a MiB. It is emptied when full.
const MAX_ENTRIES: usize = 4096;
/// Slots of the filter of keys missed once (a power of two).
const SEEN_SLOTS: usize = 4096;

pub struct StackCache {
    map: HashMap<Box<[u64]>, Entry, foldhash::fast::RandomState>,
    /// Hashes of keys missed once, by hash: a key enters the map at its second miss, so a
    /// workload whose stacks rarely repeat (an interpreter's varied leaf addresses) does not
    /// pay for copying every key into a map that would be emptied before it was hit.
    seen: Box<[u64]>,
    /// The key of the last lookup, for the insert that follows a miss.
    key: Vec<u64>,
    /// The last lookup missed a key seen before: [`StackCache::insert`] keeps it.
    keep: bool,
    pub hits: u64,
}

impl Default for StackCache {
    fn default() -> Self {
        Self {
            map: HashMap::default(),
            seen: vec![0; SEEN_SLOTS].into_boxed_slice(),
            key: Vec::new(),
            keep: false,
            hits: 0,
        }
    }
}

struct Entry {
    stack: Option<StackId>,
    /// User frames in no mapping, counted again at each hit.
    unmapped: u64,
    stamp: StackStamp,
}

impl StackCache {
    /// The stack id and unmapped-frame count stored for this raw stack, if it was stored in
    /// the store's current epoch. `flags`: whatever else of the sample its stored stack
    /// depends on (how the user walk ended, off-CPU).
    pub fn lookup(
        &mut self,
        space_version: u64,
        flags: u64,
        kernel: &[u64],
        user: &[u64],
        store: &mut impl SampleSink,
    ) -> Option<(Option<StackId>, u64)> {
        self.key.clear();
        self.key.extend([space_version, flags, kernel.len() as u64]);
        self.key.extend_from_slice(kernel);
        self.key.extend_from_slice(user);
        let Some(e) = self.map.get_mut(self.key.as_slice()) else {
            let h = self.map.hasher().hash_one(self.key.as_slice()) | 1;
            let slot = &mut self.seen[h as usize & (SEEN_SLOTS - 1)];
            self.keep = *slot == h;
            *slot = h;
            return None;
        };
        let now = store.stack_stamp();
        if e.stamp.epoch != now.epoch {
            self.keep = true;
            return None;
        }
        if e.stamp.generation != now.generation {
            e.stamp.generation = now.generation;
            if let Some(id) = e.stack {
                store.touch_stack(id);
            }
        }
        self.hits += 1;
        Some((e.stack, e.unmapped))
    }

    /// Remembers what the raw stack of the last [`lookup`](Self::lookup) (a miss) was stored
    /// as, at `stamp` (taken after interning it), if that stack was missed before.
    pub fn insert(&mut self, stack: Option<StackId>, unmapped: u64, stamp: StackStamp) {
        if !std::mem::take(&mut self.keep) {
            return;
        }
        if self.map.len() >= MAX_ENTRIES {
            self.map.clear();
        }
        self.map.insert(self.key.as_slice().into(), Entry { stack, unmapped, stamp });
    }
}
