//! Where the kernel's events happened, as the paths the agent sees: a root the kernel
//! placed a file under (a watched tree, the cache's copies and snapshots, a snapshot's
//! overlay in a job) and the path below it, another namespace's absolute path placed by its
//! mounts, or the agent's own absolute path; normalized, and checked against the watched
//! trees again (`..` in a process's path can leave a tree).

use std::{
    collections::HashMap,
    ffi::OsStr,
    os::unix::ffi::OsStrExt,
    path::{Component, Path, PathBuf},
};

use hocus_common::{Event, FIRST_OVERLAY_ROOT, ROOT_NONE, ROOT_VIEW, ev};

use crate::observe::views::Views;

/// A watched tree: its canonical path, and other prefixes that reach it (e.g. the path
/// the user named when it is a symlink).
#[derive(Debug, Clone)]
pub struct Watch {
    pub path: PathBuf,
    pub aliases: Vec<PathBuf>,
}

/// Why an event has no watched path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unplaced {
    /// Longer than the kernel copies.
    Truncated,
    /// Its process, namespace or directory could not be placed.
    Unresolved,
    /// Not under a watched tree once normalized.
    Outside,
}

pub struct Places {
    watches: Vec<Watch>,
    /// Where each of the kernel's roots is, by `Event::root`: a watched tree's path, or
    /// `/` for the cache's directories (the path below them is the network path).
    roots: Vec<PathBuf>,
    /// The network directory each snapshot overlay in a job stands for, by `Event::root`
    /// (`FIRST_OVERLAY_ROOT` and up).
    overlay_roots: HashMap<u32, PathBuf>,
    /// Roots from this index on are the cache's: what is opened under them is served.
    served_from: usize,
}

impl Places {
    /// `roots`: the watched trees', then (from `served_from` on) the cache's.
    pub fn new(watches: Vec<Watch>, roots: Vec<PathBuf>, served_from: usize) -> Self {
        Self {
            watches,
            roots,
            overlay_roots: HashMap::new(),
            served_from,
        }
    }

    /// Whether what the kernel placed under `root` was served by a local copy (the
    /// cache's copies and snapshots, a snapshot's overlay in a job), not the network.
    pub fn is_served(&self, root: u32) -> bool {
        match root {
            ROOT_NONE | ROOT_VIEW => false,
            r if r >= FIRST_OVERLAY_ROOT => self.overlay_roots.contains_key(&r),
            r => (r as usize) >= self.served_from && (r as usize) < self.roots.len(),
        }
    }

    /// `path` in canonical form, if it lies in a watched tree (a path the kernel gave,
    /// such as a descriptor's in /proc).
    pub fn watched_path(&self, path: &Path) -> Option<PathBuf> {
        self.watched(&normalize(path))
    }

    /// Files opened under kernel root `index` are under `dir` (a snapshot overlay's network
    /// directory), until forgotten.
    pub fn add_overlay_root(&mut self, index: u32, dir: PathBuf) {
        self.overlay_roots.insert(index, dir);
    }

    pub fn forget_overlay_root(&mut self, index: u32) {
        self.overlay_roots.remove(&index);
    }

    /// The normalized, watched, absolute path of an event (another namespace's placed
    /// through `views`), or why there is none.
    pub fn resolve(&self, e: &Event, views: &Views) -> Result<String, Unplaced> {
        if e.flags & ev::PATH_TRUNCATED != 0 {
            return Err(Unplaced::Truncated);
        }
        let raw = |bytes: &[u8], len: u32| -> PathBuf {
            let bytes = &bytes[..(len as usize).min(bytes.len())];
            let bytes = bytes.split(|b| *b == 0).next().unwrap_or_default();
            PathBuf::from(OsStr::from_bytes(bytes))
        };
        let path = raw(&e.path, e.path_len);
        let absolute = if e.root == ROOT_NONE {
            path
        } else if e.root == ROOT_VIEW {
            // Another namespace's path: placed by its mounts, as learned.
            let Some(placed) = views.resolve(&e.namespace, e.generation, &normalize(&path)) else {
                return Err(Unplaced::Unresolved);
            };
            placed
        } else {
            let root = match self.roots.get(e.root as usize) {
                Some(root) => Some(root),
                None => self.overlay_roots.get(&e.root),
            };
            let Some(root) = root else {
                return Err(Unplaced::Unresolved);
            };
            // The base is `/a/b` (or empty); the process's path is relative to it.
            let base = raw(&e.base, e.base_len);
            let mut placed = root.join(base.strip_prefix("/").unwrap_or(&base));
            if path.components().any(|c| c == Component::ParentDir) {
                // `..` from a directory bound elsewhere (a container's /env) climbs
                // where the process is, not where the tree is: it names nothing here.
                return Err(Unplaced::Unresolved);
            }
            if !path.as_os_str().is_empty() {
                placed.push(path);
            }
            placed
        };
        let normal = normalize(&absolute);
        match self.watched(&normal) {
            Some(p) => Ok(p.to_string_lossy().into_owned()),
            None => Err(Unplaced::Outside),
        }
    }

    /// `path` in canonical form if it lies in a watched tree.
    fn watched(&self, path: &Path) -> Option<PathBuf> {
        for w in &self.watches {
            if path.starts_with(&w.path) {
                return Some(path.to_owned());
            }
            for alias in &w.aliases {
                if let Ok(rest) = path.strip_prefix(alias) {
                    return Some(w.path.join(rest));
                }
            }
        }
        None
    }
}

/// Removes `.` and `..` and repeated slashes without touching the filesystem.
pub fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::Normal(part) => out.push(part),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_lexically() {
        assert_eq!(
            normalize(Path::new("/a/./b//c/../d")),
            PathBuf::from("/a/b/d")
        );
        assert_eq!(normalize(Path::new("/../..")), PathBuf::from("/"));
    }
}
