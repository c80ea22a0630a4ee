//! Turns what the kernel reports into working-set updates: joins where the kernel placed
//! each event (a root, the path from it, the process's own path) into the path the
//! agent sees, checks it against the watched trees again (`..` in a process's path can
//! leave a tree), follows open files from open to close, and counts what it could not
//! place.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    path::Path,
};

use hocus_common::{
    Event, FdKey, InodeKey, Mapped, NamespaceKey, OpenFile, kind,
    ranges::{RangeRead, unpack},
};
use hocus_control::status::Tally;

use self::changes::{Awaiting, Change};
use crate::{
    observe::{
        held,
        places::{Places, Unplaced},
        views::Views,
    },
    profile::working_set::WorkingSet,
    shared::log_line::{self as logs, Process},
};

const O_ACCMODE: u32 = 0o3;
const O_CREAT: u32 = 0o100;
const O_EXCL: u32 = 0o200;
const O_TRUNC: u32 = 0o1000;
const O_DIRECTORY: u32 = 0o200000;
const O_PATH: u32 = 0o10000000;

struct OpenInfo {
    path: String,
    is_dir: bool,
    written: bool,
    /// Opened through a local copy: its reads are hits, not the network's.
    served: bool,
    job: u32,
    process: Process,
    /// The run of grains last added: a sweep reads the run under way again and again.
    last_run: u64,
}

/// A watched file mapped by a process: who mapped it first (its pages are counted as
/// that job's reads), and the pages already added to the working set.
struct MappedInfo {
    path: String,
    served: bool,
    job: u32,
    process: Process,
    counted: u64,
    /// As [`OpenInfo::last_run`].
    last_run: u64,
}

/// A job (or any process) opened, missed or read a watched file: the keeper decides
/// whether a local copy served it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    pub path: String,
    /// The job of the process (`hocus-agent run`'s, or an attached Slurm task's), or 0.
    pub job: u32,
    pub process: Process,
    pub what: What,
    /// Who opened it and when (unix ns): for opens and failed lookups; 0 for reads.
    pub uid: u32,
    pub at_ns: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum What {
    Open,
    /// A failed lookup (ENOENT).
    Missing,
    /// Bytes read through an open descriptor.
    Read(u64),
    /// Grains `[start, end)` of a file read (a run): for a job's own profile, which
    /// keeps its ranges as the node's does; never counted as served.
    Grains(u32, u32),
}

/// LOOKUPs awaiting their answer, at most: answers come within a round trip, and one
/// that never comes (the server gone) is forgotten with the oldest.
const MAX_ASKED: usize = 4096;

pub struct Observer {
    /// Where the kernel's roots are, and the watched trees.
    pub places: Places,
    /// How other mount namespaces see the watched trees.
    pub views: Views,
    /// Namespaces whose view the kernel asked for since last drained: (a process in it,
    /// the namespace, its inode number).
    pub to_learn: Vec<(u32, NamespaceKey, u32)>,
    clock_offset_ns: i128,
    open: HashMap<u64, OpenInfo>,
    /// Bytes of each open file already added to the working set.
    bytes_counted: HashMap<u64, u64>,
    /// Open files the kernel did not have at the last sweep.
    missing_from_kernel: HashSet<u64>,
    /// LOOKUPs the request programs saw sent, by the mount's device and the request's
    /// number, oldest first: each a failed lookup if its answer says the name is missing.
    asked: HashMap<(u32, u64), Access>,
    asked_order: VecDeque<(u32, u64)>,
    /// NFS changes reported before the server answered: each counts once accepted.
    awaiting: Awaiting,
    /// Mapped files, by the open file that first mapped them.
    mapped: HashMap<u64, MappedInfo>,
    /// Mapped inodes the kernel had at the last sweep whose file was not known.
    unknown_mapped: HashSet<InodeKey>,
    page_size: u64,
    /// Files whose size and mtime should be (re)read.
    pub to_stat: HashSet<String>,
    /// Opens, failed lookups and reads since last drained.
    pub accesses: Vec<Access>,
    /// Files seen written, truncated, renamed or unlinked since last drained.
    pub changed: Vec<String>,
    /// Files a job tried to write through a read-only copy since last drained.
    pub refused: Vec<String>,
    pub tally: Tally,
    /// Events that reached the network or changed a tree (opens, failed lookups and
    /// reads not served by a local copy, writes): while it grows, there is something to
    /// learn, and the tracer does not rest.
    pub learned: u64,
}

impl Observer {
    pub fn new(places: Places, views: Views) -> Self {
        Self {
            places,
            views,
            to_learn: Vec::new(),
            clock_offset_ns: monotonic_to_unix_offset(),
            open: HashMap::new(),
            bytes_counted: HashMap::new(),
            missing_from_kernel: HashSet::new(),
            asked: HashMap::new(),
            asked_order: VecDeque::new(),
            awaiting: Awaiting::default(),
            mapped: HashMap::new(),
            unknown_mapped: HashSet::new(),
            // SAFETY: no arguments.
            page_size: u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096),
            to_stat: HashSet::new(),
            accesses: Vec::new(),
            changed: Vec::new(),
            refused: Vec::new(),
            tally: Tally::default(),
            learned: 0,
        }
    }

    pub fn unix_ns(&self, monotonic_ns: u64) -> u64 {
        (i128::from(monotonic_ns) + self.clock_offset_ns).max(0) as u64
    }

    pub fn handle(&mut self, e: &Event, ws: &mut WorkingSet) {
        self.tally.events += 1;
        let at = self.unix_ns(e.time_ns);
        match e.kind {
            kind::LEARN_VIEW => {
                if !self.to_learn.iter().any(|(_, k, _)| *k == e.namespace) {
                    self.to_learn.push((e.tgid, e.namespace, e.ns_inum));
                }
                return;
            }
            kind::CLOSE => {
                self.tally.closes += 1;
                if let Some(info) = self.open.remove(&e.file_id) {
                    let counted = self.bytes_counted.remove(&e.file_id).unwrap_or(0);
                    if !info.is_dir {
                        let bytes = e.bytes.saturating_sub(counted);
                        ws.add_bytes_read(&info.path, bytes);
                        if bytes > 0 && !info.served {
                            self.learned += 1;
                        }
                        if bytes > 0 {
                            self.accesses
                                .push(read(&info.path, info.job, &info.process, bytes));
                        }
                        if info.written {
                            // Stable only from the last write on: count from the close.
                            self.changed.push(info.path.clone());
                            self.to_stat.insert(info.path);
                        }
                    }
                }
                return;
            }
            kind::MAPPED => {
                if let Some(info) = self.open.get(&e.file_id).filter(|i| !i.is_dir) {
                    ws.mark_mapped(&info.path);
                    self.mapped.insert(
                        e.file_id,
                        MappedInfo {
                            path: info.path.clone(),
                            served: info.served,
                            job: info.job,
                            process: info.process.clone(),
                            counted: 0,
                            last_run: 0,
                        },
                    );
                }
                return;
            }
            kind::CHANGE_ANSWERED => {
                self.answered(e.file_id, e.bytes as i64, ws);
                return;
            }
            // Through a descriptor (a change by a name has a root and a path).
            kind::WRITE | kind::TRUNCATE if e.path_len == 0 && e.base_len == 0 => {
                self.tally.mutations += 1;
                self.learned += 1;
                if let Some(info) = self.open.get_mut(&e.file_id) {
                    if !info.written && logs::writes() {
                        let what = if e.kind == kind::WRITE {
                            "written"
                        } else {
                            "truncated"
                        };
                        logs::file_line("write", &info.path, Some(&process(e)), what);
                    }
                    info.written = true;
                    ws.mark_written(&info.path, at);
                    self.changed.push(info.path.clone());
                }
                return;
            }
            kind::LOOKUP_FAILED => {
                if let Some(missing) = self.asked.remove(&(e.bytes as u32, e.file_id)) {
                    self.learned += 1;
                    self.missing(missing, ws);
                }
                return;
            }
            _ => {}
        }
        let Some(path) = self.resolve(e) else {
            return;
        };
        if e.kind == kind::LOOKUP_ASKED {
            return self.ask(e, path, at);
        }
        // A refused write was aimed at a local copy: that is news too.
        if !self.places.is_served(e.root) || e.kind == kind::REFUSED_WRITE {
            self.learned += 1;
        }
        let uid = e.uid;
        match e.kind {
            kind::OPEN => {
                self.tally.opens += 1;
                // An O_PATH descriptor reads nothing (containers take one of each bound
                // directory): it is followed like a directory's, not profiled as a file.
                let is_dir = e.open_flags & (O_DIRECTORY | O_PATH) != 0;
                let writes = e.open_flags & O_ACCMODE != 0;
                let truncates = writes && e.open_flags & O_TRUNC != 0;
                let creates = e.open_flags & (O_CREAT | O_EXCL) == O_CREAT | O_EXCL;
                let who = process(e);
                log::debug!(
                    "open {path} by {who} uid {uid} for {}",
                    if writes { "writing" } else { "reading" }
                );
                if e.open_flags & O_DIRECTORY != 0 {
                    ws.dir_opened(&path);
                } else if !is_dir && ws.open(&path, uid, at) {
                    self.to_stat.insert(path.clone());
                }
                if !is_dir && (writes || e.open_flags & (O_CREAT | O_TRUNC) != 0) {
                    // In flux while someone may write it: its copy goes, and it waits
                    // out a quiet period like a written file (or for good, when this
                    // happens again and again).
                    ws.opened_for_writing(&path, at);
                    self.changed.push(path.clone());
                }
                if truncates || creates {
                    ws.mark_written(&path, at);
                    self.changed.push(path.clone());
                    if logs::writes() {
                        let what = match (creates, e.open_flags & O_CREAT != 0) {
                            (true, _) => "created",
                            (false, true) => "created or truncated",
                            (false, false) => "truncated",
                        };
                        logs::file_line("write", &path, Some(&who), what);
                    }
                }
                if !is_dir {
                    self.accesses.push(Access {
                        path: path.clone(),
                        job: e.job,
                        process: who.clone(),
                        what: What::Open,
                        uid,
                        at_ns: at,
                    });
                }
                if creates {
                    ws.dir_mutated(parent(&path));
                }
                self.open.insert(
                    e.file_id,
                    OpenInfo {
                        path,
                        is_dir,
                        written: truncates || creates,
                        served: self.places.is_served(e.root),
                        job: e.job,
                        process: who,
                        last_run: 0,
                    },
                );
            }
            kind::MISSING => self.missing(missing(e, path, at), ws),
            kind::REFUSED_WRITE => {
                self.tally.writes_refused += 1;
                log::warn!(
                    "{}[{}] (uid {uid}) tried to write {path} and got EROFS: its local copy is dropped, later opens go to the network",
                    comm(e),
                    e.tgid
                );
                ws.mark_refused(&path, at);
                self.refused.push(path);
            }
            kind::MKDIR
            | kind::RMDIR
            | kind::UNLINK
            | kind::RENAME_FROM
            | kind::RENAME_TO
            | kind::TRUNCATE => {
                let change = Change {
                    kind: e.kind,
                    path,
                    process: process(e),
                    at_ns: at,
                };
                if e.file_id == 0 {
                    self.change(change, ws);
                } else {
                    self.await_answer(e.file_id, change, ws);
                }
            }
            _ => {}
        }
    }

    /// A run of grains an open (or mapped) file read: where, in its ranges.
    pub fn range(&mut self, r: &RangeRead, ws: &mut WorkingSet) {
        self.tally.events += 1;
        self.add_run(r.file_id, r.run, ws);
    }

    /// Run `run` of file `file_id` (0: none), added to its ranges: from a report, or
    /// from the kernel's entry at a sweep (added again later is no change).
    fn add_run(&mut self, file_id: u64, run: u64, ws: &mut WorkingSet) {
        if run == 0 {
            return;
        }
        let (path, job, process, last) = match self.open.get_mut(&file_id) {
            Some(info) if !info.is_dir => (&info.path, info.job, &info.process, &mut info.last_run),
            Some(_) => return,
            None => match self.mapped.get_mut(&file_id) {
                Some(m) => (&m.path, m.job, &m.process, &mut m.last_run),
                None => return,
            },
        };
        if std::mem::replace(last, run) == run {
            return; // added already
        }
        let (start, end) = unpack(run);
        ws.read_range(path, start, end);
        if job != 0 {
            self.accesses.push(Access {
                path: path.clone(),
                job,
                process: process.clone(),
                what: What::Grains(start, end),
                uid: 0,
                at_ns: 0,
            });
        }
    }

    /// Adds what open files have read since last time, and closes the files of
    /// processes that exited without closing them. `requested`: the files the request
    /// programs follow (by the server's handle: their release closes them). Returns the
    /// kernel entries to forget.
    pub fn sweep(
        &mut self,
        open_files: &[(FdKey, OpenFile)],
        requested: &[OpenFile],
        ws: &mut WorkingSet,
    ) -> Vec<FdKey> {
        let mut gone = Vec::new();
        let mut in_kernel = HashSet::new();
        let mut alive: HashMap<u32, bool> = HashMap::new();
        for file in requested {
            in_kernel.insert(file.file_id);
            self.count_read(file, ws);
        }
        for (key, file) in open_files {
            in_kernel.insert(file.file_id);
            if !self.count_read(file, ws) {
                continue; // its open event is still on its way
            }
            let is_alive = *alive
                .entry(key.tgid)
                .or_insert_with(|| Path::new(&format!("/proc/{}", key.tgid)).exists());
            if !is_alive {
                gone.push(*key);
                self.close(file.file_id);
            }
        }
        // Files the kernel no longer has whose close event was lost (or whose kernel entry
        // could not be made). Each sweep follows a full drain, so an entry missing twice
        // in a row is not a close still on its way.
        let missing: HashSet<u64> = self
            .open
            .keys()
            .copied()
            .filter(|id| !in_kernel.contains(id))
            .collect();
        let lost: Vec<u64> = missing
            .intersection(&self.missing_from_kernel)
            .copied()
            .collect();
        for id in lost {
            self.close(id);
        }
        self.missing_from_kernel = missing;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        self.answers_overdue(now, ws);
        gone
    }

    /// A failed lookup (`access`, a `What::Missing`).
    fn missing(&mut self, access: Access, ws: &mut WorkingSet) {
        self.tally.failed_lookups += 1;
        ws.missing(&access.path, access.at_ns);
        self.accesses.push(access);
    }

    /// A LOOKUP of `path` was sent (`kind::LOOKUP_ASKED`): kept until its answer.
    fn ask(&mut self, e: &Event, path: String, at_ns: u64) {
        let key = (e.bytes as u32, e.file_id);
        if self.asked_order.len() >= MAX_ASKED {
            if let Some(oldest) = self.asked_order.pop_front() {
                self.asked.remove(&oldest);
            }
        }
        self.asked_order.push_back(key);
        self.asked.insert(key, missing(e, path, at_ns));
    }

    /// Adds what open file `file` read since last time; a file held open by a writer is
    /// reported changed (the kernel reports only its first write) for as long as it stays
    /// open. False if its open event is still on its way.
    fn count_read(&mut self, file: &OpenFile, ws: &mut WorkingSet) -> bool {
        self.add_run(file.file_id, file.run, ws);
        let Some(info) = self.open.get(&file.file_id) else {
            return false;
        };
        let counted = self.bytes_counted.entry(file.file_id).or_insert(0);
        if !info.is_dir && file.bytes_read > *counted {
            let bytes = file.bytes_read - *counted;
            if !info.served {
                self.learned += 1;
            }
            ws.add_bytes_read(&info.path, bytes);
            self.accesses
                .push(read(&info.path, info.job, &info.process, bytes));
            *counted = file.bytes_read;
        }
        if info.written {
            self.changed.push(info.path.clone());
        }
        true
    }

    /// Adds the pages that entered mapped files' page caches since last time as bytes
    /// read, and forgets the files the kernel forgot. Returns the kernel entries whose
    /// file is not known (their mapping's event was lost): forgotten there, the next
    /// mapping names them again.
    pub fn sweep_mapped(
        &mut self,
        mapped: &[(InodeKey, Mapped)],
        ws: &mut WorkingSet,
    ) -> Vec<InodeKey> {
        let mut in_kernel = HashSet::new();
        let mut unknown = HashSet::new();
        for (key, m) in mapped {
            in_kernel.insert(m.file_id);
            self.add_run(m.file_id, m.run, ws);
            let Some(info) = self.mapped.get_mut(&m.file_id) else {
                // Its event may still be on its way (the entry is made first).
                unknown.insert(*key);
                continue;
            };
            if m.pages > info.counted {
                let bytes = (m.pages - info.counted) * self.page_size;
                info.counted = m.pages;
                if !info.served {
                    self.learned += 1;
                }
                ws.add_bytes_read(&info.path, bytes);
                self.accesses
                    .push(read(&info.path, info.job, &info.process, bytes));
            }
        }
        self.mapped.retain(|id, _| in_kernel.contains(id));
        let lost = unknown
            .intersection(&self.unknown_mapped)
            .copied()
            .collect();
        self.unknown_mapped = unknown;
        lost
    }

    /// The normalized, watched, absolute path of an event, or None (counted).
    fn resolve(&mut self, e: &Event) -> Option<String> {
        match self.places.resolve(e, &self.views) {
            Ok(path) => Some(path),
            Err(Unplaced::Truncated) => {
                self.tally.truncated += 1;
                None
            }
            Err(Unplaced::Unresolved) => {
                self.tally.unresolved += 1;
                None
            }
            Err(Unplaced::Outside) => {
                self.tally.outside_watched += 1;
                None
            }
        }
    }

    /// Learns the watched files process `pid` holds open that no open event named: it
    /// woke the resting tracer, and opened them before the syscall program was attached
    /// again. The process is counted as no job's (its job is the kernel's to know).
    pub fn found_open(&mut self, pid: u32, ws: &mut WorkingSet) {
        let seen: HashSet<&str> = self
            .open
            .values()
            .filter(|i| i.process.pid == pid)
            .map(|i| i.path.as_str())
            .collect();
        let places = &self.places;
        let held = held::files_open(pid, |p| places.watched_path(p).is_some());
        let mut found = Vec::new();
        for h in held {
            let Some(path) = places.watched_path(&h.path) else {
                continue;
            };
            let path = path.to_string_lossy().into_owned();
            if !seen.contains(path.as_str()) && !found.iter().any(|(p, _)| *p == path) {
                found.push((path, h));
            }
        }
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        for (path, h) in found {
            log::debug!(
                "{path}: held by {}[{pid}], opened while tracing rested",
                h.comm
            );
            self.learned += 1;
            if ws.open(&path, h.uid, at) {
                self.to_stat.insert(path.clone());
            }
            self.accesses.push(Access {
                path,
                job: 0,
                process: Process { pid, comm: h.comm },
                what: What::Open,
                uid: h.uid,
                at_ns: at,
            });
        }
    }

    /// Forgets an open file whose close will not be reported.
    fn close(&mut self, file_id: u64) {
        if let Some(info) = self.open.remove(&file_id) {
            if info.written {
                self.to_stat.insert(info.path);
            }
        }
        self.bytes_counted.remove(&file_id);
    }
}

fn parent(path: &str) -> &str {
    match path.rfind('/') {
        Some(0) => "/",
        Some(i) => &path[..i],
        None => path,
    }
}

/// `bytes` read from `path` by `process` of `job`.
fn read(path: &str, job: u32, process: &Process, bytes: u64) -> Access {
    Access {
        path: path.to_owned(),
        job,
        process: process.clone(),
        what: What::Read(bytes),
        uid: 0,
        at_ns: 0,
    }
}

/// A failed lookup of `path` by event `e`'s process, at `at_ns` (unix ns).
fn missing(e: &Event, path: String, at_ns: u64) -> Access {
    Access {
        path,
        job: e.job,
        process: process(e),
        what: What::Missing,
        uid: e.uid,
        at_ns,
    }
}

fn process(e: &Event) -> Process {
    Process {
        pid: e.tgid,
        comm: comm(e),
    }
}

fn comm(e: &Event) -> String {
    let end = e.comm.iter().position(|b| *b == 0).unwrap_or(e.comm.len());
    String::from_utf8_lossy(&e.comm[..end]).into_owned()
}

/// CLOCK_REALTIME minus CLOCK_MONOTONIC (bpf_ktime_get_ns), to date kernel events.
fn monotonic_to_unix_offset() -> i128 {
    let now = |clock| {
        let t = nix::time::clock_gettime(clock).expect("clock_gettime");
        i128::from(t.tv_sec()) * 1_000_000_000 + i128::from(t.tv_nsec())
    };
    now(nix::time::ClockId::CLOCK_REALTIME) - now(nix::time::ClockId::CLOCK_MONOTONIC)
}

mod changes;
#[cfg(test)]
mod tests;
