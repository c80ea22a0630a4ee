//! Snapshots: a local copy of a whole network directory tree that is read-only in
//! practice (an environment's site-packages, a dataset). It holds every entry, cold
//! files too, so a job whose namespace binds it over the network directory gets its
//! failed lookups answered locally as well: the ENOENT probes of an import storm never
//! leave the node.
//!
//! A snapshot is taken into a staging directory and renamed into place whole. Files
//! the cache already holds (same identity) are hard-linked (their pins then cover the
//! snapshot too); the others are copied like any file. Anything but directories, regular
//! files and symlinks makes the tree unsuitable. Its stamp (every entry's identity)
//! tells later whether the network tree is still the same.

use std::{
    collections::BTreeMap,
    fs,
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
};

use std::collections::HashSet;

use crate::{
    cache::copy::{self, CopyError, Identity, Reader},
    profile::format::Profile,
};

/// Every entry's identity, by path relative to the tree's root ("" is the root).
pub type Stamp = BTreeMap<PathBuf, Identity>;

/// Where snapshots could go. For every directory where jobs opened files or probed
/// names, the directories above it that are clean (nothing in them was written, changed
/// or refused), highest first, down to the directory itself, never a watched tree's root.
/// The caller takes the first of each list that fits.
pub fn candidates(profile: &Profile, trees: &[PathBuf], unclean: &[&Path]) -> Vec<Vec<PathBuf>> {
    let mut dirty: HashSet<PathBuf> = HashSet::new();
    let changed = profile
        .files
        .iter()
        .filter(|f| f.written)
        .map(|f| &f.path)
        .chain(profile.dirs.iter().filter(|d| d.mutated).map(|d| &d.path))
        .map(Path::new)
        .chain(unclean.iter().copied());
    for path in changed {
        for a in path.ancestors() {
            if !dirty.insert(a.to_owned()) {
                break; // its ancestors are marked already
            }
        }
    }
    let mut active: Vec<&Path> = profile
        .files
        .iter()
        .filter(|f| f.opens > 0)
        .map(|f| &f.path)
        .chain(profile.missing.iter().map(|m| &m.path))
        .filter_map(|p| Path::new(p).parent())
        .collect();
    active.sort();
    active.dedup();
    let mut tops: HashSet<PathBuf> = HashSet::new();
    let mut out = Vec::new();
    for dir in active {
        let Some(tree) = trees.iter().find(|t| dir.starts_with(t)) else {
            continue;
        };
        // From the directory up to just below the tree's root, while clean.
        let mut chain: Vec<PathBuf> = dir
            .ancestors()
            .take_while(|a| *a != tree.as_path() && !dirty.contains(*a))
            .map(Path::to_owned)
            .collect();
        chain.reverse();
        if chain.first().is_some_and(|top| tops.insert(top.clone())) {
            out.push(chain);
        }
    }
    out
}

/// Walks a network tree without following symlinks: its bytes and entries, or None when
/// it exceeds the limits or holds something a snapshot cannot (devices, sockets, fifos).
pub fn measure(root: &Path, max_bytes: u64, max_entries: usize) -> Option<(u64, usize)> {
    let (mut bytes, mut entries) = (0u64, 0usize);
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).ok()? {
            let entry = entry.ok()?;
            let kind = entry.file_type().ok()?;
            entries += 1;
            if kind.is_dir() {
                stack.push(entry.path());
            } else if kind.is_file() {
                bytes += entry.metadata().ok()?.len();
            } else if !kind.is_symlink() {
                return None;
            }
            if bytes > max_bytes || entries > max_entries {
                return None;
            }
        }
    }
    Some((bytes, entries))
}

/// Reads the stamp of a network tree.
pub fn stamp(root: &Path) -> std::io::Result<Stamp> {
    let mut out = Stamp::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = root.join(&rel);
        out.insert(rel.clone(), Identity::of(&fs::symlink_metadata(&dir)?));
        for entry in fs::read_dir(&dir)? {
            let entry = entry?;
            let child = rel.join(entry.file_name());
            let m = entry.metadata()?;
            if m.is_dir() {
                stack.push(child);
            } else {
                out.insert(child, Identity::of(&m));
            }
        }
    }
    Ok(out)
}

/// What taking a snapshot cost: bytes copied from the network, bytes linked from copies
/// the cache had.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    pub copied: u64,
    pub linked: u64,
}

/// Copies the network tree `root` (inside the watched `tree`) to `dest`, via a staging
/// directory next to it. `cached` gives the cache's copy of a file and its identity.
pub fn take(
    tree: &Path,
    root: &Path,
    dest: &Path,
    tmp_dir: &Path,
    cached: &dyn Fn(&Path) -> Option<(PathBuf, Identity)>,
) -> Result<(Stamp, Taken), CopyError> {
    let parent = dest
        .parent()
        .ok_or_else(|| CopyError::Unsafe("no parent".into()))?;
    fs::create_dir_all(parent).map_err(CopyError::Local)?;
    // Built in the cache's tmp/ (emptied at every start, so a snapshot abandoned by a
    // stop or a crash leaves nothing behind), then renamed into place.
    static TAKEN: AtomicU64 = AtomicU64::new(0);
    let staging = tmp_dir.join(format!(
        "snapshot-{}-{}",
        std::process::id(),
        TAKEN.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let stamp = stamp(root).map_err(CopyError::Source)?;
        let mut taken = Taken::default();
        // Parents come before children in a BTreeMap of paths.
        for (rel, id) in &stamp {
            let src = root.join(rel);
            let dst = staging.join(rel);
            let m = fs::symlink_metadata(&src).map_err(CopyError::Source)?;
            if Identity::of(&m) != *id {
                return Err(CopyError::Changed);
            }
            let kind = m.file_type();
            if kind.is_dir() {
                fs::create_dir(&dst).map_err(CopyError::Local)?;
                fs::set_permissions(&dst, fs::Permissions::from_mode(m.mode() & 0o7777))
                    .map_err(CopyError::Local)?;
                std::os::unix::fs::lchown(&dst, Some(m.uid()), Some(m.gid()))
                    .map_err(CopyError::Local)?;
            } else if kind.is_symlink() {
                let target = fs::read_link(&src).map_err(CopyError::Source)?;
                std::os::unix::fs::symlink(&target, &dst).map_err(CopyError::Local)?;
                std::os::unix::fs::lchown(&dst, Some(m.uid()), Some(m.gid()))
                    .map_err(CopyError::Local)?;
            } else if kind.is_file() {
                match cached(&src) {
                    Some((local, cached_id))
                        if cached_id == *id && fs::hard_link(&local, &dst).is_ok() =>
                    {
                        taken.linked += m.len();
                    }
                    _ => {
                        // Cold files are read as their owner: root may be squashed.
                        let reader = Reader::lookup(m.uid()).unwrap_or_else(Reader::root);
                        let got = copy::copy(tree, &src, &reader, tmp_dir, &dst)?;
                        if got != *id {
                            return Err(CopyError::Changed);
                        }
                        taken.copied += m.len();
                    }
                }
            } else {
                return Err(CopyError::Unsafe(format!(
                    "{} is neither a file, a directory nor a symlink",
                    src.display()
                )));
            }
        }
        // Directory times last: creating their entries changed them.
        for (rel, _) in stamp.iter().rev() {
            let src = fs::symlink_metadata(root.join(rel)).map_err(CopyError::Source)?;
            if src.is_dir() {
                set_times(&staging.join(rel), &src);
            }
        }
        let _ = fs::remove_dir_all(dest);
        fs::rename(&staging, dest).map_err(CopyError::Local)?;
        Ok((stamp, taken))
    })();
    if result.is_err() {
        let _ = fs::remove_dir_all(&staging);
    }
    result
}

fn set_times(path: &Path, m: &fs::Metadata) {
    let Ok(c) = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str()))
    else {
        return;
    };
    let times = copy::times_of(m);
    // SAFETY: valid C string and two timespecs.
    unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::working_set::WorkingSet;

    #[test]
    fn candidates_are_the_highest_clean_directories_above_activity() {
        let mut ws = WorkingSet::new(0);
        ws.open("/net/env/lib/site-packages/numpy/core.py", 1, 1);
        ws.missing("/net/env/lib/site-packages/numpy/core.abi3.so", 1);
        ws.open("/net/env/lib/site-packages/scipy/x.py", 1, 1);
        ws.open("/net/home/jax-cache/entry-1", 1, 1);
        ws.mark_written("/net/home/jax-cache/entry-2", 1);
        ws.open("/net/top.txt", 1, 1);
        let trees = [PathBuf::from("/net")];
        let c = candidates(&ws.to_profile(), &trees, &[]);
        let tops: Vec<_> = c.iter().map(|chain| chain[0].clone()).collect();
        // /net/env is clean: one candidate for both packages, highest first; /net/home
        // holds a written file: nothing above or at jax-cache is clean.
        assert_eq!(tops, [PathBuf::from("/net/env")]);
        assert_eq!(
            c[0],
            [
                "/net/env",
                "/net/env/lib",
                "/net/env/lib/site-packages",
                "/net/env/lib/site-packages/numpy"
            ]
            .map(PathBuf::from)
        );
        // A refused write in scipy leaves only numpy's own directory.
        let scipy = Path::new("/net/env/lib/site-packages/scipy/x.py");
        let c = candidates(&ws.to_profile(), &trees, &[scipy]);
        let tops: Vec<_> = c.iter().map(|chain| chain[0].clone()).collect();
        assert_eq!(tops, [PathBuf::from("/net/env/lib/site-packages/numpy")]);
    }

    #[test]
    fn takes_a_whole_tree_and_notices_changes() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("net");
        let root = tree.join("env/site-packages");
        fs::create_dir_all(root.join("pkg/sub")).unwrap();
        fs::write(root.join("pkg/__init__.py"), b"").unwrap();
        fs::write(root.join("pkg/sub/cold.py"), b"never read\n").unwrap();
        fs::write(root.join("hot.py"), b"x = 1\n").unwrap();
        std::os::unix::fs::symlink("pkg", root.join("alias")).unwrap();
        fs::set_permissions(root.join("pkg/sub"), fs::Permissions::from_mode(0o750)).unwrap();
        assert_eq!(measure(&root, u64::MAX, 100), Some((17, 6)));
        assert_eq!(measure(&root, 10, 100), None, "over the byte limit");
        assert_eq!(measure(&root, u64::MAX, 3), None, "over the entry limit");

        // hot.py is in the cache already: it is linked, not copied again.
        let cache_copy = dir.path().join("cache-hot.py");
        fs::write(&cache_copy, b"x = 1\n").unwrap();
        let hot_id = Identity::of(&fs::metadata(root.join("hot.py")).unwrap());
        let cached = |p: &Path| (p == root.join("hot.py")).then(|| (cache_copy.clone(), hot_id));
        let tmp = dir.path().join("tmp");
        fs::create_dir_all(&tmp).unwrap();
        let dest = dir.path().join("trees/env/site-packages");
        let (stamp_taken, taken) = take(&tree, &root, &dest, &tmp, &cached).unwrap();
        assert_eq!(
            taken,
            Taken {
                copied: 11,
                linked: 6
            }
        );
        assert_eq!(
            fs::read(dest.join("pkg/sub/cold.py")).unwrap(),
            b"never read\n"
        );
        assert_eq!(
            fs::read_link(dest.join("alias")).unwrap(),
            PathBuf::from("pkg")
        );
        assert_eq!(
            fs::metadata(dest.join("pkg/sub")).unwrap().mode() & 0o777,
            0o750
        );
        assert_eq!(
            fs::metadata(dest.join("hot.py")).unwrap().ino(),
            fs::metadata(&cache_copy).unwrap().ino()
        );
        assert_eq!(
            fs::metadata(dest.join("pkg")).unwrap().mtime(),
            fs::metadata(root.join("pkg")).unwrap().mtime()
        );
        assert_eq!(stamp(&root).unwrap(), stamp_taken);
        // A new entry anywhere changes the stamp.
        fs::write(root.join("pkg/sub/new.py"), b"").unwrap();
        assert_ne!(stamp(&root).unwrap(), stamp_taken);
    }
}
