//! Paths interned as a tree of components. A million files live under a few thousand
//! directories: each directory's name is held once, and an entry names its path by a
//! 4-byte id. The profile holds a path's entry by that id; the full string is built only
//! to show or export it.

use std::{cmp::Ordering, hash::BuildHasher};

use hashbrown::{DefaultHashBuilder, HashTable};

/// A path held in [`Paths`]; `Paths::ROOT` is `/`.
pub type PathId = u32;

#[derive(Clone, Copy)]
struct Node {
    parent: PathId,
    /// Where the name starts in `names`: its length (one byte below 128, else two), then
    /// its bytes.
    name: u32,
}

#[derive(Clone)]
pub struct Paths {
    nodes: Vec<Node>,
    names: Vec<u8>,
    /// The children of every node, found by (parent, name).
    children: HashTable<PathId>,
    hasher: DefaultHashBuilder,
}

impl Paths {
    pub const ROOT: PathId = 0;

    /// Holding `/` alone (node 0, with an empty name).
    pub fn new() -> Self {
        Self {
            nodes: vec![Node { parent: 0, name: 0 }],
            names: vec![0],
            children: HashTable::new(),
            hasher: DefaultHashBuilder::default(),
        }
    }

    /// Bytes held on the heap (what was reserved, used or not).
    pub fn heap_bytes(&self) -> usize {
        self.nodes.capacity() * size_of::<Node>()
            + self.names.capacity()
            + table_bytes::<PathId>(self.children.capacity())
    }

    /// Nodes held (directories and leaves).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    fn name(&self, id: PathId) -> &[u8] {
        name_at(&self.names, self.nodes[id as usize].name)
    }

    fn hash(&self, parent: PathId, name: &[u8]) -> u64 {
        self.hasher.hash_one((parent, name))
    }

    fn child(&self, parent: PathId, name: &[u8]) -> Option<PathId> {
        let hash = self.hash(parent, name);
        self.children
            .find(hash, |&c| {
                self.nodes[c as usize].parent == parent && self.name(c) == name
            })
            .copied()
    }

    /// The id of an absolute path, made if new. Empty components are skipped; callers
    /// hold only normalised paths (`format::refuse_path`).
    pub fn intern(&mut self, path: &str) -> PathId {
        let mut at = Self::ROOT;
        for name in components(path) {
            at = match self.child(at, name) {
                Some(c) => c,
                None => self.add(at, name),
            };
        }
        at
    }

    fn add(&mut self, parent: PathId, name: &[u8]) -> PathId {
        let id = PathId::try_from(self.nodes.len()).expect("fewer than 2^32 paths");
        let start = u32::try_from(self.names.len()).expect("fewer than 4 GiB of names");
        // Names are at most NAME_MAX (255) bytes on Linux, paths at most PATH_MAX: a
        // longer one is cut rather than mis-stored.
        let name = &name[..name.len().min(0x7fff)];
        if name.len() < 0x80 {
            self.names.push(name.len() as u8);
        } else {
            self.names.push(0x80 | (name.len() >> 8) as u8);
            self.names.push(name.len() as u8);
        }
        self.names.extend_from_slice(name);
        self.nodes.push(Node {
            parent,
            name: start,
        });
        let hash = self.hash(parent, name);
        let (nodes, names, hasher) = (&self.nodes, &self.names, &self.hasher);
        self.children.insert_unique(hash, id, |&c| {
            let n = nodes[c as usize];
            hasher.hash_one((n.parent, name_at(names, n.name)))
        });
        id
    }

    /// The id of a path already held.
    pub fn find(&self, path: &str) -> Option<PathId> {
        components(path).try_fold(Self::ROOT, |at, name| self.child(at, name))
    }

    /// The path of `id`, as a string.
    pub fn path(&self, id: PathId) -> String {
        let mut out = Vec::new();
        self.write_path(id, &mut out);
        // Interned from &str, split at '/': always UTF-8.
        String::from_utf8(out).unwrap_or_default()
    }

    /// Appends the path of `id` to `out`, written from its end (no list of ancestors).
    pub fn write_path(&self, id: PathId, out: &mut Vec<u8>) {
        if id == Self::ROOT {
            out.push(b'/');
            return;
        }
        let mut len = 0;
        let mut at = id;
        while at != Self::ROOT {
            len += 1 + self.name(at).len();
            at = self.parent(at);
        }
        let start = out.len();
        out.resize(start + len, b'/');
        let mut end = start + len;
        let mut at = id;
        while at != Self::ROOT {
            let name = self.name(at);
            out[end - name.len()..end].copy_from_slice(name);
            end -= name.len() + 1;
            at = self.parent(at);
        }
    }

    /// The directory `id` is in (`/` for `/`).
    pub fn parent(&self, id: PathId) -> PathId {
        self.nodes[id as usize].parent
    }

    fn depth(&self, mut id: PathId) -> usize {
        let mut depth = 0;
        while id != Self::ROOT {
            depth += 1;
            id = self.parent(id);
        }
        depth
    }

    /// Which paths are `root` or under it, by id, found in one pass: a node is always
    /// added after its parent. Walking up from each of a million files took most of a
    /// `status`; this asks each node's parent once.
    pub fn under(&self, root: PathId) -> Vec<bool> {
        let mut under = vec![false; self.nodes.len()];
        if let Some(r) = under.get_mut(root as usize) {
            *r = true;
        }
        for id in root as usize + 1..self.nodes.len() {
            under[id] = under[self.nodes[id].parent as usize];
        }
        under
    }

    /// Orders two paths as their strings would be ordered, without building them: up to
    /// the two ancestors that differ below a common one, then by their names and the byte
    /// that follows the shorter name (`/` if its path goes on).
    pub fn cmp(&self, a: PathId, b: PathId) -> Ordering {
        let (da, db) = (self.depth(a), self.depth(b));
        let (mut x, mut y) = (a, b);
        for _ in db..da {
            x = self.parent(x);
        }
        for _ in da..db {
            y = self.parent(y);
        }
        if x == y {
            // One is the other or under it: the shorter string is a prefix.
            return da.cmp(&db);
        }
        while self.parent(x) != self.parent(y) {
            x = self.parent(x);
            y = self.parent(y);
        }
        let (nx, ny) = (self.name(x), self.name(y));
        let common = nx.len().min(ny.len());
        match nx[..common].cmp(&ny[..common]) {
            Ordering::Equal => {}
            o => return o,
        }
        // One name is a prefix of the other (siblings' names differ).
        let next = |id: PathId, end: PathId, name: &[u8]| match name.get(common) {
            Some(b) => Some(*b),
            None => (id != end).then_some(b'/'),
        };
        next(x, a, nx).cmp(&next(y, b, ny))
    }
}

impl Default for Paths {
    fn default() -> Self {
        Self::new()
    }
}

/// Bytes a hashbrown table with room for `capacity` entries of `T` reserves: a power of
/// two of buckets at most 7/8 full, each with its entry and a control byte.
pub fn table_bytes<T>(capacity: usize) -> usize {
    let buckets = (capacity * 8 / 7).next_power_of_two();
    buckets * (size_of::<T>() + 1)
}

/// The name stored at `at` in a names arena.
fn name_at(names: &[u8], at: u32) -> &[u8] {
    let at = at as usize;
    let (len, skip) = match names[at] {
        b if b < 0x80 => (usize::from(b), 1),
        b => (usize::from(b & 0x7f) << 8 | usize::from(names[at + 1]), 2),
    };
    &names[at + skip..at + skip + len]
}

fn components(path: &str) -> impl Iterator<Item = &[u8]> {
    path.as_bytes()
        .split(|b| *b == b'/')
        .filter(|c| !c.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interns_finds_and_rebuilds_paths() {
        let mut p = Paths::new();
        let a = p.intern("/net/env/lib/a.py");
        let b = p.intern("/net/env/lib/b.py");
        let long = format!("/net/{}", "x".repeat(200));
        let l = p.intern(&long);
        assert_ne!(a, b);
        assert_eq!(p.intern("/net/env/lib/a.py"), a);
        assert_eq!(p.find("/net/env/lib/b.py"), Some(b));
        assert_eq!(p.find("/net/env/lib/c.py"), None);
        assert_eq!(p.path(a), "/net/env/lib/a.py");
        assert_eq!(p.path(l), long);
        assert_eq!(p.path(Paths::ROOT), "/");
        let lib = p.find("/net/env/lib").unwrap();
        let under = p.under(lib);
        assert!(under[a as usize] && under[b as usize] && under[lib as usize]);
        assert!(!under[l as usize] && !under[Paths::ROOT as usize]);
        assert!(!p.under(a)[lib as usize]);
        // A path interned later, under and beside the root asked about.
        let c = p.intern("/net/env/lib/sub/c.py");
        let d = p.intern("/net/env/other.py");
        let under = p.under(lib);
        assert!(under[c as usize] && !under[d as usize]);
        assert!(p.under(Paths::ROOT).iter().all(|u| *u));
        // /, net, env, lib, a.py, b.py, the long one, sub, c.py, other.py
        assert_eq!(p.len(), 10);
        assert_eq!(p.cmp(a, b), Ordering::Less);
    }

    #[test]
    fn names_that_share_bytes_are_told_apart() {
        let mut p = Paths::new();
        let x = p.intern("/ab/c");
        let y = p.intern("/a/bc");
        assert_ne!(x, y);
        assert_eq!(p.path(x), "/ab/c");
        assert_eq!(p.path(y), "/a/bc");
    }

    proptest::proptest! {
        /// Paths order as their strings do, including names that are prefixes of others
        /// followed by bytes below `/` (`b.c` before `b/x`).
        #[test]
        fn orders_as_strings(paths in proptest::collection::vec("(/[ab.-]{1,3}){1,4}", 1..12)) {
            let mut p = Paths::new();
            let ids: Vec<PathId> = paths.iter().map(|s| p.intern(s)).collect();
            for (i, a) in ids.iter().enumerate() {
                proptest::prop_assert_eq!(p.path(*a), paths[i].clone());
                for (j, b) in ids.iter().enumerate() {
                    proptest::prop_assert_eq!(p.cmp(*a, *b), paths[i].cmp(&paths[j]), "{} vs {}", paths[i], paths[j]);
                }
            }
        }
    }
}
