//! How other mount namespaces (containers) see the watched trees. An absolute path a
//! process passes means what its namespace's mounts say: the kernel side asks once per
//! namespace (and again after any mount changes anything), the agent reads that
//! namespace's /proc/PID/mountinfo (written by the kernel, so trusted), and answers with
//! the paths at which the namespace sees a watched tree (a coarse filter for the kernel)
//! while keeping the mounts to place each path precisely: the mount a path lies on
//! (the longest mount point, the last mounted on ties) decides, so a tmpfs mounted over
//! part of a tree in a user namespace shadows it there.

use std::{
    collections::{HashMap, VecDeque},
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use hocus_common::{MAX_VIEWS, NamespaceKey, VIEW_PREFIXES, View, Watched};

use crate::observe::mounts::{self, Mount};

/// A directory the agent knows by device and path within its filesystem: a watched tree
/// (seen by the agent at `path`) or the cache's snapshots (whose paths below are the
/// network paths: `path` is `/`).
#[derive(Debug, Clone)]
pub struct Anchor {
    dev: (u32, u32),
    /// The directory's path inside its filesystem (mountinfo's "root" field joined with
    /// the rest of the path below the mount point).
    inside: PathBuf,
    path: PathBuf,
    /// Only mounts of something inside it count (hocus's binds of snapshots), not a
    /// mount of the whole disk the cache happens to be on.
    binds_only: bool,
}

impl Anchor {
    /// The anchor for `dir` as the agent's own mount table places it.
    pub fn of(own: &[Mount], dir: &Path, path: PathBuf, binds_only: bool) -> Result<Self> {
        let m = mounts::mount_of(own, dir)
            .with_context(|| format!("no mount holds {}", dir.display()))?;
        let below = dir.strip_prefix(&m.mount_point).unwrap_or(Path::new(""));
        Ok(Self {
            dev: (m.major, m.minor),
            inside: m.root.join(below),
            path,
            binds_only,
        })
    }
}

struct Learned {
    generation: u64,
    mounts: Vec<Mount>,
}

pub struct Views {
    anchors: Vec<Anchor>,
    learned: HashMap<NamespaceKey, Learned>,
    /// Learned namespaces, oldest first, to forget the oldest beyond `MAX_VIEWS`.
    order: VecDeque<NamespaceKey>,
}

impl Views {
    pub fn new(anchors: Vec<Anchor>) -> Self {
        Self {
            anchors,
            learned: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Reads the mounts of the namespace of process `tgid` (whose namespace inode must be
    /// `inum` before and after, or the process moved or its pid was reused) and returns
    /// the kernel's view of it, valid at `generation`, and a namespace to forget (the
    /// oldest, once `MAX_VIEWS` are held).
    pub fn learn(
        &mut self,
        tgid: u32,
        key: NamespaceKey,
        inum: u32,
        generation: u64,
    ) -> Result<(View, Option<NamespaceKey>)> {
        let ns = format!("/proc/{tgid}/ns/mnt");
        let expected = format!("mnt:[{inum}]");
        let same = || fs::read_link(&ns).is_ok_and(|l| l.as_os_str() == expected.as_str());
        if !same() {
            bail!("process {tgid} is no longer in mount namespace {inum}");
        }
        let text = fs::read_to_string(format!("/proc/{tgid}/mountinfo"))
            .with_context(|| format!("reading the mounts of process {tgid}"))?;
        if !same() {
            bail!("process {tgid} left mount namespace {inum} while it was read");
        }
        let mounts = mounts::parse(&text)?;
        let view = self.kernel_view(&mounts, generation);
        let mut forget = None;
        if self
            .learned
            .insert(key, Learned { generation, mounts })
            .is_none()
        {
            self.order.push_back(key);
            if self.order.len() > MAX_VIEWS as usize {
                forget = self.order.pop_front();
                if let Some(old) = forget {
                    self.learned.remove(&old);
                }
            }
        }
        Ok((view, forget))
    }

    /// The paths at which `mounts` show a watched tree or a snapshot, for the kernel.
    fn kernel_view(&self, mounts: &[Mount], generation: u64) -> View {
        let mut prefixes: Vec<PathBuf> = Vec::new();
        for m in mounts {
            for a in self.anchors.iter().filter(|a| a.dev == (m.major, m.minor)) {
                if m.root.starts_with(&a.inside) {
                    prefixes.push(m.mount_point.clone());
                } else if !a.binds_only {
                    if let Ok(below) = a.inside.strip_prefix(&m.root) {
                        prefixes.push(m.mount_point.join(below));
                    }
                }
            }
        }
        prefixes.sort_by_key(|p| p.as_os_str().len());
        let mut kept: Vec<PathBuf> = Vec::new();
        for p in prefixes {
            if !kept.iter().any(|k| p.starts_with(k)) {
                kept.push(p);
            }
        }
        // More than the kernel holds, or too long: let every absolute path through for
        // this namespace and place each here.
        let entries: Option<Vec<Watched>> = kept
            .iter()
            .map(|p| match p.as_os_str().as_encoded_bytes() {
                b"/" => Some(everything()),
                bytes => Watched::new(bytes),
            })
            .collect();
        let entries = match entries {
            Some(e) if e.len() <= VIEW_PREFIXES => e,
            _ => vec![everything()],
        };
        let mut view = View {
            generation,
            prefixes: [EMPTY; VIEW_PREFIXES],
        };
        for (slot, entry) in view.prefixes.iter_mut().zip(entries) {
            *slot = entry;
        }
        view
    }

    /// Where the agent sees the absolute path `path` of namespace `key` (normalized), if
    /// the view learned at `generation` is still the one held.
    pub fn resolve(&self, key: &NamespaceKey, generation: u64, path: &Path) -> Option<PathBuf> {
        let learned = self.learned.get(key)?;
        if learned.generation != generation {
            return None;
        }
        let m = mounts::mount_of(&learned.mounts, path)?;
        let inside = m.root.join(path.strip_prefix(&m.mount_point).ok()?);
        self.anchors
            .iter()
            .filter(|a| a.dev == (m.major, m.minor))
            .filter(|a| !a.binds_only || m.root.starts_with(&a.inside))
            .find_map(|a| Some(a.path.join(inside.strip_prefix(&a.inside).ok()?)))
    }
}

/// An unused prefix slot (no mask: the kernel skips it).
const EMPTY: Watched = Watched {
    len: 0,
    _pad: 0,
    words: [0; hocus_common::PREFIX_WORDS],
    masks: [0; hocus_common::PREFIX_WORDS],
};

/// A prefix every absolute path matches: its first byte is `/`, and it is followed (at
/// `len` 0) by that same `/`.
fn everything() -> Watched {
    let mut w = EMPTY;
    w.words[0] = u64::from(b'/');
    w.masks[0] = 0xff;
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(dev: (u32, u32), root: &str, point: &str) -> Mount {
        Mount {
            id: 1,
            parent: 1,
            major: dev.0,
            minor: dev.1,
            root: root.into(),
            mount_point: point.into(),
            fs_type: "x".into(),
            source: String::new(),
            super_options: String::new(),
        }
    }

    const NET: (u32, u32) = (0, 40);
    const DISK: (u32, u32) = (254, 0);
    const TMPFS: (u32, u32) = (0, 99);

    fn views() -> Views {
        let own = [
            mount(DISK, "/", "/"),
            mount(NET, "/export/home", "/mnt/nethome"),
        ];
        Views::new(vec![
            Anchor::of(
                &own,
                Path::new("/mnt/nethome"),
                "/mnt/nethome".into(),
                false,
            )
            .unwrap(),
            Anchor::of(&own, Path::new("/var/cache/hocus/trees"), "/".into(), true).unwrap(),
        ])
    }

    fn key(n: u64) -> NamespaceKey {
        NamespaceKey {
            namespace: n,
            root: 1,
        }
    }

    fn learn(v: &mut Views, mounts: Vec<Mount>) -> View {
        let view = v.kernel_view(&mounts, 7);
        v.learned.insert(
            key(1),
            Learned {
                generation: 7,
                mounts,
            },
        );
        view
    }

    /// The prefixes a view holds, as text.
    fn prefixes(view: &View) -> Vec<String> {
        view.prefixes
            .iter()
            .filter(|w| w.masks[0] != 0)
            .map(|w| {
                let bytes: Vec<u8> = w.words.iter().flat_map(|x| x.to_le_bytes()).collect();
                let len = (w.len as usize).max(1);
                String::from_utf8_lossy(&bytes[..len]).into_owned()
            })
            .collect()
    }

    #[test]
    fn a_container_binding_the_tree_elsewhere_maps_back() {
        let mut v = views();
        let view = learn(
            &mut v,
            vec![
                mount(DISK, "/", "/"),
                mount(NET, "/export/home/alice/env", "/env"),
                mount(TMPFS, "/", "/env/shadowed"),
                mount(
                    DISK,
                    "/var/cache/hocus/trees/mnt/nethome/alice/env/lib",
                    "/env/lib",
                ),
            ],
        );
        // "/env" alone: the snapshot bound below it is covered by it.
        assert_eq!(prefixes(&view), vec!["/env"]);
        let at = |p: &str| v.resolve(&key(1), 7, Path::new(p));
        assert_eq!(at("/env/x.py"), Some("/mnt/nethome/alice/env/x.py".into()));
        assert_eq!(
            at("/env/lib/m.py"),
            Some("/mnt/nethome/alice/env/lib/m.py".into())
        );
        assert_eq!(at("/env/shadowed/x.py"), None, "a tmpfs over it is not it");
        assert_eq!(at("/etc/passwd"), None);
        assert_eq!(
            at("/var/cache/hocus/trees/mnt/nethome/x"),
            None,
            "the disk the cache is on is not a bind of it"
        );
        assert_eq!(v.resolve(&key(1), 8, Path::new("/env/x.py")), None, "stale");
    }

    #[test]
    fn a_look_alike_at_the_same_path_is_not_the_tree() {
        let mut v = views();
        let view = learn(
            &mut v,
            vec![mount(DISK, "/", "/"), mount(TMPFS, "/", "/mnt/nethome")],
        );
        assert!(prefixes(&view).is_empty());
        assert_eq!(v.resolve(&key(1), 7, Path::new("/mnt/nethome/x")), None);
    }

    #[test]
    fn a_mount_of_the_whole_export_shows_the_tree_below_it() {
        let mut v = views();
        let view = learn(&mut v, vec![mount(DISK, "/", "/"), mount(NET, "/", "/srv")]);
        assert_eq!(prefixes(&view), vec!["/srv/export/home"]);
        assert_eq!(
            v.resolve(&key(1), 7, Path::new("/srv/export/home/bob/a")),
            Some("/mnt/nethome/bob/a".into())
        );
        assert_eq!(v.resolve(&key(1), 7, Path::new("/srv/other")), None);
    }

    #[test]
    fn too_many_places_let_everything_through() {
        let mut v = views();
        let mut mounts = vec![mount(DISK, "/", "/")];
        for i in 0..6 {
            mounts.push(mount(NET, "/export/home", &format!("/m{i}")));
        }
        let view = learn(&mut v, mounts);
        assert_eq!(prefixes(&view), vec!["/"]);
    }
}
