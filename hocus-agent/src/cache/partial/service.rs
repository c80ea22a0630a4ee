//! Partial copies on this node: the filler that serves them and the guard that holds its
//! group, started with the keeper where the kernel and the cache's filesystem allow
//! (`pre_content::probe`), taking back the group a previous daemon's guard holds (its
//! pid in the cache's root, which only root can write). The guard is forked with the
//! first copy served, or at once for a group taken back (its marks may be on copies
//! jobs still have bound), and stopped at a stop when no job may hold one.

use std::{
    fs::{self, File},
    io,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use crate::profile::extents::Extents;

use super::{
    PartialCopy,
    filler::{Filler, Growth, Limits},
    guard::{Guard, pidfd_open},
    pre_content::{Group, probe},
};

/// Where the guard's pid is kept, in the cache's root.
const GUARD_PID: &str = "guard.pid";

pub struct Partials {
    filler: Filler,
    guard: Mutex<Option<Guard>>,
    pid_file: PathBuf,
}

impl Partials {
    /// Partial copies for the cache at `root` (temporary files in `tmp`, on the same
    /// filesystem); an error says why there can be none.
    pub fn start(root: &Path, tmp: &Path, limits: Limits) -> io::Result<Arc<Self>> {
        probe(tmp)?;
        let pid_file = root.join(GUARD_PID);
        let adopted = previous_guard(&pid_file).and_then(|g| {
            let pid = g.pid();
            g.adopt()
                .inspect_err(|e| log::warn!("taking the group back from guard {pid}: {e}"))
                .ok()
        });
        let taken_back = adopted.is_some();
        let group = match adopted {
            Some(fd) => Group::from_fd(fd),
            None => Group::new()?,
        };
        let partials = Arc::new(Self {
            filler: Filler::start(group, limits)?,
            guard: Mutex::new(None),
            pid_file,
        });
        if taken_back {
            log::info!(
                "partial copies: took back the group a previous daemon's guard held (reads of its copies fail with EIO until copied again)"
            );
            partials.guarded()?;
        }
        Ok(partials)
    }

    /// Whether a previous daemon on the cache at `root` left a guard.
    pub fn left_a_guard(root: &Path) -> bool {
        root.join(GUARD_PID).exists()
    }

    /// Serves `copy` from `file` (its sparse local file): reads of it wait for the
    /// filler from now on.
    pub fn serve(&self, copy: PartialCopy, file: &File) -> io::Result<()> {
        self.guarded()?;
        self.filler.serve(Arc::new(copy), file)
    }

    /// The copies served, by network file, and the bytes each holds.
    pub fn held(&self) -> Vec<(String, u64)> {
        self.filler.held()
    }

    /// The partial copy served for the network file `name`, if any.
    pub fn growth(&self, name: &str, ranges: &Extents) -> Option<(Growth, u64)> {
        self.filler.growth(name, ranges)
    }

    pub fn copy_of(&self, name: &str) -> Option<Arc<PartialCopy>> {
        self.filler.copy_of(name)
    }

    /// Stops serving the copies of the network file `name` (the cache dropped them).
    pub fn retire(&self, name: &str) {
        self.filler.retire(name);
    }

    /// Punches the coldest chunks out of the copies until `excess` bytes are freed: no
    /// job runs that may read them. The bytes freed, by network file.
    pub fn trim_coldest(&self, excess: u64) -> Vec<(String, u64)> {
        self.filler.trim_coldest(excess)
    }

    /// The SSD budget has `room` bytes left for fills (negative: past it): fills take
    /// their bytes of it, punching chunks no job read lately if they must.
    pub fn set_room(&self, room: i64) {
        self.filler.set_room(room);
    }

    /// Bytes fills under way took of the SSD budget and have not written yet: the cache
    /// will hold them.
    pub fn filling(&self) -> u64 {
        self.filler.filling()
    }

    /// What fills punched to make room since the last call, by network file.
    pub fn trimmed_by_fills(&self) -> Vec<(String, u64)> {
        self.filler.trimmed_by_fills()
    }

    /// Lets the retired copies go: no job runs that may have one open.
    pub fn release_retired(&self) {
        self.filler.release_retired();
    }

    /// Reads allowed, bytes filled, reads failed, so far.
    pub fn counts(&self) -> (u64, u64, u64) {
        let c = &self.filler.counts;
        let n = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        (n(&c.allowed), n(&c.bytes_filled), n(&c.failed))
    }

    /// Stops the guard (at a stop with no job left that may hold a partial copy).
    pub fn stop_guard(&self) {
        if let Some(guard) = self.guard.lock().expect("not poisoned").take() {
            if let Err(e) = guard.stop() {
                log::warn!("stopping the partial copies' guard: {e}");
            }
            self.filler.set_guard(0);
            let _ = fs::remove_file(&self.pid_file);
        }
    }

    /// Starts the guard, once.
    fn guarded(&self) -> io::Result<()> {
        let mut guard = self.guard.lock().expect("not poisoned");
        if guard.is_none() {
            let me = pidfd_open(std::process::id() as libc::pid_t)?;
            let started = Guard::start(self.filler.group_fd(), &me)?;
            fs::write(&self.pid_file, started.pid().to_string())?;
            self.filler.set_guard(started.pid());
            *guard = Some(started);
        }
        Ok(())
    }
}

/// The guard a previous daemon left, if its pid file names one.
fn previous_guard(pid_file: &Path) -> Option<Guard> {
    let pid = fs::read_to_string(pid_file).ok()?.trim().parse().ok()?;
    let _ = fs::remove_file(pid_file);
    Guard::find(pid).ok()
}
