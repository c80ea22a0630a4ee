//! The processes the syscall program follows (`hocus_common::follow`), as the agent sees
//! and changes them. The kernel side's bitmap is mapped into the agent's memory: counting
//! it is a read of memory, not 65,536 lookups, and following a job's process is the same
//! atomic OR on a word the kernel side makes, so neither loses the other's bits.

use std::{
    os::fd::{AsFd, AsRawFd},
    ptr::NonNull,
    sync::atomic::{AtomicU64, Ordering},
};

use anyhow::{Context, Result, bail};
use aya::maps::Map;
use hocus_common::follow;

const WORDS: usize = follow::WORDS as usize;

pub struct Followed {
    words: NonNull<AtomicU64>,
    len: usize,
}

// SAFETY: the mapping is shared memory read and written only through atomics.
unsafe impl Send for Followed {}
// SAFETY: as above.
unsafe impl Sync for Followed {}

impl Followed {
    /// Maps the `FOLLOWED` array (made `BPF_F_MMAPABLE` by the kernel side).
    pub fn map(map: &Map) -> Result<Self> {
        let Map::Array(data) = map else {
            bail!("FOLLOWED is not an array");
        };
        let page = 4096;
        let len = (WORDS * 8).div_ceil(page) * page;
        // SAFETY: a shared mapping of the map's own descriptor, of the array's size;
        // checked for failure below and unmapped on drop.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                data.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).context("mapping the FOLLOWED table");
        }
        Ok(Self {
            words: NonNull::new(at.cast()).context("mmap returned null")?,
            len,
        })
    }

    fn words(&self) -> &[AtomicU64] {
        // SAFETY: `WORDS` u64s, mapped for as long as self lives, aligned to a page.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr(), WORDS) }
    }

    /// Follows process `pid` from now on.
    pub fn follow(&self, pid: u32) -> Result<()> {
        let Some(word) = self.words().get(follow::word(pid) as usize) else {
            bail!("process id {pid} is beyond any the kernel hands out");
        };
        word.fetch_or(follow::bit(pid), Ordering::SeqCst);
        Ok(())
    }

    /// How many processes (and threads of followed processes) are followed now, not
    /// counting the daemon's own threads: whatever it forks is a job's (the kernel side
    /// cannot tell a thread from a process at fork), yet its own syscalls are never the
    /// workload.
    pub fn count(&self) -> usize {
        let all: usize = self
            .words()
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones() as usize)
            .sum();
        all.saturating_sub(own_threads().filter(|t| self.is_set(*t)).count())
    }

    fn is_set(&self, id: u32) -> bool {
        self.words()
            .get(follow::word(id) as usize)
            .is_some_and(|w| w.load(Ordering::Relaxed) & follow::bit(id) != 0)
    }
}

fn own_threads() -> impl Iterator<Item = u32> {
    std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
}

impl Drop for Followed {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, of `len` bytes.
        unsafe { libc::munmap(self.words.as_ptr().cast(), self.len) };
    }
}
