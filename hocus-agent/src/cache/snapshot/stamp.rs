//! What a network tree was when its snapshot was taken: every entry's identity (the
//! stamp), read again to tell whether the tree is still the same; and its directories
//! changed too shortly before to be vouched for by their mtime.

use std::{
    collections::{BTreeMap, HashSet},
    io,
    path::{Path, PathBuf},
    sync::Mutex,
};

use super::fill::is_passage;
use crate::{
    cache::walk::{self, DirAttrs, Met, WALKERS},
    shared::identity::Identity,
};

/// Every entry's identity, by path relative to the tree's root ("" is the root).
pub type Stamp = BTreeMap<PathBuf, Identity>;

pub fn identity(m: &Met) -> Identity {
    let s = &m.stat;
    Identity {
        size: s.st_size as u64,
        mtime_ns: s.st_mtime * 1_000_000_000 + s.st_mtime_nsec,
        ctime_ns: s.st_ctime * 1_000_000_000 + s.st_ctime_nsec,
        ino: if m.stable_inodes { s.st_ino } else { 0 },
        mode: s.st_mode,
        uid: s.st_uid,
        gid: s.st_gid,
    }
}

/// Reads the stamp of a network tree (inside the watched `tree`), but for its
/// `passages` (by path below `root`): those are shown from the network itself, and
/// their names are in their parents' stamps.
pub fn stamp(tree: &Path, root: &Path, passages: &HashSet<PathBuf>) -> io::Result<Stamp> {
    let out = Mutex::new(Stamp::new());
    walk::walk::<io::Error>(
        tree,
        root,
        WALKERS,
        DirAttrs::Cached,
        |rel| !passages.contains(rel),
        |m| {
            if !is_passage(m) {
                out.lock().unwrap().insert(m.rel.to_owned(), identity(m));
            }
            Ok(true)
        },
    )?;
    Ok(out.into_inner().unwrap())
}

/// How close to the reading of its stamp a directory's mtime makes it racy: the mtime's
/// granularity (1 s) plus what a client may have cached, with a margin.
pub const RACY: std::time::Duration = std::time::Duration::from_secs(3);

/// The directories of `stamp`, read at `read_at`, that changed within `RACY` of it.
pub fn racy(stamp: &Stamp, read_at: std::time::SystemTime) -> Vec<PathBuf> {
    let since = read_at
        .checked_sub(RACY)
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as i64);
    stamp
        .iter()
        .filter(|(_, id)| id.is_dir() && id.mtime_ns >= since)
        .map(|(rel, _)| rel.clone())
        .collect()
}
