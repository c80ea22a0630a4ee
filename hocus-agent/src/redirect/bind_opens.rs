//! Opens made through a job's binds, told by fanotify: a mark on each bind's mount
//! reports every open made through that mount (whoever opens, by whatever path), and
//! nothing else on the node. This is how a Slurm task's hits are counted, and its
//! Slurm job's own profile learns them, while the tracer rests (docs/overhead.md): the
//! marks cost only the opens through the marked mounts, where the tracer costs every
//! syscall on the node.
//!
//! What the marks do not see: a container that binds the tree again inside the job
//! makes mounts of its own (clones carry no marks), so opens through them are not seen
//! while the tracer rests; reads and failed lookups are not reported either (opens are
//! what a profile's prefetch needs).

use std::{
    ffi::OsStr,
    io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use super::mountns::check;
use crate::shared::{
    dirs, fanotify,
    kernel::{self, Route},
};

/// The group for this daemon, and the way Slurm tasks' hits are seen while the tracer
/// rests: reported by fanotify, or (a kernel without it, or `HOCUS_FALLBACKS=bind-opens`)
/// not at all, so that the tracer follows them all along.
pub fn start() -> (Option<Arc<BindOpens>>, Route) {
    const PART: &str = "Slurm jobs' own profiles while the tracer rests";
    let made = if kernel::forced("bind-opens") {
        Err(io::Error::other(kernel::why("bind-opens", "")))
    } else {
        BindOpens::new()
    };
    match made {
        Ok(opens) => {
            let way = "opens through each task's binds reported by fanotify (mount marks): the tracer rests while its requests all hit";
            (Some(Arc::new(opens)), kernel::route(PART, way, false))
        }
        Err(e) => {
            let way = format!(
                "followed: opens through binds cannot be reported ({e}); the tracer does not rest while a Slurm task runs"
            );
            (None, kernel::route(PART, way, true))
        }
    }
}

/// Mounts marked at once, over all jobs (the group is made with `FAN_UNLIMITED_MARKS`,
/// so this is the bound): a task whose binds would pass it is followed by the tracer.
pub const MAX_MARKS: usize = 200_000;

/// One fanotify group for all jobs' binds; an open is told apart by its mount's id.
#[derive(Debug)]
pub struct BindOpens {
    group: OwnedFd,
    marks: AtomicUsize,
}

/// An open through a marked mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opened {
    /// The id of the mount it was made through (`statx`'s `stx_mnt_id`).
    pub mount: u64,
    /// The file, as the job sees it: the network path the bind sits on.
    pub path: PathBuf,
    pub pid: u32,
}

/// What one read of the group found.
#[derive(Debug, Default)]
pub struct Read {
    pub opens: Vec<Opened>,
    /// The kernel's queue overflowed: opens were lost.
    pub overflowed: bool,
}

impl BindOpens {
    /// A group of its own. Fails where the kernel lacks fanotify or `statx`'s mount
    /// ids (before 5.8): jobs are then followed by the tracer.
    pub fn new() -> io::Result<Self> {
        let flags = libc::FAN_CLASS_NOTIF
            | libc::FAN_CLOEXEC
            | libc::FAN_NONBLOCK
            | libc::FAN_UNLIMITED_MARKS;
        let event_flags = libc::O_RDONLY | libc::O_CLOEXEC | libc::O_LARGEFILE;
        // SAFETY: plain flags; the descriptor is owned on success.
        let fd = check(unsafe { libc::fanotify_init(flags, event_flags as libc::c_uint) }.into())?;
        // SAFETY: a descriptor just made, owned by nothing else.
        let group = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        mount_id(group.as_raw_fd())?;
        Ok(Self {
            group,
            marks: AtomicUsize::new(0),
        })
    }

    /// Marks `mount` (a bind's, as `open_tree` or `fsmount` gave it): opens through it
    /// are reported. Returns its id.
    pub fn mark(&self, mount: &OwnedFd) -> io::Result<u64> {
        if self.marks.fetch_add(1, Ordering::Relaxed) >= MAX_MARKS {
            self.marks.fetch_sub(1, Ordering::Relaxed);
            return Err(io::Error::other(format!(
                "{MAX_MARKS} mounts are marked already"
            )));
        }
        let flags = libc::FAN_MARK_ADD | libc::FAN_MARK_MOUNT;
        // The mount's descriptor is an O_PATH one, which fanotify_mark does not take as
        // its object: its magic link in /proc names the same mount and root.
        let link = dirs::magic_link(mount);
        // SAFETY: a valid descriptor and C string.
        let marked = check(
            unsafe {
                libc::fanotify_mark(
                    self.group.as_raw_fd(),
                    flags,
                    libc::FAN_OPEN,
                    libc::AT_FDCWD,
                    link.as_ptr(),
                )
            }
            .into(),
        );
        match marked.and_then(|_| mount_id(mount.as_raw_fd())) {
            Ok(id) => Ok(id),
            Err(e) => {
                self.marks.fetch_sub(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// `n` marked mounts are gone (their job ended).
    pub fn forget(&self, n: usize) {
        let _ = self
            .marks
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |m| {
                Some(m.saturating_sub(n))
            });
    }

    /// The mounts marked now.
    #[cfg(test)]
    pub fn marked(&self) -> usize {
        self.marks.load(Ordering::Relaxed)
    }

    /// Reads what is queued, without waiting; `Ok` with nothing when the queue is empty.
    /// At most `max` opens per call, so one call never holds its caller long.
    pub fn read(&self, max: usize) -> io::Result<Read> {
        let mut out = Read::default();
        // Each event read carries a descriptor the kernel installs in this process: at
        // most ~170 at a time (24 bytes an event), closed before the next read, far
        // below any limit on open files (an event whose descriptor cannot be made is
        // lost).
        let mut buf = vec![0u8; 4096];
        while out.opens.len() < max {
            // SAFETY: a buffer of its own length.
            let n =
                unsafe { libc::read(self.group.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.raw_os_error() {
                    Some(libc::EAGAIN) => Ok(out),
                    Some(libc::EINTR) => continue,
                    _ => Err(e),
                };
            }
            if n == 0 {
                return Ok(out);
            }
            events(&buf[..n as usize], &mut out);
        }
        Ok(out)
    }
}

/// The events in `buf` (whole ones: the kernel never splits one): each carries a
/// descriptor of the opened file, closed here.
fn events(buf: &[u8], out: &mut Read) {
    for (m, _) in fanotify::events(buf) {
        if m.mask & libc::FAN_Q_OVERFLOW != 0 {
            out.overflowed = true;
        }
        if m.fd < 0 {
            continue;
        }
        // SAFETY: the kernel installed this descriptor for us.
        let file = unsafe { OwnedFd::from_raw_fd(m.fd) };
        if m.pid < 0 || m.vers != libc::FANOTIFY_METADATA_VERSION {
            continue;
        }
        if let Some(opened) = opened(&file, m.pid as u32) {
            out.opens.push(opened);
        }
    }
}

/// The mount and path of an opened file. Its path, read from /proc, is the one the
/// job sees, up to its namespace's root: a bind sits on the network path it serves.
fn opened(file: &OwnedFd, pid: u32) -> Option<Opened> {
    let mount = mount_id(file.as_raw_fd()).ok()?;
    let link = dirs::magic_link(file);
    let path = std::fs::read_link(Path::new(OsStr::from_bytes(link.as_bytes()))).ok()?;
    // A file unlinked since (a copy dropped) says so: it names no network file now.
    if !path.is_absolute() || path.as_os_str().as_bytes().ends_with(b" (deleted)") {
        return None;
    }
    Some(Opened { mount, path, pid })
}

/// The id of the mount `fd` lies on (`statx`'s `STATX_MNT_ID`, 5.8).
fn mount_id(fd: RawFd) -> io::Result<u64> {
    // SAFETY: zeroed is a valid statx.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor, an empty C string with AT_EMPTY_PATH, a struct to fill.
    check(
        unsafe {
            libc::statx(
                fd,
                c"".as_ptr(),
                libc::AT_EMPTY_PATH,
                libc::STATX_MNT_ID,
                &mut stx,
            )
        }
        .into(),
    )?;
    if stx.stx_mask & libc::STATX_MNT_ID == 0 {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this kernel does not tell a file's mount (statx's STATX_MNT_ID, 5.8)",
        ));
    }
    Ok(stx.stx_mnt_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redirect::mountns::{Bind, Expect, bind_read_only, enter_new_namespace};
    use std::fs;

    /// Makes `bind` as a job's are, in a namespace of a thread of its own, marks its
    /// mount, runs `open` there, and returns the mount's id and what the group read.
    fn opened_through(bind: Bind, open: impl FnOnce(&Bind) + Send + 'static) -> (u64, Read) {
        std::thread::spawn(move || {
            enter_new_namespace().unwrap();
            let opens = BindOpens::new().unwrap();
            let mount = bind_read_only(&bind, None).unwrap();
            let id = opens.mark(&mount).unwrap();
            assert_eq!(opens.marked(), 1);
            open(&bind);
            (id, opens.read(100).unwrap())
        })
        .join()
        .unwrap()
    }

    /// A real bind, its mount marked: an open through it is reported with its path and
    /// mount; the copy opened by its own path and a file beside it are not. Run as root,
    /// as the daemon is.
    #[test]
    fn an_open_through_a_marked_bind_is_reported_and_one_beside_it_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        fs::create_dir(&tree).unwrap();
        let (copy, target, other) = (
            dir.path().join("copy"),
            tree.join("target"),
            tree.join("other"),
        );
        for (p, text) in [(&copy, "local"), (&target, "network"), (&other, "x")] {
            fs::write(p, text).unwrap();
        }
        let bind = Bind {
            local: copy.clone(),
            target: target.clone(),
            tree,
            expect: Expect::Nothing,
            lazy: false,
            passages: Vec::new(),
        };
        let (id, read) = opened_through(bind, move |bind| {
            assert_eq!(fs::read_to_string(&bind.target).unwrap(), "local");
            fs::read_to_string(&copy).unwrap();
            fs::read_to_string(&other).unwrap();
        });
        assert!(!read.overflowed);
        assert_eq!(read.opens.len(), 1, "{:?}", read.opens);
        assert_eq!(read.opens[0].mount, id);
        assert_eq!(read.opens[0].path, target);
        assert_eq!(read.opens[0].pid, std::process::id());
    }

    /// A lazy snapshot's overlay (an overlay: a hot file's bytes local, a cold one's read
    /// from the network layer) is marked as one mount: opens of both are reported with
    /// their network paths. Needs lazy overlays (6.13; this machine's kernel and CI's).
    #[test]
    fn opens_in_a_lazy_snapshot_s_overlay_are_reported_by_its_network_paths() {
        let dir = tempfile::tempdir().unwrap();
        let (tree, meta) = (dir.path().join("tree"), dir.path().join("meta"));
        let net = tree.join("env");
        fs::create_dir_all(&net).unwrap();
        fs::create_dir_all(&meta).unwrap();
        fs::write(net.join("cold"), "network bytes").unwrap();
        fs::write(net.join("hot"), "network").unwrap();
        fs::write(meta.join("hot"), "local").unwrap();
        let cold = fs::File::open(net.join("cold")).unwrap();
        let m = nix::sys::stat::fstat(cold.as_raw_fd()).unwrap();
        crate::cache::snapshot::write_stub(
            &OwnedFd::from(cold),
            std::path::Path::new("cold"),
            &meta.join("cold"),
            &m,
        )
        .unwrap();
        let bind = Bind {
            local: meta,
            target: net.clone(),
            tree,
            expect: Expect::Nothing,
            lazy: true,
            passages: Vec::new(),
        };
        let (id, read) = opened_through(bind, |bind| {
            assert_eq!(
                fs::read_to_string(bind.target.join("hot")).unwrap(),
                "local"
            );
            assert_eq!(
                fs::read_to_string(bind.target.join("cold")).unwrap(),
                "network bytes"
            );
        });
        let paths: Vec<_> = read.opens.iter().map(|o| o.path.clone()).collect();
        assert_eq!(paths, [net.join("hot"), net.join("cold")]);
        assert!(read.opens.iter().all(|o| o.mount == id));
    }

    #[test]
    fn the_bound_on_marks_holds() {
        let opens = BindOpens::new().unwrap();
        opens.marks.store(MAX_MARKS, Ordering::Relaxed);
        let dir = tempfile::tempdir().unwrap();
        let fd: OwnedFd = fs::File::open(dir.path()).unwrap().into();
        assert!(opens.mark(&fd).is_err());
        assert_eq!(opens.marked(), MAX_MARKS);
        opens.forget(MAX_MARKS + 5);
        assert_eq!(opens.marked(), 0);
    }
}
