//! Mount namespaces for jobs: a new namespace made a slave of the host's before anything
//! is mounted in it (nothing leaks back; automounts still arrive), and read-only,
//! nosuid, nodev binds of local copies over network paths, made with the new mount API
//! from descriptors: the target is opened beneath its watched tree without following any
//! symlink, so a symlink swapped in cannot redirect a mount.

use std::{
    ffi::{CStr, CString},
    io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::{ffi::OsStrExt, fs::MetadataExt},
    },
    path::{Path, PathBuf},
};

use crate::shared::{
    asked::{self, Asking, Purpose},
    dirs,
    identity::Identity,
    kernel::{self, Route},
    user::{AsUser, User},
};

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
    /// A lazy snapshot: `local` holds every name but only some files' bytes; the others
    /// are read from `target` on demand, through an overlay (see [`lazy_overlay`]).
    #[serde(default)]
    pub lazy: bool,
    /// Directories of a lazy snapshot no job used, by path below `target`: each shows
    /// the network directory itself, bound over the overlay's empty one.
    #[serde(default)]
    pub passages: Vec<PathBuf>,
}

/// What a local copy was made from.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Expect {
    #[default]
    Nothing,
    /// A file, at this identity.
    File(Identity),
    /// A snapshot: each entry of it (directories, files, symlinks).
    Snapshot(Vec<SnapshotEntry>),
}

/// An entry of a snapshot, as it was when the snapshot was taken.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SnapshotEntry {
    /// Relative to the snapshot's root; "" is the root.
    pub rel: PathBuf,
    pub identity: Identity,
    /// A directory changed just before it was stamped, so an unchanged identity does
    /// not prove it unchanged: its names are compared too (`snapshot::Taken::racy`).
    pub racy: bool,
}

/// Says why `path` (a bind's target, or the tree of a job's copies) is not bound: a
/// user may own a directory above a watched mount and swap it for a symlink, and no bind
/// is ever made through one; a file gone from the network is routine (debug level);
/// anything else (a server's error, a refused lookup or mount: root squashed on NFS)
/// is the administrator's to see. Users can cause each at will: said a few times a
/// minute.
pub fn say_not_bound(path: &Path, e: &io::Error) {
    match e.raw_os_error() {
        Some(libc::ELOOP) => crate::shared::tally::warn_limited!(
            "bind through a symlink",
            "not binding {}: its path now goes through a symlink ({e}); the job reads the network there",
            path.display()
        ),
        Some(libc::ENOENT) => {
            log::debug!("not binding {}: {e}", path.display());
        }
        _ => crate::shared::tally::warn_limited!(
            "bind failed",
            "not binding {}: {e}; the job reads the network there",
            path.display()
        ),
    }
}

pub(super) fn check(ret: libc::c_long) -> io::Result<libc::c_long> {
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
/// current one, and returns its descriptor. Whatever this thread forks afterwards
/// lives there.
pub fn enter_new_namespace() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; CLONE_FS first, so that this thread alone moves.
    unsafe {
        check(libc::unshare(libc::CLONE_FS).into())?;
        check(libc::unshare(libc::CLONE_NEWNS).into())?;
    }
    make_slave()?;
    this_threads_namespace()
}

/// Moves the calling thread (only it) into the mount namespace of the process `pidfd`
/// names, which must be a namespace of its own: not this daemon's, not the init
/// process's (a bind there would reach every process of the node). Made a slave of its
/// parent again, in case its maker did not, before anything is mounted in it. Returns
/// its descriptor.
pub fn enter_namespace_of(pidfd: &OwnedFd) -> io::Result<OwnedFd> {
    // The init process's may be out of reach (a sandbox's init): then the daemon's own
    // is the node's.
    let node = [
        Some(namespace_id("/proc/self/ns/mnt")?),
        namespace_id("/proc/1/ns/mnt").ok(),
    ];
    // SAFETY: plain syscalls; CLONE_FS first, so that this thread alone moves.
    unsafe {
        check(libc::unshare(libc::CLONE_FS).into())?;
        check(libc::setns(pidfd.as_raw_fd(), libc::CLONE_NEWNS).into())
            .map_err(|e| io::Error::new(e.kind(), format!("setns: {e}")))?;
    }
    let ns = this_threads_namespace()
        .map_err(|e| io::Error::new(e.kind(), format!("/proc/thread-self/ns/mnt: {e}")))?;
    let id = std::fs::File::from(ns.try_clone()?).metadata()?;
    if node.contains(&Some((id.dev(), id.ino()))) {
        return Err(io::Error::other(
            "the process shares the node's mount namespace (make one of its own first: unshare -m)",
        ));
    }
    make_slave().map_err(|e| io::Error::new(e.kind(), format!("making it a slave: {e}")))?;
    Ok(ns)
}

fn namespace_id(path: &str) -> io::Result<(u64, u64)> {
    let m =
        std::fs::metadata(path).map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))?;
    Ok((m.dev(), m.ino()))
}

fn this_threads_namespace() -> io::Result<OwnedFd> {
    Ok(std::fs::File::open("/proc/thread-self/ns/mnt")?.into())
}

/// Makes every mount of this thread's namespace a slave: mounts made here propagate
/// nowhere, the node's mounts (automounts) still arrive.
fn make_slave() -> io::Result<()> {
    // SAFETY: plain syscall with valid arguments.
    unsafe {
        check(
            libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_SLAVE | libc::MS_REC,
                std::ptr::null(),
            )
            .into(),
        )
        .map(drop)
    }
}

/// Binds `b.local` read-only, nosuid, nodev over `b.target`; for a lazy snapshot, the
/// overlay of `b.local` over the network directory. Returns the mount bound (a lazy
/// overlay's: the daemon tells the kernel side to place files under its root; any bind's:
/// its opens may be reported, `bind_opens`). A target root may not
/// look up is looked up again as `user` (the job's) where given: root may be squashed
/// on the network, and not even search the user's private directory.
pub fn bind_read_only(b: &Bind, user: Option<&User>) -> io::Result<OwnedFd> {
    let local = cstr(&b.local)?;
    // Opened before anything is mounted over it: the network directory itself.
    let target = match (open_target(b), user) {
        (Err(e), Some(user)) if matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM)) => {
            let _as_user = AsUser::take(user)?;
            open_target(b)?
        }
        (target, _) => target?,
    };
    // SAFETY: valid C strings and struct pointers; descriptors are owned on success.
    unsafe {
        let source = if b.lazy {
            let meta = check(
                libc::open(
                    local.as_ptr(),
                    libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                )
                .into(),
            )?;
            lazy_overlay(&OwnedFd::from_raw_fd(meta as i32), &target)?
        } else {
            read_only_clone(&local)?
        };
        move_mount(&source, &target)?;
        if let Err(e) = show_passages(b, &target, &source) {
            // All or nothing: without its passages the overlay would show empty
            // directories where the network has files.
            let _ = detach(&source);
            return Err(io::Error::new(
                e.kind(),
                format!(
                    "showing the network's directories in {}: {e}",
                    b.target.display()
                ),
            ));
        }
        Ok(source)
    }
}

/// A detached clone of the mount tree at `local` (in the root-only cache), read-only,
/// nosuid and nodev before anything can see it.
fn read_only_clone(local: &CStr) -> io::Result<OwnedFd> {
    if kernel::forced("mount-setattr") {
        return read_only_clone_by_remount(local);
    }
    let source = clone_tree(libc::AT_FDCWD, local, libc::AT_SYMLINK_NOFOLLOW)?;
    match set_read_only(&source) {
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
            drop(source);
            read_only_clone_by_remount(local)
        }
        done => done.map(|()| source),
    }
}

/// `mount_setattr` (5.12) of a detached mount: read-only, nosuid, nodev.
fn set_read_only(mount: &OwnedFd) -> io::Result<()> {
    let attr = MountAttr {
        attr_set: libc::MOUNT_ATTR_RDONLY | libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: a valid descriptor, an empty C string and the struct with its size.
    check(unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            mount.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            size_of::<MountAttr>(),
        )
    })
    .map(drop)
}

/// The same without `mount_setattr` (before 5.12): `local` is bound over itself in this
/// thread's namespace, remounted read-only, cloned (a clone keeps the flags), and the
/// bind taken away again. Only root reaches the cache, and no process of the job runs
/// yet: nothing sees the bind while it is writable.
fn read_only_clone_by_remount(local: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: valid C strings; null for what a bind and a remount do not take.
    unsafe {
        let (no_fs, no_data) = (std::ptr::null(), std::ptr::null());
        let bind = libc::mount(
            local.as_ptr(),
            local.as_ptr(),
            no_fs,
            libc::MS_BIND,
            no_data,
        );
        check(bind.into())?;
        let flags =
            libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV;
        let clone = check(libc::mount(no_fs, local.as_ptr(), no_fs, flags, no_data).into())
            .and_then(|_| clone_tree(libc::AT_FDCWD, local, libc::AT_SYMLINK_NOFOLLOW));
        let _ = libc::umount2(local.as_ptr(), libc::MNT_DETACH);
        clone
    }
}

/// How read-only binds are made on this kernel: `mount_setattr` on the detached clone,
/// or a read-only remount before it is cloned (before 5.12).
pub fn read_only_route() -> Route {
    // A bad descriptor: EBADF where the syscall exists.
    // SAFETY: the kernel checks the descriptor first; nothing is read.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            -1,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            std::ptr::null::<MountAttr>(),
            0,
        )
    };
    let missing = ret < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS);
    if missing || kernel::forced("mount-setattr") {
        let why = kernel::why("mount-setattr", "no mount_setattr: before 5.12");
        kernel::route(
            "read-only binds",
            format!(
                "bound over themselves in the job's namespace, remounted read-only, then cloned ({why})"
            ),
            true,
        )
    } else {
        kernel::route(
            "read-only binds",
            "cloned, then made read-only before they are attached (mount_setattr)",
            false,
        )
    }
}

/// Attaches the detached mount `source` over the directory `target`.
fn move_mount(source: &OwnedFd, target: &OwnedFd) -> io::Result<()> {
    // SAFETY: valid descriptors and empty C strings.
    check(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            source.as_raw_fd(),
            c"".as_ptr(),
            target.as_raw_fd(),
            c"".as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH | libc::MOVE_MOUNT_T_EMPTY_PATH,
        )
    })
    .map(drop)
}

/// Shows each passage of a snapshot (a directory no job used, left out of it) as the
/// network shows it: the directory beneath `network` (the network directory the overlay
/// was mounted over, opened before: a descriptor sees beneath what covers it) bound over
/// the overlay's empty one beneath `overlay` (the overlay's mount). The bind keeps the network
/// mount's own flags: a job reads and writes there what it would without hocus, and
/// nothing it writes lands in the cache. Neither path follows a symlink. A passage's
/// lookup is a round trip when the node has forgotten the directory (a page-cache
/// drop): hundreds of them are looked up by several threads at once, then mounted.
fn show_passages(b: &Bind, network: &OwnedFd, overlay: &OwnedFd) -> io::Result<()> {
    let dir = libc::O_PATH | libc::O_DIRECTORY;
    let clones: Vec<io::Result<OwnedFd>> = in_parallel(&b.passages, |rel| {
        let _asking = Asking::begin(&b.tree, Purpose::JobStart);
        asked::asked();
        let from = beneath(network, rel, dir)?;
        clone_tree(
            from.as_raw_fd(),
            c"",
            libc::AT_EMPTY_PATH | libc::AT_RECURSIVE,
        )
    });
    for (rel, clone) in b.passages.iter().zip(clones) {
        move_mount(&clone?, &beneath(overlay, rel, dir)?)?;
    }
    Ok(())
}

/// A detached copy of the mount tree at `path` (from `dir`): `open_tree(libc::OPEN_TREE_CLONE)`
/// with `flags` (`AT_*`).
fn clone_tree(dir: libc::c_int, path: &CStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: a valid descriptor (or AT_FDCWD) and C string; owned on success.
    unsafe {
        let fd = check(libc::syscall(
            libc::SYS_open_tree,
            dir,
            path.as_ptr(),
            libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC | flags as libc::c_uint,
        ))?;
        Ok(OwnedFd::from_raw_fd(fd as i32))
    }
}

/// `rel` opened beneath `dir` with `flags`, following no symlink.
fn beneath(dir: &OwnedFd, rel: &Path, flags: libc::c_int) -> io::Result<OwnedFd> {
    dirs::open_beneath(dir, rel, flags)
}

/// Threads looking up passages at once: round trips in flight, as the snapshot's walk.
const LOOKUPS: usize = 16;

/// `f` of each item, by up to `LOOKUPS` threads, in the items' order.
fn in_parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    if items.len() < 2 {
        return items.iter().map(f).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let out: Vec<std::sync::Mutex<Option<R>>> = items.iter().map(|_| Default::default()).collect();
    std::thread::scope(|s| {
        for _ in 0..LOOKUPS.min(items.len()) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(item) = items.get(i) else { break };
                    *out[i].lock().unwrap() = Some(f(item));
                }
            });
        }
    });
    out.into_iter()
        .map(|r| r.into_inner().unwrap().expect("every item was done"))
        .collect()
}

/// A detached, read-only, nosuid, nodev overlay of `meta` (a lazy snapshot's local tree:
/// directories, symlinks, hot files, and cold files as metacopy stubs redirecting to
/// their path in `data`) over `data` (the network directory) as a data-only layer
/// (Linux 6.5; layers given as descriptors, 6.13). Names, attributes, listings and failed
/// lookups come from `meta` alone; only a cold file's bytes come from `data`, when read.
/// Both layers are descriptors opened without following a symlink.
pub fn lazy_overlay(meta: &OwnedFd, data: &OwnedFd) -> io::Result<OwnedFd> {
    // SAFETY: plain syscalls with valid C strings; descriptors owned on success.
    unsafe {
        let fs = check(libc::syscall(
            libc::SYS_fsopen,
            c"overlay".as_ptr(),
            libc::FSOPEN_CLOEXEC,
        ))?;
        let fs = OwnedFd::from_raw_fd(fs as i32);
        let config = |cmd: libc::c_uint, key: &CStr, value: *const libc::c_char, fd: i32| {
            check(libc::syscall(
                libc::SYS_fsconfig,
                fs.as_raw_fd(),
                cmd,
                key.as_ptr(),
                value,
                fd,
            ))
            .map_err(|e| io::Error::new(e.kind(), format!("overlay {key:?}: {e}")))
        };
        config(
            libc::FSCONFIG_SET_FD,
            c"lowerdir+",
            std::ptr::null(),
            meta.as_raw_fd(),
        )?;
        config(
            libc::FSCONFIG_SET_FD,
            c"datadir+",
            std::ptr::null(),
            data.as_raw_fd(),
        )?;
        // Metacopy stubs and their redirects are what make the layer lazy; they are
        // trusted only in `meta`, which only root can write.
        config(libc::FSCONFIG_SET_STRING, c"metacopy", c"on".as_ptr(), 0)?;
        config(
            libc::FSCONFIG_SET_STRING,
            c"redirect_dir",
            c"follow".as_ptr(),
            0,
        )?;
        check(libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            libc::FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_char>(),
            0,
        ))
        .map_err(|e| io::Error::new(e.kind(), format!("overlay: {e}")))?;
        let mnt = check(libc::syscall(
            libc::SYS_fsmount,
            fs.as_raw_fd(),
            libc::FSMOUNT_CLOEXEC,
            (libc::MOUNT_ATTR_RDONLY | libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV)
                as libc::c_uint,
        ))?;
        Ok(OwnedFd::from_raw_fd(mnt as i32))
    }
}

/// Whether this kernel shows lazy snapshots: a stub and its file in `tmp` are put
/// together by [`lazy_overlay`] and read back through it (the overlay is never attached).
pub fn lazy_overlays_work(tmp: &Path) -> io::Result<()> {
    let dir = tmp.join(format!("lazy-probe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (meta, data) = (dir.join("meta"), dir.join("data"));
    let result = (|| {
        std::fs::create_dir_all(&meta)?;
        std::fs::create_dir_all(&data)?;
        std::fs::write(data.join("f"), b"read through the overlay")?;
        let file = std::fs::File::open(data.join("f"))?;
        let m = nix::sys::stat::fstat(file.as_raw_fd())?;
        crate::cache::snapshot::write_stub(
            &OwnedFd::from(file),
            Path::new("f"),
            &meta.join("f"),
            &m,
        )?;
        let open_dir =
            |p: &Path| -> io::Result<OwnedFd> { Ok(OwnedFd::from(std::fs::File::open(p)?)) };
        let overlay = lazy_overlay(&open_dir(&meta)?, &open_dir(&data)?)?;
        // SAFETY: a valid descriptor and C string; owned on success.
        let f = unsafe {
            let fd = check(
                libc::openat(
                    overlay.as_raw_fd(),
                    c"f".as_ptr(),
                    libc::O_RDONLY | libc::O_CLOEXEC,
                )
                .into(),
            )?;
            std::fs::File::from(OwnedFd::from_raw_fd(fd as i32))
        };
        let got = std::io::read_to_string(f)?;
        if got != "read through the overlay" {
            return Err(io::Error::other(format!("the overlay read back {got:?}")));
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn open_target(b: &Bind) -> io::Result<OwnedFd> {
    // The tree's own path goes through no symlink either: a watched mount may lie in a
    // directory its user owns, swapped for a symlink since (a mount of their own).
    // Two operations: the tree, then the target beneath it.
    let _asking = Asking::begin(&b.tree, Purpose::JobStart);
    asked::asked();
    let tree_fd = dirs::open_dir(&b.tree)?;
    asked::asked();
    let rel = b.target.strip_prefix(&b.tree).map_err(|_| {
        io::Error::other(format!(
            "{} is not inside {}",
            b.target.display(),
            b.tree.display()
        ))
    })?;
    beneath(&tree_fd, rel, libc::O_PATH)
}

/// Detaches mounts at `targets` inside the mount namespace `ns` (a /proc/PID/ns/mnt
/// descriptor), from a short-lived thread of this process. Returns how many went.
pub fn detach_in(ns: &OwnedFd, targets: &[PathBuf]) -> io::Result<usize> {
    let ns = ns.try_clone()?;
    let targets = targets.to_vec();
    std::thread::Builder::new()
        .name("hocus-detach".into())
        .spawn(move || -> io::Result<usize> {
            // SAFETY: plain syscalls on this thread, which ends right after.
            unsafe {
                check(libc::unshare(libc::CLONE_FS).into())?;
                check(libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS).into())?;
            }
            Ok(detach_here(&targets))
        })?
        .join()
        .map_err(|_| io::Error::other("the detaching thread panicked"))?
}

/// Detaches the mounts at `targets` in the calling thread's mount namespace; returns how
/// many went. Each is opened first without following a symlink: one swapped in on the
/// way since the bind was made must not take away a mount elsewhere.
fn detach_here(targets: &[PathBuf]) -> usize {
    targets
        .iter()
        .filter_map(|t| dirs::openat2(libc::AT_FDCWD, t, libc::O_PATH, dirs::NO_SYMLINKS).ok())
        .filter(|mount| detach(mount).is_ok())
        .count()
}

/// Detaches the mount whose root `mount` (a descriptor) names, through its magic link.
fn detach(mount: &OwnedFd) -> io::Result<()> {
    let at = dirs::magic_link(mount);
    // SAFETY: a valid C string.
    check(unsafe { libc::umount2(at.as_ptr(), libc::MNT_DETACH) }.into()).map(drop)
}

/// Takes `binds` (made by this thread, in its namespace) away again.
pub fn unbind_here(binds: &[Bind]) -> usize {
    let targets: Vec<PathBuf> = binds.iter().map(|b| b.target.clone()).collect();
    detach_here(&targets)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On this kernel (CI's too) a lazy overlay is put together and read through; run as
    /// root, as the daemon is.
    #[test]
    fn a_lazy_overlay_reads_a_stubs_bytes_from_the_data_layer() {
        let dir = tempfile::tempdir().unwrap();
        lazy_overlays_work(dir.path()).unwrap();
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "cleaned up"
        );
    }

    /// A snapshot's passage is the network directory itself, bound over the overlay's
    /// empty one; one swapped for a symlink is refused, and then nothing of the overlay
    /// stays mounted. Real mounts, in a namespace of a thread of its own.
    #[test]
    fn passages_show_the_network_directory_and_a_symlink_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (tree, meta) = (dir.path().join("tree"), dir.path().join("meta"));
        let net = tree.join("env");
        for d in [net.join("used"), net.join("unused"), meta.join("used")] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(net.join("used/a"), b"network").unwrap();
        std::fs::write(net.join("unused/b"), b"network").unwrap();
        std::fs::write(meta.join("used/a"), b"snapshot").unwrap();
        std::fs::create_dir(meta.join("unused")).unwrap();
        std::fs::create_dir(meta.join("link")).unwrap();
        std::os::unix::fs::symlink("unused", net.join("link")).unwrap();
        let bind = |passages: &[&str]| Bind {
            local: meta.clone(),
            target: net.clone(),
            tree: tree.clone(),
            expect: Expect::Nothing,
            lazy: false,
            passages: passages.iter().map(PathBuf::from).collect(),
        };
        let (good, swapped) = (bind(&["unused"]), bind(&["unused", "link"]));
        let net2 = net.clone();
        std::thread::spawn(move || {
            enter_new_namespace().unwrap();
            let read = |p: &str| std::fs::read_to_string(net2.join(p)).unwrap();
            let err = bind_read_only(&swapped, None).unwrap_err();
            assert!(err.to_string().contains("showing the network's"), "{err}");
            assert_eq!(read("used/a"), "network", "the overlay stayed mounted");
            bind_read_only(&good, None).unwrap();
            assert_eq!(read("used/a"), "snapshot");
            assert_eq!(read("unused/b"), "network");
            // The passage is the network's, writable as it is there; the rest is not.
            std::fs::write(net2.join("unused/new"), b"").unwrap();
            assert!(std::fs::write(net2.join("used/new"), b"").is_err());
        })
        .join()
        .unwrap();
        assert!(
            net.join("unused/new").exists(),
            "the write reached the network"
        );
    }

    /// A mount is taken away by its path only if the path goes through no symlink: a
    /// directory on it swapped for one since the bind was made must not lead the
    /// detach to a mount elsewhere.
    #[test]
    fn a_detach_through_a_symlink_takes_nothing_away() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::create_dir_all(real.join("x")).unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("link")).unwrap();
        let (through_link, direct) = (dir.path().join("link/x"), real.join("x"));
        std::thread::spawn(move || {
            enter_new_namespace().unwrap();
            let target = cstr(&direct).unwrap();
            // SAFETY: valid C strings.
            let mounted = unsafe {
                libc::mount(
                    c"none".as_ptr(),
                    target.as_ptr(),
                    c"tmpfs".as_ptr(),
                    0,
                    std::ptr::null(),
                )
            };
            assert_eq!(mounted, 0, "{}", io::Error::last_os_error());
            let is_mounted = || {
                std::fs::read_to_string("/proc/thread-self/mountinfo")
                    .unwrap()
                    .lines()
                    .any(|l| l.split(' ').nth(4) == direct.to_str())
            };
            assert!(is_mounted());
            assert_eq!(detach_here(std::slice::from_ref(&through_link)), 0);
            assert!(is_mounted(), "detached through the symlink");
            assert_eq!(detach_here(std::slice::from_ref(&direct)), 1);
            assert!(!is_mounted());
        })
        .join()
        .unwrap();
    }
}
