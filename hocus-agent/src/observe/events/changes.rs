//! Changes by a name (unlink, rmdir, mkdir, rename, truncate): what each makes of the
//! working set, and, for those the NFS programs report at their function's entry, the
//! wait for the server's answer (`kind::CHANGE_ANSWERED`): a change counts only once
//! the server accepted it.

use std::collections::{HashMap, VecDeque};

use hocus_common::kind;

use super::{Observer, parent};
use crate::{
    profile::working_set::WorkingSet,
    shared::log_line::{self as logs, Process},
};

/// NFS changes awaiting the server's answer, at most: past it, the oldest counts as
/// accepted.
const MAX_AWAITING: usize = 4096;

/// A change awaiting its answer this long counts as accepted: its answer was lost (a
/// full ring buffer), or the server is that slow. Counting it is safe: its copies go.
pub(super) const AWAITED_NS: u64 = 30_000_000_000;

/// A change by a name, as it counts once made.
pub(super) struct Change {
    pub kind: u8,
    pub path: String,
    pub process: Process,
    pub at_ns: u64,
}

/// Changes reported before the server answered, by their number, oldest first.
#[derive(Default)]
pub(super) struct Awaiting {
    by_number: HashMap<u64, Change>,
    order: VecDeque<u64>,
}

impl Awaiting {
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.by_number.is_empty() && self.order.is_empty()
    }
}

impl Observer {
    /// A change by a name, made.
    pub(super) fn change(&mut self, c: Change, ws: &mut WorkingSet) {
        self.tally.mutations += 1;
        if logs::writes() {
            let what = match c.kind {
                kind::MKDIR => "directory made",
                kind::RMDIR => "directory removed",
                kind::UNLINK => "unlinked",
                kind::RENAME_FROM => "renamed away",
                kind::RENAME_TO => "renamed over",
                _ => "truncated",
            };
            logs::file_line("write", &c.path, Some(&c.process), what);
        }
        if matches!(c.kind, kind::MKDIR | kind::RMDIR) {
            ws.dir_mutated(&c.path);
            ws.dir_mutated(parent(&c.path));
            return;
        }
        ws.mark_written(&c.path, c.at_ns);
        if c.kind != kind::TRUNCATE {
            ws.dir_mutated(parent(&c.path));
        }
        self.changed.push(c.path);
    }

    /// Change `number` waits for the server's answer (the oldest counts as accepted
    /// when too many wait).
    pub(super) fn await_answer(&mut self, number: u64, c: Change, ws: &mut WorkingSet) {
        let a = &mut self.awaiting;
        if a.order.len() >= MAX_AWAITING
            && let Some(oldest) = a.order.pop_front()
            && let Some(change) = a.by_number.remove(&oldest)
        {
            self.change(change, ws);
        }
        self.awaiting.order.push_back(number);
        self.awaiting.by_number.insert(number, c);
    }

    /// The server answered change `number` with `ret` (0: accepted).
    pub(super) fn answered(&mut self, number: u64, ret: i64, ws: &mut WorkingSet) {
        let Some(change) = self.awaiting.by_number.remove(&number) else {
            return;
        };
        match ret {
            0 => self.change(change, ws),
            err => log::debug!(
                "{} by {}: the server refused it ({}): nothing changed",
                change.path,
                change.process,
                std::io::Error::from_raw_os_error(-err as i32)
            ),
        }
    }

    /// Counts as accepted the changes awaiting an answer since before `now_ns` less
    /// [`AWAITED_NS`], and forgets those answered.
    pub(super) fn answers_overdue(&mut self, now_ns: u64, ws: &mut WorkingSet) {
        while let Some(&number) = self.awaiting.order.front() {
            match self.awaiting.by_number.get(&number) {
                None => {}
                Some(c) if c.at_ns.saturating_add(AWAITED_NS) > now_ns => break,
                Some(_) => {
                    let c = self.awaiting.by_number.remove(&number).expect("just found");
                    self.change(c, ws);
                }
            }
            self.awaiting.order.pop_front();
        }
    }
}
