//! The keeper's snapshots: choosing trees to hold whole, taking them on a worker,
//! pinning through them, and dropping them when their tree changes.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::Instant,
};

use super::{Keeper, decide, work::Work};
use crate::{
    cache::{copy::CopyError, snapshot},
    shared::{identity::Identity, log_line as logs, size::human},
};

/// A snapshot in place: where it is, and what the network tree was.
pub(super) struct Snapshot {
    pub local: PathBuf,
    pub tree: PathBuf,
    pub stamp: snapshot::Stamp,
    /// Its directories whose stamp cannot vouch for them (`snapshot::Taken::racy`).
    pub racy: std::collections::HashSet<PathBuf>,
    /// Bytes it holds beyond the files it shares with the cache.
    pub bytes: u64,
    /// It holds stubs of files left on the network: shown through an overlay.
    pub lazy: bool,
    /// Its directories no job used, by path below the root: shown from the network
    /// itself (`snapshot::Taken::passages`).
    pub passages: std::collections::HashSet<PathBuf>,
}

impl Keeper {
    /// The snapshot in place (not one being taken) holding `path`, and its root.
    pub(super) fn held_snapshot(&self, path: &Path) -> Option<(&PathBuf, &Snapshot)> {
        self.snapshots
            .iter()
            .find(|(root, _)| path.starts_with(root))
    }

    /// Whether a snapshot in place serves `path` (not one of its passages).
    pub(super) fn in_snapshot(&self, path: &Path) -> bool {
        self.held_snapshot(path).is_some() && !self.in_passage(path)
    }

    /// Whether `path` lies in a passage of the snapshot in place holding it: a directory
    /// it left to the network, which jobs see as the network shows it.
    pub(super) fn in_passage(&self, path: &Path) -> bool {
        self.held_snapshot(path)
            .is_some_and(|(root, snap)| snapshot::in_passage(root, &snap.passages, path))
    }

    /// Drops the snapshots whose passages jobs now use (a file read, a name probed or a
    /// directory listed there), so that they are taken again with what is used there:
    /// else those would stay on the network. Says whether any was.
    pub(super) fn drop_outgrown(&mut self) -> bool {
        if self.snapshots.values().all(|s| s.passages.is_empty()) {
            return false;
        }
        let mut outgrown: Vec<(PathBuf, PathBuf)> = Vec::new();
        let mut last = None;
        for dir in self.view.used_dirs() {
            // Files of one directory mostly come one after another.
            if last.replace(dir) == Some(dir) {
                continue;
            }
            if let Some((root, snap)) = self.held_snapshot(dir)
                && snapshot::in_passage(root, &snap.passages, dir)
                && !outgrown.iter().any(|(r, _)| r == root)
            {
                outgrown.push((root.clone(), dir.to_owned()));
            }
        }
        // Not an invalidation: what it holds is still the network's.
        for (root, dir) in &outgrown {
            self.remove_snapshot(
                root,
                &format!(
                    "jobs now use {}, which it left on the network: it is taken again",
                    dir.display()
                ),
            );
        }
        !outgrown.is_empty()
    }

    /// The snapshot root (in place or being taken) holding `path`, if any.
    pub(super) fn snapshot_of(&self, path: &Path) -> Option<PathBuf> {
        let roots = self.snapshots.keys().chain(self.snapshots_in_flight.keys());
        decide::snapshot_holding(path, roots).cloned()
    }

    /// Whether a snapshot holding `path` is being measured or taken: its copy waits,
    /// and is adopted from the snapshot (or started if none is taken).
    pub(super) fn snapshot_coming(&self, path: &Path) -> bool {
        self.measuring
            .iter()
            .chain(self.snapshots_in_flight.keys())
            .any(|root| path.starts_with(root))
    }

    /// Which files a snapshot of `root` holds the bytes of, and which directories it
    /// walks: with lazy views, what the working set used under it; else all.
    fn fill(&self, root: &Path) -> snapshot::Fill {
        if !self.lazy_views {
            return snapshot::Fill::Whole;
        }
        let under = |p: &&Path| p.starts_with(root);
        snapshot::Fill::Lazy(snapshot::Used::new(
            root,
            self.view.files().map(|f| Path::new(f.path)).filter(under),
            self.view.used_dirs().filter(under),
        ))
    }

    /// The bytes of the working set's files under each directory of `chains`.
    fn hot_bytes(&self, chains: &[Vec<PathBuf>]) -> HashMap<PathBuf, u64> {
        let mut hot: HashMap<PathBuf, u64> =
            chains.iter().flatten().map(|d| (d.clone(), 0)).collect();
        for f in self.view.files() {
            for dir in Path::new(f.path).ancestors().skip(1) {
                if let Some(bytes) = hot.get_mut(dir) {
                    *bytes += f.size;
                }
            }
        }
        hot
    }

    /// What one snapshot may fill: half of what the SSD budget leaves.
    fn snapshot_room(&self) -> u64 {
        self.effective_ssd_budget
            .saturating_sub(self.cache.used() + self.snapshot_bytes())
            / 2
    }

    pub(super) fn snapshot_bytes(&self) -> u64 {
        self.snapshots.values().map(|s| s.bytes).sum()
    }

    /// Looks for trees to hold whole: see `snapshot::candidates`. Each fits within half
    /// of what the SSD budget leaves; a tree too big is served file by file instead.
    pub(super) fn consider_snapshots(&mut self) {
        let now = Instant::now();
        self.unsuitable
            .retain(|_, at| now.duration_since(*at) < self.config.revalidate * 10);
        let unclean: Vec<PathBuf> = self
            .refused
            .iter()
            .chain(self.unstable.keys())
            .map(PathBuf::from)
            .collect();
        let unclean: Vec<&Path> = unclean.iter().map(PathBuf::as_path).collect();
        let chains = snapshot::candidates(&self.view, &self.config.trees, &unclean);
        let hot = if self.lazy_views {
            self.hot_bytes(&chains)
        } else {
            HashMap::new()
        };
        for chain in chains {
            if chain.iter().any(|d| self.snapshot_of(d).is_some()) {
                continue; // held already, or being taken
            }
            // Copies still under way there are linked into the snapshot once done.
            if self
                .in_flight
                .keys()
                .any(|s| Path::new(s).starts_with(&chain[0]))
            {
                continue;
            }
            let room = self.snapshot_room();
            let chain: Vec<PathBuf> = chain
                .into_iter()
                .filter(|root| !self.unsuitable.contains_key(root))
                .collect();
            let Some(tree) = chain.first().and_then(|top| self.tree_of(top)).cloned() else {
                continue;
            };
            if self.lazy_views {
                // What a lazy snapshot fills is known: the working set under it (and
                // files not readable by everyone, few). The highest directory whose
                // working set fits is taken at once, the walk giving it up if it is too
                // big after all, and a lower one is tried next.
                let fits = chain
                    .iter()
                    .map(|root| (root, hot.get(root).copied().unwrap_or(0)))
                    .find(|(_, bytes)| *bytes <= room);
                if let Some((root, bytes)) = fits {
                    self.start_snapshot(root.clone(), bytes);
                }
                continue;
            }
            if !self.measuring.insert(chain[0].clone()) {
                continue;
            }
            let fill = self.fill(&chain[0]);
            self.workers.send(Work::Measure {
                tree,
                chain,
                fill,
                room,
            });
        }
    }

    /// A chain was measured: the directory chosen is snapshotted, if nothing took its
    /// place meanwhile.
    pub(super) fn measured(
        &mut self,
        chain: Vec<PathBuf>,
        chosen: Option<(PathBuf, u64)>,
        unsuitable: Vec<PathBuf>,
    ) {
        if let Some(top) = chain.first() {
            self.measuring.remove(top);
        }
        self.start_measured(&chain, chosen, unsuitable);
        // Copies that waited for this measurement, and are not in the snapshot.
        self.place();
        if !self.settling() {
            // Prefetches that waited for this measurement may be done.
            self.advance(|_| true);
        }
    }

    /// Starts the snapshot a measurement chose, if nothing took its place meanwhile.
    fn start_measured(
        &mut self,
        chain: &[PathBuf],
        chosen: Option<(PathBuf, u64)>,
        unsuitable: Vec<PathBuf>,
    ) {
        let now = Instant::now();
        for root in unsuitable {
            self.unsuitable.insert(root, now);
        }
        let Some((root, bytes)) = chosen else {
            return;
        };
        let busy = chain.iter().any(|d| self.snapshot_of(d).is_some())
            || self
                .in_flight
                .keys()
                .any(|s| Path::new(s).starts_with(&root));
        let room = self.snapshot_room();
        if !busy && bytes <= room {
            self.start_snapshot(root, bytes);
        }
    }

    pub(super) fn start_snapshot(&mut self, root: PathBuf, bytes: u64) {
        let Some(tree) = self.tree_of(&root).cloned() else {
            return;
        };
        let cached = self
            .cache
            .sources()
            .filter(|(s, _)| Path::new(s).starts_with(&root))
            .map(|(s, c)| (PathBuf::from(s), (self.cache.local(s), c.identity)))
            .collect();
        log::info!("taking a snapshot of {} ({})", root.display(), human(bytes));
        self.snapshots_in_flight.insert(root.clone(), bytes);
        // A prefetch under way waits for it too.
        for w in &mut self.prefetches {
            if w.trees.insert(root.clone()) {
                w.progress.trees_total += 1;
                w.progress.tree_bytes_total += bytes;
            }
        }
        let room = self.snapshot_room();
        self.workers.send(Work::Snapshot {
            fill: self.fill(&root),
            room,
            dest: self.cache.tree_local(&root),
            root,
            tree,
            cached,
        });
    }

    pub(super) fn snapshotted(
        &mut self,
        root: PathBuf,
        result: Result<(snapshot::Stamp, snapshot::Taken), CopyError>,
    ) {
        let Some(expected) = self.snapshots_in_flight.remove(&root) else {
            // Dropped while it was being taken.
            self.remove_tree(&root);
            self.report_tree(&root, 0, false);
            return;
        };
        match result {
            Ok((stamp, taken)) => {
                log::info!(
                    "snapshot of {} in place in {:.2} s (walked in {:.2} s): {} copied, {} shared with cached files, {} files ({}) left on the network until read, {} directories no job used shown from the network",
                    root.display(),
                    taken.time.as_secs_f64(),
                    taken.walk_time.as_secs_f64(),
                    human(taken.copied),
                    human(taken.linked),
                    taken.stubs,
                    human(taken.left),
                    taken.passages.len()
                );
                let tree = self.tree_of(&root).cloned().unwrap_or_default();
                let local = self.cache.tree_local(&root);
                let (files, adopted) = self.adopt(&root, &local, &stamp, &taken.held);
                // A prefetch waiting for the tree got these files with it.
                for w in self
                    .prefetches
                    .iter_mut()
                    .filter(|w| w.trees.contains(&root))
                {
                    w.progress.files_total += files;
                    w.progress.files_done += files;
                    w.progress.bytes_total += adopted;
                    w.progress.bytes_done += adopted;
                }
                self.snapshots.insert(
                    root.clone(),
                    Snapshot {
                        local,
                        tree,
                        stamp,
                        racy: taken.racy.into_iter().collect(),
                        bytes: taken.copied - adopted,
                        lazy: taken.stubs > 0,
                        passages: taken.passages.into_iter().collect(),
                    },
                );
                // Pins of files in it move to the snapshot's inodes (the same ones where
                // the copy was linked).
                let inside: Vec<String> = self
                    .pins
                    .sources()
                    .filter(|s| Path::new(s).starts_with(&root))
                    .cloned()
                    .collect();
                for source in inside {
                    self.unpin(&source);
                    self.pin(&source);
                }
                // Pins of the files adopted; copies of the wanted files it holds as stubs.
                self.place_after_snapshots();
                self.report_tree(&root, expected, true);
            }
            Err(
                e @ (CopyError::TooLarge { .. } | CopyError::TooMany { .. } | CopyError::Unsafe(_)),
            ) => {
                log::info!(
                    "no snapshot of {}: {e}; a directory below it may do",
                    root.display()
                );
                self.unsuitable.insert(root.clone(), Instant::now());
                // Before the report: a prefetch waits for the one tried next.
                self.consider_snapshots();
                self.place_after_snapshots();
                self.report_tree(&root, 0, true);
            }
            Err(e) => {
                log::info!(
                    "no snapshot of {}: {e}; its files are served one by one",
                    root.display()
                );
                self.unsuitable.insert(root.clone(), Instant::now());
                self.place_after_snapshots();
                self.report_tree(&root, expected, false);
            }
        }
    }

    /// Places the working set again once no snapshot is being taken: with many
    /// snapshots under way (a profile of many packages), placing after each one would
    /// cost a whole placement per tree, and keep the keeper from its other orders (a
    /// stop). A prefetch waits for every tree under way, so none finishes before.
    fn place_after_snapshots(&mut self) {
        if self.snapshots_in_flight.is_empty() {
            self.place();
        }
    }

    /// Makes the wanted files a snapshot copied whole (`held`, below its root) copies
    /// of the cache too: hard links, so they are held once and pinned through the
    /// snapshot's inodes, as files the cache had are linked into a snapshot. Returns
    /// how many, and their bytes, which the cache counts from now on.
    fn adopt(
        &mut self,
        root: &Path,
        local: &Path,
        stamp: &snapshot::Stamp,
        held: &[PathBuf],
    ) -> (usize, u64) {
        let (mut files, mut adopted) = (0, 0);
        for rel in held {
            let source = root.join(rel).to_string_lossy().into_owned();
            let Some(id) = stamp.get(rel) else { continue };
            if self.wanted(&source).is_none() || self.cache.contains(&source) {
                continue;
            }
            let dest = self.cache.local(&source);
            let linked = dest
                .parent()
                .map_or(Ok(()), std::fs::create_dir_all)
                .and_then(|()| std::fs::hard_link(local.join(rel), &dest));
            match linked {
                Ok(()) => {
                    self.cache.insert(&source, *id);
                    files += 1;
                    adopted += id.size;
                    if logs::writes() {
                        let opener = self.last_opener.remove(&source);
                        let what = format!(
                            "copied to SSD with its tree's snapshot ({})",
                            human(id.size)
                        );
                        logs::file_line("cache write", &source, opener.as_ref(), &what);
                    }
                }
                Err(e) => log::debug!("not adopting {source} from its snapshot: {e}"),
            }
        }
        (files, adopted)
    }

    /// A file copied into the cache that a lazy snapshot holds as a stub (it became hot
    /// after the snapshot was taken): the stub is replaced by a hard link to the copy,
    /// so that later jobs read it locally, as if the snapshot had held it from the
    /// start. Only at the identity the snapshot was stamped with; a job already running
    /// may see either, whose bytes are the same.
    pub(super) fn fill_stub(&mut self, source: &str, identity: &Identity) {
        let Some((root, snap)) = self.held_snapshot(Path::new(source)) else {
            return;
        };
        let Ok(rel) = Path::new(source).strip_prefix(root) else {
            return;
        };
        if !snap.lazy || snap.stamp.get(rel) != Some(identity) {
            return;
        }
        let stub = snap.local.join(rel);
        if !snapshot::is_stub(&stub) {
            return; // held already
        }
        let staged = stub.with_file_name(format!(".hocus-fill-{}", std::process::id()));
        let filled = std::fs::hard_link(self.cache.local(source), &staged)
            .and_then(|()| std::fs::rename(&staged, &stub));
        if let Err(e) = filled {
            let _ = std::fs::remove_file(&staged);
            log::debug!("could not fill the stub of {source} in its snapshot: {e}");
        }
    }

    /// Drops a snapshot that no longer stands for its tree (changed, written): counted
    /// as an invalidation.
    pub(super) fn drop_snapshot(&mut self, root: &Path, why: &str) {
        if self.remove_snapshot(root, why) {
            self.status.invalidations += 1;
        }
    }

    /// Takes a snapshot away from jobs and the cache; says whether one was in place.
    fn remove_snapshot(&mut self, root: &Path, why: &str) -> bool {
        self.snapshots_in_flight.remove(root);
        if self.snapshots.remove(root).is_none() {
            return false;
        }
        log::info!(
            "dropping the snapshot of {} ({why}): later opens go to the network",
            root.display()
        );
        self.detach(&root.to_string_lossy());
        self.remove_tree(root);
        true
    }

    /// Moves a snapshot's local tree out of the way at once (a rename), and has a worker
    /// delete it.
    pub(super) fn remove_tree(&mut self, root: &Path) {
        let local = self.cache.tree_local(root);
        self.trees_removed += 1;
        let away = self
            .cache
            .tmp_dir()
            .join(format!("dropped-{}", self.trees_removed));
        match std::fs::rename(&local, &away) {
            Ok(()) => self.workers.send(Work::Remove(away)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => log::warn!("could not delete the snapshot of {}: {e}", root.display()),
        }
    }
}
