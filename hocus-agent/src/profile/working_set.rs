//! The working set: which files jobs touched, in what order, how much they read, which
//! names they probed that do not exist, and what they wrote. The live, mutable form of a
//! [`Profile`].

use std::{
    collections::{BTreeSet, HashMap},
    path::Path,
};

use crate::{
    profile::format::{DirEntry, FORMAT_VERSION, FileEntry, MissingEntry, Profile},
    shared::status::RootTotals,
};

/// The live, mutable form of a profile.
#[derive(Debug, Clone, Default)]
pub struct WorkingSet {
    pub started_unix_ns: u64,
    files: HashMap<String, FileState>,
    missing: HashMap<String, MissingEntry>,
    dirs: HashMap<String, DirEntry>,
    /// At most this many entries (files, missing names, directories) are read ones; writes
    /// are always recorded. None: no bound.
    limit: Option<usize>,
    /// New entries not recorded because the bound was reached.
    dropped: u64,
}

#[derive(Debug, Clone, Default)]
struct FileState {
    entry: FileEntry,
    uids: BTreeSet<u32>,
}

/// Facts about a file read from the filesystem.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Attributes {
    pub size: u64,
    pub mtime_ns: i64,
}

impl WorkingSet {
    pub fn new(started_unix_ns: u64) -> Self {
        Self {
            started_unix_ns,
            ..Default::default()
        }
    }

    pub fn from_profile(p: Profile) -> Self {
        let mut ws = Self::new(p.started_unix_ns);
        ws.merge(p);
        ws
    }

    /// Files, missing names and directories held.
    pub fn counts(&self) -> (usize, usize, usize) {
        (self.files.len(), self.missing.len(), self.dirs.len())
    }

    /// Bounds the entries read ones may make (`max-profile-entries`).
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = Some(limit);
    }

    /// New entries not recorded because the bound was reached, so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Whether a new entry may be made; counts one that may not.
    fn room(&mut self) -> bool {
        let len = self.files.len() + self.missing.len() + self.dirs.len();
        if self.limit.is_some_and(|l| len >= l) {
            self.dropped = self.dropped.saturating_add(1);
            return false;
        }
        true
    }

    fn offset(&self, unix_ns: u64) -> u64 {
        unix_ns.saturating_sub(self.started_unix_ns)
    }

    /// Records an open of a file; returns true when the file is new to the profile.
    pub fn open(&mut self, path: &str, uid: u32, at_unix_ns: u64) -> bool {
        let new = !self.files.contains_key(path);
        if new && !self.room() {
            return false;
        }
        let f = self.touch(path, at_unix_ns);
        f.entry.opens = f.entry.opens.saturating_add(1);
        f.uids.insert(uid);
        new
    }

    /// The entry of `path`, created at its first touch, with `at` recorded as a touch.
    fn touch(&mut self, path: &str, at_unix_ns: u64) -> &mut FileState {
        let at = self.offset(at_unix_ns);
        let f = self
            .files
            .entry(path.to_owned())
            .or_insert_with(|| FileState {
                entry: FileEntry {
                    path: path.to_owned(),
                    first_touch_ns: at,
                    ..Default::default()
                },
                uids: BTreeSet::new(),
            });
        f.entry.first_touch_ns = f.entry.first_touch_ns.min(at);
        f.entry.last_touch_ns = f.entry.last_touch_ns.max(at);
        f
    }

    pub fn set_attributes(&mut self, path: &str, a: Attributes) {
        if let Some(f) = self.files.get_mut(path) {
            f.entry.size = a.size;
            f.entry.mtime_ns = a.mtime_ns;
        }
    }

    pub fn add_bytes_read(&mut self, path: &str, bytes: u64) {
        if let Some(f) = self.files.get_mut(path) {
            f.entry.bytes_read = f.entry.bytes_read.saturating_add(bytes);
        }
    }

    /// A file was written, truncated, renamed or unlinked.
    pub fn mark_written(&mut self, path: &str, at_unix_ns: u64) {
        self.touch(path, at_unix_ns).entry.written = true;
    }

    /// A file was opened with write access (counted also when nothing is written).
    pub fn opened_for_writing(&mut self, path: &str, at_unix_ns: u64) {
        let e = &mut self.touch(path, at_unix_ns).entry;
        e.write_opens = e.write_opens.saturating_add(1);
    }

    /// A job got EROFS writing through a read-only copy of `path`.
    pub fn mark_refused(&mut self, path: &str, at_unix_ns: u64) {
        self.touch(path, at_unix_ns).entry.refused = true;
    }

    pub fn missing(&mut self, path: &str, at_unix_ns: u64) {
        if !self.missing.contains_key(path) && !self.room() {
            return;
        }
        let at = self.offset(at_unix_ns);
        let m = self
            .missing
            .entry(path.to_owned())
            .or_insert_with(|| MissingEntry {
                path: path.to_owned(),
                lookups: 0,
                first_touch_ns: at,
            });
        m.lookups = m.lookups.saturating_add(1);
    }

    pub fn dir_opened(&mut self, path: &str) {
        if !self.dirs.contains_key(path) && !self.room() {
            return;
        }
        let d = self.dir(path);
        d.opens = d.opens.saturating_add(1);
    }

    /// Something in the directory (or the directory itself) was created, renamed or removed.
    pub fn dir_mutated(&mut self, path: &str) {
        self.dir(path).mutated = true;
    }

    fn dir(&mut self, path: &str) -> &mut DirEntry {
        self.dirs
            .entry(path.to_owned())
            .or_insert_with(|| DirEntry {
                path: path.to_owned(),
                ..Default::default()
            })
    }

    /// Merges another profile: counts add up, first touches keep the earliest offset,
    /// the newest attributes win, the written flags and users accumulate.
    pub fn merge(&mut self, other: Profile) {
        for f in other.files {
            if !f.written && !self.files.contains_key(&f.path) && !self.room() {
                continue;
            }
            match self.files.get_mut(&f.path) {
                None => {
                    let uids = f.uids.iter().copied().collect();
                    self.files
                        .insert(f.path.clone(), FileState { entry: f, uids });
                }
                Some(s) => {
                    let e = &mut s.entry;
                    if f.mtime_ns > e.mtime_ns || (e.size == 0 && e.mtime_ns == 0) {
                        e.size = f.size;
                        e.mtime_ns = f.mtime_ns;
                    }
                    e.opens = e.opens.saturating_add(f.opens);
                    e.bytes_read = e.bytes_read.saturating_add(f.bytes_read);
                    e.first_touch_ns = e.first_touch_ns.min(f.first_touch_ns);
                    e.last_touch_ns = e.last_touch_ns.max(f.last_touch_ns);
                    e.written |= f.written;
                    e.write_opens = e.write_opens.saturating_add(f.write_opens);
                    e.refused |= f.refused;
                    s.uids.extend(f.uids);
                }
            }
        }
        for m in other.missing {
            if !self.missing.contains_key(&m.path) && !self.room() {
                continue;
            }
            match self.missing.get_mut(&m.path) {
                None => {
                    self.missing.insert(m.path.clone(), m);
                }
                Some(e) => {
                    e.lookups = e.lookups.saturating_add(m.lookups);
                    e.first_touch_ns = e.first_touch_ns.min(m.first_touch_ns);
                }
            }
        }
        for d in other.dirs {
            if !d.mutated && !self.dirs.contains_key(&d.path) && !self.room() {
                continue;
            }
            let e = self.dir(&d.path);
            e.opens = e.opens.saturating_add(d.opens);
            e.mutated |= d.mutated;
        }
    }

    /// The files opened most (then read most), hottest first.
    pub fn hottest(&self, n: usize) -> Vec<FileEntry> {
        let mut all: Vec<&FileEntry> = self.files.values().map(|s| &s.entry).collect();
        let key = |f: &FileEntry| (std::cmp::Reverse(f.opens), std::cmp::Reverse(f.bytes_read));
        let n = n.min(all.len());
        if n == 0 {
            return Vec::new();
        }
        all.select_nth_unstable_by_key(n - 1, |f| key(f));
        all.truncate(n);
        all.sort_by(|a, b| key(a).cmp(&key(b)).then_with(|| a.path.cmp(&b.path)));
        all.into_iter().cloned().collect()
    }

    /// How much of the working set is under `root`.
    pub fn totals_under(&self, root: &Path) -> RootTotals {
        let under = |p: &str| Path::new(p).starts_with(root);
        let files = self.files.values().filter(|f| under(&f.entry.path));
        let (mut count, mut bytes) = (0, 0);
        for f in files {
            count += 1;
            bytes = f.entry.size.saturating_add(bytes);
        }
        RootTotals {
            root: root.to_owned(),
            files: count,
            bytes,
            missing: self.missing.keys().filter(|p| under(p)).count(),
        }
    }

    /// The profile in its file format: files in first-touch order, the rest by path.
    pub fn to_profile(&self) -> Profile {
        let mut files: Vec<FileEntry> = self
            .files
            .values()
            .map(|s| {
                let mut e = s.entry.clone();
                e.uids = s.uids.iter().copied().collect();
                e.users = e.uids.len() as u32;
                e
            })
            .collect();
        files.sort_by(|a, b| (a.first_touch_ns, &a.path).cmp(&(b.first_touch_ns, &b.path)));
        let mut missing: Vec<MissingEntry> = self.missing.values().cloned().collect();
        missing.sort_by(|a, b| a.path.cmp(&b.path));
        let mut dirs: Vec<DirEntry> = self.dirs.values().cloned().collect();
        dirs.sort_by(|a, b| a.path.cmp(&b.path));
        Profile {
            version: FORMAT_VERSION,
            started_unix_ns: self.started_unix_ns,
            files,
            missing,
            dirs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::format::FormatError;

    const T0: u64 = 1_700_000_000_000_000_000;

    fn sample() -> WorkingSet {
        let mut ws = WorkingSet::new(T0);
        assert!(ws.open("/net/env/a.py", 1000, T0 + 10));
        assert!(!ws.open("/net/env/a.py", 1001, T0 + 50));
        ws.open("/net/env/b.so", 1000, T0 + 20);
        ws.set_attributes(
            "/net/env/a.py",
            Attributes {
                size: 42,
                mtime_ns: 7,
            },
        );
        ws.add_bytes_read("/net/env/a.py", 84);
        ws.missing("/net/env/nope.py", T0 + 5);
        ws.missing("/net/env/nope.py", T0 + 6);
        ws.mark_written("/net/out/log.txt", T0 + 30);
        ws.dir_opened("/net/env");
        ws.dir_mutated("/net/out");
        ws
    }

    #[test]
    fn records_opens_in_first_touch_order() {
        let p = sample().to_profile();
        let order: Vec<_> = p.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(
            order,
            ["/net/env/a.py", "/net/env/b.so", "/net/out/log.txt"]
        );
        let a = &p.files[0];
        assert_eq!((a.opens, a.bytes_read, a.size, a.mtime_ns), (2, 84, 42, 7));
        assert_eq!((a.first_touch_ns, a.last_touch_ns), (10, 50));
        assert_eq!((a.users, a.uids.clone()), (2, vec![1000, 1001]));
        assert!(!a.written);
        assert!(p.files[2].written);
        assert_eq!(p.missing[0].lookups, 2);
        assert_eq!(p.dirs.len(), 2);
    }

    #[test]
    fn format_round_trips() {
        let p = sample().to_profile();
        let back = Profile::from_json(&p.to_json(), Path::new("x.json"), "").unwrap();
        assert_eq!(back, p);
        // and a working set rebuilt from it exports the same profile
        assert_eq!(WorkingSet::from_profile(back).to_profile(), p);
    }

    #[test]
    fn merging_adds_counts_and_keeps_earliest_touch() {
        let mut ws = sample();
        let mut other = WorkingSet::new(T0 + 1_000);
        other.open("/net/env/a.py", 2000, T0 + 1_003);
        other.set_attributes(
            "/net/env/a.py",
            Attributes {
                size: 43,
                mtime_ns: 9,
            },
        );
        other.open("/net/env/c.py", 2000, T0 + 1_001);
        other.missing("/net/env/nope.py", T0 + 1_002);
        other.mark_written("/net/env/b.so", T0 + 1_004);
        ws.merge(other.to_profile());
        let p = ws.to_profile();
        let get = |path: &str| p.files.iter().find(|f| f.path == path).unwrap().clone();
        let a = get("/net/env/a.py");
        assert_eq!(a.opens, 3);
        assert_eq!(
            a.first_touch_ns, 3,
            "the merged profile's offset 3 is earlier than 10"
        );
        assert_eq!((a.size, a.mtime_ns), (43, 9), "newer attributes win");
        assert_eq!(a.uids, [1000, 1001, 2000]);
        assert!(get("/net/env/b.so").written);
        assert_eq!(get("/net/env/c.py").opens, 1);
        assert_eq!(p.missing[0].lookups, 3);
        assert_eq!(p.started_unix_ns, T0);
    }

    #[test]
    fn merging_is_additive_when_done_twice() {
        let p = sample().to_profile();
        let mut ws = WorkingSet::from_profile(p.clone());
        ws.merge(p);
        let doubled = ws.to_profile();
        assert_eq!(doubled.files[0].opens, 4);
        assert_eq!(doubled.files[0].bytes_read, 168);
        assert_eq!(doubled.missing[0].lookups, 4);
        assert_eq!(doubled.dirs[0].opens, 2);
    }

    #[test]
    fn rejects_corrupt_truncated_and_newer_profiles() {
        let path = Path::new("/var/lib/hocus/profile.json");
        let good = sample().to_profile().to_json();
        let truncated = &good[..good.len() / 2];
        let e = Profile::from_json(truncated, path, "delete it").unwrap_err();
        assert!(matches!(e, FormatError::Corrupt { .. }), "{e}");
        assert!(e.to_string().contains("/var/lib/hocus/profile.json"), "{e}");
        assert!(e.to_string().contains("delete it"), "{e}");

        let e = Profile::from_json(b"{\"version\": 2, \"whatever\": []}", path, "").unwrap_err();
        assert!(matches!(e, FormatError::TooNew { found: 2, .. }), "{e}");
        assert!(e.to_string().contains("upgrade"), "{e}");

        let e = Profile::from_json(b"[1,2,3]", path, "").unwrap_err();
        assert!(matches!(e, FormatError::Corrupt { .. }), "{e}");
        let e = Profile::from_json(b"{\"version\": 1, \"files\": 3}", path, "").unwrap_err();
        assert!(matches!(e, FormatError::Corrupt { .. }), "{e}");
    }

    #[test]
    fn filters_by_root() {
        let mut p = sample().to_profile();
        p.retain_under(Path::new("/net/env"));
        assert_eq!(p.files.len(), 2);
        assert_eq!(p.missing.len(), 1);
        assert_eq!(p.dirs.len(), 1);
        // a sibling with a common string prefix is not under the root
        let mut p = sample().to_profile();
        p.retain_under(Path::new("/net/en"));
        assert!(p.files.is_empty());
    }

    #[test]
    fn a_bounded_working_set_drops_new_reads_but_keeps_writes() {
        let mut ws = WorkingSet::new(T0);
        ws.set_limit(2);
        assert!(ws.open("/net/a", 1, T0));
        ws.missing("/net/nope", T0);
        assert!(!ws.open("/net/b", 1, T0), "full: not recorded");
        ws.missing("/net/nope2", T0);
        ws.dir_opened("/net/d");
        assert!(!ws.open("/net/a", 1, T0 + 1), "known entries still count");
        ws.mark_written("/net/out", T0);
        assert_eq!(ws.counts(), (2, 1, 0));
        assert_eq!(ws.dropped(), 3);
        let p = ws.to_profile();
        assert!(p.files.iter().any(|f| f.path == "/net/out" && f.written));
        assert_eq!(
            p.files.iter().find(|f| f.path == "/net/a").unwrap().opens,
            2
        );
    }
}
