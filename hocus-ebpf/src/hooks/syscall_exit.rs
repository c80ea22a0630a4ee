//! syscall_exit, on `tp_btf/sys_exit`: every syscall of every process on the node passes
//! here, so anything not traced costs a plain load (its number, from the saved
//! registers) and one table lookup, and a process not followed (`follow`) one more load
//! of its bit. The arguments are read from the saved registers too (the kernel does not
//! change them) and the result is the tracepoint's second argument. Nothing runs at
//! syscall entry: a program there would cost every syscall on the node a second run.
//!
//! What each traced syscall does, one function each: an open places what it opened
//! (`open`); a read adds its bytes and where it read to the open file (`read`); the first write to a file
//! is reported once it succeeded (`written`); a close forgets its descriptor (`close`);
//! a first mapping starts counting the file's pages (`mapped`); failed lookups and
//! mutations are placed by where their path lies (`rename`, `path_syscall`); a mount
//! makes learned views stale. For the agent's own threads: answer `CALIBRATE`, and take
//! a job's new mount namespace as known (`agent_syscall`).
//!
//! The checks of `is_compat` (a read of the task) come after the cheap tests that turn
//! away almost every syscall on the node, and before anything is changed or sent. The
//! functions are inlined into the one program, as they were written before they were
//! split: the verifier sees the same code.

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_kernel_str_bytes},
    macros::{btf_tracepoint, map},
    maps::Array,
    programs::BtfTracePointContext,
};
use hocus_common::{Calibration, FdKey, SyscallLayout, kind, op};

use crate::{
    agent::self_tgid,
    emit::{Header, emit, next_id, target},
    follow::{is_followed, may_reach_watched},
    kernel::{
        Typed, field,
        files::{File, file_at, inode_of},
        offset,
        task::{cwd, is_compat, namespace_of, nsproxy},
    },
    locate::{Located, locate},
    open_files::{
        self, add_range, add_read, claim_close, entry, file_of, first_write, forget, remember,
        watched_file,
    },
    paths::{KNOWN_NAMESPACES, mounts_change, path_target},
    skip::{OrSkip, Skip, Step, finish},
    syscall::{Args, layout, open_flags},
};

const ENOENT: i64 = 2;
const EROFS: i64 = 30;
const O_ACCMODE: u32 = 0o3;
const O_CREAT: u32 = 0o100;
const O_TRUNC: u32 = 0o1000;
/// mmap's results above this are errors (-4095..-1).
const MAX_ERRNO: u64 = 4095;

/// The agent's question about one of its descriptors, and the answer.
#[map]
static CALIBRATE: Array<Calibration> = Array::with_max_entries(1, 0);

#[btf_tracepoint(function = "sys_exit")]
pub fn syscall_exit(ctx: BtfTracePointContext) -> i32 {
    finish(try_syscall_exit(&ctx));
    0
}

fn try_syscall_exit(ctx: &BtfTracePointContext) -> Step {
    let regs = Typed(ctx.arg(0));
    let nr: i64 = regs.read(offset(|o| &o.regs_nr));
    if is_ia32_mount(nr) && is_compat() {
        mounts_change();
        return Err(Skip::Compat);
    }
    let l = layout(nr).or_skip()?;
    let ret: i64 = ctx.arg(1);
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if tgid == self_tgid() {
        return agent_syscall(l, pid_tgid, ret);
    }
    // After the mount, whoever made it: a view learned while it was under way is stale.
    if l.op == op::MOUNTS_CHANGE {
        mounts_change();
        return Ok(());
    }
    if !is_followed(tgid) {
        return Err(Skip::Unwatched);
    }
    let call = Call {
        args: Args::of(regs),
        layout: l,
        ret,
        thread: pid_tgid as u32,
        tgid,
    };
    match l.op {
        op::READ if ret > 0 => read(&call),
        // A close, or a dup2/dup3 onto the descriptor, whatever the result.
        op::CLOSE => close(&call),
        // A failed write changes nothing.
        op::WRITE | op::FTRUNCATE if (l.op == op::WRITE && ret > 0) || ret == 0 => written(&call),
        op::MMAP if (ret as u64) < u64::MAX - MAX_ERRNO => mapped(&call),
        op::OPEN if ret >= 0 => open(&call),
        op::RENAME if ret == 0 => rename(&call),
        _ => path_syscall(&call),
    }
}

/// Whether `nr` is, in the 32-bit numbering, mount, umount, umount2, pivot_root or
/// move_mount: a 32-bit mount changes what paths mean as much as a 64-bit one.
fn is_ia32_mount(nr: i64) -> bool {
    matches!(nr, 21 | 22 | 52 | 217 | 429)
}

/// A traced syscall of a followed process, at its exit.
struct Call {
    args: Args,
    layout: &'static SyscallLayout,
    ret: i64,
    thread: u32,
    tgid: u32,
}

impl Call {
    fn header(&self, kind: u8, file_id: u64, open_flags: u32) -> Header {
        Header {
            kind,
            tgid: self.tgid,
            file_id,
            bytes: 0,
            open_flags,
        }
    }

    /// The descriptor argument.
    fn fd(&self) -> Step<u32> {
        Ok(self.args.get(self.layout.fd).or_skip()? as u32)
    }

    /// An open's flags.
    fn open_flags(&self) -> u32 {
        open_flags(&self.args, self.layout)
    }
}

/// A read: its bytes are added to the open file's, and where it read to the file's
/// run of grains, in the kernel. A positioned read says where; any other (and preadv2
/// at -1) read from the file's position, which it moved on by what it returned.
#[inline(always)]
fn read(c: &Call) -> Step {
    let file = watched_file(c.fd()?, c.tgid)?;
    let bytes = c.ret as u64;
    add_read(file, bytes);
    let offset = match c.args.get(c.layout.pos) {
        Some(pos) if (pos as i64) >= 0 => pos,
        _ => field::<u64>(file_of(file), offset(|o| &o.file_pos))
            .or_skip()?
            .saturating_sub(bytes),
    };
    // SAFETY: map value pointer, valid for this program run.
    let (run, file_id) = unsafe { (&raw mut (*file).run, (*file).file_id) };
    add_range(run, file_id, offset, bytes);
    Ok(())
}

/// A close, or a dup2/dup3 onto the descriptor, whatever the result: what the
/// descriptor holds now tells whether it still holds the watched file.
#[inline(always)]
fn close(c: &Call) -> Step {
    let fd = c.fd()?;
    let entry = entry(c.tgid, fd).or_skip()?;
    let file = file_of(entry);
    if file == 0 {
        return Err(Skip::Unwatched);
    }
    if is_compat() {
        return Err(Skip::Compat);
    }
    // Still the same file (a failed close or dup2, a dup2 onto itself); or another
    // thread of the process opened a file at the freed number since and that open's exit
    // took the entry: it is that file's now.
    if file_at(fd).map(File::address) == Some(file) {
        return Ok(());
    }
    // The entry stays, closed: an open of another thread may be taking it for the number
    // at this moment, and a delete would lose that open. The next open at the number
    // reuses it; the agent removes a gone process's.
    let (file_id, bytes) = claim_close(entry).or_skip()?;
    let h = Header {
        bytes,
        ..c.header(kind::CLOSE, file_id, 0)
    };
    emit(&h, None, 0);
    Ok(())
}

/// A successful write or ftruncate: the first one through an open file marks it
/// written.
#[inline(always)]
fn written(c: &Call) -> Step {
    let file = watched_file(c.fd()?, c.tgid)?;
    let k = if c.layout.op == op::WRITE {
        kind::WRITE
    } else {
        kind::TRUNCATE
    };
    first_write(file, k, c.tgid);
    Ok(())
}

/// A successful mmap of a watched descriptor: the pages that enter the file's page cache
/// are counted from now on (`filemap`).
#[inline(always)]
fn mapped(c: &Call) -> Step {
    // Anonymous memory (fd -1) is almost every mmap on the node: no lookup.
    let fd = c.fd()? as i32;
    if fd < 0 {
        return Err(Skip::Unwatched);
    }
    let file = watched_file(fd as u32, c.tgid)?;
    // SAFETY: map value pointer, valid for this program run.
    let file_id = unsafe { (*file).file_id };
    let (mount, dentry) = file_at(fd as u32).and_then(File::place).or_skip()?;
    open_files::mapped(&inode_of(mount, dentry).or_skip()?, file_id, c.tgid);
    Ok(())
}

/// A successful open: placed by what it opened; reported, and remembered by descriptor,
/// if it lies under a root.
#[inline(always)]
fn open(c: &Call) -> Step {
    let fd = c.ret as u32;
    let key = FdKey { tgid: c.tgid, fd };
    // The descriptor number may still name a watched file whose close was not seen
    // (closed by exec or close_range), or whose close's exit has not run yet (another
    // thread's close, racing this open for the number): it is reported closed here, so
    // that no close is lost uncounted. Filtered and looked up first: almost every open on
    // the node misses.
    let stale = entry(c.tgid, fd);
    if let Some(old) = stale {
        if is_compat() {
            return Err(Skip::Compat);
        }
        if let Some((file_id, bytes)) = claim_close(old) {
            let h = Header {
                bytes,
                ..c.header(kind::CLOSE, file_id, 0)
            };
            emit(&h, None, 0);
        }
    }
    let Some((file, located)) = opened(fd) else {
        if stale.is_some() {
            forget(&key);
        }
        return Err(Skip::Unwatched);
    };
    if is_compat() {
        return Err(Skip::Compat);
    }
    let file_id = next_id();
    remember(&key, stale, file_id, file);
    let target = target(0, Some(located)).or_skip()?;
    emit(
        &c.header(kind::OPEN, file_id, c.open_flags()),
        Some(target),
        0,
    );
    Ok(())
}

/// What descriptor `fd`, just opened, is: its `struct file`'s address and where it
/// lies, if under a root.
fn opened(fd: u32) -> Option<(u64, Located)> {
    let file = file_at(fd)?;
    let (mount, dentry) = file.place()?;
    Some((file.address(), locate(mount, dentry)?))
}

/// A successful rename: both of its paths, where they lie.
#[inline(always)]
fn rename(c: &Call) -> Step {
    if !may_reach_watched(c.thread) {
        return Err(Skip::Unwatched);
    }
    if is_compat() {
        return Err(Skip::Compat);
    }
    let (args, l) = (&c.args, c.layout);
    // One after the other: both use the same walk buffer.
    if let Some(t) = path_target(args.dfd(l.dfd), args.get(l.path).or_skip()?, 0) {
        emit(&c.header(kind::RENAME_FROM, 0, 0), Some(t), 0);
    }
    if let Some(t) = path_target(args.dfd(l.dfd2), args.get(l.path2).or_skip()?, 1) {
        emit(&c.header(kind::RENAME_TO, 0, 0), Some(t), 1);
    }
    Ok(())
}

/// A failed lookup (ENOENT), a successful mutation by path, or a write a read-only bind
/// refused (EROFS): placed by where its path lies.
#[inline(always)]
fn path_syscall(c: &Call) -> Step {
    let (l, ret) = (c.layout, c.ret);
    let k = match l.op {
        // A job wrote into a read-only local copy: the agent invalidates it.
        op::OPEN | op::UNLINK | op::RMDIR | op::MKDIR | op::RENAME | op::TRUNCATE
            if ret == -EROFS =>
        {
            kind::REFUSED_WRITE
        }
        op::OPEN | op::LOOKUP if ret == -ENOENT => kind::MISSING,
        op::UNLINK if ret == 0 => kind::UNLINK,
        op::RMDIR if ret == 0 => kind::RMDIR,
        op::MKDIR if ret == 0 => kind::MKDIR,
        op::TRUNCATE if ret == 0 => kind::TRUNCATE,
        _ => return Ok(()),
    };
    // A write a read-only bind refused made no request: looked at whatever.
    let flags = if k == kind::REFUSED_WRITE {
        let flags = c.open_flags();
        if l.op == op::OPEN && flags & (O_ACCMODE | O_CREAT | O_TRUNC) == 0 {
            return Ok(()); // a read-only open cannot be a refused write
        }
        flags
    } else if may_reach_watched(c.thread) {
        0
    } else {
        return Err(Skip::Unwatched);
    };
    // One call site: the verifier follows the walk once, not once per kind.
    let Some(t) = path_target(c.args.dfd(l.dfd), c.args.get(l.path).or_skip()?, 0) else {
        return Err(Skip::Unwatched);
    };
    if is_compat() {
        return Err(Skip::Compat);
    }
    emit(&c.header(k, 0, flags), Some(t), 0);
    Ok(())
}

/// The agent's own syscalls are not the workload, with two exceptions: it asks what one
/// of its descriptors is (`CALIBRATE`), and a namespace it makes for a job is known.
fn agent_syscall(l: &SyscallLayout, pid_tgid: u64, ret: i64) -> Step {
    if let Some(c) = CALIBRATE.get_ptr_mut(0) {
        // SAFETY: map value pointer, valid for this program run.
        let c = unsafe { &mut *c };
        if c.thread == pid_tgid && c.done == 0 && l.op == op::LOOKUP {
            calibrate(c);
        }
    }
    if l.op == op::NEW_NAMESPACE && ret == 0 {
        let (key, _) = nsproxy().and_then(namespace_of).or_skip()?;
        let _ = KNOWN_NAMESPACES.insert(&key, &1, 0);
    }
    Ok(())
}

/// Answers the agent's question: what its descriptor is, read the way the programs read
/// a file, a name and a namespace, for the agent to check against `fstat`.
fn calibrate(c: &mut Calibration) {
    if let Some((mount, dentry)) = file_at(c.fd as u32).and_then(File::place) {
        c.dentry = dentry.address();
        // The superblock as `locate` is given it: the mount's, beside its root.
        c.superblock = mount.sb;
        c.superblock_root = field(mount.sb, offset(|o| &o.sb_root)).unwrap_or(0);
        c.dev = field(c.superblock, offset(|o| &o.sb_dev)).unwrap_or(0);
        // The name as `locate` reads it.
        if let Some((_, len, name)) = dentry.up() {
            c.name_len = len;
            // SAFETY: fault-tolerant read into the map value.
            let _ = unsafe { bpf_probe_read_kernel_str_bytes(name as *const u8, &mut c.name) };
        }
        c.ino = inode_of(mount, dentry).map_or(0, |i| i.ino);
    }

    c.cwd = cwd().map_or(0, |(_, dentry)| dentry.address());
    let nsproxy = nsproxy();
    c.nsproxy = nsproxy.map_or(0, |n| n.0);
    if let Some((key, inum)) = nsproxy.and_then(namespace_of) {
        c.namespace = key;
        c.ns_inum = inum;
    }
    c.done = 1;
}
