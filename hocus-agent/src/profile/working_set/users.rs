//! The distinct sets of uids that opened files, each held once: a site's files share a
//! few thousand sets, and a file holds the number of its set.

use std::collections::BTreeSet;

use hashbrown::HashMap;

/// Set numbers fit in these bits of a file's record (the rest are its flags).
pub(super) const USERS: u32 = (1 << 28) - 1;

/// The distinct sets of uids that opened files, each held once; set 0 is empty.
#[derive(Clone)]
pub(super) struct UserSets {
    sets: Vec<Box<[u32]>>,
    ids: HashMap<Box<[u32]>, u32>,
}

impl Default for UserSets {
    fn default() -> Self {
        let empty: Box<[u32]> = Box::new([]);
        Self {
            sets: vec![empty.clone()],
            ids: HashMap::from_iter([(empty, 0)]),
        }
    }
}

impl UserSets {
    /// Bytes held on the heap (each set twice: listed and as its table's key).
    pub(super) fn heap_bytes(&self) -> usize {
        self.sets.iter().map(|s| 2 * 4 * s.len()).sum()
    }

    pub(super) fn get(&self, id: u32) -> &[u32] {
        &self.sets[id as usize]
    }

    pub(super) fn id_of(&mut self, set: Box<[u32]>) -> u32 {
        if let Some(id) = self.ids.get(&set) {
            return *id;
        }
        // Bounded by the files: a file adds at most one new set per user that opens it.
        let id = (self.sets.len() as u32).min(USERS);
        if id == USERS {
            return 0;
        }
        self.sets.push(set.clone());
        self.ids.insert(set, id);
        id
    }

    /// The set `id` with `uids` added.
    pub(super) fn with(&mut self, id: u32, uids: &[u32]) -> u32 {
        let have = self.get(id);
        if uids.iter().all(|u| have.binary_search(u).is_ok()) {
            return id;
        }
        let set: BTreeSet<u32> = have.iter().chain(uids).copied().collect();
        self.id_of(set.into_iter().collect())
    }
}
