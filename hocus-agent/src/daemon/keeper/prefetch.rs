//! The keeper's prefetches: what each still waits for (copies, snapshots, pins), and
//! its progress, streamed to the `prefetch` command until it is finished.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
};

use super::{Keeper, Progressing};
use hocus_control::status::Progress;

pub(super) struct Watcher {
    pub remaining: HashSet<String>,
    pub trees: HashSet<PathBuf>,
    pub progress: Progress,
    pub tx: Progressing,
}

impl Keeper {
    /// Work a prefetch waits for beyond its own copies and snapshots: the pins they
    /// cause (a prefetch reports what it pinned) and the trees being measured for a
    /// snapshot (the snapshot it leads to is part of the warm-up).
    pub(super) fn settling(&self) -> bool {
        !self.pinning.is_empty() || !self.measuring.is_empty()
    }

    /// A copy a prefetch may wait for is done.
    pub(super) fn report(&mut self, source: &str, size: u64, ok: bool) {
        self.advance(|w| {
            if !w.remaining.remove(source) {
                return false;
            }
            w.progress.files_done += 1;
            if ok {
                w.progress.bytes_done += size;
            } else {
                w.progress.failed += 1;
            }
            true
        });
    }

    /// A snapshot a prefetch may wait for is done.
    pub(super) fn report_tree(&mut self, root: &Path, size: u64, ok: bool) {
        self.advance(|w| {
            if !w.trees.remove(root) {
                return false;
            }
            w.progress.trees_done += 1;
            if ok {
                w.progress.tree_bytes_done += size;
            } else {
                w.progress.trees_failed += 1;
            }
            true
        });
    }

    /// Applies `step` to each prefetch; those it changed report progress or finish.
    pub(super) fn advance(&mut self, mut step: impl FnMut(&mut Watcher) -> bool) {
        let settling = self.settling();
        let mut finished = Vec::new();
        for (i, w) in self.prefetches.iter_mut().enumerate() {
            if !step(w) {
                continue;
            }
            if w.remaining.is_empty() && w.trees.is_empty() && !settling {
                finished.push(i);
            } else {
                let _ = w.tx.send(w.progress.clone());
            }
        }
        for i in finished.into_iter().rev() {
            let mut w = self.prefetches.remove(i);
            self.finish(&mut w);
        }
    }

    pub(super) fn finish(&mut self, w: &mut Watcher) {
        w.progress.finished = true;
        w.progress.pinned_files = self.pins.len();
        w.progress.pinned_bytes = self.pins.bytes();
        let _ = w.tx.send(w.progress.clone());
        if self.prefetches.is_empty() {
            // Later copies are the node's own: from the network.
            self.parent = None;
        }
    }
}
