//! Who served each open, failed lookup and read of a job: a local copy (pinned or on
//! SSD), a snapshot, or the network; counted per watched tree and logged on request.

use std::path::Path;

use super::Keeper;
use crate::{
    observe::events::{Access, What},
    redirect::jobs::{self, Server, SlurmTask},
    shared::log_line as logs,
};
use hocus_control::status::{SLURM_JOBS_SHOWN, SlurmJob};

impl Keeper {
    /// Counts (and logs, if asked) who served an open, failed lookup or read.
    pub(super) fn served(&mut self, a: Access) {
        let path = Path::new(&a.path);
        let Some(i) = self.config.trees.iter().position(|t| path.starts_with(t)) else {
            return;
        };
        let mut server = self
            .jobs
            .get(&a.job)
            .map_or(Server::Network, |j| j.server_of(path));
        // A lazy snapshot holds the bytes of the files it filled (copies the cache
        // adopted); a stub's are read from the network through the overlay.
        if let (What::Read(_), Server::Snapshot(_)) = (a.what, server) {
            let stub = self
                .held_snapshot(path)
                .is_some_and(|(_, s)| s.lazy && !self.cache.contains(&a.path));
            if stub {
                server = Server::Network;
            }
        }
        let pinned = server != Server::Network && self.pins.is_pinned(&a.path);
        let hit = jobs::count(
            &mut self.status.served[i],
            a.what,
            server,
            pinned,
            a.job != 0,
        );
        let slurm_job = self.jobs.get(&a.job).and_then(|j| j.slurm_job);
        if let Some(entry) =
            slurm_job.and_then(|id| self.status.slurm_jobs.iter_mut().find(|s| s.job_id == id))
        {
            jobs::count(&mut entry.served, a.what, server, pinned, true);
        }
        if a.what == What::Open && !self.cache.contains(&a.path) {
            self.last_opener.insert(a.path.clone(), a.process.clone());
        }
        let event = match (hit, a.what) {
            (_, What::Read(_)) => return,
            (true, What::Open) => "hit",
            (true, _) => "hit (missing)",
            (false, What::Open) => "miss",
            (false, _) => "miss (missing)",
        };
        if hit && logs::hits() {
            let reason = match (a.what, server) {
                (What::Missing, Server::Snapshot(root)) => {
                    format!("answered by the snapshot of {}", root.display())
                }
                (_, Server::Snapshot(root)) => format!("in the snapshot of {}", root.display()),
                _ if pinned => "local copy pinned in RAM".into(),
                _ => "local copy on SSD".into(),
            };
            logs::file_line(event, &a.path, Some(&a.process), &reason);
        } else if !hit && logs::misses() {
            let reason = self.why_network(&a);
            logs::file_line(event, &a.path, Some(&a.process), reason);
        }
    }

    /// Why a job's open went to the network.
    pub(super) fn why_network(&self, a: &Access) -> &'static str {
        if a.job == 0 {
            return "not in a hocus-agent run job";
        }
        if !self.jobs.contains_key(&a.job) {
            return "its job is not known to the daemon";
        }
        if a.what == What::Missing {
            return "no snapshot holds its directory";
        }
        let path = a.path.as_str();
        if self.refused.contains(path) {
            "a job wrote to it: it stays on the network"
        } else if self.unstable.contains_key(path) {
            "it changed lately: copied again once stable"
        } else if self.failed.contains_key(path) {
            "its copy failed"
        } else if self.in_flight.contains_key(path) {
            "its copy is under way"
        } else if self.cache.contains(path) || self.in_snapshot(Path::new(path)) {
            "copied after the job started"
        } else if !self.config.filters.admits(path) {
            "excluded by --include-ext or --exclude"
        } else if self.weighed(path).is_some() {
            "not among the hottest files that fit the SSD budget"
        } else {
            "first seen: not in the working set yet"
        }
    }
}

/// A task of a Slurm job was attached: the job is counted among the last ones shown,
/// the oldest finished job forgotten first when there are too many.
pub(super) fn task_started(shown: &mut Vec<SlurmJob>, task: SlurmTask) {
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
pub(super) fn task_ended(shown: &mut [SlurmJob], job_id: u32) {
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
