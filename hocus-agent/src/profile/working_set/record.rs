//! Recording what the tracer saw: opens, attributes read from the filesystem, bytes read,
//! writes, failed lookups, directories listed or changed. New read entries respect the
//! bound (`room`); writes are always recorded.

use hocus_common::ranges::GRAIN_SHIFT;

use super::{
    Attributes, MAPPED, MAX_EXTENTS, RANGES_FROM, READ_BACK, REFUSED, WRITTEN, WorkingSet,
    users::USERS,
};
use crate::profile::{
    extents::{Extents, MAX_PER_FILE},
    paths::PathId,
};

impl WorkingSet {
    /// Records an open of a file; returns true when the file is new to the profile.
    pub fn open(&mut self, path: &str, uid: u32, at_unix_ns: u64) -> bool {
        let known = self.file_index(path);
        let new = known.is_none();
        if new && !self.room() {
            return false;
        }
        // Written and untouched since before the latest job started: that job reads
        // back what an earlier one wrote (an open for writing clears it again).
        let back = known.is_some_and(|i| {
            let f = self.files.get(i);
            (f.write_opens > 0 || f.written()) && f.last_touch_ns < self.job_started
        });
        let i = self.touch(path, at_unix_ns);
        let users = &mut self.users;
        self.files.update(i, |f| {
            f.opens = f.opens.saturating_add(1);
            f.bits = (f.bits & !USERS) | users.with(f.bits & USERS, &[uid]);
            if back {
                f.bits |= READ_BACK;
            }
        });
        new
    }

    /// A job starts: files it opens that were written before are read back
    /// ([`READ_BACK`]), where a managed store's files wait for it (`place`).
    pub fn job_started(&mut self, at_unix_ns: u64) {
        self.job_started = self.offset(at_unix_ns);
    }

    /// The index of `path`'s file, created at its first touch, with a touch at
    /// `at_unix_ns` recorded.
    fn touch(&mut self, path: &str, at_unix_ns: u64) -> usize {
        let at = self.offset(at_unix_ns);
        let i = self.file_at(path);
        self.files.update(i, |f| {
            f.first_touch_ns = f.first_touch_ns.min(at);
            f.last_touch_ns = f.last_touch_ns.max(at);
        });
        i
    }

    /// The size and mtime known of a file, if it is held.
    pub fn attributes(&self, path: &str) -> Option<Attributes> {
        let f = self.files.get(self.file_index(path)?);
        Some(Attributes {
            size: f.size,
            mtime_ns: f.mtime_ns,
        })
    }

    pub fn set_attributes(&mut self, path: &str, a: Attributes) {
        if let Some(i) = self.file_index(path) {
            self.changed_file(i);
            self.files.update(i, |f| {
                f.size = a.size;
                f.mtime_ns = a.mtime_ns;
            });
            if a.size <= RANGES_FROM {
                let id = self.files.get(i).path;
                self.set_ranges(id, Extents::default());
            }
        }
    }

    pub fn add_bytes_read(&mut self, path: &str, bytes: u64) {
        if let Some(i) = self.file_index(path) {
            self.changed_file(i);
            self.files
                .update(i, |f| f.bytes_read = f.bytes_read.saturating_add(bytes));
        }
    }

    /// Grains `[start, end)` of `path` were read. Kept for a file larger than
    /// [`RANGES_FROM`] (by its size, or by where the read lay, or until its size is
    /// known), within the bounds.
    pub fn read_range(&mut self, path: &str, start: u32, end: u32) {
        let Some(i) = self.file_index(path) else {
            return;
        };
        let f = self.files.get(i);
        // A size of 0 is not known yet (the file was just opened): its ranges are kept
        // until it is, and dropped then if it is small.
        if f.size != 0 && f.size <= RANGES_FROM && u64::from(end) << GRAIN_SHIFT <= RANGES_FROM {
            return;
        }
        let full = self.extents >= MAX_EXTENTS;
        match self.ranges.get(&f.path) {
            // Held already (a sweep reads the run still being read again and again).
            Some(e) if e.gaps(start, end).is_empty() => return,
            None if full => return,
            _ => {}
        }
        let e = self.ranges.entry(f.path).or_default();
        let before = e.len();
        e.add(start, end);
        if e.len() > MAX_PER_FILE {
            e.coarsen(MAX_PER_FILE);
        } else if full && e.len() > before {
            e.coarsen(before);
        }
        self.extents = self.extents + e.len() - before;
        self.changed_file(i);
    }

    /// Sets the ranges of the file at `id` (empty: none known), as a restore or a merge
    /// made them.
    pub(super) fn set_ranges(&mut self, id: PathId, ranges: Extents) {
        let before = self.ranges.get(&id).map_or(0, Extents::len);
        let after = ranges.len();
        if ranges.is_empty() {
            self.ranges.remove(&id);
        } else {
            self.ranges.insert(id, ranges);
        }
        self.extents = self.extents + after - before;
    }

    /// A file was written, truncated, renamed or unlinked.
    pub fn mark_written(&mut self, path: &str, at_unix_ns: u64) {
        let i = self.touch(path, at_unix_ns);
        self.files
            .update(i, |f| f.bits = (f.bits | WRITTEN) & !READ_BACK);
    }

    /// A file was opened with write access (counted also when nothing is written).
    pub fn opened_for_writing(&mut self, path: &str, at_unix_ns: u64) {
        let i = self.touch(path, at_unix_ns);
        self.files.update(i, |f| {
            f.write_opens = f.write_opens.saturating_add(1);
            f.bits &= !READ_BACK;
        });
    }

    /// Some process mapped `path`.
    pub fn mark_mapped(&mut self, path: &str) {
        if let Some(i) = self.file_index(path) {
            self.changed_file(i);
            self.files.update(i, |f| f.bits |= MAPPED);
        }
    }

    /// A job got EROFS writing through a read-only copy of `path`.
    pub fn mark_refused(&mut self, path: &str, at_unix_ns: u64) {
        let i = self.touch(path, at_unix_ns);
        self.files.update(i, |f| f.bits |= REFUSED);
    }

    pub fn missing(&mut self, path: &str, at_unix_ns: u64) {
        if !self.has_missing(path) && !self.room() {
            return;
        }
        let at = self.offset(at_unix_ns);
        let m = self.missing_at(path, at);
        m.lookups = m.lookups.saturating_add(1);
    }

    pub fn dir_opened(&mut self, path: &str) {
        if !self.has_dir(path) && !self.room() {
            return;
        }
        let d = self.dir_at(path);
        d.opens = d.opens.saturating_add(1);
    }

    /// Something in the directory (or the directory itself) was created, renamed or removed.
    pub fn dir_mutated(&mut self, path: &str) {
        self.dir_at(path).mutated = true;
    }
}
