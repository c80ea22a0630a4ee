//! Taking in other profiles: a profile file or a working set sent or saved, merged entry
//! by entry (counts add up, first touches keep the earliest offset, the newest attributes
//! win, the written flags and users accumulate); a saved state adopted whole when this
//! set is empty; and an entry set to exactly what a saved state says (`restore`).

use super::{FileRec, RANGES_FROM, WorkingSet, flags, saturated, users::USERS};
use crate::profile::{
    extents::{Extents, MAX_PER_FILE},
    format::{DirEntry, Entry, FileEntry, MissingEntry, Profile},
};

impl WorkingSet {
    /// Merges a profile (see the module).
    pub fn merge(&mut self, other: Profile) {
        self.merge_entries(other.into_entries());
    }

    /// Merges another working set, entry by entry.
    pub fn merge_set(&mut self, other: &WorkingSet) {
        self.merge_entries(other.entries());
    }

    /// Takes in a working set read from the state directory: as it is when this one is
    /// empty (keeping this one's bound), else merged entry by entry.
    pub fn merge_state(&mut self, other: WorkingSet) {
        if self.len() == 0 {
            let (limit, dropped, edits) = (self.limit, self.dropped, self.edits());
            *self = other;
            (self.limit, self.dropped) = (limit, dropped);
            self.changes.count_on_from(edits);
            return;
        }
        self.merge_set(&other);
    }

    fn merge_entries(&mut self, entries: impl IntoIterator<Item = Entry>) {
        for e in entries {
            match e {
                Entry::File(f) => self.merge_file(f),
                Entry::Missing(m) => self.merge_missing(m),
                Entry::Dir(d) => self.merge_dir(d),
            }
        }
    }

    fn merge_file(&mut self, f: FileEntry) {
        if !f.written && self.file_index(&f.path).is_none() && !self.room() {
            return;
        }
        let bits = flags(&f);
        let more = ranges_said(&f);
        let uids = sorted(f.uids);
        let i = self.file_at(&f.path);
        if let Some(more) = more {
            let id = self.files.get(i).path;
            let mut ranges = self.ranges.get(&id).cloned().unwrap_or_default();
            ranges.add_all(&more);
            ranges.coarsen(MAX_PER_FILE);
            self.set_ranges(id, ranges);
        }
        let users = &mut self.users;
        self.files.update(i, |e| {
            if f.mtime_ns > e.mtime_ns || (e.size == 0 && e.mtime_ns == 0) {
                e.size = f.size;
                e.mtime_ns = f.mtime_ns;
            }
            e.opens = e.opens.saturating_add(saturated(f.opens));
            e.bytes_read = e.bytes_read.saturating_add(f.bytes_read);
            e.first_touch_ns = e.first_touch_ns.min(f.first_touch_ns);
            e.last_touch_ns = e.last_touch_ns.max(f.last_touch_ns);
            e.write_opens = e.write_opens.saturating_add(saturated(f.write_opens));
            e.bits = (e.bits & !USERS) | users.with(e.bits & USERS, &uids) | bits;
        });
    }

    fn merge_missing(&mut self, m: MissingEntry) {
        if !self.has_missing(&m.path) && !self.room() {
            return;
        }
        let e = self.missing_at(&m.path, m.first_touch_ns);
        e.lookups = e.lookups.saturating_add(saturated(m.lookups));
        e.first_touch_ns = e.first_touch_ns.min(m.first_touch_ns);
    }

    fn merge_dir(&mut self, d: DirEntry) {
        if !d.mutated && !self.has_dir(&d.path) && !self.room() {
            return;
        }
        let e = self.dir_at(&d.path);
        e.opens = e.opens.saturating_add(d.opens);
        e.mutated |= d.mutated;
    }

    /// Sets an entry to exactly what a saved state says (loading the state directory).
    pub fn restore(&mut self, entry: Entry) {
        match entry {
            Entry::File(f) => {
                let bits = flags(&f);
                let ranges = ranges_said(&f).unwrap_or_default();
                let users = self.users.id_of(sorted(f.uids).into_boxed_slice());
                let i = self.file_at(&f.path);
                self.set_ranges(self.files.get(i).path, ranges);
                self.files.update(i, |e| {
                    *e = FileRec {
                        size: f.size,
                        mtime_ns: f.mtime_ns,
                        bytes_read: f.bytes_read,
                        first_touch_ns: f.first_touch_ns,
                        last_touch_ns: f.last_touch_ns,
                        opens: saturated(f.opens),
                        write_opens: saturated(f.write_opens),
                        path: e.path,
                        bits: users | bits,
                    }
                });
            }
            Entry::Missing(m) => {
                let e = self.missing_at(&m.path, m.first_touch_ns);
                e.lookups = saturated(m.lookups);
                e.first_touch_ns = m.first_touch_ns;
            }
            Entry::Dir(d) => {
                let e = self.dir_at(&d.path);
                e.opens = d.opens;
                e.mutated = d.mutated;
            }
        }
    }
}

/// The ranges an entry says were read: its own, or every grain for a big file it read
/// and gives none for (read whole: an entry's absent ranges). Without this, a file read
/// whole by one job and in part by another stayed in part, and a file restored as read
/// whole became a part of it at its next read.
fn ranges_said(f: &FileEntry) -> Option<Extents> {
    if f.ranges.is_empty() {
        return (f.bytes_read > 0 && f.size > RANGES_FROM).then(|| Extents::all_of(f.size));
    }
    Extents::from_bytes(&f.ranges).filter(|e| !e.is_empty())
}

fn sorted(mut uids: Vec<u32>) -> Vec<u32> {
    uids.sort_unstable();
    uids.dedup();
    uids
}
