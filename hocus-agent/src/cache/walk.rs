//! A network tree walked from descriptors by several threads at once. Over a network
//! every directory read and every attribute fetched is a round trip: walked one entry
//! after another, a tree of 8k entries costs seconds on a 1 ms link; walked by many
//! threads, the round trips overlap and the walk is bounded by the link.
//!
//! No path a user can change is resolved: the root is opened beneath the watched tree
//! with no symlink on the way, each directory from its parent's descriptor with
//! O_NOFOLLOW, and each entry is handed to the visitor with its directory's descriptor
//! and its name, so whatever the visitor does with it is relative to what was listed.

use std::{
    ffi::{CStr, CString, OsStr},
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
    sync::{Arc, Condvar, Mutex},
};

use nix::{
    dir::Dir,
    fcntl::{AtFlags, OFlag, openat},
    sys::stat::{FileStat, Mode, fstat, fstatat},
};

use crate::shared::{
    asked::{self, Asking},
    tree::{Tree, fstat_now},
};

/// How many threads walk a tree: enough round trips in flight to fill a cluster link
/// (SFTP and NFS clients pipeline requests over one connection), few enough to leave the
/// server and the node alone.
pub const WALKERS: usize = 16;

/// One entry met: its path below the root ("" for the root), its attributes (the entry
/// itself if it is a symlink), and where it is.
pub struct Met<'a> {
    pub rel: &'a Path,
    pub stat: FileStat,
    /// Whether the tree's inode numbers identify files (not on FUSE).
    pub stable_inodes: bool,
    pub at: At<'a>,
}

pub enum At<'a> {
    /// A directory, opened; it is met before any entry in it.
    Dir(BorrowedFd<'a>),
    /// Anything else, by its name in its directory; a directory the walk was told not
    /// to enter too.
    Entry { dir: BorrowedFd<'a>, name: &'a CStr },
}

/// Work for a walker: a directory to open and list, or names listed in one to look at.
enum Task {
    /// A directory listed but not yet opened: its parent stays open until it is.
    Dir {
        parent: Arc<OwnedFd>,
        name: CString,
        rel: PathBuf,
    },
    /// Names in the open directory `dir` (at `rel`), to stat and meet. A directory's
    /// names are shared out in batches: attributes are a round trip each over the
    /// network, and a directory of a thousand files must not be one walker's alone.
    Names {
        dir: Arc<OwnedFd>,
        rel: Arc<PathBuf>,
        names: Vec<CString>,
    },
}

/// Names per `Task::Names`.
const BATCH: usize = 16;

struct Queue {
    todo: Vec<Task>,
    /// Tasks being done: while any is, more may come.
    busy: usize,
    stop: bool,
}

/// Where a walk takes the attributes of the directories it opens from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirAttrs {
    /// The client's, as any process reads them (its attribute cache): a revalidation
    /// or a measure asks the server nothing more than listing the tree does.
    Cached,
    /// The server's, one round trip a directory (`AT_STATX_FORCE_SYNC`): what a
    /// snapshot's stamp is taken with, so that the job-start check (which asks the
    /// server) agrees with it; it refreshes the client's cache for the next walk too.
    FromServer,
}

/// Walks the tree `root` (inside the watched tree `tree`) with up to `threads` threads.
/// `visit` sees every entry once, the root first and each directory before what it
/// holds, from any thread; returning false ends the walk, an error ends it with that
/// error (the first one met). A directory below the root that `enter` refuses (by its
/// path below the root) is met as an entry, neither opened nor listed. Directories'
/// attributes come from where `dirs` says.
pub fn walk<E>(
    tree: &Path,
    root: &Path,
    threads: usize,
    dirs: DirAttrs,
    enter: impl Fn(&Path) -> bool + Sync,
    visit: impl Fn(&Met) -> Result<bool, E> + Sync,
) -> Result<(), E>
where
    E: From<io::Error> + Send,
{
    let tree = Tree::open(tree)?;
    let stable_inodes = tree.stable_inodes();
    let top = Arc::new(tree.open_beneath(root, libc::O_RDONLY | libc::O_DIRECTORY)?);
    let stat = dir_stat(top.as_fd(), dirs)?;
    let met = Met {
        rel: Path::new(""),
        stat,
        stable_inodes,
        at: At::Dir(top.as_fd()),
    };
    if !visit(&met)? {
        return Ok(());
    }
    let mut todo = Vec::new();
    list(&top, Path::new(""), &mut todo)?;
    let queue = Mutex::new(Queue {
        todo,
        busy: 0,
        stop: false,
    });
    let wake = Condvar::new();
    let failed: Mutex<Option<E>> = Mutex::new(None);
    let asking = asked::current();
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                let _asking = Asking::again(&asking);
                loop {
                    let next = {
                        let mut q = queue.lock().unwrap();
                        loop {
                            if q.stop {
                                return;
                            }
                            if let Some(t) = q.todo.pop() {
                                q.busy += 1;
                                break t;
                            }
                            if q.busy == 0 {
                                return;
                            }
                            q = wake.wait(q).unwrap();
                        }
                    };
                    let mut found = Vec::new();
                    let went_on = run(next, stable_inodes, dirs, &enter, &visit, &mut found);
                    let mut q = queue.lock().unwrap();
                    q.busy -= 1;
                    let (more, idle) = (!found.is_empty(), q.busy == 0);
                    q.todo.append(&mut found);
                    match went_on {
                        Ok(true) => {}
                        Ok(false) => q.stop = true,
                        Err(e) => {
                            q.stop = true;
                            failed.lock().unwrap().get_or_insert(e);
                        }
                    }
                    if more || idle || q.stop {
                        wake.notify_all();
                    }
                }
            });
        }
    });
    match failed.into_inner().unwrap() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The attributes of an opened directory, from where `dirs` says.
fn dir_stat(fd: BorrowedFd, dirs: DirAttrs) -> io::Result<FileStat> {
    match dirs {
        DirAttrs::Cached => fstat(fd.as_raw_fd()).map_err(io::Error::from),
        DirAttrs::FromServer => fstat_now(fd),
    }
}

/// Does one task; the tasks it makes go to `found`.
fn run<E: From<io::Error>>(
    task: Task,
    stable_inodes: bool,
    dirs: DirAttrs,
    enter: &impl Fn(&Path) -> bool,
    visit: &impl Fn(&Met) -> Result<bool, E>,
    found: &mut Vec<Task>,
) -> Result<bool, E> {
    match task {
        Task::Dir { parent, name, rel } => {
            asked::asked();
            let fd = openat(
                Some(parent.as_raw_fd()),
                name.as_c_str(),
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(io::Error::from)?;
            drop(parent);
            // SAFETY: a new descriptor we own.
            let fd = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
            let met = Met {
                rel: &rel,
                stat: dir_stat(fd.as_fd(), dirs)?,
                stable_inodes,
                at: At::Dir(fd.as_fd()),
            };
            if !visit(&met)? {
                return Ok(false);
            }
            list(&fd, &rel, found)?;
            Ok(true)
        }
        Task::Names { dir, rel, names } => {
            for name in names {
                asked::asked();
                let stat = fstatat(
                    Some(dir.as_raw_fd()),
                    name.as_c_str(),
                    AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(io::Error::from)?;
                let child = rel.join(OsStr::from_bytes(name.to_bytes()));
                if stat.st_mode & libc::S_IFMT == libc::S_IFDIR && enter(&child) {
                    found.push(Task::Dir {
                        parent: dir.clone(),
                        name,
                        rel: child,
                    });
                    continue;
                }
                let met = Met {
                    rel: &child,
                    stat,
                    stable_inodes,
                    at: At::Entry {
                        dir: dir.as_fd(),
                        name: &name,
                    },
                };
                if !visit(&met)? {
                    return Ok(false);
                }
            }
            Ok(true)
        }
    }
}

/// Reads the names in the open directory `dir` into batches for the walkers.
fn list(dir: &Arc<OwnedFd>, rel: &Path, found: &mut Vec<Task>) -> io::Result<()> {
    // The listing reads through its own descriptor; `dir` stays for the lookups.
    let mut listing = Dir::from_fd(dir.try_clone()?.into_raw_fd())?;
    asked::asked();
    let rel = Arc::new(rel.to_owned());
    let mut names = Vec::new();
    for entry in listing.iter() {
        let name = entry?.file_name().to_owned();
        if matches!(name.to_bytes(), b"." | b"..") {
            continue;
        }
        names.push(name);
        if names.len() == BATCH {
            found.push(Task::Names {
                dir: dir.clone(),
                rel: rel.clone(),
                names: std::mem::take(&mut names),
            });
        }
    }
    if !names.is_empty() {
        found.push(Task::Names {
            dir: dir.clone(),
            rel,
            names,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{collections::BTreeSet, fs};

    #[test]
    fn meets_every_entry_once_each_directory_before_its_entries() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("tree");
        for d in 0..20 {
            fs::create_dir_all(root.join(format!("d{d}/sub"))).unwrap();
            for f in 0..10 {
                fs::write(root.join(format!("d{d}/sub/f{f}")), b"x").unwrap();
            }
            std::os::unix::fs::symlink("sub", root.join(format!("d{d}/link"))).unwrap();
        }
        let met = Mutex::new(Vec::new());
        walk::<io::Error>(
            dir.path(),
            &root,
            8,
            DirAttrs::Cached,
            |_| true,
            |m| {
                let mut met = met.lock().unwrap();
                if let Some(parent) = m.rel.parent() {
                    assert!(
                        met.iter().any(|(p, _)| p == parent),
                        "{} met before its directory",
                        m.rel.display()
                    );
                }
                met.push((m.rel.to_owned(), matches!(m.at, At::Dir(_))));
                Ok(true)
            },
        )
        .unwrap();
        let met = met.into_inner().unwrap();
        let unique: BTreeSet<_> = met.iter().map(|(p, _)| p.clone()).collect();
        assert_eq!(met.len(), unique.len(), "each entry once");
        // The root, 20 d*, 20 sub, 200 files, 20 symlinks.
        assert_eq!(met.len(), 1 + 20 + 20 + 200 + 20);
        assert_eq!(met.iter().filter(|(_, d)| *d).count(), 41);
    }

    #[test]
    fn a_directory_not_entered_is_met_as_an_entry_and_not_listed() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("tree");
        fs::create_dir_all(root.join("used/deeper")).unwrap();
        fs::create_dir_all(root.join("unused/deeper")).unwrap();
        fs::write(root.join("used/deeper/f"), b"x").unwrap();
        fs::write(root.join("unused/deeper/f"), b"x").unwrap();
        let met = Mutex::new(BTreeSet::new());
        walk::<io::Error>(
            dir.path(),
            &root,
            4,
            DirAttrs::Cached,
            |rel| !rel.starts_with("unused"),
            |m| {
                let kind = match m.at {
                    At::Dir(_) => "opened",
                    At::Entry { .. } if m.stat.st_mode & libc::S_IFMT == libc::S_IFDIR => "passed",
                    At::Entry { .. } => "file",
                };
                met.lock()
                    .unwrap()
                    .insert((m.rel.display().to_string(), kind));
                Ok(true)
            },
        )
        .unwrap();
        let expected: BTreeSet<(String, &str)> = [
            ("", "opened"),
            ("used", "opened"),
            ("used/deeper", "opened"),
            ("used/deeper/f", "file"),
            ("unused", "passed"),
        ]
        .into_iter()
        .map(|(p, k)| (p.to_owned(), k))
        .collect();
        assert_eq!(met.into_inner().unwrap(), expected);
    }

    #[test]
    fn stops_when_asked_and_on_the_first_error() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("tree");
        for d in 0..50 {
            fs::create_dir_all(root.join(format!("d{d}"))).unwrap();
            fs::write(root.join(format!("d{d}/f")), b"x").unwrap();
        }
        let seen = std::sync::atomic::AtomicUsize::new(0);
        walk::<io::Error>(
            dir.path(),
            &root,
            4,
            DirAttrs::Cached,
            |_| true,
            |_| Ok(seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < 10),
        )
        .unwrap();
        assert!(seen.into_inner() < 30, "the walk went on after a stop");
        let err = walk::<io::Error>(
            dir.path(),
            &root,
            4,
            DirAttrs::Cached,
            |_| true,
            |m| {
                if m.rel == Path::new("d7/f") {
                    Err(io::Error::other("no"))
                } else {
                    Ok(true)
                }
            },
        );
        assert_eq!(err.unwrap_err().to_string(), "no");
        // A symlink on the way from the watched tree is never followed.
        std::os::unix::fs::symlink(&root, dir.path().join("link")).unwrap();
        assert!(
            walk::<io::Error>(
                dir.path(),
                &dir.path().join("link"),
                4,
                DirAttrs::Cached,
                |_| true,
                |_| Ok(true)
            )
            .is_err()
        );
    }
}
