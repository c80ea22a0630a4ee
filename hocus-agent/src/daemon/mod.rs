//! The daemon: watches the chosen trees with the tracer, keeps the working set, saves it,
//! and answers the control socket.

use std::{
    net::SocketAddr,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::mpsc as std_mpsc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Result, bail};
use hocus_common::{counter, kind, superblock};
use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::SignalKind,
    sync::{mpsc, oneshot},
};

use crate::{
    cache::directory::Cache,
    control::{calls, fanout, protocol::Call, server},
    observe::{
        events::{Observer, Watch},
        mounts,
        tracer::{Counters, Root, Tracer},
        views::{Anchor, Views},
    },
    place::{budget::Budgets, placement::Filters},
    profile::{
        records,
        store::StateDir,
        working_set::{Attributes, WorkingSet},
    },
    redirect::leftovers,
    report::metrics,
    shared::{
        memory,
        settings::Settings,
        status::{Status, TopFile, WatchedMount},
        tree::Tree,
    },
};

mod jobs;
mod keeper;
mod relays;
mod requests;
mod rest;

use keeper::{Handle as Keeper, KeeperError};

pub struct Options {
    /// The effective settings (defaults, config file, flags).
    pub settings: Settings,
    /// The flags alone, and the config file: SIGHUP reads the file again.
    pub flags: Settings,
    pub config: Option<PathBuf>,
}

/// How often the ring buffer is read when the kernel does not wake us (it does so only
/// once a large batch is waiting).
const POLL_INTERVAL: Duration = Duration::from_millis(20);
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// How often a changed working set is placed again.
const PLACE_INTERVAL: Duration = Duration::from_secs(2);
/// Files (and missing names) placement weighs at most: the keeper gets the most valuable
/// of a site-wide profile, not all of it.
const PLACE_CANDIDATES: usize = 100_000;
/// The hottest files `status` lists.
const STATUS_TOP_FILES: usize = 10;

pub fn run(opts: Options) -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "the hocus-agent daemon loads eBPF programs and must run as root: sudo hocus-agent ..."
        );
    }
    memory::settle();
    let cache = keeper::Config::of(&opts.settings)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let result = runtime.block_on(async { Daemon::start(opts, cache)?.run().await });
    // Work in flight (a permission check on a hung mount) is abandoned, not awaited.
    runtime.shutdown_timeout(Duration::from_millis(200));
    result
}

/// Whether the syscall program follows every process: asked to, or a watched tree is on
/// a filesystem whose opens and failed lookups are not all requests the tripwire sees
/// (NFS answers them from its caches, a local disk has no server). Otherwise it follows
/// jobs and the processes that used a watched mount (docs/overhead.md).
fn follows_every_process(asked: Option<bool>, watched: &[WatchedMount]) -> bool {
    if asked == Some(true) {
        log::info!("following every process's syscalls (trace-every-process)");
        return true;
    }
    if let Some(w) = watched.iter().find(|w| !mounts::is_fuse_type(&w.fs_type)) {
        log::info!(
            "following every process's syscalls: {} is on {}, whose opens and failed lookups do not all reach its server, where the tripwire would see who uses it",
            w.path.display(),
            w.fs_type
        );
        return true;
    }
    log::info!(
        "following the syscalls of jobs and of processes that used a watched mount; every other process's are turned away at once"
    );
    false
}

struct Daemon {
    opts: Options,
    state_dir: PathBuf,
    socket: PathBuf,
    started: Instant,
    started_unix_secs: u64,
    /// The control socket, once served.
    control: Option<server::Control>,
    /// Where metrics are served (the port chosen when 0 was asked for).
    metrics_addr: Option<SocketAddr>,
    watched: Vec<WatchedMount>,
    state: StateDir,
    ws: WorkingSet,
    dirty: bool,
    last_save_error: Option<String>,
    tracer: AsyncFd<Tracer>,
    observer: Observer,
    stat_requests: std_mpsc::Sender<String>,
    stat_results: StatResults,
    /// Stats asked for and not answered yet.
    stats_pending: usize,
    /// Client requests waiting for those stats.
    waiting: Vec<requests::Waiting>,
    reported_loss: u64,
    /// The working set's bound was reached and logged.
    said_profile_full: bool,
    keeper: Keeper,
    /// When the keeper last failed to take an order (logged at most every 10 s).
    keeper_failed_at: Option<Instant>,
    /// Jobs' snapshot views and attached tasks.
    jobs: jobs::Jobs,
    /// Multi-node jobs whose files other nodes may fetch from here.
    relays: relays::Relays,
    keeper_thread: Option<std::thread::JoinHandle<()>>,
    /// The working set changed since it was last placed.
    to_place: bool,
    /// When the tracer rests, and how often it did.
    rest: rest::Rest,
}

impl Daemon {
    fn start(opts: Options, mut cache: keeper::Config) -> Result<Self> {
        let mount_table = mounts::read()?;
        let named = opts.settings.watch.clone().unwrap_or_default();
        let given = if named.is_empty() {
            let found = mounts::default_watches(&mount_table);
            if found.is_empty() {
                bail!(
                    "no network filesystem is mounted (nfs, lustre, gpfs, cifs, sshfs, ...); name the trees to watch with --watch PATH"
                );
            }
            found
        } else {
            named.clone()
        };
        let mut watches = Vec::new();
        let mut watched = Vec::new();
        // Each tree is held from its check on: one found on its own may be unmounted
        // meanwhile (an automount expiring), and a path may lead elsewhere later.
        let mut dirs = Vec::new();
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
            let mount = mounts::mount_of(&mount_table, &canonical);
            let fs_type = mount.map(|m| m.fs_type.clone()).unwrap_or_default();
            let network = mount.is_some_and(mounts::Mount::is_network);
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
            watched.push(WatchedMount {
                path: canonical.clone(),
                fs_type,
                network,
            });
            watches.push(Watch {
                path: canonical,
                aliases,
            });
            dirs.push(dir);
        }
        if watches.is_empty() {
            bail!(
                "none of the network filesystems mounted here can be reached; name the trees to watch with --watch PATH"
            );
        }
        let prefixes: Vec<&Path> = watches
            .iter()
            .flat_map(|w| {
                std::iter::once(w.path.as_path()).chain(w.aliases.iter().map(PathBuf::as_path))
            })
            .collect();

        let state_dir = opts.settings.state_dir();
        let mut state = StateDir::lock(&state_dir)?;
        // A site-wide profile's file records live on local disk, beside its state.
        records::spill_into(&state_dir);
        let mut ws = WorkingSet::new(unix_now_ns());
        ws.set_limit(opts.settings.max_profile_entries());
        match state.load(&mut ws) {
            Ok(()) => {
                let (files, missing, _) = ws.counts();
                if files + missing > 0 {
                    log::info!(
                        "continuing the profile in {} ({files} files, {missing} missing names)",
                        state.profile_path().display(),
                    );
                }
            }
            Err(message) => log::error!("{message}"),
        }

        let mut tracer = Tracer::start(
            &prefixes,
            follows_every_process(opts.settings.trace_every_process, &watched),
        )?;
        if !tracer.skipped.is_empty() {
            log::warn!(
                "this kernel lacks some syscalls; not traced: {}",
                tracer.skipped.join(", ")
            );
        }
        cache.trees = watches.iter().map(|w| w.path.clone()).collect();
        let cache_dir = cache.cache_dir.clone();
        // Before any job of this daemon's exists.
        leftovers::take_away_at_start(&cache_dir, &cache.trees);
        let (keeper, keeper_thread) = keeper::start(cache)?;
        // Activity on these wakes the tracer when it rests.
        let devices = dirs
            .iter()
            .map(|d| mounts::metadata_of(d).map(|m| m.dev()))
            .collect::<std::io::Result<Vec<u64>>>()?;
        // Files are placed under the watched trees, and under the cache's copies and
        // snapshots (which jobs open through hocus's binds), whose paths below are the
        // network paths.
        let mut roots: Vec<Root> = watches
            .iter()
            .zip(dirs)
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
        tracer.place_under(&roots)?;
        tracer.watch_devices(&devices)?;
        let root_paths = roots
            .iter()
            .map(|r| match r.kind {
                superblock::WATCHED => r.path.clone(),
                _ => PathBuf::from("/"),
            })
            .collect();
        let trees = watches.iter().map(|w| w.path.clone()).collect();
        let (stat_requests, stat_results) = spawn_stat_worker(trees)?;
        // Where those roots are by device and path inside their filesystems: how other
        // namespaces' mounts are matched to them.
        let mut anchors = Vec::new();
        for r in roots.iter().filter(|r| r.kind == superblock::WATCHED) {
            anchors.push(Anchor::of(&mount_table, &r.path, r.path.clone(), false)?);
        }
        anchors.push(Anchor::of(
            &mount_table,
            &cache_dir.join(Cache::TREES),
            PathBuf::from("/"),
            true,
        )?);
        let observer = Observer::new(watches, root_paths, Views::new(anchors));
        Ok(Self {
            socket: opts.settings.socket(),
            state_dir,
            opts,
            started: Instant::now(),
            started_unix_secs: unix_now_ns() / 1_000_000_000,
            metrics_addr: None,
            control: None,
            watched,
            state,
            ws,
            dirty: false,
            last_save_error: None,
            // SAFETY: the ring buffer's descriptor lives as long as the tracer, which the
            // AsyncFd owns.
            tracer: unsafe { AsyncFd::register_with_interest(tracer, Interest::READABLE) }
                .map_err(|e| anyhow::anyhow!("watching the ring buffer: {}", e.into_parts().1))?,
            observer,
            stat_requests,
            stat_results,
            stats_pending: 0,
            waiting: Vec::new(),
            reported_loss: 0,
            said_profile_full: false,
            keeper,
            keeper_failed_at: None,
            jobs: jobs::Jobs::default(),
            relays: relays::Relays::default(),
            keeper_thread: Some(keeper_thread),
            to_place: true,
            rest: rest::Rest::new(),
        })
    }

    async fn run(mut self) -> Result<()> {
        let (calls_tx, mut calls) = mpsc::channel::<Call>(16);
        let mut scrapes = match self.opts.settings.metrics_addr() {
            Some(addr) => {
                let (bound, scrapes) = metrics::serve(addr).await?;
                self.metrics_addr = Some(bound);
                Some(scrapes)
            }
            None => None,
        };
        let limits = server::Limits {
            total: self.opts.settings.max_clients.unwrap_or(256),
            per_user: self.opts.settings.max_clients_per_user.unwrap_or(16),
        };
        let setup = calls::Setup {
            trees: self.watched.iter().map(|w| w.path.clone()).collect(),
            job_profiles: self.opts.settings.job_profiles(),
        };
        if let Some(port) = self.opts.settings.relay_port() {
            let serving = fanout::Serving {
                port,
                munge_socket: self.opts.settings.munge_socket.clone(),
                timeout: self.opts.settings.relay_timeout(),
            };
            match fanout::serve(serving, calls_tx.clone()) {
                Ok(addr) => log::info!(
                    "relay: the nodes of multi-node Slurm jobs fetch their files from each other through {addr}"
                ),
                // Each node then reads from the network: slower, never broken.
                Err(e) => log::warn!(
                    "relay: cannot listen on port {port} ({e}): each node of a multi-node job reads its files from the network"
                ),
            }
        }
        self.control = Some(server::serve(&self.socket, calls_tx, limits, setup)?);
        log::info!(
            "ready: profile in {}, control socket {}{}",
            self.state.profile_path().display(),
            self.socket.display(),
            self.metrics_addr
                .map(|a| format!(", metrics on http://{a}/metrics"))
                .unwrap_or_default()
        );
        let mut poll = tokio::time::interval(POLL_INTERVAL);
        let mut sweep = tokio::time::interval(SWEEP_INTERVAL);
        let mut save = tokio::time::interval(self.opts.settings.save_interval());
        let mut place = tokio::time::interval(PLACE_INTERVAL);
        let mut term = tokio::signal::unix::signal(SignalKind::terminate())?;
        let mut int = tokio::signal::unix::signal(SignalKind::interrupt())?;
        let mut hup = tokio::signal::unix::signal(SignalKind::hangup())?;
        loop {
            tokio::select! {
                ready = self.tracer.readable_mut() => {
                    let mut guard = ready?;
                    guard.clear_ready();
                    self.drain().await;
                }
                _ = poll.tick() => self.drain().await,
                _ = sweep.tick() => {
                    self.sweep().await;
                    self.reap_tasks().await;
                    self.rest_if_idle();
                    if !self.waiting.is_empty() {
                        self.answer_waiting().await;
                    }
                }
                _ = save.tick() => self.save(),
                _ = place.tick() => self.place().await,
                Some(result) = self.stat_results.recv() => {
                    self.stat_done(result);
                    if self.stats_pending == 0 && !self.waiting.is_empty() {
                        self.answer_waiting().await;
                    }
                }
                Some(call) = calls.recv() => self.answer(call).await,
                Some(reply) = next_scrape(&mut scrapes) => {
                    // What the workload did so far is counted first.
                    self.sweep().await;
                    let _ = reply.send(self.status(0).await);
                }
                _ = hup.recv() => {
                    if self.reload().await {
                        save = tokio::time::interval(self.opts.settings.save_interval());
                    }
                }
                _ = term.recv() => break,
                _ = int.recv() => break,
            }
        }
        // What was traced so far, then nothing more: the profile is complete.
        self.sweep().await;
        self.tracer.get_mut().detach();
        self.sweep().await;
        self.reap_tasks().await;
        log::info!("stopping: eBPF programs detached; saving the profile");
        self.dirty = true;
        self.save();
        self.keeper.stop().await;
        if let Some(t) = self.keeper_thread.take() {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
        log::info!("pins released; removing {}", self.socket.display());
        let _ = std::fs::remove_file(&self.socket);
        match self.last_save_error {
            Some(e) => bail!("the profile could not be saved: {e}"),
            None => Ok(()),
        }
    }

    async fn drain(&mut self) {
        let Self {
            tracer,
            observer,
            ws,
            ..
        } = self;
        let mut woken_by = None;
        let n = tracer.get_mut().drain(|e| match e.kind {
            kind::WAKE => woken_by = Some(e.tgid),
            _ => observer.handle(e, ws),
        });
        if let Some(tgid) = woken_by {
            self.wake(&format!("process {tgid} used a watched mount"));
        }
        if n > 0 {
            self.dirty = true;
            self.to_place = true;
            self.rest.active();
        }
        let accesses = std::mem::take(&mut self.observer.accesses);
        for access in accesses {
            self.record_for_slurm_job(&access);
            let sent = self.keeper.access(access).await;
            self.check(sent);
        }
        let changed = std::mem::take(&mut self.observer.changed);
        for path in changed {
            let sent = self.keeper.invalidate(path).await;
            self.check(sent);
        }
        let refused = std::mem::take(&mut self.observer.refused);
        for path in refused {
            let sent = self.keeper.refused(path).await;
            self.check(sent);
        }
        for (tgid, key, inum) in std::mem::take(&mut self.observer.to_learn) {
            self.learn_view(tgid, key, inum);
        }
        for path in self.observer.to_stat.drain() {
            if self.stat_requests.send(path).is_ok() {
                self.stats_pending += 1;
            }
        }
    }

    /// Learns how another mount namespace sees the watched trees, for the kernel side:
    /// its absolute paths count from then on.
    fn learn_view(&mut self, tgid: u32, key: hocus_common::NamespaceKey, inum: u32) {
        let tracer = self.tracer.get_mut();
        // Read before the mounts: a mount that changes them after this bumps it again.
        let generation = match tracer.mount_generation() {
            Ok(g) => g,
            Err(e) => return log::warn!("reading the mount generation: {e:#}"),
        };
        match self.observer.views.learn(tgid, key, inum, generation) {
            Ok((view, forget)) => {
                if let Err(e) = tracer.set_view(key, view, forget) {
                    log::warn!("giving the kernel the view of mount namespace {inum}: {e:#}");
                }
            }
            // Gone already, or moved: the next lookup there asks again.
            Err(e) => log::debug!("not learning mount namespace {inum}: {e:#}"),
        }
    }

    fn stat_done(&mut self, (path, attrs): (String, Option<Attributes>)) {
        self.stats_pending -= 1;
        if let Some(attrs) = attrs {
            self.ws.set_attributes(&path, attrs);
            self.dirty = true;
        }
    }

    async fn place(&mut self) {
        // The keeper has not taken the last view yet: the next tick tries again.
        if self.to_place && self.keeper.view_waiting() {
            return;
        }
        if std::mem::take(&mut self.to_place) {
            let sent = self
                .keeper
                .place(self.ws.for_placement(PLACE_CANDIDATES))
                .await;
            self.check(sent);
        }
    }

    /// Logs a keeper that did not take an order (at most every 10 s).
    fn check<T>(&mut self, result: Result<T, KeeperError>) -> Option<T> {
        match result {
            Ok(t) => Some(t),
            Err(e) => {
                if self
                    .keeper_failed_at
                    .is_none_or(|at| at.elapsed() >= Duration::from_secs(10))
                {
                    log::warn!("{e}: what it was told meanwhile is lost");
                    self.keeper_failed_at = Some(Instant::now());
                }
                None
            }
        }
    }

    async fn sweep(&mut self) {
        self.drain().await;
        let open = self.tracer.get_ref().open_files();
        for key in self.observer.sweep(&open, &mut self.ws) {
            self.tracer.get_mut().forget_open_file(&key);
        }
        let mapped = self.tracer.get_ref().mapped_files();
        for key in self.observer.sweep_mapped(&mapped, &mut self.ws) {
            self.tracer.get_mut().forget_mapped(&key);
        }
        if !self.observer.accesses.is_empty() {
            // Bytes read (through descriptors or mapped pages) count in the profile and
            // in placement.
            self.dirty = true;
            self.to_place = true;
            self.rest.active();
        }
        self.report_loss();
    }

    fn report_loss(&mut self) {
        if self.ws.dropped() > 0 && !self.said_profile_full {
            log::warn!(
                "the working set holds its most entries ({}, max-profile-entries): new names read are no longer recorded (writes still are); counted in status and hocus_profile_entries_dropped_total",
                self.opts.settings.max_profile_entries()
            );
            self.said_profile_full = true;
        }
        let Ok(c) = self.tracer.get_ref().counters() else {
            return;
        };
        let lost = lost(&c);
        if lost > self.reported_loss {
            log::warn!(
                "{} events could not be delivered so far ({}); the profile misses them",
                lost,
                describe(&c)
            );
            self.reported_loss = lost;
        }
    }

    fn save(&mut self) {
        if !self.dirty {
            return;
        }
        match self.state.save(&mut self.ws) {
            Ok(()) => {
                self.dirty = false;
                self.last_save_error = None;
            }
            Err(e) => {
                let message = format!("{e:#}");
                if self.last_save_error.as_deref() != Some(&message) {
                    log::error!("{message}; will retry");
                }
                self.last_save_error = Some(message);
            }
        }
    }

    async fn status(&mut self, top: usize) -> Status {
        let (files, missing, dirs) = self.ws.counts();
        let roots: Vec<PathBuf> = self.watched.iter().map(|w| w.path.clone()).collect();
        let (hottest, roots) = self.ws.summary(top, &roots);
        let paths: Vec<String> = hottest.iter().map(|f| f.path.clone()).collect();
        let n = paths.len();
        let held = match n {
            0 => Vec::new(),
            _ => self
                .keeper
                .where_held(paths)
                .await
                .unwrap_or_else(|_| vec!["network".into(); n]),
        };
        let cache = self.keeper.status().await;
        let cache = self.check(cache);
        let top = hottest
            .into_iter()
            .zip(held)
            .map(|(f, held)| TopFile {
                path: f.path,
                opens: f.opens,
                size: f.size,
                bytes_read: f.bytes_read,
                held,
            })
            .collect();
        let kernel = self
            .tracer
            .get_ref()
            .counters()
            .map(|c| {
                counter::NAMES
                    .iter()
                    .zip(c)
                    .map(|(n, v)| ((*n).to_owned(), v))
                    .collect()
            })
            .unwrap_or_default();
        Status {
            pid: std::process::id(),
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_secs: self.started.elapsed().as_secs(),
            started_unix_secs: self.started_unix_secs,
            state_dir: self.state_dir.clone(),
            metrics_addr: self.metrics_addr,
            watched: self.watched.clone(),
            roots,
            top,
            files,
            missing,
            dirs,
            profile_bytes: self.ws.heap_bytes() as u64,
            max_profile_entries: self.opts.settings.max_profile_entries(),
            profile_entries_dropped: self.ws.dropped(),
            tally: self.observer.tally.clone(),
            kernel,
            last_save_error: self.last_save_error.clone(),
            not_traced: self.tracer.get_ref().skipped.clone(),
            cache,
            control: self
                .control
                .as_ref()
                .map(server::Control::status)
                .unwrap_or_default(),
            tracing: self.tracing_status(),
        }
    }

    /// SIGHUP: reads the config file again and applies what can change live. A bad file
    /// changes nothing. Returns whether the settings changed.
    async fn reload(&mut self) -> bool {
        let new = match Settings::effective(&self.opts.flags, self.opts.config.as_deref()) {
            Ok(s) => s,
            Err(e) => {
                log::error!("SIGHUP: keeping the running configuration: {e:#}");
                return false;
            }
        };
        if new == self.opts.settings {
            log::info!("SIGHUP: the configuration is unchanged");
            return false;
        }
        let budgets = match Budgets::of(&new) {
            Ok(b) => b,
            Err(e) => {
                log::error!("SIGHUP: keeping the running configuration: {e:#}");
                return false;
            }
        };
        for name in new.restart_only_changes(&self.opts.settings) {
            log::warn!("SIGHUP: {name} changed: that takes a restart");
        }
        new.apply_logging();
        let reconfigured = self
            .keeper
            .reconfigure(keeper::Reconfigure {
                ssd_budget: budgets.ssd,
                ram_budget: budgets.ram,
                filters: Filters::of(&new),
                revalidate: new.revalidate(),
            })
            .await;
        self.check(reconfigured);
        log::info!(
            "SIGHUP: configuration reloaded from {}",
            self.opts
                .config
                .as_ref()
                .map_or("the flags alone".into(), |p| p.display().to_string())
        );
        self.ws.set_limit(new.max_profile_entries());
        self.opts.settings = new;
        true
    }
}

/// The next scrape waiting, or never when metrics are off.
async fn next_scrape(scrapes: &mut Option<metrics::Scrapes>) -> Option<oneshot::Sender<Status>> {
    match scrapes {
        Some(s) => s.recv().await,
        None => std::future::pending().await,
    }
}

fn lost(c: &Counters) -> u64 {
    c[counter::LOST_RING_FULL as usize] + c[counter::LOST_OPEN_FILES_FULL as usize]
}

fn describe(c: &Counters) -> String {
    counter::NAMES
        .iter()
        .zip(c)
        .skip(1)
        .filter(|(_, v)| **v > 0)
        .map(|(n, v)| format!("{n} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Files stat'ed, with what was found (None: gone).
type StatResults = mpsc::UnboundedReceiver<(String, Option<Attributes>)>;

/// Reads sizes and mtimes on its own thread: a stat on a network mount is a round trip.
fn spawn_stat_worker(
    trees: Vec<PathBuf>,
) -> std::io::Result<(std_mpsc::Sender<String>, StatResults)> {
    let (req_tx, req_rx) = std_mpsc::channel::<String>();
    let (res_tx, res_rx) = mpsc::unbounded_channel();
    std::thread::Builder::new()
        .name("hocus-stat".into())
        .spawn(move || {
            for path in req_rx {
                // Beneath its watched tree, following no symlink on the way.
                let p = Path::new(&path);
                let stat = trees.iter().find(|t| p.starts_with(t));
                let stat = stat.and_then(|t| Tree::open(t).and_then(|t| t.stat(p)).ok());
                let attrs = stat.map(|m| Attributes {
                    size: m.size(),
                    mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
                });
                if res_tx.send((path, attrs)).is_err() {
                    break;
                }
            }
        })?;
    Ok((req_tx, res_rx))
}

fn unix_now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64
}
