//! Users' filesystem credentials, and taking them on one thread: the daemon reads the
//! network as a user who may read a file (root is squashed on most NFS exports and must
//! not read more than users can), and checks a caller's rights as that caller.

use std::{
    collections::HashMap,
    ffi::CString,
    io,
    sync::Mutex,
    time::{Duration, Instant},
};

/// A user's credentials for the filesystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// How long a user's groups (or that there is no such user) are taken as known: a
/// placement asks for the reader of every file it would copy, and the name service can
/// cost dozens of syscalls an answer (files, userdb, sssd ...), more for a user it does
/// not know. A change of groups reaches copies within this long, as it reaches a login.
const USER_TTL: Duration = Duration::from_secs(60);

/// Users looked up lately (None: unknown to the name service), and when.
type Known = HashMap<u32, (Option<User>, Instant)>;
static KNOWN: Mutex<Option<Known>> = Mutex::new(None);

/// Users remembered at most (a placement sees a few hundred at a site).
const USERS_HELD: usize = 4096;

impl User {
    /// The user `uid` with their primary and supplementary groups; None if the name
    /// service does not know them. Remembered for `USER_TTL`.
    pub fn lookup(uid: u32) -> Option<Self> {
        let now = Instant::now();
        let mut guard = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
        let known = guard.get_or_insert_with(HashMap::new);
        if let Some((user, at)) = known.get(&uid) {
            if now.duration_since(*at) < USER_TTL {
                return user.clone();
            }
        }
        if known.len() >= USERS_HELD {
            known.retain(|_, (_, at)| now.duration_since(*at) < USER_TTL);
        }
        let user = Self::from_name_service(uid);
        if known.len() < USERS_HELD {
            known.insert(uid, (user.clone(), now));
        }
        user
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

/// This thread's filesystem identity (fsuid, fsgid, groups) as a user's until dropped,
/// then root's again. Raw syscalls: glibc's wrappers would change every thread of the
/// daemon.
pub struct AsUser {
    was_root: bool,
}

impl AsUser {
    /// Takes `user`'s identity on this thread; root's asks nothing.
    pub fn take(user: &User) -> io::Result<Self> {
        if user.uid == 0 {
            return Ok(Self { was_root: false });
        }
        // SAFETY: credential syscalls on this thread only, with valid pointers.
        unsafe {
            let groups = &user.groups;
            if libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) != 0 {
                return Err(io::Error::last_os_error());
            }
            libc::syscall(libc::SYS_setfsgid, user.gid);
            libc::syscall(libc::SYS_setfsuid, user.uid);
            // setfsuid reports the previous value; read it back to be sure it took.
            if libc::syscall(libc::SYS_setfsuid, u32::MAX) as u32 != user.uid {
                return Err(io::Error::other(format!(
                    "could not take the identity of uid {}",
                    user.uid
                )));
            }
        }
        Ok(Self { was_root: true })
    }
}

impl Drop for AsUser {
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
