//! Recording what the tracer saw: opens, attributes read from the filesystem, bytes read,
//! writes, failed lookups, directories listed or changed. New read entries respect the
//! bound (`room`); writes are always recorded.

use super::{Attributes, REFUSED, WRITTEN, WorkingSet, users::USERS};

impl WorkingSet {
    /// Records an open of a file; returns true when the file is new to the profile.
    pub fn open(&mut self, path: &str, uid: u32, at_unix_ns: u64) -> bool {
        let new = self.file_index(path).is_none();
        if new && !self.room() {
            return false;
        }
        let i = self.touch(path, at_unix_ns);
        let users = &mut self.users;
        self.files.update(i, |f| {
            f.opens = f.opens.saturating_add(1);
            f.bits = (f.bits & !USERS) | users.with(f.bits & USERS, &[uid]);
        });
        new
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
        }
    }

    pub fn add_bytes_read(&mut self, path: &str, bytes: u64) {
        if let Some(i) = self.file_index(path) {
            self.changed_file(i);
            self.files
                .update(i, |f| f.bytes_read = f.bytes_read.saturating_add(bytes));
        }
    }

    /// A file was written, truncated, renamed or unlinked.
    pub fn mark_written(&mut self, path: &str, at_unix_ns: u64) {
        let i = self.touch(path, at_unix_ns);
        self.files.update(i, |f| f.bits |= WRITTEN);
    }

    /// A file was opened with write access (counted also when nothing is written).
    pub fn opened_for_writing(&mut self, path: &str, at_unix_ns: u64) {
        let i = self.touch(path, at_unix_ns);
        self.files
            .update(i, |f| f.write_opens = f.write_opens.saturating_add(1));
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
