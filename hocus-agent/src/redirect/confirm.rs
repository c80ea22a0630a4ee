//! Job-start consistency: before a job's first process runs, every local copy it is to
//! be given is checked against the network, so a job sees what a plain process on the
//! mount sees at that moment (a network filesystem's close-to-open promise) and hocus
//! adds no staleness of its own. A copied file must still have the identity it was
//! copied at; a snapshot, every directory it was taken from (a name added, removed or
//! renamed changes its directory). The checks run in parallel, bounded in time: what is
//! not confirmed in time is not bound, and the job reads the network there.
//!
//! Each stat asks the server (`Tree::stat_now`): an attribute cached by the client is
//! what the check must not trust. A directory changed just before its snapshot was
//! stamped may change again without a new mtime (seconds on SFTP): its names are
//! compared with the snapshot's too.

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{
        Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use crate::{
    cache::copy::{Identity, Tree},
    redirect::mountns::{Bind, Expect},
};

/// One check: the network path, the identity it must still have, and for a racy
/// directory the snapshot's copy of it, whose names it must still have.
struct Item<'a> {
    bind: usize,
    path: PathBuf,
    identity: &'a Identity,
    names_of: Option<PathBuf>,
}

/// Checks running at once: the network's round trip, not its bandwidth, is what a
/// stat costs.
const PARALLEL: usize = 32;

/// What the check found.
#[derive(Debug, Default)]
pub struct Confirmed {
    /// Still what the network holds: to bind.
    pub binds: Vec<Bind>,
    /// Changed or gone on the network (their copies are stale).
    pub stale: Vec<PathBuf>,
    /// Not checked within the time allowed (not bound either).
    pub unchecked: usize,
}

/// Checks `binds` against the network within `allowed`.
pub fn confirm(binds: Vec<Bind>, allowed: Duration) -> Confirmed {
    let deadline = Instant::now() + allowed;
    let mut trees: HashMap<PathBuf, Option<Tree>> = HashMap::new();
    for b in &binds {
        trees
            .entry(b.tree.clone())
            .or_insert_with(|| Tree::open(&b.tree).ok());
    }
    // One stat per item: a copied file, or one directory of a snapshot (a snapshot's
    // directories are checked in parallel too).
    let mut items: Vec<Item> = Vec::new();
    let mut checks = vec![0usize; binds.len()];
    for (i, b) in binds.iter().enumerate() {
        let before = items.len();
        match &b.expect {
            Expect::File(id) => items.push(Item {
                bind: i,
                path: b.target.clone(),
                identity: id,
                names_of: None,
            }),
            Expect::Dirs(dirs) => items.extend(dirs.iter().map(|d| Item {
                bind: i,
                path: b.target.join(&d.rel),
                identity: &d.identity,
                names_of: d.racy.then(|| b.local.join(&d.rel)),
            })),
            Expect::Nothing => {}
        }
        checks[i] = items.len() - before;
    }
    let next = AtomicUsize::new(0);
    // Per bind: the checks passed, and whether one failed.
    let results: Mutex<Vec<(usize, bool)>> = Mutex::new(vec![(0, false); binds.len()]);
    thread::scope(|s| {
        for _ in 0..PARALLEL.min(items.len()) {
            s.spawn(|| {
                while Instant::now() < deadline {
                    let Some(item) = items.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        return;
                    };
                    let i = item.bind;
                    let tree = trees.get(&binds[i].tree).and_then(Option::as_ref);
                    let same = tree.is_some_and(|t| unchanged(t, item));
                    let mut r = results.lock().unwrap();
                    if same {
                        r[i].0 += 1;
                    } else {
                        r[i].1 = true;
                    }
                }
            });
        }
    });
    let results = results.into_inner().unwrap();
    let mut out = Confirmed::default();
    for ((b, (passed, failed)), needed) in binds.into_iter().zip(results).zip(checks) {
        if failed {
            out.stale.push(b.target);
        } else if passed == needed && needed > 0 {
            out.binds.push(b);
        } else {
            out.unchecked += 1;
        }
    }
    out
}

/// Whether the item's path still has the identity its copy (or its snapshot) was made
/// at, and for a racy directory still the names of the snapshot's copy.
fn unchanged(tree: &Tree, item: &Item) -> bool {
    let same = tree
        .stat_now(&item.path)
        .is_ok_and(|m| tree.identity(&m) == *item.identity);
    same && item.names_of.as_ref().is_none_or(|local| {
        let local_names = std::fs::read_dir(local).and_then(|entries| {
            entries
                .map(|e| e.map(|e| e.file_name()))
                .collect::<std::io::Result<std::collections::BTreeSet<_>>>()
        });
        matches!((tree.names(&item.path), local_names), (Ok(a), Ok(b)) if a == b)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redirect::mountns::SnapshotDir;
    use std::{fs, path::Path};

    fn bind(tree: &Path, target: PathBuf, expect: Expect) -> Bind {
        Bind {
            local: "/cache/x".into(),
            target,
            tree: tree.to_owned(),
            expect,
            lazy: false,
        }
    }

    #[test]
    fn what_changed_since_its_copy_is_not_bound() {
        let dir = tempfile::tempdir().unwrap();
        let tree = Tree::open(dir.path()).unwrap();
        let (same, changed, gone) = (
            dir.path().join("same"),
            dir.path().join("changed"),
            dir.path().join("gone"),
        );
        let pkg = dir.path().join("pkg");
        fs::create_dir_all(pkg.join("sub")).unwrap();
        for f in [&same, &changed, &gone] {
            fs::write(f, "v1").unwrap();
        }
        let id = |p: &Path| tree.identity(&fs::symlink_metadata(p).unwrap());
        let dirs = |root: &Path| {
            Expect::Dirs(vec![
                SnapshotDir {
                    rel: PathBuf::new(),
                    identity: id(root),
                    racy: false,
                },
                SnapshotDir {
                    rel: PathBuf::from("sub"),
                    identity: id(&root.join("sub")),
                    racy: false,
                },
            ])
        };
        let binds = vec![
            bind(dir.path(), same.clone(), Expect::File(id(&same))),
            bind(dir.path(), changed.clone(), Expect::File(id(&changed))),
            bind(dir.path(), gone.clone(), Expect::File(id(&gone))),
            bind(dir.path(), pkg.clone(), dirs(&pkg)),
        ];
        fs::write(&changed, "v2, longer").unwrap();
        fs::remove_file(&gone).unwrap();
        let all_same = confirm(binds.clone()[..1].to_vec(), Duration::from_secs(5));
        assert_eq!(all_same.binds.len(), 1);
        // A name added deep in a snapshot changes its directory.
        fs::write(pkg.join("sub/added.py"), "").unwrap();
        let c = confirm(binds, Duration::from_secs(5));
        assert_eq!(
            c.binds.iter().map(|b| &b.target).collect::<Vec<_>>(),
            vec![&same]
        );
        assert_eq!(c.stale, vec![changed, gone, pkg]);
        assert_eq!(c.unchecked, 0);
        // Nothing checked in time: nothing bound, nothing called stale.
        let late = confirm(
            vec![bind(dir.path(), same.clone(), Expect::File(id(&same)))],
            Duration::ZERO,
        );
        assert_eq!(
            (late.binds.len(), late.stale.len(), late.unchecked),
            (0, 0, 1)
        );
    }

    #[test]
    fn a_racy_directory_is_confirmed_by_its_names_not_its_mtime() {
        let dir = tempfile::tempdir().unwrap();
        let (net, local) = (dir.path().join("net"), dir.path().join("local"));
        for d in [&net, &local] {
            fs::create_dir(d).unwrap();
            fs::write(d.join("a.py"), "").unwrap();
        }
        let tree = Tree::open(dir.path()).unwrap();
        let identity = tree.identity(&fs::symlink_metadata(&net).unwrap());
        let expect = |racy| {
            vec![Bind {
                local: local.clone(),
                target: net.clone(),
                tree: dir.path().to_owned(),
                expect: Expect::Dirs(vec![SnapshotDir {
                    rel: PathBuf::new(),
                    identity,
                    racy,
                }]),
                lazy: false,
            }]
        };
        assert_eq!(confirm(expect(true), Duration::from_secs(5)).binds.len(), 1);
        // A name added; the directory's identity is then taken as it is now, as a
        // server keeping seconds would show the same identity as before.
        fs::write(net.join("b.py"), "").unwrap();
        let now = tree.identity(&fs::symlink_metadata(&net).unwrap());
        let expect_now = |racy| {
            let mut b = expect(racy);
            if let Expect::Dirs(d) = &mut b[0].expect {
                d[0].identity = now;
            }
            b
        };
        // Its identity vouches for it; only the names show the change.
        assert_eq!(
            confirm(expect_now(false), Duration::from_secs(5))
                .binds
                .len(),
            1
        );
        let c = confirm(expect_now(true), Duration::from_secs(5));
        assert_eq!((c.binds.len(), c.stale), (0, vec![net.clone()]));
    }
}
