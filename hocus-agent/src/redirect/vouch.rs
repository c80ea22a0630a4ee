//! A job's start checked against the server once for all its nodes (issue 52): a node
//! of a multi-node Slurm job asks its parent in the job's tree (docs/fanout.md) to vouch
//! for its copies' checks, and the parent answers for what its own copies expect too,
//! checked against the server as its own job start checks them (once for the job starts
//! that come together), or vouched for by its own parent in turn, up to the tree's
//! root (the parent's side is `confirm::vouch_for`). A check vouched for is as recent
//! as a check this node would reuse from another job's start (`confirm::REUSE`): a job
//! sees nothing older than a plain process would.
//!
//! What is vouched for is each network path a copy expects, one by one (a copied file,
//! or each entry of a snapshot), named with a digest of the identity expected there (as
//! the server gave it: the same on every node), never a local path: a parent answers
//! only for what it would check for a job of its own, and asks the server nothing else.
//! Nodes may snapshot a tree from different roots (each places its copies from what its
//! own jobs did): what their snapshots share is vouched for, and each node checks the
//! rest itself. A snapshot's directory whose names must be compared with the copy
//! (`racy`) is checked by each node itself: the parent's comparison is with its own
//! copy. What is not vouched for in time, this node checks.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use crate::{
    cache::relay::Parent,
    redirect::mountns::{Bind, Expect},
    shared::{identity::Identity, relay::Hash},
};

/// The digest of the identity a copy expects at a network path, the same on every node
/// that copied the same version.
pub fn digest(id: &Identity) -> Hash {
    let mut h = blake3::Hasher::new();
    h.update(b"identity");
    for word in [
        id.size,
        id.mtime_ns as u64,
        id.ctime_ns as u64,
        id.ino,
        u64::from(id.mode),
        u64::from(id.uid),
        u64::from(id.gid),
    ] {
        h.update(&word.to_be_bytes());
    }
    *h.finalize().as_bytes()
}

/// What a parent may vouch for of `bind`: each network path its copy expects and the
/// identity there, with the snapshot's entry it is (None for a copied file). Not a racy
/// directory: only this node's copy can confirm its names.
pub fn expected(bind: &Bind) -> Vec<(PathBuf, &Identity, Option<&Path>)> {
    match &bind.expect {
        Expect::Nothing => Vec::new(),
        Expect::File(id) => vec![(bind.target.clone(), id, None)],
        Expect::Snapshot(entries) => entries
            .iter()
            .filter(|e| !e.racy)
            .map(|e| {
                // The root as its bind names it, without a trailing '/'.
                let path = match e.rel.as_os_str().is_empty() {
                    true => bind.target.clone(),
                    false => bind.target.join(&e.rel),
                };
                (path, &e.identity, Some(e.rel.as_path()))
            })
            .collect(),
    }
}

/// What a parent vouched for of a job start's binds.
#[derive(Debug, Default)]
pub(super) struct Vouched {
    /// Binds vouched for whole, each with when the oldest of its checks began.
    pub whole: Vec<(Bind, Instant)>,
    /// The others, for this node to check: of each, its snapshot's entries vouched for
    /// and when the oldest of their checks began (none vouched: empty, None).
    pub rest: Vec<(Bind, HashSet<PathBuf>, Option<Instant>)>,
    /// The entries vouched for, in all.
    pub entries: usize,
}

impl Vouched {
    pub(super) fn none(binds: Vec<Bind>) -> Self {
        Self {
            rest: binds
                .into_iter()
                .map(|b| (b, HashSet::new(), None))
                .collect(),
            ..Self::default()
        }
    }
}

/// What `parent` vouches for of `binds` within `allowed`, each entry with a check begun
/// less than `fresh` ago.
pub(super) fn vouched_by(
    parent: &Parent,
    binds: Vec<Bind>,
    allowed: Duration,
    fresh: Duration,
) -> Vouched {
    let expected: Vec<Vec<(PathBuf, &Identity, Option<&Path>)>> =
        binds.iter().map(expected).collect();
    let items: Vec<(&Path, Hash)> = expected
        .iter()
        .flatten()
        .map(|(path, id, _)| (path.as_path(), digest(id)))
        .collect();
    if items.is_empty() {
        return Vouched::none(binds);
    }
    let Ok((sent, ages)) = parent.vouch(&items, allowed) else {
        return Vouched::none(binds);
    };
    // The parent's check began `age` before it answered, which was after `sent`: at
    // the latest then. Judged, as this node judges a check of its own it reuses, by how
    // long before this job's start (`sent`) it began, not by how long the answer took
    // to come. An item past what one request holds is not vouched for.
    let mut ages = ages.into_iter().map(|age| {
        age.and_then(|age| sent.checked_sub(age))
            .filter(|began| sent.saturating_duration_since(*began) < fresh)
    });
    let per_bind: Vec<(HashSet<PathBuf>, Option<Instant>, usize)> = expected
        .iter()
        .map(|expected| {
            let (mut rels, mut oldest, mut vouched) = (HashSet::new(), None::<Instant>, 0);
            for (_, _, rel) in expected {
                if let Some(began) = ages.next().flatten() {
                    vouched += 1;
                    oldest = Some(oldest.map_or(began, |o| o.min(began)));
                    rels.extend(rel.map(Path::to_path_buf));
                }
            }
            (rels, oldest, vouched)
        })
        .collect();
    let mut out = Vouched::default();
    for (bind, (rels, oldest, vouched)) in binds.into_iter().zip(per_bind) {
        out.entries += vouched;
        // Whole: every entry it expects vouched for (a racy directory never is).
        match oldest {
            Some(at) if vouched == checks(&bind) => out.whole.push((bind, at)),
            _ => out.rest.push((bind, rels, oldest)),
        }
    }
    out
}

/// The checks `bind`'s copy needs: one for a copied file, one per entry of a snapshot.
pub(super) fn checks(bind: &Bind) -> usize {
    match &bind.expect {
        Expect::Nothing => 0,
        Expect::File(_) => 1,
        Expect::Snapshot(entries) => entries.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redirect::mountns::SnapshotEntry;

    fn entry(rel: &str, size: u64, racy: bool) -> SnapshotEntry {
        SnapshotEntry {
            rel: rel.into(),
            identity: Identity {
                size,
                mtime_ns: 1,
                ctime_ns: 2,
                ino: 0,
                mode: libc::S_IFREG | 0o644,
                uid: 0,
                gid: 0,
            },
            racy,
        }
    }

    fn bind(expect: Expect) -> Bind {
        Bind {
            local: "/cache/x".into(),
            target: "/net/pkg".into(),
            tree: "/net".into(),
            expect,
            lazy: false,
            passages: Vec::new(),
        }
    }

    #[test]
    fn what_is_vouched_for_is_each_path_a_copy_expects_by_its_identity() {
        let (a, b) = (entry("", 0, false).identity, entry("x", 1, false).identity);
        assert_eq!(digest(&a), digest(&entry("elsewhere", 0, true).identity));
        assert_ne!(digest(&a), digest(&b));
        let snapshot = bind(Expect::Snapshot(vec![
            entry("", 0, false),
            entry("x", 1, false),
            // What only each node's own copy can confirm is not asked.
            entry("d", 2, true),
        ]));
        let asked: Vec<(PathBuf, Option<&Path>)> = expected(&snapshot)
            .into_iter()
            .map(|(path, _, rel)| (path, rel))
            .collect();
        assert_eq!(
            asked,
            [
                (PathBuf::from("/net/pkg"), Some(Path::new(""))),
                (PathBuf::from("/net/pkg/x"), Some(Path::new("x"))),
            ]
        );
        assert_eq!(checks(&snapshot), 3);
        let file = bind(Expect::File(b));
        assert_eq!(expected(&file).len(), 1);
        assert_eq!(expected(&file)[0].0, PathBuf::from("/net/pkg"));
        assert_eq!(checks(&file), 1);
        assert!(expected(&bind(Expect::Nothing)).is_empty());
    }
}
