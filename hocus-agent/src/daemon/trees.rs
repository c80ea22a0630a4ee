//! What the daemon watches, found and checked at start: the trees (named, or every
//! network filesystem mounted), each held open from its check on (one found on its own
//! may be unmounted meanwhile, an automount expiring, and a path may lead elsewhere
//! later); the directories the kernel side places files under (the trees, and the
//! cache's copies and snapshots, which jobs open through hocus's binds); and where those
//! are by device and path inside their filesystems, how other namespaces' mounts are
//! matched to them.

use std::{
    os::{fd::OwnedFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
};

use anyhow::{Result, bail};
use hocus_common::superblock;
use hocus_control::status::WatchedMount;

use crate::{
    cache::directory::Cache,
    observe::{
        mounts::{self, Mount},
        places::Watch,
        tracer::Root,
        views::Anchor,
    },
    shared::kernel::{Route, route},
};

/// The watched trees.
pub struct Trees {
    /// As `status` shows them.
    pub watched: Vec<WatchedMount>,
    /// As the observer matches paths: each with the other paths it was named by.
    pub watches: Vec<Watch>,
    /// Each held open.
    dirs: Vec<OwnedFd>,
}

impl Trees {
    /// The trees `named` (`--watch`), or every network filesystem of `mount_table`.
    pub fn find(named: &[PathBuf], mount_table: &[Mount]) -> Result<Self> {
        let given = if named.is_empty() {
            let found = mounts::default_watches(mount_table);
            if found.is_empty() {
                bail!(
                    "no network filesystem is mounted (nfs, lustre, gpfs, cifs, sshfs, ...); name the trees to watch with --watch PATH"
                );
            }
            found
        } else {
            named.to_vec()
        };
        let mut trees = Self {
            watched: Vec::new(),
            watches: Vec::new(),
            dirs: Vec::new(),
        };
        for path in &given {
            let checked = mounts::check_watch(path).and_then(|c| Ok((mounts::open_dir(&c)?, c)));
            let (dir, canonical) = match checked {
                Ok(c) => c,
                // A mount found on its own that does not answer (its server or FUSE daemon
                // is gone) is skipped; one the user named is an error.
                Err(e) if named.is_empty() => {
                    log::warn!("not watching {}: {e:#}", path.display());
                    continue;
                }
                Err(e) => return Err(e),
            };
            let mount = mounts::mount_of(mount_table, &canonical);
            let fs_type = mount.map(|m| m.fs_type.clone()).unwrap_or_default();
            let network = mount.is_some_and(Mount::is_network);
            if network {
                log::info!("watching {} ({fs_type})", canonical.display());
            } else {
                log::warn!(
                    "watching {} although it is on {fs_type}, not a network filesystem",
                    canonical.display()
                );
            }
            let aliases = if canonical != *path && path.is_absolute() {
                vec![path.clone()]
            } else {
                vec![]
            };
            trees.watched.push(WatchedMount {
                path: canonical.clone(),
                fs_type,
                network,
            });
            trees.watches.push(Watch {
                path: canonical,
                aliases,
            });
            trees.dirs.push(dir);
        }
        if trees.watches.is_empty() {
            bail!(
                "none of the network filesystems mounted here can be reached; name the trees to watch with --watch PATH"
            );
        }
        Ok(trees)
    }

    /// The trees' paths.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.watches.iter().map(|w| w.path.clone()).collect()
    }

    /// The paths absolute paths are matched against: each tree's, and the others it was
    /// named by.
    pub fn prefixes(&self) -> Vec<&Path> {
        self.watches
            .iter()
            .flat_map(|w| {
                std::iter::once(w.path.as_path()).chain(w.aliases.iter().map(PathBuf::as_path))
            })
            .collect()
    }

    /// The trees' devices: activity on them wakes the tracer when it rests.
    pub fn devices(&self) -> std::io::Result<Vec<u64>> {
        self.dirs
            .iter()
            .map(|d| mounts::metadata_of(d).map(|m| m.dev()))
            .collect()
    }

    /// The directories files are placed under: the watched trees, and the cache's
    /// copies and snapshots in `cache_dir`, whose paths below are the network paths.
    pub fn into_roots(self, cache_dir: &Path) -> Result<Vec<Root>> {
        let mut roots: Vec<Root> = self
            .watches
            .iter()
            .zip(self.dirs)
            .map(|(w, dir)| Root {
                path: w.path.clone(),
                dir,
                kind: superblock::WATCHED,
            })
            .collect();
        for dir in [Cache::FILES, Cache::TREES] {
            let path = cache_dir.join(dir);
            roots.push(Root {
                dir: mounts::open_dir(&path)?,
                path,
                kind: superblock::CACHE,
            });
        }
        Ok(roots)
    }
}

/// Where each root is by device and path inside its filesystem: how other namespaces'
/// mounts are matched to them.
pub fn anchors(mount_table: &[Mount], roots: &[Root], cache_dir: &Path) -> Result<Vec<Anchor>> {
    let mut anchors = Vec::new();
    for r in roots.iter().filter(|r| r.kind == superblock::WATCHED) {
        anchors.push(Anchor::of(mount_table, &r.path, r.path.clone(), false)?);
    }
    anchors.push(Anchor::of(
        mount_table,
        &cache_dir.join(Cache::TREES),
        PathBuf::from("/"),
        true,
    )?);
    Ok(anchors)
}

/// What the observer takes a root's paths to be: a watched tree's own path; the cache's
/// copies and snapshots stand for `/` (the network paths are below them).
pub fn root_paths(roots: &[Root]) -> Vec<PathBuf> {
    roots
        .iter()
        .map(|r| match r.kind {
            superblock::WATCHED => r.path.clone(),
            _ => PathBuf::from("/"),
        })
        .collect()
}

/// Whether the syscall program follows every process: asked to, or a watched tree is on
/// a filesystem whose opens and failed lookups are not all requests a tripwire sees (NFS
/// answers them from its caches, a local disk has no server), or the kernel has no
/// tripwire for it (FUSE's tracepoint is newer than Debian 13's kernel). Otherwise it
/// follows jobs and the processes that used a watched mount (docs/overhead.md). With
/// the way that takes.
pub fn follows_every_process(
    asked: Option<bool>,
    watched: &[WatchedMount],
    fuse_tripwire: bool,
) -> (bool, Route) {
    const PART: &str = "processes followed";
    if asked == Some(true) {
        return (
            true,
            route(PART, "every process (trace-every-process)", false),
        );
    }
    if let Some(w) = watched.iter().find(|w| !mounts::is_fuse_type(&w.fs_type)) {
        let way = format!(
            "every process: {} is on {}, whose opens and failed lookups do not all reach its server, where the tripwire would see who uses it",
            w.path.display(),
            w.fs_type
        );
        return (true, route(PART, way, true));
    }
    if !fuse_tripwire {
        let way = "every process: this kernel has no FUSE request tracepoint (fuse:fuse_request_send) to see who uses the watched mounts";
        return (true, route(PART, way, true));
    }
    let way = "jobs and the processes that used a watched mount (the FUSE tripwire); every other process's syscalls are turned away at once";
    (false, route(PART, way, false))
}
