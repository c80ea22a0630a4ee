//! The keeper's prefetches: what each still waits for (copies, snapshots, and then the
//! pins and measurements they cause), and its progress, streamed to the `prefetch`
//! command until it is finished; and the job's parent node their copies come from
//! first.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    sync::Arc,
};

use hocus_control::status::Progress;

use super::order::Progressing;
use crate::cache::relay::Parent;

/// One prefetch under way.
pub struct Watcher {
    pub remaining: HashSet<String>,
    pub trees: HashSet<PathBuf>,
    pub progress: Progress,
    pub tx: Progressing,
}

/// What is pinned when a prefetch finishes: it reports it.
#[derive(Clone, Copy)]
pub struct Pinned {
    pub files: usize,
    pub bytes: u64,
}

#[derive(Default)]
pub struct Prefetches {
    under_way: Vec<Watcher>,
    /// The job's parent node the prefetches under way copy from first.
    pub parent: Option<Arc<Parent>>,
}

impl Prefetches {
    pub fn any(&self) -> bool {
        !self.under_way.is_empty()
    }

    /// A prefetch starts, waiting for these copies (source, size) and snapshots (root,
    /// bytes): finished at once if there is nothing to wait for and nothing `settling`.
    pub fn start(
        &mut self,
        copies: &[(String, u64)],
        trees: &[(PathBuf, u64)],
        tx: Progressing,
        settling: bool,
        pinned: Pinned,
    ) {
        let progress = Progress {
            files_total: copies.len(),
            bytes_total: copies.iter().map(|(_, size)| size).sum(),
            trees_total: trees.len(),
            tree_bytes_total: trees.iter().map(|(_, bytes)| bytes).sum(),
            ..Default::default()
        };
        let mut w = Watcher {
            remaining: copies.iter().map(|(s, _)| s.clone()).collect(),
            trees: trees.iter().map(|(t, _)| t.clone()).collect(),
            progress,
            tx,
        };
        if w.remaining.is_empty() && w.trees.is_empty() && !settling {
            self.finish(&mut w, pinned);
        } else {
            let _ = w.tx.send(w.progress.clone());
            self.under_way.push(w);
        }
    }

    /// A copy starts: the prefetches under way wait for it too.
    pub fn wait_for_copy(&mut self, source: &str, size: u64) {
        for w in &mut self.under_way {
            if w.remaining.insert(source.to_owned()) {
                w.progress.files_total += 1;
                w.progress.bytes_total += size;
            }
        }
    }

    /// A snapshot starts: the prefetches under way wait for it too.
    pub fn wait_for_tree(&mut self, root: &Path, bytes: u64) {
        for w in &mut self.under_way {
            if w.trees.insert(root.to_owned()) {
                w.progress.trees_total += 1;
                w.progress.tree_bytes_total += bytes;
            }
        }
    }

    /// A snapshot of `root` brought `files` files (`bytes`) with it: the prefetches
    /// waiting for the tree got them.
    pub fn got_with_tree(&mut self, root: &Path, files: usize, bytes: u64) {
        for w in self.under_way.iter_mut().filter(|w| w.trees.contains(root)) {
            w.progress.files_total += files;
            w.progress.files_done += files;
            w.progress.bytes_total += bytes;
            w.progress.bytes_done += bytes;
        }
    }

    /// A copy a prefetch may wait for is done.
    pub fn copy_done(&mut self, source: &str, size: u64, ok: bool, settling: bool, pinned: Pinned) {
        self.advance(settling, pinned, |w| {
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
    pub fn tree_done(&mut self, root: &Path, size: u64, ok: bool, settling: bool, pinned: Pinned) {
        self.advance(settling, pinned, |w| {
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

    /// What the prefetches waited for besides their copies and snapshots settled (pins
    /// made, trees measured): those with nothing left finish.
    pub fn settled(&mut self, pinned: Pinned) {
        self.advance(false, pinned, |_| true);
    }

    /// Applies `step` to each prefetch; those it changed report progress or finish.
    fn advance(
        &mut self,
        settling: bool,
        pinned: Pinned,
        mut step: impl FnMut(&mut Watcher) -> bool,
    ) {
        let mut finished = Vec::new();
        for (i, w) in self.under_way.iter_mut().enumerate() {
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
            let mut w = self.under_way.remove(i);
            self.finish(&mut w, pinned);
        }
    }

    fn finish(&mut self, w: &mut Watcher, pinned: Pinned) {
        w.progress.finished = true;
        w.progress.pinned_files = pinned.files;
        w.progress.pinned_bytes = pinned.bytes;
        let _ = w.tx.send(w.progress.clone());
        if self.under_way.is_empty() {
            // Later copies are the node's own: from the network.
            self.parent = None;
        }
    }

    /// Copies and snapshots the prefetches under way still wait for.
    pub fn remaining_files(&self) -> usize {
        self.under_way
            .iter()
            .map(|w| w.remaining.len() + w.trees.len())
            .sum()
    }

    /// Bytes the prefetches under way still wait for.
    pub fn remaining_bytes(&self) -> u64 {
        self.under_way
            .iter()
            .map(|w| {
                (w.progress.bytes_total + w.progress.tree_bytes_total)
                    .saturating_sub(w.progress.bytes_done + w.progress.tree_bytes_done)
            })
            .sum()
    }
}
