//! Filling partial copies on demand: one thread reads the pre-content group's events
//! and answers at once those whose range the copy holds (every read of a partial copy
//! asks, so this is the path a job served by one takes); a few workers
//! (`Limits::fills`: the fills in flight) make the other ranges local and allow their
//! reads, and a copy found whole is unmarked (its reads no longer ask). A watchdog fails with EIO every access that made no
//! progress for `Limits::stall` (a server that does not answer: the job gets an error,
//! never a hang). A worker stuck on such a server keeps its place; past
//! `Limits::pending` accesses waiting, new ones fail at once rather than pile up.
//! A reader going through a file in order gets `Limits::read_ahead` more each time.

use std::{
    collections::HashMap,
    fs::File,
    io,
    mem::ManuallyDrop,
    os::fd::{AsRawFd, FromRawFd, RawFd},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use hocus_common::ranges::GRAIN_SHIFT;

use crate::{profile::extents::Extents, shared::tally::warn_limited};

use super::{
    FillError, PartialCopy,
    pre_content::{self, Asked, Group},
};

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Fills under way at once (worker threads).
    pub fills: usize,
    /// Accesses waiting (each holds a descriptor); past it, new ones fail at once.
    pub pending: usize,
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

type Copies = Mutex<HashMap<(u64, u64), Arc<PartialCopy>>>;
/// Copies being written by a fill, by device and inode, with how many fills write each:
/// the writes' own events are allowed as they come.
type Writing = Mutex<HashMap<(u64, u64), usize>>;

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
        let pending: Arc<Mutex<HashMap<u64, Arc<Pending>>>> = Arc::default();
        let writing: Arc<Writing> = Arc::default();
        let (send, receive) = mpsc::channel::<Job>();
        let receive = Arc::new(Mutex::new(receive));
        for i in 0..limits.fills.max(1) {
            let (group, counts, receive, pending, writing) = (
                group.clone(),
                counts.clone(),
                receive.clone(),
                pending.clone(),
                writing.clone(),
            );
            thread::Builder::new()
                .name(format!("hocus-fill-{i}"))
                .spawn(move || {
                    loop {
                        let next = receive.lock().expect("not poisoned").recv();
                        let Ok(job) = next else { return };
                        let fill = Fill {
                            group: &group,
                            writing: &writing,
                            counts: &counts,
                        };
                        fill.answer(&job);
                        pending
                            .lock()
                            .expect("not poisoned")
                            .retain(|_, p| !Arc::ptr_eq(p, &job.entry));
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
            .spawn(move || reader.run(&s, &send))?;
        Ok(Self {
            group,
            copies,
            retired: Mutex::default(),
            writing,
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
        let growth = Growth {
            copy: Arc::clone(copy),
            key: *key,
            writing: Arc::clone(&self.writing),
        };
        (lacks > 0).then_some((growth, lacks))
    }

    /// The copy served for the network file `name`, if any.
    pub fn copy_of(&self, name: &str) -> Option<Arc<PartialCopy>> {
        let copies = self.copies.lock().expect("not poisoned");
        copies.values().find(|c| c.name == name).cloned()
    }

    /// Punches out of the copies served the chunks read least lately, coldest first
    /// across all of them, until `excess` bytes are freed (or none is left to punch):
    /// eviction by range. The bytes freed, by copy. Only while no job runs (a read
    /// allowed just before a punch could meet its hole): the caller's to know; and of
    /// those, copies no process but this one (and `guard`) has open or mapped (a job's
    /// child may outlive it). Copies a daemon before made are left alone (its jobs may
    /// read them), and so are copies made whole (unmarked: a hole would read as zeros).
    pub fn trim_coldest(&self, excess: u64, guard: Option<i32>) -> Vec<(String, u64)> {
        if excess == 0 {
            return Vec::new();
        }
        let mut copies: Vec<((u64, u64), Arc<PartialCopy>)> = {
            let copies = self.copies.lock().expect("not poisoned");
            copies
                .iter()
                .filter(|(_, c)| !c.resumed && !c.whole() && !c.dropped())
                .map(|(k, c)| (*k, c.clone()))
                .collect()
        };
        let keys = copies.iter().map(|(k, _)| *k).collect();
        let open = super::open_elsewhere::opened_by_others(&keys, guard);
        copies.retain(|(k, _)| !open.contains(k));
        let mut chunks: Vec<(u64, usize, u32)> = copies
            .iter()
            .enumerate()
            .flat_map(|(i, (_, c))| c.heat().into_iter().map(move |(h, chunk)| (h, i, chunk)))
            .collect();
        chunks.sort_unstable();
        let mut freed = vec![0u64; copies.len()];
        let mut total = 0;
        for (_, i, chunk) in chunks {
            if total >= excess {
                break;
            }
            let (key, copy) = &copies[i];
            let punched = {
                let _own = OwnWrite::of(&self.writing, *key);
                copy.punch(chunk)
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
        copies
            .into_iter()
            .zip(freed)
            .filter(|(_, f)| *f > 0)
            .map(|((_, c), f)| (c.name.clone(), f))
            .collect()
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

/// The device and inode of `file`: how an event's descriptor is matched to its copy.
fn key_of(file: &impl AsRawFd) -> io::Result<(u64, u64)> {
    // SAFETY: the descriptor stays open: the File made here is never dropped.
    let file = ManuallyDrop::new(unsafe { File::from_raw_fd(file.as_raw_fd()) });
    let m = file.metadata()?;
    Ok((
        std::os::unix::fs::MetadataExt::dev(&m),
        std::os::unix::fs::MetadataExt::ino(&m),
    ))
}

/// An access the reader could not answer at once: the copy lacks grains of it.
struct Job {
    entry: Arc<Pending>,
    asked: Asked,
    copy: Arc<PartialCopy>,
    /// The copy's device and inode.
    key: (u64, u64),
    /// The grains to make local: those asked for, and the read-ahead.
    grains: (u32, u32),
}

/// What the thread reading the group's events shares with the others.
struct Reader {
    group: Arc<Group>,
    copies: Arc<Copies>,
    counts: Arc<Counts>,
    pending: Arc<Mutex<HashMap<u64, Arc<Pending>>>>,
    writing: Arc<Writing>,
    limits: Limits,
}

impl Reader {
    /// Reads the group's events until stopped: answers those it can at once, puts the
    /// rest in `pending` and on the workers' queue.
    fn run(&self, stop: &AtomicBool, send: &mpsc::Sender<Job>) {
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
                let Some(job) = self.answer_now_or(a) else {
                    continue;
                };
                next_id += 1;
                self.pending
                    .lock()
                    .expect("not poisoned")
                    .insert(next_id, job.entry.clone());
                if send.send(job).is_err() {
                    return;
                }
            }
        }
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
        copy.read(start, end);
        if copy.holds(start, end) {
            self.counts.allowed.fetch_add(1, Ordering::Relaxed);
            let _ = self.group.answer(&a, true);
            return None;
        }
        if self.pending.lock().expect("not poisoned").len() >= self.limits.pending {
            self.counts.failed.fetch_add(1, Ordering::Relaxed);
            let _ = self.group.answer(&a, false);
            return None;
        }
        Some(Job {
            entry: Arc::new(Pending {
                event_fd: a.file.as_raw_fd(),
                answered: AtomicBool::new(false),
                progress: Mutex::new(Instant::now()),
            }),
            asked: a,
            copy,
            key,
            grains: (start, ahead),
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

/// Fails with EIO every access whose fill made no progress for `stall`.
fn watch(
    group: &Group,
    stop: &AtomicBool,
    counts: &Counts,
    pending: &Mutex<HashMap<u64, Arc<Pending>>>,
    stall: Duration,
) {
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
    counts: &'a Counts,
}

impl Fill<'_> {
    /// Makes the grains `job` names local and answers its access (unless the watchdog
    /// did); a copy then whole is unmarked: its reads need no answer any more.
    fn answer(&self, job: &Job) {
        if job.entry.answered.load(Ordering::Acquire) {
            return; // failed already: too slow
        }
        let result = self.fill(job);
        if job.entry.answered.swap(true, Ordering::AcqRel) {
            return;
        }
        match result {
            Ok(()) => {
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
                failed(self.counts, Some((&job.copy, e)));
                let _ = self.group.answer(&job.asked, false);
            }
        }
    }

    /// Fills the grains `job` names, the copy's writes let through while it does.
    fn fill(&self, job: &Job) -> Result<(), FillError> {
        let (copy, key) = (&job.copy, job.key);
        let missing = copy.missing(job.grains.0, job.grains.1);
        if missing.is_empty() {
            return Ok(());
        }
        let _own = OwnWrite::of(self.writing, key);
        let mut filled = Ok(());
        for (s, e) in missing {
            filled = copy.fill_with(s, e, || {
                *job.entry.progress.lock().expect("not poisoned") = Instant::now();
            });
            if filled.is_err() {
                break;
            }
            let bytes = (u64::from(e - s) << GRAIN_SHIFT).min(copy.size());
            self.counts.bytes_filled.fetch_add(bytes, Ordering::Relaxed);
        }
        filled
    }
}

/// A served copy's missing grains, to be filled from the network (`Filler::growth`).
pub struct Growth {
    copy: Arc<PartialCopy>,
    key: (u64, u64),
    writing: Arc<Writing>,
}

impl Growth {
    /// Makes the grains of `ranges` local that the copy lacks, its writes let through.
    pub fn fill(&self, ranges: &Extents) -> Result<(), FillError> {
        let _own = OwnWrite::of(&self.writing, self.key);
        self.copy.fill_all(ranges)
    }
}

/// A write of this process to copy `key` under way (a fill, a punch): the events it
/// raises are let through until it is dropped.
struct OwnWrite<'a> {
    writing: &'a Writing,
    key: (u64, u64),
}

impl<'a> OwnWrite<'a> {
    fn of(writing: &'a Writing, key: (u64, u64)) -> Self {
        *writing
            .lock()
            .expect("not poisoned")
            .entry(key)
            .or_default() += 1;
        Self { writing, key }
    }
}

impl Drop for OwnWrite<'_> {
    fn drop(&mut self) {
        let mut writing = self.writing.lock().expect("not poisoned");
        if let Some(n) = writing.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                writing.remove(&self.key);
            }
        }
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
