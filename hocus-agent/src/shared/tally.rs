//! Log lines that come by the thousand for one cause (an imported profile whose files
//! are gone from the server: a line per file once flooded the log with 5,822), summed
//! up instead: one line per kind and tree, with a count and an example, said at most
//! once per interval. Bounded: the kinds are the code's, the trees the watched ones.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
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
}
