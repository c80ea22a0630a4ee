//! A watched tree held open: the anchor every lookup of a batch (a copy, a snapshot, a
//! revalidation, a job-start check) starts from, so that root resolves nothing a user can
//! change; and asking the server, not the client's caches, for a file's attributes.

use std::{
    collections::{BTreeSet, HashMap},
    ffi::OsString,
    fs::{self, File},
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, IntoRawFd, OwnedFd},
        unix::ffi::OsStringExt,
    },
    path::{Path, PathBuf},
    sync::Mutex,
};

use super::{
    asked::asked,
    dirs,
    identity::{Identity, stable_inodes},
};

/// A watched tree held open (`O_PATH`, opened without following a symlink).
pub struct Tree {
    path: PathBuf,
    anchor: OwnedFd,
    stable_inodes: bool,
}

impl Tree {
    pub fn open(path: &Path) -> io::Result<Tree> {
        asked();
        let anchor = dirs::open_dir(path)?;
        Ok(Tree {
            path: path.to_owned(),
            stable_inodes: stable_inodes(&anchor),
            anchor,
        })
    }

    /// The identity of a file of this tree (whose inode numbers may not be stable).
    pub fn identity(&self, m: &fs::Metadata) -> Identity {
        Identity::on(m, self.stable_inodes)
    }

    /// The identity of entry `name` of directory `dir` of this tree (a symlink itself,
    /// not followed), asked of the server (`stat_now`): one call, no descriptor.
    pub fn identity_now_at(&self, dir: &File, name: &std::ffi::CStr) -> io::Result<Identity> {
        let stx = statx_now(dir.as_fd(), name, libc::AT_SYMLINK_NOFOLLOW)?;
        Ok(Identity::of_statx(&stx, self.stable_inodes))
    }

    pub fn stable_inodes(&self) -> bool {
        self.stable_inodes
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens `path` (inside the tree; the tree itself too) with `flags`, beneath the
    /// tree without following a symlink on the way (see [`dirs::open_beneath`]).
    pub fn open_beneath(&self, path: &Path, flags: libc::c_int) -> io::Result<OwnedFd> {
        asked();
        self.open_uncounted(path, flags)
    }

    fn open_uncounted(&self, path: &Path, flags: libc::c_int) -> io::Result<OwnedFd> {
        let rel = path
            .strip_prefix(&self.path)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "outside the watched tree"))?;
        let rel = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        };
        dirs::open_beneath(&self.anchor, rel, flags)
    }

    /// The attributes of `path` (the entry itself if it is a symlink): what root may
    /// know of a tree users can write. One operation: a lookup brings the attributes.
    pub fn stat(&self, path: &Path) -> io::Result<fs::Metadata> {
        asked();
        File::from(self.open_uncounted(path, libc::O_PATH)?).metadata()
    }

    /// The names in directory `path` (inside the tree), without `.` and `..`.
    pub fn names(&self, path: &Path) -> io::Result<BTreeSet<OsString>> {
        let fd = self.open_beneath(path, libc::O_RDONLY | libc::O_DIRECTORY)?;
        asked();
        let mut dir = nix::dir::Dir::from_fd(fd.into_raw_fd())?;
        let mut names = BTreeSet::new();
        for entry in dir.iter() {
            let name = entry?.file_name().to_bytes().to_vec();
            if name != b"." && name != b".." {
                names.insert(OsString::from_vec(name));
            }
        }
        Ok(names)
    }
}

/// [`stable_inodes`] of the watched tree `tree` (held as `fd`), asked once: over FUSE a
/// statfs is a round trip to the server, and every copy would ask it again.
pub fn stable_inodes_of(tree: &Path, fd: &OwnedFd) -> bool {
    static KNOWN: Mutex<Option<HashMap<PathBuf, bool>>> = Mutex::new(None);
    let mut known = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
    let known = known.get_or_insert_with(Default::default);
    if let Some(s) = known.get(tree) {
        return *s;
    }
    let s = stable_inodes(fd);
    // Bounded by the watched trees (at most 8); a few more for tests' temporary ones.
    if known.len() < 64 {
        known.insert(tree.to_owned(), s);
    }
    s
}

/// The attributes of the open file `fd` (an O_PATH descriptor will do) from the server:
/// what the client cached (FUSE's and NFS's attribute caches) is fetched again first
/// (`AT_STATX_FORCE_SYNC`).
pub fn stat_now(f: &File) -> io::Result<fs::Metadata> {
    statx_now(f.as_fd(), c"", libc::AT_EMPTY_PATH)?;
    f.metadata()
}

/// `stat_now` for a descriptor of a walk: the attributes of the open file `fd` from the
/// server.
pub fn fstat_now(fd: BorrowedFd) -> io::Result<nix::sys::stat::FileStat> {
    statx_now(fd, c"", libc::AT_EMPTY_PATH)?;
    nix::sys::stat::fstat(fd.as_raw_fd()).map_err(io::Error::from)
}

/// `statx(dir, name, flags)`, asking the server rather than the client's attribute cache
/// (`AT_STATX_FORCE_SYNC`).
fn statx_now(
    dir: BorrowedFd,
    name: &std::ffi::CStr,
    flags: libc::c_int,
) -> io::Result<libc::statx> {
    asked();
    // SAFETY: a valid descriptor, a C string and a statx buffer of the right size.
    unsafe {
        let mut stx: libc::statx = std::mem::zeroed();
        let ret = libc::statx(
            dir.as_raw_fd(),
            name.as_ptr(),
            flags | libc::AT_STATX_FORCE_SYNC,
            libc::STATX_BASIC_STATS,
            &mut stx,
        );
        if ret != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stx)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    #[test]
    fn stats_are_read_beneath_the_tree_without_following_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        fs::create_dir_all(tree.join("d")).unwrap();
        fs::write(tree.join("d/f"), b"12345").unwrap();
        fs::write(dir.path().join("outside"), b"secret").unwrap();
        symlink(dir.path(), tree.join("link")).unwrap();
        let t = Tree::open(&tree).unwrap();
        assert_eq!(t.stat(&tree.join("d/f")).unwrap().len(), 5);
        assert!(t.stat(&tree).unwrap().is_dir());
        let link = t.stat(&tree.join("link")).unwrap();
        assert!(
            link.file_type().is_symlink(),
            "the link itself, not its target"
        );
        assert!(t.stat(&tree.join("link/outside")).is_err());
        assert!(t.stat(&dir.path().join("outside")).is_err());
        let names: Vec<_> = t.names(&tree).unwrap().into_iter().collect();
        assert_eq!(names, ["d", "link"]);
    }
}
