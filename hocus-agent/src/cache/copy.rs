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
    collections::HashMap,
    ffi::{CString, OsString},
    fs::{self, File},
    io,
    os::{
        fd::{AsRawFd, IntoRawFd, OwnedFd},
        unix::{ffi::OsStringExt, fs::MetadataExt},
    },
    path::{Path, PathBuf},
    sync::Mutex,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use super::{
    pour::{PourError, pour},
    relay::{self, Parent},
};
use crate::shared::dirs;

/// What identifies a version of a file: a copy is valid while these are unchanged. The
/// mode and owner are part of it: a permission change must reach jobs, and some network
/// filesystems (sshfs) do not move ctime on chmod or chown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    pub ino: u64,
    /// Type and permission bits (st_mode); 0 in an index written before they were kept,
    /// which then fails its first revalidation.
    #[serde(default)]
    pub mode: u32,
    #[serde(default)]
    pub uid: u32,
    #[serde(default)]
    pub gid: u32,
}

/// FUSE's superblock magic (statfs f_type). A FUSE filesystem numbers inodes itself,
/// and sshfs (and most others, without options such as `use_ino`) gives a file a new
/// number whenever the kernel forgets its inode: after every page-cache eviction.
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// Whether the filesystem of `fd` keeps a file's inode number for as long as the file
/// lives (NFS file ids, Lustre, GPFS, CephFS, local disks), so that a new number means a
/// new file. FUSE does not.
pub fn stable_inodes(fd: &impl std::os::fd::AsFd) -> bool {
    nix::sys::statfs::fstatfs(fd).map_or(true, |s| s.filesystem_type().0 != FUSE_SUPER_MAGIC)
}

/// [`stable_inodes`] of the watched tree `tree`, asked once: over FUSE a statfs is a
/// round trip to the server, and every copy would ask it again.
fn stable_inodes_of(tree: &Path, fd: &OwnedFd) -> bool {
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

impl Identity {
    /// The identity of a file on a filesystem whose inode numbers are stable or not:
    /// where they are not, the number says nothing and is left out (0).
    pub fn on(m: &fs::Metadata, stable_inodes: bool) -> Self {
        let mut id = Self::of(m);
        if !stable_inodes {
            id.ino = 0;
        }
        id
    }

    pub fn of(m: &fs::Metadata) -> Self {
        Self {
            size: m.size(),
            mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
            ctime_ns: m.ctime() * 1_000_000_000 + m.ctime_nsec(),
            ino: m.ino(),
            mode: m.mode(),
            uid: m.uid(),
            gid: m.gid(),
        }
    }
}

/// Whose credentials open the source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reader {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// How long a user's groups (or that there is no such user) are taken as known: a
/// placement asks for the reader of every file it would copy, and the name service can
/// cost dozens of syscalls an answer (files, userdb, sssd ...), more for a user it does
/// not know. A change of groups reaches copies within this long, as it reaches a login.
const READER_TTL: Duration = Duration::from_secs(60);

/// Users looked up lately (None: unknown to the name service), and when.
type Readers = HashMap<u32, (Option<Reader>, Instant)>;
static READERS: Mutex<Option<Readers>> = Mutex::new(None);

/// Users remembered at most (a placement sees a few hundred at a site).
const READERS_HELD: usize = 4096;

impl Reader {
    /// The user `uid` with their primary and supplementary groups; None if the name
    /// service does not know them. Remembered for `READER_TTL`.
    pub fn lookup(uid: u32) -> Option<Self> {
        let now = Instant::now();
        let mut guard = READERS.lock().unwrap_or_else(|e| e.into_inner());
        let readers = guard.get_or_insert_with(HashMap::new);
        if let Some((reader, at)) = readers.get(&uid) {
            if now.duration_since(*at) < READER_TTL {
                return reader.clone();
            }
        }
        if readers.len() >= READERS_HELD {
            readers.retain(|_, (_, at)| now.duration_since(*at) < READER_TTL);
        }
        let reader = Self::from_name_service(uid);
        if readers.len() < READERS_HELD {
            readers.insert(uid, (reader.clone(), now));
        }
        reader
    }

    fn from_name_service(uid: u32) -> Option<Self> {
        let user = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)).ok()??;
        let name = CString::new(user.name).ok()?;
        let groups = nix::unistd::getgrouplist(&name, user.gid)
            .map(|g| g.into_iter().map(|g| g.as_raw()).collect())
            .unwrap_or_else(|_| vec![user.gid.as_raw()]);
        Some(Self {
            uid,
            gid: user.gid.as_raw(),
            groups,
        })
    }

    pub fn root() -> Self {
        Self {
            uid: 0,
            gid: 0,
            groups: vec![0],
        }
    }
}

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

impl CopyError {
    /// A short name for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            CopyError::Changed => "changed",
            CopyError::NoSpace => "no_space",
            CopyError::Unsafe(_) => "refused",
            CopyError::TooLarge { .. } | CopyError::TooMany { .. } => "too_large",
            CopyError::Source(_) => "read_error",
            CopyError::Local(_) => "write_error",
            CopyError::Peer(_) => "peer",
        }
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

pub fn copy(
    tree: &Path,
    source: &Path,
    reader: &Reader,
    tmp_dir: &Path,
    dest: &Path,
    room: u64,
    via: Via,
) -> Result<Identity, CopyError> {
    let rel = source.strip_prefix(tree).map_err(|_| {
        CopyError::Unsafe(format!(
            "{} is not inside {}",
            source.display(),
            tree.display()
        ))
    })?;
    let tree_fd = dirs::open_dir(tree).map_err(|e| refused(e, tree))?;
    let src = {
        let _as_reader = AsReader::take(reader).map_err(CopyError::Source)?;
        open_beneath(&tree_fd, rel, libc::O_RDONLY)?
    };
    let src = File::from(src);
    // From a parent, the network's own word on size and mtime is what its copy must
    // match: asked of the server now, not of the client's attribute cache.
    let before = match via {
        Via::Network => src.metadata(),
        Via::Parent(_) => stat_now(&src),
    }
    .map_err(CopyError::Source)?;
    if !before.is_file() {
        return Err(CopyError::Unsafe(format!(
            "{} is not a regular file",
            source.display()
        )));
    }
    if before.size() > room {
        return Err(CopyError::TooLarge {
            size: before.size(),
            room,
        });
    }
    let tmp = tmp_dir.join(format!("copy-{}-{:x}", std::process::id(), rand_u64()));
    let result = (|| {
        let mut out = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(local)?;
        let poured = match via {
            Via::Network => pour(&src, &mut out).map_err(|e| match e {
                PourError::Read(e) => CopyError::Source(e),
                PourError::Write(e) => local(e),
            })?,
            Via::Parent(parent) => {
                let now = Identity::of(&before);
                parent
                    .fetch(source, now.size, now.mtime_ns, &mut out)
                    .map_err(|miss| match miss {
                        relay::Miss::Write(e) => local(e),
                        miss => CopyError::Peer(miss),
                    })?
            }
        };
        let copied = poured.bytes;
        // Changed while we read? Look at the open file and at the name again.
        let after = src.metadata().map_err(CopyError::Source)?;
        let by_name = {
            let fd = open_beneath(&tree_fd, rel, libc::O_PATH)?;
            File::from(fd).metadata().map_err(CopyError::Source)?
        };
        let stable = stable_inodes_of(tree, &tree_fd);
        let id = Identity::on(&before, stable);
        if copied != before.size()
            || Identity::on(&after, stable) != id
            || Identity::on(&by_name, stable) != id
        {
            return Err(CopyError::Changed);
        }
        copy_xattrs(&src, &out).map_err(local)?;
        relay::keep_hash(&out, &poured.hash);
        fchown(&out, before.uid(), before.gid()).map_err(local)?;
        // chown clears set-id bits: the mode comes after it.
        fchmod(&out, before.mode() & 0o7777).map_err(local)?;
        // Not fsynced one by one (a journal commit each, taken one at a time): the
        // cache index is written only after the whole cache filesystem is flushed
        // (`Cache::save`), so every copy it names is on disk, and a copy it does not
        // name is removed at the next start.
        set_times(&out, &before).map_err(local)?;
        if let Some(parent) = dest.parent() {
            fs::create_dir_all(parent).map_err(local)?;
        }
        fs::rename(&tmp, dest).map_err(local)?;
        Ok(id)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// openat2 beneath `dir` without following symlinks or magic links on any component.
pub fn open_beneath(dir: &OwnedFd, rel: &Path, flags: libc::c_int) -> Result<OwnedFd, CopyError> {
    let resolve = libc::RESOLVE_BENEATH | dirs::NO_SYMLINKS;
    dirs::openat2(dir.as_raw_fd(), rel, flags | libc::O_NOFOLLOW, resolve)
        .map_err(|e| refused(e, rel))
}

/// What a failed `openat2` of `path` without symlinks means for a copy: a path that
/// goes through a symlink, leaves its tree or holds a NUL is unsafe; anything else is
/// the source's failure.
fn refused(e: io::Error, path: &Path) -> CopyError {
    match (e.kind(), e.raw_os_error()) {
        (io::ErrorKind::InvalidInput, _) => CopyError::Unsafe("a NUL byte in the path".into()),
        (_, Some(libc::ELOOP) | Some(libc::EXDEV)) => CopyError::Unsafe(format!(
            "{} goes through a symlink or leaves the watched tree",
            path.display()
        )),
        _ => CopyError::Source(e),
    }
}

/// A watched tree held open: the anchor every lookup of a batch (a snapshot, a
/// revalidation) starts from, so that root resolves nothing a user can change and opens
/// the tree once, not once per entry.
pub struct Tree {
    path: PathBuf,
    anchor: OwnedFd,
    stable_inodes: bool,
}

impl Tree {
    pub fn open(path: &Path) -> io::Result<Tree> {
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

    pub fn stable_inodes(&self) -> bool {
        self.stable_inodes
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens `path` (inside the tree; the tree itself too) with `flags`, beneath the
    /// tree without following a symlink on the way (see [`open_beneath`]).
    pub fn open_beneath(&self, path: &Path, flags: libc::c_int) -> io::Result<OwnedFd> {
        let rel = path
            .strip_prefix(&self.path)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "outside the watched tree"))?;
        let rel = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        };
        open_beneath(&self.anchor, rel, flags).map_err(|e| match e {
            CopyError::Source(e) | CopyError::Local(e) => e,
            other => io::Error::new(io::ErrorKind::PermissionDenied, other.to_string()),
        })
    }

    /// The attributes of `path` (the entry itself if it is a symlink): what root may
    /// know of a tree users can write.
    pub fn stat(&self, path: &Path) -> io::Result<fs::Metadata> {
        File::from(self.open_beneath(path, libc::O_PATH)?).metadata()
    }

    /// The names in directory `path` (inside the tree), without `.` and `..`.
    pub fn names(&self, path: &Path) -> io::Result<std::collections::BTreeSet<OsString>> {
        let fd = self.open_beneath(path, libc::O_RDONLY | libc::O_DIRECTORY)?;
        let mut dir = nix::dir::Dir::from_fd(fd.into_raw_fd())?;
        let mut names = std::collections::BTreeSet::new();
        for entry in dir.iter() {
            let name = entry?.file_name().to_bytes().to_vec();
            if name != b"." && name != b".." {
                names.insert(OsString::from_vec(name));
            }
        }
        Ok(names)
    }
}

/// The attributes of the open file `fd` (an O_PATH descriptor will do) from the server:
/// what the client cached (FUSE's and NFS's attribute caches) is fetched again first
/// (`AT_STATX_FORCE_SYNC`).
pub fn stat_now(f: &File) -> io::Result<fs::Metadata> {
    // SAFETY: a valid descriptor, an empty path and a statx buffer of the right size.
    let ret = unsafe {
        let mut stx: libc::statx = std::mem::zeroed();
        libc::statx(
            f.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_STATX_FORCE_SYNC,
            libc::STATX_BASIC_STATS,
            &mut stx,
        )
    };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    f.metadata()
}

/// This thread's filesystem identity as `reader` until dropped. Raw syscalls: glibc's
/// wrappers would change every thread of the daemon.
struct AsReader {
    was_root: bool,
}

impl AsReader {
    fn take(r: &Reader) -> io::Result<Self> {
        if r.uid == 0 {
            return Ok(Self { was_root: false });
        }
        // SAFETY: credential syscalls on this thread only, with valid pointers.
        unsafe {
            if libc::syscall(libc::SYS_setgroups, r.groups.len(), r.groups.as_ptr()) != 0 {
                return Err(io::Error::last_os_error());
            }
            libc::syscall(libc::SYS_setfsgid, r.gid);
            libc::syscall(libc::SYS_setfsuid, r.uid);
            if libc::syscall(libc::SYS_setfsuid, u32::MAX) as u32 != r.uid {
                return Err(io::Error::other(format!(
                    "could not take the identity of uid {}",
                    r.uid
                )));
            }
        }
        Ok(Self { was_root: true })
    }
}

impl Drop for AsReader {
    fn drop(&mut self) {
        if self.was_root {
            // SAFETY: as above; back to root, which restores the filesystem capabilities.
            unsafe {
                libc::syscall(libc::SYS_setfsuid, 0);
                libc::syscall(libc::SYS_setfsgid, 0);
                let none: [u32; 0] = [];
                libc::syscall(libc::SYS_setgroups, 0, none.as_ptr());
            }
        }
    }
}

fn fchown(f: &File, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: plain syscall on an open descriptor.
    if unsafe { libc::fchown(f.as_raw_fd(), uid, gid) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn fchmod(f: &File, mode: u32) -> io::Result<()> {
    // SAFETY: plain syscall on an open descriptor.
    if unsafe { libc::fchmod(f.as_raw_fd(), mode) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The access and modification times of `m`, as futimens/utimensat take them.
pub fn times_of(m: &fs::Metadata) -> [libc::timespec; 2] {
    [
        libc::timespec {
            tv_sec: m.atime(),
            tv_nsec: m.atime_nsec(),
        },
        libc::timespec {
            tv_sec: m.mtime(),
            tv_nsec: m.mtime_nsec(),
        },
    ]
}

pub fn set_times(f: &File, m: &fs::Metadata) -> io::Result<()> {
    let times = times_of(m);
    // SAFETY: valid pointer to two timespecs.
    if unsafe { libc::futimens(f.as_raw_fd(), times.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Copies the POSIX ACLs (access, and a directory's default) and the user xattrs. An
/// ACL that cannot be copied fails the copy: a copy keeps its source's permissions or is
/// not made. Filesystems without xattrs (sshfs) have none. `src` may be an O_PATH
/// descriptor: it is read through its /proc/self/fd link, which names it and nothing else.
pub fn copy_xattrs(src: &impl AsRawFd, dst: &File) -> io::Result<()> {
    let link =
        CString::new(format!("/proc/self/fd/{}", src.as_raw_fd())).expect("no NUL in a number");
    let list = |buf: &mut [u8]| {
        // SAFETY: NUL-terminated path, buffer of the given size (empty: asks the size).
        let n = unsafe { libc::listxattr(link.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENOTSUP) => Ok(0),
            _ => Err(e),
        }
    };
    // Most files have none (and sshfs none at all): ask the size first, so that a snapshot
    // of thousands of files allocates nothing for them.
    let size = list(&mut [])?;
    if size == 0 {
        return Ok(());
    }
    // A name may be added between the two calls: room for it, and ERANGE fails the copy.
    let mut names = vec![0u8; size + 256];
    let n = list(&mut names)?;
    for name in names[..n].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let acl = name == b"system.posix_acl_access" || name == b"system.posix_acl_default";
        if !(acl || name.starts_with(b"user.")) {
            continue;
        }
        let Ok(cname) = CString::new(name) else {
            continue;
        };
        let mut value = vec![0u8; 64 << 10];
        // SAFETY: buffers of the given sizes, NUL-terminated strings.
        let len = unsafe {
            libc::getxattr(
                link.as_ptr(),
                cname.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        let set = len >= 0
            // SAFETY: as above.
            && unsafe {
                libc::fsetxattr(
                    dst.as_raw_fd(),
                    cname.as_ptr(),
                    value.as_ptr().cast(),
                    len as usize,
                    0,
                )
            } == 0;
        if !set && acl {
            return Err(io::Error::other(format!(
                "cannot copy {}: {}",
                String::from_utf8_lossy(name),
                io::Error::last_os_error()
            )));
        }
    }
    Ok(())
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
    use super::*;
    use std::{
        io::{Seek, Write},
        os::unix::{
            ffi::OsStrExt,
            fs::{PermissionsExt, symlink},
        },
    };

    #[test]
    fn keeps_user_xattrs() {
        let dir = tempfile::tempdir().unwrap();
        let (tree, tmp) = (dir.path().join("tree"), dir.path().join("tmp"));
        fs::create_dir_all(&tree).unwrap();
        fs::create_dir_all(&tmp).unwrap();
        let src = tree.join("tagged");
        fs::write(&src, b"x").unwrap();
        let (path, name) = (
            CString::new(src.as_os_str().as_bytes()).unwrap(),
            c"user.hocus.test",
        );
        // SAFETY: valid C strings and buffer.
        let set =
            unsafe { libc::setxattr(path.as_ptr(), name.as_ptr(), b"v1".as_ptr().cast(), 2, 0) };
        assert_eq!(
            set,
            0,
            "setxattr on {}: {} (the test needs a TMPDIR with user xattrs)",
            src.display(),
            io::Error::last_os_error()
        );
        let dest = dir.path().join("copy");
        // Its real size decides, not what a profile said.
        let size = fs::metadata(&src).unwrap().len();
        assert!(matches!(
            copy(
                &tree,
                &src,
                &Reader::root(),
                &tmp,
                &dest,
                size - 1,
                Via::Network
            ),
            Err(CopyError::TooLarge { .. })
        ));
        assert!(!dest.exists());
        copy(
            &tree,
            &src,
            &Reader::root(),
            &tmp,
            &dest,
            size,
            Via::Network,
        )
        .unwrap();
        let dest_c = CString::new(dest.as_os_str().as_bytes()).unwrap();
        let mut value = [0u8; 8];
        // SAFETY: as above.
        let n = unsafe {
            libc::getxattr(
                dest_c.as_ptr(),
                name.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        assert_eq!(&value[..n.max(0) as usize], b"v1");
    }

    #[test]
    fn a_file_growing_during_the_copy_is_discarded() {
        let dir = tempfile::tempdir().unwrap();
        let (tree, tmp) = (dir.path().join("tree"), dir.path().join("tmp"));
        fs::create_dir_all(&tree).unwrap();
        fs::create_dir_all(&tmp).unwrap();
        let src = tree.join("log");
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
        let dest = dir.path().join("copy");
        let result = copy(
            &tree,
            &src,
            &Reader::root(),
            &tmp,
            &dest,
            u64::MAX,
            Via::Network,
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writer.join().unwrap();
        assert!(matches!(result, Err(CopyError::Changed)), "{result:?}");
        assert!(!dest.exists(), "a torn copy was kept");
        assert_eq!(fs::read_dir(&tmp).unwrap().count(), 0);
    }

    #[test]
    fn copies_content_mode_and_times_and_refuses_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        let tmp = dir.path().join("tmp");
        fs::create_dir_all(tree.join("sub")).unwrap();
        fs::create_dir_all(&tmp).unwrap();
        let src = tree.join("sub/a.py");
        fs::write(&src, b"print(1)\n").unwrap();
        fs::set_permissions(&src, fs::Permissions::from_mode(0o640)).unwrap();
        let t = libc::timespec {
            tv_sec: 1_600_000_000,
            tv_nsec: 123_456_789,
        };
        let c = CString::new(src.as_os_str().as_bytes()).unwrap();
        // SAFETY: valid pointers.
        unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), [t, t].as_ptr(), 0) };

        let dest = dir.path().join("cache/sub/a.py");
        let id = copy(
            &tree,
            &src,
            &Reader::root(),
            &tmp,
            &dest,
            u64::MAX,
            Via::Network,
        )
        .unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"print(1)\n");
        let m = fs::metadata(&dest).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o640);
        assert_eq!((m.mtime(), m.mtime_nsec()), (1_600_000_000, 123_456_789));
        assert_eq!(id.size, 9);
        assert_eq!(
            fs::read_dir(&tmp).unwrap().count(),
            0,
            "no temporary file is left"
        );

        // A symlinked directory inside the tree pointing outside it.
        let outside = dir.path().join("secret");
        fs::write(&outside, b"secret").unwrap();
        symlink(dir.path(), tree.join("link")).unwrap();
        let err = copy(
            &tree,
            &tree.join("link/secret"),
            &Reader::root(),
            &tmp,
            &dir.path().join("x"),
            u64::MAX,
            Via::Network,
        )
        .unwrap_err();
        assert!(matches!(err, CopyError::Unsafe(_)), "{err}");
        // and a path that is not in the tree at all
        let err = copy(
            &tree,
            &outside,
            &Reader::root(),
            &tmp,
            &dir.path().join("y"),
            u64::MAX,
            Via::Network,
        )
        .unwrap_err();
        assert!(matches!(err, CopyError::Unsafe(_)), "{err}");
        assert!(!dir.path().join("x").exists() && !dir.path().join("y").exists());
    }

    #[test]
    fn a_sparse_file_is_copied_sparse_and_whole() {
        let dir = tempfile::tempdir().unwrap();
        let (tree, tmp) = (dir.path().join("tree"), dir.path().join("tmp"));
        fs::create_dir_all(&tree).unwrap();
        fs::create_dir_all(&tmp).unwrap();
        let src = tree.join("image");
        let mut f = File::create(&src).unwrap();
        f.set_len(64 << 20).unwrap();
        f.seek(io::SeekFrom::Start(10 << 20)).unwrap();
        f.write_all(b"data in the middle").unwrap();
        drop(f);
        let dest = dir.path().join("copy");
        copy(
            &tree,
            &src,
            &Reader::root(),
            &tmp,
            &dest,
            u64::MAX,
            Via::Network,
        )
        .unwrap();
        assert_eq!(fs::read(&dest).unwrap(), fs::read(&src).unwrap());
        let allocated = fs::metadata(&dest).unwrap().blocks() * 512;
        assert!(
            allocated < 4 << 20,
            "{allocated} bytes allocated for 18 bytes of data"
        );
    }

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
    }
}
