//! Who a caller is, read without races. The socket gives the caller's uid and gid and a
//! pidfd of the very process that connected (`SO_PEERCRED`, `SO_PEERPIDFD`). Its
//! `/proc/<pid>` is opened as a directory and the pidfd is then checked still alive: the
//! directory is that process's, not one that took its pid later, and reads through it
//! fail once the process is gone. Its credentials there must still be the socket's (no
//! setuid program exec'd since), and it must be confined no more than the daemon can
//! reproduce (no seccomp filter, the daemon's namespaces). A caller that fails any of
//! this is refused with a message that says why.

use std::{
    fs::File,
    io::{self, Read},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::{ffi::OsStringExt, net::UnixStream},
    },
    sync::Arc,
};

use nix::{
    fcntl::{OFlag, open, openat, readlinkat},
    sys::stat::Mode,
};

use crate::shared::kernel::{self, Route};

/// What a job inherits from its caller, read from its `/proc` entry.
#[derive(Debug, Clone, Default)]
pub struct Process {
    pub groups: Vec<u32>,
    pub umask: libc::mode_t,
    /// `/proc/PID/limits`, as text.
    pub limits: String,
    /// `/proc/PID/cgroup`, as text.
    pub cgroup: String,
    /// The caller runs with no_new_privs: its job must too.
    pub no_new_privs: bool,
}

/// The namespaces a caller must share with the daemon: in any other (a container, an
/// unprivileged user namespace) its paths and its confinement are not the daemon's.
const NAMESPACES: [&str; 6] = ["user", "mnt", "pid", "net", "ipc", "uts"];

/// The pidfd of the process at the other end of a Unix socket (Linux 6.5+).
pub fn peer_pidfd(socket: RawFd) -> io::Result<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: an int-sized option into an int, with its length.
    let rc = unsafe {
        libc::getsockopt(
            socket,
            libc::SOL_SOCKET,
            libc::SO_PEERPIDFD,
            (&raw mut fd).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel gave us this descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The process at the other end of a Unix socket, pinned by a pidfd: the socket's own
/// (`SO_PEERPIDFD`), else one of its pid taken now (before 6.5, or with the
/// `peer-pidfd` fallback): then the process may have exited since it connected and its
/// pid been given to another, which `read` refuses unless it has the socket's
/// credentials and namespaces (docs/security.md). None if the process is gone.
pub fn caller_pidfd(socket: RawFd, pid: i32) -> Option<OwnedFd> {
    if !kernel::forced("peer-pidfd") {
        if let Ok(fd) = peer_pidfd(socket) {
            return Some(fd);
        }
    }
    pidfd_open(pid).ok()
}

fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// The way callers are known on this kernel: by the pidfd the socket hands out
/// (`SO_PEERPIDFD`, 6.5), or by their pid, pinned with a pidfd taken as the request is
/// read (docs/security.md says what that leaves).
pub fn route() -> Route {
    const PART: &str = "who a caller is";
    let works = !kernel::forced("peer-pidfd")
        && UnixStream::pair().is_ok_and(|(a, _b)| peer_pidfd(a.as_raw_fd()).is_ok());
    if works {
        kernel::route(
            PART,
            "the socket's credentials and pidfd (SO_PEERPIDFD)",
            false,
        )
    } else {
        let why = kernel::why("peer-pidfd", "no SO_PEERPIDFD: before 6.5");
        kernel::route(
            PART,
            format!(
                "the socket's credentials, and a pidfd of their pid taken as the connection is accepted ({why})"
            ),
            true,
        )
    }
}

/// Whether the process of `pidfd` is still alive (not yet exited).
fn alive(pidfd: &OwnedFd) -> bool {
    // SAFETY: signal 0 checks without sending; no siginfo.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        ) == 0
    }
}

fn open_dir(path: &str) -> io::Result<OwnedFd> {
    let fd = open(
        path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    // SAFETY: a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn read_at(dir: &OwnedFd, name: &str) -> io::Result<String> {
    let fd = openat(
        Some(dir.as_raw_fd()),
        name,
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    // SAFETY: a new descriptor we own.
    let mut file = unsafe { File::from_raw_fd(fd) };
    let mut text = String::new();
    file.read_to_string(&mut text)?;
    Ok(text)
}

fn link_at(dir: &OwnedFd, name: &str) -> io::Result<Vec<u8>> {
    Ok(readlinkat(Some(dir.as_raw_fd()), name)?.into_vec())
}

/// The four ids of a `Uid:` or `Gid:` line of /proc/PID/status (real, effective, saved,
/// filesystem).
fn ids(status: &str, key: &str) -> Vec<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect()
}

fn field<'a>(status: &'a str, key: &str) -> Option<&'a str> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .map(str::trim)
}

/// What the caller is checked for: a job must be given the caller's confinement, so a
/// confinement the daemon cannot reproduce refuses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum For {
    Request,
    Job,
}

/// Refuses a caller whose confinement a job cannot have: a seccomp filter, or another
/// namespace than the daemon's.
fn confinement(dir: &OwnedFd, status: &str) -> Result<(), String> {
    if field(status, "Seccomp:").is_some_and(|v| v != "0") {
        return Err(
            "your process runs under a seccomp filter, which hocus cannot give its job: \
             run the command without hocus-agent run"
                .into(),
        );
    }
    for ns in NAMESPACES {
        let theirs = link_at(dir, &format!("ns/{ns}"))
            .map_err(|e| format!("reading your process's {ns} namespace: {e}"))?;
        let ours = std::fs::read_link(format!("/proc/self/ns/{ns}"))
            .map_err(|e| format!("reading the daemon's own {ns} namespace: {e}"))?;
        if theirs != ours.as_os_str().as_encoded_bytes() {
            return Err(format!(
                "your process is in another {ns} namespace than the daemon's (a container?): \
                 run the command there without hocus-agent run"
            ));
        }
    }
    Ok(())
}

/// Reads what a job inherits from the caller `pid` (`pidfd` from the socket), checking
/// that it is still the process that connected, with the socket's `uid` and `gid`, and,
/// for a job, confined no more than the job can be. `Err` is the message for the caller.
pub fn read(
    pidfd: Option<&Arc<OwnedFd>>,
    pid: i32,
    uid: u32,
    gid: u32,
    purpose: For,
) -> Result<Process, String> {
    let gone = || "your process exited before the daemon could read who it is".to_owned();
    let dir = open_dir(&format!("/proc/{pid}")).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOENT) | Some(libc::ESRCH) => gone(),
        // Out of descriptors, say: the caller is not to blame, and may try again.
        _ => format!("the daemon cannot read who your process is now ({e}); try again"),
    })?;
    // The directory was opened while the connecting process lived: it is that process's.
    let pinned = pidfd.is_some_and(|fd| alive(fd));
    if !pinned {
        return Err(gone());
    }
    let status = read_at(&dir, "status").map_err(|_| gone())?;
    let (uids, gids) = (ids(&status, "Uid:"), ids(&status, "Gid:"));
    if uids.len() != 4
        || uids.iter().any(|u| *u != uid)
        || gids.len() != 4
        || gids.iter().any(|g| *g != gid)
    {
        return Err(format!(
            "your process's identity changed since it connected (uids {uids:?}, gids {gids:?}, \
             the socket says {uid}/{gid}): a setuid program cannot ask for jobs"
        ));
    }
    if purpose == For::Job {
        confinement(&dir, &status)?;
    }
    let groups = field(&status, "Groups:")
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|g| g.parse().ok())
        .collect();
    let umask = field(&status, "Umask:")
        .and_then(|v| libc::mode_t::from_str_radix(v, 8).ok())
        .ok_or_else(|| "no Umask in /proc/PID/status".to_owned())?;
    let no_new_privs = field(&status, "NoNewPrivs:") == Some("1");
    let limits = read_at(&dir, "limits").map_err(|_| gone())?;
    let cgroup = read_at(&dir, "cgroup").map_err(|_| gone())?;
    // Read through a directory of a process that may have died meanwhile: still alive now,
    // so everything above was its.
    if !pidfd.is_none_or(|fd| alive(fd)) {
        return Err(gone());
    }
    Ok(Process {
        groups,
        umask,
        limits,
        cgroup,
        no_new_privs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process_and_its_identity() {
        let pid = std::process::id() as i32;
        // SAFETY: plain id queries.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let me = Arc::new(pidfd_open(pid).unwrap());
        let p = read(Some(&me), pid, uid, gid, For::Job).unwrap();
        assert!(p.limits.contains("Max locked memory"));
        assert!(!p.cgroup.is_empty());
        assert!(
            read(Some(&me), pid, uid + 1, gid, For::Request)
                .unwrap_err()
                .contains("identity changed")
        );
        // No pidfd: the process is gone (`caller_pidfd` found none).
        assert!(
            read(None, pid, uid, gid, For::Request)
                .unwrap_err()
                .contains("exited")
        );
        assert!(caller_pidfd(-1, i32::MAX).is_none());
    }
}
