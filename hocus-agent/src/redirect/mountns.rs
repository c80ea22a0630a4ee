//! Mount namespaces for jobs: a new namespace made a slave of the host's before anything
//! is mounted in it (nothing leaks back; automounts still arrive), and read-only,
//! nosuid, nodev binds of local copies over network paths, made with the new mount API
//! from descriptors: the target is opened beneath its watched tree without following any
//! symlink, so a symlink swapped in cannot redirect a mount.

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
};

use crate::cache::copy::{self, CopyError, Identity};

// The unified syscall numbers of the new mount API (all architectures but alpha/mips).
const SYS_OPEN_TREE: libc::c_long = 428;
const SYS_MOVE_MOUNT: libc::c_long = 429;
const SYS_MOUNT_SETATTR: libc::c_long = 442;
const OPEN_TREE_CLONE: libc::c_uint = 1;
const OPEN_TREE_CLOEXEC: libc::c_uint = libc::O_CLOEXEC as libc::c_uint;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x40;
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;

/// struct mount_attr (linux/mount.h).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// A local copy (a file or a snapshot directory) to show at a network path.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Bind {
    /// In the root-only cache.
    pub local: PathBuf,
    /// The network path, inside `tree`.
    pub target: PathBuf,
    /// The watched tree `target` must stay beneath.
    pub tree: PathBuf,
    /// What the network held when the copy was made, checked as a job starts.
    #[serde(default)]
    pub expect: Expect,
}

/// What a local copy was made from.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Expect {
    #[default]
    Nothing,
    /// A file, at this identity.
    File(Identity),
    /// A snapshot: each directory of it.
    Dirs(Vec<SnapshotDir>),
}

/// A directory of a snapshot, as it was when the snapshot was taken.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SnapshotDir {
    /// Relative to the snapshot's root; "" is the root.
    pub rel: PathBuf,
    pub identity: Identity,
    /// Changed just before it was stamped, so an unchanged identity does not prove it
    /// unchanged: its names are compared too (`snapshot::Taken::racy`).
    pub racy: bool,
}

fn check(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Moves the calling thread (only it) into a new mount namespace, a slave of the
/// current one. Whatever this thread forks afterwards lives there.
pub fn enter_new_namespace() -> io::Result<()> {
    // SAFETY: plain syscalls; CLONE_FS first, so that this thread alone moves.
    unsafe {
        check(libc::unshare(libc::CLONE_FS).into())?;
        check(libc::unshare(libc::CLONE_NEWNS).into())?;
        let root = c"/";
        check(
            libc::mount(
                std::ptr::null(),
                root.as_ptr(),
                std::ptr::null(),
                libc::MS_SLAVE | libc::MS_REC,
                std::ptr::null(),
            )
            .into(),
        )?;
    }
    Ok(())
}

/// Binds `b.local` read-only, nosuid, nodev over `b.target`.
pub fn bind_read_only(b: &Bind) -> io::Result<()> {
    let local = cstr(&b.local)?;
    // SAFETY: valid C strings and struct pointers; descriptors are owned on success.
    unsafe {
        let source = check(libc::syscall(
            SYS_OPEN_TREE,
            libc::AT_FDCWD,
            local.as_ptr(),
            OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | libc::AT_SYMLINK_NOFOLLOW as libc::c_uint,
        ))?;
        let source = OwnedFd::from_raw_fd(source as i32);
        let attr = MountAttr {
            attr_set: MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
            attr_clr: 0,
            propagation: 0,
            userns_fd: 0,
        };
        check(libc::syscall(
            SYS_MOUNT_SETATTR,
            source.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            size_of::<MountAttr>(),
        ))?;
        let target = open_target(b)?;
        check(libc::syscall(
            SYS_MOVE_MOUNT,
            source.as_raw_fd(),
            c"".as_ptr(),
            target.as_raw_fd(),
            c"".as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
        ))?;
    }
    Ok(())
}

fn open_target(b: &Bind) -> io::Result<OwnedFd> {
    let tree = cstr(&b.tree)?;
    // SAFETY: valid C string; owned on success.
    let tree_fd = unsafe {
        let fd = check(
            libc::open(
                tree.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
            .into(),
        )?;
        OwnedFd::from_raw_fd(fd as i32)
    };
    let rel = b.target.strip_prefix(&b.tree).map_err(|_| {
        io::Error::other(format!(
            "{} is not inside {}",
            b.target.display(),
            b.tree.display()
        ))
    })?;
    copy::open_beneath(&tree_fd, rel, libc::O_PATH).map_err(|e| match e {
        CopyError::Source(e) => e,
        other => io::Error::other(other.to_string()),
    })
}

/// Detaches mounts at `targets` inside the mount namespace `ns` (a /proc/PID/ns/mnt
/// descriptor), from a short-lived thread of this process. Returns how many went.
pub fn detach_in(ns: &OwnedFd, targets: &[PathBuf]) -> io::Result<usize> {
    let ns = ns.try_clone()?;
    let targets: Vec<CString> = targets.iter().map(|t| cstr(t)).collect::<io::Result<_>>()?;
    std::thread::Builder::new()
        .name("hocus-detach".into())
        .spawn(move || -> io::Result<usize> {
            // SAFETY: plain syscalls on this thread, which ends right after.
            unsafe {
                check(libc::unshare(libc::CLONE_FS).into())?;
                check(libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS).into())?;
                Ok(targets
                    .iter()
                    .filter(|t| libc::umount2(t.as_ptr(), libc::MNT_DETACH) == 0)
                    .count())
            }
        })?
        .join()
        .map_err(|_| io::Error::other("the detaching thread panicked"))?
}
