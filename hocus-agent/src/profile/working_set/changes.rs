//! What changed since the last save, so that a save appends only that to the journal
//! (`store`): a bit per entry (so an entry is listed once however often it changes), the
//! list in the order of first change, and past a bound, "everything".

use crate::profile::paths::PathId;

/// Past this many changed entries (or a quarter of all), a save rewrites the whole state
/// rather than appending each.
const MAX_CHANGED: usize = 1 << 16;

/// An entry changed since the last save.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Changed {
    File(u32),
    Missing(PathId),
    Dir(PathId),
}

/// The changes since the last save.
#[derive(Default)]
pub(super) struct Changes {
    /// Which files (by index) changed since the last save.
    files: Bits,
    /// Which missing names (by path) changed since the last save.
    missing: Bits,
    /// Which directories (by path) changed since the last save.
    dirs: Bits,
    /// Entries changed since `take` last ran.
    listed: Vec<Changed>,
    /// So many changed that the next save rewrites everything.
    all: bool,
    /// Changes noted since the set was made, saves or not: what was read out of it
    /// (a status's summary) is still true while this stays the same.
    edits: u64,
}

impl Changes {
    /// Entry `c` changed, in a set of `len` entries.
    pub(super) fn note(&mut self, c: Changed, len: usize) {
        self.edits += 1;
        let first = match c {
            Changed::File(i) => self.files.set(i as usize),
            Changed::Missing(id) => self.missing.set(id as usize),
            Changed::Dir(id) => self.dirs.set(id as usize),
        };
        if !first || self.all {
            return;
        }
        if self.listed.len() >= MAX_CHANGED.max(len / 4) {
            self.everything();
            return;
        }
        self.listed.push(c);
    }

    /// Everything changed: the next save writes it all.
    pub(super) fn everything(&mut self) {
        self.edits += 1;
        self.all = true;
        self.listed = Vec::new();
    }

    pub(super) fn edits(&self) -> u64 {
        self.edits
    }

    /// These changes replace a set that had seen `earlier` edits: they count on from
    /// there, so that nothing read out of the old set passes for this one's.
    pub(super) fn count_on_from(&mut self, earlier: u64) {
        self.edits += earlier + 1;
    }

    /// What changed since the last call, each entry once: everything (None), or those
    /// listed, in the order they first changed. From now on nothing has.
    pub(super) fn take(&mut self) -> Option<Vec<Changed>> {
        let all = std::mem::take(&mut self.all);
        let listed = std::mem::take(&mut self.listed);
        if all {
            self.files.clear_all();
            self.missing.clear_all();
            self.dirs.clear_all();
            return None;
        }
        for c in &listed {
            match *c {
                Changed::File(i) => self.files.clear(i as usize),
                Changed::Missing(id) => self.missing.clear(id as usize),
                Changed::Dir(id) => self.dirs.clear(id as usize),
            }
        }
        Some(listed)
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.files.heap_bytes()
            + self.missing.heap_bytes()
            + self.dirs.heap_bytes()
            + self.listed.capacity() * size_of::<Changed>()
    }
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
