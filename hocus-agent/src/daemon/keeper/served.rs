//! Who served each open, failed lookup and read of a job, as a flow across the keeper's
//! parts: a local copy (pinned or on SSD), a snapshot, or the network; counted per
//! watched tree and per Slurm job, and logged on request with why a miss missed.

use std::path::Path;

use super::Keeper;
use crate::{
    observe::events::{Access, What},
    redirect::jobs::{self, Server},
    shared::log_line as logs,
};

impl Keeper {
    /// Counts (and logs, if asked) who served an open, failed lookup or read.
    pub(super) fn served(&mut self, a: Access) {
        let path = Path::new(&a.path);
        let Some(i) = self.config.trees.iter().position(|t| path.starts_with(t)) else {
            return;
        };
        // A copy a running job uses is kept until the job ends (docs/security.md).
        self.jobs.saw(a.job, path);
        let mut server = self.jobs.server_of(a.job, path);
        // A lazy snapshot holds the bytes of the files it filled (copies the cache
        // adopted); a stub's are read from the network through the overlay.
        if let (What::Read(_), Server::Snapshot(_)) = (a.what, server) {
            let stub = self
                .snapshots
                .held(path)
                .is_some_and(|(_, s)| s.lazy && !self.cache.contains(&a.path));
            if stub {
                server = Server::Network;
            }
        }
        let pinned = server != Server::Network && self.pinning.pins.is_pinned(&a.path);
        let hit = jobs::count(
            &mut self.status.served[i],
            a.what,
            server,
            pinned,
            a.job != 0,
        );
        let slurm_job = self.jobs.slurm_job(a.job);
        if let Some(entry) =
            slurm_job.and_then(|id| self.status.slurm_jobs.iter_mut().find(|s| s.job_id == id))
        {
            jobs::count(&mut entry.served, a.what, server, pinned, true);
        }
        if a.what == What::Open && !self.cache.contains(&a.path) {
            self.copies.opened(a.path.clone(), a.process.clone());
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
    fn why_network(&self, a: &Access) -> &'static str {
        if a.job == 0 {
            return "not in a hocus-agent run job";
        }
        if !self.jobs.knows(a.job) {
            return "its job is not known to the daemon";
        }
        if a.what == What::Missing {
            return "no snapshot holds its directory";
        }
        let path = a.path.as_str();
        if let Some(why) = self.copies.why_not(path) {
            why
        } else if self.cache.contains(path) || self.snapshots.serves(Path::new(path)) {
            "copied after the job started"
        } else if !self.config.filters.admits(path) {
            "excluded by --include-ext or --exclude"
        } else if self.placement.weighed(path).is_some() {
            "not among the hottest files that fit the SSD budget"
        } else {
            "first seen: not in the working set yet"
        }
    }
}
