//! Exporting the working set in parts, in the profile format's order (files by first
//! touch, then missing names and directories by path), fixed when the export starts: the
//! daemon goes on recording between parts. The missing names and directories are sorted
//! a slice per part while the files go out, so no part holds the daemon's loop for long.

use std::path::Path;

use super::WorkingSet;
use crate::profile::{
    format::{FORMAT_VERSION, Profile},
    paths::{PathId, Paths, SlicedSort},
};

impl WorkingSet {
    /// The profile in its file format: files in first-touch order, the rest by path.
    pub fn to_profile(&self) -> Profile {
        let mut order = self.export_order(None);
        self.export_part(&mut order, usize::MAX).unwrap_or_default()
    }

    /// What an export of the entries under `root` (all when none) writes, in order.
    pub fn export_order(&self, root: Option<&Path>) -> ExportOrder {
        let root = match root {
            None => Some(Paths::ROOT),
            Some(r) => self.paths.find(&r.to_string_lossy()),
        };
        let marks = root.map(|r| self.paths.under(r));
        let under = |id: PathId| marks.as_ref().is_some_and(|m| m[id as usize]);
        let files = self.files_by_first_touch(&under);
        let missing = self.missing.keys().copied().filter(|id| under(*id));
        let dirs = self.dirs.keys().copied().filter(|id| under(*id));
        ExportOrder {
            files,
            missing: SlicedSort::new(missing.collect()),
            dirs: SlicedSort::new(dirs.collect()),
            next_file: 0,
            begun: false,
        }
    }

    /// The files under (by `under`) in first-touch order, ties by path. Files are
    /// recorded at their first touch, so a daemon's own profile is mostly in that order
    /// already: when all of them are, and no two share a first touch, the order is the
    /// records' own and costs nothing. Otherwise the records are read once more for
    /// their first touches (8 bytes a file, while sorting); only files that share a
    /// first touch have their paths compared, read back in order.
    fn files_by_first_touch(&self, under: &dyn Fn(PathId) -> bool) -> FileOrder {
        let mut in_order = true;
        let mut last: Option<u64> = None;
        self.files.scan(|_, f| {
            let t = f.first_touch();
            in_order &= under(f.path) && last.is_none_or(|l| l < t);
            last = Some(t);
        });
        if in_order {
            return FileOrder::Recorded(self.files.len());
        }
        let mut touch = Vec::with_capacity(self.files.len());
        let mut files = Vec::new();
        self.files.scan(|i, f| {
            touch.push(f.first_touch());
            if under(f.path) {
                files.push(i as u32);
            }
        });
        let at = |i: u32| touch[i as usize];
        // Unstable (no scratch copy of a million keys); ties in recording order.
        files.sort_unstable_by_key(|&i| (at(i), i));
        let mut start = 0;
        while start < files.len() {
            let t = at(files[start]);
            let len = files[start..].iter().take_while(|&&i| at(i) == t).count();
            if len > 1 {
                let run = &mut files[start..start + len];
                let mut named: Vec<(PathId, u32)> = run
                    .iter()
                    .map(|&i| (self.files.get(i as usize).path, i))
                    .collect();
                self.paths.sort_by_path(&mut named, |n| n.0);
                for (slot, (_, i)) in run.iter_mut().zip(named) {
                    *slot = i;
                }
            }
            start += len;
        }
        FileOrder::Listed(files)
    }

    /// The next at most `n` entries of an export, as a profile; none once all were
    /// given. The first part is given even when empty: it carries the start. While the
    /// missing names and directories are being sorted, each part does one slice of that
    /// (all of it when `n` is unbounded), and a part may hold fewer than `n` entries.
    pub fn export_part(&self, order: &mut ExportOrder, n: usize) -> Option<Profile> {
        if order.begun && order.left() == 0 {
            return None;
        }
        order.begun = true;
        let mut p = Profile {
            version: FORMAT_VERSION,
            started_unix_ns: self.started_unix_ns,
            ..Default::default()
        };
        let nf = order.files.len();
        let end = order.next_file.saturating_add(n).min(nf);
        for k in order.next_file..end {
            // Entries are never removed; `get` only so that a stale order cannot panic.
            let i = order.files.at(k);
            if i < self.files.len() {
                p.files.push(self.file_entry(&self.files.get(i)));
            }
        }
        let mut room = n - (end - order.next_file);
        order.next_file = end;
        if n == usize::MAX {
            order.missing.finish(&self.paths);
            order.dirs.finish(&self.paths);
        } else if !order.missing.step(&self.paths) {
            order.dirs.step(&self.paths);
        }
        if order.next_file < nf || room == 0 {
            return Some(p);
        }
        room -= order.missing.take(room, |id| {
            if let Some(m) = self.missing.get(&id) {
                p.missing.push(self.missing_entry(id, m));
            }
        });
        if order.missing.left() == 0 {
            order.dirs.take(room, |id| {
                if let Some(d) = self.dirs.get(&id) {
                    p.dirs.push(self.dir_entry(id, d));
                }
            });
        }
        Some(p)
    }
}

/// The entries an export writes, in the order it writes them, fixed when it starts:
/// files by first touch, then missing names and directories by path. It stays valid while
/// the daemon goes on recording (entries are never removed), so an export is taken a part
/// at a time between other work.
#[derive(Debug)]
pub struct ExportOrder {
    pub(super) files: FileOrder,
    missing: SlicedSort,
    dirs: SlicedSort,
    /// Files given so far.
    next_file: usize,
    begun: bool,
}

/// The files of an export, in order: the records' own, or listed.
#[derive(Debug)]
pub(super) enum FileOrder {
    /// The first n records, as recorded.
    Recorded(usize),
    Listed(Vec<u32>),
}

impl FileOrder {
    fn len(&self) -> usize {
        match self {
            FileOrder::Recorded(n) => *n,
            FileOrder::Listed(v) => v.len(),
        }
    }

    /// The index of the `k`th file.
    fn at(&self, k: usize) -> usize {
        match self {
            FileOrder::Recorded(_) => k,
            FileOrder::Listed(v) => v[k] as usize,
        }
    }
}

impl ExportOrder {
    /// Entries not given yet.
    fn left(&self) -> usize {
        self.files.len() - self.next_file + self.missing.left() + self.dirs.left()
    }
}
