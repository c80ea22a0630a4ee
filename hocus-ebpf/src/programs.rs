use aya_ebpf::{
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_current_uid_gid,
        bpf_get_smp_processor_id, bpf_ktime_get_ns, bpf_probe_read_kernel_buf, bpf_probe_read_user,
        bpf_probe_read_user_str_bytes,
    },
    macros::{map, tracepoint},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::TracePointContext,
};
use hocus_common::{
    AT_FDCWD, Event, FdKey, MAX_OPEN_FILES, MAX_PATH, MAX_PREFIX, MAX_PROCESSES, MAX_SYSCALL_NR,
    MAX_WATCHED, NO_FIELD, OpenFile, PREFIX_WORDS, PathBuf, Pending, RING_BYTES, SyscallLayout,
    Watched, counter, cwd, ev, flags_from, kind, op,
};

const ENOENT: i64 = 2;
const EROFS: i64 = 30;
const O_ACCMODE: u32 = 0o3;
const O_CREAT: u32 = 0o100;
const O_WRONLY: u32 = 0o1;
const O_TRUNC: u32 = 0o1000;
const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;
/// Wake the agent only once this much is waiting; it also polls on a short timer. An
/// import storm then costs a handful of wakeups instead of one per event.
const WAKEUP_BYTES: u64 = 256 << 10;

// Set by the agent before loading (aya `set_global`).
#[unsafe(no_mangle)]
static SELF_TGID: u32 = 0;
/// Offset of `__syscall_nr` in sys_enter/sys_exit records (tracefs format).
#[unsafe(no_mangle)]
static NR_OFFSET: u32 = 8;
/// Offset of `ret` in sys_exit records (tracefs format).
#[unsafe(no_mangle)]
static RET_OFFSET: u32 = 16;
/// Offsets of `parent_pid` and `child_pid` in sched_process_fork records.
#[unsafe(no_mangle)]
static FORK_PARENT_OFFSET: u32 = 12;
#[unsafe(no_mangle)]
static FORK_CHILD_OFFSET: u32 = 20;

#[map]
static SYSCALLS: Array<SyscallLayout> = Array::with_max_entries(MAX_SYSCALL_NR, 0);
#[map]
static WATCHED: Array<Watched> = Array::with_max_entries(MAX_WATCHED, 0);
/// Syscalls in flight, by thread. LRU: an entry outlives its syscall only if the thread died.
#[map]
static PENDING: LruHashMap<u64, Pending> = LruHashMap::with_max_entries(16384, 0);
/// Descriptors of watched files, by process and descriptor.
#[map]
static OPEN_FILES: HashMap<FdKey, OpenFile> = HashMap::with_max_entries(MAX_OPEN_FILES, 0);
/// Where each process's working directory is (`hocus_common::cwd`); absent: unknown.
/// Set by the agent at start, inherited at fork, updated at chdir.
#[map]
static CWD: LruHashMap<u32, u8> = LruHashMap::with_max_entries(MAX_PROCESSES, 0);
/// The `hocus-agent run` job each process belongs to: the id is the daemon thread that
/// forked the job's first process. Set at fork, inherited by every descendant.
#[map]
static JOBS: LruHashMap<u32, u32> = LruHashMap::with_max_entries(MAX_PROCESSES, 0);
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(RING_BYTES, 0);
#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);
/// Two path buffers per CPU (rename has two paths); too big for the 512-byte stack.
#[map]
static SCRATCH: PerCpuArray<PathBuf> = PerCpuArray::with_max_entries(2, 0);
#[map]
static NEXT_ID: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

fn global(value: &u32) -> u32 {
    // SAFETY: reads a global the loader may have rewritten; volatile keeps it from being
    // constant-folded at compile time.
    unsafe { core::ptr::read_volatile(value) }
}

fn count(index: u32) {
    if let Some(c) = COUNTERS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, no other writer while this program runs on this CPU.
        unsafe { *c += 1 };
    }
}

fn current() -> Option<(u64, u32)> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if tgid == global(&SELF_TGID) {
        return None; // the agent's own work is not the workload
    }
    Some((pid_tgid, tgid))
}

fn layout(ctx: &TracePointContext) -> Option<&'static SyscallLayout> {
    // SAFETY: the offset comes from the tracepoint's format file.
    let nr: i32 = unsafe { ctx.read_at(global(&NR_OFFSET) as usize) }.ok()?;
    let layout = SYSCALLS.get(nr as u32)?;
    if layout.op == op::NONE {
        return None;
    }
    Some(layout)
}

fn arg(ctx: &TracePointContext, offset: u16) -> Option<u64> {
    if offset == NO_FIELD {
        return None;
    }
    // SAFETY: syscall arguments are 8 bytes wide in sys_enter records.
    unsafe { ctx.read_at::<u64>(offset as usize) }.ok()
}

fn ret(ctx: &TracePointContext) -> i64 {
    // SAFETY: `ret` is a long in every sys_exit record.
    unsafe { ctx.read_at::<i64>(global(&RET_OFFSET) as usize) }.unwrap_or(0)
}

/// path_enter, on sys_enter_* of path syscalls (here sys_enter_openat; the arguments differ per syscall, each 8 bytes wide
/// from offset 16, and `SYSCALLS` holds where each syscall keeps the ones we read):
///
/// ```text
/// field:unsigned short common_type;          offset:0;  size:2; signed:0;
/// field:unsigned char common_flags;          offset:2;  size:1; signed:0;
/// field:unsigned char common_preempt_count;  offset:3;  size:1; signed:0;
/// field:int common_pid;                      offset:4;  size:4; signed:1;
///
/// field:int __syscall_nr;                    offset:8;  size:4; signed:1;
/// field:int dfd;                             offset:16; size:8; signed:0;
/// field:const char * filename;               offset:24; size:8; signed:0;
/// field:int flags;                           offset:32; size:8; signed:0;
/// field:umode_t mode;                        offset:40; size:8; signed:0;
/// ```
#[tracepoint]
pub fn path_enter(ctx: TracePointContext) -> u32 {
    let _ = try_path_enter(&ctx);
    0
}

fn try_path_enter(ctx: &TracePointContext) -> Option<()> {
    let (pid_tgid, _) = current()?;
    let l = layout(ctx)?;
    let open_flags = match l.flags_from {
        flags_from::ARG => arg(ctx, l.flags)? as u32,
        flags_from::OPEN_HOW => {
            let how = arg(ctx, l.flags)? as *const u64;
            // SAFETY: user pointer, read with the helper that tolerates faults.
            unsafe { bpf_probe_read_user(how) }.unwrap_or(0) as u32
        }
        flags_from::CREAT => O_CREAT | O_WRONLY | O_TRUNC,
        _ => 0,
    };
    let pending = Pending {
        op: l.op,
        open_flags,
        dfd: arg(ctx, l.dfd).map_or(AT_FDCWD, |d| d as i32),
        dfd2: arg(ctx, l.dfd2).map_or(AT_FDCWD, |d| d as i32),
        path: arg(ctx, l.path).unwrap_or(0),
        path2: arg(ctx, l.path2).unwrap_or(0),
        ..Default::default()
    };
    if PENDING.insert(&pid_tgid, &pending, 0).is_err() {
        count(counter::LOST_PENDING_FULL);
    }
    Some(())
}

/// path_exit, on sys_exit_* of path syscalls (the same for every syscall):
///
/// ```text
/// field:unsigned short common_type;          offset:0;  size:2; signed:0;
/// field:unsigned char common_flags;          offset:2;  size:1; signed:0;
/// field:unsigned char common_preempt_count;  offset:3;  size:1; signed:0;
/// field:int common_pid;                      offset:4;  size:4; signed:1;
///
/// field:int __syscall_nr;                    offset:8;  size:4; signed:1;
/// field:long ret;                            offset:16; size:8; signed:1;
/// ```
#[tracepoint]
pub fn path_exit(ctx: TracePointContext) -> u32 {
    let _ = try_path_exit(&ctx);
    0
}

/// Takes the thread's syscall in flight, stashed at its enter.
fn take_pending(pid_tgid: u64) -> Option<Pending> {
    // SAFETY: copied out before the entry is removed.
    let p = unsafe { *PENDING.get(&pid_tgid)? };
    let _ = PENDING.remove(&pid_tgid);
    Some(p)
}

fn try_path_exit(ctx: &TracePointContext) -> Option<()> {
    let (pid_tgid, tgid) = current()?;
    let p = take_pending(pid_tgid)?;
    let ret = ret(ctx);
    match p.op {
        op::OPEN if ret >= 0 => {
            let key = FdKey {
                tgid,
                fd: ret as u32,
            };
            let Some(m) = watched_path(tgid, p.dfd, p.path, 0) else {
                // The descriptor number may have belonged to a watched file before.
                let _ = OPEN_FILES.remove(&key);
                return Some(());
            };
            let file = OpenFile {
                file_id: next_id(),
                ..Default::default()
            };
            if OPEN_FILES.insert(&key, &file, 0).is_err() {
                count(counter::LOST_OPEN_FILES_FULL);
            }
            emit(
                &Header {
                    kind: kind::OPEN,
                    tgid,
                    file_id: file.file_id,
                    bytes: 0,
                    open_flags: p.open_flags,
                },
                &m,
                0,
            );
        }
        // A job wrote into a read-only local copy: the agent invalidates it.
        op::OPEN | op::UNLINK | op::RMDIR | op::MKDIR | op::RENAME | op::TRUNCATE
            if ret == -EROFS
                && (p.op != op::OPEN || p.open_flags & (O_ACCMODE | O_CREAT | O_TRUNC) != 0) =>
        {
            let m = watched_path(tgid, p.dfd, p.path, 0)?;
            let h = Header {
                kind: kind::REFUSED_WRITE,
                tgid,
                file_id: 0,
                bytes: 0,
                open_flags: p.open_flags,
            };
            emit(&h, &m, 0);
        }
        op::OPEN | op::LOOKUP if ret == -ENOENT => {
            let m = watched_path(tgid, p.dfd, p.path, 0)?;
            emit(
                &Header {
                    kind: kind::MISSING,
                    tgid,
                    file_id: 0,
                    bytes: 0,
                    open_flags: 0,
                },
                &m,
                0,
            );
        }
        op::UNLINK | op::RMDIR | op::MKDIR | op::TRUNCATE if ret == 0 => {
            let m = watched_path(tgid, p.dfd, p.path, 0)?;
            let k = match p.op {
                op::UNLINK => kind::UNLINK,
                op::RMDIR => kind::RMDIR,
                op::MKDIR => kind::MKDIR,
                _ => kind::TRUNCATE,
            };
            emit(
                &Header {
                    kind: k,
                    tgid,
                    file_id: 0,
                    bytes: 0,
                    open_flags: 0,
                },
                &m,
                0,
            );
        }
        op::CHDIR if ret == 0 => chdir(tgid, p.path),
        op::RENAME if ret == 0 => {
            if let Some(m) = watched_path(tgid, p.dfd, p.path, 0) {
                emit(
                    &Header {
                        kind: kind::RENAME_FROM,
                        tgid,
                        file_id: 0,
                        bytes: 0,
                        open_flags: 0,
                    },
                    &m,
                    0,
                );
            }
            if let Some(m) = watched_path(tgid, p.dfd2, p.path2, 1) {
                emit(
                    &Header {
                        kind: kind::RENAME_TO,
                        tgid,
                        file_id: 0,
                        bytes: 0,
                        open_flags: 0,
                    },
                    &m,
                    1,
                );
            }
        }
        _ => {}
    }
    Some(())
}

/// fd_enter, on sys_enter_read (and the other descriptor syscalls: pread64, readv, write*, ftruncate,
/// close, fchdir; `SYSCALLS` holds where each keeps its `fd`):
///
/// ```text
/// field:unsigned short common_type;          offset:0;  size:2; signed:0;
/// field:unsigned char common_flags;          offset:2;  size:1; signed:0;
/// field:unsigned char common_preempt_count;  offset:3;  size:1; signed:0;
/// field:int common_pid;                      offset:4;  size:4; signed:1;
///
/// field:int __syscall_nr;                    offset:8;  size:4; signed:1;
/// field:unsigned int fd;                     offset:16; size:8; signed:0;
/// field:char * buf;                          offset:24; size:8; signed:0;
/// field:size_t count;                        offset:32; size:8; signed:0;
/// ```
#[tracepoint]
pub fn fd_enter(ctx: TracePointContext) -> u32 {
    let _ = try_fd_enter(&ctx);
    0
}

fn try_fd_enter(ctx: &TracePointContext) -> Option<()> {
    let (pid_tgid, tgid) = current()?;
    let l = layout(ctx)?;
    let fd = arg(ctx, l.fd)? as u32;
    let key = FdKey { tgid, fd };
    if l.op == op::FCHDIR {
        return fchdir(tgid, &key);
    }
    let file = OPEN_FILES.get_ptr_mut(&key)?;
    let none = no_path();
    // SAFETY: map value pointer, valid for this program run.
    let file = unsafe { &mut *file };
    match l.op {
        op::READ => {
            let pending = Pending {
                op: op::READ,
                dfd: fd as i32,
                ..Default::default()
            };
            if PENDING.insert(&pid_tgid, &pending, 0).is_err() {
                count(counter::LOST_PENDING_FULL);
            }
        }
        // Counted at exit, once it succeeded: a failed write changes nothing.
        op::WRITE | op::FTRUNCATE if file.written == 0 => {
            let pending = Pending {
                op: l.op,
                dfd: fd as i32,
                ..Default::default()
            };
            if PENDING.insert(&pid_tgid, &pending, 0).is_err() {
                count(counter::LOST_PENDING_FULL);
            }
        }
        op::CLOSE => {
            let (id, bytes) = (file.file_id, file.bytes_read);
            let _ = OPEN_FILES.remove(&key);
            emit(
                &Header {
                    kind: kind::CLOSE,
                    tgid,
                    file_id: id,
                    bytes: bytes,
                    open_flags: 0,
                },
                &none,
                0,
            );
        }
        _ => {}
    }
    Some(())
}

/// fd_exit, on sys_exit_read*, write* and ftruncate (`ret` is the bytes read or written,
/// or 0 for a truncate that succeeded):
///
/// ```text
/// field:unsigned short common_type;          offset:0;  size:2; signed:0;
/// field:unsigned char common_flags;          offset:2;  size:1; signed:0;
/// field:unsigned char common_preempt_count;  offset:3;  size:1; signed:0;
/// field:int common_pid;                      offset:4;  size:4; signed:1;
///
/// field:int __syscall_nr;                    offset:8;  size:4; signed:1;
/// field:long ret;                            offset:16; size:8; signed:1;
/// ```
#[tracepoint]
pub fn fd_exit(ctx: TracePointContext) -> u32 {
    let _ = try_fd_exit(&ctx);
    0
}

fn try_fd_exit(ctx: &TracePointContext) -> Option<()> {
    let (pid_tgid, tgid) = current()?;
    let p = take_pending(pid_tgid)?;
    let ret = ret(ctx);
    let key = FdKey {
        tgid,
        fd: p.dfd as u32,
    };
    match p.op {
        op::READ if ret > 0 => {
            let file = OPEN_FILES.get_ptr_mut(&key)?;
            // SAFETY: map value pointer. The bpf target's core has no atomic fetch_add, so
            // two threads of one process reading one descriptor at the same instant can
            // lose one of the two additions; sequential reads, the common case, are exact.
            unsafe { (*file).bytes_read += ret as u64 };
        }
        op::WRITE | op::FTRUNCATE if (p.op == op::WRITE && ret > 0) || ret == 0 => {
            let file = OPEN_FILES.get_ptr_mut(&key)?;
            // SAFETY: map value pointer, valid for this program run.
            let file = unsafe { &mut *file };
            if file.written != 0 {
                return Some(()); // one event per open file is enough to mark it written
            }
            file.written = 1;
            let k = if p.op == op::WRITE {
                kind::WRITE
            } else {
                kind::TRUNCATE
            };
            emit(
                &Header {
                    kind: k,
                    tgid,
                    file_id: file.file_id,
                    bytes: 0,
                    open_flags: 0,
                },
                &no_path(),
                0,
            );
        }
        _ => {}
    }
    Some(())
}

/// sched_process_fork: the child starts where its parent is.
///
/// ```text
/// field:unsigned short common_type;          offset:0;  size:2; signed:0;
/// field:unsigned char common_flags;          offset:2;  size:1; signed:0;
/// field:unsigned char common_preempt_count;  offset:3;  size:1; signed:0;
/// field:int common_pid;                      offset:4;  size:4; signed:1;
///
/// field:__data_loc char[] parent_comm;       offset:8;  size:4; signed:0;
/// field:pid_t parent_pid;                    offset:12; size:4; signed:1;
/// field:__data_loc char[] child_comm;        offset:16; size:4; signed:0;
/// field:pid_t child_pid;                     offset:20; size:4; signed:1;
/// ```
#[tracepoint]
pub fn process_fork(ctx: TracePointContext) -> u32 {
    let _ = try_process_fork(&ctx);
    0
}

fn try_process_fork(ctx: &TracePointContext) -> Option<()> {
    // SAFETY: offsets come from the tracepoint's format file.
    let parent: u32 = unsafe { ctx.read_at(global(&FORK_PARENT_OFFSET) as usize) }.ok()?;
    let child: u32 = unsafe { ctx.read_at(global(&FORK_CHILD_OFFSET) as usize) }.ok()?;
    // Whatever the agent forks is a job (its threads get harmless entries, dropped when
    // they exit); a job's children stay in it.
    let forker = (bpf_get_current_pid_tgid() >> 32) as u32;
    let job = if forker == global(&SELF_TGID) {
        Some(parent)
    } else {
        // SAFETY: plain value copy.
        unsafe { JOBS.get(&forker).copied() }
    };
    if let Some(job) = job {
        let _ = JOBS.insert(&child, &job, 0);
    }
    // SAFETY: plain value copy.
    let where_ = unsafe { *CWD.get(&parent)? };
    let _ = CWD.insert(&child, &where_, 0);
    if where_ != cwd::UNRELATED {
        // The agent needs the child's directory as a path: it copies the parent's.
        let none = no_path();
        let h = Header {
            kind: kind::FORK,
            tgid: parent,
            file_id: u64::from(child),
            bytes: 0,
            open_flags: 0,
        };
        emit(&h, &none, 0);
    }
    Some(())
}

/// sched_process_exit: forget the process when its leader exits. Reads no field: the
/// exiting task is the current one.
///
/// ```text
/// field:char comm[16];                       offset:8;  size:16; signed:0;
/// field:pid_t pid;                           offset:24; size:4;  signed:1;
/// field:int prio;                            offset:28; size:4;  signed:1;
/// field:bool group_dead;                     offset:32; size:1;  signed:0;
/// ```
#[tracepoint]
pub fn process_exit(_ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if tgid == pid_tgid as u32 {
        let _ = CWD.remove(&tgid);
    }
    // Keyed by the exiting thread: a leader's entry, or one a thread got at its clone.
    let _ = JOBS.remove(&(pid_tgid as u32));
    0
}

fn chdir(tgid: u32, user_path: u64) {
    let Some((path, len)) = read_path(user_path, 0) else {
        return;
    };
    let m = Match {
        flags: 0,
        dir_id: 0,
        len: len as u32,
    };
    let h = Header {
        kind: kind::CHDIR,
        tgid,
        file_id: 0,
        bytes: 0,
        open_flags: 0,
    };
    if path.bytes[0] == b'/' {
        let where_ = classify(path);
        let _ = CWD.insert(&tgid, &where_, 0);
        if where_ != cwd::UNRELATED {
            emit(&h, &m, 0);
        }
        return;
    }
    // A relative move from in or above a tree: the agent joins it to the directory it
    // knows and answers with the new place. From elsewhere, it stays unrelated (a `..`
    // walk from an unrelated directory into a watched tree is not followed).
    // SAFETY: plain value copy.
    if let Some(&where_) = unsafe { CWD.get(&tgid) } {
        if where_ != cwd::UNRELATED {
            let m = Match {
                flags: ev::RELATIVE_TO_CWD,
                ..m
            };
            emit(&h, &m, 0);
        }
    }
}

fn fchdir(tgid: u32, key: &FdKey) -> Option<()> {
    // SAFETY: plain value copy.
    match unsafe { OPEN_FILES.get(key) } {
        Some(dir) => {
            let _ = CWD.insert(&tgid, &cwd::INSIDE, 0);
            let m = Match {
                flags: ev::RELATIVE_TO_DIR,
                dir_id: dir.file_id,
                len: 0,
            };
            let h = Header {
                kind: kind::CHDIR,
                tgid,
                file_id: 0,
                bytes: 0,
                open_flags: 0,
            };
            emit(&h, &m, 0);
        }
        // Not a watched directory, but it may be above one: ask the agent.
        None => {
            let _ = CWD.remove(&tgid);
        }
    }
    Some(())
}

fn no_path() -> Match {
    Match {
        flags: 0,
        dir_id: 0,
        len: 0,
    }
}

/// How a path matched: flags for the event and, for dirfd-relative paths, the directory.
struct Match {
    flags: u32,
    dir_id: u64,
    len: u32,
}

/// Reads a user path into scratch slot `slot`: the buffer and the length without NUL.
fn read_path(user_path: u64, slot: u32) -> Option<(&'static PathBuf, usize)> {
    let buf = SCRATCH.get_ptr_mut(slot)?;
    // SAFETY: per-CPU scratch owned by this program run; the user pointer is read with
    // the fault-tolerant helper.
    let buf = unsafe { &mut *buf };
    let len = match unsafe { bpf_probe_read_user_str_bytes(user_path as *const u8, &mut buf.bytes) }
    {
        Ok(s) => s.len(),
        Err(_) => {
            count(counter::PATH_UNREADABLE);
            return None;
        }
    };
    if len == 0 {
        return None;
    }
    Some((buf, len))
}

/// Reads the user path into scratch slot `slot` and decides whether it is watched.
fn watched_path(tgid: u32, dfd: i32, user_path: u64, slot: u32) -> Option<Match> {
    let (path, len) = read_path(user_path, slot)?;
    let mut m = Match {
        flags: 0,
        dir_id: 0,
        len: len as u32,
    };
    if path.bytes[0] == b'/' {
        if !is_watched(path) {
            return None;
        }
    } else if dfd == AT_FDCWD {
        // SAFETY: plain value copy.
        match unsafe { CWD.get(&tgid) } {
            Some(&cwd::UNRELATED) => return None,
            Some(_) => m.flags |= ev::RELATIVE_TO_CWD,
            None => m.flags |= ev::RELATIVE_TO_CWD | ev::CWD_UNKNOWN,
        }
    } else {
        let key = FdKey {
            tgid,
            fd: dfd as u32,
        };
        // SAFETY: plain value copy.
        let dir = unsafe { OPEN_FILES.get(&key)? };
        m.flags |= ev::RELATIVE_TO_DIR;
        m.dir_id = dir.file_id;
    }
    if len >= MAX_PATH - 1 {
        m.flags |= ev::PATH_TRUNCATED;
        count(counter::PATH_TRUNCATED);
    }
    Some(m)
}

/// Where an absolute directory path is relative to the watched trees.
fn classify(path: &PathBuf) -> u8 {
    match matching_entry(path, true) {
        Some(Watched::TREE) => cwd::INSIDE,
        Some(_) => cwd::ABOVE,
        None => cwd::UNRELATED,
    }
}

fn is_watched(path: &PathBuf) -> bool {
    matching_entry(path, false).is_some()
}

/// The kind of the first table entry `path` matches; trees come first in the table.
fn matching_entry(path: &PathBuf, with_above: bool) -> Option<u32> {
    for i in 0..MAX_WATCHED {
        let w = WATCHED.get(i)?;
        if w.len == 0 || (w.kind != Watched::TREE && !with_above) {
            return None;
        }
        if matches(path, w) {
            return Some(w.kind);
        }
    }
    None
}

fn matches(path: &PathBuf, w: &Watched) -> bool {
    for i in 0..PREFIX_WORDS {
        let mask = w.masks[i];
        if mask == 0 {
            break;
        }
        // SAFETY: `PathBuf` is 8-byte aligned and i < PREFIX_WORDS <= MAX_PATH / 8.
        let word = unsafe { *path.bytes.as_ptr().cast::<u64>().add(i) };
        if (word ^ w.words[i]) & mask != 0 {
            return false;
        }
    }
    let len = w.len as usize & (MAX_PREFIX - 1);
    let next = path.bytes[len];
    if w.kind == Watched::TREE {
        next == 0 || next == b'/'
    } else {
        // A directory above a tree must be named exactly (a trailing slash is fine).
        next == 0 || (next == b'/' && path.bytes[len + 1] == 0)
    }
}

fn next_id() -> u64 {
    let Some(n) = NEXT_ID.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: per-CPU slot. Ids are unique across CPUs through the CPU number on top.
    unsafe {
        *n += 1;
        ((bpf_get_smp_processor_id() as u64) << 48) | *n
    }
}

/// The parts of an event that do not come from the path.
struct Header {
    kind: u8,
    tgid: u32,
    file_id: u64,
    bytes: u64,
    open_flags: u32,
}

fn emit(h: &Header, m: &Match, slot: u32) {
    let Some(mut entry) = EVENTS.reserve::<Event>(0) else {
        count(counter::LOST_RING_FULL);
        match h.kind {
            kind::OPEN => count(counter::LOST_OPENS),
            kind::MISSING => count(counter::LOST_FAILED_LOOKUPS),
            _ => {}
        }
        return;
    };
    let e = entry.as_mut_ptr();
    // SAFETY: `e` points at a reserved ring buffer slot of `size_of::<Event>()` bytes; it
    // is written field by field because an Event does not fit on the BPF stack.
    unsafe {
        (*e).kind = h.kind;
        (*e).flags = m.flags;
        (*e).tgid = h.tgid;
        (*e).uid = bpf_get_current_uid_gid() as u32;
        (*e).time_ns = bpf_ktime_get_ns();
        (*e).file_id = h.file_id;
        (*e).dir_id = m.dir_id;
        (*e).bytes = h.bytes;
        (*e).open_flags = h.open_flags;
        (*e).path_len = m.len;
        (*e).comm = bpf_get_current_comm().unwrap_or([0; 16]);
        let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
        (*e).job = JOBS.get(&tgid).copied().unwrap_or(0);
        if m.len > 0 {
            match SCRATCH.get_ptr(slot) {
                Some(buf) => {
                    let _ = bpf_probe_read_kernel_buf(buf as *const u8, &mut (*e).path);
                }
                None => (*e).path_len = 0,
            }
        }
    }
    let pending = EVENTS.query(BPF_RB_AVAIL_DATA);
    entry.submit(if pending >= WAKEUP_BYTES {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    });
    count(counter::EVENTS_SENT);
}

/// The kernel's verifier refuses a program with a reachable unbounded loop, so a panic
/// that could be reached makes loading fail loudly instead of being undefined behaviour.
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    #[expect(clippy::empty_loop, reason = "a bpf program cannot abort; see above")]
    loop {}
}
