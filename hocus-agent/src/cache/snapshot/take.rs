//! Taking a snapshot: the network tree walked by many threads, its directories made
//! alike, the files it fills copied (or linked from the cache's copies of the same
//! identity) beside the walk, the others written as stubs, all into a staging directory
//! renamed into place whole; and measuring a tree before, where snapshots are whole.

use std::{
    fs, io,
    os::{
        fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::fs::{DirBuilderExt, PermissionsExt},
    },
    path::{Path, PathBuf},
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc,
    },
};

use nix::{
    fcntl::{OFlag, openat, readlinkat},
    sys::stat::{FileStat, Mode},
};

use super::{
    fill::{Fill, is_passage},
    stamp::{Stamp, identity, racy},
    stub::write_stub,
};
use crate::{
    cache::{
        copy::{self, CopyError},
        walk::{self, At, DirAttrs, Met, WALKERS},
    },
    shared::{
        asked::{self, Asking},
        attrs::{self, Times},
        identity::Identity,
        user::User,
    },
};

/// What taking a snapshot cost: bytes copied from the network, bytes linked from copies
/// the cache had; and the directories whose stamp cannot vouch for them.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Taken {
    pub copied: u64,
    pub linked: u64,
    /// Files copied whole from the network (not linked): the cache may adopt them.
    pub held: Vec<PathBuf>,
    /// Files left on the network (stubs of a lazy snapshot), and their bytes.
    pub stubs: usize,
    pub left: u64,
    /// Directories no job used, by path below the root: not walked, they are shown
    /// from the network itself (`redirect::mountns::bind_read_only`), and are not in
    /// the stamp (their names are, in their parents').
    pub passages: Vec<PathBuf>,
    /// Directories changed so shortly before their stamp was read that a later change
    /// may leave their mtime as it was (SFTP and older filesystems keep seconds; a
    /// network client may answer from attributes cached for a second or more): only
    /// their list of names can show they are unchanged.
    pub racy: Vec<PathBuf>,
    /// How long the walk took, and the whole snapshot (its copies end after the walk).
    pub walk_time: std::time::Duration,
    pub time: std::time::Duration,
}

/// What a snapshot may hold at most: the bytes of the files it fills, and entries.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub bytes: u64,
    pub entries: usize,
}

/// What a walk has met so far (the root aside): entries, and the bytes of the files the
/// snapshot fills.
#[derive(Default)]
struct Count {
    entries: AtomicU64,
    bytes: AtomicU64,
}

impl Count {
    /// Counts the entry `m`, and says whether the snapshot fills its bytes; an error as
    /// soon as the tree is past `limits`.
    fn add(&self, m: &Met, root: &Path, fill: &Fill, limits: Limits) -> Result<bool, CopyError> {
        if m.rel.as_os_str().is_empty() {
            return Ok(false);
        }
        if self.entries.fetch_add(1, Ordering::Relaxed) >= limits.entries as u64 {
            return Err(CopyError::TooMany {
                limit: limits.entries,
            });
        }
        let mode = m.stat.st_mode;
        let filled = mode & libc::S_IFMT == libc::S_IFREG && fill.holds(&root.join(m.rel), mode);
        if filled {
            let size = m.stat.st_size as u64;
            let bytes = self.bytes.fetch_add(size, Ordering::Relaxed) + size;
            if bytes > limits.bytes {
                return Err(CopyError::TooLarge {
                    size: bytes,
                    room: limits.bytes,
                });
            }
        }
        Ok(filled)
    }
}

/// Measures a network tree: the bytes a snapshot of it holds (`fill`) and its entries,
/// or None when it exceeds `limits`, holds something a snapshot cannot (devices,
/// sockets, fifos), or cannot be reached beneath `tree` without a symlink.
pub fn measure(tree: &Path, root: &Path, fill: &Fill, limits: Limits) -> Option<(u64, usize)> {
    let count = Count::default();
    let odd = AtomicBool::new(false);
    let enter = |rel: &Path| fill.enters(&root.join(rel));
    walk::walk::<CopyError>(tree, root, WALKERS, DirAttrs::Cached, enter, |m| {
        if !matches!(
            m.stat.st_mode & libc::S_IFMT,
            libc::S_IFREG | libc::S_IFDIR | libc::S_IFLNK
        ) {
            odd.store(true, Ordering::Relaxed);
            return Ok(false);
        }
        count.add(m, root, fill, limits)?;
        Ok(true)
    })
    .ok()?;
    (!odd.into_inner()).then(|| {
        (
            count.bytes.into_inner(),
            count.entries.into_inner() as usize,
        )
    })
}

/// Threads copying a snapshot's files beside its walk.
const COPIERS: usize = 8;

/// Copies the network tree `root` (inside the watched `tree`) to `dest`, via a staging
/// directory next to it; of its files, those `fill` says, the others as stubs. `cached`
/// gives the cache's copy of a file and its identity. A tree beyond `limits` is given up
/// as soon as the walk knows it (`TooLarge`, `TooMany`): no measuring walk goes first.
pub fn take(
    tree: &Path,
    root: &Path,
    fill: &Fill,
    limits: Limits,
    dest: &Path,
    tmp_dir: &Path,
    cached: &(dyn Fn(&Path) -> Option<(PathBuf, Identity)> + Sync),
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
        let read_at = std::time::SystemTime::now();
        let began = std::time::Instant::now();
        let stamp = Mutex::new(Stamp::new());
        let taken = Mutex::new(Taken::default());
        let dirs = Mutex::new(Vec::new());
        // Files whose bytes are copied go to copiers working beside the walk: a
        // directory is listed by one walker, and its hot files (a __pycache__ of a
        // hundred) must not be fetched one after another.
        let (to_copy, copies) = mpsc::channel::<(PathBuf, Identity)>();
        let copies = Mutex::new(copies);
        let failed: Mutex<Option<CopyError>> = Mutex::new(None);
        let asking = asked::current();
        let copier = || {
            let _asking = Asking::again(&asking);
            loop {
                // The lock only while waiting for the next file.
                let next = copies.lock().unwrap().recv();
                let Ok((rel, id)) = next else { break };
                if failed.lock().unwrap().is_some() {
                    continue;
                }
                // Read as its owner: root may be squashed.
                let reader = User::lookup(id.uid).unwrap_or_else(User::root);
                // The tree was measured against the room for it.
                let (source, dest) = (root.join(&rel), staging.join(&rel));
                let copying = copy::Copying {
                    tree,
                    source: &source,
                    reader: &reader,
                    tmp_dir,
                    dest: &dest,
                    room: u64::MAX,
                };
                match copy::copy(&copying, copy::Via::Network) {
                    Ok(got) if got == id => {
                        let mut t = taken.lock().unwrap();
                        t.copied += id.size;
                        t.held.push(rel);
                    }
                    Ok(_) => {
                        failed.lock().unwrap().get_or_insert(CopyError::Changed);
                    }
                    Err(e) => {
                        failed.lock().unwrap().get_or_insert(e);
                    }
                }
            }
        };
        // One walk: each entry is made in the staging tree as it is met, from the
        // attributes and descriptors the walk holds (nothing is looked up again).
        let (walked, walk_time) = std::thread::scope(|s| {
            for _ in 0..COPIERS {
                s.spawn(copier);
            }
            let count = Count::default();
            let enter = |rel: &Path| fill.enters(&root.join(rel));
            // The stamp's directories from the server: the job-start check asks the
            // server, and a directory changed just before (its ctime) would otherwise
            // make it drop the snapshot it was taken with.
            let walked = walk::walk(tree, root, WALKERS, DirAttrs::FromServer, enter, |m| {
                let filled = count.add(m, root, fill, limits)?;
                let dst = staging.join(m.rel);
                if is_passage(m) {
                    // Covered by the network directory in a job's view; if that bind
                    // were missing, nothing would show through.
                    fs::DirBuilder::new()
                        .mode(0o000)
                        .create(&dst)
                        .map_err(CopyError::Local)?;
                    taken.lock().unwrap().passages.push(m.rel.to_owned());
                    return Ok(failed.lock().unwrap().is_none());
                }
                let id = identity(m);
                match m.at {
                    At::Dir(fd) => {
                        make_dir(fd, &dst, &m.stat).map_err(CopyError::Local)?;
                        dirs.lock().unwrap().push((dst, Times::of_stat(&m.stat)));
                    }
                    At::Entry { dir, name } => match m.stat.st_mode & libc::S_IFMT {
                        libc::S_IFLNK => {
                            asked::asked();
                            let target = readlinkat(Some(dir.as_raw_fd()), name)
                                .map_err(|e| CopyError::Source(e.into()))?;
                            std::os::unix::fs::symlink(&target, &dst).map_err(CopyError::Local)?;
                            std::os::unix::fs::lchown(&dst, Some(id.uid), Some(id.gid))
                                .map_err(CopyError::Local)?;
                        }
                        libc::S_IFREG => {
                            let src = root.join(m.rel);
                            let cached = cached(&src).filter(|(_, c)| *c == id);
                            if cached.is_some_and(|(local, _)| fs::hard_link(&local, &dst).is_ok())
                            {
                                taken.lock().unwrap().linked += id.size;
                            } else if !filled {
                                asked::asked();
                                let from = openat(
                                    Some(dir.as_raw_fd()),
                                    name,
                                    OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                                    Mode::empty(),
                                )
                                .map_err(|e| CopyError::Source(e.into()))?;
                                // SAFETY: a new descriptor we own.
                                let from = unsafe { OwnedFd::from_raw_fd(from) };
                                write_stub(&from, m.rel, &dst, &m.stat)
                                    .map_err(CopyError::Local)?;
                                let mut t = taken.lock().unwrap();
                                t.stubs += 1;
                                t.left += id.size;
                            } else {
                                let _ = to_copy.send((m.rel.to_owned(), id));
                            }
                        }
                        _ => {
                            return Err(CopyError::Unsafe(format!(
                                "{} is neither a file, a directory nor a symlink",
                                root.join(m.rel).display()
                            )));
                        }
                    },
                }
                stamp.lock().unwrap().insert(m.rel.to_owned(), id);
                Ok(failed.lock().unwrap().is_none())
            });
            // The copiers finish what was sent, then stop.
            drop(to_copy);
            (walked, began.elapsed())
        });
        walked?;
        if let Some(e) = failed.into_inner().unwrap() {
            return Err(e);
        }
        // Directory times last, deepest first: making their entries changed them.
        let mut dirs = dirs.into_inner().unwrap();
        dirs.sort_by(|a, b| b.0.cmp(&a.0));
        for (dst, times) in dirs {
            let _ = times.set_at(&dst);
        }
        let stamp = stamp.into_inner().unwrap();
        let mut taken = taken.into_inner().unwrap();
        taken.racy = racy(&stamp, read_at);
        taken.walk_time = walk_time;
        taken.time = began.elapsed();
        let _ = fs::remove_dir_all(dest);
        fs::rename(&staging, dest).map_err(CopyError::Local)?;
        Ok((stamp, taken))
    })();
    if result.is_err() {
        let _ = fs::remove_dir_all(&staging);
    }
    result
}

/// Makes the directory `dst` of a snapshot like the network directory `from` (open):
/// owner, ACLs (access and default), then mode (chown clears set-id bits).
fn make_dir(from: BorrowedFd, dst: &Path, stat: &FileStat) -> io::Result<()> {
    fs::create_dir(dst)?;
    std::os::unix::fs::lchown(dst, Some(stat.st_uid), Some(stat.st_gid))?;
    let to = fs::File::open(dst)?;
    attrs::copy_xattrs(&from, &to)?;
    to.set_permissions(fs::Permissions::from_mode(stat.st_mode & 0o7777))
}

#[cfg(test)]
mod tests {
    use std::{
        collections::HashSet,
        os::unix::{ffi::OsStrExt, fs::MetadataExt},
    };

    use super::*;
    use crate::cache::snapshot::{Used, is_stub, stamp};

    const NONE: Limits = Limits {
        bytes: u64::MAX,
        entries: usize::MAX,
    };

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
        let whole = |root: &Path, bytes, entries| {
            measure(&tree, root, &Fill::Whole, Limits { bytes, entries })
        };
        assert_eq!(whole(&root, u64::MAX, 100), Some((17, 6)));
        assert_eq!(whole(&root, 10, 100), None, "over the byte limit");
        assert_eq!(whole(&root, u64::MAX, 3), None, "over the entry limit");
        // A symlink on the way from the watched tree is never followed.
        std::os::unix::fs::symlink(&root, tree.join("link")).unwrap();
        assert_eq!(whole(&tree.join("link"), u64::MAX, 100), None);
        assert!(stamp(&tree, &tree.join("link/pkg"), &HashSet::new()).is_err());
        assert!(
            stamp(&tree, Path::new("/etc"), &HashSet::new()).is_err(),
            "outside the tree"
        );

        // hot.py is in the cache already: it is linked, not copied again.
        let cache_copy = dir.path().join("cache-hot.py");
        fs::write(&cache_copy, b"x = 1\n").unwrap();
        let hot_id = Identity::of(&fs::metadata(root.join("hot.py")).unwrap());
        let cached = |p: &Path| (p == root.join("hot.py")).then(|| (cache_copy.clone(), hot_id));
        let tmp = dir.path().join("tmp");
        fs::create_dir_all(&tmp).unwrap();
        let dest = dir.path().join("trees/env/site-packages");
        let (stamp_taken, taken) =
            take(&tree, &root, &Fill::Whole, NONE, &dest, &tmp, &cached).unwrap();
        assert_eq!((taken.copied, taken.linked), (11, 6));
        // Every directory was just made: none of their stamps can vouch for them.
        let dirs = stamp_taken.iter().filter(|(_, id)| id.is_dir()).count();
        assert_eq!(taken.racy.len(), dirs);
        assert!(taken.racy.contains(&PathBuf::from("pkg/sub")));
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
        let none = HashSet::new();
        assert_eq!(stamp(&tree, &root, &none).unwrap(), stamp_taken);
        // A new entry anywhere changes the stamp.
        fs::write(root.join("pkg/sub/new.py"), b"").unwrap();
        assert_ne!(stamp(&tree, &root, &none).unwrap(), stamp_taken);
    }

    #[test]
    fn a_lazy_snapshot_holds_the_working_set_and_stubs_for_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("net");
        let root = tree.join("env");
        fs::create_dir_all(root.join("pkg")).unwrap();
        fs::write(root.join("pkg/hot.py"), b"x = 1\n").unwrap();
        fs::write(root.join("pkg/cold.py"), b"never read, 26 bytes long\n").unwrap();
        fs::write(root.join("pkg/secret.py"), b"k = 2\n").unwrap();
        fs::set_permissions(root.join("pkg/cold.py"), fs::Permissions::from_mode(0o644)).unwrap();
        // Not readable by everyone: its bytes are held, since the overlay reads as root.
        fs::set_permissions(
            root.join("pkg/secret.py"),
            fs::Permissions::from_mode(0o640),
        )
        .unwrap();
        let hot = root.join("pkg/hot.py");
        let fill = Fill::Lazy(Used::new(&root, [hot.as_path()], []));
        assert_eq!(
            measure(
                &tree,
                &root,
                &fill,
                Limits {
                    bytes: u64::MAX,
                    entries: 100
                }
            ),
            Some((12, 4))
        );
        let tmp = dir.path().join("tmp");
        fs::create_dir_all(&tmp).unwrap();
        let dest = dir.path().join("trees/env");
        // Over a limit, it is given up, and nothing is left behind.
        for limits in [Limits { bytes: 11, ..NONE }, Limits { entries: 2, ..NONE }] {
            assert!(matches!(
                take(&tree, &root, &fill, limits, &dest, &tmp, &|_| None),
                Err(CopyError::TooLarge { .. } | CopyError::TooMany { .. })
            ));
            assert!(!dest.exists());
            assert_eq!(fs::read_dir(&tmp).unwrap().count(), 0, "staging left");
        }
        let (_, taken) = take(&tree, &root, &fill, NONE, &dest, &tmp, &|_| None).unwrap();
        assert_eq!((taken.copied, taken.stubs, taken.left), (12, 1, 26));
        let stub = dest.join("pkg/cold.py");
        let m = fs::metadata(&stub).unwrap();
        assert_eq!((m.len(), m.mode() & 0o7777), (26, 0o644));
        assert_eq!(m.blocks(), 0, "sparse: no bytes held");
        assert!(is_stub(&stub) && !is_stub(&dest.join("pkg/hot.py")));
        let xattr = |name: &std::ffi::CStr| {
            let path = std::ffi::CString::new(stub.as_os_str().as_bytes()).unwrap();
            let mut v = vec![0u8; 256];
            // SAFETY: valid C strings and buffer.
            let n = unsafe {
                libc::getxattr(path.as_ptr(), name.as_ptr(), v.as_mut_ptr().cast(), v.len())
            };
            (n >= 0).then(|| v[..n as usize].to_vec())
        };
        assert_eq!(xattr(c"trusted.overlay.metacopy"), Some(Vec::new()));
        assert_eq!(
            xattr(c"trusted.overlay.redirect"),
            Some(b"/pkg/cold.py".to_vec())
        );
        assert_eq!(fs::read(dest.join("pkg/hot.py")).unwrap(), b"x = 1\n");
        assert_eq!(fs::read(dest.join("pkg/secret.py")).unwrap(), b"k = 2\n");
    }

    #[test]
    fn a_lazy_snapshot_walks_only_what_jobs_used_and_passes_the_rest_by() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("net");
        let root = tree.join("env");
        for d in [
            "pkg/sub",
            "pkg/tests/deep",
            "listed",
            "probed",
            "other/deep",
        ] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        for f in [
            "pkg/__init__.py",
            "pkg/cold.py",
            "pkg/sub/hot.py",
            "pkg/tests/deep/t.py",
            "listed/a",
            "probed/b",
            "other/deep/c",
        ] {
            fs::write(root.join(f), b"x\n").unwrap();
        }
        let hot = root.join("pkg/sub/hot.py");
        let missing = root.join("probed/gone.so");
        let listed = root.join("listed");
        // As `Shortlist::used_dirs` gives them: a probed name's directory, a listed one.
        let fill = Fill::Lazy(Used::new(
            &root,
            [hot.as_path()],
            [missing.parent().unwrap(), listed.as_path()],
        ));
        let tmp = dir.path().join("tmp");
        fs::create_dir_all(&tmp).unwrap();
        let dest = dir.path().join("trees/env");
        let (stamp_taken, taken) = take(&tree, &root, &fill, NONE, &dest, &tmp, &|_| None).unwrap();
        let mut passages = taken.passages.clone();
        passages.sort();
        assert_eq!(passages, ["other", "pkg/tests"].map(PathBuf::from));
        // What jobs used is there, names and stubs; a passage is an empty directory no
        // one may enter (a job's view covers it with the network's).
        assert_eq!(fs::read(dest.join("pkg/sub/hot.py")).unwrap(), b"x\n");
        assert!(is_stub(&dest.join("pkg/cold.py")));
        assert!(is_stub(&dest.join("listed/a")) && is_stub(&dest.join("probed/b")));
        let other = fs::metadata(dest.join("other")).unwrap();
        assert!(other.is_dir() && other.mode() & 0o7777 == 0);
        assert_eq!(fs::read_dir(dest.join("other")).unwrap().count(), 0);
        assert!(!stamp_taken.contains_key(Path::new("other")));
        assert!(!stamp_taken.keys().any(|k| k.starts_with("pkg/tests")));
        // The revalidation's walk passes them by too: changes inside a passage are the
        // network's own; a name added or removed beside one changes its parent.
        let passages: HashSet<PathBuf> = taken.passages.iter().cloned().collect();
        assert_eq!(stamp(&tree, &root, &passages).unwrap(), stamp_taken);
        fs::write(root.join("other/deep/new"), b"").unwrap();
        fs::remove_file(root.join("pkg/tests/deep/t.py")).unwrap();
        assert_eq!(stamp(&tree, &root, &passages).unwrap(), stamp_taken);
        fs::remove_dir_all(root.join("other")).unwrap();
        assert_ne!(stamp(&tree, &root, &passages).unwrap(), stamp_taken);
    }
}
