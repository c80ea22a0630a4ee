//! What the daemon asks of the file servers, counted by watched tree and purpose
//! (`hocus_server_operations_total`, `status`'s `server`): each call it makes on a
//! network mount is counted where it is made, on the thread that makes it, under the
//! purpose its work set for it (`Asking::begin`); a thread with no purpose set counts
//! nothing (its calls are local).
//!
//! One call is one operation: an open or a lookup by a path, a stat (one asked of the
//! server, or one the client may answer from its attribute cache: the daemon cannot
//! tell), a directory's listing, a read (and its bytes), an xattr's. A path the client
//! has not cached costs the server a lookup per component, counted as one; a read
//! larger than the mount's `rsize` is several. So these are the daemon's requests,
//! not the wire's count: NFS's own per operation, for the whole mount, is beside them
//! (`hocus_nfs_operations_total`, from mountstats).

use std::{
    cell::RefCell,
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Mutex,
};

/// Why the daemon asks the server something.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Purpose {
    /// A job's start: its copies and snapshots confirmed, its binds made.
    JobStart,
    /// What running jobs have bound, compared with the network each interval.
    Revalidation,
    /// A file copied (whole or the ranges jobs read).
    Copy,
    /// A directory tree's snapshot taken, or its stamp read again.
    Snapshot,
    /// What a partial copy lacks, filled when read.
    Fill,
    /// The sizes and mtimes of files newly seen, for the profile.
    Profile,
    /// A profile a user sent (a prefetch, a Slurm job's prolog), checked as them: what
    /// they may read.
    Access,
}

impl Purpose {
    pub const ALL: [Purpose; 7] = [
        Purpose::JobStart,
        Purpose::Revalidation,
        Purpose::Copy,
        Purpose::Snapshot,
        Purpose::Fill,
        Purpose::Profile,
        Purpose::Access,
    ];

    /// Its name in `status` and the metrics' `purpose` label.
    pub fn name(self) -> &'static str {
        match self {
            Purpose::JobStart => "job_start",
            Purpose::Revalidation => "revalidation",
            Purpose::Copy => "copy",
            Purpose::Snapshot => "snapshot",
            Purpose::Fill => "fill",
            Purpose::Profile => "profile",
            Purpose::Access => "access",
        }
    }
}

/// Operations and bytes read, of one tree for one purpose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Count {
    pub operations: u64,
    pub bytes: u64,
}

thread_local! {
    /// The tree and purpose this thread's network calls are counted under.
    static ASKING: RefCell<Option<(PathBuf, Purpose)>> = const { RefCell::new(None) };
}

/// Everything counted since the daemon started. Bounded by the watched trees (at most
/// 8) times the purposes.
static COUNTS: Mutex<BTreeMap<(PathBuf, Purpose), Count>> = Mutex::new(BTreeMap::new());

/// The watched network trees, for work that meets paths rather than a tree
/// ([`Asking::beneath`]).
static WATCHED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Says which trees are on the network: their calls are counted by [`Asking::beneath`].
pub fn watch(network_trees: Vec<PathBuf>) {
    *WATCHED.lock().unwrap_or_else(|e| e.into_inner()) = network_trees;
}

/// This thread's calls counted under `tree` and `purpose` until it is dropped; what was
/// set before is set again then.
#[must_use = "calls are counted only while it is held"]
pub struct Asking {
    before: Option<(PathBuf, Purpose)>,
}

impl Asking {
    pub fn begin(tree: &Path, purpose: Purpose) -> Asking {
        Asking::again(&Some((tree.to_owned(), purpose)))
    }

    /// What `current` returned on another thread, set on this one: a thread a piece
    /// of work spawns counts under its purpose.
    /// The same for `path`'s watched network tree ([`watch`]); counts nothing for a path
    /// in none.
    pub fn beneath(path: &Path, purpose: Purpose) -> Asking {
        let trees = WATCHED.lock().unwrap_or_else(|e| e.into_inner());
        let tree = trees
            .iter()
            .filter(|t| path.starts_with(t))
            .max_by_key(|t| t.as_os_str().len());
        Asking::again(&tree.map(|t| (t.clone(), purpose)))
    }

    pub fn again(current: &Option<(PathBuf, Purpose)>) -> Asking {
        let before = ASKING.with(|a| a.replace(current.clone()));
        Asking { before }
    }
}

/// The tree and purpose this thread counts under, for the threads it spawns
/// (`Asking::again`).
pub fn current() -> Option<(PathBuf, Purpose)> {
    ASKING.with(|a| a.borrow().clone())
}

impl Drop for Asking {
    fn drop(&mut self) {
        let before = self.before.take();
        ASKING.with(|a| *a.borrow_mut() = before);
    }
}

/// `operations` calls made on the network, and `bytes` read by them.
fn add(operations: u64, bytes: u64) {
    ASKING.with(|a| {
        let Some((tree, purpose)) = &*a.borrow() else {
            return;
        };
        let mut counts = COUNTS.lock().unwrap_or_else(|e| e.into_inner());
        let c = counts.entry((tree.clone(), *purpose)).or_default();
        c.operations += operations;
        c.bytes += bytes;
    });
}

/// One call made on the network (an open, a stat, a listing).
pub fn asked() {
    add(1, 0);
}

/// One read from the network that brought `bytes`.
pub fn read(bytes: u64) {
    add(1, bytes);
}

/// What was counted, by tree and purpose.
pub fn counts() -> Vec<(PathBuf, Purpose, Count)> {
    let counts = COUNTS.lock().unwrap_or_else(|e| e.into_inner());
    counts
        .iter()
        .map(|((t, p), c)| (t.clone(), *p, *c))
        .collect()
}

/// A network file read through it counts each read (`read`).
pub struct Counted<R>(pub R);

impl<R: std::io::Read> std::io::Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.0.read(buf)?;
        read(n as u64);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(tree: &Path, purpose: Purpose) -> Count {
        counts()
            .into_iter()
            .find(|(t, p, _)| t == tree && *p == purpose)
            .map_or(Count::default(), |(_, _, c)| c)
    }

    #[test]
    fn calls_count_under_the_purpose_set_and_nothing_without_one() {
        let tree = Path::new("/asked-test/tree");
        asked();
        assert_eq!(of(tree, Purpose::Copy), Count::default());
        {
            let _copy = Asking::begin(tree, Purpose::Copy);
            asked();
            {
                let _fill = Asking::begin(tree, Purpose::Fill);
                read(10);
            }
            read(5);
        }
        asked();
        assert_eq!(
            of(tree, Purpose::Copy),
            Count {
                operations: 2,
                bytes: 5
            }
        );
        assert_eq!(
            of(tree, Purpose::Fill),
            Count {
                operations: 1,
                bytes: 10
            }
        );
        // Another thread's purpose is its own.
        std::thread::spawn(asked).join().unwrap();
        assert_eq!(of(tree, Purpose::Copy).operations, 2);
    }
}
