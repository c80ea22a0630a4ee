//! A job's start checked against the server once for all its nodes (issue 52): a node
//! of a multi-node Slurm job asks its parent in the job's tree (docs/fanout.md) to vouch
//! for its copies' checks, and the parent answers for what its own copies expect too,
//! checked against the server as its own job start checks them (once for the job starts
//! that come together), or vouched for by its own parent in turn, up to the tree's
//! root (the parent's side is `confirm::vouch_for`). A check vouched for is as recent
//! as a check this node would reuse from another job's start (`confirm::REUSE`): a job
//! sees nothing older than a plain process would.
//!
//! What the parent vouches for is named by a digest of the expectation (the identities
//! a copy was made at, as the server gave them: the same on every node), never of a
//! local path: a parent answers only for what it would check for a job of its own, and
//! asks the server nothing else. A snapshot with a directory whose names must be
//! compared with the copy (`racy`) is checked by each node itself: the parent's
//! comparison is with its own copy. What is not vouched for in time, this node checks.

use std::{
    os::unix::ffi::OsStrExt,
    path::Path,
    time::{Duration, Instant},
};

use crate::{
    cache::relay::Parent,
    redirect::mountns::{Bind, Expect},
    shared::{identity::Identity, relay::Hash},
};

/// The digest of what a copy expects of the network, the same on every node that made
/// its copy of the same version; None where a parent cannot vouch for it.
pub fn digest(expect: &Expect) -> Option<Hash> {
    fn identity(h: &mut blake3::Hasher, id: &Identity) {
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
    }
    let mut h = blake3::Hasher::new();
    match expect {
        Expect::Nothing => return None,
        Expect::File(id) => {
            h.update(b"file");
            identity(&mut h, id);
        }
        Expect::Snapshot(entries) => {
            if entries.iter().any(|e| e.racy) {
                return None;
            }
            // In the order of their paths: each node lists a directory as its server
            // answers it.
            let mut sorted: Vec<_> = entries.iter().collect();
            sorted.sort_by(|a, b| a.rel.cmp(&b.rel));
            h.update(b"snapshot");
            for e in sorted {
                let rel = e.rel.as_os_str().as_bytes();
                h.update(&(rel.len() as u64).to_be_bytes());
                h.update(rel);
                identity(&mut h, &e.identity);
            }
        }
    }
    Some(*h.finalize().as_bytes())
}

/// Of `binds`, those `parent` vouches for within `allowed` with a check begun less than
/// `fresh` ago, each with when that check began (at the latest); and the others, for
/// this node to check.
pub(super) fn vouched_by(
    parent: &Parent,
    binds: Vec<Bind>,
    allowed: Duration,
    fresh: Duration,
) -> (Vec<(Bind, Instant)>, Vec<Bind>) {
    let asked: Vec<(usize, Hash)> = binds
        .iter()
        .enumerate()
        .filter_map(|(i, b)| Some((i, digest(&b.expect)?)))
        .collect();
    if asked.is_empty() {
        return (Vec::new(), binds);
    }
    let items: Vec<(&Path, Hash)> = asked
        .iter()
        .map(|&(i, d)| (binds[i].target.as_path(), d))
        .collect();
    let Ok((sent, ages)) = parent.vouch(&items, allowed) else {
        return (Vec::new(), binds);
    };
    let mut at = vec![None; binds.len()];
    for (&(i, _), age) in asked.iter().zip(ages) {
        // The parent's check began `age` before it answered, which was after `sent`.
        at[i] = age
            .and_then(|age| sent.checked_sub(age))
            .filter(|began| began.elapsed() < fresh);
    }
    let (mut vouched, mut left) = (Vec::new(), Vec::new());
    for (b, at) in binds.into_iter().zip(at) {
        match at {
            Some(at) => vouched.push((b, at)),
            None => left.push(b),
        }
    }
    (vouched, left)
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

    #[test]
    fn a_digest_names_the_expectation_whatever_order_a_server_listed_it_in() {
        let a = Expect::Snapshot(vec![entry("", 0, false), entry("x", 1, false)]);
        let listed_otherwise = Expect::Snapshot(vec![entry("x", 1, false), entry("", 0, false)]);
        let changed = Expect::Snapshot(vec![entry("", 0, false), entry("x", 2, false)]);
        assert_eq!(digest(&a), digest(&listed_otherwise));
        assert!(digest(&a).is_some());
        assert_ne!(digest(&a), digest(&changed));
        let file = Expect::File(entry("", 0, false).identity);
        assert_ne!(
            digest(&file),
            digest(&Expect::Snapshot(vec![entry("", 0, false)]))
        );
        // What only each node's own copy can confirm is not vouched for.
        let racy = Expect::Snapshot(vec![entry("", 0, true)]);
        assert_eq!(digest(&racy), None);
        assert_eq!(digest(&Expect::Nothing), None);
    }
}
