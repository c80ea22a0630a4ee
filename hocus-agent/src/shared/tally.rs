//! Log lines that come by the thousand for one cause (an imported profile whose files
//! are gone from the server: a line per file once flooded the log with 5,822), summed
//! up instead: one line per kind and tree, with a count and an example, said at most
//! once per interval ([`Tally`]). And warnings a user can cause at will (a symlink
//! swapped in before every job, a peer knocking on the relay): a few a minute of each
//! kind, then how many more were not said ([`warn_limited!`]).
//! Bounded: the kinds are the code's, the trees the watched ones.

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    sync::Mutex,
    time::{Duration, Instant},
};

/// Counts by (what happened, tree), each with its first example, since `since`.
#[derive(Default)]
pub struct Tally {
    counts: BTreeMap<(&'static str, PathBuf), (u64, String)>,
    since: Option<Instant>,
}

impl Tally {
    /// One more `what` (e.g. "files not cached, gone from the network") in `tree`, e.g.
    /// `example`.
    pub fn add(&mut self, what: &'static str, tree: &Path, example: &str) {
        self.since.get_or_insert_with(Instant::now);
        let entry = self
            .counts
            .entry((what, tree.to_owned()))
            .or_insert_with(|| (0, example.to_owned()));
        entry.0 += 1;
    }

    /// The lines to say, once the first thing added is `every` old: "{what}: N in
    /// {tree} (e.g. {example})"; the tally starts again.
    pub fn due(&mut self, every: Duration) -> Vec<String> {
        if self.since.is_none_or(|t| t.elapsed() < every) {
            return Vec::new();
        }
        self.since = None;
        std::mem::take(&mut self.counts)
            .into_iter()
            .map(|((what, tree), (n, example))| {
                format!("{what}: {n} in {} (e.g. {example})", tree.display())
            })
            .collect()
    }
}

/// Lines of one kind said per minute at most.
pub const PER_MINUTE: u32 = 5;

/// A kind's minute: when it began, lines said in it, lines not said since the last said.
type Minute = (Instant, u32, u64);

static LIMITS: Mutex<Option<HashMap<&'static str, Minute>>> = Mutex::new(None);

/// Whether a line of `kind` may be said now ([`PER_MINUTE`]), and how many were not
/// said before it.
pub fn may_say(kind: &'static str) -> Option<u64> {
    let mut guard = LIMITS.lock().unwrap_or_else(|e| e.into_inner());
    let (start, said, unsaid) = guard
        .get_or_insert_with(HashMap::new)
        .entry(kind)
        .or_insert((Instant::now(), 0, 0));
    if start.elapsed() >= Duration::from_secs(60) {
        (*start, *said) = (Instant::now(), 0);
    }
    if *said >= PER_MINUTE {
        *unsaid += 1;
        return None;
    }
    *said += 1;
    Some(std::mem::take(unsaid))
}

/// `log::warn!` for what a user can cause at will: [`PER_MINUTE`] lines of each kind (a
/// name) a minute, then one saying how many were not said.
macro_rules! warn_limited {
    ($kind:expr, $($arg:tt)+) => {
        if let Some(unsaid) = $crate::shared::tally::may_say($kind) {
            if unsaid > 0 {
                log::warn!("{} ({unsaid} more like it not said)", format_args!($($arg)+));
            } else {
                log::warn!($($arg)+);
            }
        }
    };
}
pub(crate) use warn_limited;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thousand_files_gone_make_one_line_per_tree() {
        let gone = "files not cached, gone from the network";
        let mut t = Tally::default();
        for i in 0..1000 {
            t.add(gone, Path::new("/home"), &format!("/home/a/{i}.py"));
        }
        t.add(gone, Path::new("/sw"), "/sw/x.so");
        // Not yet an interval old.
        assert!(t.due(Duration::from_secs(60)).is_empty());
        assert_eq!(
            t.due(Duration::ZERO),
            [
                "files not cached, gone from the network: 1000 in /home (e.g. /home/a/0.py)",
                "files not cached, gone from the network: 1 in /sw (e.g. /sw/x.so)",
            ]
        );
        assert!(t.due(Duration::ZERO).is_empty());
    }

    #[test]
    fn a_kind_is_said_a_few_times_a_minute_then_counted() {
        let said: Vec<_> = (0..8).map(|_| may_say("a test's kind")).collect();
        assert_eq!(
            said,
            [
                Some(0),
                Some(0),
                Some(0),
                Some(0),
                Some(0),
                None,
                None,
                None
            ]
        );
        // Another kind is not held back by it.
        assert_eq!(may_say("another test's kind"), Some(0));
    }
}
