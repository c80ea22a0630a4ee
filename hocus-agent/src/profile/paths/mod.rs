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

use std::hash::BuildHasher;

use hashbrown::{DefaultHashBuilder, HashTable};

use crate::{profile::records::Records, shared::memory::table_bytes};

mod sort;
pub use sort::SlicedSort;

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
}
