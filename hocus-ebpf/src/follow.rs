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

/// The processes `syscall_exit` follows, a bit each.
#[map]
static FOLLOWED: Array<u64> = Array::with_max_entries(follow::WORDS, BPF_F_MMAPABLE);
/// The threads that made a request to a watched FUSE mount since their last path
/// syscall was looked at (`follow::word`/`bit`, by thread id; `PATHS_BY_REQUEST`).
#[map]
static REQUESTED: Array<u64> = Array::with_max_entries(follow::WORDS, 0);
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
        .get(follow::word(id))
        .is_none_or(|w| w & follow::bit(id) != 0)
}

/// Follows `id` from now on: a process, or a thread a followed process made.
pub fn follow(id: u32) {
    if id == 0 || traces_every_process() {
        return;
    }
    set_bit(&FOLLOWED, id);
}

/// Stops following `id` (gone).
pub fn unfollow(id: u32) {
    clear_bit(&FOLLOWED, id);
}

/// Thread `thread` made a request to a watched mount (`may_reach_watched`).
pub fn requested(thread: u32) {
    if paths_by_request() {
        set_bit(&REQUESTED, thread);
    }
}

/// Sets `id`'s bit in a bitmap by process or thread id (`hocus_common::follow`). Bits
/// are set and cleared atomically: other CPUs set and clear others in the same word. The
/// word is read first, so that a bit already set costs no locked operation.
fn set_bit(map: &Array<u64>, id: u32) {
    if let Some(w) = map.get_ptr_mut(follow::word(id)) {
        // SAFETY: map value pointer, valid for this program run.
        unsafe {
            if core::ptr::read_volatile(w) & follow::bit(id) == 0 {
                core::intrinsics::atomic_or::<u64, u64, { core::intrinsics::AtomicOrdering::SeqCst }>(
                    w,
                    follow::bit(id),
                );
            }
        }
    }
}

/// Clears `id`'s bit; whether it was set (as far as this CPU saw).
fn clear_bit(map: &Array<u64>, id: u32) -> bool {
    let Some(w) = map.get_ptr_mut(follow::word(id)) else {
        return false;
    };
    // SAFETY: as in `set_bit`.
    unsafe {
        if core::ptr::read_volatile(w) & follow::bit(id) == 0 {
            return false;
        }
        core::intrinsics::atomic_and::<u64, u64, { core::intrinsics::AtomicOrdering::SeqCst }>(
            w,
            !follow::bit(id),
        );
    }
    true
}

/// Whether a path syscall (a failed lookup, a mutation) of thread `thread` may have
/// reached a watched tree, before its path is read (~105 ns for the first eight bytes
/// alone). With `PATHS_BY_REQUEST`, a process at home reached one only if the thread made
/// a request to a watched mount since its last path syscall (its `REQUESTED` bit, taken
/// here): on FUSE every lookup of a name the kernel does not hold is one. Elsewhere (a
/// job's namespace, whose binds answer lookups from local copies; a container) always.
pub fn may_reach_watched(thread: u32) -> bool {
    if !paths_by_request() || clear_bit(&REQUESTED, thread) {
        return true;
    }
    match (nsproxy(), HOME.get(0)) {
        (Some(nsproxy), Some(home)) => nsproxy.0 != home.nsproxy,
        _ => true,
    }
}
