//! Answering the control socket without stalling the loop. A request is answered from
//! the loop's state as it is, once the sizes of the files seen before it are known (it
//! waits in a queue for that, up to [`STATS_WAIT`], while the loop goes on); anything that
//! may touch the network (the caller's permission checks) runs on a task of its own, and
//! what it checked comes back to the loop as a message.

use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

use tokio::sync::mpsc;

use super::{Daemon, STATUS_TOP_FILES, keeper::KeeperError};
use crate::{
    control::protocol::{Ask, Call, JobNodes, Query, Response},
    profile::{
        format::{FileEntry, Profile},
        staging::Staging,
        working_set::WorkingSet,
    },
    redirect::access::{self, Caller},
    shared::{memory, status::TopFile},
};

/// How long a request waits for the sizes of files seen before it.
pub const STATS_WAIT: Duration = Duration::from_secs(30);

/// Entries of an export handed to its connection per turn of the loop.
const EXPORT_PART: usize = 8192;

/// Where a request's answers go.
type Reply = mpsc::UnboundedSender<Response>;

/// A client request waiting for the stats under way.
pub struct Waiting {
    caller: Caller,
    request: Query,
    reply: Reply,
    since: Instant,
}

impl Daemon {
    /// Handles one call from a connection.
    pub(super) async fn answer(&mut self, call: Call) {
        let Call { caller, ask, reply } = call;
        match ask {
            Ask::Client(request) => {
                // Whatever the workload did before asking is in the ring buffer: read it
                // first, and answer once the sizes of the files it saw are known.
                self.sweep().await;
                let waiting = Waiting {
                    caller,
                    request,
                    reply,
                    since: Instant::now(),
                };
                if self.stats_pending == 0 {
                    self.respond(waiting).await;
                } else {
                    self.waiting.push(waiting);
                }
            }
            Ask::Binds => {
                // The first step of every job session, before its namespace is made: the
                // tracer follows the job from its start.
                self.wake("a job is starting");
                let response = match self.keeper.binds().await {
                    Ok(binds) => Response::Binds(binds),
                    Err(e) => Response::Error {
                        message: e.to_string(),
                    },
                };
                let _ = reply.send(response);
            }
            Ask::JobStarting {
                id,
                binds,
                ns,
                task,
                views,
                slurm,
            } => {
                // Events already read belong to earlier jobs; the keeper learns of this
                // one before anything it does.
                self.wake("a job is starting");
                self.drain().await;
                if let Some(pidfd) = task {
                    if let Err(message) = self.follow_task(id, pidfd, slurm.map(|s| s.job_id)) {
                        let _ = reply.send(Response::Error { message });
                        return;
                    }
                }
                self.jobs.start(id);
                self.place_views(id, views);
                let started = self.keeper.job_starting(id, binds, ns, slurm).await;
                // A job the keeper does not follow still runs: its accesses count as
                // misses.
                self.check(started);
                let _ = reply.send(Response::Ready);
            }
            Ask::Stale { sources } => {
                for source in sources {
                    let sent = self
                        .keeper
                        .invalidate(source.to_string_lossy().into_owned())
                        .await;
                    self.check(sent);
                }
            }
            Ask::ExportPart(mut order) => {
                let part = self.ws.export_part(&mut order, EXPORT_PART);
                let _ = reply.send(Response::Export { order, part });
            }
            Ask::JobEnded { id } => self.job_ended(id).await,
            Ask::RelayJoin { job_id, from, to } => {
                let _ = reply.send(self.relay_join(job_id, &from, &to));
            }
            Ask::RelayFile {
                job_id,
                from,
                source,
            } => {
                let _ = reply.send(self.relay_file(job_id, &from, source).await);
            }
            Ask::TakeJobProfile { slurm_job } => {
                // What the job's last processes did is read first.
                self.sweep().await;
                let response = match self.take_job_profile(slurm_job) {
                    Some(p) => Response::JobProfile(p),
                    None => Response::Error {
                        message: format!(
                            "no task of Slurm job {slurm_job} was attached on this node"
                        ),
                    },
                };
                let _ = reply.send(response);
            }
        }
    }

    /// Answers the requests that waited for stats: all of them once none are pending,
    /// else those that waited too long.
    pub(super) async fn answer_waiting(&mut self) {
        let all = self.stats_pending == 0;
        let (due, still): (Vec<Waiting>, Vec<Waiting>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|w| all || w.since.elapsed() >= STATS_WAIT);
        self.waiting = still;
        if !all && !due.is_empty() {
            log::warn!(
                "{} files could not be stat'ed within {} s; answering without their sizes",
                self.stats_pending,
                STATS_WAIT.as_secs()
            );
        }
        for w in due {
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
        let response = match request {
            Query::Status => {
                let mut status = self.status(STATUS_TOP_FILES).await;
                tokio::spawn(async move {
                    status.top = readable_by(status.top, &caller).await;
                    let _ = reply.send(Response::Status(Box::new(status)));
                });
                return;
            }
            Query::Export { root } => {
                let mut order = self.ws.export_order(root.as_deref());
                let part = self.ws.export_part(&mut order, EXPORT_PART);
                let order = Box::new(order);
                Response::Export { order, part }
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
                self.merge(set);
                Response::Imported {
                    files,
                    missing,
                    refused_total,
                    refused,
                }
            }
            Query::Prefetch { staged, relay } => {
                self.prefetch(*staged, relay, reply).await;
                return;
            }
            Query::Budgets { .. } if !caller.is_root() => Response::Error {
                message: "only root may change the budgets".into(),
            },
            Query::Budgets { ssd, ram } => {
                let set = self.keeper.set_budgets(ssd, ram).await;
                match set.and(Ok(self.status(0).await)) {
                    Ok(status) if status.cache.is_some() => Response::Status(Box::new(status)),
                    Ok(_) => Response::Error {
                        message: KeeperError::Busy.to_string(),
                    },
                    Err(e) => Response::Error {
                        message: e.to_string(),
                    },
                }
            }
        };
        let _ = reply.send(response);
    }

    /// Merges a sent profile and warms the cache from it now, reporting progress.
    async fn prefetch(&mut self, staged: Staging, relay: Option<JobNodes>, reply: Reply) {
        let Staging {
            set,
            refused,
            refused_total,
            ..
        } = staged;
        // Placed now, from what the daemon knows of those files (sizes, writes seen),
        // not only from what the sender said.
        self.ws.merge_set(&set);
        self.dirty = true;
        self.to_place = false;
        self.save();
        let profile = self.ws.profile_for(&set);
        drop(set);
        let parent = match &relay {
            Some(nodes) => self.relay_job(nodes, &profile).await,
            None => None,
        };
        let mut refused = Some(refused);
        let (tx, mut rx) = mpsc::unbounded_channel();
        if let Err(e) = self.keeper.prefetch(profile, tx, parent).await {
            let _ = reply.send(Response::Error {
                message: e.to_string(),
            });
            return;
        }
        // Progress arrives from the keeper's thread until it is done.
        tokio::spawn(async move {
            while let Some(mut progress) = rx.recv().await {
                // The first report names what was refused.
                if let Some(r) = refused.take() {
                    progress.refused = r;
                    progress.refused_total = refused_total;
                }
                let finished = progress.finished;
                if reply.send(Response::Progress(progress)).is_err() || finished {
                    break;
                }
            }
        });
    }

    /// Merges a checked profile (see `control::calls::read_profile`), to be placed.
    fn merge(&mut self, set: WorkingSet) {
        self.ws.merge_state(set);
        self.dirty = true;
        self.to_place = true;
        self.save();
        // The import's batches and staging are gone (a site-wide one: tens of MiB).
        memory::give_back();
    }
}

/// The hottest files `caller` may read (all of them for root).
async fn readable_by(top: Vec<TopFile>, caller: &Caller) -> Vec<TopFile> {
    if caller.is_root() {
        return top;
    }
    let files = top
        .iter()
        .map(|t| FileEntry {
            path: t.path.clone(),
            ..Default::default()
        })
        .collect();
    let probe = Profile {
        files,
        ..Default::default()
    };
    let readable: HashSet<String> = match checked_for(probe, caller).await {
        Ok(p) => p.files.into_iter().map(|f| f.path).collect(),
        Err(_) => HashSet::new(),
    };
    top.into_iter()
        .filter(|t| readable.contains(&t.path))
        .collect()
}

/// The profile as `caller` may see it (permission checks may touch the network: they
/// run off the event loop's thread).
async fn checked_for(mut profile: Profile, caller: &Caller) -> Result<Profile, String> {
    let caller = caller.clone();
    match tokio::task::spawn_blocking(move || {
        access::filter_for(&mut profile, &caller).map(|()| profile)
    })
    .await
    {
        Ok(Ok(p)) => Ok(p),
        Ok(Err(e)) => Err(format!("{e:#}")),
        Err(e) => Err(e.to_string()),
    }
}
