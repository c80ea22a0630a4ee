//! Paths interned as a tree of components. A million files live under a few thousand
//! directories: each directory's name is held once, and an entry names its path by a
//! 4-byte id. The profile holds a path's entry by that id; the full string is built only
//! to show or export it.
//!
//! Directories' names stay in memory: every path goes through them. The names of
//! leaves (files, missing names) are most of the bytes and mostly cold: past
//! [`LEAVES_HELD`] bytes they go to local disk with the file records ([`Records`]) and are
//! read back when a path is looked up, built or compared. A node keeps a 32-bit hash of
//! (parent, name), so that growing the table of children reads no name back, and a
//! lookup reads one only when parent and hash match.

use std::{cmp::Ordering, collections::HashMap, hash::BuildHasher};

use hashbrown::{DefaultHashBuilder, HashTable};

use crate::{profile::records::Records, shared::memory::table_bytes};

/// A path held in [`Paths`]; `Paths::ROOT` is `/`.
pub type PathId = u32;

/// Bytes of leaf names held in memory before they go to disk.
const LEAVES_HELD: usize = 1 << 20;

/// Leaf names read back at a time: a page.
const LEAF_BLOCK: usize = 4096;

/// In [`Node::name`]: the name is in the directories' names, not the leaves'.
const DIR: u32 = 1 << 31;

#[derive(Clone, Copy)]
struct Node {
    parent: PathId,
    /// Where the name starts, in `dir_names` (with [`DIR`]) or in `leaves`: its length
    /// (one byte below 128, else two), then its bytes.
    name: u32,
    /// 32 bits of the hash of (parent, name) (`Paths::hash`).
    hash: u32,
}

pub struct Paths {
    nodes: Vec<Node>,
    /// Names of nodes with children.
    dir_names: Vec<u8>,
    /// Names of the others, as they were added.
    leaves: Records<u8>,
    /// The children of every node, found by (parent, name).
    children: HashTable<PathId>,
    hasher: DefaultHashBuilder,
}

impl Paths {
    pub const ROOT: PathId = 0;

    /// Holding `/` alone (node 0, with an empty name).
    pub fn new() -> Self {
        Self::with_leaves(Records::spilling_past(LEAVES_HELD).in_blocks_of(LEAF_BLOCK))
    }

    /// Leaf names on disk in `dir` past `held` bytes (tests use a few).
    #[cfg(test)]
    pub fn spilling(dir: &std::path::Path, held: usize) -> Self {
        Self::with_leaves(Records::spilling(Some(dir.to_owned()), held).in_blocks_of(7))
    }

    fn with_leaves(leaves: Records<u8>) -> Self {
        Self {
            nodes: vec![Node {
                parent: 0,
                name: DIR,
                hash: 0,
            }],
            dir_names: vec![0],
            leaves,
            children: HashTable::new(),
            hasher: DefaultHashBuilder::default(),
        }
    }

    /// Bytes held on the heap (what was reserved, used or not).
    pub fn heap_bytes(&self) -> usize {
        self.nodes.capacity() * size_of::<Node>()
            + self.dir_names.capacity()
            + self.leaves.heap_bytes()
            + table_bytes::<PathId>(self.children.capacity())
    }

    /// Nodes held (directories and leaves).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Calls `f` with the name of `id`, read back from disk if it is there.
    fn with_name<R>(&self, id: PathId, f: impl FnOnce(&[u8]) -> R) -> R {
        let mut buf = Vec::new();
        f(self.name_in(id, &mut buf))
    }

    /// The name of `id`: a directory's, or a leaf's not yet on disk, where it is held; or
    /// read back into `buf`.
    fn name_in<'s>(&'s self, id: PathId, buf: &'s mut Vec<u8>) -> &'s [u8] {
        let at = self.nodes[id as usize].name;
        if at & DIR != 0 {
            return name_at(&self.dir_names, at & !DIR);
        }
        let at = at as usize;
        let head = 2.min(self.leaves.len() - at);
        let held = self.leaves.in_memory(at, head).and_then(|h| {
            let (len, skip) = name_len(h);
            self.leaves.in_memory(at + skip, len)
        });
        if let Some(name) = held {
            return name;
        }
        buf.clear();
        self.leaves.get_into(at, head, buf);
        let (len, skip) = name_len(buf);
        buf.clear();
        self.leaves.get_into(at + skip, len, buf);
        buf
    }

    /// The hash a node keeps: 32 bits of the hash of (parent, name).
    fn hash(&self, parent: PathId, name: &[u8]) -> u32 {
        self.hasher.hash_one((parent, name)) as u32
    }

    fn child(&self, parent: PathId, name: &[u8]) -> Option<PathId> {
        let hash = self.hash(parent, name);
        self.children
            .find(spread(hash), |&c| {
                let n = self.nodes[c as usize];
                n.parent == parent && n.hash == hash && self.with_name(c, |held| held == name)
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
        self.make_dir(parent);
        // Names are at most NAME_MAX (255) bytes on Linux, paths at most PATH_MAX: a
        // longer one is cut rather than mis-stored.
        let name = &name[..name.len().min(0x7fff)];
        let start = u32::try_from(self.leaves.len())
            .ok()
            .filter(|s| s & DIR == 0)
            .expect("fewer than 2 GiB of names");
        let mut stored = Vec::with_capacity(name.len() + 2);
        push_name(&mut stored, name);
        self.leaves.extend(&stored);
        let hash = self.hash(parent, name);
        self.nodes.push(Node {
            parent,
            name: start,
            hash,
        });
        let nodes = &self.nodes;
        // Grown by the hashes the nodes keep: no name is read back.
        self.children
            .insert_unique(spread(hash), id, |&c| spread(nodes[c as usize].hash));
        id
    }

    /// Moves the name of `id` among the directories' names, if it is a leaf's.
    fn make_dir(&mut self, id: PathId) {
        if self.nodes[id as usize].name & DIR != 0 {
            return;
        }
        let mut name = Vec::new();
        self.with_name(id, |n| name.extend_from_slice(n));
        let start = u32::try_from(self.dir_names.len())
            .ok()
            .filter(|s| s & DIR == 0)
            .expect("fewer than 2 GiB of directory names");
        push_name(&mut self.dir_names, &name);
        self.nodes[id as usize].name = start | DIR;
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
        // The leaf's name is read once, the directories' are in memory.
        self.with_name(id, |leaf| {
            let mut len = 1 + leaf.len();
            let mut at = self.parent(id);
            while at != Self::ROOT {
                len += 1 + self.dir_name(at).len();
                at = self.parent(at);
            }
            let start = out.len();
            out.resize(start + len, b'/');
            let mut end = start + len;
            out[end - leaf.len()..end].copy_from_slice(leaf);
            end -= leaf.len() + 1;
            let mut at = self.parent(id);
            while at != Self::ROOT {
                let name = self.dir_name(at);
                out[end - name.len()..end].copy_from_slice(name);
                end -= name.len() + 1;
                at = self.parent(at);
            }
        });
    }

    /// The name of a node with children.
    fn dir_name(&self, id: PathId) -> &[u8] {
        let at = self.nodes[id as usize].name;
        debug_assert!(at & DIR != 0, "a parent's name is a directory's");
        name_at(&self.dir_names, at & !DIR)
    }

    /// The directory `id` is in (`/` for `/`).
    pub fn parent(&self, id: PathId) -> PathId {
        self.nodes[id as usize].parent
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

    /// Sorts `items` by their paths (`path`), as strings would sort. Each path is a
    /// directory's path (written once per directory, with its `/`) and a leaf name (read
    /// once each, in the order names were stored: those on disk are read in order): two
    /// in one directory compare by their names alone, others as the strings they join
    /// into. A comparison walking the tree up from both paths cost ~60 ns at a million
    /// paths (200k missing names sorted in 220 ms on the daemon's loop).
    pub fn sort_by_path<T: Copy>(&self, items: &mut [T], path: impl Fn(&T) -> PathId) {
        // (the path's id, then its directory's index; where its leaf name is; the item),
        // 12 bytes an item: a sort of 200k missing names holds ~6 MB while it runs.
        let mut keys: Vec<(u32, u32, u32)> = (items.iter().enumerate())
            .map(|(i, item)| (path(item), 0, i as u32))
            .collect();
        keys.sort_unstable();
        let mut text = Joined {
            // Names in site trees are ~15 bytes: room for them at once, not doubled as
            // they come.
            leaves: Vec::with_capacity(keys.len() * 18),
            ..Joined::default()
        };
        let mut buf = Vec::new();
        for key in &mut keys {
            let id = key.0;
            let (dir, leaf) = if id == Self::ROOT {
                (text.dir(u32::MAX, |_| {}), text.leaf(b"/"))
            } else {
                let parent = self.parent(id);
                let dir = text.dir(parent, |out| {
                    if parent != Self::ROOT {
                        self.write_path(parent, out);
                    }
                    out.push(b'/');
                });
                (dir, text.leaf(self.name_in(id, &mut buf)))
            };
            *key = (dir, leaf, key.2);
        }
        keys.sort_unstable_by(|a, b| {
            let (la, lb) = (text.leaf_at(a.1), text.leaf_at(b.1));
            if a.0 == b.0 {
                return la.cmp(lb);
            }
            let (da, db) = (text.dir_at(a.0), text.dir_at(b.0));
            let common = da.len().min(db.len());
            match da[..common].cmp(&db[..common]) {
                Ordering::Equal => da.iter().chain(la).cmp(db.iter().chain(lb)),
                o => o,
            }
        });
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

impl Default for Paths {
    fn default() -> Self {
        Self::new()
    }
}

/// The table's hash of a node, made from the 32 bits it keeps: the table places an
/// entry by the low bits and tags it with the top 7, so they must vary too.
fn spread(hash: u32) -> u64 {
    u64::from(hash).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The length of a stored name and the bytes its length takes, from its first bytes.
fn name_len(head: &[u8]) -> (usize, usize) {
    match head[0] {
        b if b < 0x80 => (usize::from(b), 1),
        b => (usize::from(b & 0x7f) << 8 | usize::from(head[1]), 2),
    }
}

/// Appends a name as stored: its length, then its bytes.
fn push_name(out: &mut Vec<u8>, name: &[u8]) {
    if name.len() < 0x80 {
        out.push(name.len() as u8);
    } else {
        out.push(0x80 | (name.len() >> 8) as u8);
        out.push(name.len() as u8);
    }
    out.extend_from_slice(name);
}

/// The name stored at `at` in a names arena.
fn name_at(names: &[u8], at: u32) -> &[u8] {
    let at = at as usize;
    let (len, skip) = name_len(&names[at..]);
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
        let mut sorted = [b, a];
        p.sort_by_path(&mut sorted, |id| *id);
        assert_eq!(sorted, [a, b]);
    }

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
    fn names_that_share_bytes_are_told_apart() {
        let mut p = Paths::new();
        let x = p.intern("/ab/c");
        let y = p.intern("/a/bc");
        assert_ne!(x, y);
        assert_eq!(p.path(x), "/ab/c");
        assert_eq!(p.path(y), "/a/bc");
    }

    #[test]
    fn leaf_names_on_disk_are_found_built_and_made_directories() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = Paths::spilling(dir.path(), 16);
        let names: Vec<String> = (0..200)
            .map(|i| format!("/net/env/d{}/f{i}.py", i % 7))
            .collect();
        let ids: Vec<PathId> = names.iter().map(|n| p.intern(n)).collect();
        assert!(
            p.leaves.len() > 1000 && p.leaves.heap_bytes() < 200,
            "on disk"
        );
        for (n, id) in names.iter().zip(&ids) {
            assert_eq!(p.find(n), Some(*id));
            assert_eq!(p.intern(n), *id);
            assert_eq!(&p.path(*id), n);
        }
        assert_eq!(p.find("/net/env/d0/f1.py"), None, "f1 is in d1");
        // A leaf on disk given a child becomes a directory; its path and id stay.
        let f3 = ids[3];
        let under = p.intern("/net/env/d3/f3.py/x");
        assert_eq!(p.parent(under), f3);
        assert_eq!(p.path(under), "/net/env/d3/f3.py/x");
        assert_eq!(p.find("/net/env/d3/f3.py"), Some(f3));
        assert_eq!(p.path(f3), "/net/env/d3/f3.py");
        // Nothing left in the directory: the file is unlinked.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    proptest::proptest! {
        /// Paths sort as their strings do, including names that are prefixes of others
        /// followed by bytes below `/` (`b.c` before `b/x`); with leaf names on disk too.
        #[test]
        fn sort_as_strings(paths in proptest::collection::vec("(/[ab.-]{1,3}){1,4}", 1..12)) {
            let dir = tempfile::tempdir().unwrap();
            for mut p in [Paths::new(), Paths::spilling(dir.path(), 5)] {
                let ids: Vec<PathId> = paths.iter().map(|s| p.intern(s)).collect();
                for (i, a) in ids.iter().enumerate() {
                    proptest::prop_assert_eq!(p.path(*a), paths[i].clone());
                    proptest::prop_assert_eq!(p.find(&paths[i]), Some(*a));
                }
                let mut sorted = ids.clone();
                p.sort_by_path(&mut sorted, |id| *id);
                let mut strings = paths.clone();
                strings.sort();
                let back: Vec<String> = sorted.iter().map(|id| p.path(*id)).collect();
                proptest::prop_assert_eq!(back, strings);
            }
        }
    }
}
