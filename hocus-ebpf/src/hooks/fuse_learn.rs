//! fuse_learn, on `tp_btf/fuse_request_send` and `tp_btf/fuse_request_end`: learning
//! what jobs do on a watched FUSE mount from the requests its server gets, while
//! `syscall_exit` rests (`rest::LEARNING_BY_REQUESTS`), so that no other process on the
//! node pays for it.
//!
//! A request made in a path walk is placed by the walk (`current->nameidata`): an OPEN
//! (or OPENDIR) by the file being opened, a LOOKUP by the directory looked in and the
//! name asked, a CREATE by both. Every open of a FUSE file is an OPEN request, and
//! every byte read from the server a READ, so nothing a job reads from the network goes
//! unseen; what the page cache serves was not read from it. Files are followed by the
//! handle the server gave each open (`REQUEST_FILES`): the bytes READs bring back are
//! added there, the first WRITE marks it written, and its RELEASE reports it closed with
//! its bytes. A LOOKUP is reported asked; its ENOENT, answered at the request's end,
//! makes it a failed lookup (unless the walk is a create's). A change by a name (an
//! UNLINK, RMDIR, MKDIR or RENAME) is made outside any walk: its dentries are found by
//! their names, which the request points to, where a name is short enough to be kept
//! inside its dentry; else by the paths the syscall was given, as `syscall_exit` places
//! them (one that cannot be is counted, `counter::CHANGE_UNPLACED`). A SETATTR that
//! changes the size marks the open file it goes through written, or else is placed by
//! the path `truncate` was given. Changes are reported as they
//! are asked, before the server answers: a change that fails drops a copy for nothing,
//! which is safe.

use aya_ebpf::{
    helpers::generated,
    macros::{btf_tracepoint, map},
    maps::{HashMap, LruHashMap},
    programs::BtfTracePointContext,
};
use hocus_common::{
    MAX_PATH, OpenFile, counter, kind, op,
    requests::{
        FATTR_FH, FATTR_SIZE, MAX_PENDING_OPENS, MAX_REQUEST_FILES, O_DIRECTORY, RequestKey, opcode,
    },
};

use crate::{
    agent::current,
    emit::{Header, Target, closed, emit, next_id, target},
    kernel::requests::{Request, Walk, walk},
    locate::locate,
    open_files::{add_range, add_read, first_write},
    paths::path_target,
    skip::{OrSkip, Skip, Step, count, finish},
    syscall::{self, opens_to_create},
    tripwire::{is_watched_device, learning},
};

const ENOENT: i32 = 2;
/// Longest name of one directory entry.
const NAME_MAX: u32 = 255;
/// Size of `struct fuse_open_in` (flags, open_flags), `fuse_create_in`, and of the
/// handle at the start of `fuse_read_in`, `fuse_write_in` and `fuse_release_in`.
const OPEN_IN: u32 = 8;
const CREATE_IN: u32 = 16;
/// `struct fuse_setattr_in`: valid, padding, fh (at 8), size ...
const SETATTR_IN: u32 = 88;
const SETATTR_FH: u32 = 8;
const HANDLE: u32 = 8;
/// `struct fuse_out_header`, before a reply's data.
const OUT_HEADER: u32 = 16;

/// Files opened through watched FUSE mounts, by the server's handle.
#[map]
static REQUEST_FILES: HashMap<RequestKey, OpenFile> =
    HashMap::with_max_entries(MAX_REQUEST_FILES, 0);
/// Opens and creates sent, by their request number (`nodeid`): the file id reported,
/// until the reply names the handle.
#[map]
static PENDING_OPENS: LruHashMap<RequestKey, u64> =
    LruHashMap::with_max_entries(MAX_PENDING_OPENS, 0);
/// LOOKUPs reported asked, by their request number (`nodeid`), until their answer:
/// only theirs is reported (the agent's own lookups, copies failing on files gone from
/// the server, would flood the ring buffer).
#[map]
static LOOKUPS_ASKED: LruHashMap<RequestKey, u8> =
    LruHashMap::with_max_entries(MAX_PENDING_OPENS, 0);

#[btf_tracepoint(function = "fuse_request_send")]
pub fn fuse_sent(ctx: BtfTracePointContext) -> i32 {
    finish(try_sent(Request::of(ctx.arg(0))));
    0
}

#[btf_tracepoint(function = "fuse_request_end")]
pub fn fuse_ended(ctx: BtfTracePointContext) -> i32 {
    finish(try_ended(Request::of(ctx.arg(0))));
    0
}

fn try_sent(req: Request) -> Step {
    let dev = req.dev().or_skip()?;
    if !is_watched_device(dev) {
        return Err(Skip::Unwatched);
    }
    let op = req.opcode();
    // The files already followed are followed to their release, whatever the rest.
    match op {
        opcode::WRITE => return mark_written(&handle(req, dev)?, kind::WRITE),
        opcode::RELEASE | opcode::RELEASEDIR => return released(req, dev),
        _ => {}
    }
    if !learning() {
        return Err(Skip::Unwatched);
    }
    // The agent's own work on the mount (copies, checks) is not the workload.
    let (_, tgid) = current().or_skip()?;
    match op {
        opcode::OPEN | opcode::OPENDIR | opcode::CREATE => opened(req, dev, tgid, op),
        opcode::LOOKUP => asked(req, dev, tgid),
        opcode::UNLINK => changed(req, tgid, kind::UNLINK),
        opcode::RMDIR => changed(req, tgid, kind::RMDIR),
        opcode::MKDIR => changed(req, tgid, kind::MKDIR),
        opcode::RENAME | opcode::RENAME2 => changed(req, tgid, kind::RENAME_FROM),
        opcode::SETATTR => resized(req, dev, tgid),
        _ => Ok(()),
    }
}

fn try_ended(req: Request) -> Step {
    let dev = req.dev().or_skip()?;
    if !is_watched_device(dev) {
        return Err(Skip::Unwatched);
    }
    let (len, error) = req.reply();
    match req.opcode() {
        opcode::READ if error == 0 => read(req, dev, len),
        opcode::OPEN | opcode::OPENDIR | opcode::CREATE => answered_open(req, dev, error),
        opcode::LOOKUP => answered_lookup(req, dev, error),
        _ => Ok(()),
    }
}

/// An OPEN or OPENDIR (the walk is at the file) or a CREATE (the walk is in the
/// directory, at the new name): reported opened, with a file id its reply will tie to
/// the server's handle.
#[inline(never)]
fn opened(req: Request, dev: u32, tgid: u32, op: u32) -> Step {
    let w = walk().or_skip()?;
    let flags = if op == opcode::CREATE {
        req.input_word(0, 0, CREATE_IN).or_skip()? as u32
    } else {
        let flags = req.input_word(0, 0, OPEN_IN).or_skip()? as u32;
        if op == opcode::OPENDIR {
            flags | O_DIRECTORY
        } else {
            flags
        }
    };
    let t = if op == opcode::CREATE {
        named(&w)?
    } else {
        target(0, Some(locate(w.mount, w.dentry).or_skip()?)).or_skip()?
    };
    let file_id = next_id();
    let _ = PENDING_OPENS.insert(&pending(dev, req.unique()), &file_id, 0);
    let h = Header {
        file_id,
        open_flags: flags,
        ..Header::new(kind::OPEN, tgid)
    };
    emit(&h, Some(t), 0);
    Ok(())
}

/// The reply to an open: the file is followed by the handle it names; a refused open is
/// reported closed at once, having read nothing.
fn answered_open(req: Request, dev: u32, error: i32) -> Step {
    let key = pending(dev, req.unique());
    // SAFETY: plain value copy.
    let file_id = unsafe { *PENDING_OPENS.get(&key).or_skip()? };
    let _ = PENDING_OPENS.remove(&key);
    if error != 0 {
        closed(file_id, 0, 0);
        return Ok(());
    }
    let key = if req.opcode() == opcode::CREATE {
        // fuse_entry_out, then fuse_open_out.
        RequestKey::new(
            dev,
            req.output_word(0).or_skip()?,
            req.output_word(1).or_skip()?,
        )
    } else {
        RequestKey::new(dev, req.nodeid(), req.output_word(0).or_skip()?)
    };
    let file = OpenFile {
        file_id,
        ..OpenFile::default()
    };
    if REQUEST_FILES.insert(&key, &file, 0).is_err() {
        closed(file_id, 0, 0); // full: reported closed rather than left open
    }
    Ok(())
}

/// A LOOKUP in a walk: reported asked, by the directory and the name; its end says
/// whether the name was missing.
#[inline(never)]
fn asked(req: Request, dev: u32, tgid: u32) -> Step {
    let w = walk().or_skip()?;
    // An O_CREAT open's: the name is made next. (The walk's own intent flags moved
    // between kernels; the syscall's did not.)
    if syscall::current().is_some_and(|(l, args)| opens_to_create(l, &args)) {
        return Ok(());
    }
    let t = named(&w)?;
    let _ = LOOKUPS_ASKED.insert(&pending(dev, req.unique()), &1, 0);
    let h = Header {
        file_id: req.unique(),
        bytes: u64::from(dev),
        ..Header::new(kind::LOOKUP_ASKED, tgid)
    };
    emit(&h, Some(t), 0);
    Ok(())
}

/// The answer to a LOOKUP reported asked: "no such name" (ENOENT, or a negative entry,
/// node id 0, which the kernel may keep) is reported.
fn answered_lookup(req: Request, dev: u32, error: i32) -> Step {
    let key = pending(dev, req.unique());
    LOOKUPS_ASKED.get_ptr(&key).or_skip()?;
    let _ = LOOKUPS_ASKED.remove(&key);
    if error == -ENOENT || (error == 0 && req.output_word(0) == Some(0)) {
        let h = Header {
            file_id: key.nodeid,
            bytes: u64::from(dev),
            ..Header::new(kind::LOOKUP_FAILED, 0)
        };
        emit(&h, None, 0);
    }
    Ok(())
}

/// The key of request `unique` on mount `dev` while its answer is awaited.
fn pending(dev: u32, unique: u64) -> RequestKey {
    RequestKey::new(dev, unique, 0)
}

/// The walk's directory, placed, with the name it looked up as the path below it
/// (scratch slot 0).
fn named(w: &Walk) -> Step<&'static Target> {
    let located = locate(w.mount, w.dentry).or_skip()?;
    let len = w.name_len;
    if len == 0 || len > NAME_MAX {
        return Err(Skip::PathTruncated);
    }
    let buf = crate::emit::SCRATCH.get_ptr_mut(0).or_skip()?;
    // SAFETY: per-CPU scratch owned by this program run; the name is read with the
    // fault-tolerant helper, its size bounded in its own register (see `locate`).
    unsafe {
        let size = core::ptr::read_volatile(&len) & NAME_MAX;
        generated::bpf_probe_read_kernel(
            (*buf).bytes.as_mut_ptr().cast(),
            size,
            w.name as *const _,
        );
        (*buf).bytes[(size as usize) & (MAX_PATH - 1)] = 0;
    }
    let t = target(0, Some(located)).or_skip()?;
    t.len = len;
    Ok(t)
}

/// The bytes a READ brought back, added to its file, and where they lie (struct
/// fuse_read_in: fh, then offset) to its run of grains.
fn read(req: Request, dev: u32, len: u32) -> Step {
    let file = REQUEST_FILES.get_ptr_mut(&handle(req, dev)?).or_skip()?;
    let bytes = u64::from(len.saturating_sub(OUT_HEADER));
    add_read(file, bytes);
    if bytes > 0 {
        let offset = req.input_word(0, 8, 16).or_skip()?;
        // SAFETY: map value pointer, valid for this program run.
        let (run, file_id) = unsafe { (&raw mut (*file).run, (*file).file_id) };
        add_range(run, file_id, offset, bytes);
    }
    Ok(())
}

/// A change by a name: its dentries, found by the names the request points to (the
/// name's for an unlink, rmdir or mkdir; the old and the new name's for a rename, in
/// that order), reported as `kind` (the new name as `RENAME_TO`). A name too long to be
/// kept in its dentry is placed by the path the syscall was given instead, where that
/// path means what it means to the agent (relative, or absolute in a known namespace).
fn changed(req: Request, tgid: u32, kind: u8) -> Step {
    let names = if kind == kind::RENAME_FROM { 2 } else { 1 };
    let mut dentries = [None, None];
    // The names follow the op's own struct, if any (and, from 6.13, an empty first
    // argument): the first arguments that are names in dentries are the ones, unless a
    // long one is among them.
    let mut found = 0;
    for i in 0..3 {
        if found < names {
            if let Some(d) = req.named_dentry(i) {
                dentries[found] = Some(d);
                found += 1;
            }
        }
    }
    if found < names {
        // Which name is the long one is not known: both are taken from the syscall.
        dentries = [None, None];
    }
    for (position, dentry) in dentries.into_iter().enumerate().take(names) {
        let k = if position == 0 { kind } else { kind::RENAME_TO };
        let placed = match dentry {
            Some((mount, dentry)) => {
                // Outside the watched trees: nothing to report.
                locate(mount, dentry)
                    .and_then(|l| target(0, Some(l)))
                    .map(|t| (&*t, 0))
            }
            None => by_syscall(position as u32).map(|t| (t, position as u32)),
        };
        match placed {
            Some((t, slot)) => emit(&Header::new(k, tgid), Some(t), slot),
            None if dentry.is_none() => count(counter::CHANGE_UNPLACED),
            None => {}
        }
    }
    Ok(())
}

/// The path argument at `position` (0: the only or old one, 1: the new one) of the
/// change by a path the current task's syscall makes (unlink, rmdir, mkdir, rename,
/// truncate), placed as the syscall program would; None
/// where it cannot be (an absolute path in a namespace whose view is not known).
fn by_syscall(position: u32) -> Option<&'static Target> {
    let (l, args) = syscall::current()?;
    if !matches!(
        l.op,
        op::UNLINK | op::RMDIR | op::MKDIR | op::RENAME | op::TRUNCATE
    ) {
        return None;
    }
    let (dfd, path) = if position == 0 {
        (l.dfd, l.path)
    } else {
        (l.dfd2, l.path2)
    };
    path_target(args.dfd(dfd), args.get(path)?, position)
}

/// A SETATTR that changes the size: through a followed file, it is marked written; by
/// a path (`truncate`), placed by the path the syscall was given.
#[inline(never)]
fn resized(req: Request, dev: u32, tgid: u32) -> Step {
    let valid = req.input_word(0, 0, SETATTR_IN).or_skip()? as u32;
    if valid & FATTR_SIZE == 0 {
        return Ok(()); // modes, owners, times: not what a profile keeps
    }
    if valid & FATTR_FH == 0 {
        match by_syscall(0) {
            Some(t) => emit(&Header::new(kind::TRUNCATE, tgid), Some(t), 0),
            None => count(counter::CHANGE_UNPLACED),
        }
        return Ok(());
    }
    let fh = req.input_word(0, SETATTR_FH, SETATTR_IN).or_skip()?;
    mark_written(&RequestKey::new(dev, req.nodeid(), fh), kind::TRUNCATE)
}

/// The file `key` names (a WRITE's, a SETATTR's) is marked written, reported once as
/// `kind` (a write or a truncate).
fn mark_written(key: &RequestKey, kind: u8) -> Step {
    let file = REQUEST_FILES.get_ptr_mut(key).or_skip()?;
    // The writer, unless the kernel flushes it later (writeback): then no one's.
    first_write(file, kind, current().map_or(0, |(_, tgid)| tgid));
    Ok(())
}

/// A RELEASE: the file is reported closed, with what it read.
fn released(req: Request, dev: u32) -> Step {
    let key = handle(req, dev)?;
    // SAFETY: plain value copy.
    let file = unsafe { *REQUEST_FILES.get(&key).or_skip()? };
    let _ = REQUEST_FILES.remove(&key);
    closed(file.file_id, file.bytes_read, file.run);
    Ok(())
}

/// The file a READ, WRITE or RELEASE is about: its node and the handle its first input
/// argument starts with.
fn handle(req: Request, dev: u32) -> Step<RequestKey> {
    let fh = req.input_word(0, 0, HANDLE).or_skip()?;
    Ok(RequestKey::new(dev, req.nodeid(), fh))
}
