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
    collections::{BTreeMap, HashSet},
    ffi::OsStr,
    fs, io,
    os::{
        fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd},
        unix::{
            ffi::OsStrExt,
            fs::{MetadataExt, OpenOptionsExt, PermissionsExt},
        },
    },
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
};

use nix::{
    dir::Dir,
    fcntl::{AtFlags, OFlag, openat},
    sys::stat::{FileStat, Mode, fstat, fstatat},
};

use crate::{
    cache::copy::{self, CopyError, Identity, Reader, Tree},
    profile::format::Profile,
};

/// Every entry's identity, by path relative to the tree's root ("" is the root).
pub type Stamp = BTreeMap<PathBuf, Identity>;

/// Which files' bytes a snapshot holds.
#[derive(Debug, Clone, Default)]
pub enum Fill {
    /// Every file's: the snapshot is bound as it is.
    #[default]
    Whole,
    /// Those of the files named (the working set), and of those not readable by everyone
    /// (the overlay reads as root, and root may be squashed on the network); every other
    /// file is a stub whose bytes are read from the network on demand, through an overlay
    /// (`redirect::mountns::lazy_view`).
    Lazy(HashSet<PathBuf>),
}

impl Fill {
    /// Whether the snapshot holds the bytes of the file `path` of mode `mode`.
    fn holds(&self, path: &Path, mode: u32) -> bool {
        match self {
            Fill::Whole => true,
            Fill::Lazy(hot) => mode & 0o004 == 0 || hot.contains(path),
        }
    }
}

/// Where snapshots could go. For every directory where jobs opened files or probed
/// names, the directories above it that are clean (nothing in them was written, changed
/// or refused), highest first, down to the directory itself, never a watched tree's root.
/// The caller takes the first of each list that fits.
pub fn candidates(profile: &Profile, trees: &[PathBuf], unclean: &[&Path]) -> Vec<Vec<PathBuf>> {
    let mut dirty: HashSet<PathBuf> = HashSet::new();
    let changed = profile
        .files
        .iter()
        .filter(|f| f.written || f.kept_on_the_network())
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

/// One entry met by [`walk`]: its path below the root, and its attributes (not
/// following it if it is a symlink).
struct Entry {
    rel: PathBuf,
    stat: FileStat,
    /// Whether the tree's inode numbers identify files (not on FUSE).
    stable_inodes: bool,
}

/// Walks the tree `root` (inside the watched `tree`) from descriptors: the root is opened
/// beneath the tree with no symlink on the way, and each subdirectory from its parent's
/// descriptor with O_NOFOLLOW, so no path a user can change is ever resolved. `visit`
/// sees every entry, the root first (with an empty `rel`); returning false stops the walk.
fn walk(tree: &Path, root: &Path, mut visit: impl FnMut(&Entry) -> bool) -> io::Result<()> {
    let tree = Tree::open(tree)?;
    let stable_inodes = tree.stable_inodes();
    let top = tree.open_beneath(root, libc::O_RDONLY | libc::O_DIRECTORY)?;
    let stat = fstat(top.as_raw_fd())?;
    if !visit(&Entry {
        rel: PathBuf::new(),
        stat,
        stable_inodes,
    }) {
        return Ok(());
    }
    let mut stack = vec![(PathBuf::new(), top)];
    while let Some((rel, fd)) = stack.pop() {
        let mut dir = Dir::from_fd(fd.into_raw_fd())?;
        let dir_fd = dir.as_raw_fd();
        let mut subdirs = Vec::new();
        for entry in dir.iter() {
            let entry = entry?;
            let name = entry.file_name();
            let bytes = name.to_bytes();
            if bytes == b"." || bytes == b".." {
                continue;
            }
            let stat = fstatat(Some(dir_fd), name, AtFlags::AT_SYMLINK_NOFOLLOW)?;
            let child = rel.join(OsStr::from_bytes(bytes));
            if stat.st_mode & libc::S_IFMT == libc::S_IFDIR {
                subdirs.push((child.clone(), name.to_owned()));
            }
            if !visit(&Entry {
                rel: child,
                stat,
                stable_inodes,
            }) {
                return Ok(());
            }
        }
        for (child, name) in subdirs {
            let fd = openat(
                Some(dir_fd),
                name.as_c_str(),
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            )?;
            // SAFETY: a new descriptor we own.
            stack.push((child, unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    Ok(())
}

fn identity(e: &Entry) -> Identity {
    let s = &e.stat;
    Identity {
        size: s.st_size as u64,
        mtime_ns: s.st_mtime * 1_000_000_000 + s.st_mtime_nsec,
        ctime_ns: s.st_ctime * 1_000_000_000 + s.st_ctime_nsec,
        ino: if e.stable_inodes { s.st_ino } else { 0 },
        mode: s.st_mode,
        uid: s.st_uid,
        gid: s.st_gid,
    }
}

/// Measures a network tree: the bytes a snapshot of it holds (`fill`) and its entries, or None when it exceeds the limits,
/// holds something a snapshot cannot (devices, sockets, fifos), or cannot be reached
/// beneath `tree` without a symlink.
pub fn measure(
    tree: &Path,
    root: &Path,
    fill: &Fill,
    max_bytes: u64,
    max_entries: usize,
) -> Option<(u64, usize)> {
    let (mut bytes, mut entries) = (0u64, 0usize);
    let mut fits = true;
    walk(tree, root, |e| {
        if e.rel.as_os_str().is_empty() {
            return true;
        }
        entries += 1;
        match e.stat.st_mode & libc::S_IFMT {
            libc::S_IFREG if fill.holds(&root.join(&e.rel), e.stat.st_mode) => {
                bytes = bytes.saturating_add(e.stat.st_size as u64)
            }
            libc::S_IFREG | libc::S_IFDIR | libc::S_IFLNK => {}
            _ => fits = false,
        }
        fits &= bytes <= max_bytes && entries <= max_entries;
        fits
    })
    .ok()?;
    fits.then_some((bytes, entries))
}

/// Reads the stamp of a network tree (inside the watched `tree`).
pub fn stamp(tree: &Path, root: &Path) -> io::Result<Stamp> {
    let mut out = Stamp::new();
    walk(tree, root, |e| {
        out.insert(e.rel.clone(), identity(e));
        true
    })?;
    Ok(out)
}

/// What taking a snapshot cost: bytes copied from the network, bytes linked from copies
/// the cache had; and the directories whose stamp cannot vouch for them.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Taken {
    pub copied: u64,
    pub linked: u64,
    /// Files left on the network (stubs of a lazy snapshot), and their bytes.
    pub stubs: usize,
    pub left: u64,
    /// Directories changed so shortly before their stamp was read that a later change
    /// may leave their mtime as it was (SFTP and older filesystems keep seconds; a
    /// network client may answer from attributes cached for a second or more): only
    /// their list of names can show they are unchanged.
    pub racy: Vec<PathBuf>,
}

/// How close to the reading of its stamp a directory's mtime makes it racy: the mtime's
/// granularity (1 s) plus what a client may have cached, with a margin.
const RACY: std::time::Duration = std::time::Duration::from_secs(3);

/// The directories of `stamp`, read at `read_at`, that changed within `RACY` of it.
fn racy(stamp: &Stamp, read_at: std::time::SystemTime) -> Vec<PathBuf> {
    let since = read_at
        .checked_sub(RACY)
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as i64);
    stamp
        .iter()
        .filter(|(_, id)| id.mode & libc::S_IFMT == libc::S_IFDIR && id.mtime_ns >= since)
        .map(|(rel, _)| rel.clone())
        .collect()
}

/// Copies the network tree `root` (inside the watched `tree`) to `dest`, via a staging
/// directory next to it; of its files, those `fill` says, the others as stubs. `cached` gives the cache's copy of a file and its identity.
pub fn take(
    tree: &Path,
    root: &Path,
    fill: &Fill,
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
        let read_at = std::time::SystemTime::now();
        let stamp = stamp(tree, root).map_err(CopyError::Source)?;
        let beneath = Tree::open(tree).map_err(CopyError::Source)?;
        let mut taken = Taken {
            racy: racy(&stamp, read_at),
            ..Taken::default()
        };
        // Parents come before children in a BTreeMap of paths.
        for (rel, id) in &stamp {
            let src = root.join(rel);
            let dst = staging.join(rel);
            let m = beneath.stat(&src).map_err(CopyError::Source)?;
            if beneath.identity(&m) != *id {
                return Err(CopyError::Changed);
            }
            let kind = m.file_type();
            if kind.is_dir() {
                fs::create_dir(&dst).map_err(CopyError::Local)?;
                std::os::unix::fs::lchown(&dst, Some(m.uid()), Some(m.gid()))
                    .map_err(CopyError::Local)?;
                // Its ACLs (access and default), read from the directory opened beneath
                // the watched tree; then the mode (after chown, which clears set-id bits).
                let from = beneath
                    .open_beneath(&src, libc::O_RDONLY | libc::O_DIRECTORY)
                    .map_err(CopyError::Source)?;
                let to = fs::File::open(&dst).map_err(CopyError::Local)?;
                copy::copy_xattrs(&fs::File::from(from), &to).map_err(CopyError::Local)?;
                fs::set_permissions(&dst, fs::Permissions::from_mode(m.mode() & 0o7777))
                    .map_err(CopyError::Local)?;
            } else if kind.is_symlink() {
                let target = beneath.readlink(&src).map_err(CopyError::Source)?;
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
                    _ if !fill.holds(&src, m.mode()) => {
                        let from = beneath
                            .open_beneath(&src, libc::O_PATH | libc::O_NOFOLLOW)
                            .map_err(CopyError::Source)?;
                        write_stub(&from, rel, &dst, &m).map_err(CopyError::Local)?;
                        taken.stubs += 1;
                        taken.left += m.len();
                    }
                    _ => {
                        // Cold files are read as their owner: root may be squashed.
                        let reader = Reader::lookup(m.uid()).unwrap_or_else(Reader::root);
                        // The tree was measured against the room for it; its stamp holds each size.
                        let got = copy::copy(tree, &src, &reader, tmp_dir, &dst, u64::MAX)?;
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
            let src = beneath.stat(&root.join(rel)).map_err(CopyError::Source)?;
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

/// Writes the stub of a cold file into a lazy snapshot: a sparse file of its size, owner,
/// mode, ACLs and times, marked for overlayfs as metadata only (`trusted.overlay.metacopy`)
/// with its bytes at `/rel` in the data layer, the snapshot's network directory
/// (`trusted.overlay.redirect`). `from` is the network file, opened without following.
pub fn write_stub(from: &OwnedFd, rel: &Path, dst: &Path, m: &fs::Metadata) -> io::Result<()> {
    let f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dst)?;
    f.set_len(m.len())?;
    let redirect = Path::new("/").join(rel);
    for (name, value) in [
        (c"trusted.overlay.metacopy", &b""[..]),
        (c"trusted.overlay.redirect", redirect.as_os_str().as_bytes()),
    ] {
        // SAFETY: a valid descriptor, NUL-terminated name, value of the given length.
        let ret = unsafe {
            libc::fsetxattr(
                f.as_raw_fd(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if ret != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    copy::copy_xattrs(from, &f)?;
    std::os::unix::fs::fchown(&f, Some(m.uid()), Some(m.gid()))?;
    // After chown, which clears set-id bits.
    f.set_permissions(fs::Permissions::from_mode(m.mode() & 0o7777))?;
    copy::set_times(&f, m)
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
        assert_eq!(
            measure(&tree, &root, &Fill::Whole, u64::MAX, 100),
            Some((17, 6))
        );
        assert_eq!(
            measure(&tree, &root, &Fill::Whole, 10, 100),
            None,
            "over the byte limit"
        );
        assert_eq!(
            measure(&tree, &root, &Fill::Whole, u64::MAX, 3),
            None,
            "over the entry limit"
        );
        // A symlink on the way from the watched tree is never followed.
        std::os::unix::fs::symlink(&root, tree.join("link")).unwrap();
        assert_eq!(
            measure(&tree, &tree.join("link"), &Fill::Whole, u64::MAX, 100),
            None
        );
        assert!(stamp(&tree, &tree.join("link/pkg")).is_err());
        assert!(stamp(&tree, Path::new("/etc")).is_err(), "outside the tree");

        // hot.py is in the cache already: it is linked, not copied again.
        let cache_copy = dir.path().join("cache-hot.py");
        fs::write(&cache_copy, b"x = 1\n").unwrap();
        let hot_id = Identity::of(&fs::metadata(root.join("hot.py")).unwrap());
        let cached = |p: &Path| (p == root.join("hot.py")).then(|| (cache_copy.clone(), hot_id));
        let tmp = dir.path().join("tmp");
        fs::create_dir_all(&tmp).unwrap();
        let dest = dir.path().join("trees/env/site-packages");
        let (stamp_taken, taken) = take(&tree, &root, &Fill::Whole, &dest, &tmp, &cached).unwrap();
        assert_eq!((taken.copied, taken.linked), (11, 6));
        // Every directory was just made: none of their stamps can vouch for them.
        let dirs = stamp_taken
            .iter()
            .filter(|(_, id)| id.mode & libc::S_IFMT == libc::S_IFDIR)
            .count();
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
        assert_eq!(stamp(&tree, &root).unwrap(), stamp_taken);
        // A new entry anywhere changes the stamp.
        fs::write(root.join("pkg/sub/new.py"), b"").unwrap();
        assert_ne!(stamp(&tree, &root).unwrap(), stamp_taken);
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
        let fill = Fill::Lazy([root.join("pkg/hot.py")].into_iter().collect());
        assert_eq!(measure(&tree, &root, &fill, u64::MAX, 100), Some((12, 4)));
        let tmp = dir.path().join("tmp");
        fs::create_dir_all(&tmp).unwrap();
        let dest = dir.path().join("trees/env");
        let (_, taken) = take(&tree, &root, &fill, &dest, &tmp, &|_| None).unwrap();
        assert_eq!((taken.copied, taken.stubs, taken.left), (12, 1, 26));
        let stub = dest.join("pkg/cold.py");
        let m = fs::metadata(&stub).unwrap();
        assert_eq!((m.len(), m.mode() & 0o7777), (26, 0o644));
        assert_eq!(m.blocks(), 0, "sparse: no bytes held");
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
}
