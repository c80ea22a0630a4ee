//! Reading the working set out: its entries in the file format, what `status` shows (the
//! hottest files, totals per watched tree), the bounded shortlist placement works from, and
//! the entries for the paths of a profile a client sent.

use hocus_control::status::RootTotals;

use super::{
    DirRec, FileRec, MissingRec, NONE, WorkingSet, best::Best, changes::Changed, users::USERS,
};
use crate::profile::{
    format::{DirEntry, Entry, FORMAT_VERSION, FileEntry, MissingEntry, Profile},
    paths::PathId,
    shortlist::Facts,
};

/// How far [`WorkingSet::next_entries`] has come: the files recorded and the names
/// held as the pass began (entries added meanwhile are marked changed: a journal after
/// the snapshot holds them).
pub struct Pass {
    file: usize,
    files: usize,
    /// Missing names (false) and directories (true).
    names: Vec<(bool, PathId)>,
    name: usize,
}

impl WorkingSet {
    pub(super) fn facts(&self, f: &FileRec) -> Facts {
        Facts {
            size: f.size,
            bytes_read: f.bytes_read,
            first_touch_ns: f.first_touch(),
            opens: f.opens,
            write_opens: f.write_opens,
            written: f.written(),
            refused: f.refused(),
            mapped: f.mapped(),
            read_back: f.read_back(),
        }
    }

    /// The ranges read of a file read in part (none for one read whole).
    pub(super) fn ranges_of(&self, f: &FileRec) -> Option<&crate::profile::extents::Extents> {
        self.ranges.get(&f.path).filter(|e| !e.whole(f.size))
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
            mapped: f.mapped(),
            read_back: f.read_back(),
            ranges: self
                .ranges_of(f)
                .map_or_else(Vec::new, |e| e.to_bytes(f.size)),
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
    pub(super) fn dir_entries(&self) -> Vec<DirEntry> {
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

    /// Every entry, one at a time, to be merged into another set: files in the order
    /// they were recorded, then missing names and directories.
    pub fn entries(&self) -> impl Iterator<Item = Entry> + '_ {
        let files = self.files.iter().map(|f| {
            let mut e = self.file_entry(&f);
            // Read whole: said in full, as absent ranges say it only with bytes read.
            if self.ranges.get(&f.path).is_some_and(|r| r.whole(f.size)) {
                e.ranges = vec![[0, f.size]];
            }
            Entry::File(e)
        });
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

    /// A pass over every entry that goes a slice at a time ([`WorkingSet::next_entries`]),
    /// the set changing in between: a snapshot written while the daemon goes on.
    pub fn pass(&self) -> Pass {
        Pass {
            file: 0,
            files: self.files.len(),
            names: (self.missing.keys().map(|id| (false, *id)))
                .chain(self.dirs.keys().map(|id| (true, *id)))
                .collect(),
            name: 0,
        }
    }

    /// Up to `n` more entries of `pass` (files in the order they were recorded, then
    /// missing names and directories), each as it is now; whether any are left.
    pub fn next_entries(&self, pass: &mut Pass, n: usize, mut out: impl FnMut(Entry)) -> bool {
        let files = n.min(pass.files - pass.file);
        if files > 0 {
            let mut recs = Vec::with_capacity(files);
            self.files.get_into(pass.file, files, &mut recs);
            for f in &recs {
                out(Entry::File(self.file_entry(f)));
            }
            pass.file += files;
        }
        let names = (n - files).min(pass.names.len() - pass.name);
        for &(dir, id) in &pass.names[pass.name..pass.name + names] {
            // Entries are never removed: each is there still.
            if dir {
                if let Some(d) = self.dirs.get(&id) {
                    out(Entry::Dir(self.dir_entry(id, d)));
                }
            } else if let Some(m) = self.missing.get(&id) {
                out(Entry::Missing(self.missing_entry(id, m)));
            }
        }
        pass.name += names;
        pass.file < pass.files || pass.name < pass.names.len()
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
        let mut best = Best::new(n.min(self.files.len()));
        self.files.scan(|i, f| {
            visit(i, f);
            best.offer(key(f), i);
        });
        best.indices()
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
