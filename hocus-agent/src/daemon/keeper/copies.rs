//! The keeper's copies, besides those in the cache: under way (with the size expected),
//! queued in the last placement's order, and the files kept from copying for a while
//! (seen changing, failed) or for good (a job wrote to them); the process that last
//! opened each file (a copy's log line names it); and the copies found at start, not
//! bound before a revalidation vouched for them.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use super::decide::Known;
use crate::shared::log_line::Process;

/// Copies handed to the workers at once. The rest of a placement's copies wait their
/// turn as a place in the shortlist each, not as queued work holding a path, a tree, a
/// reader and a destination each: a site-wide profile's 100k copies cost ~50 MiB that
/// way.
pub const COPIES_AT_ONCE: usize = 1024;

#[derive(Default)]
pub struct Copies {
    /// Copies under way: source -> expected size.
    in_flight: HashMap<String, u64>,
    /// The last placement's copies not started yet, in its order, by place in the shortlist.
    queued: VecDeque<u32>,
    /// Files seen changing, and when: they are fetched again once stable.
    unstable: HashMap<String, Instant>,
    /// Files whose copy failed, and when: retried after a while.
    failed: HashMap<String, Instant>,
    /// Files jobs tried to write: left on the network from then on.
    refused: HashSet<String>,
    /// The process that last opened each file: a copy's log line names it.
    last_opener: HashMap<String, Process>,
    /// Copies found in the cache at start and not revalidated yet: never bound.
    unverified: HashSet<String>,
}

impl Copies {
    /// Copies of the cache found at start, to be vouched for by a revalidation.
    pub fn found_at_start(unverified: HashSet<String>) -> Self {
        Self {
            unverified,
            ..Default::default()
        }
    }

    pub fn in_flight(&self, source: &str) -> bool {
        self.in_flight.contains_key(source)
    }

    /// Copies under way.
    pub fn under_way(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether one under way is below `dir`.
    pub fn under_way_below(&self, dir: &Path) -> bool {
        self.in_flight.keys().any(|s| Path::new(s).starts_with(dir))
    }

    /// The directories a copy under way is below (each of their ancestors), for many
    /// questions of `under_way_below` at once.
    pub fn dirs_under_way(&self) -> HashSet<&Path> {
        let sources = self.in_flight.keys().map(|s| Path::new(s.as_str()));
        sources.flat_map(|s| s.ancestors().skip(1)).collect()
    }

    /// The sources under way.
    pub fn sources_under_way(&self) -> impl Iterator<Item = (&String, &u64)> {
        self.in_flight.iter()
    }

    /// Bytes the copies under way are expected to take.
    pub fn reserved(&self) -> u64 {
        self.in_flight.values().sum()
    }

    pub fn begin(&mut self, source: &str, size: u64) {
        self.in_flight.insert(source.to_owned(), size);
    }

    /// A copy ended (or is abandoned): its expected size, if it was under way.
    pub fn end(&mut self, source: &str) -> Option<u64> {
        self.in_flight.remove(source)
    }

    pub fn queue(&mut self, queued: VecDeque<u32>) {
        self.queued = queued;
    }

    /// `at` (a place in the shortlist) goes before the queued copies.
    pub fn queue_first(&mut self, at: u32) {
        self.queued.push_front(at);
    }

    pub fn clear_queue(&mut self) {
        self.queued.clear();
    }

    /// The next queued copy, by place in the shortlist, while fewer than `COPIES_AT_ONCE`
    /// are under way.
    pub fn next_queued(&mut self) -> Option<u32> {
        if self.in_flight.len() >= COPIES_AT_ONCE {
            return None;
        }
        self.queued.pop_front()
    }

    pub fn any_queued(&self) -> bool {
        !self.queued.is_empty()
    }

    /// Whether something happened to `source` since it was placed that keeps it from a
    /// copy now: under way already, changed, or written by a job.
    pub fn held_back(&self, source: &str) -> bool {
        self.in_flight(source)
            || self.unstable.contains_key(source)
            || self.refused.contains(source)
    }

    /// `source` changed: it is fetched again once stable.
    pub fn changed(&mut self, source: String) {
        self.unstable.insert(source, Instant::now());
    }

    /// `source`'s copy failed: retried after a while.
    pub fn failed(&mut self, source: String) {
        self.failed.insert(source, Instant::now());
    }

    /// A job tried to write `source`: never copied again.
    pub fn refuse(&mut self, source: String) {
        self.refused.insert(source);
    }

    /// Forgets what changed or failed long enough ago (`window`: a revalidation
    /// interval; failures wait four).
    pub fn expire(&mut self, window: Duration) {
        let now = Instant::now();
        self.unstable
            .retain(|_, at| now.duration_since(*at) < window);
        self.failed
            .retain(|_, at| now.duration_since(*at) < window * 4);
    }

    /// Whether a file left out for having changed or failed may be placed again now.
    pub fn waits_over(&self, window: Duration) -> bool {
        self.unstable.values().any(|at| at.elapsed() >= window)
            || self.failed.values().any(|at| at.elapsed() >= window * 4)
    }

    /// What placement must know of the files: see `decide::admitted`.
    pub fn known<'a>(&'a self, trees: &'a [PathBuf]) -> Known<'a> {
        Known {
            trees,
            unstable: self.unstable.keys().map(String::as_str).collect(),
            failed: self.failed.keys().map(String::as_str).collect(),
            refused: self.refused.iter().map(String::as_str).collect(),
        }
    }

    /// The files kept off copies for having been written or changed: no snapshot may
    /// hold them.
    pub fn unclean(&self) -> Vec<PathBuf> {
        self.refused
            .iter()
            .chain(self.unstable.keys())
            .map(PathBuf::from)
            .collect()
    }

    /// Why `path` is not copied, if it is kept from copies.
    pub fn why_not(&self, path: &str) -> Option<&'static str> {
        if self.refused.contains(path) {
            Some("a job wrote to it: it stays on the network")
        } else if self.unstable.contains_key(path) {
            Some("it changed lately: copied again once stable")
        } else if self.failed.contains_key(path) {
            Some("its copy failed")
        } else if self.in_flight(path) {
            Some("its copy is under way")
        } else {
            None
        }
    }

    pub fn opened(&mut self, path: String, by: Process) {
        self.last_opener.insert(path, by);
    }

    /// Who last opened `source`, taken for its copy's log line.
    pub fn opener(&mut self, source: &str) -> Option<Process> {
        self.last_opener.remove(source)
    }

    /// Keeps only the openers `keep` says.
    pub fn keep_openers(&mut self, keep: impl Fn(&str) -> bool) {
        self.last_opener.retain(|path, _| keep(path));
    }

    pub fn unverified(&self, source: &str) -> bool {
        self.unverified.contains(source)
    }

    /// Whether copies from before a restart still wait for their first check.
    pub fn any_unverified(&self) -> bool {
        !self.unverified.is_empty()
    }

    /// A revalidation checked every copy: those unchanged are valid.
    pub fn all_verified(&mut self) {
        self.unverified.clear();
    }
}
