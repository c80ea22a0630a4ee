//! The keeper's snapshots, as a flow across its parts: choosing trees to hold whole,
//! measuring and taking them on a worker, adopting the wanted files they hold into the
//! cache, filling a lazy snapshot's stub once its file is copied, and dropping a
//! snapshot when its tree changes or jobs outgrow it.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
};

use super::{
    Keeper,
    snapshots::{Snapshot, Snapshots},
    work::Work,
};
use crate::{
    cache::{copy::CopyError, snapshot},
    shared::{identity::Identity, log_line as logs, size::human},
};

/// The cache's copies under a snapshot's root, by source: its local copy and identity.
type Cached = HashMap<PathBuf, (PathBuf, Identity)>;

impl Keeper {
    /// What one snapshot may fill: half of what the SSD budget leaves.
    fn snapshot_room(&self) -> u64 {
        self.snapshot_free() / 2
    }

    /// What the SSD budget leaves beyond the cache's copies and the snapshots in place.
    fn snapshot_free(&self) -> u64 {
        self.effective_ssd_budget
            .saturating_sub(self.cache.used() + self.snapshots.bytes())
    }

    /// Drops the snapshots whose passages jobs now use, so that they are taken again
    /// with what is used there: else those would stay on the network. Says whether any
    /// was.
    pub(super) fn drop_outgrown(&mut self) -> bool {
        let outgrown = self.snapshots.outgrown(self.placement.shortlist());
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

    /// Looks for trees to hold whole: see `snapshot::candidates`. Each fits within half
    /// of what the SSD budget leaves; a tree too big is served file by file instead.
    pub(super) fn consider_snapshots(&mut self) {
        self.snapshots
            .expire_unsuitable(self.config.revalidate * 10);
        let unclean = self.copies.unclean();
        let unclean: Vec<&Path> = unclean.iter().map(PathBuf::as_path).collect();
        let shortlist = self.placement.shortlist();
        let chains = snapshot::candidates(shortlist, &self.config.trees, &unclean);
        // A snapshot would hold a file read in part whole: the directories above one
        // that gets a partial copy are passed by (docs/partial-copies.md).
        let partial: Vec<&Path> = shortlist
            .files()
            .filter(|f| self.partial_ranges(f).is_some())
            .map(|f| Path::new(f.path))
            .collect();
        let chains: Vec<Vec<PathBuf>> = chains
            .into_iter()
            .map(|mut chain| {
                chain.retain(|root| !partial.iter().any(|f| f.starts_with(root)));
                chain
            })
            .filter(|chain| !chain.is_empty())
            .collect();
        let hot = if self.snapshots.lazy {
            Snapshots::hot_bytes(&chains, shortlist)
        } else {
            Default::default()
        };
        // Lazy snapshots to start, started after the loop: what each fills and the
        // copies it links are then found in one pass for them all. The loop asks nothing
        // per chain that grows with the others: a site-wide working set has thousands
        // of chains (a scan of every snapshot or copy per chain kept the keeper 8 s from
        // answering anything).
        let mut chosen: HashMap<PathBuf, u64> = HashMap::new();
        let copying = self.copies.dirs_under_way();
        let free = self.snapshot_free();
        let mut claimed = 0u64;
        for chain in chains {
            let taken = |d: &PathBuf| {
                self.snapshots.holding(d).is_some() || d.ancestors().any(|a| chosen.contains_key(a))
            };
            if chain.iter().any(taken) {
                continue; // held already, or being taken
            }
            // Copies still under way there are linked into the snapshot once done.
            if copying.contains(chain[0].as_path()) {
                continue;
            }
            // Half of what is left once the snapshots chosen so far are taken.
            let room = free.saturating_sub(claimed) / 2;
            let chain: Vec<PathBuf> = chain
                .into_iter()
                .filter(|root| !self.snapshots.is_unsuitable(root))
                .collect();
            let Some(tree) = chain.first().and_then(|top| self.tree_of(top)).cloned() else {
                continue;
            };
            if self.snapshots.lazy {
                // What a lazy snapshot fills is known: the working set under it (and
                // files not readable by everyone, few). The highest directory whose
                // working set fits is taken at once, the walk giving it up if it is too
                // big after all, and a lower one is tried next.
                let fits = chain
                    .iter()
                    .map(|root| (root, hot.get(root).copied().unwrap_or(0)))
                    .find(|(_, bytes)| *bytes <= room);
                if let Some((root, bytes)) = fits {
                    claimed += bytes;
                    chosen.insert(root.clone(), bytes);
                }
                continue;
            }
            if !self.snapshots.measure(chain[0].clone()) {
                continue;
            }
            let fill = self.snapshots.fill(&chain[0], self.placement.shortlist());
            self.workers.send(Work::Measure {
                tree,
                chain,
                fill,
                room,
            });
        }
        let roots: HashSet<&Path> = chosen.keys().map(PathBuf::as_path).collect();
        let mut fills = self
            .snapshots
            .fills(roots.iter().copied(), self.placement.shortlist());
        let mut cached = self.cached_under(&roots);
        for (root, bytes) in chosen {
            let fill = fills.remove(&root).unwrap_or_default();
            let cached = cached.remove(&root).unwrap_or_default();
            self.start_snapshot(root, bytes, fill, cached);
        }
    }

    /// The cache's copies under each of `roots` (linked into their snapshots), in one
    /// pass over the cache.
    fn cached_under(&self, roots: &HashSet<&Path>) -> HashMap<PathBuf, Cached> {
        let mut under: HashMap<PathBuf, Cached> = HashMap::new();
        if roots.is_empty() {
            return under;
        }
        for (source, copy) in self.cache.sources() {
            let path = Path::new(source);
            if let Some(root) = path.ancestors().find(|a| roots.contains(a)) {
                under
                    .entry(root.to_owned())
                    .or_default()
                    .insert(path.to_owned(), (self.cache.local(source), copy.identity));
            }
        }
        under
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
            self.snapshots.measured(top);
        }
        for root in unsuitable {
            self.snapshots.unsuitable(root);
        }
        if let Some((root, bytes)) = chosen {
            let busy = chain.iter().any(|d| self.snapshots.holding(d).is_some())
                || self.copies.under_way_below(&root);
            if !busy && bytes <= self.snapshot_room() {
                let fill = self.snapshots.fill(&root, self.placement.shortlist());
                let cached = self
                    .cached_under(&HashSet::from([root.as_path()]))
                    .remove(&root)
                    .unwrap_or_default();
                self.start_snapshot(root, bytes, fill, cached);
            }
        }
        // Copies that waited for this measurement, and are not in the snapshot.
        self.place();
        if !self.settling() {
            // Prefetches that waited for this measurement may be done.
            let pinned = self.pinned_now();
            self.prefetches.settled(pinned);
        }
    }

    fn start_snapshot(&mut self, root: PathBuf, bytes: u64, fill: snapshot::Fill, cached: Cached) {
        let Some(tree) = self.tree_of(&root).cloned() else {
            return;
        };
        log::info!("taking a snapshot of {} ({})", root.display(), human(bytes));
        self.snapshots.taking(root.clone(), bytes);
        // A prefetch under way waits for it too.
        self.prefetches.wait_for_tree(&root, bytes);
        let room = self.snapshot_room();
        self.workers.send(Work::Snapshot {
            fill,
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
        let Some(expected) = self.snapshots.taken(&root) else {
            // Dropped while it was being taken.
            self.remove_tree(&root);
            self.tree_done(&root, 0, false);
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
                self.prefetches.got_with_tree(&root, files, adopted);
                self.snapshots.hold(
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
                    .pinning
                    .pins
                    .sources()
                    .filter(|s| Path::new(s).starts_with(&root))
                    .cloned()
                    .collect();
                for source in inside {
                    self.pinning.unpin(&source);
                    self.pin(&source);
                }
                // Pins of the files adopted; copies of the wanted files it holds as stubs.
                self.place_after_snapshots();
                self.tree_done(&root, expected, true);
            }
            Err(
                e @ (CopyError::TooLarge { .. } | CopyError::TooMany { .. } | CopyError::Unsafe(_)),
            ) => {
                log::info!(
                    "no snapshot of {}: {e}; a directory below it may do",
                    root.display()
                );
                self.snapshots.unsuitable(root.clone());
                // Before the report: a prefetch waits for the one tried next.
                self.consider_snapshots();
                self.place_after_snapshots();
                self.tree_done(&root, 0, true);
            }
            Err(e) => {
                let gone = "directories not snapshotted, gone from the network";
                if !self.tally_gone(&e, gone, &root) {
                    log::info!(
                        "no snapshot of {}: {e}; its files are served one by one",
                        root.display()
                    );
                }
                self.snapshots.unsuitable(root.clone());
                self.place_after_snapshots();
                self.tree_done(&root, expected, false);
            }
        }
    }

    /// A snapshot a prefetch may wait for is done.
    fn tree_done(&mut self, root: &Path, size: u64, ok: bool) {
        let (settling, pinned) = (self.settling(), self.pinned_now());
        self.prefetches.tree_done(root, size, ok, settling, pinned);
    }

    /// Places the working set again once no snapshot is being taken: with many
    /// snapshots under way (a profile of many packages), placing after each one would
    /// cost a whole placement per tree, and keep the keeper from its other orders (a
    /// stop). A prefetch waits for every tree under way, so none finishes before.
    fn place_after_snapshots(&mut self) {
        if self.snapshots.none_being_taken() {
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
            if self.placement.wanted(&source).is_none() || self.cache.contains(&source) {
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
                        let opener = self.copies.opener(&source);
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
        let Some((root, snap)) = self.snapshots.held(Path::new(source)) else {
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
        if !self.snapshots.forget(root) {
            return false;
        }
        self.board.withdraw(root);
        log::info!(
            "dropping the snapshot of {} ({why}): later opens go to the network",
            root.display()
        );
        self.jobs.detach(&root.to_string_lossy());
        self.remove_tree(root);
        true
    }

    /// Moves a snapshot's local tree out of the way at once (a rename), and has a worker
    /// delete it.
    fn remove_tree(&mut self, root: &Path) {
        let local = self.cache.tree_local(root);
        let away = self
            .cache
            .tmp_dir()
            .join(format!("dropped-{}", self.snapshots.next_removal()));
        match std::fs::rename(&local, &away) {
            Ok(()) => self.workers.send(Work::Remove(away)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => log::warn!("could not delete the snapshot of {}: {e}", root.display()),
        }
    }
}
