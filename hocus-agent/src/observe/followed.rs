//! The processes the syscall program follows (`hocus_common::follow`), as the agent sees
//! and changes them. The kernel side's table is mapped into the agent's memory: counting
//! it is a read of memory, not 16,384 lookups, and following a job's process is the same
//! compare-and-swap on an entry the kernel side makes, so neither loses the other's.

use std::{
    os::fd::{AsFd, AsRawFd},
    ptr::NonNull,
    sync::atomic::{AtomicU64, Ordering},
};

use anyhow::{Context, Result, bail};
use aya::maps::Map;
use hocus_common::follow;

const ENTRIES: usize = follow::BUCKETS as usize * follow::WAYS;

pub struct Followed {
    entries: NonNull<AtomicU64>,
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
        let len = (ENTRIES * 8).div_ceil(page) * page;
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
            entries: NonNull::new(at.cast()).context("mmap returned null")?,
            len,
        })
    }

    fn entries(&self) -> &[AtomicU64] {
        // SAFETY: `ENTRIES` u64s, mapped for as long as self lives, aligned to a page.
        unsafe { std::slice::from_raw_parts(self.entries.as_ptr(), ENTRIES) }
    }

    fn bucket(&self, id: u32) -> &[AtomicU64] {
        let at = follow::bucket(id) as usize * follow::WAYS;
        &self.entries()[at..at + follow::WAYS]
    }

    /// Follows process `pid` from now on; false if its bucket is full.
    pub fn follow(&self, pid: u32) -> bool {
        let id = u64::from(pid);
        let bucket = self.bucket(pid);
        if bucket.iter().any(|e| e.load(Ordering::SeqCst) == id) {
            return true;
        }
        bucket.iter().any(|e| {
            e.compare_exchange(0, id, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        })
    }

    /// How many processes (and threads of followed processes) are followed now.
    pub fn count(&self) -> usize {
        self.entries()
            .iter()
            .filter(|e| e.load(Ordering::Relaxed) != 0)
            .count()
    }
}

impl Drop for Followed {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, of `len` bytes.
        unsafe { libc::munmap(self.entries.as_ptr().cast(), self.len) };
    }
}
