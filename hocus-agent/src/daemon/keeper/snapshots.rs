//! The keeper's snapshots: those in place (where, what the network tree was), those being
//! taken (with their expected bytes), the chains of directories being measured for one,
//! and the directories found unsuitable lately. What they hold and how a job is given
//! them is here; taking and dropping them, which touches the cache, is `snapshotting`.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use super::decide::snapshot_holding;
use crate::{
    cache::snapshot,
    profile::shortlist::Shortlist,
    redirect::mountns::{Bind, Expect, SnapshotEntry},
};

/// A snapshot in place: where it is, and what the network tree was.
pub struct Snapshot {
    pub local: PathBuf,
    pub tree: PathBuf,
    pub stamp: snapshot::Stamp,
    /// Its directories whose stamp cannot vouch for them (`snapshot::Taken::racy`).
    pub racy: HashSet<PathBuf>,
    /// Bytes it holds beyond the files it shares with the cache.
    pub bytes: u64,
    /// It holds stubs of files left on the network: shown through an overlay.
    pub lazy: bool,
    /// Its directories no job used, by path below the root: shown from the network
    /// itself (`snapshot::Taken::passages`).
    pub passages: HashSet<PathBuf>,
}

pub struct Snapshots {
    /// Snapshots may leave cold files on the network (`mountns::lazy_overlay` works here).
    pub lazy: bool,
    /// In place, by network directory.
    held: HashMap<PathBuf, Snapshot>,
    /// The sum of their `bytes`.
    held_bytes: u64,
    /// Being taken, with their expected bytes.
    taking: HashMap<PathBuf, u64>,
    /// Chains of directories (by their top) being measured for a snapshot.
    measuring: HashSet<PathBuf>,
    /// Directories found unsuitable for a snapshot (too big, odd entries), and when.
    unsuitable: HashMap<PathBuf, Instant>,
    /// Local trees handed to a worker for removal (names them apart in tmp/).
    removed: u64,
}

impl Snapshots {
    pub fn new(lazy: bool) -> Self {
        Self {
            lazy,
            held: HashMap::new(),
            held_bytes: 0,
            taking: HashMap::new(),
            measuring: HashSet::new(),
            unsuitable: HashMap::new(),
            removed: 0,
        }
    }

    /// The snapshot in place (not one being taken) holding `path`, and its root.
    pub fn held(&self, path: &Path) -> Option<(&PathBuf, &Snapshot)> {
        snapshot_holding(path, &self.held)
    }

    /// Whether a snapshot in place serves `path` (not one of its passages).
    pub fn serves(&self, path: &Path) -> bool {
        self.held(path).is_some() && !self.in_passage(path)
    }

    /// Whether `path` lies in a passage of the snapshot in place holding it: a directory
    /// it left to the network, which jobs see as the network shows it.
    pub fn in_passage(&self, path: &Path) -> bool {
        self.held(path)
            .is_some_and(|(root, snap)| snapshot::in_passage(root, &snap.passages, path))
    }

    /// The snapshot root (in place or being taken) holding `path`, if any.
    pub fn holding(&self, path: &Path) -> Option<PathBuf> {
        let held = snapshot_holding(path, &self.held).map(|(root, _)| root);
        held.or_else(|| snapshot_holding(path, &self.taking).map(|(root, _)| root))
            .cloned()
    }

    /// Whether a snapshot holding `path` is being measured or taken: its copy waits,
    /// and is adopted from the snapshot (or started if none is taken).
    pub fn coming(&self, path: &Path) -> bool {
        snapshot_holding(path, &self.taking).is_some()
            || (!self.measuring.is_empty()
                && path.ancestors().any(|dir| self.measuring.contains(dir)))
    }

    /// Bytes the snapshots in place hold beyond the cache's copies.
    pub fn bytes(&self) -> u64 {
        self.held_bytes
    }

    pub fn roots(&self) -> impl Iterator<Item = &PathBuf> {
        self.held.keys()
    }

    /// Their roots, stamps and passages, for a revalidation.
    pub fn stamps(&self) -> Vec<(PathBuf, snapshot::Stamp, HashSet<PathBuf>)> {
        self.held
            .iter()
            .map(|(root, snap)| (root.clone(), snap.stamp.clone(), snap.passages.clone()))
            .collect()
    }

    /// The snapshots whose passages jobs now use (a file read, a name probed or a
    /// directory listed there, in `shortlist`), with such a directory: they are taken again
    /// with what is used there, else those would stay on the network.
    pub fn outgrown(&self, shortlist: &Shortlist) -> Vec<(PathBuf, PathBuf)> {
        if self.held.values().all(|s| s.passages.is_empty()) {
            return Vec::new();
        }
        let mut outgrown: Vec<(PathBuf, PathBuf)> = Vec::new();
        let mut last = None;
        for dir in shortlist.used_dirs() {
            // Files of one directory mostly come one after another.
            if last.replace(dir) == Some(dir) {
                continue;
            }
            if let Some((root, snap)) = self.held(dir)
                && snapshot::in_passage(root, &snap.passages, dir)
                && !outgrown.iter().any(|(r, _)| r == root)
            {
                outgrown.push((root.clone(), dir.to_owned()));
            }
        }
        outgrown
    }

    /// Which files a snapshot of `root` holds the bytes of, and which directories it
    /// walks: with lazy shortlists, what the working set `shortlist` used under it; else all.
    pub fn fill(&self, root: &Path, shortlist: &Shortlist) -> snapshot::Fill {
        // Whole where the map is empty (not lazy).
        self.fills(std::iter::once(root), shortlist)
            .remove(root)
            .unwrap_or_default()
    }

    /// [`Snapshots::fill`] of each of `roots`, in one pass over the shortlist (none if
    /// snapshots are whole).
    pub fn fills<'a>(
        &self,
        roots: impl Iterator<Item = &'a Path>,
        shortlist: &Shortlist,
    ) -> HashMap<PathBuf, snapshot::Fill> {
        let roots: HashSet<&Path> = roots.collect();
        if !self.lazy || roots.is_empty() {
            return HashMap::new();
        }
        let mut files: HashMap<&Path, Vec<&Path>> = HashMap::new();
        let mut dirs: HashMap<&Path, Vec<&Path>> = HashMap::new();
        for f in shortlist.files() {
            let path = Path::new(f.path);
            for dir in path.ancestors().skip(1) {
                if let Some(root) = roots.get(dir) {
                    files.entry(root).or_default().push(path);
                }
            }
        }
        for used in shortlist.used_dirs() {
            for dir in used.ancestors() {
                if let Some(root) = roots.get(dir) {
                    dirs.entry(root).or_default().push(used);
                }
            }
        }
        roots
            .iter()
            .map(|root| {
                let (f, d) = (files.remove(root), dirs.remove(root));
                let used =
                    snapshot::Used::new(root, f.into_iter().flatten(), d.into_iter().flatten());
                (root.to_path_buf(), snapshot::Fill::Lazy(used))
            })
            .collect()
    }

    /// The bytes of the working set's files under each directory of `chains`.
    pub fn hot_bytes(chains: &[Vec<PathBuf>], shortlist: &Shortlist) -> HashMap<PathBuf, u64> {
        let mut hot: HashMap<PathBuf, u64> =
            chains.iter().flatten().map(|d| (d.clone(), 0)).collect();
        for f in shortlist.files() {
            for dir in Path::new(f.path).ancestors().skip(1) {
                if let Some(bytes) = hot.get_mut(dir) {
                    *bytes += f.size;
                }
            }
        }
        hot
    }

    /// Forgets the directories found unsuitable more than `window` ago.
    pub fn expire_unsuitable(&mut self, window: Duration) {
        let now = Instant::now();
        self.unsuitable
            .retain(|_, at| now.duration_since(*at) < window);
    }

    pub fn is_unsuitable(&self, root: &Path) -> bool {
        self.unsuitable.contains_key(root)
    }

    pub fn unsuitable(&mut self, root: PathBuf) {
        self.unsuitable.insert(root, Instant::now());
    }

    /// Starts measuring the chain whose top is `top`; false if it is measured already.
    pub fn measure(&mut self, top: PathBuf) -> bool {
        self.measuring.insert(top)
    }

    pub fn measured(&mut self, top: &Path) {
        self.measuring.remove(top);
    }

    /// Whether chains are being measured (a prefetch waits for the snapshots they lead
    /// to).
    pub fn measuring(&self) -> bool {
        !self.measuring.is_empty()
    }

    /// A snapshot of `root` is being taken, of about `bytes`.
    pub fn taking(&mut self, root: PathBuf, bytes: u64) {
        self.taking.insert(root, bytes);
    }

    /// The snapshot of `root` was taken, or failed: the bytes it was expected to hold,
    /// if it was still wanted (not dropped meanwhile).
    pub fn taken(&mut self, root: &Path) -> Option<u64> {
        self.taking.remove(root)
    }

    /// Snapshots being taken, and their expected bytes.
    pub fn being_taken(&self) -> impl Iterator<Item = (&PathBuf, &u64)> {
        self.taking.iter()
    }

    pub fn none_being_taken(&self) -> bool {
        self.taking.is_empty()
    }

    pub fn hold(&mut self, root: PathBuf, snapshot: Snapshot) {
        self.held_bytes += snapshot.bytes;
        if let Some(old) = self.held.insert(root, snapshot) {
            self.held_bytes -= old.bytes;
        }
    }

    /// Forgets the snapshot of `root`, in place or being taken; whether one was in
    /// place.
    pub fn forget(&mut self, root: &Path) -> bool {
        self.taking.remove(root);
        let held = self.held.remove(root);
        if let Some(old) = &held {
            self.held_bytes -= old.bytes;
        }
        held.is_some()
    }

    /// A name, unique in this run, for a local tree moved away to be deleted.
    pub fn next_removal(&mut self) -> u64 {
        self.removed += 1;
        self.removed
    }

    /// The binds of the snapshots in place, each with what the network held when it was
    /// made (checked as a job starts: `redirect::confirm`): its directories and files.
    /// Not its symlinks: a link cannot be changed in place, only replaced, which changes
    /// its directory.
    pub fn binds(&self) -> impl Iterator<Item = Bind> + '_ {
        self.held.iter().map(|(root, snap)| Bind {
            local: snap.local.clone(),
            target: root.clone(),
            tree: snap.tree.clone(),
            expect: Expect::Snapshot(
                snap.stamp
                    .iter()
                    .filter(|(_, id)| !id.is_symlink())
                    .map(|(rel, id)| SnapshotEntry {
                        rel: rel.clone(),
                        identity: *id,
                        racy: snap.racy.contains(rel),
                    })
                    .collect(),
            ),
            lazy: snap.lazy,
            passages: snap.passages.iter().cloned().collect(),
        })
    }
}
