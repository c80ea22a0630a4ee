//! When the tracer rests. The syscall program makes every syscall of every process on
//! the node take the kernel's traced path, watched or not (docs/overhead.md); so while
//! there is nothing to learn for `rest-after` seconds (nothing reached the network or
//! changed a tree: no job runs, or every job's requests hit local copies) it is
//! detached, and the node pays nothing. It is attached again before a job starts (so
//! the job's accesses are all counted), and by the kernel side's tripwires, which only
//! watched mounts reach: the first request to a watched FUSE mount, or pages read from
//! a watched mount's server. A file the waking process opened before the program was
//! attached again is learned if it still holds it (`observe::held`); what is served
//! from the client's caches alone is not seen: the profile learns from what reaches
//! the network. While jobs run at rest, their hits are not counted.
//!
//! Where the request programs learn jobs (`Tracer::learns_by_requests`: every watched
//! tree on FUSE, a kernel that types its requests), the syscall program is needed only
//! as a job starts (the namespace its session makes, its snapshot overlays) and for the
//! hits of a job given local copies that nothing else counts: it rests from the start,
//! whatever jobs run, and is attached again only while a job starts (and `rest-after`
//! seconds after, for such a job).

use std::time::{Duration, Instant};

use hocus_control::status::TracingStatus;

use crate::observe::tracer::Tracer;

/// The jobs running, for resting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jobs {
    None,
    /// Jobs run, and the tracer may rest while their requests all hit local copies.
    Served,
    /// Jobs run that the tracer follows all along.
    Followed,
}

pub struct Rest {
    /// When something was last learned or followed: an event, bytes read, a job.
    last_activity: Instant,
    /// When the tracer last rested or woke.
    since: Instant,
    rests: u64,
    wakeups: u64,
    /// Time spent resting before `since`.
    rested: Duration,
    /// The rest under way began while jobs ran (all served).
    with_jobs: bool,
    /// Time spent resting while jobs ran, before `since`.
    rested_with_jobs: Duration,
}

impl Rest {
    /// `learns_by_requests`: the request programs learn jobs (`Tracer`): the syscall
    /// program rests from the start.
    pub fn new(learns_by_requests: bool) -> Self {
        let now = Instant::now();
        let long_ago = now.checked_sub(Duration::from_secs(3600)).unwrap_or(now);
        Self {
            last_activity: if learns_by_requests { long_ago } else { now },
            since: now,
            rests: 0,
            wakeups: 0,
            rested: Duration::ZERO,
            with_jobs: false,
            rested_with_jobs: Duration::ZERO,
        }
    }

    /// Something was learned or followed just now.
    pub fn active(&mut self) {
        self.last_activity = Instant::now();
    }
}

impl Rest {
    /// Rests `tracer` if nothing was learned for `after`, and the jobs that run (if
    /// any) may run at rest.
    pub fn rest_if_idle(&mut self, tracer: &mut Tracer, after: Option<Duration>, jobs: Jobs) {
        let Some(after) = after else {
            return;
        };
        if tracer.learns_by_requests {
            // Jobs are learned at rest: it rests once nothing but the request programs
            // learned anything for `after`, unless a Slurm task runs whose hits only it
            // can count for its job's own profile (no fanotify marks).
            let with_jobs = jobs != Jobs::None;
            if jobs == Jobs::Followed {
                if tracer.is_resting() {
                    self.wake(tracer, "a job runs that must be followed");
                }
                return;
            }
            if !tracer.is_resting() && self.last_activity.elapsed() >= after {
                self.rest(tracer, jobs, after);
            } else if tracer.is_resting() && with_jobs != self.with_jobs {
                self.account_rest();
                self.with_jobs = with_jobs;
            }
            return;
        }
        if tracer.is_resting() && self.with_jobs && jobs == Jobs::None {
            self.jobs_ended(tracer);
        }
        if tracer.is_resting() && self.with_jobs && jobs == Jobs::Followed {
            // A job's accesses can no longer be seen at rest (opens through its binds
            // were lost).
            return self.wake(tracer, "a job runs that must be followed");
        }
        if tracer.is_resting() || jobs == Jobs::Followed || self.last_activity.elapsed() < after {
            return;
        }
        self.rest(tracer, jobs, after);
    }

    fn rest(&mut self, tracer: &mut Tracer, jobs: Jobs, after: Duration) {
        // `after` is said in the log only.
        match tracer.rest(jobs == Jobs::Served) {
            Ok(()) => {
                self.rests += 1;
                self.since = Instant::now();
                // Where the request programs learn, any job runs at rest.
                self.with_jobs = if tracer.learns_by_requests {
                    jobs != Jobs::None
                } else {
                    jobs == Jobs::Served
                };
                if tracer.learns_by_requests {
                    // Once, then again after each job's start: said once.
                    if self.rests == 1 {
                        log::info!(
                            "tracing rests: jobs are learned from the FUSE servers' requests"
                        );
                    }
                    return;
                }
                let why = if self.with_jobs {
                    "jobs run whose requests all hit local copies (only Slurm tasks' hits are counted while it rests)"
                } else {
                    "no job running"
                };
                log::info!(
                    "tracing rests: nothing to learn for {} s, {why}; a miss, a write or a job start wakes it",
                    after.as_secs()
                );
            }
            Err(e) => log::warn!("could not rest the tracer: {e:#}"),
        }
    }

    /// Rests `tracer` at once if the request programs learn jobs (`Tracing`), jobs
    /// running.
    pub fn rest_for_requests(&mut self, tracer: &mut Tracer) {
        if tracer.learns_by_requests && !tracer.is_resting() {
            self.rest(tracer, Jobs::Followed, Duration::ZERO);
        }
    }

    /// The jobs that ran at rest ended: the rest goes on without them.
    fn jobs_ended(&mut self, tracer: &mut Tracer) {
        if let Err(e) = tracer.rest_without_jobs() {
            return log::warn!("could not tell the kernel side no job runs: {e:#}");
        }
        self.account_rest();
        self.with_jobs = false;
    }

    /// Adds the rest so far to the time rested (with jobs, if they ran), from now on
    /// counted anew.
    fn account_rest(&mut self) {
        if self.with_jobs {
            self.rested_with_jobs += self.since.elapsed();
        }
        self.rested += self.since.elapsed();
        self.since = Instant::now();
    }

    /// Attaches the syscall program again, if it rests (`why`: for the log).
    pub fn wake(&mut self, tracer: &mut Tracer, why: &str) {
        self.active();
        if !tracer.is_resting() {
            return;
        }
        match tracer.wake() {
            Ok(()) => {
                self.wakeups += 1;
                self.rested += self.since.elapsed();
                if self.with_jobs {
                    self.rested_with_jobs += self.since.elapsed();
                }
                self.since = Instant::now();
                log::info!("tracing wakes: {why}");
            }
            Err(e) => log::error!("could not wake the tracer ({why}): {e:#}"),
        }
    }

    pub fn status(&self, tracer: &Tracer, after: Option<Duration>) -> TracingStatus {
        let resting = tracer.is_resting();
        let followed = tracer.followed();
        let since = self.since.elapsed();
        let now = |with: bool| {
            if resting && with {
                since
            } else {
                Duration::ZERO
            }
        };
        TracingStatus {
            resting,
            since_secs: since.as_secs(),
            rest_after_secs: after.map_or(0, |d| d.as_secs()),
            rests: self.rests,
            wakeups: self.wakeups,
            resting_secs: (self.rested + now(true)).as_secs(),
            with_jobs: resting && self.with_jobs,
            resting_with_jobs_secs: (self.rested_with_jobs + now(self.with_jobs)).as_secs(),
            followed: followed.map_or(0, |f| f.count() as u64),
            every_process: followed.is_none(),
        }
    }
}
