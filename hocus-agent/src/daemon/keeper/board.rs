//! What the keeper shows while it is busy (placing a million entries takes it most of a
//! second): its status, and the binds a new job gets. `status` and a job's start read
//! the board when the keeper does not answer at once, so that no request waits behind
//! the keeper's own work.
//!
//! Binds on the board may lack copies made since it was written (the job then reads
//! those from the network, as before they were made), but never hold one the keeper has
//! dropped since: each drop is withdrawn from the board at once. What a bind promises
//! is checked against the network as the job starts (`redirect::confirm`) either way.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    sync::{Mutex, MutexGuard},
    time::{Duration, Instant},
};

use hocus_control::status::CacheStatus;

use crate::redirect::mountns::Bind;

/// A list of binds is written again at most this often...
const BINDS_EVERY: Duration = Duration::from_millis(250);
/// ... and, when it is long, at most this share of the keeper's time.
const BINDS_SHARE: u32 = 20;

#[derive(Default)]
pub struct Board {
    status: Mutex<Option<CacheStatus>>,
    binds: Mutex<Binds>,
}

#[derive(Default)]
struct Binds {
    list: Option<Vec<Bind>>,
    /// Dropped since the list was written: copies by source, snapshots by root.
    withdrawn: HashSet<PathBuf>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Board {
    pub fn status(&self) -> Option<CacheStatus> {
        lock(&self.status).clone()
    }

    pub fn write_status(&self, status: CacheStatus) {
        *lock(&self.status) = Some(status);
    }

    /// The binds written last, less those withdrawn since.
    pub fn binds(&self) -> Option<Vec<Bind>> {
        let binds = lock(&self.binds);
        let withdrawn = &binds.withdrawn;
        let kept = |b: &&Bind| {
            withdrawn.is_empty() || !b.target.ancestors().any(|a| withdrawn.contains(a))
        };
        Some(binds.list.as_ref()?.iter().filter(kept).cloned().collect())
    }

    pub fn write_binds(&self, list: Vec<Bind>) {
        let mut binds = lock(&self.binds);
        binds.list = Some(list);
        binds.withdrawn.clear();
    }

    /// A copy (by its source) or a snapshot (by its root) was dropped.
    pub fn withdraw(&self, target: &Path) {
        let mut binds = lock(&self.binds);
        if binds.list.is_some() {
            binds.withdrawn.insert(target.to_owned());
        }
    }
}

/// When the keeper writes its binds on the board: once they may have changed, paced by
/// what writing them costs.
pub struct BindsDue {
    changed: bool,
    written_at: Instant,
    cost: Duration,
}

impl Default for BindsDue {
    fn default() -> Self {
        Self {
            changed: true,
            written_at: Instant::now() - BINDS_EVERY,
            cost: Duration::ZERO,
        }
    }
}

impl BindsDue {
    /// Copies or snapshots may have come or gone.
    pub fn changed(&mut self) {
        self.changed = true;
    }

    pub fn due(&self) -> bool {
        self.changed && self.written_at.elapsed() >= BINDS_EVERY.max(self.cost * BINDS_SHARE)
    }

    /// They were written, which took `cost`.
    pub fn written(&mut self, cost: Duration) {
        self.changed = false;
        self.written_at = Instant::now();
        self.cost = cost;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redirect::mountns::Expect;

    fn bind(target: &str) -> Bind {
        Bind {
            local: PathBuf::from("/cache").join(target.trim_start_matches('/')),
            target: PathBuf::from(target),
            tree: PathBuf::from("/net"),
            expect: Expect::Snapshot(Vec::new()),
            lazy: false,
            passages: Vec::new(),
        }
    }

    fn targets(binds: Option<Vec<Bind>>) -> Vec<String> {
        let binds = binds.unwrap_or_default();
        binds
            .iter()
            .map(|b| b.target.display().to_string())
            .collect()
    }

    #[test]
    fn a_dropped_copy_or_snapshot_leaves_the_board_at_once() {
        let board = Board::default();
        assert!(board.binds().is_none());
        board.write_binds(vec![bind("/net/a"), bind("/net/env"), bind("/net/b")]);
        board.withdraw(Path::new("/net/a"));
        assert_eq!(targets(board.binds()), ["/net/env", "/net/b"]);
        // A snapshot's root withdraws what lies under it.
        board.write_binds(vec![
            bind("/net/env/lib"),
            bind("/net/envx"),
            bind("/net/b"),
        ]);
        board.withdraw(Path::new("/net/env"));
        assert_eq!(targets(board.binds()), ["/net/envx", "/net/b"]);
        // A new list starts clean.
        board.write_binds(vec![bind("/net/env")]);
        assert_eq!(targets(board.binds()), ["/net/env"]);
    }

    #[test]
    fn binds_are_written_again_paced_by_their_cost() {
        let mut due = BindsDue::default();
        assert!(due.due());
        due.written(Duration::from_millis(40));
        assert!(!due.due(), "nothing changed");
        due.changed();
        // 40 ms to write: not again within 800 ms.
        assert!(!due.due());
        due.written_at -= Duration::from_millis(801);
        assert!(due.due());
    }
}
