//! The guard: a small process that holds the pre-content group beside the daemon. When
//! the last holder of a group closes it, the kernel allows every access the group was
//! asked and not answered (checked: the reader then reads the hole's zeros), and later
//! reads of the copy see no event at all. So a daemon that dies (killed, or out of
//! memory) must not take the group with it: the guard, standing by on the daemon's
//! pidfd, takes over when it ends and fails every access with EIO — a job reading a
//! range not yet local gets an error, never zeros and never a hang — until a daemon
//! starts again and takes the group back (`adopt`: `pidfd_getfd`), marks and all.
//!
//! It is forked from the daemon and runs raw system calls only (no allocation, no
//! lock: the daemon has threads), in a session of its own (a terminal's signals are
//! not for it), with every signal blocked but SIGUSR1, by which the daemon that takes
//! the group back stops it, and the OOM killer told to leave it be. It holds no
//! descriptor but the group and the daemon's pidfd.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    time::{Duration, Instant},
};

use super::pre_content::DENY_EIO;

/// A guard started by this daemon, or found from a previous one.
#[derive(Debug)]
pub struct Guard {
    pid: libc::pid_t,
    pidfd: OwnedFd,
}

impl Guard {
    /// Forks a guard holding group `group` that stands by while the process of pidfd
    /// `daemon` lives (this daemon's own, in the daemon).
    pub fn start(group: RawFd, daemon: &OwnedFd) -> io::Result<Self> {
        let daemon = daemon.as_raw_fd();
        // SAFETY: the child runs `stand_by` only, which makes raw system calls and never
        // returns.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        if pid == 0 {
            // SAFETY: in the child of a fork, as above.
            unsafe { stand_by(group, daemon) }
        }
        let pidfd = pidfd_open(pid)?;
        Ok(Self { pid, pidfd })
    }

    /// The guard of process `pid` (a previous daemon's, as its state directory says),
    /// if it is one: a root process named `hocus-guard`.
    pub fn find(pid: libc::pid_t) -> io::Result<Self> {
        let pidfd = pidfd_open(pid)?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
                .unwrap_or("")
                .to_owned()
        };
        if field("Name:") != "hocus-guard" || !field("Uid:").starts_with("0\t") {
            return Err(io::Error::other(format!(
                "process {pid} is not a hocus guard"
            )));
        }
        Ok(Self { pid, pidfd })
    }

    pub fn pid(&self) -> libc::pid_t {
        self.pid
    }

    /// Takes the group back (its marks with it), then stops the guard: the group never
    /// goes away in between, so no access is allowed unanswered.
    pub fn adopt(self) -> io::Result<OwnedFd> {
        // SAFETY: a pidfd of ours; the guard holds its group at 0.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, self.pidfd.as_raw_fd(), 0, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just installed for us.
        let group = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        self.stop()?;
        Ok(group)
    }

    /// Stops the guard (SIGUSR1) and waits up to 5 s for it to end.
    pub fn stop(self) -> io::Result<()> {
        // SAFETY: a pidfd of ours, a signal number.
        let sent = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_raw_fd(),
                libc::SIGUSR1,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let mut p = libc::pollfd {
                fd: self.pidfd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd.
            if unsafe { libc::poll(&raw mut p, 1, 100) } > 0 {
                // Our own child is reaped; another daemon's was reparented.
                // SAFETY: no status wanted.
                unsafe { libc::waitpid(self.pid, std::ptr::null_mut(), libc::WNOHANG) };
                return Ok(());
            }
        }
        Err(io::Error::other(format!(
            "the guard (process {}) did not stop",
            self.pid
        )))
    }
}

/// A pidfd of process `pid`.
pub fn pidfd_open(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: plain arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just made, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// The guard's life, in the child of the fork: group at 0, the daemon's pidfd at 1,
/// SIGUSR1's signalfd at 2, nothing else.
///
/// # Safety
/// Only in the child of a fork: it never returns.
unsafe fn stand_by(group: RawFd, daemon: RawFd) -> ! {
    // SAFETY: raw system calls on descriptors and stack memory of this function.
    unsafe {
        libc::setsid();
        libc::prctl(libc::PR_SET_NAME, c"hocus-guard".as_ptr());
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&raw mut all);
        libc::sigprocmask(libc::SIG_SETMASK, &raw const all, std::ptr::null_mut());
        let g = libc::fcntl(group, libc::F_DUPFD, 16);
        let d = libc::fcntl(daemon, libc::F_DUPFD, 16);
        if g < 0 || d < 0 {
            libc::_exit(1);
        }
        libc::dup2(g, 0);
        libc::dup2(d, 1);
        libc::syscall(libc::SYS_close_range, 2u32, u32::MAX, 0u32);
        let mut usr1: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&raw mut usr1);
        libc::sigaddset(&raw mut usr1, libc::SIGUSR1);
        if libc::signalfd(-1, &raw const usr1, 0) != 2 {
            libc::_exit(1);
        }
        let adj = libc::open(c"/proc/self/oom_score_adj".as_ptr(), libc::O_WRONLY);
        if adj >= 0 {
            libc::write(adj, c"-1000".as_ptr().cast(), 5);
            libc::close(adj);
        }
        // Standing by: until the daemon ends, or the guard is told to stop.
        if wait_for(1) != 1 {
            libc::_exit(0);
        }
        // Taking over: every access fails with EIO.
        let mut buf = [0u8; 4096];
        loop {
            if wait_for(0) != 0 {
                libc::_exit(0);
            }
            let n = libc::read(0, buf.as_mut_ptr().cast(), buf.len());
            if n <= 0 {
                continue;
            }
            let mut at = 0usize;
            // struct fanotify_event_metadata: event_len (u32) at 0, fd (i32) at 16.
            while at + 24 <= n as usize {
                let len = u32::from_ne_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
                let fd =
                    i32::from_ne_bytes([buf[at + 16], buf[at + 17], buf[at + 18], buf[at + 19]]);
                if len < 24 {
                    break;
                }
                if fd >= 0 {
                    let response = libc::fanotify_response {
                        fd,
                        response: DENY_EIO,
                    };
                    libc::write(
                        0,
                        (&raw const response).cast(),
                        size_of::<libc::fanotify_response>(),
                    );
                    libc::close(fd);
                }
                at += len as usize;
            }
        }
    }
}

/// Waits until descriptor `fd` or the stop signal (2) is readable: which one.
///
/// # Safety
/// In the guard only.
unsafe fn wait_for(fd: RawFd) -> RawFd {
    let mut polls = [
        libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: 2,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: two pollfds on the stack.
        if unsafe { libc::poll(polls.as_mut_ptr(), 2, -1) } > 0 {
            return if polls[1].revents != 0 { 2 } else { fd };
        }
    }
}
