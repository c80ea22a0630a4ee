//! What the loop keeps of each job beside the keeper's binds: the snapshot overlays in its
//! namespace, whose files the kernel side places under their network directories (so a
//! job's opens in a lazy snapshot count as hits and teach the profile), and for an
//! attached task (Slurm's, through hocus's SPANK plugin; a process the daemon did not
//! fork) its pidfd, polled at each sweep to see it end, and its Slurm job's own working
//! set, which the job's epilog saves for the user's next job with the same key. A Slurm
//! task's opens through its binds are reported by fanotify (`redirect::bind_opens`):
//! while the tracer rests they still reach its Slurm job's working set, so it may rest.

use std::{
    collections::{HashMap, HashSet},
    os::fd::{AsFd, OwnedFd},
    path::PathBuf,
    sync::Arc,
};

use hocus_common::{FIRST_OVERLAY_ROOT, MAX_OVERLAY_ROOTS};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use super::{profiling::unix_now_ns, rest, tracing::Tracing};
use crate::{
    control::refusal::Refusal,
    observe::{
        events::{Access, What},
        tracer::OverlayRoot,
    },
    profile::{format::Profile, working_set::WorkingSet},
    redirect::{
        bind_opens::{BindOpens, Opened},
        jobs::SlurmTask,
    },
    shared::log_line::Process,
};

/// Attached tasks followed at once; more are refused (and run without hocus).
pub const MAX_TASKS: usize = 4096;
/// Slurm jobs whose own working set is kept at once (until their epilog takes it): the
/// oldest job with no task running is forgotten first.
pub const MAX_JOB_PROFILES: usize = 64;
/// Entries one Slurm job's working set holds at most.
pub const MAX_JOB_PROFILE_ENTRIES: usize = 200_000;

/// An attached task starting: its pidfd, its Slurm job, and the ids of its binds' mounts
/// if each one's opens are reported.
pub struct Task {
    pub pidfd: Arc<OwnedFd>,
    pub slurm: Option<SlurmTask>,
    pub marked: Option<Vec<u64>>,
}

/// What the loop keeps of an attached task.
struct Attached {
    pidfd: Arc<OwnedFd>,
    slurm: Option<SlurmTask>,
    /// Every open through its binds is reported (its mounts are in `Jobs::mounts`).
    reported: bool,
}

/// The loop's side of the jobs.
#[derive(Default)]
pub struct Jobs {
    /// Jobs started and not ended.
    running: HashSet<u32>,
    /// Attached tasks, by job id (= pid).
    tasks: HashMap<u32, Attached>,
    /// The task each marked mount belongs to.
    mounts: HashMap<u64, u32>,
    /// Where the marks were made (their count given back as tasks end).
    bind_opens: Option<Arc<BindOpens>>,
    /// Each Slurm job's own working set, in the order the jobs were first seen.
    profiles: Vec<(u32, WorkingSet)>,
    /// Each job's snapshot overlays: the kernel root index, the kernel's addresses, and the
    /// overlay's mount, held open so those addresses stay the overlay's.
    overlays: HashMap<u32, Vec<(u32, OverlayRoot, OwnedFd)>>,
    /// Kernel root indexes not in use.
    free: Vec<u32>,
    next: u32,
}

impl Jobs {
    pub fn new(bind_opens: Option<Arc<BindOpens>>) -> Self {
        Self {
            bind_opens,
            ..Self::default()
        }
    }

    /// Job `id` starts: an attached task (its pidfd; a task of Slurm job `slurm_job`) is
    /// followed as job `id` (the kernel side counts it and whatever it forks as the
    /// job's); files opened in its snapshot overlays are placed under the network
    /// directories they stand for.
    pub fn start(
        &mut self,
        tracing: &mut Tracing,
        id: u32,
        task: Option<Task>,
        overlays: Vec<(OwnedFd, PathBuf)>,
    ) -> Result<(), Refusal> {
        if let Some(task) = task {
            self.follow_task(tracing, id, task)?;
        }
        self.running.insert(id);
        self.place_overlays(tracing, id, overlays);
        Ok(())
    }

    fn follow_task(&mut self, tracing: &mut Tracing, id: u32, task: Task) -> Result<(), Refusal> {
        if self.tasks.len() >= MAX_TASKS {
            return Err(Refusal::new(
                "too_many_tasks",
                format!("{MAX_TASKS} tasks are attached on this node already"),
            ));
        }
        tracing.tracer_mut().mark_job(id, id).map_err(|e| {
            Refusal::new(
                "not_followed",
                format!("the kernel side cannot follow the task: {e:#}"),
            )
        })?;
        let slurm_job = task.slurm.map(|s| s.job_id);
        for &mount in task.marked.iter().flatten() {
            self.mounts.insert(mount, id);
        }
        let attached = Attached {
            pidfd: task.pidfd,
            slurm: task.slurm,
            reported: task.marked.is_some(),
        };
        self.tasks.insert(id, attached);
        let Some(slurm_job) = slurm_job else {
            return Ok(());
        };
        if !self.profiles.iter().any(|(j, _)| *j == slurm_job) {
            if self.profiles.len() >= MAX_JOB_PROFILES {
                let running = |j: u32| self.tasks.values().any(|t| slurm_job_of(t) == Some(j));
                let oldest = (0..self.profiles.len())
                    .find(|&i| !running(self.profiles[i].0))
                    .unwrap_or(0);
                let (gone, _) = self.profiles.remove(oldest);
                log::warn!(
                    "the working sets of {MAX_JOB_PROFILES} Slurm jobs are kept already: Slurm job {gone}'s is forgotten before its epilog took it"
                );
            }
            let mut ws = WorkingSet::new(unix_now_ns());
            ws.set_limit(MAX_JOB_PROFILE_ENTRIES);
            self.profiles.push((slurm_job, ws));
        }
        Ok(())
    }

    /// Adds an access of an attached task's process to its Slurm job's working set.
    pub fn record_for_slurm_job(&mut self, a: &Access) {
        let Some(slurm_job) = self.tasks.get(&a.job).and_then(slurm_job_of) else {
            return;
        };
        let Some((_, ws)) = self.profiles.iter_mut().find(|(j, _)| *j == slurm_job) else {
            return;
        };
        match a.what {
            What::Open => {
                ws.open(&a.path, a.uid, a.at_ns);
            }
            What::Missing => ws.missing(&a.path, a.at_ns),
            What::Read(bytes) => ws.add_bytes_read(&a.path, bytes),
            What::Grains(start, end) => ws.read_range(&a.path, start, end),
        }
    }

    /// Slurm job `slurm_job`'s own working set, taken (its epilog saves it), with the
    /// sizes and mtimes the node's working set `known` has of its files.
    pub fn take_profile(&mut self, slurm_job: u32, known: &WorkingSet) -> Option<Profile> {
        let i = self.profiles.iter().position(|(j, _)| *j == slurm_job)?;
        let (_, ws) = self.profiles.remove(i);
        let mut p = ws.to_profile();
        for f in &mut p.files {
            if let Some(known) = known.attributes(&f.path) {
                f.size = known.size;
                f.mtime_ns = known.mtime_ns;
            }
        }
        Some(p)
    }

    fn place_overlays(
        &mut self,
        tracing: &mut Tracing,
        id: u32,
        overlays: Vec<(OwnedFd, PathBuf)>,
    ) {
        for (overlay, dir) in overlays {
            let Some(index) = self.index() else {
                log::warn!(
                    "{MAX_OVERLAY_ROOTS} snapshot overlays are followed already: opens in {} in job {id} are not counted",
                    dir.display()
                );
                return;
            };
            let shown = dir.display().to_string();
            match tracing.add_overlay_root(&overlay, index, dir) {
                Ok(root) => self
                    .overlays
                    .entry(id)
                    .or_default()
                    .push((index, root, overlay)),
                Err(e) => {
                    self.free.push(index);
                    log::warn!(
                        "opens in the snapshot of {shown} in job {id} are not counted: {e:#}"
                    );
                }
            }
        }
    }

    /// Reads the opens through marked binds queued now (read with the ring buffer, every
    /// 20 ms at most: a read of an empty queue is one syscall). While the tracer rests
    /// (`resting`: before the ring buffer was read) they are returned, to be counted as
    /// hits and added to their Slurm jobs' working sets; awake, it saw them itself.
    pub fn read_opens(&mut self, resting: bool) -> Vec<Access> {
        const MAX_READ: usize = 16_384;
        let Some(group) = self.bind_opens.as_ref().filter(|_| !self.mounts.is_empty()) else {
            return Vec::new();
        };
        let read = match group.read(MAX_READ) {
            Ok(r) => r,
            Err(e) => {
                log::warn!("reading the opens through Slurm tasks' binds: {e}");
                self.opens_lost();
                return Vec::new();
            }
        };
        if read.overflowed && resting {
            self.opens_lost();
        }
        if !resting {
            return Vec::new();
        }
        read.opens
            .into_iter()
            .filter_map(|o| self.opened(o))
            .collect()
    }

    /// An open through a marked bind, as the access the tracer would have seen: of the
    /// task whose bind it went through, as its Slurm job's user.
    fn opened(&self, o: Opened) -> Option<Access> {
        let &job = self.mounts.get(&o.mount)?;
        let slurm = self.tasks.get(&job)?.slurm?;
        Some(Access {
            path: o.path.to_str()?.to_owned(),
            job,
            process: Process {
                pid: o.pid,
                comm: String::new(),
            },
            what: What::Open,
            uid: slurm.uid,
            at_ns: unix_now_ns(),
        })
    }

    /// Opens through marked binds were lost (the kernel's queue overflowed): every
    /// Slurm task running now is followed by the tracer until it ends.
    fn opens_lost(&mut self) {
        log::warn!(
            "opens through Slurm tasks' binds were lost (the fanotify queue overflowed): the tasks running now are followed by the tracer until they end"
        );
        for task in self.tasks.values_mut() {
            task.reported = false;
        }
    }

    /// Job `id` ended (what it did was read): it is forgotten.
    pub fn ended(&mut self, tracing: &mut Tracing, id: u32) {
        self.running.remove(&id);
        if self.tasks.remove(&id).is_some() {
            // Its marks go with its mounts, counted here even if its opens were lost.
            let marked = self.mounts.len();
            self.mounts.retain(|_, t| *t != id);
            if let Some(opens) = &self.bind_opens {
                opens.forget(marked - self.mounts.len());
            }
        }
        tracing.active();
        for (index, root, _overlay) in self.overlays.remove(&id).unwrap_or_default() {
            tracing.remove_overlay_root(index, &root);
            self.free.push(index);
        }
    }

    /// The attached tasks whose process exited.
    pub fn exited_tasks(&self) -> Vec<u32> {
        if self.tasks.is_empty() {
            return Vec::new();
        }
        let (ids, mut fds): (Vec<u32>, Vec<PollFd>) = self
            .tasks
            .iter()
            .map(|(id, t)| (*id, PollFd::new(t.pidfd.as_fd(), PollFlags::POLLIN)))
            .unzip();
        if poll(&mut fds, PollTimeout::ZERO).is_err() {
            return Vec::new();
        }
        // A pidfd is readable once its process has exited.
        ids.into_iter()
            .zip(&fds)
            .filter(|(_, fd)| fd.revents().is_some_and(|r| !r.is_empty()))
            .map(|(id, _)| id)
            .collect()
    }

    /// Whether jobs run, and whether the tracer may rest while they do (where its
    /// tripwires tell a served job's misses apart, `tells_misses`): while every request
    /// of theirs hits local copies. A Slurm job keeps its own working set, which must hold
    /// its hits too: its tasks may run at rest only if their binds' opens are reported
    /// (else they are followed all along).
    pub fn at_rest(&self, tells_misses: bool) -> rest::Jobs {
        let own_profiles = self
            .tasks
            .values()
            .any(|t| t.slurm.is_some() && !t.reported);
        if self.running.is_empty() {
            rest::Jobs::None
        } else if tells_misses && !own_profiles {
            rest::Jobs::Served
        } else {
            rest::Jobs::Followed
        }
    }

    /// Where opens through Slurm tasks' binds are reported, if they are.
    pub fn bind_opens(&self) -> Option<Arc<BindOpens>> {
        self.bind_opens.clone()
    }

    fn index(&mut self) -> Option<u32> {
        self.free.pop().or_else(|| {
            (self.next < MAX_OVERLAY_ROOTS).then(|| {
                self.next += 1;
                FIRST_OVERLAY_ROOT + self.next - 1
            })
        })
    }
}

fn slurm_job_of(t: &Attached) -> Option<u32> {
    t.slurm.map(|s| s.job_id)
}
