//! A working set's file records, kept on local disk once there are many. A site-wide
//! profile holds a million files, and their facts (56 bytes each) were half of the
//! daemon's memory, though nearly all of them are cold: read when a status, an export
//! or a placement goes through them all, rarely one at a time. Past [`SPILL_AT`]
//! records, they are appended to an unlinked file in the daemon's state directory
//! (O_TMPFILE: a crash leaves nothing behind) and read back in blocks through the page
//! cache, which the kernel may drop under pressure and the daemon's memory may not.
//! Records changed since they were written wait in memory until [`Records::write_back`]
//! (each save) or until too many wait. The file is scratch space only: what survives a
//! restart is the store's (`profile::store`).

use std::{
    cell::RefCell,
    fs::File,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::OnceLock,
};

use hashbrown::HashMap;

use crate::shared::memory::table_bytes;

/// Records held in memory before they go to disk (~900 KiB of file records).
pub const SPILL_AT: usize = 16 * 1024;

/// Changed records held in memory before they are written back without waiting for a
/// save.
const CHANGED_HELD: usize = 64 * 1024;

/// Records read back at a time going through them all: small enough to stay in the CPU's
/// cache between the copy and the look.
const SCAN: usize = 2048;

/// Records read back at a time when one is asked for (export goes through files by
/// first touch: mostly in the order they were recorded).
const BLOCK: usize = 1024;

static SPILL_DIR: OnceLock<PathBuf> = OnceLock::new();

/// Working sets made from now on keep their records in `dir` once they are many (the
/// daemon's state directory, on local disk). Without it (the CLI, tests) records stay
/// in memory.
pub fn spill_into(dir: &Path) {
    let _ = SPILL_DIR.set(dir.to_owned());
}

/// A record type whose bytes may be written out and read back as they are: plain
/// integers, no padding, every bit pattern valid.
///
/// # Safety
/// Implement only for `#[repr(C)]` structs of integers with no padding bytes.
pub unsafe trait Plain: Copy + Default {}

// SAFETY: a byte is plain.
unsafe impl Plain for u8 {}

/// Records by index, `0..len()`: the first `on_disk` in the file, the rest in `tail`.
pub struct Records<T: Plain> {
    dir: Option<PathBuf>,
    spill_at: usize,
    /// Records read back at a time for `get` and `get_into`.
    block_len: usize,
    file: Option<File>,
    on_disk: usize,
    tail: Vec<T>,
    /// Records in the file changed since they were written there.
    changed: HashMap<u32, T>,
    /// The last block read back for `get`: its first index and records.
    block: RefCell<(usize, Vec<T>)>,
    /// Writing failed once (a full disk): records stay in memory from then on.
    failed: bool,
}

impl<T: Plain> Default for Records<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Plain> Records<T> {
    /// In memory until there are [`SPILL_AT`], then in the directory given to
    /// [`spill_into`], if any.
    pub fn new() -> Self {
        Self::spilling_past(SPILL_AT)
    }

    /// In memory until there are `spill_at`, then in the directory given to
    /// [`spill_into`], if any.
    pub fn spilling_past(spill_at: usize) -> Self {
        Self::spilling(SPILL_DIR.get().cloned(), spill_at)
    }

    /// Read back `n` at a time for `get` and `get_into` (a block of [`BLOCK`] unless
    /// told).
    pub fn in_blocks_of(self, n: usize) -> Self {
        Self {
            block_len: n.max(1),
            ..self
        }
    }

    /// Spilling into `dir` past `spill_at` records (tests use a few).
    pub fn spilling(dir: Option<PathBuf>, spill_at: usize) -> Self {
        Self {
            dir,
            spill_at: spill_at.max(1),
            block_len: BLOCK,
            file: None,
            on_disk: 0,
            tail: Vec::new(),
            changed: HashMap::new(),
            block: RefCell::new((0, Vec::new())),
            failed: false,
        }
    }

    pub fn len(&self) -> usize {
        self.on_disk + self.tail.len()
    }

    /// Bytes held on the heap.
    pub fn heap_bytes(&self) -> usize {
        (self.tail.capacity() + self.block.borrow().1.capacity()) * size_of::<T>()
            + table_bytes::<(u32, T)>(self.changed.capacity())
    }

    /// Record `i` (`i < len()`).
    pub fn get(&self, i: usize) -> T {
        if i >= self.on_disk {
            return self.tail[i - self.on_disk];
        }
        if let Some(r) = self.changed.get(&(i as u32)) {
            return *r;
        }
        self.in_block(i, |records| records[0])
    }

    /// The records in memory at `at..at + n`, if they all are (none went to disk).
    pub fn in_memory(&self, at: usize, n: usize) -> Option<&[T]> {
        let from = at.checked_sub(self.on_disk)?;
        self.tail.get(from..from + n)
    }

    /// Appends records `at..at + n` (all below `len()`) to `out`, those on disk read
    /// through the block of `get`.
    pub fn get_into(&self, at: usize, n: usize, out: &mut Vec<T>) {
        let end = at + n;
        let mut i = at;
        while i < end.min(self.on_disk) {
            let first = out.len();
            let k = self.in_block(i, |records| {
                let k = records.len().min(end - i);
                out.extend_from_slice(&records[..k]);
                k
            });
            self.overlay(i, &mut out[first..]);
            i += k;
        }
        if i < end {
            out.extend_from_slice(&self.tail[i - self.on_disk..end - self.on_disk]);
        }
    }

    /// Calls `f` with the records on disk from `i` to the end of the block holding it,
    /// as written; a block starting at `i` is read first if none holds it.
    fn in_block<R>(&self, i: usize, f: impl FnOnce(&[T]) -> R) -> R {
        let mut block = self.block.borrow_mut();
        let (start, records) = &mut *block;
        if !(*start..*start + records.len()).contains(&i) {
            let n = self.block_len.min(self.on_disk - i);
            self.read(i, n, records);
            *start = i;
        }
        f(&records[i - *start..])
    }

    /// Puts the changes not yet written back over `out`, records from index `at`.
    fn overlay(&self, at: usize, out: &mut [T]) {
        if self.changed.is_empty() {
            return;
        }
        for (k, r) in out.iter_mut().enumerate() {
            if let Some(c) = self.changed.get(&((at + k) as u32)) {
                *r = *c;
            }
        }
    }

    /// Changes record `i` (`i < len()`) with `f`.
    pub fn update<R>(&mut self, i: usize, f: impl FnOnce(&mut T) -> R) -> R {
        if i >= self.on_disk {
            return f(&mut self.tail[i - self.on_disk]);
        }
        let Self {
            changed, file, dir, ..
        } = self;
        // One record, not a block: events touch cold files in no particular order.
        let record = changed.entry(i as u32).or_insert_with(|| {
            let mut one = [T::default()];
            read_into(file.as_ref(), dir.as_deref(), i, &mut one);
            one[0]
        });
        let out = f(record);
        if self.changed.len() >= CHANGED_HELD {
            self.write_back();
        }
        out
    }

    /// Adds a record at index `len()`.
    pub fn push(&mut self, r: T) {
        self.extend(&[r]);
    }

    /// Adds records from index `len()` on.
    pub fn extend(&mut self, records: &[T]) {
        self.tail.extend_from_slice(records);
        if self.tail.len() >= self.spill_at {
            self.spill();
        }
    }

    /// Moves the records in memory to the end of the file, if there is somewhere to.
    fn spill(&mut self) {
        if self.failed {
            return;
        }
        let Some(dir) = &self.dir else { return };
        if self.file.is_none() {
            match tempfile::tempfile_in(dir) {
                Ok(f) => self.file = Some(f),
                Err(e) => return self.give_up(&e),
            }
        }
        let file = self.file.as_ref().expect("just opened");
        let at = (self.on_disk * size_of::<T>()) as u64;
        match file.write_all_at(as_bytes(&self.tail), at) {
            Ok(()) => {
                self.on_disk += self.tail.len();
                self.tail.clear();
            }
            Err(e) => self.give_up(&e),
        }
    }

    fn give_up(&mut self, e: &std::io::Error) {
        self.failed = true;
        log::warn!(
            "keeping the profile's records in memory: writing them to {} failed: {e}",
            shown(self.dir.as_deref())
        );
    }

    /// Writes the changed records back to the file (each save). What cannot be written
    /// stays in memory, still right, for the next try.
    pub fn write_back(&mut self) {
        let Some(file) = &self.file else { return };
        let mut changed: Vec<(u32, T)> = self.changed.drain().collect();
        changed.sort_unstable_by_key(|(i, _)| *i);
        let mut kept = Vec::new();
        for (i, r) in changed {
            let at = (i as usize * size_of::<T>()) as u64;
            if let Err(e) = file.write_all_at(as_bytes(std::slice::from_ref(&r)), at) {
                if kept.is_empty() {
                    log::warn!("writing a profile record back failed, kept in memory: {e}");
                }
                kept.push((i, r));
            }
        }
        self.changed.extend(kept);
        self.changed.shrink_to(CHANGED_HELD / 16);
        // The block may hold what was just overwritten.
        *self.block.borrow_mut() = (0, Vec::new());
    }

    /// Reads `n` records from index `at` of the file into `out`, as written.
    fn read(&self, at: usize, n: usize, out: &mut Vec<T>) {
        out.clear();
        out.resize(n, T::default());
        read_into(self.file.as_ref(), self.dir.as_deref(), at, out);
    }

    /// Reads up to [`SCAN`] records on disk from index `at` into `out`, as they are now
    /// (with the changes not yet written back).
    fn read_current(&self, at: usize, out: &mut Vec<T>) {
        self.read(at, SCAN.min(self.on_disk - at), out);
        self.overlay(at, out);
    }

    /// Calls `f` with every record and its index, in order: the fast way through all of
    /// them (a status, a placement), read back [`SCAN`] at a time into one buffer.
    pub fn scan(&self, mut f: impl FnMut(usize, &T)) {
        let mut buf = Vec::new();
        let mut at = 0;
        while at < self.on_disk {
            self.read_current(at, &mut buf);
            for (k, r) in buf.iter().enumerate() {
                f(at + k, r);
            }
            at += buf.len();
        }
        for (k, r) in self.tail.iter().enumerate() {
            f(self.on_disk + k, r);
        }
    }

    /// Every record in index order, read back [`SCAN`] at a time.
    pub fn iter(&self) -> Iter<'_, T> {
        Iter {
            records: self,
            next: 0,
            start: 0,
            buf: Vec::new(),
        }
    }
}

pub struct Iter<'a, T: Plain> {
    records: &'a Records<T>,
    next: usize,
    start: usize,
    buf: Vec<T>,
}

impl<T: Plain> Iterator for Iter<'_, T> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        let r = self.records;
        let i = self.next;
        if i >= r.len() {
            return None;
        }
        self.next += 1;
        if i >= r.on_disk {
            return Some(r.tail[i - r.on_disk]);
        }
        if i >= self.start + self.buf.len() {
            r.read_current(i, &mut self.buf);
            self.start = i;
        }
        Some(self.buf[i - self.start])
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.records.len() - self.next;
        (left, Some(left))
    }
}

/// Fills `out` from index `at` of `file`. A local file just written fails to read back
/// only when the disk does. Going on with records made up would save them over the
/// profile; the daemon stops instead, and the state directory keeps the profile as of
/// its last save.
fn read_into<T: Plain>(file: Option<&File>, dir: Option<&Path>, at: usize, out: &mut [T]) {
    let Some(file) = file else { return };
    if let Err(e) = file.read_exact_at(as_bytes_mut(out), (at * size_of::<T>()) as u64) {
        log::error!(
            "reading the profile's records back from the scratch file in {} failed: {e}; \
             stopping before anything is saved from them (the state directory keeps the \
             profile as of its last save): check that disk, then start hocus-agent again",
            shown(dir)
        );
        std::process::exit(1);
    }
}

fn shown(dir: Option<&Path>) -> std::path::Display<'_> {
    dir.unwrap_or(Path::new("?")).display()
}

fn as_bytes<T: Plain>(records: &[T]) -> &[u8] {
    // SAFETY: `Plain` types have no padding, so every byte is initialised.
    unsafe { std::slice::from_raw_parts(records.as_ptr().cast(), size_of_val(records)) }
}

fn as_bytes_mut<T: Plain>(records: &mut [T]) -> &mut [u8] {
    // SAFETY: as above, and every bit pattern is a valid `Plain` value.
    unsafe { std::slice::from_raw_parts_mut(records.as_mut_ptr().cast(), size_of_val(records)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(C)]
    #[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
    struct R {
        a: u64,
        b: u32,
        c: u32,
    }
    unsafe impl Plain for R {}

    fn r(i: usize) -> R {
        R {
            a: i as u64 * 3,
            b: i as u32,
            c: 7,
        }
    }

    #[test]
    fn records_on_disk_read_back_changed_and_written_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut on_disk = Records::spilling(Some(dir.path().to_owned()), 4);
        let mut in_memory = Records::spilling(None, 4);
        for i in 0..23 {
            on_disk.push(r(i));
            in_memory.push(r(i));
        }
        assert_eq!(on_disk.on_disk, 20, "spilled in fours");
        assert!(on_disk.file.is_some());
        assert_eq!(in_memory.on_disk, 0);
        // Nothing left in the directory: the file is unlinked.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        for records in [&mut on_disk, &mut in_memory] {
            for i in [0, 5, 19, 20, 22] {
                records.update(i, |x| x.c += 1);
            }
            assert_eq!(records.get(5).c, 8);
            let all: Vec<R> = records.iter().collect();
            assert_eq!(all.len(), 23);
            let mut scanned = Vec::new();
            records.scan(|i, x| scanned.push((i, *x)));
            assert_eq!(scanned, all.iter().copied().enumerate().collect::<Vec<_>>());
            for (i, x) in all.iter().enumerate() {
                let bumped = [0, 5, 19, 20, 22].contains(&i);
                assert_eq!(x.a, i as u64 * 3);
                assert_eq!(x.c, if bumped { 8 } else { 7 }, "record {i}");
            }
        }
        assert_eq!(on_disk.changed.len(), 3);
        on_disk.write_back();
        assert!(on_disk.changed.is_empty());
        assert_eq!(on_disk.get(19).c, 8);
        assert_eq!(on_disk.get(18).c, 7);
        let again: Vec<R> = on_disk.iter().collect();
        let memory: Vec<R> = in_memory.iter().collect();
        assert_eq!(again, memory);
    }

    #[test]
    fn ranges_read_back_across_the_file_and_memory() {
        let dir = tempfile::tempdir().unwrap();
        let mut on_disk = Records::spilling(Some(dir.path().to_owned()), 8).in_blocks_of(3);
        let bytes: Vec<u8> = (0..27).collect();
        for chunk in bytes.chunks(5) {
            on_disk.extend(chunk);
        }
        assert_eq!(on_disk.on_disk, 20);
        for (at, n) in [(0, 27), (2, 5), (18, 4), (22, 5), (7, 0), (19, 1)] {
            let mut out = vec![99];
            on_disk.get_into(at, n, &mut out);
            assert_eq!(out[1..], bytes[at..at + n], "{at}+{n}");
            let held = on_disk.in_memory(at, n);
            assert_eq!(held, (at >= 20).then(|| &bytes[at..at + n]), "{at}+{n}");
        }
        // A change not yet written back reads as changed.
        on_disk.update(4, |b| *b = 200);
        let mut out = Vec::new();
        on_disk.get_into(2, 5, &mut out);
        assert_eq!(out, [2, 3, 200, 5, 6]);
    }

    #[test]
    fn a_directory_that_cannot_be_written_keeps_records_in_memory() {
        let mut records = Records::spilling(Some(PathBuf::from("/nonexistent/hocus")), 2);
        for i in 0..5 {
            records.push(r(i));
        }
        assert!(records.failed && records.file.is_none());
        assert_eq!(
            records.iter().collect::<Vec<_>>(),
            (0..5).map(r).collect::<Vec<_>>()
        );
    }
}
