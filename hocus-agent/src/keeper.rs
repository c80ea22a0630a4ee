//! The keeper holds the working set close: it applies placements (copies to the SSD
//! cache, pins in RAM, evictions), keeps copies consistent with the network (revalidation
//! at an interval, invalidation at once when the tracer sees a change), and counts where
//! the bytes jobs read would come from. It runs on its own thread, with a pool of copy
//! workers, so the daemon's event loop never waits on the network.

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    sync::{Arc, Mutex, mpsc},
    thread,
    time::{Duration, Instant},
};

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::{
    budget::human,
    cache::Cache,
    copy::{self, CopyError, Identity, Reader},
    pins::{PinError, Pins},
    placement::{self, Filters, Placement},
    profile::FileEntry,
};

pub struct Config {
    pub cache_dir: PathBuf,
    pub ssd_budget: u64,
    pub ram_budget: u64,
    pub filters: Filters,
    pub revalidate: Duration,
    pub trees: Vec<PathBuf>,
    pub copy_workers: usize,
}

/// Progress of a prefetch, streamed to the `prefetch` command.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct Progress {
    pub files_done: usize,
    pub files_total: usize,
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub failed: usize,
    pub pinned_files: usize,
    pub pinned_bytes: u64,
    pub finished: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct KeeperStatus {
    pub cache_dir: PathBuf,
    pub ssd_budget: u64,
    pub ram_budget: u64,
    pub cached_files: usize,
    pub cached_bytes: u64,
    pub pinned_files: usize,
    pub pinned_bytes: u64,
    pub copying: usize,
    pub copies: u64,
    pub copy_failures: u64,
    pub changed_during_copy: u64,
    pub invalidations: u64,
    pub cache_full_events: u64,
    /// Bytes jobs read of files while hocus held them pinned, on SSD only, or neither.
    pub read_pinned: u64,
    pub read_ssd: u64,
    pub read_network: u64,
    pub limited_by_map_count: bool,
}

pub enum Order {
    /// The working set changed: place it again.
    Place(Vec<FileEntry>),
    /// The tracer saw the file written, truncated, renamed or unlinked.
    Invalidate(String),
    /// A job read this many bytes of the file.
    Read(String, u64),
    /// Place these files now and report progress until their copies are done.
    Prefetch(Vec<FileEntry>, mpsc::Sender<Progress>),
    Status(mpsc::Sender<KeeperStatus>),
    /// New budgets (bytes); pins and copies beyond them are released.
    Budgets {
        ssd: Option<u64>,
        ram: Option<u64>,
    },
    Stop,
}

struct Job {
    source: String,
    tree: PathBuf,
    reader: Reader,
    dest: PathBuf,
}

type Done = (String, Result<Identity, CopyError>);

enum Msg {
    Order(Order),
    Copied(Done),
}

/// Starts the keeper; orders go in through the returned sender.
pub fn start(config: Config) -> Result<(mpsc::Sender<Order>, thread::JoinHandle<()>)> {
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
    let (msg_tx, msg_rx) = mpsc::channel::<Msg>();
    let (order_tx, order_rx) = mpsc::channel::<Order>();
    // Orders are forwarded into the keeper's single inbox, beside copy results.
    let forward = msg_tx.clone();
    thread::Builder::new()
        .name("hocus-orders".into())
        .spawn(move || {
            for order in order_rx {
                if forward.send(Msg::Order(order)).is_err() {
                    break;
                }
            }
        })?;
    let (job_tx, job_rx) = mpsc::channel::<Job>();
    let job_rx = Arc::new(Mutex::new(job_rx));
    for i in 0..config.copy_workers.max(1) {
        let jobs = Arc::clone(&job_rx);
        let results = msg_tx.clone();
        let tmp = cache.tmp_dir().to_owned();
        thread::Builder::new()
            .name(format!("hocus-copy-{i}"))
            .spawn(move || {
                loop {
                    let job = match jobs.lock().map(|rx| rx.recv()) {
                        Ok(Ok(job)) => job,
                        _ => break,
                    };
                    let result =
                        copy::copy(&job.tree, job.source.as_ref(), &job.reader, &tmp, &job.dest);
                    if results.send(Msg::Copied((job.source, result))).is_err() {
                        break;
                    }
                }
            })?;
    }
    let mut keeper = Keeper {
        effective_ssd_budget: config.ssd_budget,
        config,
        cache,
        pins: Pins::new(),
        jobs: job_tx,
        in_flight: HashMap::new(),
        wanted: Placement::default(),
        unstable: HashMap::new(),
        failed: HashMap::new(),
        files: HashMap::new(),
        prefetches: Vec::new(),
        status: KeeperStatus::default(),
    };
    let handle = thread::Builder::new()
        .name("hocus-keeper".into())
        .spawn(move || keeper.run(msg_rx))?;
    Ok((order_tx, handle))
}

struct Watcher {
    remaining: HashSet<String>,
    progress: Progress,
    tx: mpsc::Sender<Progress>,
}

struct Keeper {
    config: Config,
    /// The SSD budget, lowered when the cache filesystem turned out to be full.
    effective_ssd_budget: u64,
    cache: Cache,
    pins: Pins,
    jobs: mpsc::Sender<Job>,
    /// Copies under way: source -> expected size.
    in_flight: HashMap<String, u64>,
    wanted: Placement,
    /// Files seen changing, and when: they are fetched again once stable.
    unstable: HashMap<String, Instant>,
    /// Files whose copy failed, and when: retried after a while.
    failed: HashMap<String, Instant>,
    /// The last working set, for readers' uids and values.
    files: HashMap<String, FileEntry>,
    prefetches: Vec<Watcher>,
    status: KeeperStatus,
}

impl Keeper {
    fn run(&mut self, inbox: mpsc::Receiver<Msg>) {
        let mut next_check = Instant::now() + self.config.revalidate;
        loop {
            let timeout = next_check.saturating_duration_since(Instant::now());
            match inbox.recv_timeout(timeout) {
                Ok(Msg::Order(Order::Stop)) | Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Ok(Msg::Order(order)) => self.obey(order),
                Ok(Msg::Copied(done)) => self.copied(done),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            if Instant::now() >= next_check {
                self.revalidate();
                next_check = Instant::now() + self.config.revalidate;
            }
            self.cache.save();
        }
        self.cache.save();
    }

    fn obey(&mut self, order: Order) {
        match order {
            Order::Place(files) => {
                self.remember(files);
                self.place();
            }
            Order::Prefetch(files, tx) => {
                self.remember(files);
                self.place();
                let remaining: HashSet<String> = self.in_flight.keys().cloned().collect();
                let progress = Progress {
                    files_total: remaining.len(),
                    bytes_total: remaining.iter().map(|s| self.in_flight[s]).sum(),
                    ..Default::default()
                };
                let mut w = Watcher {
                    remaining,
                    progress,
                    tx,
                };
                if w.remaining.is_empty() {
                    self.finish(&mut w);
                } else {
                    let _ = w.tx.send(w.progress.clone());
                    self.prefetches.push(w);
                }
            }
            Order::Invalidate(source) => {
                if self.cache.contains(&source) || self.in_flight.contains_key(&source) {
                    self.status.invalidations += 1;
                    log::info!("{source} changed: dropping its copy");
                }
                self.drop_copy(&source);
                self.unstable.insert(source, Instant::now());
            }
            Order::Read(source, bytes) => {
                if self.pins.is_pinned(&source) {
                    self.status.read_pinned += bytes;
                } else if self.cache.contains(&source) {
                    self.status.read_ssd += bytes;
                } else {
                    self.status.read_network += bytes;
                }
            }
            Order::Status(tx) => {
                let _ = tx.send(self.status());
            }
            Order::Budgets { ssd, ram } => {
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
            Order::Stop => {}
        }
    }

    fn remember(&mut self, files: Vec<FileEntry>) {
        self.files = files.into_iter().map(|f| (f.path.clone(), f)).collect();
    }

    /// Computes the placement of the remembered working set and moves towards it.
    fn place(&mut self) {
        let now = Instant::now();
        let window = self.config.revalidate;
        self.unstable
            .retain(|_, at| now.duration_since(*at) < window);
        self.failed
            .retain(|_, at| now.duration_since(*at) < window * 4);
        let files: Vec<FileEntry> = self
            .files
            .values()
            .filter(|f| !self.unstable.contains_key(&f.path) && !self.failed.contains_key(&f.path))
            .filter(|f| {
                self.config
                    .trees
                    .iter()
                    .any(|t| std::path::Path::new(&f.path).starts_with(t))
            })
            .cloned()
            .collect();
        let held: HashSet<String> = self
            .cache
            .sources()
            .map(|(s, _)| s.clone())
            .chain(self.in_flight.keys().cloned())
            .collect();
        let pinned: HashSet<String> = self.pins.sources().cloned().collect();
        let wanted = placement::place(
            &files,
            &self.config.filters,
            self.effective_ssd_budget,
            self.config.ram_budget,
            &held,
            &pinned,
        );
        let keep: HashMap<&str, bool> = wanted
            .files
            .iter()
            .map(|c| (c.path.as_str(), c.pinned))
            .collect();
        // Make room first: evictions and unpins.
        let cached: Vec<String> = self.cache.sources().map(|(s, _)| s.clone()).collect();
        for source in cached {
            match keep.get(source.as_str()) {
                None => self.drop_copy(&source),
                Some(false) => self.pins.unpin(&source),
                Some(true) => {}
            }
        }
        for choice in &wanted.files {
            if self.cache.contains(&choice.path) {
                if choice.pinned {
                    self.pin(&choice.path);
                }
            } else if !self.in_flight.contains_key(&choice.path) {
                self.start_copy(&choice.path, choice.size);
            }
        }
        self.wanted = wanted;
    }

    fn start_copy(&mut self, source: &str, size: u64) {
        let reserved: u64 = self.in_flight.values().sum();
        if self.cache.used() + reserved + size > self.effective_ssd_budget {
            return; // after the evictions under way; the next placement retries
        }
        let Some(tree) = self
            .config
            .trees
            .iter()
            .find(|t| std::path::Path::new(source).starts_with(t))
        else {
            return;
        };
        let Some(reader) = self.reader_of(source) else {
            log::debug!("not copying {source}: no user is known to read it");
            return;
        };
        self.in_flight.insert(source.to_owned(), size);
        let _ = self.jobs.send(Job {
            source: source.to_owned(),
            tree: tree.clone(),
            reader,
            dest: self.cache.local(source),
        });
    }

    /// A user seen reading the file: an ordinary user if there is one (root is squashed
    /// on most NFS exports and must not read more than users can).
    fn reader_of(&self, source: &str) -> Option<Reader> {
        let uids = &self.files.get(source)?.uids;
        let uid = uids
            .iter()
            .copied()
            .find(|u| *u != 0)
            .or_else(|| uids.first().copied())?;
        if uid == 0 {
            Some(Reader::root())
        } else {
            Reader::lookup(uid)
        }
    }

    fn copied(&mut self, (source, result): Done) {
        let Some(expected) = self.in_flight.remove(&source) else {
            // Invalidated while copying: whatever arrived is not wanted.
            if result.is_ok() && !self.cache.contains(&source) {
                let _ = std::fs::remove_file(self.cache.local(&source));
            }
            return;
        };
        let mut ok = false;
        match result {
            Ok(identity) => {
                self.status.copies += 1;
                let wanted = self.wanted.files.iter().find(|c| c.path == source).cloned();
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
                    if wanted.is_some_and(|c| c.pinned) {
                        self.pin(&source);
                    }
                }
            }
            Err(CopyError::Changed) => {
                self.status.changed_during_copy += 1;
                log::info!(
                    "{source} changed while being copied: discarded, fetched again once stable"
                );
                self.unstable.insert(source.clone(), Instant::now());
            }
            Err(CopyError::NoSpace) => self.cache_full(&source, expected),
            Err(e) => {
                self.status.copy_failures += 1;
                log::warn!("not caching {source}: {e}");
                self.failed.insert(source.clone(), Instant::now());
            }
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

    fn pin(&mut self, source: &str) {
        if self.pins.is_pinned(source) {
            return;
        }
        let size = self.cache.get(source).map_or(0, |c| c.identity.size);
        if self.pins.bytes() + size > self.config.ram_budget {
            return;
        }
        let limited = self.pins.limited_by_map_count;
        match self.pins.pin(source, &self.cache.local(source)) {
            Ok(()) => {}
            // Said once; `status` keeps saying it.
            Err(e @ PinError::MapCount(_)) if !limited => log::warn!("cannot pin {source}: {e}"),
            Err(PinError::MapCount(_)) => log::debug!("cannot pin {source}: vm.max_map_count"),
            Err(e) => log::warn!("cannot pin {source}: {e}"),
        }
    }

    fn drop_copy(&mut self, source: &str) {
        self.pins.unpin(source);
        self.cache.remove(source);
        // A copy under way is discarded when it arrives.
        self.in_flight.remove(source);
    }

    /// A copy is valid while the network file keeps its size, mtime, ctime and inode.
    fn revalidate(&mut self) {
        let sources: Vec<(String, Identity)> = self
            .cache
            .sources()
            .map(|(s, c)| (s.clone(), c.identity))
            .collect();
        for (source, identity) in sources {
            let now = std::fs::symlink_metadata(&source).map(|m| Identity::of(&m));
            if now.as_ref().ok() != Some(&identity) {
                self.status.invalidations += 1;
                log::info!(
                    "{source} changed on the network: dropping its copy, fetched again once stable"
                );
                self.drop_copy(&source);
                self.unstable.insert(source, Instant::now());
            }
        }
        // Stable again ones come back.
        if !self.files.is_empty() {
            self.place();
        }
    }

    fn report(&mut self, source: &str, size: u64, ok: bool) {
        let mut finished = Vec::new();
        for (i, w) in self.prefetches.iter_mut().enumerate() {
            if w.remaining.remove(source) {
                w.progress.files_done += 1;
                if ok {
                    w.progress.bytes_done += size;
                } else {
                    w.progress.failed += 1;
                }
                if w.remaining.is_empty() {
                    finished.push(i);
                } else {
                    let _ = w.tx.send(w.progress.clone());
                }
            }
        }
        for i in finished.into_iter().rev() {
            let mut w = self.prefetches.remove(i);
            self.finish(&mut w);
        }
    }

    fn finish(&mut self, w: &mut Watcher) {
        w.progress.finished = true;
        w.progress.pinned_files = self.pins.len();
        w.progress.pinned_bytes = self.pins.bytes();
        let _ = w.tx.send(w.progress.clone());
    }

    fn status(&self) -> KeeperStatus {
        KeeperStatus {
            cache_dir: self.config.cache_dir.clone(),
            ssd_budget: self.effective_ssd_budget,
            ram_budget: self.config.ram_budget,
            cached_files: self.cache.len(),
            cached_bytes: self.cache.used(),
            pinned_files: self.pins.len(),
            pinned_bytes: self.pins.bytes(),
            copying: self.in_flight.len(),
            limited_by_map_count: self.pins.limited_by_map_count,
            ..self.status.clone()
        }
    }
}
