//! Job-start consistency: before a job's first process runs, every local copy it is to
//! be given is checked against the network, so a job sees what a plain process on the
//! mount sees at that moment (a network filesystem's close-to-open promise) and hocus
//! adds no staleness of its own. A copied file must still have the identity it was
//! copied at; a snapshot, every entry it was taken from: a name added, removed or
//! renamed changes its directory, a file rewritten in place (another node's write)
//! changes only the file. The checks run in parallel, bounded in time: what is not
//! confirmed in time is not bound, and the job reads the network there.
//!
//! Each stat asks the server (`copy::stat_now`): an attribute cached by the client is
//! what the check must not trust. A snapshot is checked level by level, each entry
//! opened from its parent directory's descriptor: over a network every component looked
//! up is a round trip, and a job's start waits for them. A directory changed just before
//! its snapshot was stamped may change again without a new mtime (seconds on SFTP): its
//! names are compared with the snapshot's too.

use std::{
    collections::{HashMap, HashSet},
    ffi::CString,
    fs::File,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use super::vouch;
use crate::{
    cache::relay::Parent,
    redirect::mountns::{self, Bind, Expect},
    shared::{
        asked::{self, Asking, Purpose},
        identity::Identity,
        relay::{Hash, NOT_VOUCHED},
        tree::{Tree, stat_now},
        user::{AsUser, User},
    },
};

/// One check: the network path, the identity it must still have, and for a racy
/// directory the snapshot's copy of it, whose names it must still have. A snapshot's
/// entry also says where it is below the snapshot's root.
struct Item<'a> {
    bind: usize,
    path: PathBuf,
    entry: Option<&'a Path>,
    identity: &'a Identity,
    names_of: Option<PathBuf>,
}

impl Item<'_> {
    /// A snapshot's directory: held open for the entries below it.
    fn is_dir(&self) -> bool {
        self.entry.is_some() && self.identity.is_dir()
    }
}

/// Checks running at once: the network's round trip, not its bandwidth, is what a
/// stat costs.
const PARALLEL: usize = 32;

/// Directories held open for their subdirectories' checks at most: beyond, a directory
/// is looked up from the tree's root.
const HELD_OPEN: usize = 4096;

/// What the check found.
#[derive(Debug)]
pub struct Confirmed<B = Bind> {
    /// Still what the network holds: to bind.
    pub binds: Vec<B>,
    /// Changed or gone on the network (their copies are stale): a copied file, or in
    /// a snapshot the first entry found changed (the snapshot goes, and that file's
    /// own copy too).
    pub stale: Vec<PathBuf>,
    /// Not checked within the time allowed (not bound either).
    pub unchecked: usize,
    /// The entries `binds` were confirmed by: a copied file is one, a snapshot each
    /// file and directory it was taken from.
    pub entries: usize,
}

impl<B> Default for Confirmed<B> {
    fn default() -> Self {
        Self {
            binds: Vec::new(),
            stale: Vec::new(),
            unchecked: 0,
            entries: 0,
        }
    }
}

/// A snapshot's directory, held open (O_PATH) so that those below it are opened from
/// it: one lookup each, not a resolution of every component from the tree's root.
type Opened = HashMap<(usize, PathBuf), Arc<File>>;

/// A confirmation this recent is not asked of the server again: within the time a
/// network client trusts its cached attributes (NFS's acregmin is 3 s, sshfs's cache 1 s
/// in the tests), so a job sees nothing older than a plain process would.
pub const REUSE: Duration = Duration::from_secs(1);

/// How long a job's start may wait for its copies to be checked against the network;
/// what is not checked by then is not bound.
pub const JOB_START_CHECK: Duration = Duration::from_secs(2);

/// Binds confirmed lately, by (local copy, network path), with when their check began.
static RECENT: Mutex<Option<HashMap<(PathBuf, PathBuf), Instant>>> = Mutex::new(None);

fn recent_key(b: &Bind) -> (PathBuf, PathBuf) {
    (b.local.clone(), b.target.clone())
}

/// Binds given without asking the server for this job's start: confirmed by another
/// job's start on this node, or vouched for by the job's parent node; and the entries
/// the parent vouched for in all (of those binds, and of others it vouched for in part).
#[derive(Debug, Default, Clone, Copy)]
pub struct Reused {
    pub recent: usize,
    pub vouched: usize,
    pub vouched_entries: usize,
}

/// Like [`confirm`], for job starts that may come together (a Slurm step's tasks on a
/// node start at once, and each would ask the server the same thing): checks run one at
/// a time, and a bind confirmed less than [`REUSE`] ago is given without asking again.
/// A Slurm job's node asks its `parent` in the job's tree first (`vouch`), which
/// answers for what it checked against the server less than [`REUSE`] ago: a job's
/// start asks the server once for all its nodes. Of a snapshot the parent vouched for
/// in part, this node checks the rest of its entries. Returns also what was given so.
pub fn confirm_reusing(
    binds: Vec<Bind>,
    allowed: Duration,
    asking: Option<User>,
    parent: Option<&Parent>,
) -> (Confirmed, Reused) {
    let began = Instant::now();
    let deadline = began + allowed;
    // Waiting for the checks before (another job's start, a child's request) counts in
    // the time allowed: a server that does not answer holds each of them to its bound,
    // and a start waiting for all of them would not be bounded.
    let mut guard = loop {
        match RECENT.try_lock() {
            Ok(guard) => break guard,
            Err(std::sync::TryLockError::Poisoned(e)) => break e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(5));
            }
            Err(std::sync::TryLockError::WouldBlock) => {
                let unchecked = binds.len();
                let none = Confirmed {
                    unchecked,
                    ..Confirmed::default()
                };
                return (none, Reused::default());
            }
        }
    };
    let recent = guard.get_or_insert_with(HashMap::new);
    recent.retain(|_, at| began.saturating_duration_since(*at) < REUSE);
    let (fresh, to_check): (Vec<Bind>, Vec<Bind>) = binds
        .into_iter()
        .partition(|b| recent.contains_key(&recent_key(b)));
    let left = || deadline.saturating_duration_since(Instant::now());
    let vouched = match parent {
        // What is left of the time is this node's own to check what was not vouched for.
        Some(p) if !to_check.is_empty() => vouch::vouched_by(p, to_check, left() * 3 / 4, REUSE),
        _ => vouch::Vouched::none(to_check),
    };
    let checked = check_rest(vouched.rest, left(), asking);
    for (b, at) in &checked.binds {
        // As recent as the oldest of its checks.
        recent.insert(recent_key(b), at.map_or(began, |at| at.min(began)));
    }
    for (b, at) in &vouched.whole {
        recent.insert(recent_key(b), *at);
    }
    let reused = Reused {
        recent: fresh.len(),
        vouched: vouched.whole.len(),
        vouched_entries: vouched.entries,
    };
    let mut binds: Vec<Bind> = checked.binds.into_iter().map(|(b, _)| b).collect();
    binds.extend(fresh);
    binds.extend(vouched.whole.into_iter().map(|(b, _)| b));
    let checked = Confirmed {
        binds,
        stale: checked.stale,
        unchecked: checked.unchecked,
        entries: checked.entries,
    };
    (checked, reused)
}

/// Binds the parent did not vouch for whole, each checked against the network in what
/// it did not vouch for (of a snapshot, the rest of its entries): those confirmed, with
/// when the oldest check vouched for of each began.
fn check_rest(
    rest: Vec<(Bind, HashSet<PathBuf>, Option<Instant>)>,
    allowed: Duration,
    asking: Option<User>,
) -> Confirmed<(Bind, Option<Instant>)> {
    let mut left = HashMap::new();
    let mut to_check = Vec::new();
    for (b, rels, at) in rest {
        let mut part = b.clone();
        if let Expect::Snapshot(entries) = &mut part.expect {
            entries.retain(|e| !rels.contains(&e.rel));
        }
        left.insert(recent_key(&b), (b, at));
        to_check.push(part);
    }
    let checked = confirm(to_check, allowed, asking);
    Confirmed {
        binds: checked
            .binds
            .iter()
            .filter_map(|part| left.remove(&recent_key(part)))
            .collect(),
        stale: checked.stale,
        unchecked: checked.unchecked,
        entries: checked.entries,
    }
}

/// When the checks of `binds` that confirmed them began, where they are still recent.
fn checked_at(binds: &[&Bind]) -> Vec<Option<Instant>> {
    let guard = RECENT.lock().unwrap_or_else(|e| e.into_inner());
    binds
        .iter()
        .map(|b| {
            let at = *guard.as_ref()?.get(&recent_key(b))?;
            (at.elapsed() < REUSE).then_some(at)
        })
        .collect()
}

/// The answer to a child that asks this node to vouch for `items` (network paths and
/// digests of the identities its copies expect there) within `allowed`: for each, how
/// long ago (ms) the check of this node's own bind expecting the same there began, or
/// `NOT_VOUCHED`; and the copies found stale meanwhile, for the keeper to drop.
pub fn vouch_for(
    own: Vec<Bind>,
    items: &[(PathBuf, Hash)],
    allowed: Duration,
    parent: Option<&Parent>,
) -> (Vec<u32>, Vec<PathBuf>) {
    // Each path this node's copies expect, with what (a file copied on its own and in a
    // snapshot too: two binds).
    let mut expecting: HashMap<PathBuf, Vec<(Hash, usize)>> = HashMap::new();
    for (i, b) in own.iter().enumerate() {
        for (path, id, _) in vouch::expected(b) {
            expecting
                .entry(path)
                .or_default()
                .push((vouch::digest(id), i));
        }
    }
    let matched: Vec<Option<usize>> = items
        .iter()
        .map(|(path, d)| {
            let binds = expecting.get(path.as_path())?;
            binds.iter().find(|(e, _)| e == d).map(|&(_, i)| i)
        })
        .collect();
    let mut wanted: Vec<usize> = matched.iter().flatten().copied().collect();
    wanted.sort_unstable();
    wanted.dedup();
    let to_check: Vec<Bind> = wanted.iter().map(|&i| own[i].clone()).collect();
    let (checked, _) = confirm_reusing(to_check, allowed, None, parent);
    let confirmed: Vec<&Bind> = checked.binds.iter().collect();
    let began: HashMap<(&Path, &Path), Instant> = confirmed
        .iter()
        .zip(checked_at(&confirmed))
        .filter_map(|(b, at)| Some(((b.local.as_path(), b.target.as_path()), at?)))
        .collect();
    let ages = matched
        .iter()
        .map(|m| {
            m.and_then(|i| began.get(&(own[i].local.as_path(), own[i].target.as_path())))
                .map_or(NOT_VOUCHED, |at| {
                    at.elapsed().as_millis().min(u128::from(NOT_VOUCHED - 1)) as u32
                })
        })
        .collect();
    (ages, checked.stale)
}

/// Checks runs that may still be waiting for a server past their time, at most: a
/// server that does not answer blocks whoever asks it (a hard NFS mount, until it is
/// back), and each job start would leave its checks behind; beyond this many, a job's
/// copies are not checked (nor bound) until some come back.
const STUCK_AT_MOST: usize = 8;

/// Check runs not yet finished (`STUCK_AT_MOST`).
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// Checks `binds` against the network within `allowed`, whatever the network does: the
/// checks run on a thread of their own, and what they have not answered in time is
/// not bound (a silent server holds that thread, not the job).
///
/// What the network refuses to tell root is asked again as `asking` (the job's user)
/// where given: root may be squashed there, and may not even search a user's private
/// directory. What it refuses to tell them too is not bound, and its copy stays.
pub fn confirm(binds: Vec<Bind>, allowed: Duration, asking: Option<User>) -> Confirmed {
    let count = binds.len();
    let none = || Confirmed {
        unchecked: count,
        ..Confirmed::default()
    };
    if count == 0 {
        return Confirmed::default();
    }
    if IN_FLIGHT.fetch_add(1, Ordering::SeqCst) >= STUCK_AT_MOST {
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
        log::warn!(
            "job start: {STUCK_AT_MOST} checks of earlier jobs' copies still wait for the network (a server not answering?): this job's {count} local copies are not bound"
        );
        return none();
    }
    let deadline = Instant::now() + allowed;
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = thread::Builder::new()
        .name("hocus-confirm".into())
        .spawn(move || {
            let confirmed = confirm_until(binds, deadline, asking.as_ref());
            IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
            let _ = tx.send(confirmed);
        });
    if let Err(e) = spawned {
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
        log::warn!("job start: no thread to check the local copies ({e}): none bound");
        return none();
    }
    // A moment past the deadline: the checks stop taking items at it.
    match rx.recv_timeout(allowed + Duration::from_millis(100)) {
        Ok(confirmed) => confirmed,
        Err(_) => none(),
    }
}

/// The checks of [`confirm`], on its thread: each item started before `deadline`.
fn confirm_until(binds: Vec<Bind>, deadline: Instant, asking: Option<&User>) -> Confirmed {
    let mut trees: HashMap<PathBuf, Option<Tree>> = HashMap::new();
    for b in &binds {
        trees.entry(b.tree.clone()).or_insert_with(|| {
            // Nothing is checked (nor bound) through a tree it cannot open.
            let _asking = Asking::begin(&b.tree, Purpose::JobStart);
            Tree::open(&b.tree)
                .inspect_err(|e| mountns::say_not_bound(&b.tree, e))
                .ok()
        });
    }
    // One stat per item: a copied file, or one entry of a snapshot, by depth: the
    // items of a level are checked in parallel, each entry from its parent's
    // descriptor, opened on the level before.
    let mut levels: Vec<Vec<Item>> = Vec::new();
    let mut checks = vec![0usize; binds.len()];
    for (i, b) in binds.iter().enumerate() {
        match &b.expect {
            Expect::File(id) => {
                checks[i] = 1;
                at(
                    &mut levels,
                    0,
                    Item {
                        bind: i,
                        path: b.target.clone(),
                        entry: None,
                        identity: id,
                        names_of: None,
                    },
                );
            }
            Expect::Snapshot(entries) => {
                checks[i] = entries.len();
                for e in entries {
                    at(
                        &mut levels,
                        e.rel.components().count(),
                        Item {
                            bind: i,
                            path: b.target.join(&e.rel),
                            entry: Some(&e.rel),
                            identity: &e.identity,
                            names_of: (e.racy && e.identity.is_dir()).then(|| b.local.join(&e.rel)),
                        },
                    );
                }
            }
            Expect::Nothing => {}
        }
    }
    // Per bind: the checks passed, and the first path found changed.
    let results: Mutex<Vec<(usize, Option<PathBuf>)>> = Mutex::new(vec![(0, None); binds.len()]);
    let mut opened = Opened::new();
    for level in &levels {
        let next = AtomicUsize::new(0);
        let now_open = Mutex::new(Opened::new());
        thread::scope(|s| {
            for _ in 0..PARALLEL.min(level.len()) {
                s.spawn(|| {
                    while Instant::now() < deadline {
                        let Some(item) = level.get(next.fetch_add(1, Ordering::Relaxed)) else {
                            return;
                        };
                        let i = item.bind;
                        let _asking = Asking::begin(&binds[i].tree, Purpose::JobStart);
                        let tree = trees.get(&binds[i].tree).and_then(Option::as_ref);
                        let mut found = tree.map_or(Found::Unanswered, |t| check(t, item, &opened));
                        // Refused to root (squashed): asked again as the job's user.
                        if let (Found::Unanswered, Some(t), Some(user)) = (&found, tree, asking) {
                            if let Ok(_as_user) = AsUser::take(user) {
                                found = check(t, item, &opened);
                            }
                        }
                        let mut r = results.lock().unwrap();
                        match found {
                            Found::Same(fd) => {
                                r[i].0 += 1;
                                let mut held = now_open.lock().unwrap();
                                if let (Some(rel), Some(fd)) = (item.entry, fd) {
                                    if held.len() < HELD_OPEN {
                                        held.insert((i, rel.to_owned()), Arc::new(fd));
                                    }
                                }
                            }
                            Found::Changed => {
                                r[i].1.get_or_insert_with(|| item.path.clone());
                            }
                            Found::Unanswered => {}
                        }
                    }
                });
            }
        });
        // Only the level above is needed from here on.
        opened = now_open.into_inner().unwrap();
    }
    let results = results.into_inner().unwrap();
    let mut out = Confirmed::default();
    for ((b, (passed, changed)), needed) in binds.into_iter().zip(results).zip(checks) {
        if let Some(changed) = changed {
            out.stale.push(changed);
        } else if passed == needed && needed > 0 {
            out.entries += needed;
            out.binds.push(b);
        } else {
            out.unchecked += 1;
        }
    }
    out
}

fn at<'a>(levels: &mut Vec<Vec<Item<'a>>>, depth: usize, item: Item<'a>) {
    if levels.len() <= depth {
        levels.resize_with(depth + 1, Vec::new);
    }
    levels[depth].push(item);
}

/// What a check found of one item.
enum Found {
    /// As it was, with a snapshot's directory held open for those below it.
    Same(Option<File>),
    /// Changed, or gone.
    Changed,
    /// The network refused to say (permission): neither bound nor dropped.
    Unanswered,
}

/// Whether the item's path still has the identity its copy (or its snapshot) was made
/// at, and for a racy directory still the names of the snapshot's copy.
fn check(tree: &Tree, item: &Item, opened: &Opened) -> Found {
    match same(tree, item, opened) {
        Ok(Some(fd)) => Found::Same(fd),
        Ok(None) => Found::Changed,
        Err(e) if matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM)) => Found::Unanswered,
        Err(_) => Found::Changed,
    }
}

fn same(tree: &Tree, item: &Item, opened: &Opened) -> std::io::Result<Option<Option<File>>> {
    let parent = item
        .entry
        .and_then(|rel| Some((rel.parent()?, rel.file_name()?)))
        .and_then(|(parent, name)| Some((opened.get(&(item.bind, parent.to_owned()))?, name)));
    let fd = match parent {
        Some((parent, name)) => {
            let Ok(name) = CString::new(name.as_bytes()) else {
                return Ok(None);
            };
            // A file or link: its identity is all there is to check, in one call.
            if !item.is_dir() {
                let same = tree.identity_now_at(parent, &name)? == *item.identity;
                return Ok(same.then_some(None));
            }
            asked::asked();
            // SAFETY: a valid directory descriptor and C string; owned on success.
            let fd = unsafe {
                libc::openat(
                    parent.as_raw_fd(),
                    name.as_ptr(),
                    libc::O_PATH | libc::O_NOFOLLOW | libc::O_DIRECTORY | libc::O_CLOEXEC,
                )
            };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: as above.
            File::from(unsafe { OwnedFd::from_raw_fd(fd) })
        }
        None => File::from(tree.open_beneath(&item.path, libc::O_PATH)?),
    };
    let same = tree.identity(&stat_now(&fd)?) == *item.identity;
    let names_same = item.names_of.as_ref().is_none_or(|local| {
        let local_names = std::fs::read_dir(local).and_then(|entries| {
            entries
                .map(|e| e.map(|e| e.file_name()))
                .collect::<std::io::Result<std::collections::BTreeSet<_>>>()
        });
        matches!((tree.names(&item.path), local_names), (Ok(a), Ok(b)) if a == b)
    });
    Ok((same && names_same).then(|| item.is_dir().then_some(fd)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redirect::mountns::SnapshotEntry;
    use std::{fs, path::Path};

    fn bind(tree: &Path, target: PathBuf, expect: Expect) -> Bind {
        Bind {
            local: "/cache/x".into(),
            target,
            tree: tree.to_owned(),
            expect,
            lazy: false,
            passages: Vec::new(),
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
        let (pkg, lib) = (dir.path().join("pkg"), dir.path().join("lib"));
        for root in [&pkg, &lib] {
            fs::create_dir_all(root.join("sub")).unwrap();
            fs::write(root.join("sub/mod.py"), "v1").unwrap();
            std::os::unix::fs::symlink("mod.py", root.join("sub/link.py")).unwrap();
        }
        for f in [&same, &changed, &gone] {
            fs::write(f, "v1").unwrap();
        }
        let id = |p: &Path| tree.identity(&fs::symlink_metadata(p).unwrap());
        // Links are stamped as links (their target, when it is in the snapshot, has
        // its own entry).
        let snapshot = |root: &Path| {
            Expect::Snapshot(
                ["", "sub", "sub/mod.py", "sub/link.py"]
                    .into_iter()
                    .map(|rel| SnapshotEntry {
                        rel: PathBuf::from(rel),
                        identity: id(&root.join(rel)),
                        racy: false,
                    })
                    .collect(),
            )
        };
        let binds = vec![
            bind(dir.path(), same.clone(), Expect::File(id(&same))),
            bind(dir.path(), changed.clone(), Expect::File(id(&changed))),
            bind(dir.path(), gone.clone(), Expect::File(id(&gone))),
            bind(dir.path(), pkg.clone(), snapshot(&pkg)),
            bind(dir.path(), lib.clone(), snapshot(&lib)),
        ];
        fs::write(&changed, "v2, longer").unwrap();
        fs::remove_file(&gone).unwrap();
        let all_same = confirm(binds.clone()[..1].to_vec(), Duration::from_secs(5), None);
        assert_eq!(all_same.binds.len(), 1);
        let snapshots_same = confirm(binds.clone()[3..].to_vec(), Duration::from_secs(5), None);
        assert_eq!(snapshots_same.binds.len(), 2, "{snapshots_same:?}");
        // A name added deep in a snapshot changes its directory; a file rewritten in
        // place changes only itself.
        fs::write(pkg.join("sub/added.py"), "").unwrap();
        fs::write(lib.join("sub/mod.py"), "v2, longer").unwrap();
        let c = confirm(binds, Duration::from_secs(5), None);
        assert_eq!(
            c.binds.iter().map(|b| &b.target).collect::<Vec<_>>(),
            vec![&same]
        );
        assert_eq!(
            c.stale,
            vec![changed, gone, pkg.join("sub"), lib.join("sub/mod.py")]
        );
        assert_eq!(c.unchecked, 0);
        // Nothing checked in time: nothing bound, nothing called stale.
        let late = confirm(
            vec![bind(dir.path(), same.clone(), Expect::File(id(&same)))],
            Duration::ZERO,
            None,
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
                expect: Expect::Snapshot(vec![SnapshotEntry {
                    rel: PathBuf::new(),
                    identity,
                    racy,
                }]),
                lazy: false,
                passages: Vec::new(),
            }]
        };
        assert_eq!(
            confirm(expect(true), Duration::from_secs(5), None)
                .binds
                .len(),
            1
        );
        // A name added; the directory's identity is then taken as it is now, as a
        // server keeping seconds would show the same identity as before.
        fs::write(net.join("b.py"), "").unwrap();
        let now = tree.identity(&fs::symlink_metadata(&net).unwrap());
        let expect_now = |racy| {
            let mut b = expect(racy);
            if let Expect::Snapshot(d) = &mut b[0].expect {
                d[0].identity = now;
            }
            b
        };
        // Its identity vouches for it; only the names show the change.
        assert_eq!(
            confirm(expect_now(false), Duration::from_secs(5), None)
                .binds
                .len(),
            1
        );
        let c = confirm(expect_now(true), Duration::from_secs(5), None);
        assert_eq!((c.binds.len(), c.stale), (0, vec![net.clone()]));
    }

    fn named(tree: &Path, local: &str, target: PathBuf, expect: Expect) -> Bind {
        Bind {
            local: PathBuf::from("/cache").join(local),
            ..bind(tree, target, expect)
        }
    }

    #[test]
    fn a_node_vouches_only_for_what_its_own_copies_expect_and_still_hold() {
        let dir = tempfile::tempdir().unwrap();
        let tree = Tree::open(dir.path()).unwrap();
        let (same, changed) = (dir.path().join("same"), dir.path().join("changed"));
        for f in [&same, &changed] {
            fs::write(f, "v1").unwrap();
        }
        let pkg = dir.path().join("pkg");
        fs::create_dir_all(pkg.join("sub")).unwrap();
        fs::write(pkg.join("sub/mod.py"), "v1").unwrap();
        let id = |p: &Path| tree.identity(&fs::symlink_metadata(p).unwrap());
        let entry = |rel: &str| SnapshotEntry {
            rel: rel.into(),
            identity: id(&pkg.join("sub").join(rel)),
            racy: false,
        };
        // This node snapshotted pkg/sub; a child may have snapshotted pkg.
        let own = vec![
            named(dir.path(), "a", same.clone(), Expect::File(id(&same))),
            named(dir.path(), "b", changed.clone(), Expect::File(id(&changed))),
            named(
                dir.path(),
                "c",
                pkg.join("sub"),
                Expect::Snapshot(vec![entry(""), entry("mod.py")]),
            ),
        ];
        let mut other = id(&same);
        other.size += 1;
        let item = |p: &Path| (p.to_owned(), vouch::digest(&id(p)));
        let items = vec![
            item(&same),
            // Not what this node's copy expects: not vouched for, and not asked.
            (same.clone(), vouch::digest(&other)),
            item(&changed),
            // No copy of this node's.
            (dir.path().join("else"), [0; 32]),
            // The child's snapshot's entries: what this node's snapshot holds too.
            item(&pkg),
            item(&pkg.join("sub")),
            item(&pkg.join("sub/mod.py")),
        ];
        fs::write(&changed, "v2, longer").unwrap();
        let (ages, stale) = vouch_for(own, &items, Duration::from_secs(2), None);
        assert!(ages[0] < 1000, "{ages:?}");
        assert_eq!(&ages[1..5], [NOT_VOUCHED; 4]);
        assert!(ages[5] < 1000 && ages[6] < 1000, "{ages:?}");
        assert_eq!(stale, [changed]);
    }

    #[test]
    fn a_start_waits_for_the_checks_before_it_only_within_its_own_time() {
        let dir = tempfile::tempdir().unwrap();
        let tree = Tree::open(dir.path()).unwrap();
        let f = dir.path().join("f");
        fs::write(&f, "v1").unwrap();
        let id = tree.identity(&fs::symlink_metadata(&f).unwrap());
        let b = named(dir.path(), "waits", f, Expect::File(id));
        // Another check under way, held by a server that does not answer.
        let held = RECENT.lock().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let start = thread::spawn(move || {
            let _ = tx.send(confirm_reusing(
                vec![b],
                Duration::from_millis(300),
                None,
                None,
            ));
        });
        let given = rx.recv_timeout(Duration::from_secs(1));
        drop(held);
        start.join().unwrap();
        let (c, reused) = given.expect("the start waited past its 300 ms");
        assert_eq!((c.binds.len(), c.unchecked, reused.recent), (0, 1, 0));
    }

    #[test]
    fn of_a_snapshot_vouched_for_in_part_only_the_rest_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let tree = Tree::open(dir.path()).unwrap();
        let pkg = dir.path().join("pkg");
        fs::create_dir_all(pkg.join("sub")).unwrap();
        for f in ["a.py", "sub/b.py"] {
            fs::write(pkg.join(f), "v1").unwrap();
        }
        let snapshot = Expect::Snapshot(
            ["", "a.py", "sub", "sub/b.py"]
                .into_iter()
                .map(|rel| SnapshotEntry {
                    rel: rel.into(),
                    identity: tree.identity(&fs::symlink_metadata(pkg.join(rel)).unwrap()),
                    racy: false,
                })
                .collect(),
        );
        let b = bind(dir.path(), pkg.clone(), snapshot);
        let vouched: HashSet<PathBuf> =
            ["sub", "sub/b.py"].into_iter().map(PathBuf::from).collect();
        let at = Instant::now();
        // What was vouched for is taken as it was vouched: a change there is the
        // parent's to find (here it did not); the rest is asked of the network.
        fs::write(pkg.join("sub/b.py"), "v2, longer").unwrap();
        let c = check_rest(
            vec![(b.clone(), vouched.clone(), Some(at))],
            Duration::from_secs(5),
            None,
        );
        assert_eq!((c.binds.len(), c.entries, c.unchecked), (1, 2, 0), "{c:?}");
        assert_eq!(c.binds[0].1, Some(at));
        assert_eq!(c.binds[0].0, b, "the bind given is the whole snapshot");
        fs::write(pkg.join("a.py"), "v2, longer").unwrap();
        let c = check_rest(vec![(b, vouched, Some(at))], Duration::from_secs(5), None);
        assert_eq!((c.binds.len(), c.stale), (0, vec![pkg.join("a.py")]));
    }
}
