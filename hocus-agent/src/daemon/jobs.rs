//! What the loop keeps of each job beside the keeper's binds: the snapshot views in its
//! namespace, whose files the kernel side places under their network directories (so a
//! job's opens in a lazy snapshot count as hits and teach the profile), and for an
//! attached task (Slurm's, through hocus's SPANK plugin; a process the daemon did not
//! fork) its pidfd, polled at each sweep to see it end.

use std::{
    collections::HashMap,
    os::fd::{AsFd, OwnedFd},
    path::PathBuf,
    sync::Arc,
};

use hocus_common::{FIRST_VIEW_ROOT, MAX_VIEW_ROOTS};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use super::Daemon;
use crate::observe::tracer::ViewRoot;

/// Attached tasks followed at once; more are refused (and run without hocus).
pub const MAX_TASKS: usize = 4096;

/// The loop's side of the jobs.
#[derive(Default)]
pub struct Jobs {
    /// Attached tasks: (job id = pid, pidfd).
    tasks: Vec<(u32, Arc<OwnedFd>)>,
    /// Each job's snapshot views: the kernel root index, the kernel's addresses, and the
    /// view's mount, held open so those addresses stay the view's.
    views: HashMap<u32, Vec<(u32, ViewRoot, OwnedFd)>>,
    /// Kernel root indexes not in use.
    free: Vec<u32>,
    next: u32,
}

impl Jobs {
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
    /// Follows the attached process `id` (its pidfd) as job `id`: the kernel side counts
    /// it and whatever it forks as the job's.
    pub(super) fn follow_task(&mut self, id: u32, pidfd: Arc<OwnedFd>) -> Result<(), String> {
        if self.jobs.tasks.len() >= MAX_TASKS {
            return Err(format!(
                "{MAX_TASKS} tasks are attached on this node already"
            ));
        }
        self.tracer
            .get_mut()
            .mark_job(id, id)
            .map_err(|e| format!("the kernel side cannot follow the task: {e:#}"))?;
        self.jobs.tasks.push((id, pidfd));
        Ok(())
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
            let mut fds: Vec<PollFd> = self
                .jobs
                .tasks
                .iter()
                .map(|(_, fd)| PollFd::new(fd.as_fd(), PollFlags::POLLIN))
                .collect();
            if poll(&mut fds, PollTimeout::ZERO).is_err() {
                return;
            }
            // A pidfd is readable once its process has exited.
            fds.iter()
                .zip(&self.jobs.tasks)
                .filter(|(fd, _)| fd.revents().is_some_and(|r| !r.is_empty()))
                .map(|(_, (id, _))| *id)
                .collect()
        };
        for id in ended {
            self.jobs.tasks.retain(|(t, _)| *t != id);
            self.job_ended(id).await;
        }
    }
}
