//! Who may see what. Profiles name other people's files: root sees everything, anyone
//! else only the entries they could reach themselves. The check runs the kernel's own
//! permission test (`faccessat` with `AT_EACCESS`) on a thread that has taken the
//! caller's filesystem identity, so ACLs and the network filesystem's rules apply too.

use std::{
    ffi::CString,
    os::{fd::OwnedFd, unix::ffi::OsStrExt},
    path::Path,
    sync::Arc,
};

use anyhow::Result;

use crate::{
    profile::format::Profile,
    redirect::identity,
    shared::user::{AsUser, User},
};

/// The credentials of a process talking to the daemon: the socket's uid and gid, its
/// groups from its `/proc` entry, and its pidfd (see `identity`).
#[derive(Debug, Clone)]
pub struct Caller {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    /// The process that connected (`identity::caller_pidfd`), to tell it from one that
    /// took its pid; None once it is gone.
    pub pidfd: Option<Arc<OwnedFd>>,
}

impl Caller {
    pub fn is_root(&self) -> bool {
        self.uid == 0
    }

    /// Completes the socket's credentials, checking that the process is still the one
    /// that connected, as itself; `Err` is the message for the caller.
    pub fn from_peer(
        pid: i32,
        uid: u32,
        gid: u32,
        pidfd: Option<Arc<OwnedFd>>,
    ) -> Result<Self, String> {
        let process = identity::read(pidfd.as_ref(), pid, uid, gid, identity::For::Request)?;
        Ok(Self {
            pid,
            uid,
            gid,
            groups: process.groups,
            pidfd,
        })
    }

    /// What a job of this caller inherits, read now (see `identity::read`).
    pub fn process(&self) -> Result<identity::Process, String> {
        identity::read(
            self.pidfd.as_ref(),
            self.pid,
            self.uid,
            self.gid,
            identity::For::Job,
        )
    }
}

/// Keeps only the entries `caller` could read (files, directories) or look up (missing
/// names: the parent directory must be searchable), and only the caller's own uid.
pub fn filter_for(profile: &mut Profile, caller: &Caller) -> Result<()> {
    if caller.is_root() {
        return Ok(());
    }
    let uid = caller.uid;
    let mut p = std::mem::take(profile);
    *profile = as_caller(caller, move || {
        p.files
            .retain(|f| can(&f.path, libc::R_OK) || gone_but_parent_searchable(&f.path));
        p.dirs.retain(|d| can(&d.path, libc::R_OK | libc::X_OK));
        p.missing.retain(|m| parent_searchable(&m.path));
        for f in &mut p.files {
            f.uids.retain(|u| *u == uid);
        }
        p
    })?;
    Ok(())
}

/// Runs `f` with `caller`'s filesystem identity (uid, gid, groups), on a thread of its
/// own that ends with it: every path `f` touches is resolved with the caller's rights,
/// never root's.
pub fn as_caller<T: Send + 'static>(
    caller: &Caller,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T> {
    let uid = caller.uid;
    let caller = caller.clone();
    let handle = std::thread::Builder::new()
        .name("hocus-as-user".into())
        .spawn(move || -> Result<T> {
            let user = User {
                uid: caller.uid,
                gid: caller.gid,
                groups: caller.groups,
            };
            let _as_caller = AsUser::take(&user)?;
            Ok(f())
        })?;
    // The thread exits with the caller's identity; nothing else ever runs on it.
    handle
        .join()
        .map_err(|_| anyhow::anyhow!("a thread working as uid {uid} panicked"))?
}

fn can(path: &str, mode: libc::c_int) -> bool {
    let Ok(c) = CString::new(Path::new(path).as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: valid C string. AT_EACCESS: check with the thread's fs identity.
    unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), mode, libc::AT_EACCESS) == 0 }
}

fn parent_searchable(path: &str) -> bool {
    Path::new(path)
        .parent()
        .is_some_and(|p| can(&p.to_string_lossy(), libc::X_OK))
}

/// A file that no longer exists (unlinked, renamed) is shown if its directory is.
fn gone_but_parent_searchable(path: &str) -> bool {
    std::fs::symlink_metadata(path).is_err() && parent_searchable(path)
}
