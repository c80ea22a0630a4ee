//! Partial copies: for a big file, a sparse local file of the network file's size that
//! holds only the byte ranges jobs read (the profile's `ranges`), served at once and
//! filled on demand. A read of a range not yet local waits on a pre-content event
//! (`pre_content`, Linux 6.14); the filler reads it from the network file, writes it
//! to the copy and allows the read (`filler`). While the daemon
//! lives a guard process holds the group too, and answers EIO for it once the daemon is
//! gone (`guard`): a group that goes away allows what it was asked, and a job would
//! read a hole's zeros as data.
//!
//! Every range belongs to one identity of the network file (inode, size, mtime,
//! ctime): a fill that finds it changed fails the read with EIO and drops the copy
//! rather than mix versions.
//!
//! The hash of each grain is kept as it is filled (from the network, or from a job's
//! other node that hashed it so): a partial copy passes its grains on to the job's
//! other nodes with them (`relay`), and a hole punched since or a disk's corruption is
//! found, never passed on.

pub mod filler;
pub mod guard;
pub mod heat;
mod on_disk;
pub mod open_elsewhere;
pub mod pre_content;
pub mod served;
pub mod service;
pub mod shares;
pub mod trim;

pub use on_disk::held_grains;
use on_disk::read_full;

use std::{
    collections::HashMap,
    fs::File,
    io,
    os::{
        fd::AsRawFd,
        unix::fs::{FileExt, MetadataExt},
    },
    path::{Path, PathBuf},
    sync::{
        Mutex, RwLock,
        atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering},
    },
};

use hocus_common::ranges::{GRAIN, GRAIN_SHIFT};

use heat::{Heat, Touch};

use crate::{
    profile::extents::Extents,
    shared::{
        asked::{self, Asking, Purpose},
        relay::{Hash, RUN_GRAINS, grain_hash},
        tree::stat_now,
    },
};

/// The chunks ([`HEAT_SHIFT`]) grains `[start, end)` fall in: `[first, last)`.
fn chunks(start: u32, end: u32) -> (u32, u32) {
    (
        start >> HEAT_SHIFT,
        (end.saturating_sub(1) >> HEAT_SHIFT) + 1,
    )
}

/// Bytes read from the network and written to the copy at a time.
const CHUNK: usize = 1 << 20;

/// Grains a fill reads before it asks the server the file's version again (4 MiB, the
/// filler's read-ahead): one GETATTR a fill of what a job reads, not one a read.
pub(super) const CHECKED_GRAINS: u32 = 64;

/// A chunk a copy holds, as trimming weighs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// When it was last read, among all accesses (0: not since the copy was made).
    pub order: u64,
    pub chunk: u32,
    /// Whose fill brought it in (none: the placement's).
    pub owner: Option<u32>,
}

/// What a copy's heat is kept per, and what trimming punches out at a time: 1 MiB (16
/// grains), the size of a data loader's chunk.
const HEAT_SHIFT: u32 = 20 - GRAIN_SHIFT;

/// Accesses to partial copies so far, all copies together: the clock their heat is kept
/// by (an order, not a time: which was read last is what counts).
static ACCESSES: AtomicU64 = AtomicU64::new(0);

/// Grains whose hash is kept, all copies together, and the most kept: 64 GiB of
/// partial copies (48 MiB of memory). Past it a grain is held without one, and a job's
/// other nodes fill it from the network themselves.
static HASHED: AtomicUsize = AtomicUsize::new(0);
const MAX_HASHED: usize = 1 << 20;

/// The identity of a network file: a change to any of these is a new version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Version {
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i128,
    pub ctime_ns: i128,
}

impl Version {
    /// As the client has it: for a file just opened, what the open fetched (no
    /// request of its own to the server).
    pub fn of(file: &File) -> io::Result<Self> {
        Ok(Self::from(&file.metadata()?))
    }

    /// As the server has it now, past the client's attribute cache (which may be
    /// seconds old).
    pub fn now(file: &File) -> io::Result<Self> {
        Ok(Self::from(&stat_now(file)?))
    }

    fn from(m: &std::fs::Metadata) -> Self {
        Self {
            ino: m.ino(),
            size: m.size(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
            ctime_ns: i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec()),
        }
    }
}

/// Why a range could not be made local.
#[derive(Debug, thiserror::Error)]
pub enum FillError {
    #[error("the network file changed since its copy was made")]
    Changed,
    #[error("reading the network file failed: {0}")]
    Source(io::Error),
    #[error("writing the copy failed: {0}")]
    Local(io::Error),
    #[error(
        "the SSD budget has no room left: the cache is full of what jobs read within the last 10 s (raise ssd-budget, or partial-from to make fewer partial copies)"
    )]
    Budget,
    #[error(
        "this user's fills hold their share of the SSD budget's room (an equal share of what fills hold, among the users whose fills hold it): a read of theirs punches only their own chunks not read within the last 10 s, and there are none"
    )]
    Share,
}

/// A partial copy: the network file it stands for (open with the credentials of the
/// user whose job read it, as whole copies are made), the version its ranges are of,
/// and the grains held so far.
#[derive(Debug)]
pub struct PartialCopy {
    /// For logs.
    pub name: String,
    source: File,
    /// The copy, open for writing on the cache's own (writable) mount: a job reads it
    /// through a read-only bind, where the event's descriptor cannot be opened for
    /// writing. Its writes raise events of their own, which the filler answers at once.
    local: File,
    version: Version,
    filled: Mutex<Extents>,
    dropped: AtomicBool,
    /// Where the last access ended (a grain): one that starts there reads in order.
    next: AtomicU32,
    /// When each 1 MiB chunk ([`HEAT_SHIFT`]) was last allowed to be read, by
    /// [`ACCESSES`] and the daemon's clock; a chunk held but not read since the copy
    /// was made is the coldest (none here). Taken with `filled` held, so that a chunk is
    /// never punched between a check that it is held and the read allowed on it.
    heat: Mutex<Heat>,
    /// The hash of each grain filled by this daemon (a copy resumed holds none for what
    /// it held), for the job's other nodes (`relay`).
    hashes: Mutex<HashMap<u32, Hash>>,
    /// Fills hold it shared while they write and count grains, a punch alone: a grain
    /// a fill wrote is never punched between its write and its count.
    punching: RwLock<()>,
    /// Made by a daemon before this one: jobs it does not know may hold it.
    pub resumed: bool,
    /// The watched tree its source is in: its fills' reads count there
    /// (`counted_under`).
    tree: PathBuf,
}

impl PartialCopy {
    /// Stands for `source` (its version read now) in `local`, a sparse file made to its
    /// size (not marked yet), holding nothing yet: [`fill_all`](Self::fill_all) and
    /// [`put`](Self::put) make ranges local, the rest is filled on demand.
    pub fn new(name: String, source: File, local: File) -> Result<Self, FillError> {
        let version = Version::of(&source).map_err(FillError::Source)?;
        local.set_len(version.size).map_err(FillError::Local)?;
        Ok(Self {
            name,
            source,
            local,
            version,
            filled: Mutex::new(Extents::default()),
            dropped: AtomicBool::new(false),
            next: AtomicU32::new(0),
            heat: Mutex::default(),
            hashes: Mutex::default(),
            punching: RwLock::default(),
            resumed: false,
            tree: PathBuf::new(),
        })
    }

    /// Its fills' reads of the network count under `tree` (`shared::asked`), as fills
    /// where what they are done for counts nothing else.
    pub fn counted_under(mut self, tree: &Path) -> Self {
        self.tree = tree.to_owned();
        self
    }

    /// Stands for `source` again in `local`, a partial copy made before (by a daemon
    /// since gone) of the version `source` is now (the caller checked it against the
    /// index), holding what [`held_grains`] found in it.
    pub fn resume(name: String, source: File, local: File) -> Result<Self, FillError> {
        let version = Version::of(&source).map_err(FillError::Source)?;
        let size = local.metadata().map_err(FillError::Local)?.len();
        if size != version.size {
            return Err(FillError::Changed);
        }
        let held = held_grains(&local, size).map_err(FillError::Local)?;
        Ok(Self {
            name,
            source,
            local,
            version,
            filled: Mutex::new(held),
            dropped: AtomicBool::new(false),
            next: AtomicU32::new(0),
            heat: Mutex::default(),
            hashes: Mutex::default(),
            punching: RwLock::default(),
            resumed: true,
            tree: PathBuf::new(),
        })
    }

    pub fn size(&self) -> u64 {
        self.version.size
    }

    /// The size and mtime (ns) of the version its ranges are of, as the relay offers
    /// them to a job's other node.
    pub fn offered(&self) -> (u64, i64) {
        (self.version.size, self.version.mtime_ns as i64)
    }

    /// Bytes held (whole grains; the last may be short).
    pub fn held(&self) -> u64 {
        self.filled
            .lock()
            .expect("not poisoned")
            .bytes(self.version.size)
    }

    /// The copy, open on the cache's own mount.
    pub fn local(&self) -> &File {
        &self.local
    }

    /// Whether a fill found the network file changed: the copy must go.
    pub fn dropped(&self) -> bool {
        self.dropped.load(Ordering::Relaxed)
    }

    /// The grains held.
    #[cfg(test)]
    pub fn filled(&self) -> Extents {
        self.filled.lock().expect("not poisoned").clone()
    }

    /// The grains of `[start, end)` not held yet.
    pub fn missing(&self, start: u32, end: u32) -> Vec<(u32, u32)> {
        self.filled
            .lock()
            .expect("not poisoned")
            .gaps(start, end.min(self.grains()))
    }

    /// Whether the copy holds grains `[start, end)`.
    pub fn holds(&self, start: u32, end: u32) -> bool {
        self.missing(start, end).is_empty()
    }

    /// Whether the copy holds the whole file.
    pub fn whole(&self) -> bool {
        self.holds(0, self.grains())
    }

    /// Whether an access to grains `[start, end)` starts where the last one ended (a
    /// reader going through the file in order); remembers where it ends.
    pub fn follows(&self, start: u32, end: u32) -> bool {
        let last = self.next.swap(end, Ordering::Relaxed);
        last != 0 && last == start
    }

    /// Whether the copy holds grains `[start, end)`: if so, a read of them is allowed
    /// now and their chunks are the hottest (checked and noted at once, so a punch
    /// while jobs run, which skips chunks read lately, never falls in between).
    pub fn allows(&self, start: u32, end: u32) -> bool {
        let filled = self.filled.lock().expect("not poisoned");
        if !filled.gaps(start, end.min(self.grains())).is_empty() {
            return false;
        }
        self.touch(start, end, true);
        true
    }

    /// Grains `[start, end)` were just filled for a read of user `uid`'s not allowed yet:
    /// too fresh for another fill to punch for room, the fill's to take back if its read
    /// is refused ([`Self::punch_only_filled`]), and counted against `uid`'s share.
    pub fn filled_now(&self, start: u32, end: u32, uid: u32) {
        let _filled = self.filled.lock().expect("not poisoned");
        self.touch(start, end, false);
        let (first, last) = chunks(start, end);
        self.heat
            .lock()
            .expect("not poisoned")
            .filled_by(first, last, uid);
    }

    /// Notes the chunks of grains `[start, end)` touched now (`filled` held).
    fn touch(&self, start: u32, end: u32, allowed: bool) {
        let touch = Touch {
            order: ACCESSES.fetch_add(1, Ordering::Relaxed) + 1,
            secs: heat::now(),
            allowed,
        };
        let (first, last) = chunks(start, end);
        self.heat
            .lock()
            .expect("not poisoned")
            .touch(first, last, touch);
    }

    /// The chunks of grains `[start, end)` filled and never allowed to be read since:
    /// a refused read's fill takes them back.
    pub fn only_filled(&self, start: u32, end: u32) -> Vec<u32> {
        let (first, last) = chunks(start, end);
        let _filled = self.filled.lock().expect("not poisoned");
        self.heat
            .lock()
            .expect("not poisoned")
            .only_filled(first, last)
    }

    /// The chunks the copy holds grains of, each with when it was last read (0: not
    /// since the copy was made) and whose fill brought it in, in the file's order.
    pub fn heat(&self) -> Vec<Chunk> {
        let filled = self.filled.lock().expect("not poisoned");
        let heat = self.heat.lock().expect("not poisoned");
        let mut chunks: Vec<u32> = Vec::new();
        for &(s, e) in filled.iter() {
            for chunk in s >> HEAT_SHIFT..=(e - 1) >> HEAT_SHIFT {
                if chunks.last() != Some(&chunk) {
                    chunks.push(chunk);
                }
            }
        }
        chunks
            .into_iter()
            .map(|c| Chunk {
                order: heat.of(c).map_or(0, |t| t.order),
                chunk: c,
                owner: heat.owner(c),
            })
            .collect()
    }

    /// Takes chunk `chunk` out of the copy: held no more (a read of it asks a fill
    /// again), then its blocks punched out of the file. The bytes it held (none while
    /// a fill of the copy is under way, or if it was allowed to be read since second
    /// `read_before` of the daemon's clock). Without `read_before`, only while no
    /// process but the daemon has the copy open or mapped: a read allowed just before
    /// could meet the hole. With it, a read allowed that long ago is over (a read is
    /// allowed within its system call, which goes on at once), but a mapping is not:
    /// the caller's to know none maps the copy.
    pub fn punch(&self, chunk: u32, read_before: Option<u32>) -> io::Result<u64> {
        self.punch_if(chunk, |t| {
            read_before.is_none_or(|before| t.is_none_or(|t| t.secs < before))
        })
    }

    /// Punches chunk `chunk` if it was filled and never allowed to be read since: no read
    /// can be on its way to it.
    pub fn punch_only_filled(&self, chunk: u32) -> io::Result<u64> {
        self.punch_if(chunk, |t| t.is_some_and(|t| !t.allowed))
    }

    /// Punches chunk `chunk` if `may` says so of its last touch, checked under the lock
    /// every allow takes.
    fn punch_if(&self, chunk: u32, may: impl FnOnce(Option<Touch>) -> bool) -> io::Result<u64> {
        let (start, end) = (
            chunk << HEAT_SHIFT,
            ((chunk + 1) << HEAT_SHIFT).min(self.grains()),
        );
        // A fill under way (a server slow to answer) is not waited for: nothing punched.
        let Ok(_alone) = self.punching.try_write() else {
            return Ok(0);
        };
        let freed = {
            let mut filled = self.filled.lock().expect("not poisoned");
            let mut heat = self.heat.lock().expect("not poisoned");
            if !may(heat.of(chunk)) {
                return Ok(0);
            }
            heat.forget(chunk);
            let before = filled.bytes(self.version.size);
            filled.remove(start, end);
            before - filled.bytes(self.version.size)
        };
        self.forget_hashes(start, end);
        let from = u64::from(start) << GRAIN_SHIFT;
        let to = (u64::from(end) << GRAIN_SHIFT).min(self.version.size);
        self.punch_bytes(from, to)?;
        Ok(freed)
    }

    /// Punches bytes `[from, to)` (within the file) out of the copy's file.
    fn punch_bytes(&self, from: u64, to: u64) -> io::Result<()> {
        // SAFETY: fallocate on a descriptor we hold; the range is within the file.
        let r = unsafe {
            libc::fallocate(
                self.local.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                from as libc::off_t,
                (to - from) as libc::off_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Grains in the file (the last may be short).
    pub fn grains(&self) -> u32 {
        self.version.size.div_ceil(GRAIN).min(u64::from(u32::MAX)) as u32
    }

    /// Makes grains `[start, end)` (none of them held) local: read from the network
    /// file, written to the copy (whose writes the filler lets through at once), and
    /// held once the server says the file is still this copy's version (every
    /// [`CHECKED_GRAINS`]). A change found drops the copy: its bytes of two versions
    /// are never served together. `progress` is told of each chunk.
    pub fn fill_with(
        &self,
        start: u32,
        end: u32,
        mut progress: impl FnMut(),
    ) -> Result<(), FillError> {
        let end = end.min(self.grains());
        let _asking = (asked::current().is_none() && !self.tree.as_os_str().is_empty())
            .then(|| Asking::begin(&self.tree, Purpose::Fill));
        let _shared = self.punching.read().expect("not poisoned");
        let mut buf = vec![0u8; CHUNK];
        let mut piece = start;
        while piece < end {
            let piece_end = end.min(piece.saturating_add(CHECKED_GRAINS));
            let from = u64::from(piece) << GRAIN_SHIFT;
            let to = (u64::from(piece_end) << GRAIN_SHIFT).min(self.version.size);
            let mut at = from;
            let checked = self
                .write_from_source(&mut buf, &mut at, to, &mut progress)
                .and_then(|()| self.still_this_version());
            if let Err(e) = checked {
                // What was written is not known to be of this version: it goes, and
                // with it the hashes kept of it.
                let _ = self.punch_bytes(from, at);
                self.forget_hashes(piece, piece_end);
                if matches!(e, FillError::Changed) {
                    self.dropped.store(true, Ordering::Relaxed);
                }
                return Err(e);
            }
            self.filled
                .lock()
                .expect("not poisoned")
                .add(piece, piece_end);
            piece = piece_end;
        }
        Ok(())
    }

    /// Reads the network file's bytes `[at, to)` into the copy, `at` moving on as they
    /// are written.
    fn write_from_source(
        &self,
        buf: &mut [u8],
        at: &mut u64,
        to: u64,
        progress: &mut impl FnMut(),
    ) -> Result<(), FillError> {
        while *at < to {
            let n = ((to - *at) as usize).min(buf.len());
            let got = read_full(&self.source, &mut buf[..n], *at).map_err(FillError::Source)?;
            asked::read(got as u64);
            // Short: the file shrank under us.
            if got < n {
                return Err(FillError::Changed);
            }
            self.local
                .write_all_at(&buf[..n], *at)
                .map_err(FillError::Local)?;
            self.keep_hashes((*at >> GRAIN_SHIFT) as u32, &buf[..n], None);
            *at += n as u64;
            progress();
        }
        Ok(())
    }

    /// Whether the network file is this copy's version, as the server says now (the
    /// client's attributes, cached, would not show a rewrite in place for seconds).
    fn still_this_version(&self) -> Result<(), FillError> {
        let now = Version::now(&self.source).map_err(FillError::Source)?;
        if now == self.version {
            Ok(())
        } else {
            Err(FillError::Changed)
        }
    }

    /// Makes the grains of `ranges` local that it does not hold yet, from the network.
    pub fn fill_all(&self, ranges: &Extents) -> Result<(), FillError> {
        for &(start, end) in ranges.iter() {
            for (s, e) in self.missing(start, end) {
                self.fill_with(s, e, || {})?;
            }
        }
        Ok(())
    }

    /// Takes grains from `start` on, `bytes` whose grains hash to `hashes` (checked by
    /// the caller: a job's other node sent them, hashed as they were filled from the
    /// network file of this copy's version), as a fill does.
    pub fn put(&self, start: u32, hashes: &[Hash], bytes: &[u8]) -> Result<(), FillError> {
        let end = start.saturating_add(hashes.len() as u32);
        let from = u64::from(start) << GRAIN_SHIFT;
        let to = (u64::from(end) << GRAIN_SHIFT).min(self.version.size);
        if end > self.grains() || bytes.len() as u64 != to.saturating_sub(from) {
            return Err(FillError::Local(io::Error::other(
                "grains beyond the file, or not whole",
            )));
        }
        let _shared = self.punching.read().expect("not poisoned");
        self.local
            .write_all_at(bytes, from)
            .map_err(FillError::Local)?;
        self.keep_hashes(start, bytes, Some(hashes));
        self.filled.lock().expect("not poisoned").add(start, end);
        Ok(())
    }

    /// Keeps the hashes of the grains from `start` on that `bytes` hold (`known`, or
    /// computed), while fewer than [`MAX_HASHED`] are kept.
    fn keep_hashes(&self, start: u32, bytes: &[u8], known: Option<&[Hash]>) {
        let mut hashes = self.hashes.lock().expect("not poisoned");
        for (i, grain) in bytes.chunks(GRAIN as usize).enumerate() {
            let hash = known.map_or_else(|| grain_hash(grain), |k| k[i]);
            if hashes.insert(start + i as u32, hash).is_none()
                && HASHED.fetch_add(1, Ordering::Relaxed) >= MAX_HASHED
            {
                HASHED.fetch_sub(1, Ordering::Relaxed);
                hashes.remove(&(start + i as u32));
            }
        }
    }

    fn forget_hashes(&self, start: u32, end: u32) {
        let mut hashes = self.hashes.lock().expect("not poisoned");
        let before = hashes.len();
        hashes.retain(|g, _| *g < start || *g >= end);
        HASHED.fetch_sub(before - hashes.len(), Ordering::Relaxed);
    }

    /// Passes on the grains of `asked` it holds with their hash, to `send` as runs of
    /// at most [`RUN_GRAINS`]: their start, hashes and bytes. No grain is punched
    /// meanwhile; a run whose bytes read back as other than their hash (a disk's
    /// corruption) is not sent. The bytes sent.
    pub fn relay(
        &self,
        asked: &[(u32, u32)],
        mut send: impl FnMut(u32, &[Hash], &[u8]) -> io::Result<()>,
    ) -> io::Result<u64> {
        let _shared = self.punching.read().expect("not poisoned");
        let runs: Vec<(u32, Vec<Hash>)> = {
            let filled = self.filled.lock().expect("not poisoned");
            let hashes = self.hashes.lock().expect("not poisoned");
            // Asked runs that overlap are sent once; each is matched with the held
            // extents it meets only (both sorted): a request costs the grains it gets.
            let mut wanted = Extents::default();
            for &(s, e) in asked {
                if s < e.min(self.grains()) {
                    wanted.add(s, e.min(self.grains()));
                }
            }
            let held = filled.grains();
            let mut runs: Vec<(u32, Vec<Hash>)> = Vec::new();
            for &(start, end) in wanted.iter() {
                let first = held.partition_point(|&(_, e)| e <= start);
                for &(s, e) in held[first..].iter().take_while(|(s, _)| *s < end) {
                    for g in s.max(start)..e.min(end) {
                        match (hashes.get(&g), runs.last_mut()) {
                            (None, _) => {}
                            (Some(h), Some((first, hs)))
                                if *first + hs.len() as u32 == g
                                    && (hs.len() as u32) < RUN_GRAINS =>
                            {
                                hs.push(*h);
                            }
                            (Some(h), _) => runs.push((g, vec![*h])),
                        }
                    }
                }
            }
            runs
        };
        let mut sent = 0;
        let mut buf = vec![0u8; CHUNK];
        for (start, hashes) in runs {
            let from = u64::from(start) << GRAIN_SHIFT;
            let to = (u64::from(start + hashes.len() as u32) << GRAIN_SHIFT).min(self.version.size);
            let bytes = &mut buf[..(to - from) as usize];
            if read_full(&self.local, bytes, from)? < bytes.len() {
                continue;
            }
            let intact = bytes
                .chunks(GRAIN as usize)
                .zip(&hashes)
                .all(|(g, h)| grain_hash(g) == *h);
            if !intact {
                log::warn!(
                    "{}: a grain no longer reads as it was filled; not passed on",
                    self.name
                );
                continue;
            }
            send(start, &hashes, bytes)?;
            sent += bytes.len() as u64;
        }
        Ok(sent)
    }
}

impl Drop for PartialCopy {
    fn drop(&mut self) {
        let kept = self.hashes.get_mut().map_or(0, |h| h.len());
        HASHED.fetch_sub(kept, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
