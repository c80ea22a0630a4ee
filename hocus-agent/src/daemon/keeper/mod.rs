//! The keeper holds the working set close: it applies placements (copies to the SSD
//! cache, pins in RAM, evictions), keeps copies consistent with the network (revalidation
//! at an interval, invalidation at once when the tracer sees a change), and counts where
//! the bytes jobs read would come from. It runs on its own thread, with a pool of copy
//! workers; the daemon's loop talks to it only through [`Handle`], whose every wait is
//! bounded, so that loop never waits on the network.
//!
//! The keeper is a composition of parts, each owning one state: the last `placement`,
//! the `copies` under way and held back, the `pinning`, the `snapshots`, the
//! `prefetches`, the `jobs`. This file is its loop and its dispatch; the flows that
//! cross parts are `copying` (placement, copies, pins, revalidation), `snapshotting`
//! and `served`. What it decides is `decide` (plain functions); what it has done is
//! `work` (the workers); what it is told is `order`.

mod board;
mod copies;
mod copying;
mod decide;
mod file_index;
mod handle;
mod jobs;
mod order;
mod partial_copies;
mod pinning;
mod placement;
mod prefetches;
mod schedule;
mod served;
mod snapshots;
mod snapshotting;
mod work;

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use anyhow::Result;
use hocus_control::status::{CacheStatus, Served};
use tokio::sync::mpsc as tokio_mpsc;

use self::{
    copies::Copies,
    jobs::Jobs,
    order::{Latest, ORDER_QUEUE, Order, Progressing},
    pinning::Pinning,
    placement::Placement,
    prefetches::Prefetches,
    schedule::Schedule,
    snapshots::Snapshots,
    work::{Done, Workers},
};
pub use self::{
    handle::{Handle, KeeperError},
    order::{Config, Reconfigure},
};
use crate::{
    cache::{
        copy::CopyError,
        directory::Cache,
        partial::{filler::Limits, service::Partials},
        relay::{Holding, Parent},
    },
    profile::{format::Profile, shortlist::Shortlist},
    redirect::{
        jobs::JobStart,
        mountns::{self, Bind, Expect},
    },
    shared::{
        kernel::{self, Route, route},
        memory,
        size::human,
        tally::Tally,
    },
};

/// How often the keeper publishes its status at most (`Handle::status`).
const PUBLISH_EVERY: Duration = Duration::from_millis(250);

/// How often lines summed up (`Keeper::said`) are said at most.
const SAID_EVERY: Duration = Duration::from_secs(10);

/// How often the cache index is written while it changes.
const INDEX_SAVE_INTERVAL: Duration = Duration::from_secs(1);
/// A revalidation that changed nothing places the working set again only this long
/// after the last placement.
const PLACE_AGAIN_ANYWAY: Duration = Duration::from_secs(300);
/// Entries of a working set's shortlist past which a placement gives freed memory back (a
/// few milliseconds then; nothing for a job's few thousand files).
const BIG_SHORTLIST: usize = 50_000;

/// Starts the keeper; orders go in through the returned handle. Also returns the ways
/// snapshots and big files read in part are held on this kernel.
pub fn start(config: Config) -> Result<(Handle, thread::JoinHandle<()>, [Route; 2])> {
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
    let (lazy_overlays, snapshots) = if config.whole_snapshots {
        let way = "copies of every file of their tree (whole-snapshots)";
        (false, route("snapshots", way, false))
    } else {
        lazy_overlays_here(cache.tmp_dir())
    };
    let (partials, big_files) = partials_here(&config, &cache);
    let workers = Workers::start(config.copy_workers, cache.tmp_dir(), done_tx)?;
    let unverified = cache.sources().map(|(s, _)| s.clone()).collect();
    let latest = Latest::default();
    let status = CacheStatus {
        served: config
            .trees
            .iter()
            .map(|root| Served {
                root: root.clone(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let board = Arc::new(board::Board::default());
    let mut keeper = Keeper {
        latest: latest.clone(),
        effective_ssd_budget: config.ssd_budget,
        config,
        cache,
        partials,
        trim_after: Instant::now(),
        workers,
        revalidating: None,
        schedule: Schedule::default(),
        placement: Placement::new(),
        copies: Copies::found_at_start(unverified),
        pinning: Pinning::new(),
        snapshots: Snapshots::new(lazy_overlays),
        prefetches: Prefetches::default(),
        jobs: Jobs::default(),
        status,
        said: Tally::default(),
        board: board.clone(),
        published_at: Instant::now() - PUBLISH_EVERY,
        binds_due: board::BindsDue::default(),
    };
    keeper.resume_partials();
    let handle = thread::Builder::new()
        .name("hocus-keeper".into())
        .spawn(move || keeper.run(order_rx, done_rx))?;
    Ok((
        Handle::new(order_tx, latest, board),
        handle,
        [snapshots, big_files],
    ))
}

/// Partial copies where the kernel and the cache's filesystem allow them, and the way
/// big files read in part are held.
fn partials_here(config: &Config, cache: &Cache) -> (Option<Arc<Partials>>, Route) {
    const PART: &str = "big files read in part";
    // A previous daemon's guard holds a group whose copies jobs may still read: taken
    // back (and held) whatever this daemon makes.
    let guarded = Partials::left_a_guard(&config.cache_dir);
    if config.partial_from == 0 && !guarded {
        let way = "whole copies (partial copies are off: partial-from 0)";
        return (None, route(PART, way, false));
    }
    let why_not = if kernel::forced("partial-copies") && !guarded {
        Err(kernel::why("partial-copies", ""))
    } else {
        let limits = Limits {
            stall: config.fill_timeout,
            ..Limits::default()
        };
        Partials::start(&config.cache_dir, cache.tmp_dir(), limits).map_err(|e| {
            format!(
                "the cache's filesystem or the kernel has no fanotify pre-content events ({e}; Linux 6.14)"
            )
        })
    };
    match why_not {
        Ok(partials) => {
            let way = format!(
                "partial copies from {}: the ranges jobs read, the rest filled when read (fanotify pre-content events)",
                human(config.partial_from)
            );
            (Some(partials), route(PART, way, false))
        }
        Err(why) => (None, route(PART, format!("whole copies ({why})"), true)),
    }
}

/// Whether this kernel shows lazy snapshots, and the route that makes.
fn lazy_overlays_here(tmp: &Path) -> (bool, Route) {
    match mountns::lazy_overlays_work(tmp) {
        Ok(()) => (
            true,
            route(
                "snapshots",
                "lazy: the working set's bytes, the other files read from the network when opened (overlayfs, the network as a data-only layer)",
                false,
            ),
        ),
        Err(e) => (
            false,
            route(
                "snapshots",
                format!(
                    "copies of every file of their tree: this kernel cannot show lazy ones ({e}; overlayfs with data-only layers given as descriptors needs Linux 6.13)"
                ),
                true,
            ),
        ),
    }
}

struct Keeper {
    /// The newest working set to place (see `Order::PlaceLatest`).
    latest: Latest,
    config: Config,
    /// The SSD budget, lowered when the cache filesystem turned out to be full.
    effective_ssd_budget: u64,
    cache: Cache,
    /// Partial copies' filler and guard, where the kernel allows them.
    partials: Option<Arc<Partials>>,
    /// Not before then is the cache trimmed again (a trim that fell short, its copies
    /// held open elsewhere, waits: each asks /proc about every process).
    trim_after: Instant,
    workers: Workers,
    /// A revalidation is under way, of these bound targets.
    revalidating: Option<HashSet<PathBuf>>,
    /// When each bound target is next checked.
    schedule: Schedule,
    placement: Placement,
    copies: Copies,
    pinning: Pinning,
    snapshots: Snapshots,
    prefetches: Prefetches,
    jobs: Jobs,
    status: CacheStatus,
    /// What happens to files by the thousand, said summed up (`tally`).
    said: Tally,
    /// What `status` and a job's start read while it is busy (`Handle::status`,
    /// `Handle::binds`); when its status was written there, and when its binds are due.
    board: Arc<board::Board>,
    published_at: Instant,
    binds_due: board::BindsDue,
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
        // No job of this daemon's is left to read a partial copy: nothing to guard.
        if let Some(p) = self.partials.as_ref().filter(|_| self.jobs.running() == 0) {
            p.stop_guard();
        }
        self.jobs.release_all();
        self.cache.save_now();
        self.say_tallied(Duration::ZERO);
    }

    /// A worker finished something.
    fn done(&mut self, done: Done) {
        // Copies and snapshots land, revalidations drop them: the binds may change.
        self.binds_due.changed();
        match done {
            Done::Copied(source, result, origin) => {
                if result.is_ok() {
                    self.status.copied_from_peers_bytes += origin.from_peer;
                }
                self.status.peer_wait_ms += origin.waited.as_millis() as u64;
                self.copied(source, result)
            }
            Done::Resumed(source, reader, result) => self.resumed(source, reader, result),
            Done::Snapshotted(root, result) => self.snapshotted(root, result),
            Done::Pinned(source, result) => self.pinned(source, result),
            Done::Grown(source, result) => self.grown(source, result),
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
            self.revalidate(false);
            *next_check = Instant::now() + self.config.revalidate;
        }
        // The index is rewritten whole: at most once a second, not once per copy (a crash
        // loses the entries of the last second; their files are then removed as strays at
        // the next start).
        if last_save.elapsed() >= INDEX_SAVE_INTERVAL {
            self.count_partial_copies();
            self.cache.save();
            *last_save = Instant::now();
        }
        self.say_tallied(SAID_EVERY);
        // Not after every order (an open a job makes is one): a few times a second.
        if self.published_at.elapsed() >= PUBLISH_EVERY {
            self.board.write_status(self.status());
            self.published_at = Instant::now();
        }
        if self.binds_due.due() {
            let t = Instant::now();
            self.board.write_binds(self.binds());
            self.binds_due.written(t.elapsed());
        }
    }

    /// Says what was summed up (`said`) once its first line is `every` old.
    fn say_tallied(&mut self, every: Duration) {
        for line in self.said.due(every) {
            log::warn!("{line}");
        }
    }

    /// Sums `path` up among `what` (e.g. "files not cached, gone from the network") if
    /// `e` says it is gone from the network (by the thousand after a profile's import);
    /// whether it did.
    fn tally_gone(&mut self, e: &CopyError, what: &'static str, path: &Path) -> bool {
        let Some(tree) = self.tree_of(path).filter(|_| e.is_gone()).cloned() else {
            return false;
        };
        self.said.add(what, &tree, &path.to_string_lossy());
        true
    }

    fn obey(&mut self, order: Order) {
        // Orders that neither make nor drop copies leave the binds as they are.
        let questions = matches!(
            order,
            Order::Accesses(_)
                | Order::Status(..)
                | Order::Binds(_)
                | Order::LocalCopy(..)
                | Order::JobStarting(_)
                | Order::JobEnded { .. }
        );
        if !questions {
            self.binds_due.changed();
        }
        match order {
            Order::PlaceLatest => self.place_latest(),
            Order::Prefetch(profile, tx, parent) => self.prefetch(profile, tx, parent),
            Order::Refused(source) => self.refuse(source),
            Order::Invalidate(source) => self.invalidate(source),
            Order::RevalidateNow => self.revalidate(true),
            Order::Accesses(accesses) => accesses.into_iter().for_each(|a| self.served(a)),
            Order::Reconfigure(r) => {
                self.config.filters = r.filters;
                self.config.revalidate = r.revalidate;
                let longest = r.revalidate_max.unwrap_or(self.config.revalidate_max);
                self.config.revalidate_max = longest.max(r.revalidate);
                log::info!(
                    "settings reloaded: revalidating what jobs bind after {} s, waiting up to {} s for what stays unchanged",
                    r.revalidate.as_secs(),
                    self.config.revalidate_max.as_secs()
                );
                self.set_budgets(Some(r.ssd_budget), Some(r.ram_budget));
            }
            Order::Status(paths, tx) => {
                let held = paths.iter().map(|p| self.where_held(p).to_owned());
                let _ = tx.send((self.status(), held.collect()));
            }
            Order::LocalCopy(source, tx) => {
                let _ = tx.send(self.holding(&source));
            }
            Order::Budgets { ssd, ram } => self.set_budgets(ssd, ram),
            Order::Binds(tx) => {
                let _ = tx.send(self.binds());
            }
            Order::JobStarting(start) => self.job_starting(start),
            Order::JobEnded { id } => {
                if let Some(j) = self.jobs.end(id) {
                    jobs::task_ended(&mut self.status.slurm_jobs, j);
                }
                if let Some(p) = self.partials.as_ref().filter(|_| self.jobs.running() == 0) {
                    p.release_retired();
                }
            }
            // Handled by the loop.
            Order::Stop => {}
        }
    }

    /// Places the newest working set the daemon sent, if it was not placed already.
    fn place_latest(&mut self) {
        let latest = self.latest.lock().map(|mut l| l.take()).ok().flatten();
        let Some(shortlist) = latest else {
            return;
        };
        // The shortlist it replaces is freed: a large one goes back to the system.
        let large = shortlist.len() + shortlist.missing.len() > BIG_SHORTLIST;
        self.remember(shortlist);
        if self.drop_outgrown() {
            // Trees first: files under one being taken are copied by it.
            self.consider_snapshots();
        }
        self.place();
        if large {
            memory::give_back();
        }
    }

    /// Places these files now and reports progress until their copies, snapshots and
    /// pins are done; copies come from the job's parent node first, if there is one.
    fn prefetch(&mut self, profile: Profile, tx: Progressing, parent: Option<Arc<Parent>>) {
        self.remember(Shortlist::from(profile));
        self.drop_outgrown();
        if parent.is_some() {
            // From a parent node, file by file: the snapshots then link them.
            self.prefetches.parent = parent;
            self.place();
            self.consider_snapshots();
        } else {
            // Trees first: files under one being measured are copied by its snapshot.
            self.consider_snapshots();
            self.place();
        }
        let copies: Vec<(String, u64)> = self
            .copies
            .sources_under_way()
            .map(|(s, size)| (s.clone(), *size))
            .collect();
        let trees: Vec<(PathBuf, u64)> = self
            .snapshots
            .being_taken()
            .map(|(t, bytes)| (t.clone(), *bytes))
            .collect();
        self.status.prefetches += 1;
        let (settling, pinned) = (self.settling(), self.pinned_now());
        self.prefetches.start(&copies, &trees, tx, settling, pinned);
    }

    /// Takes a new shortlist of the working set; a placement follows (the last one named
    /// files by their place in the shortlist it replaces).
    fn remember(&mut self, shortlist: Shortlist) {
        self.placement.remember(shortlist);
        self.copies.clear_queue();
    }

    /// Where this node's copy of `source` is, for a job's other node asking for it.
    fn holding(&self, source: &str) -> Holding {
        let held = self
            .cache
            .get(source)
            .filter(|_| !self.copies.unverified(source));
        let partial = || {
            let copy = self.partials.as_ref()?.copy_of(source)?;
            (!copy.dropped()).then_some(copy)
        };
        if held.is_some_and(|c| !c.is_partial()) {
            Holding::Copy(self.cache.local(source))
        } else if let Some(copy) = held.and_then(|_| partial()) {
            Holding::Partial(copy)
        } else if self.copies.in_flight(source)
            || (self.copies.any_queued() && self.placement.wanted(source).is_some())
            || self.snapshots.coming(Path::new(source))
            || self.prefetches.any()
        {
            Holding::Coming
        } else {
            Holding::No
        }
    }

    /// Where `path` is held: "ram", "ssd" or "network".
    fn where_held(&self, path: &str) -> &'static str {
        if self.pinning.pins.is_pinned(path) {
            "ram"
        } else if self.cache.contains(path) || self.snapshots.serves(Path::new(path)) {
            "ssd"
        } else {
            "network"
        }
    }

    /// The binds a new job's namespace gets, each with what the network held when it
    /// was made (checked as the job starts: `redirect::confirm`). A snapshot still being
    /// taken is not bound yet: its files are, meanwhile, as are those in its passages
    /// (bound after it). Copies from before a restart are bound only once revalidated.
    fn binds(&self) -> Vec<Bind> {
        let files = self
            .cache
            .sources()
            .filter(|(source, _)| !self.copies.unverified(source))
            .filter(|(source, _)| !self.snapshots.serves(Path::new(source)))
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
        self.snapshots.binds().chain(files).collect()
    }

    /// A job starts: its binds are followed from now on, and its hits counted.
    fn job_starting(&mut self, start: JobStart) {
        let cache = &self.cache;
        if let Some(task) = self.jobs.start(start, |b| cache.is_snapshot(&b.local)) {
            jobs::task_started(&mut self.status.slurm_jobs, task);
        }
        self.status.jobs_started += 1;
    }

    fn status(&self) -> CacheStatus {
        let pins = &self.pinning.pins;
        CacheStatus {
            cache_dir: self.config.cache_dir.clone(),
            ssd_budget: self.effective_ssd_budget,
            ram_budget: self.config.ram_budget,
            cached_files: self.cache.len(),
            cached_bytes: self.cache.used(),
            pinned_files: pins.len(),
            pinned_bytes: pins.bytes(),
            copying: self.copies.under_way() + self.snapshots.being_taken().count(),
            snapshots: self.snapshots.roots().cloned().collect(),
            snapshot_bytes: self.snapshots.bytes(),
            limited_by_map_count: pins.limited_by_map_count,
            jobs_running: self.jobs.running(),
            prefetch_remaining_files: self.prefetches.remaining_files(),
            prefetch_remaining_bytes: self.prefetches.remaining_bytes(),
            partial_reads_allowed: self.partials.as_ref().map_or(0, |p| p.counts().0),
            partial_bytes_filled: self.partials.as_ref().map_or(0, |p| p.counts().1),
            partial_reads_failed: self.partials.as_ref().map_or(0, |p| p.counts().2),
            ..self.status.clone()
        }
    }
}
