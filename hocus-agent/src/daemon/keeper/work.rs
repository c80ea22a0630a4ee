//! The keeper's hands: every blocking call it needs (a copy, a snapshot, the stats of a
//! revalidation, a tree walk, the mlock of a copy, the removal of a dropped snapshot)
//! runs here, on worker threads, and comes back as a [`Done`] message. The keeper itself
//! never waits on a filesystem.
//!
//! Two queues: copies, snapshots, pins and removals go to the copy workers; the checks
//! that ask the network about metadata (revalidation, measuring a tree) to a checker of
//! their own, so that they never wait behind thousands of copies.

use std::{
    collections::{HashMap, HashSet},
    fs,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, mpsc},
    thread,
    time::{Duration, Instant},
};

use tokio::sync::mpsc as tokio_mpsc;

use crate::{
    cache::{
        copy::{self, CopyError, Via},
        partial::{FillError, PartialCopy, filler::Growth},
        pins::{self, Mapped},
        relay::Parent,
        snapshot::{self, Fill, Stamp, Taken},
    },
    profile::extents::Extents,
    shared::{
        asked::{Asking, Purpose},
        identity::Identity,
        tree::Tree,
        user::User,
    },
};

/// A snapshot holds at most this many entries (directories, files, symlinks).
const SNAPSHOT_MAX_ENTRIES: usize = 200_000;

/// Something the keeper wants done.
pub enum Work {
    /// Copy `source` (in `tree`) to `dest`, reading as `reader`, if it is at most `room`
    /// bytes: from the job's `parent` node if there is one and it holds the file, else
    /// from the network. With `ranges`, a partial copy holding them, from the network.
    Copy {
        source: String,
        tree: PathBuf,
        reader: User,
        dest: PathBuf,
        room: u64,
        parent: Option<Arc<Parent>>,
        ranges: Option<Extents>,
    },
    /// Serve again the partial copy `dest` of `source` (in `tree`, read as `reader`) a
    /// previous daemon made of version `made_of`, if the network file is still that.
    Resume {
        source: String,
        tree: PathBuf,
        reader: User,
        dest: PathBuf,
        made_of: Identity,
    },
    /// Take a snapshot of `root` (in `tree`) into `dest`, linking the cache's valid copies.
    Snapshot {
        root: PathBuf,
        tree: PathBuf,
        fill: Fill,
        /// The most bytes it may fill.
        room: u64,
        dest: PathBuf,
        cached: HashMap<PathBuf, (PathBuf, Identity)>,
    },
    /// Fill what the served partial copy of `source` lacks of `ranges` from the network.
    Grow {
        source: String,
        growth: Growth,
        ranges: Extents,
    },
    /// Map and lock the local copy `local` of `source` (held in part: its ranges only).
    Pin {
        source: String,
        local: PathBuf,
        in_part: bool,
    },
    /// Delete a local tree already moved out of the way (a dropped snapshot).
    Remove(PathBuf),
    /// Compare these copies and snapshots with the network.
    Revalidate {
        copies: Vec<(String, Identity)>,
        /// Each snapshot's root, stamp and passages (`snapshot::Taken::passages`).
        snapshots: Vec<(PathBuf, Stamp, HashSet<PathBuf>)>,
        /// The watched trees, beneath which the snapshots' trees are walked.
        trees: Vec<PathBuf>,
    },
    /// Find the highest directory of `chain` (top first) that a snapshot can hold within
    /// `room` bytes.
    Measure {
        tree: PathBuf,
        chain: Vec<PathBuf>,
        fill: Fill,
        room: u64,
    },
}

/// What came of a piece of work.
pub enum Done {
    Copied(String, Result<Copied, CopyError>, Origin),
    /// A partial copy found at the start, served again (its reader's uid with it).
    Resumed(String, u32, Result<Copied, CopyError>),
    Snapshotted(PathBuf, Result<(Stamp, Taken), CopyError>),
    Pinned(String, std::io::Result<Mapped>),
    Grown(String, Result<(), FillError>),
    /// The copies and snapshots that differ from the network now (gone ones too).
    Revalidated {
        changed: Vec<String>,
        changed_trees: Vec<PathBuf>,
    },
    /// The directory to snapshot and its bytes, if any, and those found unsuitable.
    Measured {
        chain: Vec<PathBuf>,
        chosen: Option<(PathBuf, u64)>,
        unsuitable: Vec<PathBuf>,
    },
}

/// A copy made: the version of the network file it is of, and for a partial copy, what
/// serves it and its file (open, to be marked).
pub struct Copied {
    pub identity: Identity,
    pub partial: Option<(PartialCopy, fs::File)>,
}

impl Copied {
    /// A partial copy made (or served again).
    fn partial((identity, copy, file): (Identity, PartialCopy, fs::File)) -> Self {
        Self {
            identity,
            partial: Some((copy, file)),
        }
    }
}

/// How many of a copy's bytes came from the parent node, and how long it waited on it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Origin {
    pub from_peer: u64,
    pub waited: Duration,
}

/// Where the keeper sends work.
pub struct Workers {
    copies: mpsc::Sender<Work>,
    checks: mpsc::Sender<Work>,
}

impl Workers {
    /// Starts `copy_workers` copy threads and one checker; their results go to `done`.
    pub fn start(
        copy_workers: usize,
        tmp: &Path,
        done: tokio_mpsc::UnboundedSender<Done>,
    ) -> std::io::Result<Self> {
        let (copies, copy_queue) = mpsc::channel::<Work>();
        let copy_queue = Arc::new(Mutex::new(copy_queue));
        for i in 0..copy_workers.max(1) {
            pool_thread(format!("hocus-copy-{i}"), &copy_queue, tmp, &done)?;
        }
        let (checks, check_queue) = mpsc::channel::<Work>();
        pool_thread(
            "hocus-check".into(),
            &Arc::new(Mutex::new(check_queue)),
            tmp,
            &done,
        )?;
        Ok(Self { copies, checks })
    }

    pub fn send(&self, work: Work) {
        let queue = match work {
            Work::Revalidate { .. } | Work::Measure { .. } => &self.checks,
            _ => &self.copies,
        };
        // The workers end only when the keeper drops this sender.
        let _ = queue.send(work);
    }
}

fn pool_thread(
    name: String,
    queue: &Arc<Mutex<mpsc::Receiver<Work>>>,
    tmp: &Path,
    done: &tokio_mpsc::UnboundedSender<Done>,
) -> std::io::Result<()> {
    let (queue, tmp, done) = (Arc::clone(queue), tmp.to_owned(), done.clone());
    thread::Builder::new().name(name).spawn(move || {
        loop {
            let work = match queue.lock().map(|q| q.recv()) {
                Ok(Ok(work)) => work,
                _ => break,
            };
            if let Some(result) = run(work, &tmp) {
                if done.send(result).is_err() {
                    break;
                }
            }
        }
    })?;
    Ok(())
}

impl Work {
    /// What its calls on the network are counted as (`shared::asked`); a growth counts
    /// as a fill (`PartialCopy::counted_under`), the checks per tree as they go.
    fn asking(&self) -> Option<Asking> {
        match self {
            Work::Copy { tree, .. } | Work::Resume { tree, .. } => {
                Some(Asking::begin(tree, Purpose::Copy))
            }
            Work::Snapshot { tree, .. } | Work::Measure { tree, .. } => {
                Some(Asking::begin(tree, Purpose::Snapshot))
            }
            _ => None,
        }
    }
}

/// Does one piece of work; what it found, if the keeper needs to know.
fn run(work: Work, tmp: &Path) -> Option<Done> {
    let _asking = work.asking();
    Some(match work {
        Work::Copy {
            source,
            tree,
            reader,
            dest,
            room,
            parent,
            ranges,
        } => {
            let copying = copy::Copying {
                tree: &tree,
                source: source.as_ref(),
                reader: &reader,
                tmp_dir: tmp,
                dest: &dest,
                room,
            };
            let copy = |via| {
                copy::copy(&copying, via).map(|identity| Copied {
                    identity,
                    partial: None,
                })
            };
            let mut origin = Origin::default();
            let parent = parent.as_deref().filter(|p| !p.has_failed());
            if let Some(ranges) = ranges {
                let via = parent.map_or(Via::Network, Via::Parent);
                let made =
                    copy::copy_partial(&copying, &ranges, via).map(|(id, copy, file, peer)| {
                        origin.from_peer = peer;
                        Copied::partial((id, copy, file))
                    });
                return Some(Done::Copied(source, made, origin));
            }
            let result = match parent {
                Some(p) => {
                    let started = Instant::now();
                    let got = copy(Via::Parent(p));
                    origin.waited = started.elapsed();
                    match got {
                        Err(CopyError::Peer(miss)) => {
                            log::debug!("{source}: {miss}; from the network");
                            copy(Via::Network)
                        }
                        got => {
                            if let Ok(c) = &got {
                                origin.from_peer = c.identity.size;
                            }
                            got
                        }
                    }
                }
                None => copy(Via::Network),
            };
            Done::Copied(source, result, origin)
        }
        Work::Resume {
            source,
            tree,
            reader,
            dest,
            made_of,
        } => {
            let resumed = copy::resume_partial(&tree, source.as_ref(), &reader, &dest, &made_of);
            Done::Resumed(source, reader.uid, resumed.map(Copied::partial))
        }
        Work::Snapshot {
            root,
            tree,
            fill,
            room,
            dest,
            cached,
        } => {
            let cached = |p: &Path| cached.get(p).cloned();
            let limits = snapshot::Limits {
                bytes: room,
                entries: SNAPSHOT_MAX_ENTRIES,
            };
            let result = snapshot::take(&tree, &root, &fill, limits, &dest, tmp, &cached);
            Done::Snapshotted(root, result)
        }
        Work::Pin {
            source,
            local,
            in_part,
        } => Done::Pinned(source, pins::map_locked(&local, in_part)),
        Work::Grow {
            source,
            growth,
            ranges,
        } => Done::Grown(source, growth.fill(&ranges)),
        Work::Remove(dir) => {
            if let Err(e) = fs::remove_dir_all(&dir) {
                log::warn!("could not delete {}: {e}", dir.display());
            }
            return None;
        }
        Work::Revalidate {
            copies,
            snapshots,
            trees,
        } => {
            // A copy is valid while the network file keeps its identity. Each tree is
            // opened once for the whole check.
            let asking = |tree: &Path| Asking::begin(tree, Purpose::Revalidation);
            let opened: Vec<Tree> = trees
                .iter()
                .filter_map(|t| {
                    let _asking = asking(t);
                    Tree::open(t).ok()
                })
                .collect();
            let changed = copies
                .into_iter()
                .filter(|(source, identity)| {
                    let path = Path::new(source);
                    let now = opened
                        .iter()
                        .find(|t| path.starts_with(t.path()))
                        .and_then(|t| {
                            let _asking = asking(t.path());
                            Some(t.identity(&t.stat(path).ok()?))
                        });
                    now.as_ref() != Some(identity)
                })
                .map(|(source, _)| source)
                .collect();
            let changed_trees = snapshots
                .into_iter()
                .filter(|(root, stamp, passages)| {
                    let tree = trees.iter().find(|t| root.starts_with(t));
                    let now = tree.and_then(|t| {
                        let _asking = asking(t);
                        snapshot::stamp(t, root, passages).ok()
                    });
                    now.as_ref() != Some(stamp)
                })
                .map(|(root, _, _)| root)
                .collect();
            Done::Revalidated {
                changed,
                changed_trees,
            }
        }
        Work::Measure {
            tree,
            chain,
            fill,
            room,
        } => {
            let mut unsuitable = Vec::new();
            let mut chosen = None;
            for root in &chain {
                let limits = snapshot::Limits {
                    bytes: room,
                    entries: SNAPSHOT_MAX_ENTRIES,
                };
                match snapshot::measure(&tree, root, &fill, limits) {
                    Some((bytes, _)) => {
                        chosen = Some((root.clone(), bytes));
                        break;
                    }
                    None => unsuitable.push(root.clone()),
                }
            }
            Done::Measured {
                chain,
                chosen,
                unsuitable,
            }
        }
    })
}
