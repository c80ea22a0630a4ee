//! The processes the syscall program follows (`hocus_common::follow`), as the agent sees
//! and changes them. The kernel side's table (a byte per process id) is mapped into the
//! agent's memory: counting it is a read of memory, not 65,536 lookups, and following a
//! job's process is a store of its byte, as the kernel side makes it.

use std::{
    os::fd::{AsFd, AsRawFd},
    sync::atomic::{AtomicU8, AtomicU64, Ordering},
};

use anyhow::{Context, Result, bail};
use aya::maps::Map;
use hocus_common::follow;
use memmap2::{MmapOptions, MmapRaw};

const BYTES: usize = follow::IDS as usize;

pub struct Followed {
    /// The array's bytes, one per process id, shared with the kernel side.
    table: MmapRaw,
}

impl Followed {
    /// Maps the `FOLLOWED` array (made `BPF_F_MMAPABLE` by the kernel side).
    pub fn map(map: &Map) -> Result<Self> {
        let Map::Array(data) = map else {
            bail!("FOLLOWED is not an array");
        };
        let table = MmapOptions::new()
            .len(BYTES)
            .map_raw(data.fd().as_fd().as_raw_fd())
            .context("mapping the FOLLOWED table")?;
        Ok(Self { table })
    }

    fn bytes(&self) -> &[AtomicU8] {
        // SAFETY: `BYTES` bytes (the array's entries hold no padding), mapped for as long
        // as self lives, and only ever read and written whole (here and by the kernel).
        unsafe { std::slice::from_raw_parts(self.table.as_ptr().cast(), BYTES) }
    }

    /// The same bytes eight at a time, for counting.
    fn words(&self) -> &[AtomicU64] {
        // SAFETY: as above; the mapping is aligned to a page.
        unsafe { std::slice::from_raw_parts(self.table.as_ptr().cast(), BYTES / 8) }
    }

    /// Follows process `pid` from now on.
    pub fn follow(&self, pid: u32) -> Result<()> {
        let Some(byte) = self.bytes().get(pid as usize) else {
            bail!("process id {pid} is beyond any the kernel hands out");
        };
        byte.store(1, Ordering::SeqCst);
        Ok(())
    }

    /// How many processes (and threads of followed processes) are followed now, not
    /// counting the daemon's own threads: whatever it forks is a job's (the kernel side
    /// cannot tell a thread from a process at fork), yet its own syscalls are never the
    /// workload. Its threads come and go as it works: a set byte counts unless it is one
    /// of them, read again after looking (a thread clears its byte as it exits, before
    /// it leaves /proc).
    pub fn count(&self) -> usize {
        let mut n = 0;
        for (w, word) in self.words().iter().enumerate() {
            // Every byte is 0 or 1: a word's ones are its followed ids.
            if word.load(Ordering::Relaxed) == 0 {
                continue;
            }
            for id in (w * 8..w * 8 + 8).map(|i| i as u32) {
                if self.is_set(id) && !is_own_thread(id) && self.is_set(id) {
                    n += 1;
                }
            }
        }
        n
    }

    fn is_set(&self, id: u32) -> bool {
        self.bytes()
            .get(id as usize)
            .is_some_and(|b| b.load(Ordering::Relaxed) != 0)
    }
}

fn is_own_thread(id: u32) -> bool {
    std::path::Path::new("/proc/self/task")
        .join(id.to_string())
        .exists()
}
