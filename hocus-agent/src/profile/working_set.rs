//! The working set: which files jobs touched, in what order, how much they read, which
//! names they probed that do not exist, and what they wrote. The live, mutable form of a
//! [`Profile`], compact enough for a site-wide million files: paths are interned
//! ([`Paths`]), a file's facts fit in 56 bytes, and the sets of users that opened files
//! are held once each. What changed since the last save is tracked, so that a save
//! writes only that (`store`).

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use hashbrown::HashMap;

use crate::{
    profile::{
        format::{DirEntry, FORMAT_VERSION, FileEntry, MissingEntry, Profile},
        paths::{PathId, Paths},
        records::{Plain, Records},
        view::{Facts, View},
    },
    shared::{memory::table_bytes, status::RootTotals},
};

/// The live, mutable form of a profile.
#[derive(Default)]
pub struct WorkingSet {
    pub started_unix_ns: u64,
    paths: Paths,
    /// On disk once there are many ([`Records`]).
    files: Records<FileRec>,
    /// Which files (by index) changed since the last save.
    dirty_files: Bits,
    /// Which missing names (by path) changed since the last save.
    dirty_missing: Bits,
    /// Which directories (by path) changed since the last save.
    dirty_dirs: Bits,
    /// The index in `files` of each path's file, or [`NONE`].
    file_of: Vec<u32>,
    missing: HashMap<PathId, MissingRec>,
    dirs: HashMap<PathId, DirRec>,
    users: UserSets,
    /// At most this many entries (files, missing names, directories) are read ones; writes
    /// are always recorded. None: no bound.
    limit: Option<usize>,
    /// New entries not recorded because the bound was reached.
    dropped: u64,
    /// Entries changed since [`WorkingSet::take_changes`] last ran.
    changed: Vec<Changed>,
    /// So many changed that the next save rewrites everything.
    all_changed: bool,
}

const NONE: u32 = u32::MAX;
const WRITTEN: u32 = 1 << 31;
const REFUSED: u32 = 1 << 30;
const USERS: u32 = (1 << 29) - 1;

/// Past this many changed entries (or a quarter of all), a save rewrites the whole state
/// rather than appending each.
const MAX_CHANGED: usize = 1 << 16;

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
    /// The set of users ([`UserSets`]), and the WRITTEN and REFUSED bits.
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
}

/// 12 bytes, 16 with its key in the table (a site has 10^5 of them): lookups saturate
/// at 2^32 like opens, and whether it changed is a bit beside it.
#[repr(C, packed(4))]
#[derive(Clone, Copy, Default)]
struct MissingRec {
    first_touch_ns: u64,
    lookups: u32,
}

/// A bit per index, grown on demand.
#[derive(Default)]
struct Bits(Vec<u64>);

impl Bits {
    /// Sets bit `i`; whether it was clear.
    fn set(&mut self, i: usize) -> bool {
        let (word, bit) = (i / 64, 1u64 << (i % 64));
        if self.0.len() <= word {
            self.0.resize(word + 1, 0);
        }
        let was_clear = self.0[word] & bit == 0;
        self.0[word] |= bit;
        was_clear
    }

    fn clear(&mut self, i: usize) {
        if let Some(w) = self.0.get_mut(i / 64) {
            *w &= !(1u64 << (i % 64));
        }
    }

    fn clear_all(&mut self) {
        self.0.iter_mut().for_each(|w| *w = 0);
    }

    fn heap_bytes(&self) -> usize {
        self.0.capacity() * size_of::<u64>()
    }
}

#[derive(Clone, Copy, Default)]
struct DirRec {
    opens: u64,
    mutated: bool,
}

/// An entry changed since the last save.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Changed {
    File(u32),
    Missing(PathId),
    Dir(PathId),
}

/// The distinct sets of uids that opened files, each held once; set 0 is empty.
#[derive(Clone)]
struct UserSets {
    sets: Vec<Box<[u32]>>,
    ids: HashMap<Box<[u32]>, u32>,
}

impl Default for UserSets {
    fn default() -> Self {
        let empty: Box<[u32]> = Box::new([]);
        Self {
            sets: vec![empty.clone()],
            ids: HashMap::from_iter([(empty, 0)]),
        }
    }
}

impl UserSets {
    fn get(&self, id: u32) -> &[u32] {
        &self.sets[id as usize]
    }

    fn id_of(&mut self, set: Box<[u32]>) -> u32 {
        if let Some(id) = self.ids.get(&set) {
            return *id;
        }
        // Bounded by the files: a file adds at most one new set per user that opens it.
        let id = (self.sets.len() as u32).min(USERS);
        if id == USERS {
            return 0;
        }
        self.sets.push(set.clone());
        self.ids.insert(set, id);
        id
    }

    /// The set `id` with `uids` added.
    fn with(&mut self, id: u32, uids: &[u32]) -> u32 {
        let have = self.get(id);
        if uids.iter().all(|u| have.binary_search(u).is_ok()) {
            return id;
        }
        let set: BTreeSet<u32> = have.iter().chain(uids).copied().collect();
        self.id_of(set.into_iter().collect())
    }
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

    fn len(&self) -> usize {
        self.files.len() + self.missing.len() + self.dirs.len()
    }

    /// Bytes the set holds on the heap, as reserved (an estimate of its share of the
    /// daemon's memory: allocator overhead aside).
    pub fn heap_bytes(&self) -> usize {
        self.paths.heap_bytes()
            + self.files.heap_bytes()
            + self.dirty_files.heap_bytes()
            + self.dirty_missing.heap_bytes()
            + self.dirty_dirs.heap_bytes()
            + self.file_of.capacity() * size_of::<u32>()
            + table_bytes::<(PathId, MissingRec)>(self.missing.capacity())
            + table_bytes::<(PathId, DirRec)>(self.dirs.capacity())
            + self
                .users
                .sets
                .iter()
                .map(|s| 2 * 4 * s.len())
                .sum::<usize>()
            + self.changed.capacity() * size_of::<Changed>()
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

    fn note(&mut self, c: Changed) {
        if self.all_changed {
            return;
        }
        if self.changed.len() >= MAX_CHANGED.max(self.len() / 4) {
            self.all_changed = true;
            self.changed = Vec::new();
            return;
        }
        self.changed.push(c);
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
        if self.dirty_files.set(i) {
            self.note(Changed::File(i as u32));
        }
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

    /// The missing name `path`, made if new (first looked up at `first_touch_ns`),
    /// marked changed.
    fn missing_at(&mut self, path: &str, first_touch_ns: u64) -> &mut MissingRec {
        let id = self.paths.intern(path);
        if self.dirty_missing.set(id as usize) {
            self.note(Changed::Missing(id));
        }
        self.missing.entry(id).or_insert(MissingRec {
            first_touch_ns,
            ..Default::default()
        })
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

    /// The directory `path`, made if new, marked changed.
    fn dir_at(&mut self, path: &str) -> &mut DirRec {
        let id = self.paths.intern(path);
        if self.dirty_dirs.set(id as usize) {
            self.note(Changed::Dir(id));
        }
        self.dirs.entry(id).or_default()
    }

    /// Merges another profile: counts add up, first touches keep the earliest offset,
    /// the newest attributes win, the written flags and users accumulate.
    pub fn merge(&mut self, other: Profile) {
        for f in other.files {
            self.merge_file(f);
        }
        for m in other.missing {
            self.merge_missing(m);
        }
        for d in other.dirs {
            self.merge_dir(d);
        }
    }

    pub fn merge_file(&mut self, f: FileEntry) {
        if !f.written && self.file_index(&f.path).is_none() && !self.room() {
            return;
        }
        let mut uids = f.uids;
        uids.sort_unstable();
        uids.dedup();
        let i = self.file_at(&f.path);
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
            e.bits =
                (e.bits & !USERS) | users.with(e.bits & USERS, &uids) | flags(f.written, f.refused);
        });
    }

    pub fn merge_missing(&mut self, m: MissingEntry) {
        if !self.has_missing(&m.path) && !self.room() {
            return;
        }
        let e = self.missing_at(&m.path, m.first_touch_ns);
        e.lookups = e.lookups.saturating_add(saturated(m.lookups));
        e.first_touch_ns = e.first_touch_ns.min(m.first_touch_ns);
    }

    pub fn merge_dir(&mut self, d: DirEntry) {
        if !d.mutated && !self.has_dir(&d.path) && !self.room() {
            return;
        }
        let e = self.dir_at(&d.path);
        e.opens = e.opens.saturating_add(d.opens);
        e.mutated |= d.mutated;
    }

    /// Takes in a working set read from the state directory: as it is when this one is
    /// empty (keeping this one's bound), else merged entry by entry.
    pub fn merge_state(&mut self, other: WorkingSet) {
        if self.len() == 0 {
            let (limit, dropped) = (self.limit, self.dropped);
            *self = other;
            (self.limit, self.dropped) = (limit, dropped);
            return;
        }
        self.merge_set(&other);
    }

    /// Merges another working set, entry by entry (as [`WorkingSet::merge`]).
    pub fn merge_set(&mut self, other: &WorkingSet) {
        for e in other.entries() {
            match e {
                Entry::File(f) => self.merge_file(f),
                Entry::Missing(m) => self.merge_missing(m),
                Entry::Dir(d) => self.merge_dir(d),
            }
        }
    }

    /// Marks everything changed: the next save writes it all.
    pub fn all_changed(&mut self) {
        self.all_changed = true;
        self.changed = Vec::new();
    }

    /// Sets an entry to exactly what a saved state says (loading the state directory).
    pub fn restore(&mut self, entry: Entry) {
        match entry {
            Entry::File(f) => {
                let mut uids = f.uids;
                uids.sort_unstable();
                uids.dedup();
                let users = self.users.id_of(uids.into_boxed_slice());
                let i = self.file_at(&f.path);
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
                        bits: users | flags(f.written, f.refused),
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

    fn facts(&self, f: &FileRec) -> Facts {
        Facts {
            size: f.size,
            bytes_read: f.bytes_read,
            first_touch_ns: f.first_touch(),
            opens: f.opens,
            write_opens: f.write_opens,
            written: f.bits & WRITTEN != 0,
            refused: f.bits & REFUSED != 0,
        }
    }

    fn file_entry(&self, f: &FileRec) -> FileEntry {
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
            written: f.bits & WRITTEN != 0,
            write_opens: u64::from(f.write_opens),
            refused: f.bits & REFUSED != 0,
        }
    }

    fn missing_entry(&self, id: PathId, m: &MissingRec) -> MissingEntry {
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

    fn dir_entry(&self, id: PathId, d: &DirRec) -> DirEntry {
        DirEntry {
            path: self.paths.path(id),
            opens: d.opens,
            mutated: d.mutated,
        }
    }

    /// What changed since the last call, as entries to save; `None` when so much changed
    /// that everything should be (see [`WorkingSet::entries`]).
    pub fn take_changes(&mut self) -> Option<Vec<Entry>> {
        let all = std::mem::take(&mut self.all_changed);
        let changed = std::mem::take(&mut self.changed);
        if all {
            self.files.write_back();
            self.dirty_files.clear_all();
            self.dirty_missing.clear_all();
            self.dirty_dirs.clear_all();
            return None;
        }
        let mut out = Vec::with_capacity(changed.len());
        for c in changed {
            match c {
                Changed::File(i) => {
                    self.dirty_files.clear(i as usize);
                    let f = self.files.get(i as usize);
                    out.push(Entry::File(self.file_entry(&f)));
                }
                Changed::Missing(id) => {
                    self.dirty_missing.clear(id as usize);
                    if let Some(m) = self.missing.get(&id) {
                        out.push(Entry::Missing(self.missing_entry(id, m)));
                    }
                }
                Changed::Dir(id) => {
                    self.dirty_dirs.clear(id as usize);
                    if let Some(d) = self.dirs.get(&id) {
                        out.push(Entry::Dir(self.dir_entry(id, d)));
                    }
                }
            }
        }
        self.files.write_back();
        Some(out)
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
    pub fn summary(&self, n: usize, roots: &[PathBuf]) -> (Vec<FileEntry>, Vec<RootTotals>) {
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
                if writes.len() < n && (f.write_opens > 0 || f.bits & (WRITTEN | REFUSED) != 0) {
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
        let by_path = |ids: &mut Vec<PathId>| self.paths.sort_by_path(ids, |id| *id);
        let mut missing: Vec<PathId> = self
            .missing
            .keys()
            .copied()
            .filter(|id| under(*id))
            .collect();
        by_path(&mut missing);
        let mut dirs: Vec<PathId> = self.dirs.keys().copied().filter(|id| under(*id)).collect();
        by_path(&mut dirs);
        ExportOrder {
            files,
            missing,
            dirs,
            next: 0,
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
    /// given. The first part is given even when empty: it carries the start.
    pub fn export_part(&self, order: &mut ExportOrder, n: usize) -> Option<Profile> {
        if order.begun && order.next >= order.len() {
            return None;
        }
        order.begun = true;
        let mut p = Profile {
            version: FORMAT_VERSION,
            started_unix_ns: self.started_unix_ns,
            ..Default::default()
        };
        let end = order.next.saturating_add(n).min(order.len());
        let (nf, nm) = (order.files.len(), order.missing.len());
        for k in order.next..end {
            // Entries are never removed; `get` only so that a stale order cannot panic.
            if k < nf {
                let i = order.files.at(k);
                if i < self.files.len() {
                    p.files.push(self.file_entry(&self.files.get(i)));
                }
            } else if k < nf + nm {
                let id = order.missing[k - nf];
                if let Some(m) = self.missing.get(&id) {
                    p.missing.push(self.missing_entry(id, m));
                }
            } else {
                let id = order.dirs[k - nf - nm];
                if let Some(d) = self.dirs.get(&id) {
                    p.dirs.push(self.dir_entry(id, d));
                }
            }
        }
        order.next = end;
        Some(p)
    }

    /// The entries this set holds for the paths `other` holds, as a profile: what the
    /// daemon knows of the files a profile sent names.
    pub fn profile_for(&self, other: &WorkingSet) -> Profile {
        let here = |id: PathId| self.paths.find(&other.paths.path(id));
        let files = other
            .files
            .iter()
            .filter_map(|f| {
                let i = *self.file_of.get(here(f.path)? as usize)?;
                (i != NONE).then(|| self.file_entry(&self.files.get(i as usize)))
            })
            .collect();
        let missing = other
            .missing
            .keys()
            .filter_map(|id| here(*id))
            .filter_map(|id| Some(self.missing_entry(id, self.missing.get(&id)?)))
            .collect();
        let mut p = self.profile(files, missing);
        p.dirs.retain(|d| other.has_dir(&d.path));
        p
    }

    /// A profile of these files and missing names (put in order, a file once) and every
    /// directory.
    fn profile(&self, mut files: Vec<FileEntry>, mut missing: Vec<MissingEntry>) -> Profile {
        files.sort_by(|a, b| (a.first_touch_ns, &a.path).cmp(&(b.first_touch_ns, &b.path)));
        files.dedup_by(|a, b| a.path == b.path);
        missing.sort_by(|a, b| a.path.cmp(&b.path));
        Profile {
            version: FORMAT_VERSION,
            started_unix_ns: self.started_unix_ns,
            files,
            missing,
            dirs: self.dir_entries(),
        }
    }
}

fn saturated(count: u64) -> u32 {
    count.min(u64::from(u32::MAX)) as u32
}

fn flags(written: bool, refused: bool) -> u32 {
    (if written { WRITTEN } else { 0 }) | if refused { REFUSED } else { 0 }
}

/// The entries an export writes, in the order it writes them, fixed when it starts:
/// files by first touch, then missing names and directories by path. It stays valid while
/// the daemon goes on recording (entries are never removed), so an export is taken a part
/// at a time between other work.
#[derive(Debug)]
pub struct ExportOrder {
    files: FileOrder,
    missing: Vec<PathId>,
    dirs: Vec<PathId>,
    /// Entries given so far, across the three lists.
    next: usize,
    begun: bool,
}

/// The files of an export, in order: the records' own, or listed.
#[derive(Debug)]
enum FileOrder {
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
    /// Entries in all.
    fn len(&self) -> usize {
        self.files.len() + self.missing.len() + self.dirs.len()
    }
}

/// One entry of a profile, as saved and restored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    File(FileEntry),
    Missing(MissingEntry),
    Dir(DirEntry),
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
    fn an_export_in_parts_is_the_profile_as_it_began() {
        let mut ws = sample();
        ws.missing("/net/env/a.py-x", T0 + 7);
        ws.missing("/net/env/a.py/x", T0 + 8);
        let whole = ws.to_profile();
        let mut order = ws.export_order(None);
        let mut all = ws.export_part(&mut order, 2).unwrap();
        // Recorded mid-export: facts of entries in the order show, new entries do not.
        ws.add_bytes_read("/net/out/log.txt", 5);
        ws.open("/net/env/late.py", 1000, T0 + 1);
        while let Some(part) = ws.export_part(&mut order, 2) {
            assert!((1..=2).contains(&part.len()));
            all.files.extend(part.files);
            all.missing.extend(part.missing);
            all.dirs.extend(part.dirs);
        }
        let mut want = whole.clone();
        want.files[2].bytes_read += 5;
        assert_eq!(all, want);
        // Names ordered as strings: `a.py-x` and `a.py/x` around `nope.py`.
        let names: Vec<&str> = whole.missing.iter().map(|m| m.path.as_str()).collect();
        assert_eq!(
            names,
            ["/net/env/a.py-x", "/net/env/a.py/x", "/net/env/nope.py"]
        );
        // Under a root, as `retain_under` keeps; an empty export still carries the start.
        let mut order = ws.export_order(Some(Path::new("/net/env")));
        let under = ws.export_part(&mut order, usize::MAX).unwrap();
        let mut want = ws.to_profile();
        want.retain_under(Path::new("/net/env"));
        assert_eq!(under, want);
        let mut order = ws.export_order(Some(Path::new("/elsewhere")));
        assert_eq!(ws.export_part(&mut order, 9).unwrap().started_unix_ns, T0);
        assert!(ws.export_part(&mut order, 9).is_none());
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
    fn the_hottest_of_many_are_those_a_full_sort_finds() {
        // Agrees with sorting everything (ties by path), few of many or many of few.
        for count in [100u32, 1000] {
            let mut ws = WorkingSet::default();
            for i in 0..count {
                let path = format!("/net/f{i:04}");
                // Opens 1..=7 over and over: many ties, broken by path.
                for _ in 0..(i * 7919 % 7 + 1) {
                    ws.open(&path, 1000, u64::from(i));
                }
            }
            let mut all = ws.to_profile().files;
            all.sort_by(|a, b| b.opens.cmp(&a.opens).then_with(|| a.path.cmp(&b.path)));
            let hottest: Vec<_> = ws.hottest(10).into_iter().map(|f| f.opens).collect();
            let expected: Vec<_> = all.iter().take(10).map(|f| f.opens).collect();
            assert_eq!(hottest, expected, "{count} files");
        }
    }

    /// The same work done on a set whose records and leaf names went to disk (in fours,
    /// in sixteen bytes) and on one that kept them in memory.
    #[test]
    fn records_on_disk_answer_as_records_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let mut on_disk = WorkingSet::new(T0);
        on_disk.files = Records::spilling(Some(dir.path().to_owned()), 4);
        on_disk.paths = Paths::spilling(dir.path(), 16);
        let mut in_memory = WorkingSet::new(T0);
        in_memory.files = Records::spilling(None, 4);
        for ws in [&mut on_disk, &mut in_memory] {
            for i in 0..50u64 {
                let path = format!("/net/env/d{}/f{i}.py", i % 3);
                ws.open(&path, 1000 + (i % 4) as u32, T0 + 100 - i);
                ws.set_attributes(
                    &path,
                    Attributes {
                        size: i * 4096,
                        mtime_ns: i as i64,
                    },
                );
            }
            // Saved: what changes after it changes records already on disk.
            assert_eq!(ws.take_changes().unwrap().len(), 50);
            for i in (0..50u64).step_by(7) {
                let path = format!("/net/env/d{}/f{i}.py", i % 3);
                ws.open(&path, 2000, T0 + 200 + i);
                ws.add_bytes_read(&path, i * 10);
            }
            ws.opened_for_writing("/net/env/d1/f4.py", T0 + 300);
            ws.mark_written("/net/env/d2/f5.py", T0 + 301);
            ws.missing("/net/env/d0/nope.py", T0 + 5);
        }
        let changes = |ws: &mut WorkingSet| ws.take_changes().unwrap();
        assert_eq!(changes(&mut on_disk), changes(&mut in_memory));
        assert_eq!(on_disk.to_profile(), in_memory.to_profile());
        assert_eq!(on_disk.hottest(5), in_memory.hottest(5));
        assert_eq!(on_disk.for_placement(10), in_memory.for_placement(10));
        let roots = [PathBuf::from("/net/env/d1"), PathBuf::from("/net/env")];
        let (top, totals) = on_disk.summary(3, &roots);
        assert_eq!((top, totals.clone()), in_memory.summary(3, &roots));
        assert_eq!(totals[0].files, 17);
        assert_eq!(totals[1].files, 50);
        assert_eq!(totals[1].missing, 1);
        let f = "/net/env/d2/f8.py";
        assert_eq!(on_disk.attributes(f), in_memory.attributes(f));
        assert_eq!(on_disk.to_profile().files.len(), 50);
        assert!(on_disk.files.len() > 0 && dir.path().read_dir().unwrap().count() == 0);
    }

    #[test]
    fn an_export_in_recording_order_lists_nothing_and_one_out_of_order_sorts() {
        let mut ws = WorkingSet::new(T0);
        for i in 0..5 {
            ws.open(&format!("/net/{}", 9 - i), 1000, T0 + 10 * i);
        }
        let order = ws.export_order(None);
        assert!(matches!(order.files, FileOrder::Recorded(5)), "{order:?}");
        let paths = |ws: &WorkingSet| -> Vec<String> {
            ws.to_profile().files.into_iter().map(|f| f.path).collect()
        };
        assert_eq!(
            paths(&ws),
            ["/net/9", "/net/8", "/net/7", "/net/6", "/net/5"]
        );
        // Under a root that leaves some out, or touched before the rest: listed.
        ws.open("/other/x", 1000, T0 + 90);
        assert!(matches!(
            ws.export_order(Some(Path::new("/net"))).files,
            FileOrder::Listed(_)
        ));
        ws.merge_file(FileEntry {
            path: "/net/early".into(),
            opens: 1,
            first_touch_ns: 15,
            ..Default::default()
        });
        assert!(matches!(ws.export_order(None).files, FileOrder::Listed(_)));
        assert_eq!(
            paths(&ws),
            [
                "/net/9",
                "/net/8",
                "/net/early",
                "/net/7",
                "/net/6",
                "/net/5",
                "/other/x"
            ]
        );
    }

    #[test]
    fn files_touched_at_once_export_by_path() {
        let mut ws = WorkingSet::new(T0);
        for name in ["d", "b", "c", "a"] {
            ws.open(&format!("/net/{name}"), 1000, T0 + 7);
        }
        ws.open("/net/0", 1000, T0 + 9);
        ws.open("/net/z", 1000, T0 + 1);
        let order: Vec<String> = ws.to_profile().files.into_iter().map(|f| f.path).collect();
        assert_eq!(
            order,
            ["/net/z", "/net/a", "/net/b", "/net/c", "/net/d", "/net/0"]
        );
    }

    #[test]
    fn placement_gets_one_missing_name_per_directory_when_bounded() {
        let mut ws = WorkingSet::default();
        for (name, lookups) in [("/net/a/x.so", 1), ("/net/a/y.so", 5), ("/net/a/z.so", 2)] {
            for _ in 0..lookups {
                ws.missing(name, 1);
            }
        }
        ws.missing("/net/b/w.py", 1);
        ws.open("/net/a/real.py", 1000, 1);
        let mut missing: Vec<_> = ws
            .for_placement(2)
            .missing
            .into_iter()
            .map(|m| (m.path, m.lookups))
            .collect();
        missing.sort();
        assert_eq!(
            missing,
            [("/net/a/y.so".to_owned(), 5), ("/net/b/w.py".to_owned(), 1)]
        );
    }

    /// A bounded view holds the hottest by opens per page, and also the files written
    /// or opened for writing, however cold: they keep copies off the cache. Each once.
    #[test]
    fn a_bounded_view_keeps_the_files_written_or_opened_for_writing() {
        let mut ws = WorkingSet::default();
        for i in 0..10 {
            for _ in 0..5 {
                ws.open(&format!("/net/hot{i}.py"), 1000, 1);
            }
        }
        ws.mark_written("/net/out.log", 2);
        ws.opened_for_writing("/net/lock", 3);
        // Hot and written: in the view once.
        ws.mark_written("/net/hot1.py", 4);
        let view = ws.for_placement(3);
        let mut paths: Vec<&str> = view.files().map(|f| f.path).collect();
        paths.sort();
        assert_eq!(
            paths,
            [
                "/net/hot0.py",
                "/net/hot1.py",
                "/net/hot2.py",
                "/net/lock",
                "/net/out.log"
            ]
        );
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
