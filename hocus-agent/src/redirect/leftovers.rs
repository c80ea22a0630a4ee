//! Local copies a daemon left bound in jobs that outlived it (killed, or crashed before
//! it could take them away): found at start in the node's other mount namespaces and
//! taken away, so those jobs read the network from then on. No daemon would take a copy
//! away when its file changes on the network, and the job would read an older copy.

use std::{
    collections::HashSet,
    fs,
    os::{fd::OwnedFd, unix::fs::MetadataExt},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};

use crate::{
    observe::mounts::{self, Mount},
    redirect::mountns,
    shared::procs,
};

/// What was taken away.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Taken {
    pub namespaces: usize,
    pub binds: usize,
}

/// The cache's mounts as other namespaces' mount tables show them: binds of its copies
/// and snapshots (by device and path inside their filesystem), and lazy snapshot overlays
/// (overlays whose layer is in the cache).
struct Ours {
    dev: (u32, u32),
    inside: PathBuf,
    cache_dir: PathBuf,
}

impl Ours {
    fn of(own: &[Mount], cache_dir: &Path) -> Result<Self> {
        let m = mounts::mount_of(own, cache_dir)
            .with_context(|| format!("no mount holds {}", cache_dir.display()))?;
        let below = cache_dir
            .strip_prefix(&m.mount_point)
            .unwrap_or(Path::new(""));
        Ok(Self {
            dev: (m.major, m.minor),
            inside: m.root.join(below),
            cache_dir: cache_dir.to_owned(),
        })
    }

    fn made(&self, m: &Mount) -> bool {
        let overlay = m.fs_type == "overlay"
            && m.super_options.split(',').any(|o| {
                o.strip_prefix("lowerdir+=")
                    .is_some_and(|layer| Path::new(layer).starts_with(&self.cache_dir))
            });
        // A bind of a copy or snapshot: the cache may itself be on an overlay (a
        // container's root, a diskless node's /tmp), so this is asked of overlays too.
        let bind = (m.major, m.minor) == self.dev
            && m.root.starts_with(&self.inside)
            && m.root != self.inside;
        overlay || bind
    }
}

/// `take_away`, logged, as the daemon starts (before any job of its own exists).
/// Detaching walks the jobs' paths, which a network mount that does not answer can
/// hang: after `WAIT` the daemon starts anyway (a job there would hang on the same
/// mount) and the walk goes on meanwhile.
pub fn take_away_at_start(cache_dir: &Path, trees: &[PathBuf]) {
    const WAIT: std::time::Duration = std::time::Duration::from_secs(10);
    let (cache_dir, trees) = (cache_dir.to_owned(), trees.to_vec());
    let (done, finished) = std::sync::mpsc::channel();
    let walk = std::thread::Builder::new()
        .name("hocus-leftovers".into())
        .spawn(move || {
            match take_away(&cache_dir, &trees) {
                Ok(t) if t.binds > 0 => log::warn!(
                    "an earlier daemon left {} local copies bound in {} jobs that outlived it: taken away, those jobs read the network until they end",
                    t.binds,
                    t.namespaces
                ),
                Ok(_) => {}
                Err(e) => log::warn!(
                    "could not look for local copies an earlier daemon left bound in running jobs: {e:#}"
                ),
            }
            let _ = done.send(());
        });
    match walk {
        Ok(_) => {
            if finished.recv_timeout(WAIT).is_err() {
                log::warn!(
                    "still taking away the local copies an earlier daemon left in running jobs after {} s (a network mount does not answer?); starting meanwhile",
                    WAIT.as_secs()
                );
            }
        }
        Err(e) => log::warn!("could not look for local copies an earlier daemon left: {e}"),
    }
}

/// Takes away, in every mount namespace of the node but this process's, the mounts of
/// the cache at `cache_dir` (canonical) that lie in a watched tree (`trees`).
pub fn take_away(cache_dir: &Path, trees: &[PathBuf]) -> Result<Taken> {
    let cache_dir = match fs::canonicalize(cache_dir) {
        // A first start: no earlier daemon had a cache here to leave bound.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Taken::default()),
        found => found.with_context(|| format!("finding the cache {}", cache_dir.display()))?,
    };
    let ours = Ours::of(&mounts::read()?, &cache_dir)?;
    let own = fs::metadata("/proc/self/ns/mnt")?.ino();
    let mut seen = HashSet::from([own]);
    let mut taken = Taken::default();
    for pid in procs::pids().context("reading /proc")? {
        // A process may end, or its pid be reused, at any moment: whatever fails is
        // skipped, and a namespace is read only if the pid still had it afterwards.
        let Some((ns, inum, table)) = namespace_of(pid, &seen) else {
            continue;
        };
        seen.insert(inum);
        let left: Vec<&Mount> = table
            .iter()
            .filter(|m| ours.made(m) && trees.iter().any(|t| m.mount_point.starts_with(t)))
            .collect();
        // The outermost only: a overlay's passages go with it.
        let ids: HashSet<u32> = left.iter().map(|m| m.id).collect();
        let targets: Vec<PathBuf> = left
            .iter()
            .filter(|m| !ids.contains(&m.parent))
            .map(|m| m.mount_point.clone())
            .collect();
        if targets.is_empty() {
            continue;
        }
        match mountns::detach_in(&ns, &targets) {
            Ok(n) => {
                taken.namespaces += 1;
                taken.binds += n;
            }
            Err(e) => log::warn!(
                "could not take away the local copies an earlier daemon left in the mount namespace of process {pid}: {e}"
            ),
        }
    }
    Ok(taken)
}

/// Process `pid`'s mount namespace (held), its inode number and its mount table, unless
/// already `seen`.
fn namespace_of(pid: u32, seen: &HashSet<u64>) -> Option<(OwnedFd, u64, Vec<Mount>)> {
    let link = format!("/proc/{pid}/ns/mnt");
    let ns = fs::File::open(&link).ok()?;
    let inum = ns.metadata().ok()?.ino();
    if seen.contains(&inum) {
        return None;
    }
    let text = fs::read_to_string(format!("/proc/{pid}/mountinfo")).ok()?;
    if fs::metadata(&link).ok()?.ino() != inum {
        return None;
    }
    Some((ns.into(), inum, mounts::parse(&text).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
71 22 0:39 / /mnt/net rw,nosuid,nodev,relatime - fuse.sshfs root@h:/srv rw,user_id=0
80 71 252:1 /var/cache/hocus/files/mnt/net/a.py /mnt/net/a.py ro,nosuid,nodev - ext4 /dev/vda rw
81 71 0:41 / /mnt/net/site ro,nosuid,nodev - overlay none ro,lowerdir+=/var/cache/hocus/trees/mnt/net/site,datadir+=/mnt/net/site,metacopy=on
82 81 0:39 /site/pkg/sub /mnt/net/site/pkg/sub rw,nosuid,nodev - fuse.sshfs root@h:/srv rw,user_id=0
83 71 252:1 /home/u/own /mnt/net/mine rw - ext4 /dev/vda rw
84 71 252:1 /var/cache/other/files/x /mnt/net/x ro - ext4 /dev/vda rw
85 22 252:1 /var/cache/hocus/files/etc/y /etc/y ro - ext4 /dev/vda rw
";

    #[test]
    fn only_the_caches_own_binds_and_views_are_ours() {
        let table = mounts::parse(TABLE).unwrap();
        let ours = Ours::of(&table, Path::new("/var/cache/hocus")).unwrap();
        let made: Vec<u32> = table
            .iter()
            .filter(|m| ours.made(m))
            .map(|m| m.id)
            .collect();
        // The file bind and the overlay; not the passage under the overlay (the network's),
        // a user's own bind, another cache's, or the cache's disk itself. (85 is the
        // cache's, outside any watched tree: `take_away` leaves it.)
        assert_eq!(made, [80, 81, 85]);
    }

    /// The cache on an overlay itself (a container's root, the rig's guests' /tmp): its
    /// binds are overlay mounts too, found by device and path all the same.
    #[test]
    fn binds_of_a_cache_on_an_overlay_are_ours() {
        let table = mounts::parse(
            "\
23 1 0:21 / / ro,relatime - 9p /dev/root ro,trans=virtio
54 23 0:46 / /tmp rw,relatime - overlay rw_overlay rw,lowerdir=/tmp,upperdir=/run/u,workdir=/run/w
73 54 0:60 / /tmp/net rw,relatime - nfs 127.0.0.1:/exp rw,vers=3
111 73 0:46 /hocus-agent-x/cache/trees/tmp/net/env /tmp/net/env ro,nosuid,nodev,relatime - overlay rw_overlay rw,lowerdir=/tmp,upperdir=/run/u,workdir=/run/w
112 73 0:46 /other/env /tmp/net/other ro - overlay rw_overlay rw,lowerdir=/tmp,upperdir=/run/u,workdir=/run/w
",
        )
        .unwrap();
        let ours = Ours::of(&table, Path::new("/tmp/hocus-agent-x/cache")).unwrap();
        let made: Vec<u32> = table
            .iter()
            .filter(|m| ours.made(m))
            .map(|m| m.id)
            .collect();
        assert_eq!(made, [111]);
    }
}
