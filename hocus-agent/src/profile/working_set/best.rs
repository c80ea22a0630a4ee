//! The `n` records of least key, found in one pass that may come a slice at a time:
//! only `n` are held (not a million keys sorted out on the daemon's loop), the worst of
//! them on top of a heap. Ties keep the first offered.

use std::collections::BinaryHeap;

pub(super) struct Best<K> {
    n: usize,
    heap: BinaryHeap<(K, usize)>,
}

impl<K: Ord> Best<K> {
    pub(super) fn new(n: usize) -> Self {
        Self {
            n,
            heap: BinaryHeap::new(),
        }
    }

    /// Record `i`, of `key`.
    pub(super) fn offer(&mut self, key: K, i: usize) {
        if self.n == 0 {
            return;
        }
        let k = (key, i);
        if self.heap.len() < self.n {
            self.heap.push(k);
        } else if let Some(mut worst) = self.heap.peek_mut()
            && k < *worst
        {
            *worst = k;
        }
    }

    /// The records kept, by index: in the order they were recorded, as their records
    /// and leaf names are stored.
    pub(super) fn indices(self) -> Vec<u32> {
        let mut at: Vec<u32> = self.heap.into_iter().map(|(_, i)| i as u32).collect();
        at.sort_unstable();
        at
    }
}
