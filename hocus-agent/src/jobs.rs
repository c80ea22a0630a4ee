//! The `hocus-agent run` jobs the keeper follows: each job's mount namespace and the binds
//! in it, which of them (if any) serves a path, and the hits and misses that makes.

use std::{
    collections::HashSet,
    os::fd::OwnedFd,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::{mountns::Bind, observe::What};

/// A live job namespace and the binds in it.
pub struct Job {
    pub ns: OwnedFd,
    pub binds: Vec<Bind>,
    /// The targets of `binds`: single files, and whole trees (snapshots).
    files: HashSet<PathBuf>,
    trees: Vec<PathBuf>,
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
            trees: trees.iter().map(|b| b.target.clone()).collect(),
            ns,
            binds,
        }
    }

    pub fn server_of(&self, path: &Path) -> Server<'_> {
        if self.files.contains(path) {
            return Server::File;
        }
        self.trees
            .iter()
            .find(|t| path.starts_with(t))
            .map_or(Server::Network, |t| Server::Snapshot(t))
    }

    /// The bind on `target` was detached.
    pub fn forget(&mut self, target: &Path) {
        self.binds.retain(|b| b.target != target);
        self.files.remove(target);
        self.trees.retain(|t| t != target);
    }
}

/// Opens, failed lookups and bytes read under one watched tree, by who answered: a local
/// copy (in RAM when pinned, else on SSD) bound into a `hocus-agent run` job, or the
/// network.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct Served {
    pub root: PathBuf,
    pub opens_local: u64,
    pub opens_network: u64,
    /// Of all opens: those made by processes of `hocus-agent run` jobs.
    pub job_opens: u64,
    pub lookups_local: u64,
    pub lookups_network: u64,
    pub read_ram: u64,
    pub read_ssd: u64,
    pub read_network: u64,
}

impl Served {
    /// Counts one access by a process (of a job if `in_job`) that `server` answered, from
    /// RAM if `pinned`. Returns whether it was a hit: an open of a local copy, or a name
    /// a snapshot answered as missing (a file bind holds no other names).
    pub fn count(&mut self, what: What, server: Server, pinned: bool, in_job: bool) -> bool {
        let local = server != Server::Network;
        match what {
            What::Open => {
                if in_job {
                    self.job_opens += 1;
                }
                if local {
                    self.opens_local += 1;
                } else {
                    self.opens_network += 1;
                }
                local
            }
            What::Missing if matches!(server, Server::Snapshot(_)) => {
                self.lookups_local += 1;
                true
            }
            What::Missing => {
                self.lookups_network += 1;
                false
            }
            What::Read(n) => {
                match (local, pinned) {
                    (true, true) => self.read_ram += n,
                    (true, false) => self.read_ssd += n,
                    (false, _) => self.read_network += n,
                }
                local
            }
        }
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
        };
        let binds = vec![
            bind("/cache/trees/net/env", "/net/env"),
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
        j.forget(Path::new("/net/env"));
        assert_eq!(j.server_of(Path::new("/net/env/lib/x.py")), Server::Network);
    }

    #[test]
    fn hits_misses_and_bytes_by_tier() {
        let mut s = Served::default();
        let snap = Server::Snapshot(Path::new("/net/env"));
        assert!(s.count(What::Open, Server::File, true, true));
        assert!(!s.count(What::Open, Server::Network, false, false));
        assert!(s.count(What::Missing, snap, false, true));
        assert!(!s.count(What::Missing, Server::File, false, true));
        s.count(What::Read(10), Server::File, true, true);
        s.count(What::Read(20), snap, false, true);
        s.count(What::Read(40), Server::Network, false, false);
        assert_eq!((s.opens_local, s.opens_network, s.job_opens), (1, 1, 1));
        assert_eq!((s.lookups_local, s.lookups_network), (1, 1));
        assert_eq!((s.read_ram, s.read_ssd, s.read_network), (10, 20, 40));
    }
}
