//! The daemon: watches the chosen trees with the tracer, keeps the working set, saves it,
//! places it with the keeper, and answers the control socket. This file is the loop and
//! its dispatch; each state has one owner beside it: `tracing` (the kernel side, with
//! `rest`), `stats` (sizes of newly seen files), `profiling` (the working set and its
//! state directory), `jobs`, `relays`, `requests` (what waits, and the work done off the
//! loop), and the `keeper` (placement, on its own thread). `trees` finds what is watched
//! at start; `faces` starts the control socket and the relay port.
//!
//! May use: everything below it.

use std::{
    net::SocketAddr,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use hocus_control::{
    Response,
    status::{Status, WatchedMount},
};
use tokio::{
    signal::unix::SignalKind,
    sync::{mpsc, oneshot},
};

use crate::{
    cache::relay::Holding,
    control::{
        gate::Control,
        messages::{Answer, Ask, Call, JobNodes, Query},
        refusal::Refusal,
    },
    observe::{
        events::Observer, mounts, places::Places, tracefs, tracer::Tracer, tripwires, views::Views,
    },
    place::{budget::Budgets, placement::Filters},
    profile::{
        staging::Staging,
        working_set::{SHORTLIST_SLICE, ShortlistBuild},
    },
    redirect::{bind_opens, identity, jobs::JobStart, leftovers, mountns, spawn},
    report::metrics,
    shared::{
        asked,
        kernel::{self, Route},
        memory,
        settings::Settings,
    },
};

mod faces;
mod jobs;
mod keeper;
mod profiling;
mod relays;
mod requests;
mod rest;
mod stats;
mod status;
mod tracing;
mod trees;

use self::{
    jobs::Jobs,
    keeper::{Handle as Keeper, KeeperError},
    profiling::{Profiling, unix_now_ns},
    relays::Relays,
    requests::{EXPORT_PART, Reply, Waiting},
    stats::Stats,
    tracing::Tracing,
    trees::Trees,
};

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

struct Daemon {
    opts: Options,
    socket: PathBuf,
    started: Instant,
    started_unix_secs: u64,
    /// The control socket, once served.
    control: Option<Control>,
    /// Where metrics are served (the port chosen when 0 was asked for).
    metrics_addr: Option<SocketAddr>,
    watched: Vec<WatchedMount>,
    tracing: Tracing,
    stats: Stats,
    profiling: Profiling,
    /// Client requests waiting for the stats under way.
    waiting: Vec<Waiting>,
    keeper: Keeper,
    /// When the keeper last failed to take an order (logged at most every 10 s).
    keeper_failed_at: Option<Instant>,
    /// The next placement's shortlist, being built a slice per turn of the loop.
    shortlist_build: Option<ShortlistBuild>,
    keeper_thread: Option<std::thread::JoinHandle<()>>,
    /// Jobs' snapshot overlays and attached tasks.
    jobs: Jobs,
    /// Multi-node jobs whose files other nodes may fetch from here.
    relays: Relays,
    /// The running kernel, and the way each part takes on it.
    kernel_release: String,
    routes: Vec<Route>,
    /// The tracer may rest while jobs run whose requests all hit local copies.
    rests_with_jobs: bool,
}

impl Daemon {
    fn start(opts: Options, mut cache: keeper::Config) -> Result<Self> {
        let kernel_release = kernel::release();
        kernel::check_supported(&kernel_release)?;
        kernel::check_fallbacks()?;
        spawn::close_inherited_on_exec();
        let mount_table = mounts::read()?;
        let named = opts.settings.watch.clone().unwrap_or_default();
        let trees = Trees::find(&named, &mount_table)?;
        let profiling = Profiling::load(
            &opts.settings.state_dir(),
            opts.settings.max_profile_entries(),
        )?;
        let (every_process, tripwires, following) = trees::follows_every_process(
            opts.settings.trace_every_process,
            &trees.watched,
            &tripwires::on_this_kernel(&tracefs::root()?),
        );
        let mut tracer = Tracer::start(&trees.prefixes(), every_process, &tripwires)?;
        let (rests_with_jobs, at_rest) = trees::rests_while_jobs_run(
            every_process,
            &tripwires,
            tracer.tells_misses,
            tracer.learns_by_requests,
        );
        if !tracer.skipped.is_empty() {
            log::warn!(
                "this kernel lacks some syscalls; not traced: {}",
                tracer.skipped.join(", ")
            );
        }
        cache.trees = trees.paths();
        cache.revalidate_max = trees.longest_wait(&opts.settings);
        let cache_dir = cache.cache_dir.clone();
        // Before any job of this daemon's exists.
        leftovers::take_away_at_start(&cache_dir, &cache.trees);
        let (keeper, keeper_thread, [snapshots, big_files]) = keeper::start(cache)?;
        let (bind_opens, slurm_at_rest) = bind_opens::start();
        let mut routes = tracer.routes.clone();
        routes.extend([
            following,
            at_rest,
            slurm_at_rest,
            snapshots,
            big_files,
            mountns::read_only_route(),
            identity::route(),
        ]);
        kernel::log_routes(&kernel_release, &routes);
        let devices = trees.devices()?;
        let (watched, watches) = (trees.watched.clone(), trees.watches.clone());
        asked::watch(
            watched
                .iter()
                .filter(|w| w.network)
                .map(|w| w.path.clone())
                .collect(),
        );
        let roots = trees.into_roots(&cache_dir)?;
        tracer.place_under(&roots)?;
        tracer.watch_devices(&devices)?;
        let stats = Stats::start(watches.iter().map(|w| w.path.clone()).collect())?;
        let anchors = trees::anchors(&mount_table, &roots, &cache_dir)?;
        let places = Places::new(
            watches,
            trees::root_paths(&roots),
            trees::served_from(&roots),
        );
        let observer = Observer::new(places, Views::new(anchors));
        Ok(Self {
            socket: opts.settings.socket(),
            opts,
            started: Instant::now(),
            started_unix_secs: unix_now_ns() / 1_000_000_000,
            metrics_addr: None,
            control: None,
            watched,
            tracing: Tracing::new(tracer, observer)?,
            stats,
            profiling,
            waiting: Vec::new(),
            keeper,
            keeper_failed_at: None,
            shortlist_build: None,
            keeper_thread: Some(keeper_thread),
            jobs: Jobs::new(bind_opens),
            relays: Relays::default(),
            kernel_release,
            routes,
            rests_with_jobs,
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
        self.serve(calls_tx)?;
        let mut poll = tokio::time::interval(POLL_INTERVAL);
        let mut sweep = tokio::time::interval(SWEEP_INTERVAL);
        let mut save = tokio::time::interval(self.opts.settings.save_interval());
        let mut place = tokio::time::interval(PLACE_INTERVAL);
        let mut term = tokio::signal::unix::signal(SignalKind::terminate())?;
        let mut int = tokio::signal::unix::signal(SignalKind::interrupt())?;
        let mut hup = tokio::signal::unix::signal(SignalKind::hangup())?;
        loop {
            tokio::select! {
                ready = self.tracing.readable() => {
                    ready?;
                    self.drain().await;
                }
                _ = poll.tick() => self.drain().await,
                _ = sweep.tick() => {
                    self.sweep().await;
                    self.reap_tasks().await;
                    let after = self.opts.settings.rest_after();
                    self.tracing
                        .rest_if_idle(after, self.jobs.at_rest(self.rests_with_jobs));
                    if !self.waiting.is_empty() {
                        self.answer_waiting().await;
                    }
                }
                _ = save.tick() => self.profiling.save(),
                // A snapshot or placement shortlist of a large working set: a slice per turn,
                // between the rest.
                () = tokio::task::yield_now(), if self.profiling.slicing() || self.shortlist_build.is_some() => {
                    self.profiling.write_slice();
                    self.build_shortlist().await;
                }
                _ = place.tick() => self.place().await,
                Some((path, attrs)) = self.stats.next() => {
                    self.profiling.stat_done(&path, attrs);
                    if self.stats.pending() == 0 && !self.waiting.is_empty() {
                        self.answer_waiting().await;
                    }
                }
                Some(call) = calls.recv() => self.answer(call).await,
                Some(reply) = next_scrape(&mut scrapes) => {
                    // What the workload did so far is counted first.
                    self.sweep().await;
                    let status = self.status(0);
                    tokio::spawn(async move { reply.send(status.await) });
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
        self.tracing.tracer_mut().detach();
        self.sweep().await;
        self.reap_tasks().await;
        log::info!("stopping: eBPF programs detached; saving the profile");
        self.profiling.save_last();
        self.keeper.stop().await;
        if let Some(t) = self.keeper_thread.take() {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
        log::info!("pins released; removing {}", self.socket.display());
        let _ = std::fs::remove_file(&self.socket);
        match self.profiling.last_save_error() {
            Some(e) => bail!("the profile could not be saved: {e}"),
            None => Ok(()),
        }
    }

    /// Reads what the kernel side sent (and the opens through Slurm tasks' binds) and
    /// routes what it means.
    async fn drain(&mut self) {
        let resting = self.tracing.tracer().is_resting();
        let drained = self.tracing.drain(&mut self.profiling.ws);
        let opened = self.jobs.read_opens(resting);
        self.tracing.observer.accesses.extend(opened);
        if let Some(tgid) = drained.woken_by {
            self.tracing
                .wake(&format!("process {tgid} used a watched mount"));
        }
        if drained.events > 0 {
            self.profiling.changed();
        }
        self.route().await;
    }

    /// Routes what the observer found: accesses to the jobs and the keeper, changed and
    /// refused files to the keeper, files to stat to the stat thread.
    async fn route(&mut self) {
        let observer = &mut self.tracing.observer;
        let accesses = std::mem::take(&mut observer.accesses);
        let changed = std::mem::take(&mut observer.changed);
        let refused = std::mem::take(&mut observer.refused);
        let to_stat: Vec<String> = observer.to_stat.drain().collect();
        for access in &accesses {
            self.jobs.record_for_slurm_job(access);
        }
        let sent = self.keeper.accesses(accesses);
        self.check(sent);
        for path in changed {
            let sent = self.keeper.invalidate(path).await;
            self.check(sent);
        }
        for path in refused {
            let sent = self.keeper.refused(path).await;
            self.check(sent);
        }
        for path in to_stat {
            self.stats.ask(path);
        }
    }

    async fn sweep(&mut self) {
        self.drain().await;
        // Bytes read (through descriptors or mapped pages) count in the profile and in
        // placement.
        if self.tracing.sweep(&mut self.profiling.ws) {
            self.profiling.changed();
            // Routed now, to the jobs too: a job that ends next is forgotten after this
            // sweep, and its files' releases (FUSE's come after the task is gone) are
            // then no longer its own profile's.
            self.route().await;
        }
        if self.tracing.changes_unplaced() {
            log::info!(
                "a change on a watched tree named no file the kernel side could place (a long name, by an absolute path in a namespace not learned): every copy a running job has bound is checked against the network now (the others at the next job's start)"
            );
            let sent = self.keeper.revalidate_now().await;
            self.check(sent);
        }
        self.profiling
            .say_if_full(self.opts.settings.max_profile_entries());
        self.tracing.report_loss();
    }

    async fn place(&mut self) {
        // The keeper has not taken the last shortlist yet: the next tick tries again.
        if self.profiling.wants_placing() && self.keeper.shortlist_waiting() {
            return;
        }
        if self.shortlist_build.is_none() && self.profiling.take_to_place() {
            self.shortlist_build = Some(self.profiling.ws.shortlist_build(PLACE_CANDIDATES));
            self.build_shortlist().await;
        }
    }

    /// Builds a slice of the shortlist being built; sends it to the keeper once it is done.
    async fn build_shortlist(&mut self) {
        let Some(build) = &mut self.shortlist_build else {
            return;
        };
        if let Some(shortlist) = self.profiling.ws.build_shortlist(build, SHORTLIST_SLICE) {
            self.shortlist_build = None;
            let sent = self.keeper.place(shortlist).await;
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

    /// Handles one call from a connection.
    async fn answer(&mut self, call: Call) {
        let Call { caller, ask, reply } = call;
        let answer: Answer = match ask {
            Ask::Client(request) => {
                // Whatever the workload did before asking is in the ring buffer: read it
                // first, and answer once the sizes of the files it saw are known.
                self.sweep().await;
                let waiting = Waiting::new(caller, request, reply);
                if self.stats.pending() == 0 {
                    self.respond(waiting).await;
                } else {
                    self.waiting.push(waiting);
                }
                return;
            }
            Ask::Binds | Ask::RelayVouch { .. } | Ask::CopiesExpect => {
                return self.give_binds(ask, reply).await;
            }
            Ask::JobStarting(start) => self.job_starting(start).await,
            Ask::Stale { sources } => {
                for source in sources {
                    let sent = self
                        .keeper
                        .invalidate(source.to_string_lossy().into_owned())
                        .await;
                    self.check(sent);
                }
                return;
            }
            Ask::ExportPart(mut order) => {
                let part = self.profiling.ws.export_part(&mut order, EXPORT_PART);
                Answer::Export { order, part }
            }
            Ask::JobEnded { id } => {
                self.job_ended(id).await;
                return;
            }
            Ask::RelayJoin {
                job_id,
                from,
                to,
                held,
            } => self.relays.join(job_id, &from, &to, held),
            Ask::JobParent { job_id } => Answer::Parent(self.relays.parent_of(job_id)),
            Ask::RelayJob(nodes) => {
                Answer::Parent(self.relays.add(&nodes, None, &self.opts.settings).await)
            }
            Ask::RelayForget(job_id) => {
                self.relays.forget(job_id);
                Answer::Ready
            }
            Ask::RelayHeld { job_id, me, files } => {
                if self.relays.hold(job_id, &me, files, &self.opts.settings) {
                    Answer::Ready
                } else {
                    Refusal::new("relay_off", "the relay is off on this node").into()
                }
            }
            Ask::RelayFile {
                job_id,
                from,
                source,
                held,
            } => match self.relays.may_fetch(job_id, &from, &source, held) {
                Err(r) => r.into(),
                // Its profile is being read here: its copies are coming.
                Ok(None) => Answer::Relay(Holding::Coming),
                Ok(Some(false)) => Answer::Relay(Holding::No),
                Ok(Some(true)) => {
                    Answer::Relay(self.keeper.local_copy(source).await.unwrap_or(Holding::No))
                }
            },
            Ask::TakeJobProfile { slurm_job } => {
                // What the job's last processes did is read first.
                self.sweep().await;
                match self.jobs.take_profile(slurm_job, &self.profiling.ws) {
                    Some(p) => Answer::JobProfile(p),
                    None => Refusal::new(
                        "unknown_job",
                        format!("no task of Slurm job {slurm_job} was attached on this node"),
                    )
                    .into(),
                }
            }
        };
        let _ = reply.send(answer);
    }

    /// A job is starting: the tracer follows it from its start, and sees the namespace
    /// the job's session makes (where the request programs learn jobs, it rests again
    /// once the job has started, unless the job has local copies whose hits it counts).
    /// What was queued while it rested is read first: opens through Slurm tasks' binds
    /// then are the tracer's to count no more.
    pub(super) async fn wake_for_job(&mut self) {
        if self.tracing.tracer().is_resting() {
            self.drain().await;
        }
        self.tracing.wake("a job is starting");
    }

    /// A job starts: the keeper learns of it before anything it does.
    async fn job_starting(&mut self, mut start: JobStart) -> Answer {
        // Events already read belong to earlier jobs.
        self.wake_for_job().await;
        self.drain().await;
        self.profiling.ws.job_started(unix_now_ns());
        let task = start.task.take().map(|pidfd| jobs::Task {
            pidfd,
            slurm: start.slurm,
            marked: start.marked.take(),
        });
        // Its hits, if it has local copies, are counted by the tracer for `rest-after`
        // seconds, as before any rest (fanotify reports a Slurm task's opens only, not
        // the failed lookups its snapshots answer).
        let hits = !start.binds.is_empty();
        let overlays = std::mem::take(&mut start.overlays);
        let started = self.jobs.start(&mut self.tracing, start.id, task, overlays);
        // Its namespace and snapshot overlays are known: the request programs learn it.
        if !hits && self.opts.settings.rest_after().is_some() {
            self.tracing.rest_for_requests();
        }
        if let Err(r) = started {
            return r.into();
        }
        let started = self.keeper.job_starting(start).await;
        // A job the keeper does not follow still runs: its accesses count as misses.
        self.check(started);
        Answer::Ready
    }

    /// Job `id` ended: what it did is read, then it is forgotten.
    async fn job_ended(&mut self, id: u32) {
        self.sweep().await;
        self.jobs.ended(&mut self.tracing, id);
        let ended = self.keeper.job_ended(id).await;
        self.check(ended);
    }

    /// Ends the attached tasks that exited.
    async fn reap_tasks(&mut self) {
        for id in self.jobs.exited_tasks() {
            self.job_ended(id).await;
        }
    }

    /// Answers the requests that waited for stats: all of them once none are pending,
    /// else those that waited too long.
    async fn answer_waiting(&mut self) {
        for w in requests::due(&mut self.waiting, self.stats.pending()) {
            self.respond(w).await;
        }
    }

    async fn respond(&mut self, w: Waiting) {
        let Waiting {
            caller,
            request,
            reply,
            ..
        } = w;
        let answer: Answer = match request {
            Query::Status => {
                let status = self.status(STATUS_TOP_FILES);
                return requests::send_status(status, caller, reply);
            }
            Query::Export { root } => {
                let ws = &self.profiling.ws;
                let mut order = ws.export_order(root.as_deref());
                let part = ws.export_part(&mut order, EXPORT_PART);
                let order = Box::new(order);
                Answer::Export { order, part }
            }
            Query::Import(staged) => {
                let Staging {
                    set,
                    files,
                    missing,
                    refused,
                    refused_total,
                    ..
                } = *staged;
                self.profiling.merge(set);
                Response::Imported {
                    files,
                    missing,
                    refused_total,
                    refused,
                }
                .into()
            }
            Query::Prefetch {
                staged,
                relay,
                node,
            } => {
                return self.prefetch(*staged, relay, node, reply).await;
            }
            Query::Budgets { .. } if !caller.is_root() => Refusal::new(
                "not_root",
                "only root may change the budgets: run it with sudo",
            )
            .into(),
            Query::Budgets { ssd, ram } => {
                let set = self.keeper.set_budgets(ssd, ram).await;
                match set.and(Ok(self.status(0).await)) {
                    Ok(status) if status.cache.is_some() => {
                        Response::Status(Box::new(status)).into()
                    }
                    Ok(_) => Refusal::new("busy", KeeperError::Busy.to_string()).into(),
                    Err(e) => Refusal::new("busy", e.to_string()).into(),
                }
            }
        };
        let _ = reply.send(answer);
    }

    /// Merges a sent profile and warms the cache from it now, reporting progress.
    async fn prefetch(
        &mut self,
        staged: Staging,
        relay: Option<JobNodes>,
        node: Option<String>,
        reply: Reply,
    ) {
        let Staging {
            set,
            refused,
            refused_total,
            holder,
            ..
        } = staged;
        // Placed now, from what the daemon knows of those files (sizes, writes seen),
        // not only from what the sender said.
        let profile = self.profiling.merge_to_prefetch(set);
        let from = (relay.as_ref(), holder.as_ref(), node.as_deref());
        let parent = self
            .relays
            .copies_from(from, &profile, &self.opts.settings)
            .await;
        let (tx, rx) = mpsc::unbounded_channel();
        if let Err(e) = self.keeper.prefetch(profile, tx, parent).await {
            let _ = reply.send(Refusal::new("busy", e.to_string()).into());
            return;
        }
        // Progress arrives from the keeper's thread until it is done.
        requests::send_progress(rx, refused, refused_total, reply);
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
                revalidate_max: new.revalidate_max(),
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
        self.profiling.ws.set_limit(new.max_profile_entries());
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
