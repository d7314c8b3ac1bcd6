//! Row ranges of the `UNWIND_ROWS` array: first fit over the free ranges, neighbours merged
//! on free, so the space of evicted tables is reused by later ones.

use std::collections::BTreeMap;

#[derive(Clone, Debug)]
pub struct RowAllocator {
    /// Free ranges, start → length; never adjacent (merged on free).
    free: BTreeMap<u32, u32>,
}

impl RowAllocator {
    pub fn new(capacity: u32) -> Self {
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Self { free }
    }

    /// The lowest free range of at least `count` rows, shortened from its start.
    pub fn alloc(&mut self, count: u32) -> Option<u32> {
        if count == 0 {
            return None;
        }
        let (&start, &len) = self.free.iter().find(|&(_, &len)| len >= count)?;
        self.free.remove(&start);
        if len > count {
            self.free.insert(start + count, len - count);
        }
        Some(start)
    }

    /// Returns `first..first + count` (a range `alloc` gave out) and merges it with free
    /// neighbours.
    pub fn free(&mut self, first: u32, count: u32) {
        if count == 0 {
            return;
        }
        let (mut start, mut len) = (first, count);
        if let Some((&p, &plen)) = self.free.range(..first).next_back() {
            debug_assert!(p + plen <= first, "free of {first}+{count} overlaps {p}+{plen}");
            if p + plen == first {
                self.free.remove(&p);
                start = p;
                len += plen;
            }
        }
        if let Some(nlen) = self.free.remove(&(first + count)) {
            len += nlen;
        }
        debug_assert!(self.free.range(first..first + count).next().is_none(), "double free");
        self.free.insert(start, len);
    }

    /// Free rows in all.
    #[cfg(test)]
    fn free_rows(&self) -> u32 {
        self.free.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::RowAllocator;

    #[test]
    fn alloc_until_full_then_none() {
        let mut a = RowAllocator::new(10);
        assert_eq!(a.alloc(4), Some(0));
        assert_eq!(a.alloc(4), Some(4));
        assert_eq!(a.alloc(3), None);
        assert_eq!(a.alloc(2), Some(8));
        assert_eq!(a.alloc(1), None);
        assert_eq!(a.alloc(0), None);
        assert_eq!(RowAllocator::new(0).alloc(1), None);
    }

    #[test]
    fn free_merges_both_neighbours() {
        let mut a = RowAllocator::new(30);
        let (x, y, z) = (a.alloc(10).unwrap(), a.alloc(10).unwrap(), a.alloc(10).unwrap());
        a.free(x, 10);
        a.free(z, 10);
        assert_eq!(a.free.len(), 2);
        // The middle one joins both into one range: all 30 rows fit again.
        a.free(y, 10);
        assert_eq!(a.free.len(), 1);
        assert_eq!(a.alloc(30), Some(0));
    }

    #[test]
    fn first_fit_reuses_the_lowest_hole_that_fits() {
        let mut a = RowAllocator::new(100);
        let r: Vec<u32> = [10, 20, 10, 30].iter().map(|&n| a.alloc(n).unwrap()).collect();
        assert_eq!(r, [0, 10, 30, 40]);
        a.free(r[0], 10); // hole 0..10
        a.free(r[2], 10); // hole 30..40
        // 15 fits in neither hole: it goes after the last table (70..85).
        assert_eq!(a.alloc(15), Some(70));
        // 8 takes the lowest hole, leaving 8..10.
        assert_eq!(a.alloc(8), Some(0));
        assert_eq!(a.alloc(2), Some(8));
        assert_eq!(a.alloc(10), Some(30));
        assert_eq!(a.free_rows(), 15);
    }

    #[test]
    fn fragmentation_refuses_what_only_the_total_would_hold() {
        let mut a = RowAllocator::new(40);
        let r: Vec<u32> = (0..4).map(|_| a.alloc(10).unwrap()).collect();
        a.free(r[0], 10);
        a.free(r[2], 10);
        assert_eq!(a.free_rows(), 20);
        assert_eq!(a.alloc(20), None, "two 10-row holes are not one of 20");
        a.free(r[1], 10);
        assert_eq!(a.alloc(20), Some(0));
        assert_eq!(a.alloc(10), Some(20));
        assert_eq!(a.alloc(1), None);
    }

    #[test]
    fn free_at_the_end_merges_with_the_tail() {
        let mut a = RowAllocator::new(20);
        let x = a.alloc(5).unwrap();
        let y = a.alloc(5).unwrap();
        a.free(y, 5);
        assert_eq!(a.free.len(), 1, "{:?}", a.free);
        assert_eq!(a.alloc(15), Some(5));
        a.free(x, 5);
        assert_eq!(a.alloc(5), Some(0));
    }
}
