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
pub mod open_elsewhere;
pub mod pre_content;
pub mod service;

use std::{
    collections::HashMap,
    fs::File,
    io,
    os::{
        fd::AsRawFd,
        unix::fs::{FileExt, MetadataExt},
    },
    sync::{
        Mutex, RwLock,
        atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering},
    },
};

use hocus_common::ranges::{GRAIN, GRAIN_SHIFT};

use crate::{
    profile::extents::Extents,
    shared::{
        relay::{Hash, RUN_GRAINS, grain_hash},
        tree::stat_now,
    },
};

/// Bytes read from the network and written to the copy at a time.
const CHUNK: usize = 1 << 20;

/// Grains a fill reads before it asks the server the file's version again (4 MiB, the
/// filler's read-ahead): one GETATTR a fill of what a job reads, not one a read.
const CHECKED_GRAINS: u32 = 64;

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
    /// When each 1 MiB chunk ([`HEAT_SHIFT`]) was last read, by [`ACCESSES`]; a chunk
    /// held but not read since the copy was made is the coldest (none here).
    heat: Mutex<HashMap<u32, u64>>,
    /// The hash of each grain filled by this daemon (a copy resumed holds none for what
    /// it held), for the job's other nodes (`relay`).
    hashes: Mutex<HashMap<u32, Hash>>,
    /// Fills hold it shared while they write and count grains, a punch alone: a grain
    /// a fill wrote is never punched between its write and its count.
    punching: RwLock<()>,
    /// Made by a daemon before this one: jobs it does not know may hold it.
    pub resumed: bool,
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
        })
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

    /// A job read grains `[start, end)`: their chunks are the hottest now.
    pub fn read(&self, start: u32, end: u32) {
        let now = ACCESSES.fetch_add(1, Ordering::Relaxed) + 1;
        let mut heat = self.heat.lock().expect("not poisoned");
        for chunk in start >> HEAT_SHIFT..=end.saturating_sub(1) >> HEAT_SHIFT {
            heat.insert(chunk, now);
        }
    }

    /// The chunks the copy holds grains of, each with when it was last read (0: not
    /// since the copy was made), in the file's order.
    pub fn heat(&self) -> Vec<(u64, u32)> {
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
            .map(|c| (heat.get(&c).copied().unwrap_or(0), c))
            .collect()
    }

    /// Takes chunk `chunk` out of the copy: held no more (a read of it asks a fill
    /// again), then its blocks punched out of the file. The bytes it held (none while
    /// a fill of the copy is under way). Only while no job can read the copy: a read
    /// allowed just before could meet the hole.
    pub fn punch(&self, chunk: u32) -> io::Result<u64> {
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
            let before = filled.bytes(self.version.size);
            filled.remove(start, end);
            before - filled.bytes(self.version.size)
        };
        self.heat.lock().expect("not poisoned").remove(&chunk);
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

/// The whole grains of `file` (`size` bytes) that hold data, as the filesystem says
/// (`SEEK_DATA`, `SEEK_HOLE`). A fill writes each grain whole before it counts it, and
/// writes only what it checked to be of the copy's version; a fill cut short (the daemon
/// killed mid-write) leaves a grain in part, which this leaves out: it is filled again.
pub fn held_grains(file: &File, size: u64) -> io::Result<Extents> {
    let fd = file.as_raw_fd();
    let seek = |at: u64, whence| {
        // SAFETY: a plain lseek on a descriptor we hold.
        let r = unsafe { libc::lseek(fd, at as libc::off_t, whence) };
        match r {
            -1 => {
                let e = io::Error::last_os_error();
                // ENXIO: no data at or after `at`.
                if e.raw_os_error() == Some(libc::ENXIO) {
                    Ok(None)
                } else {
                    Err(e)
                }
            }
            at => Ok(Some(at as u64)),
        }
    };
    let last = size.div_ceil(GRAIN).min(u64::from(u32::MAX)) as u32;
    let mut held = Extents::default();
    let mut at = 0;
    while at < size {
        let Some(data) = seek(at, libc::SEEK_DATA)? else {
            break;
        };
        let hole = seek(data, libc::SEEK_HOLE)?.unwrap_or(size).min(size);
        let start = data.div_ceil(GRAIN).min(u64::from(last)) as u32;
        // Data to the end holds the last grain, short as it may be.
        let end = if hole >= size {
            last
        } else {
            (hole / GRAIN) as u32
        };
        if start < end {
            held.add(start, end);
        }
        at = hole.max(data + 1);
    }
    Ok(held)
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
fn read_full(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests;
