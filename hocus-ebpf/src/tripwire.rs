//! Tripwires: work a watched mount's client or server does for a process (a FUSE
//! request, an NFS permission check, pages entering the page cache) follows that process from then on, and wakes a resting
//! `syscall_exit`. Other filesystems never pass here, so resting costs them nothing.

use aya_ebpf::{macros::map, maps::Array};
use hocus_common::{MAX_WATCHED, kind, rest};

use crate::{
    agent::current,
    emit::{Header, emit},
    follow::follow,
};

/// Whether `syscall_exit` is attached (`hocus_common::rest`): the agent detaches it
/// while there is nothing to learn, and the tripwires wake it.
#[map]
pub static REST: Array<u32> = Array::with_max_entries(1, 0);
/// Whether the filesystems' own programs learn what jobs do now (FUSE requests, the
/// NFS client's functions): `syscall_exit` rests for them. (Awake, it sees all of that
/// itself.)
pub fn learning() -> bool {
    REST.get(0).copied() == Some(rest::LEARNING_BY_REQUESTS)
}

/// The watched mounts' devices (`s_dev`, the kernel's encoding; 0 ends the list).
#[map]
static WATCHED_DEVICES: Array<u32> = Array::with_max_entries(MAX_WATCHED, 0);

/// If `dev` is a watched mount's device, the current process is followed from now on
/// (this very syscall too: its exit comes after), and a resting `syscall_exit` is asked
/// to attach again, once: by any request, or while jobs served from local copies run,
/// by one that `reads_or_changes` the mount; never while the request programs learn
/// (`rest::LEARNING_BY_REQUESTS`). The agent's own work on the mount (copies,
/// checks) is neither. Returns the thread, if `dev` is watched.
pub fn tripped(dev: u32, reads_or_changes: bool) -> Option<u32> {
    if !is_watched_device(dev) {
        return None;
    }
    let (pid_tgid, tgid) = current()?;
    follow(tgid);
    let thread = Some(pid_tgid as u32);
    let Some(state) = REST.get_ptr_mut(0) else {
        return thread;
    };
    // SAFETY: map value pointer, valid for this program run.
    match unsafe { *state } {
        rest::RESTING => {}
        rest::RESTING_WITH_JOBS if reads_or_changes => {}
        _ => return thread,
    }
    // SAFETY: as above. Two CPUs may both get here: the agent wakes once either way.
    unsafe { *state = rest::WAKING };
    emit(&Header::new(kind::WAKE, tgid), None, 0);
    thread
}

pub fn is_watched_device(dev: u32) -> bool {
    for i in 0..MAX_WATCHED {
        match WATCHED_DEVICES.get(i).copied() {
            Some(0) | None => return false,
            Some(d) if d == dev => return true,
            Some(_) => {}
        }
    }
    false
}
