//! Dense ids for distinct values, reclaimed once nothing uses them.

use std::{borrow::Borrow, hash::Hash};

/// Looked up once per frame of every sample: foldhash, not SipHash (keys are small and the
/// seed is random per process).
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// An interner whose entries can be dropped once nothing refers to them any more, so it stays
/// bounded while the data that uses its ids is recycled. Every `intern` stamps the entry with
/// the caller's generation (the storage chunk being written); `prune(g)` drops entries last
/// used in generation `g` or earlier and reuses their ids.
#[derive(Debug)]
pub struct PrunableInterner<T> {
    items: Vec<Option<T>>,
    last_use: Vec<u64>,
    ids: HashMap<T, u32>,
    free: Vec<u32>,
}

impl<T> Default for PrunableInterner<T> {
    fn default() -> Self {
        Self { items: Vec::new(), last_use: Vec::new(), ids: HashMap::default(), free: Vec::new() }
    }
}

impl<T: Hash + Eq + Clone> PrunableInterner<T> {
    pub fn intern<Q>(&mut self, value: &Q, generation: u64) -> u32
    where
        T: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = T> + ?Sized,
    {
        if let Some(&id) = self.ids.get(value) {
            self.last_use[id as usize] = generation;
            return id;
        }
        let owned = value.to_owned();
        let id = match self.free.pop() {
            Some(id) => {
                self.items[id as usize] = Some(owned.clone());
                self.last_use[id as usize] = generation;
                id
            }
            None => {
                self.items.push(Some(owned.clone()));
                self.last_use.push(generation);
                (self.items.len() - 1) as u32
            }
        };
        self.ids.insert(owned, id);
        id
    }

    /// Marks a live entry as used in `generation`.
    pub fn touch(&mut self, id: u32, generation: u64) {
        if let Some(g) = self.last_use.get_mut(id as usize) {
            *g = (*g).max(generation);
        }
    }

    /// None for an id that was never handed out or has been pruned.
    pub fn get(&self, id: u32) -> Option<&T> {
        self.items.get(id as usize).and_then(Option::as_ref)
    }

    /// Drops every entry whose last use is at or before `generation`; returns how many.
    pub fn prune(&mut self, generation: u64) -> usize {
        let mut n = 0;
        for (id, item) in self.items.iter_mut().enumerate() {
            if item.is_some() && self.last_use[id] <= generation {
                let value = item.take().expect("checked");
                self.ids.remove(&value);
                self.free.push(id as u32);
                n += 1;
            }
        }
        n
    }

    /// Live entries.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Slots, live or free, indexed by id.
    pub fn slots(&self) -> &[Option<T>] {
        &self.items
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pruned_entries_go_and_their_ids_are_reused() {
        let mut i: PrunableInterner<String> = PrunableInterner::default();
        let a = i.intern("a", 1);
        let b = i.intern("b", 1);
        assert_eq!(i.intern("a", 3), a, "re-use refreshes the generation");
        assert_eq!(i.prune(2), 1);
        assert_eq!(i.get(b), None);
        assert_eq!(i.get(a).map(String::as_str), Some("a"));
        let c = i.intern("c", 4);
        assert_eq!(c, b, "freed id is reused");
        assert_eq!(i.len(), 2);
        assert_eq!(i.intern("b", 4), 2, "a pruned value comes back under a fresh id");
    }
}
