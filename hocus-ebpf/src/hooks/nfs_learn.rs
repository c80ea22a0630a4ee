//! nfs_learn, on the NFS client's own functions (fentry and fexit through the `nfs` and
//! `nfsv4` modules' BTF): learning what jobs do on a watched NFS mount while
//! `syscall_exit` rests (`rest::LEARNING_BY_REQUESTS`), so that no other process on the
//! node pays for it; a process pays a program run where it uses NFS only.
//!
//! Every open of an NFS file runs the client's open (`nfs_file_open`, `nfs4_file_open`,
//! or an NFSv4 atomic open that opened it; `nfs_opendir` for a directory): the file is
//! reported opened where it lies, and followed by its `struct file` (`NFS_FILES`), the
//! bytes each read returns added to it (`nfs_file_read`: page-cache hits included, as
//! the syscall route counts them), the first write marking it written, its mapping
//! naming its inode for the pages that enter its page cache, and its last close
//! (`nfs_file_release`, `nfs_closedir`) reporting it closed with its bytes. A lookup the
//! server answered "no such name" (`nfs_lookup` leaving the dentry negative) is a
//! missing name, unless an O_CREAT open or a rename made it. Changes by a name
//! (unlink, rmdir, rename, a setattr of the size) are reported at the function's entry,
//! by the dentries it is given (a rename has moved them by its exit), each with a
//! number; its exit says what the server answered (`kind::CHANGE_ANSWERED`), and the
//! agent counts the change only once the server accepted it: a change refused drops
//! no copy. A mkdir is counted at its entry: it drops no copy, and its return is a
//! dentry on newer kernels, an int on older ones. A write marks its file written
//! once it wrote something.

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_get_current_uid_gid};
use aya_ebpf::{
    macros::{fentry, fexit, map},
    maps::HashMap,
    programs::{FEntryContext, FExitContext},
};
use hocus_common::{
    OpenFile, counter, kind, op,
    requests::{
        MAX_PENDING_CHANGES, MAX_REQUEST_FILES, MAX_REQUEST_FILES_PER_USER, MAX_REQUEST_USERS,
        O_DIRECTORY,
    },
};

use crate::{
    agent::current,
    emit::{Header, closed, emit, next_id, target},
    kernel::{
        Typed,
        files::{File, inode_of},
        nfs::{file_of_kiocb, flags, placed, position, resizes},
        offset,
    },
    locate::locate,
    open_files::{self, add_range, add_read, first_write},
    skip::{OrSkip, Skip, Step, count, finish},
    syscall::{self, opens_to_create},
    tripwire::learning,
};

/// Files opened on watched NFS mounts while jobs are learned, by their `struct file`.
#[map]
static NFS_FILES: HashMap<u64, OpenFile> = HashMap::with_max_entries(MAX_REQUEST_FILES, 0);

/// How many of `NFS_FILES` each user's opens hold, by uid: at most
/// `MAX_REQUEST_FILES_PER_USER`, so one user holding thousands of NFS files open blinds
/// the learning of no one else's.
#[map]
static NFS_FILES_OF: HashMap<u32, u32> = HashMap::with_max_entries(MAX_REQUEST_USERS, 0);

/// The numbers of the changes each thread's NFS call under way reported (0: none), by
/// the thread's id: its exit says what the server answered them.
#[map]
static CHANGING: HashMap<u32, [u64; 2]> = HashMap::with_max_entries(MAX_PENDING_CHANGES, 0);

#[fexit(function = "nfs_file_open")]
pub fn nfs_opened(ctx: FExitContext) -> i32 {
    finish(opened(ctx.arg(1), ctx.arg(2), 0));
    0
}

#[fexit(function = "nfs4_file_open")]
pub fn nfs4_opened(ctx: FExitContext) -> i32 {
    finish(opened(ctx.arg(1), ctx.arg(2), 0));
    0
}

/// A directory opened (to be listed): `nfs_opendir(inode, file)`.
#[fexit(function = "nfs_opendir")]
pub fn nfs_dir_opened(ctx: FExitContext) -> i32 {
    finish(opened(ctx.arg(1), ctx.arg(2), O_DIRECTORY));
    0
}

/// `nfs_atomic_open(dir, dentry, file, open_flags, mode)`: NFSv4's open of a name not
/// looked up yet, which opens the file itself, or only looks it up and leaves the open
/// to the VFS (`nfs4_file_open` then).
#[fexit(function = "nfs_atomic_open")]
pub fn nfs_atomic_opened(ctx: FExitContext) -> i32 {
    finish(opened(ctx.arg(2), ctx.arg(5), 0));
    0
}

#[fexit(function = "nfs_file_read")]
pub fn nfs_read(ctx: FExitContext) -> i32 {
    finish(read(ctx.arg(0), ctx.arg(2)));
    0
}

/// `nfs_file_write(kiocb, from)`, returning the bytes written or an error.
#[fexit(function = "nfs_file_write")]
pub fn nfs_write(ctx: FExitContext) -> i32 {
    if ctx.arg::<i64>(2) > 0 {
        finish(write(ctx.arg(0)));
    }
    0
}

#[fexit(function = "nfs_file_mmap")]
pub fn nfs_mapped(ctx: FExitContext) -> i32 {
    finish(mapped(ctx.arg(0), ctx.arg(2)));
    0
}

#[fentry(function = "nfs_file_release")]
pub fn nfs_released(ctx: FEntryContext) -> i32 {
    finish(released(ctx.arg(1)));
    0
}

#[fentry(function = "nfs_closedir")]
pub fn nfs_dir_closed(ctx: FEntryContext) -> i32 {
    finish(released(ctx.arg(1)));
    0
}

/// `nfs_lookup(dir, dentry, flags)`, returning an alias, an error, or NULL.
#[fexit(function = "nfs_lookup")]
pub fn nfs_looked_up(ctx: FExitContext) -> i32 {
    finish(looked_up(ctx.arg(1), ctx.arg(3)));
    0
}

#[fentry(function = "nfs_unlink")]
pub fn nfs_unlinking(ctx: FEntryContext) -> i32 {
    changing([ctx.arg(1), 0], [kind::UNLINK, 0]);
    0
}

/// `nfs_unlink(dir, dentry)`, returning 0 or an error.
#[fexit(function = "nfs_unlink")]
pub fn nfs_unlinked(ctx: FExitContext) -> i32 {
    answered(ctx.arg(2));
    0
}

#[fentry(function = "nfs_rmdir")]
pub fn nfs_rmdiring(ctx: FEntryContext) -> i32 {
    changing([ctx.arg(1), 0], [kind::RMDIR, 0]);
    0
}

/// `nfs_rmdir(dir, dentry)`, returning 0 or an error (ENOTEMPTY from the server).
#[fexit(function = "nfs_rmdir")]
pub fn nfs_rmdired(ctx: FExitContext) -> i32 {
    answered(ctx.arg(2));
    0
}

/// `nfs_mkdir(idmap, dir, dentry, mode)`.
#[fentry(function = "nfs_mkdir")]
pub fn nfs_mkdired(ctx: FEntryContext) -> i32 {
    finish(changed(ctx.arg(2), kind::MKDIR, 0).map(|_| ()));
    0
}

/// `nfs_rename(idmap, old_dir, old_dentry, new_dir, new_dentry, flags)`.
#[fentry(function = "nfs_rename")]
pub fn nfs_renaming(ctx: FEntryContext) -> i32 {
    changing(
        [ctx.arg(2), ctx.arg(4)],
        [kind::RENAME_FROM, kind::RENAME_TO],
    );
    0
}

#[fexit(function = "nfs_rename")]
pub fn nfs_renamed(ctx: FExitContext) -> i32 {
    answered(ctx.arg(6));
    0
}

/// `nfs_setattr(idmap, dentry, attr)`: a truncate, by a path, a descriptor or an
/// O_TRUNC open.
#[fentry(function = "nfs_setattr")]
pub fn nfs_setattring(ctx: FEntryContext) -> i32 {
    if resizes(Typed(ctx.arg(2))) {
        changing([ctx.arg(1), 0], [kind::TRUNCATE, 0]);
    }
    0
}

#[fexit(function = "nfs_setattr")]
pub fn nfs_setattred(ctx: FExitContext) -> i32 {
    answered(ctx.arg(3));
    0
}

/// Reports the changes by `dentries` (0: none) as `kinds`, each numbered for the
/// answer this thread's exit from the call gives (unnumbered, counted at once, when
/// too many threads await theirs).
fn changing(dentries: [u64; 2], kinds: [u8; 2]) {
    if !learning() {
        return;
    }
    let thread = bpf_get_current_pid_tgid() as u32;
    let awaited = CHANGING.insert(&thread, &[0, 0], 0).is_ok();
    let mut numbers = [0u64; 2];
    for i in 0..2 {
        if dentries[i] == 0 {
            continue;
        }
        match changed(dentries[i], kinds[i], u64::from(awaited)) {
            Ok(number) => numbers[i] = number,
            Err(skip) => finish(Err(skip)),
        }
    }
    if awaited {
        if numbers == [0, 0] {
            let _ = CHANGING.remove(&thread);
        } else if let Some(entry) = CHANGING.get_ptr_mut(&thread) {
            // SAFETY: map value pointer, valid for this program run.
            unsafe { *entry = numbers };
        }
    }
}

/// The server's answer (`ret`, an int: 0 accepted) to the changes this thread's call
/// reported at its entry.
fn answered(ret: u64) {
    let thread = bpf_get_current_pid_tgid() as u32;
    // SAFETY: plain value copy.
    let Some(numbers) = (unsafe { CHANGING.get(&thread).copied() }) else {
        return;
    };
    let _ = CHANGING.remove(&thread);
    let tgid = current().map_or(0, |(_, tgid)| tgid);
    for number in numbers {
        if number != 0 {
            let h = Header {
                file_id: number,
                bytes: i64::from(ret as i32) as u64,
                ..Header::new(kind::CHANGE_ANSWERED, tgid)
            };
            emit(&h, None, 0);
        }
    }
}

/// An open that succeeded (`ret` 0) and opened `file`: reported where it lies, with its
/// flags and `more`, and followed.
fn opened(file: u64, ret: i64, more: u32) -> Step {
    if ret as i32 != 0 || !learning() {
        return Err(Skip::Unwatched);
    }
    let (_, tgid) = current().or_skip()?;
    let typed = Typed(file);
    let f = File::of(typed);
    let (mount, dentry) = f.place().or_skip()?;
    if dentry.address() == 0 {
        return Err(Skip::Unwatched); // an atomic open that only looked the name up
    }
    let located = locate(mount, dentry).or_skip()?;
    let file_id = next_id();
    let h = Header {
        file_id,
        open_flags: flags(typed) | more,
        ..Header::new(kind::OPEN, tgid)
    };
    emit(&h, Some(target(0, Some(located)).or_skip()?), 0);
    let uid = bpf_get_current_uid_gid() as u32;
    if !take_place(uid) {
        count(counter::LOST_OPEN_FILES_OF_USER);
        closed(file_id, 0, 0); // reported closed rather than left open
        return Ok(());
    }
    let entry = OpenFile {
        file_id,
        uid,
        ..OpenFile::default()
    };
    if NFS_FILES.insert(&f.address(), &entry, 0).is_err() {
        give_place(uid);
        count(counter::LOST_OPEN_FILES_FULL);
        closed(file_id, 0, 0);
    }
    Ok(())
}

/// Counts a file of `uid`'s in `NFS_FILES`, unless they have their share of it (or the
/// count of users is full). Two CPUs at once may both take the last place: a bound,
/// not a count to the file.
fn take_place(uid: u32) -> bool {
    if NFS_FILES_OF.get_ptr_mut(&uid).is_none() && NFS_FILES_OF.insert(&uid, &0, 1).is_err() {
        // BPF_NOEXIST: made meanwhile on another CPU is fine; full is not.
        if NFS_FILES_OF.get_ptr_mut(&uid).is_none() {
            return false;
        }
    }
    let Some(n) = NFS_FILES_OF.get_ptr_mut(&uid) else {
        return false;
    };
    // SAFETY: map value pointer, valid for this program run; the add is atomic.
    unsafe {
        if *n >= MAX_REQUEST_FILES_PER_USER {
            return false;
        }
        core::intrinsics::atomic_xadd::<u32, u32, { core::intrinsics::AtomicOrdering::Relaxed }>(
            n, 1,
        );
    }
    true
}

/// Gives back a place `take_place` counted; a user with none left is forgotten, so
/// that the users who ever opened an NFS file never fill `NFS_FILES_OF` (an open on
/// another CPU in between loses its count: the bound is then one looser).
fn give_place(uid: u32) {
    let Some(n) = NFS_FILES_OF.get_ptr_mut(&uid) else {
        return;
    };
    // SAFETY: as in `take_place`; adding u32::MAX takes one away.
    let none_left = unsafe {
        if *n > 0 {
            core::intrinsics::atomic_xadd::<u32, u32, { core::intrinsics::AtomicOrdering::Relaxed }>(
                n,
                u32::MAX,
            );
        }
        *n == 0
    };
    if none_left {
        let _ = NFS_FILES_OF.remove(&uid);
    }
}

/// The followed file a kiocb is on.
fn followed(kiocb: u64) -> Step<*mut OpenFile> {
    let file = file_of_kiocb(Typed(kiocb)).or_skip()?;
    NFS_FILES
        .get_ptr_mut(&file.address())
        .ok_or(Skip::Unwatched)
}

/// A read that returned `ret` bytes, added to its file, and where they lie (the
/// kiocb's position, which the read moved past them) to its run of grains.
fn read(kiocb: u64, ret: i64) -> Step {
    if ret <= 0 {
        return Err(Skip::Unwatched);
    }
    let file = followed(kiocb)?;
    let bytes = ret as u64;
    add_read(file, bytes);
    let offset = position(Typed(kiocb)).saturating_sub(bytes);
    // SAFETY: map value pointer, valid for this program run.
    let (run, file_id) = unsafe { (&raw mut (*file).run, (*file).file_id) };
    add_range(run, file_id, offset, bytes);
    Ok(())
}

/// A write through a followed file: the first marks it written.
fn write(kiocb: u64) -> Step {
    let file = followed(kiocb)?;
    first_write(file, kind::WRITE, current().map_or(0, |(_, tgid)| tgid));
    Ok(())
}

/// A followed file mapped (`ret` 0): the pages that enter its page cache are counted
/// from now on, as `syscall_exit` does.
fn mapped(file: u64, ret: i64) -> Step {
    if ret as i32 != 0 {
        return Err(Skip::Unwatched);
    }
    let f = File::of(Typed(file));
    // SAFETY: plain value copy.
    let file_id = unsafe { NFS_FILES.get(&f.address()).or_skip()?.file_id };
    let (mount, dentry) = f.place().or_skip()?;
    let tgid = current().map_or(0, |(_, tgid)| tgid);
    open_files::mapped(&inode_of(mount, dentry).or_skip()?, file_id, tgid);
    Ok(())
}

/// The last close of a followed file: reported with its bytes.
fn released(file: u64) -> Step {
    let key = File::of(Typed(file)).address();
    // SAFETY: plain value copy.
    let entry = unsafe { *NFS_FILES.get(&key).or_skip()? };
    if NFS_FILES.remove(&key).is_ok() {
        give_place(entry.uid);
    }
    closed(entry.file_id, entry.bytes_read, entry.run);
    Ok(())
}

/// A lookup that left `dentry` negative (`ret` NULL, no inode): a missing name, unless
/// the name is to be made (an O_CREAT open, whose exclusive lookup the client skips; a
/// rename's target).
fn looked_up(dentry: u64, ret: u64) -> Step {
    if ret != 0 || !learning() {
        return Err(Skip::Unwatched);
    }
    let (_, tgid) = current().or_skip()?;
    let d = Typed(dentry);
    if d.read::<u64>(offset(|o| &o.dentry_inode)) != 0 {
        return Err(Skip::Unwatched);
    }
    if syscall::current().is_some_and(|(l, args)| l.op == op::RENAME || opens_to_create(l, &args)) {
        return Ok(());
    }
    let (mount, dentry) = placed(d);
    let t = target(0, Some(locate(mount, dentry).or_skip()?)).or_skip()?;
    emit(&Header::new(kind::MISSING, tgid), Some(t), 0);
    Ok(())
}

/// A change by a name: `dentry`, reported as `kind` where it lies; numbered (its
/// number returned) if `numbered` is 1, for the answer to come.
fn changed(dentry: u64, kind: u8, numbered: u64) -> Step<u64> {
    if !learning() {
        return Err(Skip::Unwatched);
    }
    let (_, tgid) = current().or_skip()?;
    let (mount, dentry) = placed(Typed(dentry));
    let t = target(0, Some(locate(mount, dentry).or_skip()?)).or_skip()?;
    let number = if numbered != 0 { next_id() } else { 0 };
    let h = Header {
        file_id: number,
        ..Header::new(kind, tgid)
    };
    emit(&h, Some(t), 0);
    Ok(number)
}
