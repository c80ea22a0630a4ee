//! The daemon's memory: how its allocator is set up, giving memory back after a burst,
//! and what a hash table reserves (for the working set's own count). glibc keeps what a
//! thread freed in its arena for the next allocation: after a site-wide profile is
//! imported (parsed in batches on a connection thread) and placed (a shortlist of 100k files
//! on the keeper's), some 65 MiB of freed memory stayed with the daemon for good.

/// Allocations from this size up get pages of their own (mmap) rather than a place in an
/// arena: a large table freed goes back to the system at once, and one that grows is
/// moved by remapping its pages, not copied beside the old one.
const OWN_PAGES_FROM: i32 = 256 << 10;

/// Sets the daemon's allocator up for large tables that grow and shrink: without it,
/// glibc raises its mmap threshold after the first large free (up to 32 MiB), and the
/// tables of a site-wide profile then grow inside arenas, leaving the copies they grew
/// out of behind. Measured at 1M files: the daemon's memory empty 61 -> 44 MiB, with the
/// profile 150 -> 123 MiB.
pub fn settle() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets a parameter of the allocator; called before the threads.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, OWN_PAGES_FROM);
    }
}

/// Returns the free memory of every arena to the system (`malloc_trim`). A few
/// milliseconds at a large heap: for after bursts, not for every event.
pub fn give_back() {
    #[cfg(target_env = "gnu")]
    // SAFETY: no preconditions; it only releases free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Bytes a hashbrown table with room for `capacity` entries of `T` reserves: a power of
/// two of buckets at most 7/8 full, each with its entry and a control byte.
pub fn table_bytes<T>(capacity: usize) -> usize {
    let buckets = (capacity * 8 / 7).next_power_of_two();
    buckets * (size_of::<T>() + 1)
}
