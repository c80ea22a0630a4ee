//! Who served each open, failed lookup and read of a job: a local copy (pinned or on
//! SSD), a snapshot, or the network; counted per watched tree and logged on request.

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
        let server = self
            .jobs
            .get(&a.job)
            .map_or(Server::Network, |j| j.server_of(path));
        let pinned = server != Server::Network && self.pins.is_pinned(&a.path);
        let hit = jobs::count(
            &mut self.status.served[i],
            a.what,
            server,
            pinned,
            a.job != 0,
        );
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
        } else if self.cache.contains(path) || self.held_snapshot(Path::new(path)).is_some() {
            "copied after the job started"
        } else if !self.config.filters.admits(path) {
            "excluded by --include-ext or --exclude"
        } else if self.file_index.contains_key(path) {
            "not among the hottest files that fit the SSD budget"
        } else {
            "first seen: not in the working set yet"
        }
    }
}
