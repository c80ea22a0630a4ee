//! What the loop keeps of each job beside the keeper's binds: the snapshot views in its
//! namespace, whose files the kernel side places under their network directories (so a
//! job's opens in a lazy snapshot count as hits and teach the profile), and for an
//! attached task (Slurm's, through hocus's SPANK plugin; a process the daemon did not
//! fork) its pidfd, polled at each sweep to see it end, and its Slurm job's own working
//! set, which the job's epilog saves for the user's next job with the same key.

use std::{
    collections::{HashMap, HashSet},
    os::fd::{AsFd, OwnedFd},
    path::PathBuf,
    sync::Arc,
};

use hocus_common::{FIRST_VIEW_ROOT, MAX_VIEW_ROOTS};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use super::{Daemon, unix_now_ns};
use crate::{
    observe::{
        events::{Access, What},
        tracer::ViewRoot,
    },
    profile::{format::Profile, working_set::WorkingSet},
};

/// Attached tasks followed at once; more are refused (and run without hocus).
pub const MAX_TASKS: usize = 4096;
/// Slurm jobs whose own working set is kept at once (until their epilog takes it): the
/// oldest job with no task running is forgotten first.
pub const MAX_JOB_PROFILES: usize = 64;
/// Entries one Slurm job's working set holds at most.
pub const MAX_JOB_PROFILE_ENTRIES: usize = 200_000;

/// The loop's side of the jobs.
#[derive(Default)]
pub struct Jobs {
    /// Jobs started and not ended.
    running: HashSet<u32>,
    /// Attached tasks, by job id (= pid): their pidfd, and their Slurm job.
    tasks: HashMap<u32, (Arc<OwnedFd>, Option<u32>)>,
    /// Each Slurm job's own working set, in the order the jobs were first seen.
    profiles: Vec<(u32, WorkingSet)>,
    /// Each job's snapshot views: the kernel root index, the kernel's addresses, and the
    /// view's mount, held open so those addresses stay the view's.
    views: HashMap<u32, Vec<(u32, ViewRoot, OwnedFd)>>,
    /// Kernel root indexes not in use.
    free: Vec<u32>,
    next: u32,
}

impl Jobs {
    pub fn start(&mut self, id: u32) {
        self.running.insert(id);
    }

    /// Whether any job runs (the tracer follows them: it does not rest).
    pub fn running(&self) -> bool {
        !self.running.is_empty()
    }

    fn index(&mut self) -> Option<u32> {
        self.free.pop().or_else(|| {
            (self.next < MAX_VIEW_ROOTS).then(|| {
                self.next += 1;
                FIRST_VIEW_ROOT + self.next - 1
            })
        })
    }
}

impl Daemon {
    /// Follows the attached process `id` (its pidfd), a task of Slurm job `slurm_job`,
    /// as job `id`: the kernel side counts it and whatever it forks as the job's.
    pub(super) fn follow_task(
        &mut self,
        id: u32,
        pidfd: Arc<OwnedFd>,
        slurm_job: Option<u32>,
    ) -> Result<(), String> {
        if self.jobs.tasks.len() >= MAX_TASKS {
            return Err(format!(
                "{MAX_TASKS} tasks are attached on this node already"
            ));
        }
        self.tracer
            .get_mut()
            .mark_job(id, id)
            .map_err(|e| format!("the kernel side cannot follow the task: {e:#}"))?;
        self.jobs.tasks.insert(id, (pidfd, slurm_job));
        let Some(slurm_job) = slurm_job else {
            return Ok(());
        };
        if !self.jobs.profiles.iter().any(|(j, _)| *j == slurm_job) {
            if self.jobs.profiles.len() >= MAX_JOB_PROFILES {
                let running = |j: u32| self.jobs.tasks.values().any(|t| t.1 == Some(j));
                let oldest = (0..self.jobs.profiles.len())
                    .find(|&i| !running(self.jobs.profiles[i].0))
                    .unwrap_or(0);
                let (gone, _) = self.jobs.profiles.remove(oldest);
                log::warn!(
                    "the working sets of {MAX_JOB_PROFILES} Slurm jobs are kept already: Slurm job {gone}'s is forgotten before its epilog took it"
                );
            }
            let mut ws = WorkingSet::new(unix_now_ns());
            ws.set_limit(MAX_JOB_PROFILE_ENTRIES);
            self.jobs.profiles.push((slurm_job, ws));
        }
        Ok(())
    }

    /// Adds an access of an attached task's process to its Slurm job's working set.
    pub(super) fn record_for_slurm_job(&mut self, a: &Access) {
        let Some(&(_, Some(slurm_job))) = self.jobs.tasks.get(&a.job) else {
            return;
        };
        let Some((_, ws)) = self.jobs.profiles.iter_mut().find(|(j, _)| *j == slurm_job) else {
            return;
        };
        match a.what {
            What::Open => {
                ws.open(&a.path, a.uid, a.at_ns);
            }
            What::Missing => ws.missing(&a.path, a.at_ns),
            What::Read(bytes) => ws.add_bytes_read(&a.path, bytes),
        }
    }

    /// Slurm job `slurm_job`'s own working set, taken (its epilog saves it), with the
    /// sizes and mtimes the node's working set knows of its files.
    pub(super) fn take_job_profile(&mut self, slurm_job: u32) -> Option<Profile> {
        let i = self
            .jobs
            .profiles
            .iter()
            .position(|(j, _)| *j == slurm_job)?;
        let (_, ws) = self.jobs.profiles.remove(i);
        let mut p = ws.to_profile();
        for f in &mut p.files {
            if let Some(known) = self.ws.attributes(&f.path) {
                f.size = known.size;
                f.mtime_ns = known.mtime_ns;
            }
        }
        Some(p)
    }

    /// Has the kernel side place files opened in job `id`'s snapshot views under the
    /// network directories they stand for.
    pub(super) fn place_views(&mut self, id: u32, views: Vec<(OwnedFd, PathBuf)>) {
        for (view, dir) in views {
            let Some(index) = self.jobs.index() else {
                log::warn!(
                    "{MAX_VIEW_ROOTS} snapshot views are followed already: opens in {} in job {id} are not counted",
                    dir.display()
                );
                return;
            };
            match self.tracer.get_mut().add_view_root(&view, index) {
                Ok(root) => {
                    self.observer.add_view_root(index, dir);
                    self.jobs
                        .views
                        .entry(id)
                        .or_default()
                        .push((index, root, view));
                }
                Err(e) => {
                    self.jobs.free.push(index);
                    log::warn!(
                        "opens in the snapshot of {} in job {id} are not counted: {e:#}",
                        dir.display()
                    );
                }
            }
        }
    }

    /// Job `id` ended: what it did is read, then it is forgotten.
    pub(super) async fn job_ended(&mut self, id: u32) {
        self.sweep().await;
        self.jobs.running.remove(&id);
        self.rest.active();
        for (index, root, _view) in self.jobs.views.remove(&id).unwrap_or_default() {
            self.tracer.get_mut().remove_view_root(&root);
            self.observer.forget_view_root(index);
            self.jobs.free.push(index);
        }
        let ended = self.keeper.job_ended(id).await;
        self.check(ended);
    }

    /// Ends the attached tasks that exited.
    pub(super) async fn reap_tasks(&mut self) {
        if self.jobs.tasks.is_empty() {
            return;
        }
        let ended: Vec<u32> = {
            let (ids, mut fds): (Vec<u32>, Vec<PollFd>) = self
                .jobs
                .tasks
                .iter()
                .map(|(id, (fd, _))| (*id, PollFd::new(fd.as_fd(), PollFlags::POLLIN)))
                .unzip();
            if poll(&mut fds, PollTimeout::ZERO).is_err() {
                return;
            }
            // A pidfd is readable once its process has exited.
            ids.into_iter()
                .zip(&fds)
                .filter(|(_, fd)| fd.revents().is_some_and(|r| !r.is_empty()))
                .map(|(id, _)| id)
                .collect()
        };
        for id in ended {
            self.jobs.tasks.remove(&id);
            self.job_ended(id).await;
        }
    }
}
