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
        tripwires::Tripwire,
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
    /// The least time the watched NFS mounts' clients trust their cached attributes
    /// (`Mount::attribute_cache_max`).
    pub attribute_cache_max: Option<std::time::Duration>,
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
            attribute_cache_max: None,
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
            if let Some(max) = mount.and_then(Mount::attribute_cache_max) {
                trees.attribute_cache_max =
                    Some(trees.attribute_cache_max.map_or(max, |m| m.min(max)));
            }
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

    /// The longest wait between two checks of a bound entry: `revalidate-max` if
    /// given, else the watched NFS mounts' own (`attribute_cache_max`), else a minute;
    /// never below `revalidate`. Said in the log.
    pub fn longest_wait(
        &self,
        settings: &crate::shared::settings::Settings,
    ) -> std::time::Duration {
        let longest = settings
            .revalidate_max()
            .or(self.attribute_cache_max)
            .unwrap_or(std::time::Duration::from_secs(60))
            .max(settings.revalidate());
        log::info!(
            "revalidation: what running jobs bind is checked {} s after their start, then less often while it stays unchanged, up to {} s apart{}",
            settings.revalidate().as_secs(),
            longest.as_secs(),
            match (settings.revalidate_max, self.attribute_cache_max) {
                (None, Some(_)) => " (the NFS mounts' own acregmax)",
                _ => "",
            }
        );
        longest
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

/// The index of the first of the cache's roots (the watched trees' come first).
pub fn served_from(roots: &[Root]) -> usize {
    roots
        .iter()
        .position(|r| r.kind != superblock::WATCHED)
        .unwrap_or(roots.len())
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

/// How the syscall program finds whom to follow, from the watched trees and the
/// tripwires this kernel `has` (`observe::tripwires`): it follows jobs and the processes
/// that used a watched mount, seen by the mount's tripwire; or every process, when
/// asked to, or when a watched tree is on a filesystem with no tripwire (Lustre, GPFS, a
/// local disk) or one this kernel lacks (FUSE's is newer than Debian 13's kernel).
/// Returns whether it follows every process, the tripwires to attach (those of the
/// watched trees; they also wake a resting program), and the way taken.
pub fn follows_every_process(
    asked: Option<bool>,
    watched: &[WatchedMount],
    has: &[Tripwire],
) -> (bool, Vec<Tripwire>, Route) {
    const PART: &str = "processes followed";
    let mut wanted: Vec<Tripwire> = Vec::new();
    let mut without = None;
    for w in watched {
        match Tripwire::of(&w.fs_type) {
            Some(t) if has.contains(&t) => {
                if !wanted.contains(&t) {
                    wanted.push(t);
                }
            }
            Some(t) => {
                without.get_or_insert(format!(
                    "every process: this kernel has no {} tripwire ({}) to see who uses {}",
                    t.filesystems(),
                    t.tracepoints(),
                    w.path.display()
                ));
            }
            None => {
                without.get_or_insert(format!(
                    "every process: {} is on {}, which has no tripwire to see who uses it",
                    w.path.display(),
                    w.fs_type
                ));
            }
        }
    }
    if asked == Some(true) {
        let way = route(PART, "every process (trace-every-process)", false);
        return (true, wanted, way);
    }
    if let Some(way) = without {
        return (true, wanted, route(PART, way, true));
    }
    let names: Vec<&str> = wanted.iter().map(|t| t.filesystems()).collect();
    let way = format!(
        "jobs and the processes that used a watched mount (the {} tripwire); every other process's syscalls are turned away at once",
        names.join(" and ")
    );
    (false, wanted, route(PART, way, false))
}

/// Whether the tracer may rest while jobs run whose requests all hit local copies: when
/// the tripwires of every watched tree tell a served job's misses apart (`tells_misses`:
/// their hooks for requests that read or change a mount are attached), so that what a
/// served job does that is news wakes it.
pub fn rests_while_jobs_run(
    every_process: bool,
    tripwires: &[Tripwire],
    tells_misses: bool,
    learns_by_requests: bool,
) -> (bool, Route) {
    const PART: &str = "tracing while jobs run";
    if learns_by_requests {
        let way = "rests: the filesystem's own programs learn jobs (their hits are not counted, but Slurm tasks')";
        return (true, route(PART, way, false));
    }
    if every_process {
        let way = "followed: every process is followed, and no tripwire sees a served job's misses";
        return (false, route(PART, way, false));
    }
    let names: Vec<&str> = tripwires.iter().map(|t| t.filesystems()).collect();
    if !tells_misses {
        let way = format!(
            "followed: this kernel lacks the {} tripwire's hooks that tell a served job's misses apart",
            names.join(" and ")
        );
        return (false, route(PART, way, true));
    }
    let way = format!(
        "rests while every job's requests hit local copies (their hits are not counted meanwhile, but Slurm tasks'); a miss, a write, a job start wakes it (the {} tripwire)",
        names.join(" and ")
    );
    (true, route(PART, way, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(path: &str, fs_type: &str) -> WatchedMount {
        WatchedMount {
            path: PathBuf::from(path),
            fs_type: fs_type.to_owned(),
            network: true,
        }
    }

    #[test]
    fn every_process_is_followed_where_a_watched_tree_has_no_tripwire_here() {
        use Tripwire::{Fuse, Nfs};
        let sshfs = on("/home", "fuse.sshfs");
        let nfs = on("/sw", "nfs4");
        let lustre = on("/scratch", "lustre");
        let both = [sshfs.clone(), nfs.clone()];
        let (every, wanted, way) = follows_every_process(None, &both, &[Fuse, Nfs]);
        assert!(!every && !way.fallback);
        assert_eq!(wanted, [Fuse, Nfs]);
        assert!(way.way.contains("FUSE and NFS tripwire"), "{}", way.way);
        // Debian's kernels have no FUSE tripwire: the NFS one still wakes a rest.
        let (every, wanted, way) = follows_every_process(None, &both, &[Nfs]);
        assert!(every && way.fallback);
        assert_eq!(wanted, [Nfs]);
        assert!(way.way.contains("no FUSE tripwire"), "{}", way.way);
        let (every, wanted, way) = follows_every_process(None, &[nfs.clone(), lustre], &[Nfs]);
        assert!(every && way.fallback);
        assert_eq!(wanted, [Nfs]);
        assert!(way.way.contains("/scratch is on lustre"), "{}", way.way);
        let (every, wanted, way) = follows_every_process(Some(true), &[nfs], &[Nfs]);
        assert!(every && !way.fallback);
        assert_eq!(wanted, [Nfs]);
    }
}
