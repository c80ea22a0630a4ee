//! The processes the syscall program follows (`hocus_common::follow`), as the agent sees
//! and changes them. The kernel side's bitmap is mapped into the agent's memory: counting
//! it is a read of memory, not 65,536 lookups, and following a job's process is the same
//! atomic OR on a word the kernel side makes, so neither loses the other's bits.

use std::{
    os::fd::{AsFd, AsRawFd},
    sync::atomic::{AtomicU64, Ordering},
};

use anyhow::{Context, Result, bail};
use aya::maps::Map;
use hocus_common::follow;
use memmap2::{MmapOptions, MmapRaw};

const WORDS: usize = follow::WORDS as usize;

pub struct Followed {
    /// The array's `WORDS` u64s, shared with the kernel side.
    words: MmapRaw,
}

impl Followed {
    /// Maps the `FOLLOWED` array (made `BPF_F_MMAPABLE` by the kernel side).
    pub fn map(map: &Map) -> Result<Self> {
        let Map::Array(data) = map else {
            bail!("FOLLOWED is not an array");
        };
        let words = MmapOptions::new()
            .len(WORDS * 8)
            .map_raw(data.fd().as_fd().as_raw_fd())
            .context("mapping the FOLLOWED table")?;
        Ok(Self { words })
    }

    fn words(&self) -> &[AtomicU64] {
        // SAFETY: `WORDS` u64s, mapped for as long as self lives, aligned to a page, and
        // only ever read and written atomically (here and by the kernel side).
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), WORDS) }
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
