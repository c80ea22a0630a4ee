//! Copying one network file into the local cache, safely:
//!
//! - the source is opened beneath its watched tree without following any symlink
//!   (openat2 with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS), so a symlink swapped in
//!   cannot make hocus copy a file from outside the tree;
//! - it is opened with the credentials of a user seen reading it: root is squashed on
//!   most NFS exports and must not read more than users can;
//! - the data goes to a temporary file renamed into place once whole; the cache index
//!   names a copy only once the filesystem holding it was flushed, so after a crash a
//!   copy is either whole or not the index's (and removed);
//! - a source that changed during the copy (size, mtime, ctime or inode) is discarded;
//! - owner, group, mode, POSIX ACLs, user xattrs, atime and mtime (ns) are kept.

use std::{
    fs::{self, File},
    io,
    os::{
        fd::OwnedFd,
        unix::fs::{MetadataExt, OpenOptionsExt},
    },
    path::{Path, PathBuf},
};

use super::{
    partial::{FillError, PartialCopy},
    pour::{PourError, pour},
    relay::{self, Parent},
};
use crate::profile::extents::Extents;
use crate::shared::{
    asked::{self, Counted},
    attrs::{self, Times},
    dirs,
    identity::Identity,
    relay as shared_relay,
    tree::{stable_inodes_of, stat_now},
    user::{AsUser, User},
};

#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("it changed while being copied")]
    Changed,
    #[error("the cache filesystem is full")]
    NoSpace,
    #[error("refused: {0}")]
    Unsafe(String),
    #[error("at {size} bytes it is larger than the {room} bytes left for it")]
    TooLarge { size: u64, room: u64 },
    #[error("it holds more than {limit} entries")]
    TooMany { limit: usize },
    #[error("reading it failed: {0}")]
    Source(io::Error),
    #[error("writing the copy failed: {0}")]
    Local(io::Error),
    /// Not from the job's parent node: the copy is made from the network instead.
    #[error("not from the parent node: {0}")]
    Peer(relay::Miss),
}

impl From<FillError> for CopyError {
    fn from(e: FillError) -> Self {
        match e {
            FillError::Changed => CopyError::Changed,
            FillError::Source(e) => CopyError::Source(e),
            FillError::Local(e) => local(e),
            FillError::Budget | FillError::Share => CopyError::NoSpace,
        }
    }
}

impl CopyError {
    /// A short name for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            CopyError::Changed => "changed",
            CopyError::NoSpace => "no_space",
            CopyError::Unsafe(_) => "refused",
            CopyError::TooLarge { .. } | CopyError::TooMany { .. } => "too_large",
            CopyError::Source(_) if self.is_gone() => "gone",
            CopyError::Source(_) => "read_error",
            CopyError::Local(_) => "write_error",
            CopyError::Peer(_) => "peer",
        }
    }

    /// The file (or a directory above it) is no longer on the network: an imported
    /// profile's files often are, by the thousand.
    pub fn is_gone(&self) -> bool {
        matches!(self, CopyError::Source(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)))
    }
}

/// An error met reading the network side (a walk of a tree, with `?`).
impl From<io::Error> for CopyError {
    fn from(e: io::Error) -> Self {
        CopyError::Source(e)
    }
}

fn local(e: io::Error) -> CopyError {
    if e.raw_os_error() == Some(libc::ENOSPC) || e.raw_os_error() == Some(libc::EDQUOT) {
        CopyError::NoSpace
    } else {
        CopyError::Local(e)
    }
}

/// Copies `source` (inside the watched `tree`) to `dest`, going through a temporary file
/// in `tmp_dir` (on the same filesystem as `dest`), if it is at most `room` bytes: its
/// size is read from the opened file, never taken from a profile's word. Runs on the
/// calling thread, whose filesystem identity it changes for the open and restores
/// afterwards.
/// Where a copy's bytes come from: the network file itself, or the job's parent node
/// (docs/fanout.md), which offers them only if it holds what the network holds now.
#[derive(Clone, Copy)]
pub enum Via<'a> {
    Network,
    Parent(&'a Parent),
}

/// What a copy is of and where it goes: `source` inside the watched `tree`, read as
/// `reader`, written in `tmp_dir` (on the same filesystem as `dest`) and renamed to
/// `dest`, if it takes at most `room` bytes.
pub struct Copying<'a> {
    pub tree: &'a Path,
    pub source: &'a Path,
    pub reader: &'a User,
    pub tmp_dir: &'a Path,
    pub dest: &'a Path,
    pub room: u64,
}

pub fn copy(c: &Copying, via: Via) -> Result<Identity, CopyError> {
    let (source, reader, tmp_dir, dest, room) = (c.source, c.reader, c.tmp_dir, c.dest, c.room);
    let src = Source::open(c.tree, source, reader, via)?;
    let before = &src.before;
    if before.size() > room {
        return Err(CopyError::TooLarge {
            size: before.size(),
            room,
        });
    }
    let tmp = tmp_path(tmp_dir);
    let result = (|| {
        let mut out = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(local)?;
        let poured = match via {
            Via::Network => pour(Counted(&src.file), &mut out).map_err(|e| match e {
                PourError::Read(e) => CopyError::Source(e),
                PourError::Write(e) => local(e),
            })?,
            Via::Parent(parent) => {
                let now = Identity::of(before);
                parent
                    .fetch(source, now.size, now.mtime_ns, &mut out)
                    .map_err(|miss| match miss {
                        relay::Miss::Write(e) => local(e),
                        miss => CopyError::Peer(miss),
                    })?
            }
        };
        let id = src.unchanged(reader)?;
        if poured.bytes != before.size() {
            return Err(CopyError::Changed);
        }
        shared_relay::keep_hash(&out, &poured.hash);
        src.put_in_place(&out, &tmp, dest)?;
        Ok(id)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// A partial copy of `source` at `dest` (docs/partial-copies.md): a sparse file of its
/// size holding the grains `ranges`, made as [`copy`] makes a whole one (the source
/// opened beneath its tree as `reader`, checked unchanged after, owner, mode, xattrs
/// and times kept, renamed into place from `tmp_dir`), if those ranges fit `room`. The
/// network file stays open (as `reader` opened it) for the rest to be filled on
/// demand; the copy is returned open, to be marked. Via a parent node, the grains it
/// holds of those ranges come from it (checked against the hashes of their first
/// fill), the rest from the network; with the bytes the parent gave.
pub fn copy_partial(
    c: &Copying,
    ranges: &Extents,
    via: Via,
) -> Result<(Identity, PartialCopy, File, u64), CopyError> {
    let (source, reader, tmp_dir, dest, room) = (c.source, c.reader, c.tmp_dir, c.dest, c.room);
    let src = Source::open(c.tree, source, reader, via)?;
    let held = ranges.bytes(src.before.size());
    if held > room {
        return Err(CopyError::TooLarge { size: held, room });
    }
    let tmp = tmp_path(tmp_dir);
    let result = (|| {
        let out = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(local)?;
        let network = src.file.try_clone().map_err(CopyError::Source)?;
        let name = source.display().to_string();
        let writer = out.try_clone().map_err(local)?;
        let partial = PartialCopy::new(name, network, writer)?.counted_under(c.tree);
        let mut from_parent = 0;
        if let Via::Parent(parent) = via {
            let now = Identity::of(&src.before);
            let put = |start, hashes: &[_], bytes: &[u8]| partial.put(start, hashes, bytes);
            match parent.fetch_grains(source, (now.size, now.mtime_ns), ranges.grains(), put) {
                Ok(bytes) => from_parent = bytes,
                Err(relay::Miss::Write(e)) => return Err(local(e)),
                Err(miss) => {
                    log::debug!("{}: {miss}; its ranges from the network", source.display())
                }
            }
        }
        partial.fill_all(ranges)?;
        let id = src.unchanged(reader)?;
        src.put_in_place(&out, &tmp, dest)?;
        Ok((id, partial, out, from_parent))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Takes up again the partial copy at `dest` that a daemon since gone made of `source`
/// (in `tree`) at version `made_of` (the index's word): the source opened again as
/// `reader`, beneath its tree, and found unchanged since; the copy then holds what its
/// filesystem says it holds, the rest filled on demand as before. A changed source, or
/// a copy that is not the source's size, is `Changed`: the copy must go.
pub fn resume_partial(
    tree: &Path,
    source: &Path,
    reader: &User,
    dest: &Path,
    made_of: &Identity,
) -> Result<(Identity, PartialCopy, File), CopyError> {
    let src = Source::open(tree, source, reader, Via::Network)?;
    let id = src.unchanged(reader)?;
    if id != *made_of {
        return Err(CopyError::Changed);
    }
    // The cache's own file (root's, 0700 above it), never a link put in its place.
    let out = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(dest)
        .map_err(local)?;
    let writer = out.try_clone().map_err(local)?;
    let name = source.display().to_string();
    let partial = PartialCopy::resume(name, src.file, writer)?.counted_under(tree);
    Ok((id, partial, out))
}

/// A network file opened to be copied: beneath its watched tree, as the user it is read
/// as, a regular file, with what it was when opened.
struct Source<'a> {
    tree: &'a Path,
    tree_fd: OwnedFd,
    rel: &'a Path,
    file: File,
    before: fs::Metadata,
}

impl<'a> Source<'a> {
    fn open(tree: &'a Path, source: &'a Path, reader: &User, via: Via) -> Result<Self, CopyError> {
        let rel = source.strip_prefix(tree).map_err(|_| {
            CopyError::Unsafe(format!(
                "{} is not inside {}",
                source.display(),
                tree.display()
            ))
        })?;
        // Two operations: the tree's root, then the file beneath it.
        asked::asked();
        let tree_fd = dirs::open_dir(tree).map_err(|e| refused(e, tree))?;
        asked::asked();
        let file = {
            let _as_reader = AsUser::take(reader).map_err(CopyError::Source)?;
            dirs::open_regular_beneath(&tree_fd, rel).map_err(|e| match e.kind() {
                io::ErrorKind::InvalidData => {
                    CopyError::Unsafe(format!("{} is not a regular file", source.display()))
                }
                _ => refused(e, rel),
            })?
        };
        // From a parent, the network's own word on size and mtime is what its copy must
        // match: asked of the server now, not of the client's attribute cache.
        let before = match via {
            Via::Network => file.metadata(),
            Via::Parent(_) => stat_now(&file),
        }
        .map_err(CopyError::Source)?;
        Ok(Self {
            tree,
            tree_fd,
            rel,
            file,
            before,
        })
    }

    /// Its identity, if the open file and its name both still show the version first
    /// seen (a change while it was read); else `Changed`.
    fn unchanged(&self, reader: &User) -> Result<Identity, CopyError> {
        let after = self.file.metadata().map_err(CopyError::Source)?;
        // As the reader again: a squashed root may not even search the file's directory.
        let by_name = {
            let _as_reader = AsUser::take(reader).map_err(CopyError::Source)?;
            asked::asked();
            let fd = open_beneath(&self.tree_fd, self.rel, libc::O_PATH)?;
            File::from(fd).metadata().map_err(CopyError::Source)?
        };
        let stable = stable_inodes_of(self.tree, &self.tree_fd);
        let id = Identity::on(&self.before, stable);
        if Identity::on(&after, stable) != id || Identity::on(&by_name, stable) != id {
            return Err(CopyError::Changed);
        }
        Ok(id)
    }

    /// Gives `out` (written at `tmp`) the source's xattrs, owner, mode and times, and
    /// renames it to `dest`.
    fn put_in_place(&self, out: &File, tmp: &Path, dest: &Path) -> Result<(), CopyError> {
        let before = &self.before;
        attrs::copy_xattrs(&self.file, out).map_err(local)?;
        attrs::own(out, before.uid(), before.gid(), before.mode()).map_err(local)?;
        // Not fsynced one by one (a journal commit each, taken one at a time): the
        // cache index is written only after the whole cache filesystem is flushed
        // (`Cache::save`), so every copy it names is on disk, and a copy it does not
        // name is removed at the next start.
        Times::of(before).set(out).map_err(local)?;
        if let Some(parent) = dest.parent() {
            fs::create_dir_all(parent).map_err(local)?;
        }
        fs::rename(tmp, dest).map_err(local)
    }
}

/// A temporary file's name in `tmp_dir`, never used before.
fn tmp_path(tmp_dir: &Path) -> PathBuf {
    tmp_dir.join(format!("copy-{}-{:x}", std::process::id(), rand_u64()))
}

/// `rel` opened beneath the tree `dir`, following no symlink (`dirs::open_beneath`).
fn open_beneath(dir: &OwnedFd, rel: &Path, flags: libc::c_int) -> Result<OwnedFd, CopyError> {
    dirs::open_beneath(dir, rel, flags).map_err(|e| refused(e, rel))
}

/// What a failed `openat2` of `path` without symlinks means for a copy: a path that
/// goes through a symlink, leaves its tree or holds a NUL is unsafe; anything else is
/// the source's failure.
fn refused(e: io::Error, path: &Path) -> CopyError {
    if e.kind() == io::ErrorKind::InvalidInput {
        CopyError::Unsafe("a NUL byte in the path".into())
    } else if dirs::is_refusal(&e) {
        CopyError::Unsafe(format!(
            "{} goes through a symlink or leaves the watched tree",
            path.display()
        ))
    } else {
        CopyError::Source(e)
    }
}

fn rand_u64() -> u64 {
    let mut b = [0u8; 8];
    if File::open("/dev/urandom")
        .and_then(|mut f| io::Read::read_exact(&mut f, &mut b))
        .is_err()
    {
        return std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
    }
    u64::from_ne_bytes(b)
}

/// Where the copy of `source` lives under the cache's file tree.
pub fn local_path(files_root: &Path, source: &str) -> PathBuf {
    files_root.join(source.trim_start_matches('/'))
}

#[cfg(test)]
mod tests {
    use std::{
        io::{Seek, Write},
        os::{
            fd::AsRawFd,
            unix::fs::{PermissionsExt, symlink},
        },
        time::Duration,
    };

    use super::*;

    fn root() -> &'static User {
        static ROOT: std::sync::OnceLock<User> = std::sync::OnceLock::new();
        ROOT.get_or_init(User::root)
    }

    /// A watched tree and the cache's tmp/ in a temporary directory.
    struct Fixture {
        dir: tempfile::TempDir,
        tree: PathBuf,
        tmp: PathBuf,
    }

    impl Fixture {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let (tree, tmp) = (dir.path().join("tree"), dir.path().join("tmp"));
            fs::create_dir_all(&tree).unwrap();
            fs::create_dir_all(&tmp).unwrap();
            Self { dir, tree, tmp }
        }

        /// `src` copied to `dest` (beside the tree) as root from the network, if it fits
        /// `room`.
        fn copy(&self, src: &Path, dest: &str, room: u64) -> Result<Identity, CopyError> {
            let dest = self.dir.path().join(dest);
            copy(&self.copying(src, &dest, room), Via::Network)
        }

        fn copying<'a>(&'a self, src: &'a Path, dest: &'a Path, room: u64) -> Copying<'a> {
            Copying {
                tree: &self.tree,
                source: src,
                reader: root(),
                tmp_dir: &self.tmp,
                dest,
                room,
            }
        }

        fn nothing_left_in_tmp(&self) -> bool {
            fs::read_dir(&self.tmp).unwrap().count() == 0
        }
    }

    #[test]
    fn keeps_user_xattrs() {
        let f = Fixture::new();
        let src = f.tree.join("tagged");
        fs::write(&src, b"x").unwrap();
        let name = c"user.hocus.test";
        attrs::set_xattr(&File::open(&src).unwrap(), name, b"v1").unwrap_or_else(|e| {
            panic!(
                "setxattr on {}: {e} (the test needs a TMPDIR with user xattrs)",
                src.display()
            )
        });
        // Its real size decides, not what a profile said.
        let size = fs::metadata(&src).unwrap().len();
        assert!(matches!(
            f.copy(&src, "copy", size - 1),
            Err(CopyError::TooLarge { .. })
        ));
        let dest = f.dir.path().join("copy");
        assert!(!dest.exists());
        f.copy(&src, "copy", size).unwrap();
        let mut value = [0u8; 8];
        let n = attrs::get_xattr(&File::open(&dest).unwrap(), name, &mut value).unwrap();
        assert_eq!(&value[..n], b"v1");
    }

    #[test]
    fn a_file_growing_during_the_copy_is_discarded() {
        let f = Fixture::new();
        let src = f.tree.join("log");
        fs::write(&src, vec![0u8; 32 << 20]).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (src, stop) = (src.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut f = fs::OpenOptions::new().append(true).open(&src).unwrap();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    io::Write::write_all(&mut f, b"more\n").unwrap();
                    std::thread::sleep(Duration::from_micros(200));
                }
            })
        };
        let result = f.copy(&src, "copy", u64::MAX);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writer.join().unwrap();
        assert!(matches!(result, Err(CopyError::Changed)), "{result:?}");
        assert!(!f.dir.path().join("copy").exists(), "a torn copy was kept");
        assert!(f.nothing_left_in_tmp());
    }

    #[test]
    fn copies_content_mode_and_times_and_refuses_symlinks() {
        let f = Fixture::new();
        fs::create_dir_all(f.tree.join("sub")).unwrap();
        let src = f.tree.join("sub/a.py");
        fs::write(&src, b"print(1)\n").unwrap();
        fs::set_permissions(&src, fs::Permissions::from_mode(0o640)).unwrap();
        let t = libc::timespec {
            tv_sec: 1_600_000_000,
            tv_nsec: 123_456_789,
        };
        let file = File::open(&src).unwrap();
        // SAFETY: a valid descriptor and two timespecs.
        assert_eq!(
            unsafe { libc::futimens(file.as_raw_fd(), [t, t].as_ptr()) },
            0
        );

        let id = f.copy(&src, "cache/sub/a.py", u64::MAX).unwrap();
        let dest = f.dir.path().join("cache/sub/a.py");
        assert_eq!(fs::read(&dest).unwrap(), b"print(1)\n");
        let m = fs::metadata(&dest).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o640);
        assert_eq!((m.mtime(), m.mtime_nsec()), (1_600_000_000, 123_456_789));
        assert_eq!(id.size, 9);
        assert!(f.nothing_left_in_tmp(), "no temporary file is left");

        // A symlinked directory inside the tree pointing outside it, and a path that is
        // not in the tree at all.
        let outside = f.dir.path().join("secret");
        fs::write(&outside, b"secret").unwrap();
        symlink(f.dir.path(), f.tree.join("link")).unwrap();
        for (src, dest) in [(f.tree.join("link/secret"), "x"), (outside, "y")] {
            let err = f.copy(&src, dest, u64::MAX).unwrap_err();
            assert!(matches!(err, CopyError::Unsafe(_)), "{err}");
            assert!(!f.dir.path().join(dest).exists());
        }
    }

    #[test]
    fn a_partial_copy_holds_its_ranges_within_room_and_keeps_mode_and_times() {
        let f = Fixture::new();
        let src = f.tree.join("train.bin");
        let bytes: Vec<u8> = (0..8u32 << 20).map(|i| (i % 251) as u8 + 1).collect();
        fs::write(&src, &bytes).unwrap();
        fs::set_permissions(&src, fs::Permissions::from_mode(0o640)).unwrap();
        let mut ranges = Extents::default();
        ranges.add(16, 32); // 1 MiB at 1 MiB
        let dest = f.dir.path().join("cache/train.bin");
        let partial = |room| copy_partial(&f.copying(&src, &dest, room), &ranges, Via::Network);
        assert!(matches!(
            partial((1 << 20) - 1),
            Err(CopyError::TooLarge { .. })
        ));
        assert!(!dest.exists() && f.nothing_left_in_tmp());
        let (id, copy, file, from_parent) = partial(1 << 20).unwrap();
        assert_eq!(from_parent, 0);
        assert_eq!((id.size, copy.size()), (8 << 20, 8 << 20));
        let held = fs::read(&dest).unwrap();
        assert_eq!(held.len(), 8 << 20);
        assert_eq!(&held[1 << 20..2 << 20], &bytes[1 << 20..2 << 20]);
        assert!(
            held[..1 << 20]
                .iter()
                .chain(&held[2 << 20..])
                .all(|b| *b == 0)
        );
        let m = file.metadata().unwrap();
        assert_eq!(m.blocks() * 512, 1 << 20, "only the range is allocated");
        assert_eq!(m.mode() & 0o7777, 0o640);
        assert_eq!(m.mtime(), fs::metadata(&src).unwrap().mtime());
        assert!(f.nothing_left_in_tmp());
    }

    #[test]
    fn a_sparse_file_is_copied_sparse_and_whole() {
        let f = Fixture::new();
        let src = f.tree.join("image");
        let mut file = File::create(&src).unwrap();
        file.set_len(64 << 20).unwrap();
        file.seek(io::SeekFrom::Start(10 << 20)).unwrap();
        file.write_all(b"data in the middle").unwrap();
        drop(file);
        f.copy(&src, "copy", u64::MAX).unwrap();
        let dest = f.dir.path().join("copy");
        assert_eq!(fs::read(&dest).unwrap(), fs::read(&src).unwrap());
        let allocated = fs::metadata(&dest).unwrap().blocks() * 512;
        assert!(
            allocated < 4 << 20,
            "{allocated} bytes allocated for 18 bytes of data"
        );
    }
}
