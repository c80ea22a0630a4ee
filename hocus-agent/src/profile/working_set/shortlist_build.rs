//! The bounded shortlist placement works from (`profile::shortlist`), built a slice at a time so
//! that the daemon's loop answers between slices: at a million files one build is a pass
//! over every record (~120 ms). The set changes between slices; the shortlist is a picture of
//! it for ranking, not a promise (what a job may read is checked against the network as
//! it starts, and a write invalidates a copy at once).

use std::cmp::Reverse;

use hashbrown::HashMap;

use super::{FileRec, MissingRec, WorkingSet, best::Best, users::USERS};
use crate::profile::{paths::PathId, shortlist::Shortlist};

/// Records scanned, or files added to the shortlist, per slice: ~10 ms of the loop's time.
pub const SHORTLIST_SLICE: usize = 16_384;

/// A shortlist being built: see [`WorkingSet::build_shortlist`].
pub struct ShortlistBuild {
    n: usize,
    /// Every file goes in (a set of at most `n`): no ranking.
    whole: bool,
    /// The next record to scan (ranking) or to add (once ranked).
    at: usize,
    /// The best so far by opens per page, and the written ones.
    best: Best<Reverse<u64>>,
    writes: Vec<u32>,
    /// The files chosen, in the order they were recorded, once all are ranked.
    chosen: Option<Vec<u32>>,
    shortlist: Shortlist,
}

impl WorkingSet {
    /// [`WorkingSet::build_shortlist`] in one go. What placement needs, bounded: the `n` files
    /// of most opens per page (what placement ranks by), those written or opened for
    /// writing (they keep copies and their directories off the cache), and the `n`
    /// missing names looked up most, with the directories. A site-wide profile is not
    /// copied whole to the keeper.
    #[cfg(test)]
    pub fn for_placement(&self, n: usize) -> Shortlist {
        let mut build = self.shortlist_build(n);
        loop {
            if let Some(shortlist) = self.build_shortlist(&mut build, usize::MAX) {
                return shortlist;
            }
        }
    }

    /// Starts building [`WorkingSet::for_placement`]'s shortlist a slice at a time.
    pub fn shortlist_build(&self, n: usize) -> ShortlistBuild {
        let whole = self.files.len() <= n && self.missing.len() <= n;
        ShortlistBuild {
            n,
            whole,
            at: 0,
            best: Best::new(n),
            writes: Vec::new(),
            chosen: whole.then(Vec::new),
            shortlist: Shortlist::default(),
        }
    }

    /// Goes on with `b` for about `slice` records; the shortlist, once it is done.
    pub fn build_shortlist(&self, b: &mut ShortlistBuild, slice: usize) -> Option<Shortlist> {
        match &b.chosen {
            None => self.rank(b, slice),
            Some(_) => self.add_chosen(b, slice),
        }
        if b.chosen.is_none() || b.at < self.files_to_add(b) {
            return None;
        }
        self.add_missing_and_dirs(&mut b.shortlist, b.whole, b.n);
        Some(std::mem::take(&mut b.shortlist))
    }

    /// How many files the shortlist takes in all.
    fn files_to_add(&self, b: &ShortlistBuild) -> usize {
        match &b.chosen {
            Some(_) if b.whole => self.files.len(),
            Some(chosen) => chosen.len(),
            None => usize::MAX,
        }
    }

    /// Ranks the next `slice` records, keeping the best `n` by opens per page and the
    /// written ones; once all are ranked, fixes the choice.
    fn rank(&self, b: &mut ShortlistBuild, slice: usize) {
        let end = self.files.len().min(b.at.saturating_add(slice));
        let mut recs = Vec::with_capacity(end - b.at);
        self.files.get_into(b.at, end - b.at, &mut recs);
        for (k, f) in recs.iter().enumerate() {
            let i = b.at + k;
            if b.writes.len() < b.n && (f.write_opens > 0 || f.written() || f.refused()) {
                b.writes.push(i as u32);
            }
            let pages = f.size.div_ceil(4096).max(1);
            b.best.offer(Reverse((u64::from(f.opens) << 20) / pages), i);
        }
        b.at = end;
        if b.at < self.files.len() {
            return;
        }
        // Read back in the order they were recorded, as their records and leaf names are
        // stored; a file both hot and written once.
        let mut chosen = std::mem::replace(&mut b.best, Best::new(0)).indices();
        chosen.append(&mut b.writes);
        chosen.sort_unstable();
        chosen.dedup();
        b.chosen = Some(chosen);
        b.at = 0;
    }

    /// Adds the next `slice` chosen files (every file, if the shortlist is whole).
    fn add_chosen(&self, b: &mut ShortlistBuild, slice: usize) {
        let end = self.files_to_add(b).min(b.at.saturating_add(slice));
        let mut scratch = Vec::new();
        let shortlist = &mut b.shortlist;
        let mut add = |f: &FileRec| {
            let uids = self.users.get(f.bits & USERS);
            shortlist.push_file(self.facts(f), uids, |out| {
                scratch.clear();
                self.paths.write_path(f.path, &mut scratch);
                // Interned from &str, split at '/': always UTF-8.
                out.push_str(std::str::from_utf8(&scratch).unwrap_or_default());
            });
            if let Some(ranges) = self.ranges_of(f) {
                shortlist.set_last_ranges(ranges.clone());
            }
        };
        match &b.chosen {
            Some(_) if b.whole => {
                let mut recs = Vec::with_capacity(end - b.at);
                self.files.get_into(b.at, end - b.at, &mut recs);
                recs.iter().for_each(&mut add);
            }
            Some(chosen) => {
                for &i in &chosen[b.at..end] {
                    add(&self.files.get(i as usize));
                }
            }
            None => {}
        }
        b.at = end;
    }

    /// The shortlist's missing names (all, or the one looked up most per directory, `n` at
    /// most) and its directories.
    fn add_missing_and_dirs(&self, shortlist: &mut Shortlist, whole: bool, n: usize) {
        let mut missing: Vec<(PathId, &MissingRec)> = if whole {
            let mut all: Vec<_> = self.missing.iter().map(|(id, m)| (*id, m)).collect();
            self.paths.sort_by_path(&mut all, |m| m.0);
            all
        } else {
            // Placement weighs a missing name for where it was looked up (a directory
            // jobs probe is a snapshot candidate): one per directory is enough, the one
            // looked up most, rather than 100k names with their strings.
            let mut by_dir: HashMap<PathId, (PathId, &MissingRec)> = HashMap::new();
            for (&id, m) in &self.missing {
                let best = by_dir.entry(self.paths.parent(id)).or_insert((id, m));
                if m.lookups > best.1.lookups {
                    *best = (id, m);
                }
            }
            by_dir.into_values().collect()
        };
        if missing.len() > n {
            missing.select_nth_unstable_by_key(n - 1, |(_, m)| Reverse(m.lookups));
            missing.truncate(n);
        }
        shortlist.missing = missing
            .into_iter()
            .map(|(id, m)| self.missing_entry(id, m))
            .collect();
        shortlist.dirs = self.dir_entries();
    }
}
