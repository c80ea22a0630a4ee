//! The working set: which files jobs touched, in what order, how much they read, which
//! names they probed that do not exist, and what they wrote. The live, mutable form of a
//! [`Profile`], compact enough for a site-wide million files: paths are interned
//! ([`Paths`]), a file's facts fit in 56 bytes, and the sets of users that opened files
//! are held once each (`users`).
//!
//! This file holds the store; the rest, one concern each: recording what the tracer saw
//! (`record`), merging profiles and restoring a saved state (`merge`), tracking what
//! changed for the next save (`changes`), reading it out for status, placement and a
//! sent profile (`read_out`), and exporting it in parts (`export`).

mod best;
mod changes;
pub mod export;
mod merge;
mod read_out;
mod record;
mod shortlist_build;
mod users;

#[cfg(test)]
mod tests;

use hashbrown::HashMap;

use self::{changes::Changes, users::UserSets};
pub use self::{
    read_out::Pass,
    shortlist_build::{SHORTLIST_SLICE, ShortlistBuild},
};
use crate::{
    profile::{
        extents::Extents,
        format::{FileEntry, Profile},
        paths::{PathId, Paths},
        records::{Plain, Records},
    },
    shared::memory::table_bytes,
};

/// Facts about a file read from the filesystem.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Attributes {
    pub size: u64,
    pub mtime_ns: i64,
}

/// The live, mutable form of a profile.
#[derive(Default)]
pub struct WorkingSet {
    pub started_unix_ns: u64,
    paths: Paths,
    /// On disk once there are many ([`Records`]).
    files: Records<FileRec>,
    /// The index in `files` of each path's file, or [`NONE`].
    file_of: Vec<u32>,
    missing: HashMap<PathId, MissingRec>,
    dirs: HashMap<PathId, DirRec>,
    /// The byte ranges read of files larger than [`RANGES_FROM`], and how many extents
    /// they hold together (at most [`MAX_EXTENTS`]).
    ranges: HashMap<PathId, Extents>,
    extents: usize,
    users: UserSets,
    /// At most this many entries (files, missing names, directories) are read ones; writes
    /// are always recorded. None: no bound.
    limit: Option<usize>,
    /// New entries not recorded because the bound was reached.
    dropped: u64,
    changes: Changes,
    /// When the latest job started (as an offset from `started_unix_ns`): a file opened
    /// after it and touched last before it is read back by a job other than its writer.
    job_started: u64,
}

const NONE: u32 = u32::MAX;
/// Files up to this size are copied whole: their ranges are not kept.
pub const RANGES_FROM: u64 = 1 << 20;
/// Extents all files' ranges hold at most (8 MiB): past it a file with none keeps none
/// (copied whole), and one with some joins what it reads next into them.
pub const MAX_EXTENTS: usize = 1 << 20;
/// A file's flags, beside its set of users (`users::USERS`) in `FileRec::bits`.
const WRITTEN: u32 = 1 << 31;
const REFUSED: u32 = 1 << 30;
/// Some process mapped it (`mmap`): a mapping asks for all it maps at once.
const MAPPED: u32 = 1 << 29;
/// Read back since its last write: opened by a job that started after it was last
/// touched, not only by the job that wrote it (see `WorkingSet::job_started`).
const READ_BACK: u32 = 1 << 28;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FileRec {
    size: u64,
    mtime_ns: i64,
    bytes_read: u64,
    first_touch_ns: u64,
    last_touch_ns: u64,
    /// Saturating at 2^32.
    opens: u32,
    write_opens: u32,
    path: PathId,
    /// The set of users ([`UserSets`]), and the WRITTEN, REFUSED and MAPPED bits.
    bits: u32,
}

// SAFETY: integers only, 5 * 8 + 4 * 4 bytes with no padding.
unsafe impl Plain for FileRec {}

impl FileRec {
    /// When it was first opened; 0 for a file known only by its attributes or a write.
    fn first_touch(&self) -> u64 {
        match self.first_touch_ns {
            u64::MAX => 0,
            t => t,
        }
    }

    fn written(&self) -> bool {
        self.bits & WRITTEN != 0
    }

    fn refused(&self) -> bool {
        self.bits & REFUSED != 0
    }

    fn mapped(&self) -> bool {
        self.bits & MAPPED != 0
    }

    fn read_back(&self) -> bool {
        self.bits & READ_BACK != 0
    }
}

/// 12 bytes, 16 with its key in the table (a site has 10^5 of them): lookups saturate
/// at 2^32 like opens, and whether it changed is a bit beside it.
#[repr(C, packed(4))]
#[derive(Clone, Copy, Default)]
struct MissingRec {
    first_touch_ns: u64,
    lookups: u32,
}

#[derive(Clone, Copy, Default)]
struct DirRec {
    opens: u64,
    mutated: bool,
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

    fn len(&self) -> usize {
        self.files.len() + self.missing.len() + self.dirs.len()
    }

    /// Bytes the set holds on the heap, as reserved (an estimate of its share of the
    /// daemon's memory: allocator overhead aside).
    pub fn heap_bytes(&self) -> usize {
        self.paths.heap_bytes()
            + self.files.heap_bytes()
            + self.changes.heap_bytes()
            + self.file_of.capacity() * size_of::<u32>()
            + table_bytes::<(PathId, MissingRec)>(self.missing.capacity())
            + table_bytes::<(PathId, DirRec)>(self.dirs.capacity())
            + table_bytes::<(PathId, Extents)>(self.ranges.capacity())
            + self.ranges.values().map(Extents::heap_bytes).sum::<usize>()
            + self.users.heap_bytes()
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
        if self.limit.is_some_and(|l| self.len() >= l) {
            self.dropped = self.dropped.saturating_add(1);
            return false;
        }
        true
    }

    fn offset(&self, unix_ns: u64) -> u64 {
        unix_ns.saturating_sub(self.started_unix_ns)
    }

    fn file_index(&self, path: &str) -> Option<usize> {
        let id = self.paths.find(path)?;
        match self.file_of.get(id as usize) {
            Some(&i) if i != NONE => Some(i as usize),
            _ => None,
        }
    }

    /// The index of `path`'s file, made (empty) if new, marked changed.
    fn file_at(&mut self, path: &str) -> usize {
        let id = self.paths.intern(path);
        if self.file_of.len() <= id as usize {
            self.file_of.resize(id as usize + 1, NONE);
        }
        let i = match self.file_of[id as usize] {
            NONE => {
                self.file_of[id as usize] = self.files.len() as u32;
                self.files.push(FileRec {
                    path: id,
                    first_touch_ns: u64::MAX,
                    ..Default::default()
                });
                self.files.len() - 1
            }
            i => i as usize,
        };
        self.changed_file(i);
        i
    }

    fn changed_file(&mut self, i: usize) {
        let len = self.len();
        self.changes.note(changes::Changed::File(i as u32), len);
    }

    fn has_missing(&self, path: &str) -> bool {
        self.paths
            .find(path)
            .is_some_and(|id| self.missing.contains_key(&id))
    }

    fn has_dir(&self, path: &str) -> bool {
        self.paths
            .find(path)
            .is_some_and(|id| self.dirs.contains_key(&id))
    }

    /// The missing name `path`, made if new (first looked up at `first_touch_ns`),
    /// marked changed.
    fn missing_at(&mut self, path: &str, first_touch_ns: u64) -> &mut MissingRec {
        let id = self.paths.intern(path);
        let len = self.len();
        self.changes.note(changes::Changed::Missing(id), len);
        self.missing.entry(id).or_insert(MissingRec {
            first_touch_ns,
            ..Default::default()
        })
    }

    /// How many changes the set has seen: while it stays the same, so does everything
    /// read out of it.
    pub fn edits(&self) -> u64 {
        self.changes.edits()
    }

    /// Marks everything changed: the next save writes it all.
    pub fn all_changed(&mut self) {
        self.changes.everything();
    }

    /// The directory `path`, made if new, marked changed.
    fn dir_at(&mut self, path: &str) -> &mut DirRec {
        let id = self.paths.intern(path);
        let len = self.len();
        self.changes.note(changes::Changed::Dir(id), len);
        self.dirs.entry(id).or_default()
    }
}

fn saturated(count: u64) -> u32 {
    count.min(u64::from(u32::MAX)) as u32
}

fn flags(f: &FileEntry) -> u32 {
    (if f.written { WRITTEN } else { 0 })
        | (if f.refused { REFUSED } else { 0 })
        | (if f.mapped { MAPPED } else { 0 })
        | if f.read_back { READ_BACK } else { 0 }
}
