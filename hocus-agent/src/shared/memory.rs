//! Giving memory back to the system after a burst. glibc keeps what a thread freed in
//! its arena for the next allocation: after a site-wide profile is imported (parsed in
//! batches on a connection thread) and placed (a view of 100k files on the keeper's),
//! some 65 MiB of freed memory stayed with the daemon for good.

/// Returns the free memory of every arena to the system (`malloc_trim`). A few
/// milliseconds at a large heap: for after bursts, not for every event.
pub fn give_back() {
    #[cfg(target_env = "gnu")]
    // SAFETY: no preconditions; it only releases free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}
