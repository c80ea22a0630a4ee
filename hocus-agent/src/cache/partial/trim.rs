//! Eviction by range, and the SSD budget's room for fills. The keeper says each second
//! how much room the budget has left ([`Trimmer::set_room`]); every fill takes its bytes
//! of it before it writes ([`Trimmer::take`]), so fills count against the budget while
//! jobs run. When the room is gone, a fill first punches out the chunks read least
//! lately that may go while jobs run: not allowed to be read within [`READ_AGO`] (a read
//! allowed before that is over), of copies no other process maps (a mapping reads what
//! was allowed at its `mmap` whenever it likes). Only if that frees too little does the
//! fill fail. With no job running the keeper punches more freely ([`Trimmer::coldest`]).
//!
//! The room is shared among the users whose fills hold it ([`Held`]): each chunk counts
//! against the user whose read's fill brought it in. A fill short of room for a user
//! past an equal share punches only that user's own chunks; for any other user it
//! punches first the chunks of users past their share, then the coldest of the rest.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc, Mutex,
        atomic::{AtomicI32, AtomicI64, Ordering},
    },
    time::{Duration, Instant},
};

use super::{
    Chunk, FillError, GRAIN_SHIFT, HEAT_SHIFT, PartialCopy, heat,
    open_elsewhere::{self, Key},
    served::{Copies, OwnWrite, Writing},
};

/// A chunk allowed to be read this long ago (seconds) may be punched while jobs run.
/// Between its allow and the page cache lock the read takes (which a punch waits for),
/// a read only runs on: it does no I/O there, so only a CPU starved for this long could
/// still be on its way.
pub const READ_AGO: u32 = 10;

/// How long what /proc says is mapped is taken as still so, that fills which find no
/// room do not each scan it: a mapping made since was allowed since, and its chunks are
/// not punched for [`READ_AGO`], longer than this.
const MAPPED_FOR: Duration = Duration::from_secs(1);

pub struct Trimmer {
    copies: Arc<Copies>,
    writing: Arc<Writing>,
    /// The guard's pid (0: none yet): its descriptors are the daemon's own.
    guard: AtomicI32,
    /// Bytes fills may still write before the cache passes its SSD budget.
    room: AtomicI64,
    /// Bytes fills took of the room and have not written yet: not in what the keeper
    /// counts the cache holding, so not to be given out again by its next count.
    filling: AtomicI64,
    /// One trim at a time.
    trimming: Mutex<()>,
    /// What fills punched, by network file, for the keeper's counts and logs.
    trimmed: Mutex<Vec<(String, u64)>>,
    /// The copies other processes mapped, and when /proc said so.
    mapped: Mutex<Option<(Instant, HashSet<Key>)>>,
}

/// Which chunks may go.
#[derive(Clone, Copy)]
enum While {
    /// No job runs: any chunk of a copy no other process has open or mapped.
    NoJob,
    /// Jobs run: chunks not allowed to be read since this second of the daemon's clock,
    /// of copies no other process maps, for a fill of user `uid`'s read (its share).
    Jobs { read_before: u32, uid: u32 },
}

/// What each user's fills hold of the copies served: whose chunks a fill short of room
/// may punch, and whose first.
#[derive(Debug, Default)]
struct Held {
    by: HashMap<u32, u64>,
    total: u64,
}

/// The bytes a chunk counts for (its last may hold fewer: near enough for a share).
const CHUNK_BYTES: u64 = 1 << (HEAT_SHIFT + GRAIN_SHIFT);

impl Held {
    fn of(chunks: &[Chunk]) -> Self {
        let mut held = Self::default();
        for owner in chunks.iter().filter_map(|c| c.owner) {
            *held.by.entry(owner).or_default() += CHUNK_BYTES;
            held.total += CHUNK_BYTES;
        }
        held
    }

    /// An equal share of what fills hold and the `adding` bytes `uid`'s fill asks, among
    /// the users whose fills hold some and `uid`.
    fn share(&self, uid: u32, adding: u64) -> u64 {
        let users = self.by.len() + usize::from(!self.by.contains_key(&uid));
        (self.total + adding) / users as u64
    }

    /// Whether `uid`'s fills would hold more than their share with `adding` more.
    fn past_share(&self, uid: u32, adding: u64) -> bool {
        self.by.get(&uid).copied().unwrap_or(0) + adding > self.share(uid, adding)
    }

    /// When a fill of `adding` bytes for `uid`'s read may punch a chunk `owner`'s fill
    /// brought in: first (0) if `owner` is another user past their share, else after
    /// (1); never (None) another's (or the placement's) while `uid` is past their own.
    fn rank(&self, uid: u32, adding: u64, owner: Option<u32>) -> Option<u8> {
        if self.past_share(uid, adding) {
            return (owner == Some(uid)).then_some(1);
        }
        let share = self.share(uid, adding);
        match owner {
            Some(o) if o != uid && self.by.get(&o).is_some_and(|b| *b > share) => Some(0),
            _ => Some(1),
        }
    }
}

impl Trimmer {
    pub fn new(copies: Arc<Copies>, writing: Arc<Writing>) -> Self {
        Self {
            copies,
            writing,
            guard: AtomicI32::new(0),
            room: AtomicI64::new(i64::MAX),
            filling: AtomicI64::new(0),
            trimming: Mutex::new(()),
            trimmed: Mutex::default(),
            mapped: Mutex::default(),
        }
    }

    /// The guard's pid (0: none, stopped): what it has open is the daemon's own.
    pub fn set_guard(&self, pid: i32) {
        self.guard.store(pid, Ordering::Relaxed);
    }

    /// The budget has `room` bytes left (negative: past it), as the keeper counts what
    /// the cache holds now; less what fills under way took.
    pub fn set_room(&self, room: i64) {
        let filling = self.filling.load(Ordering::Acquire);
        self.room
            .store(room.saturating_sub(filling), Ordering::Release);
    }

    /// Bytes fills under way took of the room and have not written yet.
    pub fn filling(&self) -> u64 {
        self.filling.load(Ordering::Acquire).max(0) as u64
    }

    /// A fill wrote the `bytes` it took (the copy holds them now), or gave up (`wrote`
    /// false: they go back to the room).
    pub fn filled(&self, bytes: u64, wrote: bool) {
        self.filling.fetch_sub(bytes as i64, Ordering::AcqRel);
        if !wrote {
            self.give_back(bytes);
        }
    }

    /// Takes `bytes` of the room if it has them, punching nothing (the keeper's growth
    /// of a copy, which may wait); given back by [`Self::filled`].
    pub fn reserve(&self, bytes: u64) -> bool {
        let bytes = bytes as i64;
        self.filling.fetch_add(bytes, Ordering::AcqRel);
        if self.room.fetch_sub(bytes, Ordering::AcqRel) >= bytes {
            return true;
        }
        self.filling.fetch_sub(bytes, Ordering::AcqRel);
        self.room.fetch_add(bytes, Ordering::AcqRel);
        false
    }

    /// Takes `bytes` of the room for a fill of user `uid`'s read, punching cold chunks if
    /// it must (within `uid`'s share); an error if the budget has no room for them even
    /// so (the fill must not write them).
    pub fn take(&self, bytes: u64, uid: u32) -> Result<(), FillError> {
        let asked = bytes;
        let bytes = bytes as i64;
        // Counted as filling before the room is taken: a count of the keeper's between
        // the two never gives these bytes out again.
        self.filling.fetch_add(bytes, Ordering::AcqRel);
        if self.room.fetch_sub(bytes, Ordering::AcqRel) >= bytes {
            return Ok(());
        }
        let _one = self.trimming.lock().expect("not poisoned");
        let short = -self.room.load(Ordering::Acquire);
        let mut past_share = false;
        if short > 0 {
            let want = short as u64;
            let read_before = heat::now().saturating_sub(READ_AGO);
            let mode = While::Jobs { read_before, uid };
            let (trimmed, past) = self.trim_for(want, mode, asked);
            past_share = past;
            self.give_back(trimmed.iter().map(|(_, f)| f).sum());
            self.trimmed.lock().expect("not poisoned").extend(trimmed);
        }
        if self.room.load(Ordering::Acquire) >= 0 {
            return Ok(());
        }
        self.filling.fetch_sub(bytes, Ordering::AcqRel);
        self.room.fetch_add(bytes, Ordering::AcqRel);
        Err(if past_share {
            FillError::Share
        } else {
            FillError::Budget
        })
    }

    /// Punches out of `copy` (file `key`) the chunks of grains `[start, end)` filled
    /// and never allowed to be read since (a read refused for want of room: what its
    /// fill wrote goes back to the room).
    pub fn take_back(&self, copy: &PartialCopy, key: Key, start: u32, end: u32) {
        let mut freed = 0;
        for chunk in copy.only_filled(start, end) {
            let _own = OwnWrite::of(&self.writing, key);
            match copy.punch_only_filled(chunk) {
                Ok(bytes) => freed += bytes,
                Err(e) => {
                    log::warn!("partial copies: taking back {}: {e}", copy.name);
                    break;
                }
            }
        }
        if freed > 0 {
            self.give_back(freed);
            let mut trimmed = self.trimmed.lock().expect("not poisoned");
            trimmed.push((copy.name.clone(), freed));
        }
    }

    /// Gives back room: bytes punched out.
    fn give_back(&self, bytes: u64) {
        self.room.fetch_add(bytes as i64, Ordering::AcqRel);
    }

    /// What fills punched since the last call, by network file.
    pub fn take_trimmed(&self) -> Vec<(String, u64)> {
        std::mem::take(&mut *self.trimmed.lock().expect("not poisoned"))
    }

    /// Punches out of the copies served the chunks read least lately, coldest first
    /// across all of them, until `excess` bytes are freed (or none is left to punch):
    /// eviction by range. The bytes freed, by copy. Only while no job runs (a read
    /// allowed just before a punch could meet its hole): the caller's to know; and of
    /// those, copies no process but this one (and the guard) has open or mapped (a
    /// job's child may outlive it).
    pub fn coldest(&self, excess: u64) -> Vec<(String, u64)> {
        let _one = self.trimming.lock().expect("not poisoned");
        self.trim_for(excess, While::NoJob, 0).0
    }

    /// Of `keys`, those other processes map, as /proc said within [`MAPPED_FOR`].
    fn mapped(&self, keys: &HashSet<Key>, guard: Option<i32>) -> HashSet<Key> {
        let mut mapped = self.mapped.lock().expect("not poisoned");
        match &*mapped {
            Some((at, found)) if at.elapsed() < MAPPED_FOR => found.clone(),
            _ => {
                let found = open_elsewhere::mapped_by_others(keys, guard);
                *mapped = Some((Instant::now(), found.clone()));
                found
            }
        }
    }

    /// Punches chunks as `mode` allows until `excess` bytes are freed, for a fill of
    /// `adding` bytes; and whether that fill's user is past their share. Copies a daemon
    /// before made are left alone (its jobs may read them), and so are copies made whole
    /// (unmarked: a hole would read as zeros).
    fn trim_for(&self, excess: u64, mode: While, adding: u64) -> (Vec<(String, u64)>, bool) {
        if excess == 0 {
            return (Vec::new(), false);
        }
        let copies: Vec<(Key, Arc<PartialCopy>)> = {
            let copies = self.copies.lock().expect("not poisoned");
            copies
                .iter()
                .filter(|(_, c)| !c.resumed && !c.whole() && !c.dropped())
                .map(|(k, c)| (*k, c.clone()))
                .collect()
        };
        let keys: HashSet<Key> = copies.iter().map(|(k, _)| *k).collect();
        let guard = Some(self.guard.load(Ordering::Relaxed)).filter(|p| *p > 0);
        let (kept, read_before) = match mode {
            While::NoJob => (open_elsewhere::opened_by_others(&keys, guard), None),
            While::Jobs { read_before, .. } => (self.mapped(&keys, guard), Some(read_before)),
        };
        // What users' fills hold counts every copy, those kept too.
        let heat: Vec<Vec<Chunk>> = copies.iter().map(|(_, c)| c.heat()).collect();
        let held = Held::of(&heat.concat());
        let uid = match mode {
            While::NoJob => None,
            While::Jobs { uid, .. } => Some(uid),
        };
        let past_share = uid.is_some_and(|u| held.past_share(u, adding));
        let rank = |owner| uid.map_or(Some(1), |u| held.rank(u, adding, owner));
        let mut chunks: Vec<(u8, u64, usize, u32)> = copies
            .iter()
            .zip(&heat)
            .enumerate()
            .filter(|(_, ((k, _), _))| !kept.contains(k))
            .flat_map(|(i, (_, chunks))| {
                chunks
                    .iter()
                    .filter_map(|c| Some((rank(c.owner)?, c.order, i, c.chunk)))
                    .collect::<Vec<_>>()
            })
            .collect();
        chunks.sort_unstable();
        let mut freed = vec![0u64; copies.len()];
        let mut total = 0;
        for (_, _, i, chunk) in chunks {
            if total >= excess {
                break;
            }
            let (key, copy) = &copies[i];
            let punched = {
                let _own = OwnWrite::of(&self.writing, *key);
                copy.punch(chunk, read_before)
            };
            match punched {
                Ok(bytes) => {
                    freed[i] += bytes;
                    total += bytes;
                }
                Err(e) => {
                    log::warn!("partial copies: trimming {}: {e}", copy.name);
                    break;
                }
            }
        }
        let trimmed = copies
            .into_iter()
            .zip(freed)
            .filter(|(_, f)| *f > 0)
            .map(|((_, c), f)| (c.name.clone(), f))
            .collect();
        (trimmed, past_share)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_fills_under_way_took_is_not_given_out_again_by_the_next_count() {
        let trimmer = Trimmer::new(Arc::default(), Arc::default());
        trimmer.set_room(3 << 20);
        assert!(trimmer.take(3 << 20, 0).is_ok());
        assert_eq!(trimmer.filling(), 3 << 20);
        // The keeper counts before the fill wrote a byte: the room is still gone.
        trimmer.set_room(3 << 20);
        assert!(trimmer.take(1, 0).is_err(), "nothing to punch, no room");
        // Written: the keeper's next count holds them.
        trimmer.filled(3 << 20, true);
        assert_eq!(trimmer.filling(), 0);
        trimmer.set_room(0);
        assert!(trimmer.take(1, 0).is_err());
        // A fill that gave up gives its bytes back.
        trimmer.set_room(1 << 20);
        assert!(trimmer.take(1 << 20, 0).is_ok());
        trimmer.filled(1 << 20, false);
        assert!(trimmer.take(1 << 20, 0).is_ok());
        trimmer.filled(1 << 20, true);
        // A growth takes room only if it is there, punching nothing, and gives it back
        // if it is not made.
        trimmer.set_room(2 << 20);
        assert!(!trimmer.reserve(3 << 20));
        assert!(trimmer.reserve(2 << 20));
        assert!(trimmer.take(1, 0).is_err(), "the growth took it");
        trimmer.filled(2 << 20, false);
        assert!(trimmer.reserve(2 << 20));
    }

    fn chunk(owner: Option<u32>) -> Chunk {
        Chunk {
            order: 0,
            chunk: 0,
            owner,
        }
    }

    #[test]
    fn a_user_past_their_share_punches_only_their_own_and_others_punch_theirs_first() {
        const MIB: u64 = CHUNK_BYTES;
        // uid 1001's fills hold 48 MiB, 0's 8 MiB, the placement 8 MiB.
        let chunks: Vec<Chunk> = [(Some(1001), 48), (Some(0), 8), (None, 8)]
            .into_iter()
            .flat_map(|(owner, n)| (0..n).map(move |_| chunk(owner)))
            .collect();
        let held = Held::of(&chunks);
        assert_eq!(held.total, 56 * MIB);
        // Two users: 28 MiB each (and what the fill asks).
        assert!(held.past_share(1001, MIB));
        assert_eq!(held.rank(1001, MIB, Some(1001)), Some(1));
        assert_eq!(held.rank(1001, MIB, Some(0)), None);
        assert_eq!(
            held.rank(1001, MIB, None),
            None,
            "not the placement's either"
        );
        assert!(!held.past_share(0, MIB));
        assert_eq!(held.rank(0, MIB, Some(1001)), Some(0), "theirs first");
        assert_eq!(held.rank(0, MIB, Some(0)), Some(1));
        assert_eq!(held.rank(0, MIB, None), Some(1));
        // A third user's share is a third: 1001 is past it, 0 is not.
        assert!(!held.past_share(1002, 4 * MIB));
        assert_eq!(held.rank(1002, 4 * MIB, Some(1001)), Some(0));
        assert_eq!(held.rank(1002, 4 * MIB, Some(0)), Some(1));
        // Alone, a user is never past their share: the coldest of all may go.
        let alone = Held::of(&chunks[..48]);
        assert!(!alone.past_share(1001, MIB));
        assert_eq!(alone.rank(1001, MIB, None), Some(1));
    }
}
