//! Dense ids for distinct values: each value is stored once and gets the next index.

use std::{borrow::Borrow, collections::HashMap, hash::Hash};

#[derive(Debug)]
pub struct Interner<T> {
    items: Vec<T>,
    ids: HashMap<T, u32>,
}

impl<T> Default for Interner<T> {
    fn default() -> Self {
        Self { items: Vec::new(), ids: HashMap::new() }
    }
}

impl<T: Hash + Eq + Clone> Interner<T> {
    /// The id of `value`, adding it if it is new.
    pub fn intern<Q>(&mut self, value: &Q) -> u32
    where
        T: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = T> + ?Sized,
    {
        if let Some(&id) = self.ids.get(value) {
            return id;
        }
        let id = self.items.len() as u32;
        let owned = value.to_owned();
        self.items.push(owned.clone());
        self.ids.insert(owned, id);
        id
    }

    pub fn get(&self, id: u32) -> &T {
        &self.items[id as usize]
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn items(&self) -> &[T] {
        &self.items
    }

    pub fn into_items(self) -> Vec<T> {
        self.items
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_values_share_an_id_in_first_seen_order() {
        let mut i: Interner<String> = Interner::default();
        assert_eq!(i.intern("b"), 0);
        assert_eq!(i.intern("a"), 1);
        assert_eq!(i.intern("b"), 0);
        assert_eq!(i.items(), &["b".to_owned(), "a".to_owned()]);
    }
}
