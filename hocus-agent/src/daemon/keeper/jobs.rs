//! The jobs the keeper follows: each job's mount namespace and the binds in it, by job
//! id; a bind whose file changes is taken out of every job at once. And the last Slurm
//! jobs whose tasks were attached, as `status` shows them.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
};

use hocus_control::status::{SLURM_JOBS_SHOWN, SlurmJob};

use crate::redirect::{
    jobs::{Job, JobStart, Server, SlurmTask},
    mountns::{self, Bind},
};

#[derive(Default)]
pub struct Jobs {
    by_id: HashMap<u32, Job>,
}

impl Jobs {
    /// A job starts; its Slurm task, if it is one. `is_snapshot` tells the binds of
    /// trees from those of files.
    pub fn start(
        &mut self,
        start: JobStart,
        is_snapshot: impl Fn(&Bind) -> bool,
    ) -> Option<SlurmTask> {
        let mut job = Job::new(start.ns, start.binds, is_snapshot);
        job.slurm_job = start.slurm.map(|task| task.job_id);
        self.by_id.insert(start.id, job);
        start.slurm
    }

    /// Job `id` ended; the Slurm job it was a task of.
    pub fn end(&mut self, id: u32) -> Option<u32> {
        self.by_id.remove(&id).and_then(|j| j.slurm_job)
    }

    pub fn running(&self) -> usize {
        self.by_id.len()
    }

    pub fn knows(&self, id: u32) -> bool {
        self.by_id.contains_key(&id)
    }

    /// What serves `path` in job `id` (the network outside jobs).
    pub fn server_of(&self, id: u32, path: &Path) -> Server<'_> {
        self.by_id
            .get(&id)
            .map_or(Server::Network, |j| j.server_of(path))
    }

    /// Job `id` was seen opening or reading `path`.
    pub fn saw(&mut self, id: u32, path: &Path) {
        if let Some(job) = self.by_id.get_mut(&id) {
            job.saw(path);
        }
    }

    /// What running jobs have bound: copied files' and snapshots' network paths.
    pub fn bound(&self) -> HashSet<&Path> {
        self.by_id
            .values()
            .flat_map(|j| j.binds.iter().map(|b| b.target.as_path()))
            .collect()
    }

    /// Whether a running job uses the copy of `source` (`Job::uses_copy`).
    pub fn uses_copy(&self, source: &str, partial: bool) -> bool {
        let target = Path::new(source);
        self.by_id.values().any(|j| j.uses_copy(target, partial))
    }

    /// The Slurm job job `id` is a task of.
    pub fn slurm_job(&self, id: u32) -> Option<u32> {
        self.by_id.get(&id).and_then(|j| j.slurm_job)
    }

    /// Takes the binds of `source` out of the live jobs: their next open goes to the
    /// network.
    pub fn detach(&mut self, source: &str) {
        for (pid, job) in &mut self.by_id {
            let targets: Vec<PathBuf> = job
                .binds
                .iter()
                .filter(|b| b.target == Path::new(source))
                .map(|b| b.target.clone())
                .collect();
            if targets.is_empty() {
                continue;
            }
            match mountns::detach_in(&job.ns, &targets) {
                Ok(n) => log::info!("{source}: detached {n} binds in job {pid}"),
                Err(e) => log::warn!("{source}: could not detach it in job {pid}: {e}"),
            }
            job.forget(Path::new(source));
        }
    }

    /// The daemon stops: the jobs that outlive it read the network from now on, as
    /// nobody is left to take a copy away when its file changes there.
    pub fn release_all(&mut self) {
        let (jobs, mut binds) = (self.by_id.len(), 0);
        for (pid, job) in self.by_id.drain() {
            let targets: Vec<PathBuf> = job.binds.iter().map(|b| b.target.clone()).collect();
            match mountns::detach_in(&job.ns, &targets) {
                Ok(n) => binds += n,
                Err(e) => {
                    log::warn!("stopping: could not take the local copies out of job {pid}: {e}")
                }
            }
        }
        if binds > 0 {
            log::info!(
                "stopping: took {binds} local copies out of {jobs} running jobs; they read the network until they end"
            );
        }
    }
}

/// A task of a Slurm job was attached: the job is counted among the last ones shown,
/// the oldest finished job forgotten first when there are too many.
pub fn task_started(shown: &mut Vec<SlurmJob>, task: SlurmTask) {
    if let Some(j) = shown.iter_mut().find(|j| j.job_id == task.job_id) {
        j.tasks += 1;
        j.tasks_running += 1;
        return;
    }
    if shown.len() >= SLURM_JOBS_SHOWN {
        let oldest = shown.iter().position(|j| j.tasks_running == 0).unwrap_or(0);
        shown.remove(oldest);
    }
    shown.push(SlurmJob {
        job_id: task.job_id,
        uid: task.uid,
        tasks: 1,
        tasks_running: 1,
        served: Default::default(),
    });
}

/// A task of Slurm job `job_id` ended.
pub fn task_ended(shown: &mut [SlurmJob], job_id: u32) {
    if let Some(j) = shown.iter_mut().find(|j| j.job_id == job_id) {
        j.tasks_running = j.tasks_running.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_slurm_jobs_are_shown_finished_ones_forgotten_first() {
        let mut shown = Vec::new();
        let task = |job_id| SlurmTask { job_id, uid: 1000 };
        for id in 0..SLURM_JOBS_SHOWN as u32 {
            task_started(&mut shown, task(id));
        }
        task_started(&mut shown, task(0)); // a second task of job 0
        for id in 1..SLURM_JOBS_SHOWN as u32 {
            task_ended(&mut shown, id);
        }
        // Full: job 0 still runs, so the oldest finished one (1) goes.
        task_started(&mut shown, task(100));
        assert_eq!(shown.len(), SLURM_JOBS_SHOWN);
        assert!(!shown.iter().any(|j| j.job_id == 1));
        let zero = shown.iter().find(|j| j.job_id == 0).unwrap();
        assert_eq!((zero.tasks, zero.tasks_running), (2, 2));
        task_ended(&mut shown, 0);
        assert_eq!(
            shown.iter().find(|j| j.job_id == 0).unwrap().tasks_running,
            1
        );
    }
}
