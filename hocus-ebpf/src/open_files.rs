//! Watched files processes hold: descriptors, with the bytes read through them (added up
//! here, in the kernel, instead of an event per read), and files mapped, with the pages
//! that entered their page cache since. Filters beside the descriptor table let a read,
//! a write or a close on the node that is not on a watched file pass without a hash
//! lookup.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap},
};
use hocus_common::{
    FdKey, InodeKey, MAX_MAPPED, MAX_OPEN_FILES, Mapped, OpenFile, counter, filter, kind,
    ranges::{grains, join},
};

use crate::{
    emit::{Header, emit, range},
    kernel::task::is_compat,
    skip::{OrSkip, Skip, Step, count},
};

/// `bpf_map_update_elem` flag: only if there is no entry yet.
pub const BPF_NOEXIST: u64 = 1;

/// Descriptors of watched files, by process and descriptor.
#[map]
static OPEN_FILES: HashMap<FdKey, OpenFile> = HashMap::with_max_entries(MAX_OPEN_FILES, 0);
/// `OPEN_FILES` entries made here, less those removed here, by process slot
/// (`filter::process_slot`); and those the agent removed (processes gone without a
/// close). Equal: no process of the slot holds a watched file, and a read, write or
/// close on the node needs no hash lookup.
#[map]
static HELD: Array<u32> = Array::with_max_entries(filter::PROCESS_SLOTS, 0);
#[map]
static RELEASED: Array<u32> = Array::with_max_entries(filter::PROCESS_SLOTS, 0);
/// Watched files some process mapped, by inode: pages entering their page cache.
#[map]
pub static MAPPED: LruHashMap<InodeKey, Mapped> = LruHashMap::with_max_entries(MAX_MAPPED, 0);

/// Whether process `tgid` may hold a watched descriptor (false: certainly not).
pub fn may_hold_files(tgid: u32) -> bool {
    let slot = filter::process_slot(tgid);
    let held = HELD.get(slot).copied().unwrap_or(1);
    let released = RELEASED.get(slot).copied().unwrap_or(0);
    held != released
}

/// Counts an `OPEN_FILES` entry made (`by` 1) or removed (`by` u32::MAX, i.e. -1) for
/// process `tgid`.
fn count_held(tgid: u32, by: u32) {
    if let Some(n) = HELD.get_ptr_mut(filter::process_slot(tgid)) {
        // SAFETY: map value pointer; the add is atomic (other CPUs count too).
        unsafe {
            core::intrinsics::atomic_xadd::<u32, u32, { core::intrinsics::AtomicOrdering::Relaxed }>(
                n, by,
            )
        };
    }
}

/// The entry process `tgid` has for descriptor `fd`, if any; filtered first (almost
/// every descriptor on the node is not a watched one).
pub fn entry(tgid: u32, fd: u32) -> Option<*mut OpenFile> {
    if !may_hold_files(tgid) {
        return None;
    }
    OPEN_FILES.get_ptr_mut(&FdKey { tgid, fd })
}

/// An entry's `struct file`: 0 once its close was reported.
pub fn file_of(entry: *mut OpenFile) -> u64 {
    // SAFETY: map value pointer, valid for this program run.
    unsafe { core::ptr::read_volatile(&raw const (*entry).file) }
}

/// The open watched file descriptor `fd` of a read, write, ftruncate or mmap names:
/// filtered and looked up first (almost every descriptor is not one), then refused for
/// a 32-bit syscall, whose arguments are not where its layout says.
#[inline(always)]
pub fn watched_file(fd: u32, tgid: u32) -> Step<*mut OpenFile> {
    let file = entry(tgid, fd).or_skip()?;
    if file_of(file) == 0 {
        return Err(Skip::Unwatched); // closed (its number not reused by a watched file since)
    }
    if is_compat() {
        return Err(Skip::Compat);
    }
    Ok(file)
}

/// A close of a watched descriptor is reported by exactly one program run: the close's
/// exit, or the exit of another thread's open that took the freed number first (a close
/// and an open of one process race for the number when nothing runs at syscall entry).
/// Whoever swaps the entry's `file` for 0 reports it; the entry's facts are read before.
/// Returns the entry's file id and bytes read if this run claimed its close, having
/// reported the run of grains it was reading.
pub fn claim_close(entry: *mut OpenFile) -> Option<(u64, u64)> {
    // SAFETY: map value pointer, valid for this program run; the file is read first, as
    // an open republishing the entry writes it last.
    let (file, file_id, bytes, run) = unsafe {
        (
            core::ptr::read_volatile(&raw const (*entry).file),
            core::ptr::read_volatile(&raw const (*entry).file_id),
            core::ptr::read_volatile(&raw const (*entry).bytes_read),
            core::ptr::read_volatile(&raw const (*entry).run),
        )
    };
    if file == 0 {
        return None;
    }
    // SAFETY: as above.
    let (_, claimed) = unsafe {
        core::intrinsics::atomic_cxchg::<
            u64,
            { core::intrinsics::AtomicOrdering::SeqCst },
            { core::intrinsics::AtomicOrdering::SeqCst },
        >(&raw mut (*entry).file, file, 0)
    };
    if claimed && run != 0 {
        range(file_id, run);
    }
    claimed.then_some((file_id, bytes))
}

/// Removes process `tgid`'s entry for descriptor `key`, if it has one.
pub fn forget(key: &FdKey) {
    if OPEN_FILES.remove(key).is_ok() {
        count_held(key.tgid, u32::MAX);
    }
}

/// Descriptor `key` holds watched file `file` (its `struct file`), new as `file_id`:
/// `stale` is the entry the number had, if any, taken again; else a new one. A full
/// table is counted: the file's reads and close are then not seen.
pub fn remember(key: &FdKey, stale: Option<*mut OpenFile>, file_id: u64, file: u64) {
    match stale {
        // The entry again, for this file: its file last, which publishes it.
        // SAFETY: map value pointer, valid for this program run.
        Some(old) => unsafe {
            (*old).file_id = file_id;
            (*old).bytes_read = 0;
            (*old).written = 0;
            (*old).run = 0;
            core::ptr::write_volatile(&raw mut (*old).file, file);
        },
        None => {
            let entry = OpenFile {
                file_id,
                file,
                ..Default::default()
            };
            // Counted before it exists, so a filter never says "none" wrongly.
            count_held(key.tgid, 1);
            if OPEN_FILES.insert(key, &entry, BPF_NOEXIST).is_err() {
                count_held(key.tgid, u32::MAX);
                count(counter::LOST_OPEN_FILES_FULL);
            }
        }
    }
}

/// `bytes` read through a followed file, added to it (threads, and replies on any CPU,
/// add at once).
#[inline(always)]
pub fn add_read(file: *mut OpenFile, bytes: u64) {
    // SAFETY: map value pointer, valid for this program run; the add is atomic.
    unsafe {
        core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
            &raw mut (*file).bytes_read,
            bytes,
        )
    };
}

/// Bytes `[offset, offset + len)` read through open file `file_id` (`len` > 0), whose
/// current run of grains is at `run`: joined to it when they touch, else the run is
/// reported and they start the next. One word, swapped by compare-exchange: threads
/// reading one file at once (a FUSE server's replies, on several CPUs) join their runs
/// rather than overwrite each other's; whoever swaps a run out reports it. (Before 5.12
/// the swap is a plain store, and a rare race loses a run.)
#[inline(always)]
pub fn add_range(run: *mut u64, file_id: u64, offset: u64, len: u64) {
    let more = grains(offset, len);
    for _ in 0..4 {
        // SAFETY: map value pointer, valid for this program run.
        let old = unsafe { core::ptr::read_volatile(run) };
        let (new, jumped) = match join(old, more) {
            Some(joined) if joined == old => return,
            Some(joined) => (joined, false),
            None => (more, true),
        };
        // SAFETY: as above; the swap is atomic.
        let (_, swapped) = unsafe {
            core::intrinsics::atomic_cxchg::<
                u64,
                { core::intrinsics::AtomicOrdering::SeqCst },
                { core::intrinsics::AtomicOrdering::SeqCst },
            >(run, old, new)
        };
        if swapped {
            if jumped {
                range(file_id, old);
            }
            return;
        }
    }
}

/// A followed file written (`kind`: a write or a truncate through it) by process
/// `tgid`: reported once, its first time.
#[inline(always)]
pub fn first_write(file: *mut OpenFile, kind: u8, tgid: u32) {
    // SAFETY: map value pointer, valid for this program run.
    let file = unsafe { &mut *file };
    if file.written != 0 {
        return; // one event per open file is enough to mark it written
    }
    file.written = 1;
    let h = Header {
        file_id: file.file_id,
        ..Header::new(kind, tgid)
    };
    emit(&h, None, 0);
}

/// A watched file `file_id` mapped by process `tgid`: the pages that enter its inode's
/// page cache are counted from now on (`filemap`). The first mapping names the inode;
/// later ones (every process loading the same library) add to it.
#[inline(always)]
pub fn mapped(inode: &InodeKey, file_id: u64, tgid: u32) {
    let fresh = Mapped {
        file_id,
        pages: 0,
        run: 0,
    };
    if MAPPED.insert(inode, &fresh, BPF_NOEXIST).is_ok() {
        let h = Header {
            file_id,
            ..Header::new(kind::MAPPED, tgid)
        };
        emit(&h, None, 0);
    }
}
