//! When the tracer rests. The syscall program makes every syscall of every process on
//! the node take the kernel's traced path, watched or not (docs/overhead.md); so while
//! there is nothing to learn (no job to follow, and nothing done on the watched trees
//! for `rest-after` seconds) it is detached, and the node pays nothing. It is attached
//! again before a job starts (so the job's accesses are all counted), and by the
//! kernel side's tripwires, which only watched mounts reach: the first request to a
//! watched FUSE mount, or pages read from a watched mount's server. What a process does
//! before that, and what is served from the client's caches alone, is not seen: the
//! profile learns from what reaches the network.

use std::time::{Duration, Instant};

use hocus_control::status::TracingStatus;

use crate::observe::tracer::Tracer;

pub struct Rest {
    /// When something was last learned or followed: an event, bytes read, a job.
    last_activity: Instant,
    /// When the tracer last rested or woke.
    since: Instant,
    rests: u64,
    wakeups: u64,
    /// Time spent resting before `since`.
    rested: Duration,
}

impl Rest {
    pub fn new() -> Self {
        let now = Instant::now();
        Self {
            last_activity: now,
            since: now,
            rests: 0,
            wakeups: 0,
            rested: Duration::ZERO,
        }
    }

    /// Something was learned or followed just now.
    pub fn active(&mut self) {
        self.last_activity = Instant::now();
    }
}

impl Rest {
    /// Rests `tracer` if nothing was learned for `after` and no job runs.
    pub fn rest_if_idle(&mut self, tracer: &mut Tracer, after: Option<Duration>, jobs: bool) {
        let Some(after) = after else {
            return;
        };
        if tracer.is_resting() || jobs || self.last_activity.elapsed() < after {
            return;
        }
        match tracer.rest() {
            Ok(()) => {
                self.rests += 1;
                self.since = Instant::now();
                log::info!(
                    "tracing rests: nothing to learn for {} s and no job running; the next use of a watched mount wakes it",
                    after.as_secs()
                );
            }
            Err(e) => log::warn!("could not rest the tracer: {e:#}"),
        }
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
        TracingStatus {
            resting,
            since_secs: since.as_secs(),
            rest_after_secs: after.map_or(0, |d| d.as_secs()),
            rests: self.rests,
            wakeups: self.wakeups,
            resting_secs: (self.rested + if resting { since } else { Duration::ZERO }).as_secs(),
            followed: followed.map_or(0, |f| f.count() as u64),
            every_process: followed.is_none(),
        }
    }
}
