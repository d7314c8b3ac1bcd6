//! Stacks as the kernel sent them (addresses) → the stack ids they were stored as.
//!
//! Most samples repeat a stack seen moments before (a hot loop, a thread blocked in the same
//! call). Normalizing such a stack again (each address to its file and offset) and interning
//! it (hashing and comparing its normalized frames) were the larger part of a sample's cost in
//! userspace; a hit here is two hashes of the raw addresses instead.
//!
//! A raw stack normalizes the same way for as long as its process's address space keeps its
//! [version](crate::collect::modules::AddressSpace::version), so the version is part of the
//! key; the store's [`StackStamp`] says when a remembered id may have been pruned.
//!
//! An entry holds a 128-bit fingerprint of its key (two 64-bit hashes, seeded apart at
//! random), not the key: comparing the key itself read it from its own allocation, a cache
//! miss per lookup, and a record's userspace time at 999 Hz on 2 busy CPUs fell from 0.33 to
//! 0.26 µs without it (BENCHMARKS.md). Two different stacks match only if both hashes
//! collide, about 2^-128 per comparison: far rarer than a memory error.

use std::hash::BuildHasher;

use hashbrown::HashTable;

use crate::{
    model::ids::StackId,
    store::{SampleSink, StackStamp},
};

/// Bounds each of the map's two generations: 8,192 entries (two `bash` loops keep about 4,000
/// stacks hot), of a fixed size whatever the stacks' depth.
pub(crate) const GENERATION_ENTRIES: usize = 8192;
/// Slots of the filter of keys missed once (a power of two), two candidates per key.
const SEEN_SLOTS: usize = 8192;

pub struct StackCache {
    /// Keys inserted or hit since the last turnover. When it is full it becomes `older` and
    /// the previous `older` is dropped; a key of `older` that is hit moves back. So a hot set
    /// up to a generation's size survives the turnover, where emptying one map when full had
    /// dropped it all at once: an interpreter's loop keeps thousands of stacks hot (two
    /// `bash` loops about 3,700), and half their lookups missed.
    map: Generation,
    older: Generation,
    /// The fingerprint's two hashers; the first also places the key in both generations and
    /// the filter, so a key is hashed twice per lookup in all.
    hasher: foldhash::fast::RandomState,
    second: foldhash::fast::RandomState,
    /// Hashes of keys missed once: a key enters the map at its second miss, so a workload
    /// whose stacks rarely repeat (an interpreter's varied leaf addresses) does not pay for
    /// putting every key in a map that would turn over before it was hit. Each key has two
    /// candidate slots and a miss overwrites them in turn: with one slot, two hot keys that
    /// shared it and missed in turn wiped each other's mark at every round and were never
    /// kept (half of a 3,000-stack hot set in 4,096 slots).
    seen: Box<[u64]>,
    turn: bool,
    /// Room for a key's words, to hash them (keys are not kept), and the last lookup's
    /// fingerprint, for the insert that follows a miss.
    key: Vec<u64>,
    hash: u64,
    check: u64,
    /// The last lookup missed a key seen before: [`StackCache::insert`] keeps it.
    keep: bool,
    pub hits: u64,
}

impl Default for StackCache {
    fn default() -> Self {
        Self {
            map: Generation::default(),
            older: Generation::default(),
            hasher: foldhash::fast::RandomState::default(),
            second: foldhash::fast::RandomState::default(),
            seen: vec![0; SEEN_SLOTS].into_boxed_slice(),
            turn: false,
            key: Vec::new(),
            hash: 0,
            check: 0,
            keep: false,
            hits: 0,
        }
    }
}

#[derive(Default)]
struct Generation {
    table: HashTable<Entry>,
}

struct Entry {
    /// The key's fingerprint: `hash` places it, both must match.
    hash: u64,
    check: u64,
    stack: Option<StackId>,
    /// User frames in no mapping, counted again at each hit.
    unmapped: u64,
    stamp: StackStamp,
}

impl Entry {
    /// Whether this entry is the key of this fingerprint.
    fn is(&self, hash: u64, check: u64) -> bool {
        self.hash == hash && self.check == check
    }
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
        let hash = self.hasher.hash_one(self.key.as_slice());
        let check = self.second.hash_one(self.key.as_slice());
        (self.hash, self.check) = (hash, check);
        let eq = |e: &Entry| e.is(hash, check);
        let index = match self.map.table.find_bucket_index(hash, eq) {
            Some(i) => Some(i),
            None => match self.older.table.find_entry(hash, eq) {
                Ok(found) => {
                    let (e, _) = found.remove();
                    Some(insert(&mut self.map, &mut self.older, e))
                }
                Err(_) => None,
            },
        };
        let Some(e) = index.and_then(|i| self.map.table.get_bucket_mut(i)) else {
            let mark = hash | 1;
            let slots =
                [hash as usize & (SEEN_SLOTS - 1), (hash >> 32) as usize & (SEEN_SLOTS - 1)];
            self.keep = slots.iter().any(|&i| self.seen[i] == mark);
            self.turn = !self.turn;
            self.seen[slots[usize::from(self.turn)]] = mark;
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
        insert(
            &mut self.map,
            &mut self.older,
            Entry { hash: self.hash, check: self.check, stack, unmapped, stamp },
        );
    }

    /// Keys held, in both generations.
    pub fn len(&self) -> usize {
        self.map.table.len() + self.older.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Into the current generation, which first becomes `older` if it is full; returns its
/// bucket there.
fn insert(map: &mut Generation, older: &mut Generation, e: Entry) -> usize {
    if map.table.len() >= GENERATION_ENTRIES {
        *older = std::mem::take(map);
    }
    // A key missed because of its old epoch is still there: replaced.
    match map.table.find_entry(e.hash, |old| old.is(e.hash, e.check)) {
        Ok(mut found) => {
            *found.get_mut() = e;
            found.bucket_index()
        }
        Err(_) => map.table.insert_unique(e.hash, e, |e| e.hash).bucket_index(),
    }
}
