//! The processes `syscall_exit` follows (`hocus_common::follow`): jobs and their
//! descendants from their start, any other process from its first request to a watched
//! mount (`tripwire`); the threads that made such a request since their last path
//! syscall; and the `hocus-agent run` job each process belongs to.

use aya_ebpf::{
    macros::map,
    maps::{Array, LruHashMap},
};
use hocus_common::{MAX_PROCESSES, follow};

use crate::{
    agent::{HOME, paths_by_request, traces_every_process},
    kernel::task::nsproxy,
};

/// A map the agent maps into its memory.
const BPF_F_MMAPABLE: u32 = 1 << 10;

/// The processes `syscall_exit` follows, a byte each.
#[map]
static FOLLOWED: Array<follow::Entry> = Array::with_max_entries(follow::ENTRIES, BPF_F_MMAPABLE);
/// The threads that made a request to a watched mount (FUSE, NFS) since their last path
/// syscall was looked at (`follow::entry`/`byte`, by thread id; `PATHS_BY_REQUEST`).
#[map]
static REQUESTED: Array<follow::Entry> = Array::with_max_entries(follow::ENTRIES, 0);
/// The `hocus-agent run` job each process belongs to: the id is the daemon thread that
/// forked the job's first process. Set at fork, inherited by every descendant.
#[map]
pub static JOBS: LruHashMap<u32, u32> = LruHashMap::with_max_entries(MAX_PROCESSES, 0);

/// Whether `syscall_exit` follows process `tgid`: one array load, for every traced
/// syscall on the node.
pub fn is_followed(tgid: u32) -> bool {
    traces_every_process() || in_followed(tgid)
}

pub fn in_followed(id: u32) -> bool {
    FOLLOWED
        .get(follow::entry(id))
        .is_none_or(|e| e[follow::byte(id)] != 0)
}

/// Follows `id` from now on: a process, or a thread a followed process made.
pub fn follow(id: u32) {
    if id == 0 || traces_every_process() {
        return;
    }
    mark(&FOLLOWED, id);
}

/// Stops following `id` (gone).
pub fn unfollow(id: u32) {
    take(&FOLLOWED, id);
}

/// Thread `thread` made a request to a watched mount (`may_reach_watched`).
pub fn requested(thread: u32) {
    if paths_by_request() {
        mark(&REQUESTED, thread);
    }
}

/// Sets `id`'s byte in a table by process or thread id (`hocus_common::follow`): a plain
/// store, read first so that a byte already set is not written (its cache line stays
/// shared between CPUs).
fn mark(map: &Array<follow::Entry>, id: u32) {
    if let Some(entry) = map.get_ptr_mut(follow::entry(id)) {
        // SAFETY: map value pointer, valid for this program run; the byte is inside it.
        unsafe {
            let b = entry.cast::<u8>().add(follow::byte(id));
            if core::ptr::read_volatile(b) == 0 {
                core::ptr::write_volatile(b, 1);
            }
        }
    }
}

/// Clears `id`'s byte; whether it was set.
fn take(map: &Array<follow::Entry>, id: u32) -> bool {
    let Some(entry) = map.get_ptr_mut(follow::entry(id)) else {
        return false;
    };
    // SAFETY: as in `mark`.
    unsafe {
        let b = entry.cast::<u8>().add(follow::byte(id));
        if core::ptr::read_volatile(b) == 0 {
            return false;
        }
        core::ptr::write_volatile(b, 0);
    }
    true
}

/// Whether a path syscall (a failed lookup, a mutation) of thread `thread` may have
/// reached a watched tree, before its path is read (~105 ns for the first eight bytes
/// alone). With `PATHS_BY_REQUEST`, a process at home reached one only if the thread made
/// a request to a watched mount since its last path syscall (its `REQUESTED` byte, taken
/// here): on FUSE every lookup of a name the kernel does not hold is one, on NFS every
/// walk through one of its directories checks a permission there. Elsewhere (a
/// job's namespace, whose binds answer lookups from local copies; a container) always.
pub fn may_reach_watched(thread: u32) -> bool {
    if !paths_by_request() || take(&REQUESTED, thread) {
        return true;
    }
    match (nsproxy(), HOME.get(0)) {
        (Some(nsproxy), Some(home)) => nsproxy.0 != home.nsproxy,
        _ => true,
    }
}
