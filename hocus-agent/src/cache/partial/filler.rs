//! Filling partial copies on demand: one thread reads the pre-content group's events
//! and answers at once those whose range the copy holds (every read of a partial copy
//! asks, so this is the path a job served by one takes); a few workers
//! (`Limits::fills`: the fills in flight) make the other ranges local and allow their
//! reads, and a copy found whole is unmarked (its reads no longer ask). What waits is
//! shared fairly among the node's users (`shares`): `Limits::per_user` accesses each,
//! `Limits::pending` in all, past which that user's fail at once; workers serve users
//! in turn, 4 MiB at a time. A watchdog fails with EIO every access that made no
//! progress for `Limits::stall` (a server that does not answer: the job gets an error,
//! never a hang). A worker stuck on such a server keeps its place.
//! A reader going through a file in order gets `Limits::read_ahead` more each time.

use std::{
    collections::HashMap,
    fs::File,
    io,
    os::fd::{AsRawFd, RawFd},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use hocus_common::ranges::GRAIN_SHIFT;

use crate::{
    profile::extents::Extents,
    shared::{procs::real_uid, tally::warn_limited},
};

use super::{
    CHECKED_GRAINS, FillError, PartialCopy,
    pre_content::{self, Asked, Group},
    served::{Copies, OwnWrite, Writing, key_of},
    shares::{Admission, Shares},
    trim::Trimmer,
};

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Fills under way at once (worker threads).
    pub fills: usize,
    /// Accesses waiting (each holds a descriptor and a thread blocked in the kernel);
    /// past it, new ones fail at once, or take the place of the heaviest user's newest.
    pub pending: usize,
    /// Accesses one user may have waiting; past it, that user's new ones fail at once.
    pub per_user: usize,
    /// An access whose fill made no progress this long fails with EIO.
    pub stall: Duration,
    /// Grains filled beyond what a reader going through a file in order asked for.
    pub read_ahead: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            fills: 4,
            pending: 1024,
            // A job of a user rarely has more reads of holes at once than a data
            // loader's threads; a flood past it fails their reads, not the others'.
            per_user: 256,
            stall: Duration::from_secs(30),
            // 4 MiB.
            read_ahead: 64,
        }
    }
}

/// What the filler did, for metrics.
#[derive(Debug, Default)]
pub struct Counts {
    pub allowed: AtomicU64,
    pub bytes_filled: AtomicU64,
    /// Failed with EIO: the network file changed, could not be read, or was too slow.
    pub failed: AtomicU64,
    pub stalled: AtomicU64,
}

/// An access read from the group and not answered yet.
struct Pending {
    event_fd: RawFd,
    answered: AtomicBool,
    progress: Mutex<Instant>,
}

/// The accesses waiting, for the watchdog, by a number of their own.
type Waiting = Mutex<HashMap<u64, Arc<Pending>>>;

pub struct Filler {
    group: Arc<Group>,
    copies: Arc<Copies>,
    /// Copies the cache no longer holds, still marked: a job may have one open, and
    /// unmarked its holes would read as zeros. Their reads of what they lack fail with
    /// EIO; they are unmarked (and their network files closed) once no job runs.
    retired: Mutex<Vec<Arc<PartialCopy>>>,
    /// Copies this process writes (fills, and punches when trimming): their own events
    /// are let through.
    writing: Arc<Writing>,
    trimmer: Arc<Trimmer>,
    pub counts: Arc<Counts>,
    stop: Arc<AtomicBool>,
    /// The reader and the watchdog, joined at a drop; the workers end once the reader's
    /// queue is gone and they are done (one stuck on a server is left).
    stoppable: Vec<thread::JoinHandle<()>>,
}

impl Filler {
    /// Starts answering `group`'s events.
    pub fn start(group: Group, limits: Limits) -> io::Result<Self> {
        let group = Arc::new(group);
        let copies: Arc<Copies> = Arc::default();
        let counts: Arc<Counts> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let pending: Arc<Waiting> = Arc::default();
        let writing: Arc<Writing> = Arc::default();
        let shares = Arc::new(Shares::new(limits.pending, limits.per_user));
        let trimmer = Arc::new(Trimmer::new(copies.clone(), writing.clone()));
        for i in 0..limits.fills.max(1) {
            let (group, counts, shares, pending, writing, trimmer) = (
                group.clone(),
                counts.clone(),
                shares.clone(),
                pending.clone(),
                writing.clone(),
                trimmer.clone(),
            );
            thread::Builder::new()
                .name(format!("hocus-fill-{i}"))
                .spawn(move || {
                    let fill = Fill {
                        group: &group,
                        writing: &writing,
                        trimmer: &trimmer,
                        counts: &counts,
                    };
                    while let Some((uid, job)) = shares.next() {
                        if fill.answer(&job) {
                            forget(&pending, job.id);
                            shares.done(uid);
                        } else {
                            shares.again(uid, job);
                        }
                    }
                })?;
        }
        let (g, s, c, p) = (group.clone(), stop.clone(), counts.clone(), pending.clone());
        let watchdog = thread::Builder::new()
            .name("hocus-fill-watch".into())
            .spawn(move || watch(&g, &s, &c, &p, limits.stall))?;
        let reader = Reader {
            group: group.clone(),
            copies: copies.clone(),
            counts: counts.clone(),
            pending,
            writing: writing.clone(),
            limits,
        };
        let s = stop.clone();
        let reader = thread::Builder::new()
            .name("hocus-fill-read".into())
            .spawn(move || reader.run(&s, &shares))?;
        Ok(Self {
            group,
            copies,
            retired: Mutex::default(),
            writing,
            trimmer,
            counts,
            stop,
            stoppable: vec![watchdog, reader],
        })
    }

    /// The group's descriptor (for the guard).
    pub fn group_fd(&self) -> RawFd {
        self.group.fd()
    }

    /// Serves `copy` from `file` (the sparse local file): its reads wait for the filler
    /// from now on. Another copy of the same network file served before is retired:
    /// this one took its place in the cache.
    pub fn serve(&self, copy: Arc<PartialCopy>, file: &File) -> io::Result<()> {
        let key = key_of(file)?;
        self.retire_but(&copy.name, Some(key));
        self.copies.lock().expect("not poisoned").insert(key, copy);
        if let Err(e) = self.group.mark(file) {
            self.copies.lock().expect("not poisoned").remove(&key);
            return Err(e);
        }
        Ok(())
    }

    /// The copies served, by the network file they stand for, with the bytes each holds.
    pub fn held(&self) -> Vec<(String, u64)> {
        let copies = self.copies.lock().expect("not poisoned");
        copies
            .values()
            .map(|c| (c.name.clone(), c.held()))
            .collect()
    }

    /// What the copy served for `name` lacks of `ranges`, in bytes, and how to fill it
    /// (a copy worker's, not the filler's own workers: no access waits on it); None if
    /// it lacks nothing. A copy made while its first job still read has the ranges known
    /// then: the rest comes to it before the next job reads it.
    pub fn growth(&self, name: &str, ranges: &Extents) -> Option<(Growth, u64)> {
        let copies = self.copies.lock().expect("not poisoned");
        let (key, copy) = copies.iter().find(|(_, c)| c.name == name)?;
        let lacks: u64 = ranges
            .iter()
            .flat_map(|&(start, end)| copy.missing(start, end))
            .map(|(s, e)| (u64::from(e - s) << GRAIN_SHIFT).min(copy.size()))
            .sum();
        // Taken of the room at once, as a fill's bytes are: the cache's count lags a
        // fill just made by up to a second, and a growth in between took room twice.
        if lacks == 0 || !self.trimmer.reserve(lacks) {
            return None;
        }
        let growth = Growth {
            copy: Arc::clone(copy),
            key: *key,
            writing: Arc::clone(&self.writing),
            room: Reserved {
                trimmer: Arc::clone(&self.trimmer),
                bytes: lacks,
                wrote: false,
            },
        };
        Some((growth, lacks))
    }

    /// The copy served for the network file `name`, if any.
    pub fn copy_of(&self, name: &str) -> Option<Arc<PartialCopy>> {
        let copies = self.copies.lock().expect("not poisoned");
        copies.values().find(|c| c.name == name).cloned()
    }

    /// Punches out of the copies served the chunks read least lately (see
    /// [`Trimmer::coldest`]), until `excess` bytes are freed: only while no job runs.
    pub fn trim_coldest(&self, excess: u64) -> Vec<(String, u64)> {
        self.trimmer.coldest(excess)
    }

    /// The SSD budget has `room` bytes left for fills (negative: it is past it).
    pub fn set_room(&self, room: i64) {
        self.trimmer.set_room(room);
    }

    /// Bytes fills under way took of the SSD budget's room and have not written yet.
    pub fn filling(&self) -> u64 {
        self.trimmer.filling()
    }

    /// What fills punched to make room since the last call, by network file.
    pub fn trimmed_by_fills(&self) -> Vec<(String, u64)> {
        self.trimmer.take_trimmed()
    }

    /// The guard's pid: what it has open is the daemon's own.
    pub fn set_guard(&self, pid: i32) {
        self.trimmer.set_guard(pid);
    }

    /// Stops serving the copies of the network file `name` (the cache dropped them):
    /// reads of what they lack fail with EIO from now on; unmarked once no job runs
    /// ([`Filler::release_retired`]).
    pub fn retire(&self, name: &str) {
        self.retire_but(name, None);
    }

    /// Retires the copies of `name` but the one of file `kept`.
    fn retire_but(&self, name: &str, kept: Option<(u64, u64)>) {
        let mut copies = self.copies.lock().expect("not poisoned");
        let keys: Vec<(u64, u64)> = copies
            .iter()
            .filter(|(k, c)| c.name == name && Some(**k) != kept)
            .map(|(k, _)| *k)
            .collect();
        let mut retired = self.retired.lock().expect("not poisoned");
        retired.extend(keys.iter().filter_map(|k| copies.remove(k)));
    }

    /// Unmarks the retired copies and lets them go, at a time no job of this daemon
    /// runs; but not those a daemon before made (jobs it started may still hold them,
    /// unknown to this one): they stay marked, failing what they lack, while the group
    /// lives.
    pub fn release_retired(&self) {
        self.retired.lock().expect("not poisoned").retain(|copy| {
            if copy.resumed {
                return true;
            }
            if let Err(e) = self.group.unmark(copy.local()) {
                log::debug!("partial copies: unmarking {}: {e}", copy.name);
            }
            false
        });
    }
}

impl Drop for Filler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // They notice within their poll.
        for t in std::mem::take(&mut self.stoppable) {
            let _ = t.join();
        }
    }
}

/// An access the reader could not answer at once: the copy lacks grains of it.
struct Job {
    /// Its number in what the watchdog watches.
    id: u64,
    /// The real uid of the process whose access it is: its fills count against them.
    uid: u32,
    entry: Arc<Pending>,
    asked: Asked,
    copy: Arc<PartialCopy>,
    /// The copy's device and inode.
    key: (u64, u64),
    /// The grains to make local: those asked for, and the read-ahead.
    grains: (u32, u32),
    /// Where the grains asked for end.
    end: u32,
}

/// What the thread reading the group's events shares with the others.
struct Reader {
    group: Arc<Group>,
    copies: Arc<Copies>,
    counts: Arc<Counts>,
    pending: Arc<Waiting>,
    writing: Arc<Writing>,
    limits: Limits,
}

impl Reader {
    /// Reads the group's events until stopped: answers those it can at once, puts the
    /// rest in `pending` and in their users' shares of the workers' queue.
    fn run(&self, stop: &AtomicBool, shares: &Shares<Job>) {
        self.read_until(stop, shares);
        shares.close();
    }

    fn read_until(&self, stop: &AtomicBool, shares: &Shares<Job>) {
        let mut buf = vec![0u8; 4096];
        let mut next_id = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let mut poll = libc::pollfd {
                fd: self.group.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd.
            if unsafe { libc::poll(&raw mut poll, 1, 250) } <= 0 {
                continue;
            }
            let asked = match self.group.wait(&mut buf) {
                Ok(asked) => asked,
                Err(e) => {
                    log::warn!("partial copies: reading the pre-content group: {e}");
                    thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            for a in asked {
                let Some(mut job) = self.answer_now_or(a) else {
                    continue;
                };
                // The access's process waits for this answer: its pid is its own.
                let Some(uid) = real_uid(job.asked.pid) else {
                    self.fail(&job.asked, None);
                    continue;
                };
                next_id += 1;
                job.id = next_id;
                job.uid = uid;
                self.pending
                    .lock()
                    .expect("not poisoned")
                    .insert(next_id, job.entry.clone());
                match shares.admit(uid, job) {
                    Admission::Queued => {}
                    Admission::Refused(job) => {
                        forget(&self.pending, job.id);
                        self.refuse(&job, uid);
                    }
                    Admission::Displaced(theirs, other) => {
                        forget(&self.pending, other.id);
                        if !other.entry.answered.swap(true, Ordering::AcqRel) {
                            self.refuse(&other, theirs);
                        }
                    }
                }
            }
        }
    }

    /// Fails `job`'s access: its user has their share of what waits.
    fn refuse(&self, job: &Job, uid: u32) {
        self.counts.failed.fetch_add(1, Ordering::Relaxed);
        warn_limited!(
            "partial copies' reads refused",
            "uid {uid} has {} reads of what partial copies lack waiting (or all {} places are taken): more fail with EIO",
            self.limits.per_user,
            self.limits.pending
        );
        let _ = self.group.answer(&job.asked, false);
    }

    /// Answers `a` if it needs no fill (the copy holds its range, or it cannot be
    /// served); else the job for a worker.
    fn answer_now_or(&self, a: Asked) -> Option<Job> {
        let key = key_of(&a.file).ok();
        // A fill's own write to the copy: let through, or the fill waits on itself.
        let own = a.pid == std::process::id() as i32
            && key.is_some_and(|k| self.writing.lock().expect("not poisoned").contains_key(&k));
        if own {
            let _ = self.group.answer(&a, true);
            return None;
        }
        let copy = key.and_then(|k| self.copies.lock().expect("not poisoned").get(&k).cloned());
        let (copy, key) = match (copy, key) {
            // A marked file the filler does not know (made before a restart, or
            // forgotten while a read waited): nothing says what its holes hold.
            (None, _) | (_, None) => return self.fail(&a, None),
            // Found changed by an earlier fill: the network file is another version now.
            (Some(copy), _) if copy.dropped() => {
                return self.fail(&a, Some((&copy, FillError::Changed)));
            }
            (Some(copy), Some(key)) => (copy, key),
        };
        let (start, end, ahead) = grains(&a, &copy, self.limits.read_ahead);
        // The daemon's own pins map what a copy holds: no job's read, no heat.
        let pinned = a.pid == std::process::id() as i32 && copy.holds(start, end);
        if pinned || copy.allows(start, end) {
            self.counts.allowed.fetch_add(1, Ordering::Relaxed);
            let _ = self.group.answer(&a, true);
            return None;
        }
        Some(Job {
            id: 0,
            uid: 0,
            entry: Arc::new(Pending {
                event_fd: a.file.as_raw_fd(),
                answered: AtomicBool::new(false),
                progress: Mutex::new(Instant::now()),
            }),
            asked: a,
            copy,
            key,
            grains: (start, ahead),
            end,
        })
    }

    fn fail(&self, a: &Asked, why: Option<(&PartialCopy, FillError)>) -> Option<Job> {
        failed(&self.counts, why);
        let _ = self.group.answer(a, false);
        None
    }
}

/// Counts a read failed with EIO and says why (rate-limited).
fn failed(counts: &Counts, why: Option<(&PartialCopy, FillError)>) {
    counts.failed.fetch_add(1, Ordering::Relaxed);
    const KIND: &str = "partial copies' reads failed";
    match why {
        Some((copy, e @ FillError::Changed)) => warn_limited!(
            KIND,
            "{}: {e}: reads of what its copy lacks fail with EIO until it is copied again",
            copy.name
        ),
        Some((copy, e)) => warn_limited!(KIND, "{}: {e}: the read fails with EIO", copy.name),
        None => warn_limited!(
            KIND,
            "a read of a partial copy no longer served (made before a restart) fails with EIO"
        ),
    }
}

/// Takes access `id` out of what the watchdog watches.
fn forget(pending: &Waiting, id: u64) {
    pending.lock().expect("not poisoned").remove(&id);
}

/// Fails with EIO every access whose fill made no progress for `stall`.
fn watch(group: &Group, stop: &AtomicBool, counts: &Counts, pending: &Waiting, stall: Duration) {
    while !stop.load(Ordering::Relaxed) {
        thread::sleep(Duration::from_millis(100));
        let now = Instant::now();
        for p in pending.lock().expect("not poisoned").values() {
            let since = now.duration_since(*p.progress.lock().expect("not poisoned"));
            if since >= stall && !p.answered.swap(true, Ordering::AcqRel) {
                counts.stalled.fetch_add(1, Ordering::Relaxed);
                counts.failed.fetch_add(1, Ordering::Relaxed);
                let _ = pre_content::answer(group.fd(), p.event_fd, false);
            }
        }
    }
}

/// What a worker fills with.
struct Fill<'a> {
    group: &'a Group,
    writing: &'a Writing,
    trimmer: &'a Trimmer,
    counts: &'a Counts,
}

impl Fill<'_> {
    /// Makes the next piece of the grains `job` names local; once it holds them all,
    /// answers its access (unless the watchdog did) and says it is done. A copy then
    /// whole is unmarked: its reads need no answer any more.
    fn answer(&self, job: &Job) -> bool {
        if job.entry.answered.load(Ordering::Acquire) {
            return true; // failed already: too slow, or another user's turn
        }
        let result = self.fill_piece(job);
        if matches!(result, Ok(false)) {
            return false;
        }
        if job.entry.answered.swap(true, Ordering::AcqRel) {
            return true;
        }
        match result {
            Ok(_) => {
                self.counts.allowed.fetch_add(1, Ordering::Relaxed);
                let _ = self.group.answer(&job.asked, true);
                if job.copy.whole()
                    && let Err(e) = self.group.unmark(&job.asked.file)
                {
                    log::debug!(
                        "partial copies: unmarking {}, now whole: {e}",
                        job.copy.name
                    );
                }
            }
            Err(e) => {
                if matches!(e, FillError::Budget | FillError::Share) {
                    // What this read's fill wrote was never read: room for others.
                    let (start, ahead) = job.grains;
                    self.trimmer.take_back(&job.copy, job.key, start, ahead);
                }
                failed(self.counts, Some((&job.copy, e)));
                let _ = self.group.answer(&job.asked, false);
            }
        }
        true
    }

    /// Fills the first piece (at most [`CHECKED_GRAINS`]) of what the copy lacks of the
    /// grains `job` names, the copy's writes let through while it does, its bytes taken
    /// of the SSD budget's room first: whether it now holds them all, and the read may
    /// be allowed. A piece at a time, so a fill of a huge mapping takes turns.
    fn fill_piece(&self, job: &Job) -> Result<bool, FillError> {
        let (copy, (start, ahead)) = (&job.copy, job.grains);
        let Some(&(s, e)) = copy.missing(start, ahead).first() else {
            // Held (a punch between this and the allow makes it ask again).
            return Ok(copy.allows(start, job.end));
        };
        let e = e.min(s.saturating_add(CHECKED_GRAINS));
        let bytes = (u64::from(e - s) << GRAIN_SHIFT).min(copy.size());
        self.trimmer.take(bytes, job.uid)?;
        let _own = OwnWrite::of(self.writing, job.key);
        let filled = copy.fill_with(s, e, || {
            *job.entry.progress.lock().expect("not poisoned") = Instant::now();
        });
        self.trimmer.filled(bytes, filled.is_ok());
        filled?;
        copy.filled_now(s, e, job.uid);
        self.counts.bytes_filled.fetch_add(bytes, Ordering::Relaxed);
        Ok(false)
    }
}

/// A served copy's missing grains, to be filled from the network (`Filler::growth`),
/// their bytes taken of the SSD budget's room.
pub struct Growth {
    copy: Arc<PartialCopy>,
    key: (u64, u64),
    writing: Arc<Writing>,
    room: Reserved,
}

impl Growth {
    /// Makes the grains of `ranges` local that the copy lacks, its writes let through.
    pub fn fill(mut self, ranges: &Extents) -> Result<(), FillError> {
        let _own = OwnWrite::of(&self.writing, self.key);
        let filled = self.copy.fill_all(ranges);
        self.room.wrote = filled.is_ok();
        filled
    }
}

/// Room a growth took: held by the copy once written, else given back (a growth not
/// made, or failed).
struct Reserved {
    trimmer: Arc<Trimmer>,
    bytes: u64,
    wrote: bool,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.trimmer.filled(self.bytes, self.wrote);
    }
}

/// The grains an access asks for, within the file (`start`, `end`), and where a fill
/// for it ends (`ahead`): with read-ahead when it starts where the file's last one
/// ended (a reader going through it in order).
fn grains(asked: &Asked, copy: &PartialCopy, read_ahead: u32) -> (u32, u32, u32) {
    let last = copy.grains();
    let start = (asked.offset >> GRAIN_SHIFT).min(u64::from(last)) as u32;
    let end_byte = asked.offset.saturating_add(asked.count);
    let end = end_byte.div_ceil(1 << GRAIN_SHIFT).min(u64::from(last)) as u32;
    let ahead = if copy.follows(start, end) {
        end.saturating_add(read_ahead).min(last)
    } else {
        end
    };
    (start, end, ahead)
}
