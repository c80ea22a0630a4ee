//! Reading the working set out: its entries in the file format, what `status` shows (the
//! hottest files, totals per watched tree), the bounded view placement works from, and
//! the entries for the paths of a profile a client sent.

use hashbrown::HashMap;
use hocus_control::status::RootTotals;

use super::{DirRec, FileRec, MissingRec, NONE, WorkingSet, changes::Changed, users::USERS};
use crate::profile::{
    format::{DirEntry, Entry, FORMAT_VERSION, FileEntry, MissingEntry, Profile},
    paths::PathId,
    view::{Facts, View},
};

impl WorkingSet {
    fn facts(&self, f: &FileRec) -> Facts {
        Facts {
            size: f.size,
            bytes_read: f.bytes_read,
            first_touch_ns: f.first_touch(),
            opens: f.opens,
            write_opens: f.write_opens,
            written: f.written(),
            refused: f.refused(),
        }
    }

    pub(super) fn file_entry(&self, f: &FileRec) -> FileEntry {
        let uids = self.users.get(f.bits & USERS).to_vec();
        FileEntry {
            path: self.paths.path(f.path),
            size: f.size,
            mtime_ns: f.mtime_ns,
            opens: u64::from(f.opens),
            bytes_read: f.bytes_read,
            first_touch_ns: f.first_touch(),
            last_touch_ns: f.last_touch_ns,
            users: uids.len() as u32,
            uids,
            written: f.written(),
            write_opens: u64::from(f.write_opens),
            refused: f.refused(),
        }
    }

    pub(super) fn missing_entry(&self, id: PathId, m: &MissingRec) -> MissingEntry {
        MissingEntry {
            path: self.paths.path(id),
            lookups: u64::from(m.lookups),
            first_touch_ns: m.first_touch_ns,
        }
    }

    /// The directories, by path.
    fn dir_entries(&self) -> Vec<DirEntry> {
        let mut ids: Vec<PathId> = self.dirs.keys().copied().collect();
        self.paths.sort_by_path(&mut ids, |id| *id);
        ids.iter()
            .map(|id| self.dir_entry(*id, &self.dirs[id]))
            .collect()
    }

    pub(super) fn dir_entry(&self, id: PathId, d: &DirRec) -> DirEntry {
        DirEntry {
            path: self.paths.path(id),
            opens: d.opens,
            mutated: d.mutated,
        }
    }

    /// What changed since the last call, as entries to save; `None` when so much changed
    /// that everything should be (see [`WorkingSet::entries`]).
    pub fn take_changes(&mut self) -> Option<Vec<Entry>> {
        let changed = self.changes.take().map(|listed| {
            listed
                .into_iter()
                .filter_map(|c| match c {
                    Changed::File(i) => {
                        Some(Entry::File(self.file_entry(&self.files.get(i as usize))))
                    }
                    Changed::Missing(id) => {
                        let m = self.missing.get(&id)?;
                        Some(Entry::Missing(self.missing_entry(id, m)))
                    }
                    Changed::Dir(id) => {
                        let d = self.dirs.get(&id)?;
                        Some(Entry::Dir(self.dir_entry(id, d)))
                    }
                })
                .collect()
        });
        self.files.write_back();
        changed
    }

    /// Every entry, one at a time: files in the order they were recorded, then missing
    /// names and directories.
    pub fn entries(&self) -> impl Iterator<Item = Entry> + '_ {
        let files = self.files.iter().map(|f| Entry::File(self.file_entry(&f)));
        let missing = self
            .missing
            .iter()
            .map(|(id, m)| Entry::Missing(self.missing_entry(*id, m)));
        let dirs = self
            .dirs
            .iter()
            .map(|(id, d)| Entry::Dir(self.dir_entry(*id, d)));
        files.chain(missing).chain(dirs)
    }

    /// The files opened most (then read most), hottest first.
    #[cfg(test)]
    pub fn hottest(&self, n: usize) -> Vec<FileEntry> {
        self.summary(n, &[]).0
    }

    /// What a status shows, in one pass over the records: the `n` files opened most
    /// (then read most), hottest first, and how much of the set is under each of `roots`.
    pub fn summary(
        &self,
        n: usize,
        roots: &[std::path::PathBuf],
    ) -> (Vec<FileEntry>, Vec<RootTotals>) {
        let under: Vec<Option<Vec<bool>>> = roots
            .iter()
            .map(|r| r.to_str().and_then(|r| self.paths.find(r)))
            .map(|id| id.map(|id| self.paths.under(id)))
            .collect();
        let mut totals: Vec<RootTotals> = roots
            .iter()
            .map(|r| RootTotals {
                root: r.clone(),
                files: 0,
                bytes: 0,
                missing: 0,
            })
            .collect();
        let key = |f: &FileRec| (std::cmp::Reverse(f.opens), std::cmp::Reverse(f.bytes_read));
        let hottest = self.top_files(n, key, |_, f| {
            for (t, under) in totals.iter_mut().zip(&under) {
                if under.as_ref().is_some_and(|u| u[f.path as usize]) {
                    t.files += 1;
                    t.bytes = t.bytes.saturating_add(f.size);
                }
            }
        });
        for (t, under) in totals.iter_mut().zip(&under) {
            if let Some(u) = under {
                t.missing = self.missing.keys().filter(|id| u[**id as usize]).count();
            }
        }
        // Hottest first, ties by path.
        let mut hottest: Vec<FileRec> = hottest
            .iter()
            .map(|i| self.files.get(*i as usize))
            .collect();
        self.paths.sort_by_path(&mut hottest, |f| f.path);
        hottest.sort_by_key(key);
        let hottest = hottest.iter().map(|f| self.file_entry(f)).collect();
        (hottest, totals)
    }

    /// The indices of the `n` files with the least `key`, in the order they were
    /// recorded; `visit` sees every record on the way.
    fn top_files<K: Ord>(
        &self,
        n: usize,
        key: impl Fn(&FileRec) -> K,
        mut visit: impl FnMut(usize, &FileRec),
    ) -> Vec<u32> {
        let n = n.min(self.files.len());
        // One pass keeping the best so far, the worst of them on top: the records are
        // read once, in order, and only `n` are held (not a million keys sorted out on
        // the daemon's loop). Ties keep the first recorded.
        let mut best = std::collections::BinaryHeap::with_capacity(n);
        self.files.scan(|i, f| {
            visit(i, f);
            if n == 0 {
                return;
            }
            let k = (key(f), i);
            if best.len() < n {
                best.push(k);
            } else if let Some(mut worst) = best.peek_mut()
                && k < *worst
            {
                *worst = k;
            }
        });
        // In the order they were recorded, as their records and leaf names are stored.
        let mut at: Vec<u32> = best.into_iter().map(|(_, i)| i as u32).collect();
        at.sort_unstable();
        at
    }

    /// What placement needs, bounded: the `n` files of most opens per page (what
    /// placement ranks by), those written or opened for writing (they keep copies and
    /// their directories off the cache), and the `n` missing names looked up most, with
    /// the directories. A site-wide profile is not copied whole to the keeper.
    pub fn for_placement(&self, n: usize) -> View {
        let mut view = View::default();
        let mut scratch = Vec::new();
        let mut add = |f: &FileRec| {
            let uids = self.users.get(f.bits & USERS);
            view.push_file(self.facts(f), uids, |out| {
                scratch.clear();
                self.paths.write_path(f.path, &mut scratch);
                // Interned from &str, split at '/': always UTF-8.
                out.push_str(std::str::from_utf8(&scratch).unwrap_or_default());
            });
        };
        let whole = self.files.len() <= n && self.missing.len() <= n;
        if whole {
            self.files.scan(|_, f| add(f));
        } else {
            let per_page = |f: &FileRec| {
                let pages = f.size.div_ceil(4096).max(1);
                std::cmp::Reverse((u64::from(f.opens) << 20) / pages)
            };
            // Those written or opened for writing are gathered in the same pass.
            let mut writes = Vec::new();
            let mut chosen = self.top_files(n, per_page, |i, f| {
                if writes.len() < n && (f.write_opens > 0 || f.written() || f.refused()) {
                    writes.push(i as u32);
                }
            });
            // Read back in the order they were recorded; a file both hot and written once.
            chosen.extend(writes);
            chosen.sort_unstable();
            chosen.dedup();
            for i in chosen {
                add(&self.files.get(i as usize));
            }
        }
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
            missing.select_nth_unstable_by_key(n - 1, |(_, m)| std::cmp::Reverse(m.lookups));
            missing.truncate(n);
        }
        view.missing = missing
            .into_iter()
            .map(|(id, m)| self.missing_entry(id, m))
            .collect();
        view.dirs = self.dir_entries();
        view
    }

    /// The entries this set holds for the paths `other` holds, as a profile: what the
    /// daemon knows of the files a profile sent names. Files in first-touch order (ties
    /// by path), missing names by path, and the directories `other` holds.
    pub fn profile_for(&self, other: &WorkingSet) -> Profile {
        let here = |id: PathId| self.paths.find(&other.paths.path(id));
        let mut files: Vec<FileEntry> = other
            .files
            .iter()
            .filter_map(|f| {
                let i = *self.file_of.get(here(f.path)? as usize)?;
                (i != NONE).then(|| self.file_entry(&self.files.get(i as usize)))
            })
            .collect();
        let mut missing: Vec<MissingEntry> = other
            .missing
            .keys()
            .filter_map(|id| here(*id))
            .filter_map(|id| Some(self.missing_entry(id, self.missing.get(&id)?)))
            .collect();
        files.sort_by(|a, b| (a.first_touch_ns, &a.path).cmp(&(b.first_touch_ns, &b.path)));
        files.dedup_by(|a, b| a.path == b.path);
        missing.sort_by(|a, b| a.path.cmp(&b.path));
        let mut dirs = self.dir_entries();
        dirs.retain(|d| other.has_dir(&d.path));
        Profile {
            version: FORMAT_VERSION,
            started_unix_ns: self.started_unix_ns,
            files,
            missing,
            dirs,
        }
    }
}
