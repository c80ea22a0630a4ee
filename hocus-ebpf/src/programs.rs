use aya_ebpf::{
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_current_task,
        bpf_get_current_uid_gid, bpf_get_smp_processor_id, bpf_ktime_get_ns, bpf_probe_read_kernel,
        bpf_probe_read_kernel_buf, bpf_probe_read_kernel_str_bytes, bpf_probe_read_user,
        bpf_probe_read_user_str_bytes, generated,
    },
    macros::{map, raw_tracepoint, tracepoint},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::{RawTracePointContext, TracePointContext},
};
use hocus_common::{
    AT_FDCWD, Calibration, Event, FdKey, Home, InodeKey, KernelOffsets, MAX_KNOWN_NAMESPACES,
    MAX_MAPPED, MAX_OPEN_FILES, MAX_PATH, MAX_PREFIX, MAX_PROCESSES, MAX_ROOTS, MAX_SUPERBLOCKS,
    MAX_SYSCALL_NR, MAX_VIEW_ROOTS, MAX_VIEWS, MAX_WATCHED, Mapped, NO_FIELD, NamespaceKey,
    OpenFile, PREFIX_WORDS, PathBuf, RING_BYTES, ROOT_NONE, ROOT_VIEW, SyscallLayout, View,
    Watched, counter, ev, flags_from, kind, op, superblock,
};

const ENOENT: i64 = 2;
const EROFS: i64 = 30;
const O_ACCMODE: u32 = 0o3;
const O_CREAT: u32 = 0o100;
const O_WRONLY: u32 = 0o1;
const O_TRUNC: u32 = 0o1000;
/// x86-64's `thread_info.status` bit for a 32-bit syscall in progress.
const TS_COMPAT: u32 = 0x0002;
const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;
/// `bpf_map_update_elem` flag: only if there is no entry yet.
const BPF_NOEXIST: u64 = 1;
/// mmap's results above this are errors (-4095..-1).
const MAX_ERRNO: u64 = 4095;
/// Wake the agent only once this much is waiting; it also polls on a short timer. An
/// import storm then costs a handful of wakeups instead of one per event.
const WAKEUP_BYTES: u64 = 256 << 10;
/// How many directories up from a file the kernel side walks to find its root.
const WALK_DEPTH: usize = 40;
/// Longest name of one directory entry.
const NAME_MAX: usize = 255;

// Set by the agent before loading (aya `set_global`).
#[unsafe(no_mangle)]
static SELF_TGID: u32 = 0;
/// Offsets of `parent_pid` and `child_pid` in sched_process_fork records.
#[unsafe(no_mangle)]
static FORK_PARENT_OFFSET: u32 = 12;
#[unsafe(no_mangle)]
static FORK_CHILD_OFFSET: u32 = 20;
/// Offsets of `i_ino`, `s_dev` and `order` (`u32::MAX`: none) in
/// mm_filemap_add_to_page_cache records.
#[unsafe(no_mangle)]
static FILEMAP_INO_OFFSET: u32 = 16;
#[unsafe(no_mangle)]
static FILEMAP_DEV_OFFSET: u32 = 32;
#[unsafe(no_mangle)]
static FILEMAP_ORDER_OFFSET: u32 = 36;
/// Where the kernel keeps the fields read below, from its BTF.
#[unsafe(no_mangle)]
static OFFSETS: KernelOffsets = KernelOffsets {
    task_files: 0,
    task_fs: 0,
    task_nsproxy: 0,
    files_fdt: 0,
    fdt_fd: 0,
    file_mnt: 0,
    fs_pwd_mnt: 0,
    fs_root_dentry: 0,
    dentry_parent: 0,
    dentry_name_len: 0,
    dentry_name: 0,
    vfsmount_root: 0,
    sb_root: 0,
    sb_dev: 0,
    nsproxy_mnt_ns: 0,
    mnt_ns_id: 0,
    mnt_ns_inum: 0,
    regs_nr: 0,
    thread_status: 0,
    dentry_inode: 0,
    inode_ino: 0,
};

#[map]
static SYSCALLS: Array<SyscallLayout> = Array::with_max_entries(MAX_SYSCALL_NR, 0);
/// The watched trees as the agent sees them, for absolute paths of failed lookups and
/// mutations (opens are placed by what they opened).
#[map]
static WATCHED: Array<Watched> = Array::with_max_entries(MAX_WATCHED, 0);
/// The directories files are placed under: dentry address to `Event::root` (the roots,
/// then the roots of snapshot views in jobs).
#[map]
static ROOTS: HashMap<u64, u32> = HashMap::with_max_entries(MAX_ROOTS as u32 + MAX_VIEW_ROOTS, 0);
/// The superblocks those directories are on (`hocus_common::superblock` flags).
#[map]
static SUPERBLOCKS: HashMap<u64, u32> = HashMap::with_max_entries(MAX_SUPERBLOCKS, 0);
/// Mount namespaces (with a root) whose absolute paths mean what they mean to the agent.
#[map]
static KNOWN_NAMESPACES: LruHashMap<NamespaceKey, u32> =
    LruHashMap::with_max_entries(MAX_KNOWN_NAMESPACES, 0);
/// The agent's own mount namespace (by its nsproxy) and root.
#[map]
static HOME: Array<Home> = Array::with_max_entries(1, 0);
/// How other mount namespaces (containers) see the watched trees, learned by the agent.
#[map]
static VIEWS: LruHashMap<NamespaceKey, View> = LruHashMap::with_max_entries(MAX_VIEWS, 0);
/// The namespaces whose view the agent was asked to learn, at which generation: asked
/// once per mount change, not once per lookup.
#[map]
static ASKED: LruHashMap<NamespaceKey, u64> = LruHashMap::with_max_entries(MAX_VIEWS, 0);
/// Bumped when a mount syscall starts and when it ends: a view learned before is stale.
#[map]
static MOUNT_GENERATION: Array<u64> = Array::with_max_entries(1, 0);
/// The agent's question about one of its descriptors, and the answer.
#[map]
static CALIBRATE: Array<Calibration> = Array::with_max_entries(1, 0);
/// Descriptors of watched files, by process and descriptor.
#[map]
static OPEN_FILES: HashMap<FdKey, OpenFile> = HashMap::with_max_entries(MAX_OPEN_FILES, 0);
/// The `hocus-agent run` job each process belongs to: the id is the daemon thread that
/// forked the job's first process. Set at fork, inherited by every descendant.
#[map]
static JOBS: LruHashMap<u32, u32> = LruHashMap::with_max_entries(MAX_PROCESSES, 0);
/// Watched files some process mapped, by inode: pages entering their page cache.
#[map]
static MAPPED: LruHashMap<InodeKey, Mapped> = LruHashMap::with_max_entries(MAX_MAPPED, 0);
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(RING_BYTES, 0);
#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::COUNT, 0);
/// Two path buffers per CPU (rename has two paths); too big for the 512-byte stack.
#[map]
static SCRATCH: PerCpuArray<PathBuf> = PerCpuArray::with_max_entries(2, 0);
/// Where a walk up the directories writes its path, backwards from `MAX_PATH`; twice
/// as long so that the verifier sees every write land inside it.
#[map]
static WALK: PerCpuArray<WalkBuf> = PerCpuArray::with_max_entries(1, 0);
#[map]
static NEXT_ID: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

#[repr(C, align(8))]
pub struct WalkBuf {
    bytes: [u8; 2 * MAX_PATH],
}

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

/// What the syscall numbered `nr` means, if it is traced.
fn layout(nr: i64) -> Option<&'static SyscallLayout> {
    if !(0..MAX_SYSCALL_NR as i64).contains(&nr) {
        return None; // -1 (no syscall), or an x32 number
    }
    let layout = SYSCALLS.get(nr as u32)?;
    if layout.op == op::NONE {
        return None;
    }
    Some(layout)
}

/// A syscall argument, from the saved registers at `offset` (`NO_FIELD`: none).
fn arg(regs: u64, offset: u16) -> Option<u64> {
    if offset == NO_FIELD {
        return None;
    }
    field(regs, u32::from(offset))
}

/// A directory descriptor argument; `AT_FDCWD` for syscalls that have none.
fn arg_fd(regs: u64, offset: u16) -> i32 {
    arg(regs, offset).map_or(AT_FDCWD, |d| d as i32)
}

/// Whether `nr` is, in the 32-bit numbering, mount, umount, umount2, pivot_root or
/// move_mount: a 32-bit mount changes what paths mean as much as a 64-bit one.
fn is_ia32_mount(nr: i64) -> bool {
    matches!(nr, 21 | 22 | 52 | 217 | 429)
}

/// Whether the current syscall is a 32-bit one (`int 0x80` or a 32-bit process): its
/// number and registers mean something else, so it is never read as a 64-bit one.
fn is_compat() -> bool {
    field::<u32>(task(), offset(|o| &o.thread_status)).is_none_or(|s| s & TS_COMPAT != 0)
}

// ---- Kernel objects: where a file, a working directory or a namespace is ----

/// Reads a field of a kernel object, `offset` bytes into it.
fn field<T>(object: u64, offset: u32) -> Option<T> {
    if object == 0 {
        return None;
    }
    // SAFETY: the helper tolerates any address; a wrong one fails instead of faulting.
    unsafe { bpf_probe_read_kernel((object + u64::from(offset)) as *const T) }.ok()
}

fn offset(f: fn(&KernelOffsets) -> &u32) -> u32 {
    global(f(&OFFSETS))
}

/// A directory entry as a process reached it: through which mount, and which dentry.
struct Place {
    mnt: u64,
    dentry: u64,
}

fn task() -> u64 {
    // SAFETY: no arguments; the current task's address.
    unsafe { bpf_get_current_task() }
}

/// What descriptor `fd` of the current process is open on.
fn file_place(fd: u32) -> Option<Place> {
    let files: u64 = field(task(), offset(|o| &o.task_files))?;
    let fdt: u64 = field(files, offset(|o| &o.files_fdt))?;
    // No check against max_fds: `fd` was valid at this syscall (a table only grows), and
    // a wrong read lands on no known superblock anyway. One read less on every open.
    let array: u64 = field(fdt, offset(|o| &o.fdt_fd))?;
    let file: u64 = field(array + u64::from(fd) * 8, 0)?;
    // f_path is a struct path: mnt then dentry, read at once (checked by the agent).
    let [mnt, dentry] = field::<[u64; 2]>(file, offset(|o| &o.file_mnt))?;
    Some(Place { mnt, dentry })
}

/// The page cache key of what a descriptor is open on: its superblock's device and its
/// inode's number.
fn inode_of(place: &Place) -> Option<InodeKey> {
    let [_, sb] = field::<[u64; 2]>(place.mnt, offset(|o| &o.vfsmount_root))?;
    let inode: u64 = field(place.dentry, offset(|o| &o.dentry_inode))?;
    Some(InodeKey {
        dev: field(sb, offset(|o| &o.sb_dev))?,
        _pad: 0,
        ino: field(inode, offset(|o| &o.inode_ino))?,
    })
}

/// The current process's working directory.
fn cwd_place() -> Option<Place> {
    let fs: u64 = field(task(), offset(|o| &o.task_fs))?;
    let [mnt, dentry] = field::<[u64; 2]>(fs, offset(|o| &o.fs_pwd_mnt))?;
    Some(Place { mnt, dentry })
}

/// The current process's mount namespace (from its nsproxy) and root: what its absolute
/// paths mean; and the namespace's inode number, which the agent checks.
fn namespace_of(nsproxy: u64) -> Option<(NamespaceKey, u32)> {
    let mnt_ns: u64 = field(nsproxy, offset(|o| &o.nsproxy_mnt_ns))?;
    let key = NamespaceKey {
        namespace: field(mnt_ns, offset(|o| &o.mnt_ns_id))?,
        root: root_dentry()?,
    };
    Some((key, field(mnt_ns, offset(|o| &o.mnt_ns_inum))?))
}

fn nsproxy() -> Option<u64> {
    field(task(), offset(|o| &o.task_nsproxy))
}

fn root_dentry() -> Option<u64> {
    let fs: u64 = field(task(), offset(|o| &o.task_fs))?;
    field(fs, offset(|o| &o.fs_root_dentry))
}

fn generation() -> u64 {
    MOUNT_GENERATION.get(0).copied().unwrap_or(0)
}

fn mounts_change() {
    if let Some(g) = MOUNT_GENERATION.get_ptr_mut(0) {
        // SAFETY: a map value; the add is atomic (concurrent mounts on other CPUs).
        unsafe {
            core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                g, 1,
            )
        };
    }
}

/// Where a file or directory lies: under root `root`, at the path in `WALK` from `start`
/// to `MAX_PATH` (`/a/b`, empty for the root itself).
#[derive(Clone, Copy)]
struct Located {
    root: u32,
    start: u32,
}

/// Places a dentry under one of `ROOTS` by walking up its parents, whatever mount or
/// namespace it was reached through: a tree bound elsewhere in a container is still
/// the tree, a look-alike mounted at the same path is another superblock.
fn locate(place: &Place) -> Option<Located> {
    // The mount's root and superblock, read at once (adjacent, checked by the agent):
    // every open on the node pays this, so it is kept to one read.
    let [mnt_root, sb] = field::<[u64; 2]>(place.mnt, offset(|o| &o.vfsmount_root))?;
    // SAFETY: plain value copy.
    let flags = unsafe { *SUPERBLOCKS.get(&sb)? };
    if flags & (superblock::WATCHED | superblock::SNAPSHOT_VIEW) == 0 {
        // Only the cache is on this disk: what matters is reached through hocus's binds
        // (mounts rooted inside the cache), not through the disk's own mount.
        let s_root: u64 = field(sb, offset(|o| &o.sb_root))?;
        if mnt_root == s_root {
            return None;
        }
    }
    let buf = WALK.get_ptr_mut(0)?;
    // SAFETY: per-CPU scratch owned by this program run.
    let buf = unsafe { &mut *buf };
    let parent_at = offset(|o| &o.dentry_parent);
    let (len_at, name_at) = (offset(|o| &o.dentry_name_len), offset(|o| &o.dentry_name));
    let mut pos = MAX_PATH;
    let mut d = place.dentry;
    for _ in 0..WALK_DEPTH {
        // SAFETY: plain value copy. One lookup rather than a comparison per root: the
        // verifier then follows one "found" path per step, not one per root.
        if let Some(&root) = unsafe { ROOTS.get(&d) } {
            return Some(Located {
                root,
                start: pos as u32,
            });
        }
        let parent: u64 = field(d, parent_at)?;
        if parent == d {
            return None; // the filesystem's root, above every watched tree
        }
        let len = field::<u32>(d, len_at)? as usize;
        let name: u64 = field(d, name_at)?;
        if len == 0 || len > NAME_MAX || len + 2 > pos {
            count(counter::PATH_TRUNCATED);
            return None;
        }
        pos -= len;
        // SAFETY: the destination is inside `buf` (pos < MAX_PATH, len <= NAME_MAX, the
        // buffer is 2 * MAX_PATH); the source is read with the fault-tolerant helper.
        unsafe {
            generated::bpf_probe_read_kernel(
                buf.bytes.as_mut_ptr().add(pos & (MAX_PATH - 1)).cast(),
                (len & NAME_MAX) as u32,
                name as *const _,
            );
        }
        pos -= 1;
        buf.bytes[pos & (MAX_PATH - 1)] = b'/';
        d = parent;
    }
    count(counter::PATH_TOO_DEEP);
    None
}

/// syscall_enter, on the raw `sys_enter` tracepoint: every syscall of every process on
/// the node passes here, so anything not traced costs one table lookup. Only what must
/// happen before the syscall is done here: a close forgets its descriptor before the
/// number can be reused, and a mount makes learned views stale before it starts.
/// Everything else is decided at exit, where the arguments are still in the registers.
#[raw_tracepoint(tracepoint = "sys_enter")]
pub fn syscall_enter(ctx: RawTracePointContext) -> i32 {
    let _ = try_syscall_enter(&ctx);
    0
}

fn try_syscall_enter(ctx: &RawTracePointContext) -> Option<()> {
    let nr: i64 = ctx.arg(1);
    if is_ia32_mount(nr) && is_compat() {
        mounts_change();
        return None;
    }
    let l = layout(nr)?;
    if l.op != op::CLOSE && l.op != op::MOUNTS_CHANGE {
        return None;
    }
    let (_, tgid) = current()?;
    if l.op == op::MOUNTS_CHANGE {
        // Before the mount and after it: a view learned while it was under way is stale
        // too. The agent's own binds, in jobs' namespaces, propagate nowhere (those
        // namespaces are slaves), so they change no view.
        mounts_change();
        return None;
    }
    let regs: u64 = ctx.arg(0);
    let key = FdKey {
        tgid,
        fd: arg(regs, l.fd)? as u32,
    };
    // SAFETY: copied out before the entry is removed.
    let file = unsafe { *OPEN_FILES.get(&key)? };
    if is_compat() {
        return None;
    }
    let _ = OPEN_FILES.remove(&key);
    let h = Header {
        kind: kind::CLOSE,
        tgid,
        file_id: file.file_id,
        bytes: file.bytes_read,
        open_flags: 0,
    };
    emit(&h, &no_path(), 0);
    Some(())
}

/// syscall_exit, on the raw `sys_exit` tracepoint: the syscall's number is read from
/// the saved registers (`orig_ax`), its arguments too (the kernel does not change them),
/// and its result is the tracepoint's second argument. Opens are placed by what they
/// opened; failed lookups and mutations by where their path lies; reads add their bytes
/// to the open file; the first write to a file is reported once it succeeded.
#[raw_tracepoint(tracepoint = "sys_exit")]
pub fn syscall_exit(ctx: RawTracePointContext) -> i32 {
    let _ = try_syscall_exit(&ctx);
    0
}

/// The open watched file descriptor `fd` of a read, write, ftruncate or mmap names:
/// looked up first (almost every descriptor is not one), then refused for a 32-bit
/// syscall, whose arguments are not where `l` says.
#[inline(always)]
fn watched_file(fd: u32, tgid: u32) -> Option<*mut OpenFile> {
    let file = OPEN_FILES.get_ptr_mut(&FdKey { tgid, fd })?;
    if is_compat() {
        return None;
    }
    Some(file)
}

/// The checks of `is_compat` (a read of kernel memory) come after the cheap tests that
/// turn away almost every syscall on the node, and before anything is changed or sent.
fn try_syscall_exit(ctx: &RawTracePointContext) -> Option<()> {
    let regs: u64 = ctx.arg(0);
    let nr: i64 = field(regs, offset(|o| &o.regs_nr))?;
    if is_ia32_mount(nr) && is_compat() {
        mounts_change();
        return None;
    }
    let l = layout(nr)?;
    let ret: i64 = ctx.arg(1);
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if tgid == global(&SELF_TGID) {
        return agent_syscall(l, pid_tgid, ret);
    }
    let header = |kind, file_id, open_flags| Header {
        kind,
        tgid,
        file_id,
        bytes: 0,
        open_flags,
    };
    match l.op {
        op::MOUNTS_CHANGE => mounts_change(),
        op::READ if ret > 0 => {
            let file = watched_file(arg(regs, l.fd)? as u32, tgid)?;
            // SAFETY: map value pointer; the add is atomic (threads of one process may
            // read one descriptor at once).
            unsafe {
                core::intrinsics::atomic_xadd::<
                    u64,
                    u64,
                    { core::intrinsics::AtomicOrdering::Relaxed },
                >(&raw mut (*file).bytes_read, ret as u64)
            };
        }
        // A failed write changes nothing.
        op::WRITE | op::FTRUNCATE if (l.op == op::WRITE && ret > 0) || ret == 0 => {
            let file = watched_file(arg(regs, l.fd)? as u32, tgid)?;
            // SAFETY: map value pointer, valid for this program run.
            let file = unsafe { &mut *file };
            if file.written != 0 {
                return Some(()); // one event per open file is enough to mark it written
            }
            file.written = 1;
            let k = if l.op == op::WRITE {
                kind::WRITE
            } else {
                kind::TRUNCATE
            };
            emit(&header(k, file.file_id, 0), &no_path(), 0);
        }
        op::MMAP if (ret as u64) < u64::MAX - MAX_ERRNO => {
            // Anonymous memory (fd -1) is almost every mmap on the node: no lookup.
            let fd = arg(regs, l.fd)? as i32;
            if fd < 0 {
                return None;
            }
            let file = watched_file(fd as u32, tgid)?;
            // SAFETY: map value pointer, valid for this program run.
            let file_id = unsafe { (*file).file_id };
            let inode = inode_of(&file_place(fd as u32)?)?;
            // The first mapping names the inode; later ones (every process loading the
            // same library) add to it.
            let fresh = Mapped { file_id, pages: 0 };
            if MAPPED.insert(&inode, &fresh, BPF_NOEXIST).is_ok() {
                emit(&header(kind::MAPPED, file_id, 0), &no_path(), 0);
            }
        }
        op::OPEN if ret >= 0 => {
            let key = FdKey {
                tgid,
                fd: ret as u32,
            };
            let Some(located) = file_place(ret as u32).and_then(|f| locate(&f)) else {
                // The descriptor number may have belonged to a watched file before (closed
                // by dup2 or exec, unseen). Looked up first: a lookup is cheaper than a
                // delete, and almost every open on the node misses.
                if OPEN_FILES.get_ptr(&key).is_some() && !is_compat() {
                    let _ = OPEN_FILES.remove(&key);
                }
                return Some(());
            };
            if is_compat() {
                return None;
            }
            let file = OpenFile {
                file_id: next_id(),
                ..Default::default()
            };
            if OPEN_FILES.insert(&key, &file, 0).is_err() {
                count(counter::LOST_OPEN_FILES_FULL);
            }
            let target = Target {
                located: Some(located),
                ..no_path()
            };
            emit(
                &header(kind::OPEN, file.file_id, open_flags(regs, l)),
                &target,
                0,
            );
        }
        op::RENAME if ret == 0 => {
            if is_compat() {
                return None;
            }
            // One after the other: both use the same walk buffer.
            if let Some(t) = path_target(arg_fd(regs, l.dfd), arg(regs, l.path)?, 0) {
                emit(&header(kind::RENAME_FROM, 0, 0), &t, 0);
            }
            if let Some(t) = path_target(arg_fd(regs, l.dfd2), arg(regs, l.path2)?, 1) {
                emit(&header(kind::RENAME_TO, 0, 0), &t, 1);
            }
        }
        _ => {
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
                _ => return Some(()),
            };
            let flags = if k == kind::REFUSED_WRITE {
                let flags = open_flags(regs, l);
                if l.op == op::OPEN && flags & (O_ACCMODE | O_CREAT | O_TRUNC) == 0 {
                    return Some(()); // a read-only open cannot be a refused write
                }
                flags
            } else {
                0
            };
            // One call site: the verifier follows the walk once, not once per kind.
            let t = path_target(arg_fd(regs, l.dfd), arg(regs, l.path)?, 0)?;
            if is_compat() {
                return None;
            }
            emit(&header(k, 0, flags), &t, 0);
        }
    }
    Some(())
}

/// An open's flags: an argument, or in the `struct open_how` an argument points to.
fn open_flags(regs: u64, l: &SyscallLayout) -> u32 {
    match l.flags_from {
        flags_from::ARG => arg(regs, l.flags).unwrap_or(0) as u32,
        flags_from::OPEN_HOW => arg(regs, l.flags).map_or(0, |how| {
            // SAFETY: user pointer, read with the helper that tolerates faults.
            unsafe { bpf_probe_read_user(how as *const u64) }.unwrap_or(0) as u32
        }),
        flags_from::CREAT => O_CREAT | O_WRONLY | O_TRUNC,
        _ => 0,
    }
}

/// The agent's own syscalls are not the workload, with two exceptions: it asks what one
/// of its descriptors is (`CALIBRATE`), and a namespace it makes for a job is known.
fn agent_syscall(l: &SyscallLayout, pid_tgid: u64, ret: i64) -> Option<()> {
    if let Some(c) = CALIBRATE.get_ptr_mut(0) {
        // SAFETY: map value pointer, valid for this program run.
        let c = unsafe { &mut *c };
        if c.thread == pid_tgid && c.done == 0 && l.op == op::LOOKUP {
            calibrate(c);
        }
    }
    if l.op == op::NEW_NAMESPACE && ret == 0 {
        let (key, _) = namespace_of(nsproxy()?)?;
        let _ = KNOWN_NAMESPACES.insert(&key, &1, 0);
    }
    Some(())
}

fn calibrate(c: &mut Calibration) {
    if let Some(f) = file_place(c.fd as u32) {
        c.mnt = f.mnt;
        c.dentry = f.dentry;
        // The superblock as `locate` reads it: the mount's, beside its root.
        c.superblock = field::<[u64; 2]>(f.mnt, offset(|o| &o.vfsmount_root)).map_or(0, |m| m[1]);
        c.dev = field(c.superblock, offset(|o| &o.sb_dev)).unwrap_or(0);
        c.name_len = field(f.dentry, offset(|o| &o.dentry_name_len)).unwrap_or(0);
        let name: u64 = field(f.dentry, offset(|o| &o.dentry_name)).unwrap_or(0);
        // SAFETY: fault-tolerant read into the map value.
        let _ = unsafe { bpf_probe_read_kernel_str_bytes(name as *const u8, &mut c.name) };
        c.ino = inode_of(&f).map_or(0, |i| i.ino);
    }
    c.cwd = cwd_place().map_or(0, |p| p.dentry);
    c.nsproxy = nsproxy().unwrap_or(0);
    if let Some((key, inum)) = namespace_of(c.nsproxy) {
        c.namespace = key;
        c.ns_inum = inum;
    }
    c.done = 1;
}

/// floor, on the raw `sys_enter` and `sys_exit` tracepoints: returns at once. Only
/// `cargo xtask bench overhead` attaches it (`hocus-agent trace-floor`), to measure what
/// any program on these tracepoints costs the node, whatever it does.
#[raw_tracepoint(tracepoint = "sys_enter")]
pub fn floor(_ctx: RawTracePointContext) -> i32 {
    0
}

/// sched_process_fork: a job's children stay in the job.
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
    Some(())
}

/// filemap_add, on `filemap:mm_filemap_add_to_page_cache`: a page (or a folio of
/// `1 << order` pages) entered a file's page cache. For a mapped watched file that is
/// what a job read by faulting it in (shared objects, `numpy.memmap`); for every other
/// file on the node it costs one lookup. The agent's own copies and pins are not the
/// workload.
///
/// ```text
/// field:unsigned long pfn;                   offset:8;  size:8; signed:0;
/// field:unsigned long i_ino;                 offset:16; size:8; signed:0;
/// field:unsigned long index;                 offset:24; size:8; signed:0;
/// field:dev_t s_dev;                         offset:32; size:4; signed:0;
/// field:unsigned char order;                 offset:36; size:1; signed:0;
/// ```
#[tracepoint]
pub fn filemap_add(ctx: TracePointContext) -> u32 {
    let _ = try_filemap_add(&ctx);
    0
}

fn try_filemap_add(ctx: &TracePointContext) -> Option<()> {
    // SAFETY: offsets come from the tracepoint's format file.
    let key = InodeKey {
        dev: unsafe { ctx.read_at(global(&FILEMAP_DEV_OFFSET) as usize) }.ok()?,
        _pad: 0,
        ino: unsafe { ctx.read_at(global(&FILEMAP_INO_OFFSET) as usize) }.ok()?,
    };
    let mapped = MAPPED.get_ptr_mut(&key)?;
    current()?;
    // SAFETY: as above; `u32::MAX`: this kernel adds one page at a time.
    let order: u8 = match global(&FILEMAP_ORDER_OFFSET) {
        u32::MAX => 0,
        at => unsafe { ctx.read_at(at as usize) }.ok()?,
    };
    // SAFETY: map value pointer; the add is atomic (faults on several CPUs at once).
    unsafe {
        core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
            &raw mut (*mapped).pages,
            1 << (order & 31),
        )
    };
    Some(())
}

/// sched_process_exit: forget the exiting thread's job. Reads no field: the exiting task
/// is the current one.
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
    // Keyed by the exiting thread: a leader's entry, or one a thread got at its clone.
    let _ = JOBS.remove(&(pid_tgid as u32));
    0
}

fn no_path() -> Target {
    Target {
        flags: 0,
        located: None,
        view: None,
        len: 0,
    }
}

/// Where an event happened: under a root (`located`, the path in `WALK`), and the
/// process's path in a scratch slot (`len` bytes; absolute when not located).
struct Target {
    flags: u32,
    located: Option<Located>,
    /// An absolute path in another namespace's view, or a view to learn.
    view: Option<ViewRef>,
    len: u32,
}

#[derive(Clone, Copy)]
struct ViewRef {
    key: NamespaceKey,
    generation: u64,
    inum: u32,
}

/// Reads a user path into scratch slot `slot`: what an event carries, `len` bytes.
fn read_target(user_path: u64, slot: u32) -> Option<(&'static PathBuf, Target)> {
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
    let mut t = Target {
        len: len as u32,
        ..no_path()
    };
    if len >= MAX_PATH - 1 {
        t.flags |= ev::PATH_TRUNCATED;
        count(counter::PATH_TRUNCATED);
    }
    Some((buf, t))
}

/// Where the path of a path syscall (failed lookup, mutation) lies, if watched. A
/// relative path is placed by the directory it starts from, found like an opened file;
/// an absolute one by the watched prefixes, but only in a namespace whose paths mean
/// what they mean to the agent (a look-alike mounted in another namespace is not it).
/// The path is copied only once a cheap test says it may be watched: most failed
/// lookups on a node (a search path's misses) are nowhere near a watched tree.
fn path_target(dfd: i32, user_path: u64, slot: u32) -> Option<Target> {
    // SAFETY: user pointer, read with the helper that tolerates faults.
    let first: u8 = unsafe { bpf_probe_read_user(user_path as *const u8) }.ok()?;
    if first == b'/' {
        return absolute_target(user_path, slot);
    }
    let start = if dfd == AT_FDCWD {
        cwd_place()?
    } else {
        file_place(dfd as u32)?
    };
    let located = locate(&start)?;
    let (_, mut t) = read_target(user_path, slot)?;
    t.located = Some(located);
    Some(t)
}

/// The first eight bytes of a user path, for a test against the prefixes' first words
/// before the whole path is copied. None if they cannot be read at once (a short path
/// at the end of a page): then the whole path is.
fn first_word(user_path: u64) -> Option<u64> {
    // SAFETY: user pointer, read with the helper that tolerates faults.
    unsafe { bpf_probe_read_user(user_path as *const u64) }.ok()
}

/// Whether a path starting with `word` may lie under `w` (its first eight bytes agree).
fn may_match(word: Option<u64>, w: &Watched) -> bool {
    word.is_none_or(|word| (word ^ w.words[0]) & w.masks[0] == 0)
}

/// An absolute path means what it means to the agent in the agent's own namespace and
/// root, and in the namespaces it made for jobs; elsewhere (a container) it means what
/// that namespace's mounts say, which the agent learns from its mountinfo.
fn absolute_target(user_path: u64, slot: u32) -> Option<Target> {
    let nsproxy = nsproxy()?;
    let home = HOME.get(0)?;
    let at_home = nsproxy == home.nsproxy;
    // One read for most processes on the node (they share the agent's nsproxy).
    let key = if at_home {
        None
    } else {
        Some(namespace_of(nsproxy)?)
    };
    // SAFETY: plain lookup.
    let own = key.is_none_or(|(k, _)| unsafe { KNOWN_NAMESPACES.get(&k) }.is_some());
    if own {
        let word = first_word(user_path);
        if !any_watched(|w| may_match(word, w)) {
            return None;
        }
        let (path, t) = read_target(user_path, slot)?;
        if !any_watched(|w| matches(path, w)) {
            return None;
        }
        // A chroot (in a user namespace, anyone can) keeps the nsproxy: check the root.
        if at_home && root_dentry()? != home.root {
            count(counter::FOREIGN_NAMESPACE);
            return None;
        }
        return Some(t);
    }
    let (key, inum) = key?;
    let generation = generation();
    let view = ViewRef {
        key,
        generation,
        inum,
    };
    // SAFETY: plain lookups.
    match unsafe { VIEWS.get(&key) } {
        Some(v) if v.generation == generation => {
            let word = first_word(user_path);
            if !v
                .prefixes
                .iter()
                .any(|w| w.masks[0] != 0 && may_match(word, w))
            {
                return None;
            }
            let (path, mut t) = read_target(user_path, slot)?;
            if !v
                .prefixes
                .iter()
                .any(|w| w.masks[0] != 0 && matches(path, w))
            {
                return None;
            }
            t.view = Some(view);
            Some(t)
        }
        _ => {
            count(counter::FOREIGN_NAMESPACE);
            if unsafe { ASKED.get(&key) } != Some(&generation) {
                let _ = ASKED.insert(&key, &generation, 0);
                let h = Header {
                    kind: kind::LEARN_VIEW,
                    tgid: (bpf_get_current_pid_tgid() >> 32) as u32,
                    file_id: 0,
                    bytes: 0,
                    open_flags: 0,
                };
                let ask = Target {
                    view: Some(view),
                    ..no_path()
                };
                emit(&h, &ask, 0);
            }
            None
        }
    }
}

/// Whether any watched tree passes `test`.
fn any_watched(test: impl Fn(&Watched) -> bool) -> bool {
    for i in 0..MAX_WATCHED {
        let Some(w) = WATCHED.get(i) else {
            return false;
        };
        if w.len == 0 {
            return false;
        }
        if test(w) {
            return true;
        }
    }
    false
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
    let next = path.bytes[w.len as usize & (MAX_PREFIX - 1)];
    next == 0 || next == b'/'
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

fn emit(h: &Header, t: &Target, slot: u32) {
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
        (*e).flags = t.flags;
        (*e).tgid = h.tgid;
        (*e).uid = bpf_get_current_uid_gid() as u32;
        (*e).time_ns = bpf_ktime_get_ns();
        (*e).file_id = h.file_id;
        (*e).bytes = h.bytes;
        (*e).open_flags = h.open_flags;
        (*e).path_len = t.len;
        (*e).comm = bpf_get_current_comm().unwrap_or([0; 16]);
        let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
        (*e).job = JOBS.get(&tgid).copied().unwrap_or(0);
        (*e).root = ROOT_NONE;
        (*e).base_len = 0;
        (*e).namespace = NamespaceKey::default();
        (*e).generation = 0;
        (*e).ns_inum = 0;
        if let Some(v) = t.view {
            (*e).root = ROOT_VIEW;
            (*e).namespace = v.key;
            (*e).generation = v.generation;
            (*e).ns_inum = v.inum;
        }
        if let Some(l) = t.located {
            (*e).root = l.root;
            let start = l.start as usize & (MAX_PATH - 1);
            let len = (MAX_PATH - start) & (MAX_PATH - 1);
            (*e).base_len = len as u32;
            if let Some(walk) = WALK.get_ptr(0) {
                generated::bpf_probe_read_kernel(
                    (*e).base.as_mut_ptr().cast(),
                    len as u32,
                    (*walk).bytes.as_ptr().add(start).cast(),
                );
            }
        }
        if t.len > 0 {
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
