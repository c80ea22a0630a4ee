//! The daemon: watches the chosen trees with the tracer, keeps the working set, saves it,
//! and answers the control socket.

use std::{
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::mpsc as std_mpsc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Result, bail};
use hocus_common::counter;
use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::SignalKind,
    sync::mpsc,
};

use crate::{
    access,
    control::{self, Call, Request, Response, Status, WatchedMount},
    mounts,
    observe::{Observer, Watch},
    profile::{Attributes, WorkingSet},
    store::StateDir,
    tracer::{Counters, Tracer},
};

pub struct Options {
    pub watch: Vec<PathBuf>,
    pub state_dir: PathBuf,
    pub socket: PathBuf,
    pub save_interval: Duration,
}

/// How often the ring buffer is read when the kernel does not wake us (it does so only
/// once a large batch is waiting).
const POLL_INTERVAL: Duration = Duration::from_millis(20);
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);

pub fn run(opts: Options) -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "the hocus-agent daemon loads eBPF programs and must run as root: sudo hocus-agent ..."
        );
    }
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(async { Daemon::start(opts)?.run().await })
}

struct Daemon {
    opts: Options,
    started: Instant,
    watched: Vec<WatchedMount>,
    state: StateDir,
    ws: WorkingSet,
    dirty: bool,
    last_save_error: Option<String>,
    tracer: AsyncFd<Tracer>,
    observer: Observer,
    stat_requests: std_mpsc::Sender<String>,
    stat_results: mpsc::UnboundedReceiver<(String, Option<Attributes>)>,
    /// Stats asked for and not answered yet.
    stats_pending: usize,
    reported_loss: u64,
}

impl Daemon {
    fn start(opts: Options) -> Result<Self> {
        let mount_table = mounts::read()?;
        let given = if opts.watch.is_empty() {
            let found = mounts::default_watches(&mount_table);
            if found.is_empty() {
                bail!(
                    "no network filesystem is mounted (nfs, lustre, gpfs, cifs, sshfs, ...); name the trees to watch with --watch PATH"
                );
            }
            found
        } else {
            opts.watch.clone()
        };
        let mut watches = Vec::new();
        let mut watched = Vec::new();
        for path in &given {
            let canonical = mounts::check_watch(path)?;
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
        }
        let prefixes: Vec<&Path> = watches
            .iter()
            .flat_map(|w| {
                std::iter::once(w.path.as_path()).chain(w.aliases.iter().map(PathBuf::as_path))
            })
            .collect();

        let state = StateDir::lock(&opts.state_dir)?;
        let ws = match state.load_or_set_aside() {
            Ok(Some(p)) => {
                log::info!(
                    "continuing the profile in {} ({} files, {} missing names)",
                    state.profile_path().display(),
                    p.files.len(),
                    p.missing.len()
                );
                WorkingSet::from_profile(p)
            }
            Ok(None) => WorkingSet::new(unix_now_ns()),
            Err(message) => {
                log::error!("{message}");
                WorkingSet::new(unix_now_ns())
            }
        };

        let tracer = Tracer::start(&prefixes)?;
        if !tracer.skipped.is_empty() {
            log::warn!(
                "this kernel lacks some syscalls; not traced: {}",
                tracer.skipped.join(", ")
            );
        }
        let (stat_requests, stat_results) = spawn_stat_worker();
        let mut observer = Observer::new(watches);
        // Processes that started before us: where are their working directories?
        observer.scan_processes();
        let mut tracer = tracer;
        for (tgid, place) in observer.cwd_places.drain(..) {
            tracer.set_cwd(tgid, place);
        }
        Ok(Self {
            opts,
            started: Instant::now(),
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
            reported_loss: 0,
        })
    }

    async fn run(mut self) -> Result<()> {
        let (calls_tx, mut calls) = mpsc::channel::<Call>(16);
        let server = control::serve(&self.opts.socket, calls_tx)?;
        log::info!(
            "ready: profile in {}, control socket {}",
            self.state.profile_path().display(),
            self.opts.socket.display()
        );
        let mut poll = tokio::time::interval(POLL_INTERVAL);
        let mut sweep = tokio::time::interval(SWEEP_INTERVAL);
        let mut save = tokio::time::interval(self.opts.save_interval);
        let mut term = tokio::signal::unix::signal(SignalKind::terminate())?;
        let mut int = tokio::signal::unix::signal(SignalKind::interrupt())?;
        loop {
            tokio::select! {
                ready = self.tracer.readable_mut() => {
                    let mut guard = ready?;
                    guard.clear_ready();
                    self.drain();
                }
                _ = poll.tick() => self.drain(),
                _ = sweep.tick() => self.sweep(),
                _ = save.tick() => self.save(),
                Some(result) = self.stat_results.recv() => self.stat_done(result),
                Some(call) = calls.recv() => self.answer(call).await,
                _ = term.recv() => break,
                _ = int.recv() => break,
            }
        }
        log::info!("stopping: saving the profile");
        server.abort();
        let _ = std::fs::remove_file(&self.opts.socket);
        self.drain();
        self.sweep();
        self.dirty = true;
        self.save();
        match self.last_save_error {
            Some(e) => bail!("the profile could not be saved: {e}"),
            None => Ok(()),
        }
    }

    fn drain(&mut self) {
        let Self {
            tracer,
            observer,
            ws,
            ..
        } = self;
        let n = tracer.get_mut().drain(|e| observer.handle(e, ws));
        if n > 0 {
            self.dirty = true;
        }
        for (tgid, place) in self.observer.cwd_places.drain(..) {
            self.tracer.get_mut().set_cwd(tgid, place);
        }
        for path in self.observer.to_stat.drain() {
            if self.stat_requests.send(path).is_ok() {
                self.stats_pending += 1;
            }
        }
    }

    fn stat_done(&mut self, (path, attrs): (String, Option<Attributes>)) {
        self.stats_pending -= 1;
        if let Some(attrs) = attrs {
            self.ws.set_attributes(&path, attrs);
            self.dirty = true;
        }
    }

    /// Waits (boundedly) for the sizes and mtimes of files seen so far.
    async fn finish_stats(&mut self) {
        let deadline = tokio::time::sleep(Duration::from_secs(30));
        tokio::pin!(deadline);
        while self.stats_pending > 0 {
            tokio::select! {
                Some(result) = self.stat_results.recv() => self.stat_done(result),
                _ = &mut deadline => {
                    log::warn!("{} files could not be stat'ed within 30 s", self.stats_pending);
                    break;
                }
            }
        }
    }

    fn sweep(&mut self) {
        self.drain();
        let open = self.tracer.get_ref().open_files();
        for key in self.observer.sweep(&open, &mut self.ws) {
            self.tracer.get_mut().forget_open_file(&key);
        }
        self.report_loss();
    }

    fn report_loss(&mut self) {
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
        match self.state.save(&self.ws.to_profile()) {
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

    async fn answer(&mut self, call: Call) {
        let Call {
            caller,
            request,
            reply,
        } = call;
        // Whatever the workload did before asking is in the ring buffer: read it first.
        self.sweep();
        self.finish_stats().await;
        let response = match request {
            Request::Status => Response::Status(Box::new(self.status())),
            Request::Export { root } => {
                let mut profile = self.ws.to_profile();
                if let Some(root) = root {
                    profile.retain_under(&root);
                }
                // Permission checks may touch the network: keep them off this thread.
                let checked = tokio::task::spawn_blocking(move || {
                    access::filter_for(&mut profile, &caller).map(|()| profile)
                })
                .await;
                match checked {
                    Ok(Ok(p)) => Response::Profile(p),
                    Ok(Err(e)) => Response::Error {
                        message: format!("{e:#}"),
                    },
                    Err(e) => Response::Error {
                        message: e.to_string(),
                    },
                }
            }
            Request::Import { mut profile } => {
                if !caller.is_root() {
                    // An ordinary user vouches only for what they can read, as themselves.
                    let c = caller.clone();
                    profile = match tokio::task::spawn_blocking(move || {
                        access::filter_for(&mut profile, &c).map(|()| profile)
                    })
                    .await
                    {
                        Ok(Ok(p)) => p,
                        _ => {
                            let _ = reply.send(Response::Error {
                                message: "checking the profile's entries failed".into(),
                            });
                            return;
                        }
                    };
                    for f in &mut profile.files {
                        f.uids = vec![caller.uid];
                    }
                }
                let (files, missing) = (profile.files.len(), profile.missing.len());
                self.ws.merge(profile);
                self.dirty = true;
                self.save();
                Response::Imported { files, missing }
            }
        };
        let _ = reply.send(response);
    }

    fn status(&self) -> Status {
        let p = self.ws.to_profile();
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
            uptime_secs: self.started.elapsed().as_secs(),
            state_dir: self.opts.state_dir.clone(),
            watched: self.watched.clone(),
            files: p.files.len(),
            missing: p.missing.len(),
            dirs: p.dirs.len(),
            tally: self.observer.tally.clone(),
            kernel,
            last_save_error: self.last_save_error.clone(),
            not_traced: self.tracer.get_ref().skipped.clone(),
        }
    }
}

fn lost(c: &Counters) -> u64 {
    c[counter::LOST_RING_FULL as usize]
        + c[counter::LOST_OPEN_FILES_FULL as usize]
        + c[counter::LOST_PENDING_FULL as usize]
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

/// Reads sizes and mtimes on its own thread: a stat on a network mount is a round trip.
fn spawn_stat_worker() -> (
    std_mpsc::Sender<String>,
    mpsc::UnboundedReceiver<(String, Option<Attributes>)>,
) {
    let (req_tx, req_rx) = std_mpsc::channel::<String>();
    let (res_tx, res_rx) = mpsc::unbounded_channel();
    std::thread::Builder::new()
        .name("hocus-stat".into())
        .spawn(move || {
            for path in req_rx {
                let attrs = std::fs::symlink_metadata(&path).ok().map(|m| Attributes {
                    size: m.size(),
                    mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
                });
                if res_tx.send((path, attrs)).is_err() {
                    break;
                }
            }
        })
        .expect("spawning the stat thread");
    (req_tx, res_rx)
}

fn unix_now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64
}
