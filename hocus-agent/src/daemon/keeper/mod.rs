//! The keeper holds the working set close: it applies placements (copies to the SSD
//! cache, pins in RAM, evictions), keeps copies consistent with the network (revalidation
//! at an interval, invalidation at once when the tracer sees a change), and counts where
//! the bytes jobs read would come from. It runs on its own thread, with a pool of copy
//! workers; the daemon's loop talks to it only through [`Handle`], whose every wait is
//! bounded, so that loop never waits on the network.

mod decide;
mod file_index;
mod handle;
mod prefetch;
mod served;
mod snapshots;
mod work;

pub use handle::{Handle, KeeperError};

use std::{
    collections::{HashMap, HashSet, VecDeque},
    path::{Path, PathBuf},
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use anyhow::Result;
use memmap2::Mmap;
use tokio::sync::{mpsc as tokio_mpsc, oneshot};

use self::{
    decide::{Held, Known},
    file_index::FileIndex,
    prefetch::Watcher,
    snapshots::Snapshot,
    work::{Done, Work, Workers},
};
use crate::{
    cache::{copy::CopyError, directory::Cache, pins::Pins, relay::Parent},
    observe::events::Access,
    place::{budget::Budgets, placement::Filters},
    profile::{
        format::Profile,
        view::{File, View},
    },
    redirect::{
        jobs::{Job, JobStart},
        mountns::{self, Bind, Expect, SnapshotDir},
    },
    shared::{
        identity::Identity,
        log_line::{self as logs, Process},
        memory,
        relay::Holding,
        settings::Settings,
        size::human,
        user::User,
    },
};
use hocus_control::status::{CacheStatus, Progress, Served};

/// How often the cache index is written while it changes.
const INDEX_SAVE_INTERVAL: Duration = Duration::from_secs(1);
/// A revalidation that changed nothing places the working set again only this long
/// after the last placement.
const PLACE_AGAIN_ANYWAY: Duration = Duration::from_secs(300);
/// Entries of a working set's view past which a placement gives freed memory back (a
/// few milliseconds then; nothing for a job's few thousand files).
const BIG_VIEW: usize = 50_000;
/// Copies handed to the workers at once. The rest of a placement's copies wait their
/// turn as a path and a size each, not as queued work holding a path, a tree, a reader
/// and a destination each: a site-wide profile's 100k copies cost ~50 MiB that way.
const COPIES_AT_ONCE: usize = 1024;

pub struct Config {
    pub cache_dir: PathBuf,
    pub ssd_budget: u64,
    pub ram_budget: u64,
    pub filters: Filters,
    pub revalidate: Duration,
    pub trees: Vec<PathBuf>,
    pub copy_workers: usize,
    /// Snapshots hold every file's bytes, even where lazy ones would work.
    pub whole_snapshots: bool,
}

impl Config {
    /// The keeper's part of the settings; the watched trees are set once known.
    pub fn of(settings: &Settings) -> Result<Config> {
        let budgets = Budgets::of(settings)?;
        Ok(Config {
            cache_dir: settings.cache_dir(),
            ssd_budget: budgets.ssd,
            ram_budget: budgets.ram,
            filters: Filters::of(settings),
            revalidate: settings.revalidate(),
            trees: Vec::new(),
            copy_workers: settings.copy_workers.unwrap_or(8),
            whole_snapshots: settings.whole_snapshots.unwrap_or(false),
        })
    }
}

/// Live settings (SIGHUP).
pub struct Reconfigure {
    pub ssd_budget: u64,
    pub ram_budget: u64,
    pub filters: Filters,
    pub revalidate: Duration,
}

/// The newest working set waiting to be placed.
pub(super) type Latest = std::sync::Arc<std::sync::Mutex<Option<View>>>;

pub enum Order {
    /// The working set changed: place its latest version (in `Latest`) again. At most
    /// one is queued: a keeper behind on placements skips to the newest.
    PlaceLatest,
    /// The tracer saw the file written, truncated, renamed or unlinked.
    Invalidate(String),
    /// A process opened, failed to find or read a watched file.
    Access(Access),
    Reconfigure(Reconfigure),
    /// Place these files now and report progress until their copies are done; copies
    /// come from the job's parent node first, if there is one (docs/fanout.md).
    Prefetch(Profile, Progressing, Option<Arc<Parent>>),
    /// Where this node's copy of a file is, for a job's other node asking for it.
    LocalCopy(String, oneshot::Sender<Holding>),
    Status(oneshot::Sender<CacheStatus>),
    /// Where each file is held: "ram", "ssd" or "network".
    WhereHeld(Vec<String>, oneshot::Sender<Vec<String>>),
    /// New budgets (bytes); pins and copies beyond them are released.
    Budgets {
        ssd: Option<u64>,
        ram: Option<u64>,
    },
    /// The binds a new job's namespace gets: every valid copy.
    Binds(oneshot::Sender<Vec<Bind>>),
    /// A job starts in its mount namespace with its binds (an attached Slurm task's job
    /// is counted per Slurm job too); answered once it is registered, so that the job's
    /// first opens find it.
    JobStarting(JobStart, oneshot::Sender<()>),
    JobEnded {
        id: u32,
    },
    /// A job tried to write the file through its read-only copy: never redirect it again.
    Refused(String),
    Stop,
}

/// Where a prefetch's progress goes.
pub type Progressing = tokio_mpsc::UnboundedSender<Progress>;

/// Orders waiting for the keeper; a daemon loop sending more waits (bounded memory).
const ORDER_QUEUE: usize = 4096;

/// Starts the keeper; orders go in through the returned handle.
pub fn start(config: Config) -> Result<(Handle, thread::JoinHandle<()>)> {
    let (cache, repairs) = Cache::open(&config.cache_dir)?;
    if repairs != Default::default() {
        log::info!(
            "cache {}: removed {} unfinished copies, dropped {} index entries without their file, deleted {} files without an entry",
            config.cache_dir.display(),
            repairs.temporary_removed,
            repairs.entries_dropped,
            repairs.strays_removed
        );
    }
    log::info!(
        "cache in {} ({} files, {}): SSD budget {}, RAM budget {}",
        config.cache_dir.display(),
        cache.len(),
        human(cache.used()),
        human(config.ssd_budget),
        human(config.ram_budget)
    );
    // Results are few per job sent (one per copy, snapshot, pin or check): unbounded,
    // so that a worker never waits on the keeper.
    let (done_tx, done_rx) = tokio_mpsc::unbounded_channel::<Done>();
    let (order_tx, order_rx) = tokio_mpsc::channel::<Order>(ORDER_QUEUE);
    let lazy_views = if config.whole_snapshots {
        log::info!("snapshots copy every file of their tree (whole-snapshots)");
        false
    } else {
        lazy_views_here(cache.tmp_dir())
    };
    let workers = Workers::start(config.copy_workers, cache.tmp_dir(), done_tx)?;
    let unverified = cache.sources().map(|(s, _)| s.clone()).collect();
    let latest = Latest::default();
    let mut keeper = Keeper {
        latest: latest.clone(),
        effective_ssd_budget: config.ssd_budget,
        lazy_views,
        config,
        cache,
        pins: Pins::new(),
        workers,
        pinning: HashMap::new(),
        revalidating: false,
        placed_at: Instant::now(),
        unverified,
        trees_removed: 0,
        measuring: HashSet::new(),
        in_flight: HashMap::new(),
        queued: VecDeque::new(),
        wanted: Vec::new(),
        unstable: HashMap::new(),
        failed: HashMap::new(),
        view: View::default(),
        file_index: FileIndex::default(),
        snapshots: HashMap::new(),
        snapshots_in_flight: HashMap::new(),
        unsuitable: HashMap::new(),
        prefetches: Vec::new(),
        parent: None,
        jobs: HashMap::new(),
        refused: HashSet::new(),
        last_opener: HashMap::new(),
        status: CacheStatus::default(),
    };
    keeper.status.served = keeper
        .config
        .trees
        .iter()
        .map(|root| Served {
            root: root.clone(),
            ..Default::default()
        })
        .collect();
    let handle = thread::Builder::new()
        .name("hocus-keeper".into())
        .spawn(move || keeper.run(order_rx, done_rx))?;
    Ok((Handle::new(order_tx, latest), handle))
}

/// Whether this kernel shows lazy snapshots, said in the log either way.
fn lazy_views_here(tmp: &std::path::Path) -> bool {
    match mountns::lazy_views_work(tmp) {
        Ok(()) => {
            log::info!(
                "snapshots are lazy: they hold the working set's bytes, and the other files are read from the network when opened (overlayfs, the network as a data-only layer)"
            );
            true
        }
        Err(e) => {
            log::info!(
                "snapshots copy every file of their tree: this kernel cannot show lazy ones ({e}; overlayfs with data-only layers given as descriptors needs Linux 6.13)"
            );
            false
        }
    }
}

struct Keeper {
    /// The newest working set to place (see `Order::PlaceLatest`).
    latest: Latest,
    config: Config,
    /// The SSD budget, lowered when the cache filesystem turned out to be full.
    effective_ssd_budget: u64,
    /// Snapshots may leave cold files on the network (`mountns::lazy_view` works here).
    lazy_views: bool,
    cache: Cache,
    pins: Pins,
    workers: Workers,
    /// Pins being made: source -> size.
    pinning: HashMap<String, u64>,
    /// A revalidation is under way.
    revalidating: bool,
    /// When the working set was last placed.
    placed_at: Instant,
    /// Copies found in the cache at start and not revalidated yet: never bound.
    unverified: HashSet<String>,
    /// Snapshot trees handed to a worker for removal (names them apart in tmp/).
    trees_removed: u64,
    /// Chains of directories (by their top) being measured for a snapshot.
    measuring: HashSet<PathBuf>,
    /// Copies under way: source -> expected size.
    in_flight: HashMap<String, u64>,
    /// The last placement's copies not started yet, in its order (`COPIES_AT_ONCE`), by
    /// their place in the view.
    queued: VecDeque<u32>,
    /// The last placement, by place in the view: each file wanted, and whether it is to
    /// be pinned. Indices, not paths: a site-wide placement wants 100k files.
    wanted: Vec<Option<bool>>,
    /// Files seen changing, and when: they are fetched again once stable.
    unstable: HashMap<String, Instant>,
    /// Files whose copy failed, and when: retried after a while.
    failed: HashMap<String, Instant>,
    /// The last view of the working set, and where each file is in it.
    view: View,
    file_index: FileIndex,
    /// Snapshots of whole trees, by network directory.
    snapshots: HashMap<PathBuf, Snapshot>,
    /// Snapshots being taken, with their expected bytes.
    snapshots_in_flight: HashMap<PathBuf, u64>,
    /// Directories found unsuitable for a snapshot (too big, odd entries), and when.
    unsuitable: HashMap<PathBuf, Instant>,
    prefetches: Vec<Watcher>,
    /// The job's parent node the prefetches under way copy from first.
    parent: Option<Arc<Parent>>,
    jobs: HashMap<u32, Job>,
    /// Files jobs tried to write: left on the network from then on.
    refused: HashSet<String>,
    /// The process that last opened each file: a copy's log line names it.
    last_opener: HashMap<String, Process>,
    status: CacheStatus,
}

impl Keeper {
    /// The keeper's loop, on its own thread: orders from the daemon, results from the
    /// workers, and the timers of revalidation and index saves.
    fn run(
        &mut self,
        mut orders: tokio_mpsc::Receiver<Order>,
        mut results: tokio_mpsc::UnboundedReceiver<Done>,
    ) {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
        {
            Ok(r) => r,
            Err(e) => {
                log::error!("the cache keeper cannot run: {e}");
                return;
            }
        };
        runtime.block_on(async {
            // The copies found at start are checked at once.
            let mut next_check = Instant::now();
            let mut last_save = Instant::now();
            loop {
                let timeout = next_check
                    .saturating_duration_since(Instant::now())
                    .min(INDEX_SAVE_INTERVAL);
                tokio::select! {
                    // Results first: they free budget and finish prefetches.
                    biased;
                    Some(done) = results.recv() => self.done(done),
                    order = orders.recv() => match order {
                        None | Some(Order::Stop) => break,
                        Some(order) => self.obey(order),
                    },
                    () = tokio::time::sleep(timeout) => {}
                }
                self.tick(&mut next_check, &mut last_save);
            }
        });
        self.release_jobs();
        self.cache.save_now();
    }

    /// The daemon stops: the jobs that outlive it read the network from now on, as
    /// nobody is left to take a copy away when its file changes there.
    fn release_jobs(&mut self) {
        let (jobs, mut binds) = (self.jobs.len(), 0);
        for (pid, job) in self.jobs.drain() {
            let targets: Vec<PathBuf> = job.binds.iter().map(|b| b.target.clone()).collect();
            match mountns::detach_in(&job.ns, &targets) {
                Ok(n) => binds += n,
                Err(e) => {
                    log::warn!("stopping: could not take the local copies out of job {pid}: {e}")
                }
            }
        }
        if binds > 0 {
            log::info!(
                "stopping: took {binds} local copies out of {jobs} running jobs; they read the network until they end"
            );
        }
    }

    /// A worker finished something.
    fn done(&mut self, done: Done) {
        match done {
            Done::Copied(source, result, origin) => {
                if origin.peer {
                    if let Ok(id) = &result {
                        self.status.copied_from_peers_bytes += id.size;
                    }
                }
                self.status.peer_wait_ms += origin.waited.as_millis() as u64;
                self.copied(source, result)
            }
            Done::Snapshotted(root, result) => self.snapshotted(root, result),
            Done::Pinned(source, result) => self.pinned(source, result),
            Done::Revalidated {
                changed,
                changed_trees,
            } => self.revalidated(changed, changed_trees),
            Done::Measured {
                chain,
                chosen,
                unsuitable,
            } => self.measured(chain, chosen, unsuitable),
        }
    }

    /// Revalidates and saves the index when they are due.
    fn tick(&mut self, next_check: &mut Instant, last_save: &mut Instant) {
        if Instant::now() >= *next_check {
            self.revalidate();
            *next_check = Instant::now() + self.config.revalidate;
        }
        // The index is rewritten whole: at most once a second, not once per copy (a crash
        // loses the entries of the last second; their files are then removed as strays at
        // the next start).
        if last_save.elapsed() >= INDEX_SAVE_INTERVAL {
            self.cache.save();
            *last_save = Instant::now();
        }
    }

    fn obey(&mut self, order: Order) {
        match order {
            Order::PlaceLatest => {
                let latest = self.latest.lock().map(|mut l| l.take()).ok().flatten();
                if let Some(view) = latest {
                    // The view it replaces is freed: a large one goes back to the system.
                    let large = view.len() + view.missing.len() > BIG_VIEW;
                    self.remember(view);
                    if self.drop_outgrown() {
                        // Trees first: files under one being taken are copied by it.
                        self.consider_snapshots();
                    }
                    self.place();
                    if large {
                        memory::give_back();
                    }
                }
            }
            Order::Prefetch(profile, tx, parent) => {
                self.remember(View::from(profile));
                self.drop_outgrown();
                if parent.is_some() {
                    // From a parent node, file by file: the snapshots then link them.
                    self.parent = parent;
                    self.place();
                    self.consider_snapshots();
                } else {
                    // Trees first: files under one being measured are copied by its
                    // snapshot.
                    self.consider_snapshots();
                    self.place();
                }
                let remaining: HashSet<String> = self.in_flight.keys().cloned().collect();
                let trees: HashSet<PathBuf> = self.snapshots_in_flight.keys().cloned().collect();
                let progress = Progress {
                    files_total: remaining.len(),
                    bytes_total: remaining.iter().map(|s| self.in_flight[s]).sum(),
                    trees_total: trees.len(),
                    tree_bytes_total: trees.iter().map(|t| self.snapshots_in_flight[t]).sum(),
                    ..Default::default()
                };
                self.status.prefetches += 1;
                let mut w = Watcher {
                    remaining,
                    trees,
                    progress,
                    tx,
                };
                if w.remaining.is_empty() && w.trees.is_empty() && !self.settling() {
                    self.finish(&mut w);
                } else {
                    let _ = w.tx.send(w.progress.clone());
                    self.prefetches.push(w);
                }
            }
            Order::Refused(source) => {
                if let Some(root) = self.snapshot_of(Path::new(&source)) {
                    self.drop_snapshot(&root, "a job tried to write in it");
                }
                self.drop_copy(&source);
                self.refused.insert(source);
            }
            Order::Invalidate(source) => {
                // A passage shows the network itself: what changes there is seen as is.
                if let Some(root) = self
                    .snapshot_of(Path::new(&source))
                    .filter(|_| !self.in_passage(Path::new(&source)))
                {
                    self.drop_snapshot(&root, &format!("{source} changed"));
                    self.unstable
                        .insert(root.to_string_lossy().into_owned(), Instant::now());
                }
                if self.cache.contains(&source) || self.in_flight.contains_key(&source) {
                    self.status.invalidations += 1;
                    log::info!("{source} changed: dropping its copy");
                }
                self.drop_copy(&source);
                self.unstable.insert(source, Instant::now());
            }
            Order::Access(access) => self.served(access),
            Order::Reconfigure(r) => {
                self.config.filters = r.filters;
                self.config.revalidate = r.revalidate;
                log::info!(
                    "settings reloaded: revalidating every {} s",
                    r.revalidate.as_secs()
                );
                self.set_budgets(Some(r.ssd_budget), Some(r.ram_budget));
            }
            Order::Status(tx) => {
                let _ = tx.send(self.status());
            }
            Order::LocalCopy(source, tx) => {
                let held = if self.cache.contains(&source) && !self.unverified.contains(&source) {
                    Holding::Copy(self.cache.local(&source))
                } else if self.in_flight.contains_key(&source)
                    || (!self.queued.is_empty() && self.wanted(&source).is_some())
                    || self.snapshot_coming(Path::new(&source))
                    || !self.prefetches.is_empty()
                {
                    Holding::Coming
                } else {
                    Holding::No
                };
                let _ = tx.send(held);
            }
            Order::WhereHeld(paths, tx) => {
                let held = paths.iter().map(|p| {
                    if self.pins.is_pinned(p) {
                        "ram"
                    } else if self.cache.contains(p) || self.in_snapshot(Path::new(p)) {
                        "ssd"
                    } else {
                        "network"
                    }
                });
                let _ = tx.send(held.map(str::to_owned).collect());
            }
            Order::Budgets { ssd, ram } => self.set_budgets(ssd, ram),
            Order::Binds(tx) => {
                // Each with what the network held when it was made: checked as the job
                // starts (redirect::confirm).
                let trees = self.snapshots.iter().map(|(root, snap)| Bind {
                    local: snap.local.clone(),
                    target: root.clone(),
                    tree: snap.tree.clone(),
                    expect: Expect::Dirs(
                        snap.stamp
                            .iter()
                            .filter(|(_, id)| id.mode & libc::S_IFMT == libc::S_IFDIR)
                            .map(|(rel, id)| SnapshotDir {
                                rel: rel.clone(),
                                identity: *id,
                                racy: snap.racy.contains(rel),
                            })
                            .collect(),
                    ),
                    lazy: snap.lazy,
                    passages: snap.passages.iter().cloned().collect(),
                });
                // A snapshot still being taken is not bound yet: its files are, meanwhile,
                // as are those in its passages (bound after it). Copies from before a
                // restart are bound only once revalidated.
                let files = self
                    .cache
                    .sources()
                    .filter(|(source, _)| !self.unverified.contains(*source))
                    .filter(|(source, _)| !self.in_snapshot(Path::new(source)))
                    .filter_map(|(source, cached)| {
                        let tree = self.tree_of(Path::new(source))?;
                        Some(Bind {
                            local: self.cache.local(source),
                            target: PathBuf::from(source),
                            tree: tree.clone(),
                            expect: Expect::File(cached.identity),
                            lazy: false,
                            passages: Vec::new(),
                        })
                    });
                let _ = tx.send(trees.chain(files).collect());
            }
            Order::JobStarting(start, ack) => {
                let id = start.id;
                let mut job = Job::new(start.ns, start.binds, |b| self.cache.is_snapshot(&b.local));
                if let Some(task) = start.slurm {
                    job.slurm_job = Some(task.job_id);
                    served::task_started(&mut self.status.slurm_jobs, task);
                }
                self.jobs.insert(id, job);
                self.status.jobs_started += 1;
                let _ = ack.send(());
            }
            Order::JobEnded { id } => {
                if let Some(j) = self.jobs.remove(&id).and_then(|j| j.slurm_job) {
                    served::task_ended(&mut self.status.slurm_jobs, j);
                }
            }
            Order::Stop => {}
        }
    }

    /// New budgets (bytes); copies and pins beyond them are released.
    fn set_budgets(&mut self, ssd: Option<u64>, ram: Option<u64>) {
        if let Some(ssd) = ssd {
            self.config.ssd_budget = ssd;
            self.effective_ssd_budget = ssd;
        }
        if let Some(ram) = ram {
            self.config.ram_budget = ram;
        }
        log::info!(
            "budgets now: SSD {}, RAM {}",
            human(self.effective_ssd_budget),
            human(self.config.ram_budget)
        );
        self.place();
    }

    /// The watched tree `path` is in.
    fn tree_of(&self, path: &Path) -> Option<&PathBuf> {
        self.config.trees.iter().find(|t| path.starts_with(t))
    }

    /// Takes the binds of `source` out of the live jobs: their next open goes to the
    /// network.
    fn detach(&mut self, source: &str) {
        for (pid, job) in &mut self.jobs {
            let targets: Vec<PathBuf> = job
                .binds
                .iter()
                .filter(|b| b.target == Path::new(source))
                .map(|b| b.target.clone())
                .collect();
            if targets.is_empty() {
                continue;
            }
            match mountns::detach_in(&job.ns, &targets) {
                Ok(n) => log::info!("{source}: detached {n} binds in job {pid}"),
                Err(e) => log::warn!("{source}: could not detach it in job {pid}: {e}"),
            }
            job.forget(Path::new(source));
        }
    }

    /// Takes a new view of the working set; a placement follows (the last one named
    /// files by their place in the view it replaces).
    fn remember(&mut self, view: View) {
        // The old view goes first: two site-wide views at once are ~24 MiB.
        self.view = View::default();
        self.file_index = FileIndex::of(&view);
        self.view = view;
        self.wanted = Vec::new();
        self.queued.clear();
    }

    /// Whether the last placement wants `source`, and pinned.
    fn wanted(&self, source: &str) -> Option<bool> {
        let i = self.file_index.position(&self.view, source)?;
        self.wanted.get(i).copied().flatten()
    }

    /// The remembered file at `path`, if placement weighed it.
    fn weighed(&self, path: &str) -> Option<File<'_>> {
        self.file_index.find(&self.view, path)
    }

    /// Computes the placement of the remembered working set and moves towards it.
    fn place(&mut self) {
        let now = Instant::now();
        self.placed_at = now;
        let window = self.config.revalidate;
        self.unstable
            .retain(|_, at| now.duration_since(*at) < window);
        self.failed
            .retain(|_, at| now.duration_since(*at) < window * 4);
        let known = Known {
            trees: &self.config.trees,
            unstable: self.unstable.keys().map(String::as_str).collect(),
            failed: self.failed.keys().map(String::as_str).collect(),
            refused: self.refused.iter().map(String::as_str).collect(),
        };
        let admitted = decide::admitted(&self.view, &known);
        let (cache, in_flight) = (&self.cache, &self.in_flight);
        let (pins, pinning) = (&self.pins, &self.pinning);
        let held = Held {
            cached: &|p| cache.contains(p),
            copying: &|p| in_flight.contains_key(p),
            pinned: &|p| pins.is_pinned(p) || pinning.contains_key(p),
            copies: cache.sources().map(|(s, _)| s.as_str()).collect(),
        };
        let moves = decide::moves(
            &admitted,
            &self.config.filters,
            self.effective_ssd_budget,
            self.config.ram_budget,
            &held,
        );
        let mut wanted = vec![None; self.view.len()];
        for c in &moves.wanted {
            wanted[c.at as usize] = Some(c.pinned);
        }
        let queued: VecDeque<u32> = moves.copies().map(|c| c.at).collect();
        let pin: Vec<String> = moves.pin.iter().map(|p| (*p).to_owned()).collect();
        let (evict, unpin) = (moves.evict, moves.unpin);
        self.wanted = wanted;
        // Openers are remembered only to name them when their copy lands: those of files
        // placed and not wanted, or held already, are forgotten.
        let (index, files, wanted) = (&self.file_index, &self.view, &self.wanted);
        let cache = &self.cache;
        self.last_opener.retain(|path, _| {
            let at = index.position(files, path);
            let wanted = at.is_some_and(|i| wanted[i].is_some());
            (wanted || at.is_none()) && !cache.contains(path)
        });
        // Make room first: evictions and unpins.
        for source in evict {
            self.status.evictions += 1;
            log::info!(
                "evicting {source}: no longer among the hottest files that fit the SSD budget ({})",
                human(self.effective_ssd_budget)
            );
            self.drop_copy(&source);
        }
        for source in unpin {
            self.unpin(&source);
        }
        for source in pin {
            self.pin(&source);
        }
        self.queued = queued;
        self.start_queued();
    }

    /// Starts the queued copies in the placement's order, up to `COPIES_AT_ONCE` under
    /// way; each copy that ends starts the next.
    fn start_queued(&mut self) {
        while self.in_flight.len() < COPIES_AT_ONCE {
            let Some(at) = self.queued.pop_front() else {
                break;
            };
            let Some(f) = self.view.file(at as usize) else {
                continue;
            };
            let (source, size) = (f.path.to_owned(), f.size);
            // What happened since the placement: held, changed, or written by a job.
            let since = self.cache.contains(&source)
                || self.in_flight.contains_key(&source)
                || self.unstable.contains_key(&source)
                || self.refused.contains(&source);
            if !since {
                self.start_copy(&source, size);
            }
        }
    }

    fn start_copy(&mut self, source: &str, size: u64) {
        let reserved: u64 = self.in_flight.values().sum();
        if self
            .cache
            .used()
            .saturating_add(reserved)
            .saturating_add(size)
            > self.effective_ssd_budget
        {
            return; // after the evictions under way; the next placement retries
        }
        let Some(tree) = self.tree_of(Path::new(source)).cloned() else {
            return;
        };
        if self.snapshot_coming(Path::new(source)) {
            return; // the snapshot copies it, with the rest of its tree
        }
        let Some(reader) = self.reader_of(source) else {
            log::debug!("not copying {source}: no user is known to read it");
            return;
        };
        // The profile's size is a claim: the copy checks the real one against this room.
        let room = self
            .effective_ssd_budget
            .saturating_sub(self.cache.used().saturating_add(reserved));
        self.in_flight.insert(source.to_owned(), size);
        // A prefetch under way waits for it too.
        for w in &mut self.prefetches {
            if w.remaining.insert(source.to_owned()) {
                w.progress.files_total += 1;
                w.progress.bytes_total += size;
            }
        }
        self.workers.send(Work::Copy {
            source: source.to_owned(),
            tree,
            reader,
            dest: self.cache.local(source),
            room,
            parent: self.parent.clone(),
        });
    }

    /// A user seen reading the file (`File::reader`).
    fn reader_of(&self, source: &str) -> Option<User> {
        let uid = self.weighed(source)?.reader()?;
        if uid == 0 {
            Some(User::root())
        } else {
            User::lookup(uid)
        }
    }

    fn copied(&mut self, source: String, result: Result<Identity, CopyError>) {
        let Some(expected) = self.in_flight.remove(&source) else {
            // Invalidated while copying: whatever arrived is not wanted.
            if result.is_ok() && !self.cache.contains(&source) {
                let _ = std::fs::remove_file(self.cache.local(&source));
            }
            self.start_queued();
            return;
        };
        let mut ok = false;
        if let Err(e) = &result {
            *self
                .status
                .copy_failures_by_reason
                .entry(e.reason().to_owned())
                .or_default() += 1;
        }
        match result {
            Ok(identity) => {
                self.status.copies += 1;
                self.status.copied_bytes += identity.size;
                let wanted = self.wanted(&source);
                self.cache.insert(&source, identity);
                if self.cache.used() > self.effective_ssd_budget {
                    log::info!(
                        "not keeping {source}: at {} it is larger than the profile said and does not fit the SSD budget",
                        human(identity.size)
                    );
                    self.cache.remove(&source);
                } else if wanted.is_none() {
                    self.cache.remove(&source); // no longer wanted
                } else {
                    ok = true;
                    // Before the pin: it goes through the snapshot's inode.
                    self.fill_stub(&source, &identity);
                    if wanted == Some(true) {
                        self.pin(&source);
                    }
                    if logs::writes() {
                        let opens = self.weighed(&source).map_or(0, |f| f.opens);
                        let held = if wanted == Some(true) {
                            "SSD and RAM"
                        } else {
                            "SSD"
                        };
                        logs::file_line(
                            "cache write",
                            &source,
                            self.last_opener.remove(&source).as_ref(),
                            &format!(
                                "copied to {held} ({}, opened {opens} times)",
                                human(identity.size)
                            ),
                        );
                    }
                }
            }
            Err(CopyError::Changed) => {
                log::info!(
                    "{source} changed while being copied: discarded, fetched again once stable"
                );
                self.unstable.insert(source.clone(), Instant::now());
            }
            Err(CopyError::NoSpace) => self.cache_full(&source, expected),
            Err(e) => {
                log::warn!("not caching {source}: {e}");
                self.failed.insert(source.clone(), Instant::now());
            }
        }
        // The next queued copy first: a prefetch waiting for this one waits for it too.
        self.start_queued();
        if self.in_flight.is_empty() {
            // Snapshots wait for the copies under them (they are linked in); a prefetch
            // under way then waits for them too, so this comes before its report.
            self.consider_snapshots();
        }
        self.report(&source, expected, ok);
    }

    /// ENOSPC: the cache filesystem holds less than the budget said. Shrink the budget to
    /// what is held now, with a margin, and evict down to it.
    fn cache_full(&mut self, source: &str, size: u64) {
        self.status.cache_full_events += 1;
        let reserved: u64 = self.in_flight.values().sum();
        let new_budget = ((self.cache.used() + reserved) as f64 * 0.9) as u64;
        log::warn!(
            "the cache filesystem of {} is full (copying {source}, {}): evicting, and holding at most {} from now on",
            self.config.cache_dir.display(),
            human(size),
            human(new_budget)
        );
        self.effective_ssd_budget = new_budget.min(self.effective_ssd_budget);
        self.failed.insert(source.to_owned(), Instant::now());
        self.place();
    }

    /// Starts pinning a held copy, within the RAM budget; a worker maps and locks it.
    fn pin(&mut self, source: &str) {
        if self.pins.is_pinned(source) || self.pinning.contains_key(source) {
            return;
        }
        let size = self.cache.get(source).map_or(0, |c| c.identity.size);
        let pending: u64 = self.pinning.values().sum();
        if self
            .pins
            .bytes()
            .saturating_add(pending)
            .saturating_add(size)
            > self.config.ram_budget
        {
            return;
        }
        let limited = self.pins.limited_by_map_count;
        match self.pins.has_room(self.pinning.len()) {
            Ok(()) => {}
            // Said once; `status` keeps saying it.
            Err(e) if !limited => {
                log::warn!("cannot pin {source}: {e}");
                return;
            }
            Err(_) => return,
        }
        // A file inside a snapshot is pinned through the snapshot's own copy: that is
        // the inode jobs read.
        let local = self
            .held_snapshot(Path::new(source))
            .filter(|_| !self.in_passage(Path::new(source)))
            .and_then(|(root, snap)| {
                Some(snap.local.join(Path::new(source).strip_prefix(root).ok()?))
            })
            .unwrap_or_else(|| self.cache.local(source));
        self.pinning.insert(source.to_owned(), size);
        self.workers.send(Work::Pin {
            source: source.to_owned(),
            local,
        });
    }

    /// A pin was made: kept if it is still wanted.
    fn pinned(&mut self, source: String, result: std::io::Result<(Option<Mmap>, u64)>) {
        if self.pinning.remove(&source).is_none() {
            return; // unpinned meanwhile: the mapping is dropped here
        }
        match result {
            Ok((map, size)) if self.wanted(&source) == Some(true) => {
                self.pins.hold(&source, map, size);
            }
            Ok(_) => {}
            Err(e) => log::warn!("cannot pin {source}: {e}"),
        }
        if !self.settling() {
            // Prefetches that waited for their pins may be done.
            self.advance(|_| true);
        }
    }

    fn unpin(&mut self, source: &str) {
        self.pins.unpin(source);
        self.pinning.remove(source);
    }

    fn drop_copy(&mut self, source: &str) {
        self.detach(source);
        self.unpin(source);
        self.cache.remove(source);
        // A copy under way is discarded when it arrives.
        self.in_flight.remove(source);
    }

    /// Asks a worker to compare every copy and snapshot with the network (one check at
    /// a time).
    fn revalidate(&mut self) {
        if self.revalidating {
            return;
        }
        self.revalidating = true;
        self.workers.send(Work::Revalidate {
            copies: self
                .cache
                .sources()
                .map(|(s, c)| (s.clone(), c.identity))
                .collect(),
            snapshots: self
                .snapshots
                .iter()
                .map(|(root, snap)| (root.clone(), snap.stamp.clone(), snap.passages.clone()))
                .collect(),
            trees: self.config.trees.clone(),
        });
    }

    /// What changed on the network is dropped, and fetched again once stable.
    fn revalidated(&mut self, changed: Vec<String>, changed_trees: Vec<PathBuf>) {
        self.revalidating = false;
        let mut dropped = !changed_trees.is_empty();
        // Every copy was in this check: those unchanged are valid, the others dropped.
        self.unverified.clear();
        for source in changed {
            // A copy made since the check was sent is not the one checked.
            if !self.cache.contains(&source) {
                continue;
            }
            self.status.invalidations += 1;
            dropped = true;
            log::info!(
                "{source} changed on the network: dropping its copy, fetched again once stable"
            );
            self.drop_copy(&source);
            self.unstable.insert(source, Instant::now());
        }
        for root in changed_trees {
            self.drop_snapshot(&root, "it changed on the network");
            self.unstable
                .insert(root.to_string_lossy().into_owned(), Instant::now());
        }
        // Stable again ones come back. Nothing changed and nothing came back: placing a
        // site-wide profile again would decide the same (a second of work at a million
        // files), so that is done only now and then, for what waits on no event (a user
        // the name service learned of).
        let worth_it =
            dropped || self.any_waits_over() || self.placed_at.elapsed() >= PLACE_AGAIN_ANYWAY;
        if !self.view.is_empty() && worth_it {
            self.place();
            self.consider_snapshots();
        }
    }

    /// Whether a file left out for having changed or failed may be placed again now.
    fn any_waits_over(&self) -> bool {
        let window = self.config.revalidate;
        self.unstable.values().any(|at| at.elapsed() >= window)
            || self.failed.values().any(|at| at.elapsed() >= window * 4)
    }

    fn status(&self) -> CacheStatus {
        CacheStatus {
            cache_dir: self.config.cache_dir.clone(),
            ssd_budget: self.effective_ssd_budget,
            ram_budget: self.config.ram_budget,
            cached_files: self.cache.len(),
            cached_bytes: self.cache.used(),
            pinned_files: self.pins.len(),
            pinned_bytes: self.pins.bytes(),
            copying: self.in_flight.len() + self.snapshots_in_flight.len(),
            snapshots: self.snapshots.keys().cloned().collect(),
            snapshot_bytes: self.snapshot_bytes(),
            limited_by_map_count: self.pins.limited_by_map_count,
            jobs_running: self.jobs.len(),
            prefetch_remaining_files: self
                .prefetches
                .iter()
                .map(|w| w.remaining.len() + w.trees.len())
                .sum(),
            prefetch_remaining_bytes: self
                .prefetches
                .iter()
                .map(|w| {
                    (w.progress.bytes_total + w.progress.tree_bytes_total)
                        .saturating_sub(w.progress.bytes_done + w.progress.tree_bytes_done)
                })
                .sum(),
            ..self.status.clone()
        }
    }
}
