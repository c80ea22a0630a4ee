//! The kernel side as the loop holds it: the eBPF programs and their ring buffer
//! (`Tracer`), what the events mean for the working set (`Observer`), when the syscall
//! program rests (`Rest`), and what could not be delivered. The loop takes what the
//! observer found (accesses, changes, refused writes, files to stat) and routes it.

use std::time::{Duration, Instant};

use hocus_common::{NamespaceKey, counter, kind};
use hocus_control::status::TracingStatus;
use tokio::io::{Interest, unix::AsyncFd};

use super::rest::{Jobs, Rest};
use crate::{
    observe::{
        events::Observer,
        tracer::{Counters, OverlayRoot, Report, Tracer},
    },
    profile::working_set::WorkingSet,
};

pub struct Tracing {
    tracer: AsyncFd<Tracer>,
    pub observer: Observer,
    rest: Rest,
    /// Events lost so far, as last logged.
    reported_loss: u64,
    /// Changes the kernel side could not place, as last asked.
    unplaced: u64,
    /// Processes that woke the resting tracer, and when: the files they hold are looked
    /// at once their open events, if the program saw them, are in (`WOKEN_LOOK_AFTER`).
    woken: Vec<(u32, Instant)>,
}

/// How long after a process woke the tracer the files it holds are looked at: long
/// enough for the events of a syscall that returned after the program was attached
/// again to be drained (the loop drains every 20 ms), so no open counts twice.
const WOKEN_LOOK_AFTER: Duration = Duration::from_millis(50);
/// Processes whose files are waiting to be looked at, at most.
const MAX_WOKEN: usize = 64;

/// What one read of the ring buffer brought.
pub struct Drained {
    /// Events handled.
    pub events: usize,
    /// The process whose use of a watched mount woke the resting tracer.
    pub woken_by: Option<u32>,
}

impl Tracing {
    pub fn new(tracer: Tracer, observer: Observer) -> anyhow::Result<Self> {
        // SAFETY: the ring buffer's descriptor lives as long as the tracer, which the
        // AsyncFd owns.
        let tracer = unsafe { AsyncFd::register_with_interest(tracer, Interest::READABLE) }
            .map_err(|e| anyhow::anyhow!("watching the ring buffer: {}", e.into_parts().1))?;
        let rest = Rest::new(tracer.get_ref().learns_by_requests);
        Ok(Self {
            tracer,
            observer,
            rest,
            reported_loss: 0,
            unplaced: 0,
            woken: Vec::new(),
        })
    }

    pub fn tracer(&self) -> &Tracer {
        self.tracer.get_ref()
    }

    pub fn tracer_mut(&mut self) -> &mut Tracer {
        self.tracer.get_mut()
    }

    /// Waits until the ring buffer has events.
    pub async fn readable(&mut self) -> std::io::Result<()> {
        self.tracer.readable_mut().await?.clear_ready();
        Ok(())
    }

    /// Reads the ring buffer into `ws`; views of other namespaces asked for are learned,
    /// and the files processes that woke the tracer hold.
    pub fn drain(&mut self, ws: &mut WorkingSet) -> Drained {
        let Self {
            tracer, observer, ..
        } = self;
        let learned = news(tracer.get_ref(), observer);
        let mut woken_by = None;
        let mut events = tracer.get_mut().drain(|report| match report {
            Report::Event(e) if e.kind == kind::WAKE => woken_by = Some(e.tgid),
            Report::Event(e) => observer.handle(e, ws),
            Report::Range(r) => observer.range(&r, ws),
        });
        if let Some(tgid) = woken_by {
            if self.woken.len() < MAX_WOKEN {
                self.woken.push((tgid, Instant::now()));
            }
        }
        if !self.woken.is_empty() {
            let (due, later) = std::mem::take(&mut self.woken)
                .into_iter()
                .partition(|(_, at)| at.elapsed() >= WOKEN_LOOK_AFTER);
            self.woken = later;
            for (tgid, _) in due {
                self.observer.found_open(tgid, ws);
            }
        }
        if self.news() != learned {
            events += 1;
            self.rest.active();
        }
        for (tgid, key, inum) in std::mem::take(&mut self.observer.to_learn) {
            self.learn_view(tgid, key, inum);
        }
        Drained { events, woken_by }
    }

    /// Learns how another mount namespace sees the watched trees, for the kernel side:
    /// its absolute paths count from then on.
    fn learn_view(&mut self, tgid: u32, key: NamespaceKey, inum: u32) {
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

    /// Closes in `ws` what processes that are gone still held open or mapped; whether
    /// bytes were read meanwhile (the observer has accesses to route).
    pub fn sweep(&mut self, ws: &mut WorkingSet) -> bool {
        let learned = self.news();
        let open = self.tracer.get_ref().open_files();
        let requested = self.tracer.get_ref().request_files();
        for key in self.observer.sweep(&open, &requested, ws) {
            self.tracer.get_mut().forget_open_file(&key);
        }
        let mapped = self.tracer.get_ref().mapped_files();
        for key in self.observer.sweep_mapped(&mapped, ws) {
            self.tracer.get_mut().forget_mapped(&key);
        }
        if self.news() != learned {
            self.rest.active();
        }
        !self.observer.accesses.is_empty()
    }

    /// What keeps the syscall program awake (`news`).
    fn news(&self) -> u64 {
        news(self.tracer.get_ref(), &self.observer)
    }

    /// Whether changes the kernel side could not place (`counter::CHANGE_UNPLACED`) were
    /// made since last asked: what they changed is known only by comparing every copy
    /// with the network.
    pub fn changes_unplaced(&mut self) -> bool {
        let Ok(c) = self.tracer.get_ref().counters() else {
            return false;
        };
        let now = c[counter::CHANGE_UNPLACED as usize];
        std::mem::replace(&mut self.unplaced, now) != now
    }

    /// Logs what the kernel side could not deliver, once more was lost.
    pub fn report_loss(&mut self) {
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

    /// The kernel side's counters by name.
    pub fn counters(&self) -> Vec<(String, u64)> {
        self.tracer
            .get_ref()
            .counters()
            .map(|c| {
                counter::NAMES
                    .iter()
                    .zip(c)
                    .map(|(n, v)| ((*n).to_owned(), v))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Something was learned or followed just now (a job started or ended).
    pub fn active(&mut self) {
        self.rest.active();
    }

    /// Rests the tracer if nothing was learned for `after`, and the jobs that run (if
    /// any) may run at rest.
    pub fn rest_if_idle(&mut self, after: Option<Duration>, jobs: Jobs) {
        self.rest.rest_if_idle(self.tracer.get_mut(), after, jobs);
    }

    /// Rests the syscall program now where the request programs learn jobs: a job's
    /// start woke it to see the namespace its session made (and to place its snapshot
    /// overlays); that done, there is nothing else for it to see.
    pub fn rest_for_requests(&mut self) {
        self.rest.rest_for_requests(self.tracer.get_mut());
    }

    /// Attaches the syscall program again, if it rests (`why`: for the log).
    pub fn wake(&mut self, why: &str) {
        self.rest.wake(self.tracer.get_mut(), why);
    }

    pub fn status(&self, rest_after: Option<Duration>) -> TracingStatus {
        self.rest.status(self.tracer.get_ref(), rest_after)
    }

    /// Has the kernel side place files opened in a job's snapshot overlay under the
    /// network directory `dir` it stands for, as root `index`.
    pub fn add_overlay_root(
        &mut self,
        overlay: &std::os::fd::OwnedFd,
        index: u32,
        dir: std::path::PathBuf,
    ) -> anyhow::Result<OverlayRoot> {
        let root = self.tracer.get_mut().add_overlay_root(overlay, index)?;
        self.observer.places.add_overlay_root(index, dir);
        Ok(root)
    }

    pub fn remove_overlay_root(&mut self, index: u32, root: &OverlayRoot) {
        self.tracer.get_mut().remove_overlay_root(root);
        self.observer.places.forget_overlay_root(index);
    }
}

/// What keeps the syscall program awake while it grows: anything learned; where the
/// request programs learn jobs, only what they cannot see (changes the syscall program
/// saw while awake, writes refused).
fn news(tracer: &Tracer, observer: &Observer) -> u64 {
    if tracer.learns_by_requests {
        observer.tally.mutations + observer.tally.writes_refused
    } else {
        observer.learned
    }
}

fn lost(c: &Counters) -> u64 {
    c[counter::LOST_RING_FULL as usize]
        + c[counter::LOST_OPEN_FILES_FULL as usize]
        + c[counter::LOST_OPEN_FILES_OF_USER as usize]
        + c[counter::CHANGE_UNPLACED as usize]
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
