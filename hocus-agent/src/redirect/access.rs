//! Who may see what. Profiles name other people's files: root sees everything, anyone
//! else only the entries they could reach themselves. The check runs the kernel's own
//! permission test (`faccessat` with `AT_EACCESS`) on a thread that has taken the
//! caller's filesystem identity, so ACLs and the network filesystem's rules apply too.

use std::{
    collections::HashMap,
    ffi::CString,
    os::{fd::OwnedFd, unix::ffi::OsStrExt},
    path::{Path, PathBuf},
    sync::Arc,
    time::Instant,
};

use anyhow::Result;

use crate::{
    cache::relay::Parent,
    profile::format::Profile,
    redirect::{
        identity,
        remembered::{self, Expected},
        verdicts,
    },
    shared::{
        asked::{self, Asking, Purpose},
        relay::Entry,
        user::{AsUser, User},
    },
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
/// Each check may ask the server (counted as `access`): a directory holding many
/// missing names (a `__pycache__` no one made, probed once per module) is asked once.
pub fn filter_for(profile: &mut Profile, caller: &Caller) -> Result<()> {
    filter_for_job(profile, caller, None).map(|_| ())
}

/// A profile to prefetch checked as its user: a Slurm job's in its prolog, once for all
/// its nodes (`verdicts`: the job, this node's parent in the job's tree), or a user's
/// own prefetch (no job); what this node's copies expect (what is found is remembered
/// with it: `remembered`), and whether the user's verdicts found before are taken (not
/// where this node's children in a job's tree take what it finds, found now).
pub struct ProfileCheck {
    pub job_id: Option<u32>,
    pub parent: Option<Arc<Parent>>,
    pub expected: Arc<Expected>,
    pub recall: bool,
}

/// Where the verdicts of a job's profile came from besides this node's own checks.
#[derive(Debug, Default, Clone, Copy)]
pub struct Taken {
    /// From this node's parent.
    pub parent: usize,
    /// Found before on this node for the same user, the copies unchanged.
    pub remembered: usize,
}

impl std::ops::AddAssign for Taken {
    fn add_assign(&mut self, t: Self) {
        self.parent += t.parent;
        self.remembered += t.remembered;
    }
}

/// [`filter_for`] of a part of `job`'s profile: the user's verdicts this node found
/// before taken first, then the parent's, the rest checked here; all kept for this
/// node's own children, and what is new remembered.
pub fn filter_for_job(
    profile: &mut Profile,
    caller: &Caller,
    job: Option<&ProfileCheck>,
) -> Result<Taken> {
    if caller.is_root() {
        return Ok(Taken::default());
    }
    let user = verdicts::job_user(caller.uid, caller.gid, &caller.groups);
    let mut taken = HashMap::new();
    if let Some(j) = job.filter(|j| j.recall && !j.expected.is_empty()) {
        for (kind, path) in entries(profile) {
            if let Some(v) = remembered::recall(&user, &j.expected, kind, path) {
                taken.insert((kind, path.to_owned()), v);
            }
        }
    }
    let remembered = taken.len();
    if let Some(parent) = job.and_then(|j| j.parent.as_deref()) {
        let items: Vec<(Entry, &str)> = entries(profile)
            .filter(|&(kind, path)| !taken.contains_key(&(kind, path.to_owned())))
            .collect();
        if !items.is_empty() {
            taken.extend(verdicts::asked_of(parent, &user, &items));
        }
    }
    let uid = caller.uid;
    let job_id = job.and_then(|j| j.job_id);
    let mut p = std::mem::take(profile);
    let (p, found, taken) = as_caller(caller, move || {
        let (mut found, mut given) = (Vec::new(), 0);
        let mut searchable = Searchable::new(|dir: &Path| can(dir, libc::X_OK));
        let mut may = |kind: Entry, path: &str, check: &mut dyn FnMut(&str) -> bool| {
            if let Some(&(may, _)) = taken.get(&(kind, path.to_owned())) {
                return may;
            }
            let began = Instant::now();
            let may = check(path);
            found.push(((kind, path.to_owned()), (may, began)));
            // The job's other nodes wait for these as they are found.
            let due = found.len() - given >= verdicts::GIVEN_EVERY;
            if let Some(job_id) = job_id.filter(|_| due) {
                verdicts::record(job_id, found[given..].iter().cloned());
                given = found.len();
            }
            may
        };
        p.files.retain(|f| {
            may(Entry::File, &f.path, &mut |path| {
                can(Path::new(path), libc::R_OK) || (gone(path) && searchable.parent_of(path))
            })
        });
        p.dirs.retain(|d| {
            may(Entry::Dir, &d.path, &mut |path| {
                can(Path::new(path), libc::R_OK | libc::X_OK)
            })
        });
        p.missing.retain(|m| {
            may(Entry::Missing, &m.path, &mut |path| {
                searchable.parent_of(path)
            })
        });
        for f in &mut p.files {
            f.uids.retain(|u| *u == uid);
        }
        (p, found, taken)
    })?;
    *profile = p;
    let Some(job) = job else {
        return Ok(Taken::default());
    };
    let parent = taken.len() - remembered;
    let new = found.iter().map(|(k, v)| (k, v));
    remembered::remember(&user, &job.expected, new.chain(taken.iter()));
    if let Some(job_id) = job.job_id {
        verdicts::record(job_id, found.into_iter().chain(taken));
    }
    Ok(Taken { parent, remembered })
}

/// A profile's entries, each with what it is.
fn entries(p: &Profile) -> impl Iterator<Item = (Entry, &str)> {
    let files = p.files.iter().map(|f| (Entry::File, f.path.as_str()));
    let dirs = p.dirs.iter().map(|d| (Entry::Dir, d.path.as_str()));
    let missing = p.missing.iter().map(|m| (Entry::Missing, m.path.as_str()));
    files.chain(dirs).chain(missing)
}

/// Whether directories are searchable, each asked once.
struct Searchable<F> {
    ask: F,
    known: HashMap<PathBuf, bool>,
}

impl<F: FnMut(&Path) -> bool> Searchable<F> {
    fn new(ask: F) -> Self {
        Self {
            ask,
            known: HashMap::new(),
        }
    }

    fn parent_of(&mut self, path: &str) -> bool {
        let Some(dir) = Path::new(path).parent() else {
            return false;
        };
        if let Some(&known) = self.known.get(dir) {
            return known;
        }
        let found = (self.ask)(dir);
        self.known.insert(dir.to_owned(), found);
        found
    }
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

fn can(path: &Path, mode: libc::c_int) -> bool {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    let _asking = Asking::beneath(path, Purpose::Access);
    asked::asked();
    // SAFETY: valid C string. AT_EACCESS: check with the thread's fs identity.
    unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), mode, libc::AT_EACCESS) == 0 }
}

/// A file that no longer exists (unlinked, renamed) is shown if its directory is.
fn gone(path: &str) -> bool {
    let _asking = Asking::beneath(Path::new(path), Purpose::Access);
    asked::asked();
    std::fs::symlink_metadata(path).is_err()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_holding_many_missing_names_is_asked_once() {
        let mut asked = Vec::new();
        let mut s = Searchable::new(|d: &Path| {
            asked.push(d.to_owned());
            d.ends_with("s00")
        });
        for m in ["m0", "m1", "m2"] {
            assert!(!s.parent_of(&format!("/net/pkg/s00/__pycache__/{m}.pyc")));
            assert!(s.parent_of(&format!("/net/pkg/s00/{m}.so")));
        }
        assert!(!s.parent_of("/"));
        drop(s);
        assert_eq!(
            asked,
            [
                PathBuf::from("/net/pkg/s00/__pycache__"),
                PathBuf::from("/net/pkg/s00")
            ]
        );
    }
}
