//! Sorting by path, as the strings would sort, without building them: at once
//! (`Paths::sort_by_path`), or a slice at a time (`SlicedSort`) for work the daemon's
//! loop must not be held by, such as the order of an export's missing names.
//!
//! Each path is a directory's path (written once per directory, with its `/`) and a leaf
//! name (read once each, in the order names were stored: those on disk are read in
//! order): two in one directory compare by their names alone, others as the strings they
//! join into. A comparison walking the tree up from both paths cost ~60 ns at a million
//! paths (200k missing names sorted in 220 ms on the daemon's loop).

use std::{cmp::Ordering, collections::HashMap};

use super::{PathId, Paths};

/// What a sort knows of a path: its directory's index in [`Joined`], where its leaf name
/// is there, and the item's place before the sort (`SlicedSort`: the path's id). 12
/// bytes an item: a sort of 200k missing names holds ~6 MB while it runs.
type Key = (u32, u32, u32);

impl Paths {
    /// Sorts `items` by their paths (`path`), as strings would sort.
    pub fn sort_by_path<T: Copy>(&self, items: &mut [T], path: impl Fn(&T) -> PathId) {
        let mut keys = by_id(items.iter().map(path));
        let mut text = Joined::sized_for(keys.len());
        let mut buf = Vec::new();
        for key in &mut keys {
            *key = text.key(self, *key, &mut buf);
        }
        keys.sort_unstable_by(|a, b| text.cmp(a, b));
        drop(text);
        // Moved into place along the permutation's cycles: no second list of items.
        for start in 0..keys.len() {
            if keys[start].2 == u32::MAX {
                continue;
            }
            let first = items[start];
            let mut at = start;
            loop {
                let from = std::mem::replace(&mut keys[at].2, u32::MAX) as usize;
                if from == start {
                    items[at] = first;
                    break;
                }
                items[at] = items[from];
                at = from;
            }
        }
    }
}

/// Keys (id, 0, place) in id order: leaf names are then read in the order they were
/// stored (those on disk, in order).
fn by_id(ids: impl Iterator<Item = PathId>) -> Vec<Key> {
    let mut keys: Vec<Key> = ids.enumerate().map(|(i, id)| (id, 0, i as u32)).collect();
    keys.sort_unstable();
    keys
}

/// A sort by path made a slice at a time (`step`), then taken in order (`take`): the
/// names are read `SLICE` paths at a time, runs of that many are sorted one at a time,
/// and the runs are merged as the sorted paths are taken. No step costs more than a
/// slice's worth (~5 ms), where sorting 200k missing names at once held the daemon's
/// loop 74-80 ms (most of it reading their names back from disk).
///
/// Paths only ever gain entries while it is under way, and an id's path never changes:
/// what was read of the names stays true between steps.
pub struct SlicedSort {
    /// Each path's key, its id last (what is given out).
    keys: Vec<Key>,
    text: Joined,
    /// Keys whose names were read (in id order); then, keys sorted in runs.
    read: usize,
    sorted: usize,
    /// The runs being merged, each as where its head is and where it ends in `keys`: a
    /// heap by their heads, least first (`log2` of the runs' count comparisons a path:
    /// ~7 at the 2M entries a profile holds at most, 122 runs).
    runs: Vec<(usize, usize)>,
    slice: usize,
}

impl std::fmt::Debug for SlicedSort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlicedSort")
            .field("paths", &self.keys.len())
            .field("read", &self.read)
            .field("sorted", &self.sorted)
            .field("left", &self.left())
            .finish()
    }
}

impl SlicedSort {
    /// Paths read, or sorted, in one step.
    pub const SLICE: usize = 16_384;

    pub fn new(ids: Vec<PathId>) -> Self {
        Self::in_slices_of(ids, Self::SLICE)
    }

    fn in_slices_of(ids: Vec<PathId>, slice: usize) -> Self {
        let mut keys: Vec<Key> = ids.into_iter().map(|id| (id, 0, id)).collect();
        keys.sort_unstable();
        Self {
            text: Joined::sized_for(keys.len()),
            keys,
            read: 0,
            sorted: 0,
            runs: Vec::new(),
            slice: slice.max(1),
        }
    }

    /// Whether all steps are done and the paths can be taken.
    pub fn ready(&self) -> bool {
        self.sorted == self.keys.len()
    }

    /// One slice of the work left: reading names, or sorting a run. False when there
    /// was none left.
    pub fn step(&mut self, paths: &Paths) -> bool {
        let n = self.keys.len();
        if self.read < n {
            let end = (self.read + self.slice).min(n);
            let mut buf = Vec::new();
            for key in &mut self.keys[self.read..end] {
                *key = self.text.key(paths, *key, &mut buf);
            }
            self.read = end;
            return true;
        }
        if self.sorted < n {
            let (start, end) = (self.sorted, (self.sorted + self.slice).min(n));
            let text = &self.text;
            self.keys[start..end].sort_unstable_by(|a, b| text.cmp(a, b));
            self.runs.push((start, end));
            self.sorted = end;
            if self.ready() {
                let Self {
                    keys, text, runs, ..
                } = self;
                for at in (0..runs.len() / 2).rev() {
                    sift_down(runs, at, |a, b| text.cmp(&keys[a], &keys[b]));
                }
            }
            return true;
        }
        false
    }

    /// Every step left, at once.
    pub fn finish(&mut self, paths: &Paths) {
        while self.step(paths) {}
    }

    /// Paths not taken yet.
    pub fn left(&self) -> usize {
        self.runs
            .iter()
            .map(|(start, end)| end - start)
            .sum::<usize>()
            + (self.keys.len() - self.sorted)
    }

    /// The next at most `n` paths in order, to `out`; how many. None before `ready`.
    pub fn take(&mut self, n: usize, mut out: impl FnMut(PathId)) -> usize {
        if !self.ready() {
            return 0;
        }
        let Self {
            keys, text, runs, ..
        } = self;
        let mut taken = 0;
        while taken < n && !runs.is_empty() {
            let at = runs[0].0;
            out(keys[at].2);
            taken += 1;
            runs[0].0 += 1;
            if runs[0].0 == runs[0].1 {
                runs.swap_remove(0);
            }
            sift_down(runs, 0, |a, b| text.cmp(&keys[a], &keys[b]));
        }
        taken
    }
}

/// Moves the run at `at` down the heap `runs` (by their heads, compared by `cmp`) to
/// where it belongs.
fn sift_down(runs: &mut [(usize, usize)], mut at: usize, cmp: impl Fn(usize, usize) -> Ordering) {
    loop {
        let mut least = at;
        for child in [2 * at + 1, 2 * at + 2] {
            if child < runs.len() && cmp(runs[child].0, runs[least].0) == Ordering::Less {
                least = child;
            }
        }
        if least == at {
            return;
        }
        runs.swap(at, least);
        at = least;
    }
}

/// The directories' paths and leaf names of a sort: leaves in one buffer, each after
/// its length (two bytes, or four when the first two are 0xffff); directories in another.
#[derive(Default)]
struct Joined {
    leaves: Vec<u8>,
    dir_bytes: Vec<u8>,
    /// Each directory's path, by index: where it starts and ends in `dir_bytes`.
    dirs: Vec<(u32, u32)>,
    /// Directory ids (`u32::MAX`: the empty one before `/`) to their index.
    index: HashMap<PathId, u32>,
}

impl Joined {
    /// Room for `n` leaf names at once: names in site trees are ~15 bytes, and are not
    /// doubled as they come.
    fn sized_for(n: usize) -> Self {
        Self {
            leaves: Vec::with_capacity(n * 18),
            ..Self::default()
        }
    }

    /// The key of `(id, _, place)`: its path's directory and leaf name, added here.
    fn key(&mut self, paths: &Paths, (id, _, place): Key, buf: &mut Vec<u8>) -> Key {
        if id == Paths::ROOT {
            return (self.dir(u32::MAX, |_| {}), self.leaf(b"/"), place);
        }
        let parent = paths.parent(id);
        let dir = self.dir(parent, |out| {
            if parent != Paths::ROOT {
                paths.write_path(parent, out);
            }
            out.push(b'/');
        });
        (dir, self.leaf(paths.name_in(id, buf)), place)
    }

    /// Two keys' paths, compared as strings.
    fn cmp(&self, a: &Key, b: &Key) -> Ordering {
        let (la, lb) = (self.leaf_at(a.1), self.leaf_at(b.1));
        if a.0 == b.0 {
            return la.cmp(lb);
        }
        let (da, db) = (self.dir_at(a.0), self.dir_at(b.0));
        let common = da.len().min(db.len());
        match da[..common].cmp(&db[..common]) {
            Ordering::Equal => da.iter().chain(la).cmp(db.iter().chain(lb)),
            o => o,
        }
    }

    /// Appends a leaf name; returns where it is.
    fn leaf(&mut self, name: &[u8]) -> u32 {
        let at = self.leaves.len() as u32;
        match u16::try_from(name.len()) {
            Ok(n) if n < u16::MAX => self.leaves.extend_from_slice(&n.to_le_bytes()),
            _ => {
                self.leaves.extend_from_slice(&u16::MAX.to_le_bytes());
                self.leaves
                    .extend_from_slice(&(name.len() as u32).to_le_bytes());
            }
        }
        self.leaves.extend_from_slice(name);
        at
    }

    fn leaf_at(&self, at: u32) -> &[u8] {
        let at = at as usize;
        let short = u16::from_le_bytes([self.leaves[at], self.leaves[at + 1]]);
        let (start, len) = if short < u16::MAX {
            (at + 2, short as usize)
        } else {
            let b = &self.leaves[at + 2..at + 6];
            (
                at + 6,
                u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize,
            )
        };
        &self.leaves[start..start + len]
    }

    /// The index of directory `id`, its path written by `write` the first time.
    fn dir(&mut self, id: PathId, write: impl FnOnce(&mut Vec<u8>)) -> u32 {
        if let Some(&i) = self.index.get(&id) {
            return i;
        }
        let start = self.dir_bytes.len() as u32;
        write(&mut self.dir_bytes);
        self.dirs.push((start, self.dir_bytes.len() as u32));
        let i = self.dirs.len() as u32 - 1;
        self.index.insert(id, i);
        i
    }

    fn dir_at(&self, i: u32) -> &[u8] {
        let (start, end) = self.dirs[i as usize];
        &self.dir_bytes[start as usize..end as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_longer_than_64k_sorts_too() {
        let mut p = Paths::new();
        let long = format!("/a/{}", "x".repeat(70_000));
        let ids = [p.intern("/a/y"), p.intern(&long), p.intern("/a/w")];
        let mut sorted = ids;
        p.sort_by_path(&mut sorted, |id| *id);
        assert_eq!(sorted, [ids[2], ids[1], ids[0]]);
    }

    #[test]
    fn a_sliced_sort_takes_nothing_before_it_is_ready_and_what_was_asked_after() {
        let mut p = Paths::new();
        let ids: Vec<PathId> = ["/n/c", "/n/a", "/n/d", "/n/b", "/m/z"]
            .iter()
            .map(|s| p.intern(s))
            .collect();
        let mut s = SlicedSort::in_slices_of(ids.clone(), 2);
        let mut got = Vec::new();
        // 3 slices to read the names, 3 runs to sort.
        for _ in 0..5 {
            assert!(s.step(&p) && !s.ready());
            assert_eq!(s.take(10, |id| got.push(id)), 0);
        }
        assert!(s.step(&p) && s.ready() && !s.step(&p));
        // Paths added meanwhile change nothing.
        p.intern("/n/a/under");
        assert_eq!(s.left(), 5);
        assert_eq!(s.take(2, |id| got.push(id)), 2);
        assert_eq!(s.take(10, |id| got.push(id)), 3);
        assert_eq!(s.left(), 0);
        let back: Vec<String> = got.iter().map(|id| p.path(*id)).collect();
        assert_eq!(back, ["/m/z", "/n/a", "/n/b", "/n/c", "/n/d"]);
    }

    #[test]
    fn a_sliced_sort_of_many_runs_merges_them_as_one_sort() {
        let mut p = Paths::new();
        // 1,000 paths in 143 runs of 7, across directories and names that share bytes.
        let ids: Vec<PathId> = (0..1000u32)
            .map(|i| {
                p.intern(&format!(
                    "/t/d{}/{}x{}",
                    i.wrapping_mul(7919) % 13,
                    i % 10,
                    i
                ))
            })
            .collect();
        let mut whole = ids.clone();
        p.sort_by_path(&mut whole, |id| *id);
        let mut s = SlicedSort::in_slices_of(ids, 7);
        s.finish(&p);
        let mut taken = Vec::new();
        while s.take(33, |id| taken.push(id)) > 0 {}
        assert_eq!(taken, whole);
    }

    proptest::proptest! {
        /// Paths sort as their strings do, including names that are prefixes of others
        /// followed by bytes below `/` (`b.c` before `b/x`); with leaf names on disk too;
        /// at once and a slice at a time.
        #[test]
        fn sort_as_strings(
            paths in proptest::collection::vec("(/[ab.-]{1,3}){1,4}", 1..12),
            slice in 1usize..5,
        ) {
            let dir = tempfile::tempdir().unwrap();
            for mut p in [Paths::new(), Paths::spilling(dir.path(), 5)] {
                let ids: Vec<PathId> = paths.iter().map(|s| p.intern(s)).collect();
                for (i, a) in ids.iter().enumerate() {
                    proptest::prop_assert_eq!(p.path(*a), paths[i].clone());
                    proptest::prop_assert_eq!(p.find(&paths[i]), Some(*a));
                }
                let mut strings = paths.clone();
                strings.sort();
                let mut sorted = ids.clone();
                p.sort_by_path(&mut sorted, |id| *id);
                let back: Vec<String> = sorted.iter().map(|id| p.path(*id)).collect();
                proptest::prop_assert_eq!(&back, &strings);
                // A sliced sort is of distinct paths (an export's keys).
                strings.dedup();
                let mut unique = ids.clone();
                unique.sort_unstable();
                unique.dedup();
                let mut sliced = SlicedSort::in_slices_of(unique, slice);
                sliced.finish(&p);
                let mut taken = Vec::new();
                while sliced.take(slice, |id| taken.push(p.path(id))) > 0 {}
                proptest::prop_assert_eq!(&taken, &strings);
            }
        }
    }
}
