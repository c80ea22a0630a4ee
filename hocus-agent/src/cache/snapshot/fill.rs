//! What a snapshot holds and where snapshots could go: which files' bytes it fills and
//! which directories it walks (`Fill`, from what jobs `Used`), the trees worth holding
//! (`candidates`), and its passages (directories it passes by, shown from the network).

use std::{
    collections::HashSet,
    hash::BuildHasher,
    path::{Path, PathBuf},
};

use crate::{
    cache::walk::{At, Met},
    profile::shortlist::Shortlist,
};

/// Which files' bytes a snapshot holds, and which of its directories it walks.
#[derive(Debug, Clone, Default)]
pub enum Fill {
    /// Every file's, every directory: the snapshot is bound as it is.
    #[default]
    Whole,
    /// Those of the files jobs used (the working set), and of those not readable by
    /// everyone (the overlay reads as root, and root may be squashed on the network);
    /// every other file is a stub whose bytes are read from the network on demand,
    /// through an overlay (`redirect::mountns::lazy_overlay`). Only the directories jobs
    /// used are walked; the others are passages, shown from the network itself.
    Lazy(Used),
}

impl Fill {
    /// Whether the snapshot holds the bytes of the file `path` of mode `mode`.
    pub fn holds(&self, path: &Path, mode: u32) -> bool {
        match self {
            Fill::Whole => true,
            Fill::Lazy(used) => mode & 0o004 == 0 || used.file(path),
        }
    }

    /// Whether the snapshot walks the directory `path` (else it is a passage).
    pub fn enters(&self, path: &Path) -> bool {
        match self {
            Fill::Whole => true,
            Fill::Lazy(used) => used.dir(path),
        }
    }
}

/// What jobs used in a tree: the files whose bytes a lazy snapshot holds, and the
/// directories it walks (those holding them, the missing names jobs probed and the
/// directories they listed, and every directory above these). By 64-bit hashes of their
/// paths: the 100k paths of a site-wide working set took ~10 MiB as a set of paths. Two
/// paths with one hash (a chance in ~10^9 at 100k) only mean that a cold file's bytes
/// are copied too, or a directory no job used is walked.
#[derive(Debug, Clone, Default)]
pub struct Used {
    files: hashbrown::HashSet<u64>,
    dirs: hashbrown::HashSet<u64>,
    hasher: hashbrown::DefaultHashBuilder,
}

impl Used {
    /// From the files whose bytes it holds and the directories jobs used
    /// (`Shortlist::used_dirs`), beneath `root`; the files' directories are walked too.
    pub fn new<'a>(
        root: &Path,
        files: impl IntoIterator<Item = &'a Path>,
        dirs: impl IntoIterator<Item = &'a Path>,
    ) -> Self {
        let mut used = Used::default();
        for f in files {
            let h = used.hasher.hash_one(f);
            used.files.insert(h);
            if let Some(dir) = f.parent() {
                used.add_dirs(root, dir);
            }
        }
        for d in dirs {
            used.add_dirs(root, d);
        }
        used
    }

    /// `dir` and the directories above it, up to `root`.
    fn add_dirs(&mut self, root: &Path, dir: &Path) {
        if !dir.starts_with(root) {
            return;
        }
        for d in dir.ancestors() {
            if !self.dirs.insert(self.hasher.hash_one(d)) || d == root {
                break; // the ones above are in already
            }
        }
    }

    fn file(&self, path: &Path) -> bool {
        self.files.contains(&self.hasher.hash_one(path))
    }

    fn dir(&self, path: &Path) -> bool {
        self.dirs.contains(&self.hasher.hash_one(path))
    }
}

/// Where snapshots could go. For every directory jobs used (opened files or probed
/// names in it, or listed it), the directories above it that are clean (nothing in them
/// was written, changed or refused) from the highest one jobs used themselves, highest
/// first, down to the directory itself, never a watched tree's root. The caller takes
/// the first of each list that fits. Not higher: a snapshot is read-only where it walks,
/// and walking is cheap since it passes unused directories by, so a home directory
/// above an environment would otherwise be taken, and a job's first write there refused.
pub fn candidates(
    shortlist: &Shortlist,
    trees: &[PathBuf],
    unclean: &[&Path],
) -> Vec<Vec<PathBuf>> {
    let mut dirty: HashSet<PathBuf> = HashSet::new();
    let changed = shortlist
        .files()
        .filter(|f| f.written || f.kept_on_the_network())
        .map(|f| f.path)
        .chain(
            shortlist
                .dirs
                .iter()
                .filter(|d| d.mutated)
                .map(|d| d.path.as_str()),
        )
        .map(Path::new)
        .chain(unclean.iter().copied());
    for path in changed {
        for a in path.ancestors() {
            if !dirty.insert(a.to_owned()) {
                break; // its ancestors are marked already
            }
        }
    }
    // (A directory holding a written file is unclean: it starts no chain.)
    let mut active: Vec<&Path> = shortlist.used_dirs().collect();
    active.sort();
    active.dedup();
    let used = |d: &Path| active.binary_search(&d).is_ok();
    let mut tops: HashSet<PathBuf> = HashSet::new();
    let mut out = Vec::new();
    // Deepest first: a chain that has a directory to fall back on claims its top.
    for &dir in active.iter().rev() {
        let Some(tree) = trees.iter().find(|t| dir.starts_with(t)) else {
            continue;
        };
        // From the directory up to just below the tree's root, while clean; from the
        // highest one used down.
        let mut chain: Vec<PathBuf> = dir
            .ancestors()
            .take_while(|a| *a != tree.as_path() && !dirty.contains(*a))
            .map(Path::to_owned)
            .collect();
        while chain.last().is_some_and(|top| !used(top)) {
            chain.pop();
        }
        chain.reverse();
        if chain.first().is_some_and(|top| tops.insert(top.clone())) {
            out.push(chain);
        }
    }
    out
}

/// Whether `path`, inside the snapshot of `root`, lies in one of its `passages` (by
/// path below the root): the network serves it.
pub fn in_passage(root: &Path, passages: &HashSet<PathBuf>, path: &Path) -> bool {
    !passages.is_empty()
        && path
            .strip_prefix(root)
            .is_ok_and(|rel| rel.ancestors().any(|a| passages.contains(a)))
}

/// Whether the walk passed the entry `m` by: a directory it did not enter.
pub fn is_passage(m: &Met) -> bool {
    matches!(m.at, At::Entry { .. }) && m.stat.st_mode & libc::S_IFMT == libc::S_IFDIR
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::working_set::WorkingSet;

    #[test]
    fn candidates_are_the_highest_clean_directories_jobs_used() {
        let mut ws = WorkingSet::new(0);
        ws.open("/net/env/lib/site-packages/numpy/core.py", 1, 1);
        ws.missing("/net/env/lib/site-packages/numpy/core.abi3.so", 1);
        ws.open("/net/env/lib/site-packages/scipy/x.py", 1, 1);
        // Python lists the directories of its path.
        ws.dir_opened("/net/env/lib/site-packages");
        ws.open("/net/home/jax-cache/entry-1", 1, 1);
        ws.mark_written("/net/home/jax-cache/entry-2", 1);
        ws.open("/net/top.txt", 1, 1);
        let trees = [PathBuf::from("/net")];
        let c = candidates(&Shortlist::from(ws.to_profile()), &trees, &[]);
        let tops: Vec<_> = c.iter().map(|chain| chain[0].clone()).collect();
        // site-packages was used itself: one candidate for both packages, highest
        // first; not /net/env, clean but only above what was used (a job's first write
        // there would be refused). /net/home holds a written file: nothing above or at
        // jax-cache is clean.
        assert_eq!(tops, [PathBuf::from("/net/env/lib/site-packages")]);
        assert_eq!(
            c[0],
            [
                "/net/env/lib/site-packages",
                "/net/env/lib/site-packages/scipy"
            ]
            .map(PathBuf::from)
        );
        // A refused write in scipy leaves only numpy's own directory.
        let scipy = Path::new("/net/env/lib/site-packages/scipy/x.py");
        let c = candidates(&Shortlist::from(ws.to_profile()), &trees, &[scipy]);
        let tops: Vec<_> = c.iter().map(|chain| chain[0].clone()).collect();
        assert_eq!(tops, [PathBuf::from("/net/env/lib/site-packages/numpy")]);
    }
}
