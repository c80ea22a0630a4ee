//! The `hocus-agent run` jobs the keeper follows: each job's mount namespace and the binds
//! in it, which of them (if any) serves a path, and the hits and misses that makes.

use hocus_control::status::Served;
use std::{
    collections::HashSet,
    os::fd::OwnedFd,
    path::{Path, PathBuf},
    sync::Arc,
};

use crate::{cache::snapshot, observe::events::What, redirect::mountns::Bind};

/// A live job namespace and the binds in it.
pub struct Job {
    pub ns: OwnedFd,
    pub binds: Vec<Bind>,
    /// The Slurm job this is a task of, if it was attached through the SPANK plugin.
    pub slurm_job: Option<u32>,
    /// The targets of `binds`: single files, and trees (snapshots) with their passages
    /// (below the target), which the network serves.
    files: HashSet<PathBuf>,
    trees: Vec<(PathBuf, HashSet<PathBuf>)>,
    /// The bound files it was seen opening or reading (at most `files`).
    used: HashSet<PathBuf>,
}

/// A job starting, as its session made it: the binds in its mount namespace, and what
/// the daemon follows it by.
pub struct JobStart {
    /// The daemon thread about to fork it (`hocus-agent run`: the kernel marks whatever
    /// that thread forks as this job), or an attached task's pid.
    pub id: u32,
    pub ns: OwnedFd,
    pub binds: Vec<Bind>,
    /// The snapshot overlays among the binds (their mounts), with the network directory
    /// each stands for: files opened in them are placed there.
    pub overlays: Vec<(OwnedFd, PathBuf)>,
    /// An attached task's pidfd: it is followed until that process exits.
    pub task: Option<Arc<OwnedFd>>,
    /// The ids of its binds' mounts, if each is marked (`bind_opens`): its opens of local
    /// copies are then seen while the tracer rests.
    pub marked: Option<Vec<u64>>,
    /// An attached Slurm task's job.
    pub slurm: Option<SlurmTask>,
}

/// A Slurm task attached through the SPANK plugin: its job, and whose it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlurmTask {
    pub job_id: u32,
    pub uid: u32,
}

/// What serves a path in a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server<'a> {
    /// A local copy bound over the file.
    File,
    /// The snapshot bound over this directory.
    Snapshot(&'a Path),
    Network,
}

impl Job {
    /// A job in namespace `ns` with `binds`, of which `is_snapshot` tells the trees.
    pub fn new(ns: OwnedFd, binds: Vec<Bind>, is_snapshot: impl Fn(&Bind) -> bool) -> Self {
        let (trees, files): (Vec<&Bind>, Vec<&Bind>) = binds.iter().partition(|b| is_snapshot(b));
        Self {
            files: files.iter().map(|b| b.target.clone()).collect(),
            trees: trees
                .iter()
                .map(|b| (b.target.clone(), b.passages.iter().cloned().collect()))
                .collect(),
            ns,
            binds,
            slurm_job: None,
            used: HashSet::new(),
        }
    }

    /// It was seen opening or reading `path`: if a local copy is bound there, that copy
    /// is in use until the job ends.
    pub fn saw(&mut self, path: &Path) {
        if self.files.contains(path) && !self.used.contains(path) {
            self.used.insert(path.to_owned());
        }
    }

    /// Whether it uses the local copy bound on `target`: seen using it, or, for a
    /// `partial` copy, has it bound at all (what one lacks fails once it is let go).
    pub fn uses_copy(&self, target: &Path, partial: bool) -> bool {
        let used = if partial { &self.files } else { &self.used };
        used.contains(target)
    }

    pub fn server_of(&self, path: &Path) -> Server<'_> {
        if self.files.contains(path) {
            return Server::File;
        }
        let Some((tree, passages)) = self.trees.iter().find(|(t, _)| path.starts_with(t)) else {
            return Server::Network;
        };
        if snapshot::in_passage(tree, passages, path) {
            Server::Network
        } else {
            Server::Snapshot(tree)
        }
    }

    /// The bind on `target` was detached.
    pub fn forget(&mut self, target: &Path) {
        self.binds.retain(|b| b.target != target);
        self.files.remove(target);
        self.used.remove(target);
        self.trees.retain(|(t, _)| t != target);
    }
}

/// Counts in `served` one access by a process (of a job if `in_job`) that `server`
/// answered, from RAM if `pinned`. Returns whether it was a hit: an open of a local copy,
/// or a name a snapshot answered as missing (a file bind holds no other names).
pub fn count(s: &mut Served, what: What, server: Server, pinned: bool, in_job: bool) -> bool {
    let local = server != Server::Network;
    match what {
        What::Open => {
            if in_job {
                s.job_opens += 1;
            }
            if local {
                s.opens_local += 1;
            } else {
                s.opens_network += 1;
            }
            local
        }
        What::Missing if matches!(server, Server::Snapshot(_)) => {
            s.lookups_local += 1;
            true
        }
        What::Missing => {
            s.lookups_network += 1;
            false
        }
        What::Read(n) => {
            match (local, pinned) {
                (true, true) => s.read_ram += n,
                (true, false) => s.read_ssd += n,
                (false, _) => s.read_network += n,
            }
            local
        }
        // Where a read lay: its bytes are counted by `Read`.
        What::Grains(..) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> Job {
        let bind = |local: &str, target: &str| Bind {
            local: local.into(),
            target: target.into(),
            tree: "/net".into(),
            expect: Default::default(),
            lazy: false,
            passages: Vec::new(),
        };
        let binds = vec![
            Bind {
                passages: vec!["lib/unused".into()],
                ..bind("/cache/trees/net/env", "/net/env")
            },
            bind("/cache/files/net/data/a.csv", "/net/data/a.csv"),
        ];
        let ns = std::fs::File::open("/proc/self/ns/mnt").unwrap().into();
        Job::new(ns, binds, |b| b.local.starts_with("/cache/trees"))
    }

    #[test]
    fn a_path_is_served_by_its_file_bind_or_the_snapshot_above_it() {
        let mut j = job();
        assert_eq!(j.server_of(Path::new("/net/data/a.csv")), Server::File);
        assert_eq!(
            j.server_of(Path::new("/net/env/lib/x.py")),
            Server::Snapshot(Path::new("/net/env"))
        );
        assert_eq!(j.server_of(Path::new("/net/data/b.csv")), Server::Network);
        assert_eq!(j.server_of(Path::new("/net/environ")), Server::Network);
        // A directory no job used is the network's own in the job's overlay.
        assert_eq!(
            j.server_of(Path::new("/net/env/lib/unused/y.py")),
            Server::Network
        );
        assert_eq!(
            j.server_of(Path::new("/net/env/lib/unused")),
            Server::Network
        );
        j.forget(Path::new("/net/env"));
        assert_eq!(j.server_of(Path::new("/net/env/lib/x.py")), Server::Network);
    }

    #[test]
    fn hits_misses_and_bytes_by_tier() {
        let mut s = Served::default();
        let snap = Server::Snapshot(Path::new("/net/env"));
        assert!(count(&mut s, What::Open, Server::File, true, true));
        assert!(!count(&mut s, What::Open, Server::Network, false, false));
        assert!(count(&mut s, What::Missing, snap, false, true));
        assert!(!count(&mut s, What::Missing, Server::File, false, true));
        count(&mut s, What::Read(10), Server::File, true, true);
        count(&mut s, What::Read(20), snap, false, true);
        count(&mut s, What::Read(40), Server::Network, false, false);
        assert_eq!((s.opens_local, s.opens_network, s.job_opens), (1, 1, 1));
        assert_eq!((s.lookups_local, s.lookups_network), (1, 1));
        assert_eq!((s.read_ram, s.read_ssd, s.read_network), (10, 20, 40));
    }
}
