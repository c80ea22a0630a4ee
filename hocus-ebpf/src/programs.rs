use aya_ebpf::{
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_current_uid_gid,
        bpf_get_smp_processor_id, bpf_ktime_get_ns, bpf_probe_read_kernel,
        bpf_probe_read_kernel_buf, bpf_probe_read_kernel_str_bytes, bpf_probe_read_user,
        bpf_probe_read_user_str_bytes, generated,
    },
    macros::{btf_tracepoint, map, tracepoint},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::{BtfTracePointContext, TracePointContext},
};
use hocus_common::{
    AT_FDCWD, Calibration, Event, FdKey, Home, InodeKey, KernelOffsets, MAX_KNOWN_NAMESPACES,
    MAX_MAPPED, MAX_OPEN_FILES, MAX_PATH, MAX_PREFIX, MAX_PROCESSES, MAX_ROOTS, MAX_SUPERBLOCKS,
    MAX_SYSCALL_NR, MAX_VIEW_ROOTS, MAX_VIEWS, MAX_WATCHED, Mapped, NO_FIELD, NamespaceKey,
    OpenFile, PREFIX_WORDS, PathBuf, RING_BYTES, ROOT_NONE, ROOT_VIEW, Superblock, SuperblockSlot,
    SyscallLayout, View, Watched, counter, ev, filter, flags_from, follow, kfunc, kind, op, rest,
    superblock,
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
/// A map the agent maps into its memory.
const BPF_F_MMAPABLE: u32 = 1 << 10;
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
/// Offset of `group_dead` in sched_process_exit records.
#[unsafe(no_mangle)]
static EXIT_GROUP_DEAD_OFFSET: u32 = 32;
/// Non-zero: `syscall_exit` follows every process, not only `FOLLOWED` ones
/// (`--trace-every-process`).
#[unsafe(no_mangle)]
static TRACE_EVERY_PROCESS: u32 = 0;
/// Offset of `connection` (the FUSE mount's device) in fuse_request_send records.
#[unsafe(no_mangle)]
static FUSE_CONNECTION_OFFSET: u32 = 8;
/// Non-zero: every watched tree is on FUSE and `fuse_request` is attached, so a path
/// syscall of a process at home reached a watched tree only if its thread made a
/// request to it (`REQUESTED`); the others are turned away before their path is read.
#[unsafe(no_mangle)]
static PATHS_BY_REQUEST: u32 = 0;
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
    regs_args: [0; 6],
    file_pointer_type: 0,
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
/// The superblocks those directories are on.
#[map]
static SUPERBLOCKS: HashMap<u64, Superblock> = HashMap::with_max_entries(MAX_SUPERBLOCKS, 0);
/// `SUPERBLOCKS` by slot (`filter::superblock_slot`), kept by the agent: every open on
/// the node asks, and almost every answer is "none" or the slot's one superblock.
#[map]
static SUPERBLOCK_SLOTS: Array<SuperblockSlot> =
    Array::with_max_entries(filter::SUPERBLOCK_SLOTS, 0);
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
/// Bumped when a mount syscall ends (and by the agent when the syscall program wakes
/// from a rest): a view learned before is stale.
#[map]
static MOUNT_GENERATION: Array<u64> = Array::with_max_entries(1, 0);
/// Whether `syscall_exit` is attached (`hocus_common::rest`): the agent detaches it
/// while there is nothing to learn, and the tripwires wake it.
#[map]
static REST: Array<u32> = Array::with_max_entries(1, 0);
/// The watched mounts' devices (`s_dev`, the kernel's encoding; 0 ends the list).
#[map]
static WATCHED_DEVICES: Array<u32> = Array::with_max_entries(MAX_WATCHED, 0);
/// The agent's question about one of its descriptors, and the answer.
#[map]
static CALIBRATE: Array<Calibration> = Array::with_max_entries(1, 0);
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
/// The `hocus-agent run` job each process belongs to: the id is the daemon thread that
/// forked the job's first process. Set at fork, inherited by every descendant.
#[map]
static JOBS: LruHashMap<u32, u32> = LruHashMap::with_max_entries(MAX_PROCESSES, 0);
/// The processes `syscall_exit` follows (`hocus_common::follow`).
#[map]
static FOLLOWED: Array<u64> = Array::with_max_entries(follow::WORDS, BPF_F_MMAPABLE);
/// The threads that made a request to a watched FUSE mount since their last path
/// syscall was looked at (`follow::word`/`bit`, by thread id; `PATHS_BY_REQUEST`).
#[map]
static REQUESTED: Array<u64> = Array::with_max_entries(follow::WORDS, 0);
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
/// Where a typed pointer is written and read back as a plain number (`Typed::address`).
#[map]
static ADDRESS: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

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

/// A syscall's six arguments, read from its saved registers at once: six plain loads
/// at constant offsets, which the verifier checks against `struct pt_regs`.
struct Args([u64; 6]);

impl Args {
    fn of(regs: Typed) -> Self {
        let at = |register: &u32| regs.read::<u64>(global(register));
        let r = &OFFSETS.regs_args;
        Self([
            at(&r[0]),
            at(&r[1]),
            at(&r[2]),
            at(&r[3]),
            at(&r[4]),
            at(&r[5]),
        ])
    }

    /// The argument at `position` (`NO_FIELD`: none).
    fn get(&self, position: u16) -> Option<u64> {
        if position == NO_FIELD {
            return None;
        }
        self.0.get(usize::from(position)).copied()
    }

    /// A directory descriptor argument; `AT_FDCWD` for syscalls that have none.
    fn dfd(&self, position: u16) -> i32 {
        self.get(position).map_or(AT_FDCWD, |d| d as i32)
    }
}

/// Whether `nr` is, in the 32-bit numbering, mount, umount, umount2, pivot_root or
/// move_mount: a 32-bit mount changes what paths mean as much as a 64-bit one.
fn is_ia32_mount(nr: i64) -> bool {
    matches!(nr, 21 | 22 | 52 | 217 | 429)
}

/// Whether the current syscall is a 32-bit one (`int 0x80` or a 32-bit process): its
/// number and registers mean something else, so it is never read as a 64-bit one.
fn is_compat() -> bool {
    task().read::<u32>(offset(|o| &o.thread_status)) & TS_COMPAT != 0
}

// ---- Kernel objects: where a file, a working directory or a namespace is ----

/// A kernel object whose type the verifier knows from BTF: the tracepoint's arguments,
/// the current task, and the struct pointers in their fields. Its fields are read with
/// plain loads, which the JIT guards against faults (a null or stale pointer reads
/// zeros), instead of a helper call each: every syscall on the node pays for what is
/// read before it is turned away. The offsets are read-only data, constants to the
/// verifier, which checks each load against the kernel's types. Anything else (the
/// address in a pointer to pointers, or got through the helper) is only a number to
/// the verifier: it is typed with `cast` where the kernel can, else read with `field`.
#[derive(Clone, Copy)]
struct Typed(u64);

impl Typed {
    fn read<T: Copy>(self, offset: u32) -> T {
        // SAFETY: see the type.
        unsafe { core::ptr::read_volatile((self.0 + u64::from(offset)) as *const T) }
    }

    /// A field that points to a struct: typed too. None if null.
    fn follow(self, offset: u32) -> Option<Typed> {
        let p: u64 = self.read(offset);
        (p != 0).then_some(Typed(p))
    }

    /// The object's address as a plain number, which the verifier lets a program shift
    /// and mask (a filter slot) and hand to `field`, like any address got through the
    /// helper: written to a map and read back (maps keep no pointer types).
    fn address(self) -> u64 {
        let Some(slot) = ADDRESS.get_ptr_mut(0) else {
            return 0;
        };
        // SAFETY: per-CPU slot owned by this program run.
        unsafe {
            core::ptr::write_volatile(slot, self.0);
            core::ptr::read_volatile(slot)
        }
    }
}

/// Reads a field of a kernel object known only by its address, `offset` bytes into it.
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

/// The mount a place was reached through: its root directory and its superblock.
#[derive(Clone, Copy)]
struct Mount {
    root: u64,
    sb: u64,
}

impl Mount {
    /// A `struct vfsmount` known by address: mnt_root then mnt_sb, read at once
    /// (adjacent, checked by the agent).
    fn at(mnt: u64) -> Option<Self> {
        let [root, sb] = field::<[u64; 2]>(mnt, offset(|o| &o.vfsmount_root))?;
        Some(Self { root, sb })
    }

    fn of(mnt: Typed) -> Self {
        let at = offset(|o| &o.vfsmount_root);
        Self {
            root: Typed(mnt.read(at)).address(),
            sb: Typed(mnt.read(at + 8)).address(),
        }
    }
}

fn task() -> Typed {
    // SAFETY: no arguments; the current task, typed.
    Typed(unsafe { generated::bpf_get_current_task_btf() } as u64)
}

/// An open `struct file`: typed where the kernel can cast (`kfunc::RDONLY_CAST`), its
/// fields then read with plain loads; else only its address, its fields read with the
/// helper. Opens of followed processes come here, to be turned away by where they lie.
#[derive(Clone, Copy)]
struct File(Typed);

/// Whether the agent made the cast placeholders calls of the kfunc: a constant to the
/// verifier, which then never looks at the other way.
fn can_cast() -> bool {
    offset(|o| &o.file_pointer_type) != 0
}

/// The object at `address` as BTF type `btf_id` (`bpf_rdonly_cast`).
fn cast(address: u64, btf_id: u32) -> Typed {
    // SAFETY: a helper number the agent rewrites into a call of the kfunc, which only
    // retypes its first argument; taken only where it did (`can_cast`).
    unsafe {
        let cast: unsafe extern "C" fn(u64, u32) -> u64 =
            core::mem::transmute(kfunc::RDONLY_CAST as usize);
        Typed(cast(address, btf_id))
    }
}

/// The file descriptor `fd` of the current process holds now. The table is an array of
/// pointers, which the verifier types as a number: its slot is cast to a struct whose
/// first field points to a file. (The table built into `files_struct` is typed, but
/// almost no process uses it: a child gets a grown table when its parent has a high
/// descriptor open, a shell's fd 255, and keeps it.) No check against max_fds: `fd` was
/// valid at this syscall (a table only grows), and a wrong read lands on no known
/// superblock anyway.
fn file_at(fd: u32) -> Option<File> {
    let files = task().follow(offset(|o| &o.task_files))?;
    let fdt = files.follow(offset(|o| &o.files_fdt))?;
    let slot = fdt.read::<u64>(offset(|o| &o.fdt_fd)) + u64::from(fd) * 8;
    let file = if can_cast() {
        cast(slot, offset(|o| &o.file_pointer_type)).follow(0)?
    } else {
        Typed(field::<u64>(slot, 0).filter(|&f| f != 0)?)
    };
    Some(File(file))
}

impl File {
    /// Its address as a plain number, which identifies it in `OPEN_FILES`.
    fn address(self) -> u64 {
        if can_cast() {
            self.0.address()
        } else {
            self.0.0
        }
    }

    /// Where it lies: the mount it was opened through, and its dentry. f_path is a struct
    /// path: mnt then dentry (checked by the agent).
    fn place(self) -> Option<(Mount, Dentry)> {
        let at = offset(|o| &o.file_mnt);
        if can_cast() {
            let mnt = self.0.follow(at)?;
            return Some((Mount::of(mnt), Dentry::of(Typed(self.0.read(at + 8)))));
        }
        let [mnt, dentry] = field::<[u64; 2]>(self.0.0, at)?;
        Some((Mount::at(mnt)?, Dentry(dentry)))
    }
}

/// A directory entry: typed where files are (`can_cast`), its fields then read with
/// plain loads as `locate` walks up; else its address, read with the helper. One way or
/// the other for the whole program, so that the verifier follows one walk.
#[derive(Clone, Copy)]
struct Dentry(u64);

impl Dentry {
    /// A typed dentry (a working directory, a typed file's), kept typed where files are.
    fn of(d: Typed) -> Self {
        if can_cast() {
            Self(d.0)
        } else {
            Self(d.address())
        }
    }

    /// Its address as a plain number.
    fn address(self) -> u64 {
        if can_cast() {
            Typed(self.0).address()
        } else {
            self.0
        }
    }

    /// Its parent, and the length and address of its name.
    fn up(self) -> Option<(Dentry, u32, u64)> {
        let parent_at = offset(|o| &o.dentry_parent);
        let (len_at, name_at) = (offset(|o| &o.dentry_name_len), offset(|o| &o.dentry_name));
        if can_cast() {
            let d = Typed(self.0);
            return Some((Self(d.read(parent_at)), d.read(len_at), d.read(name_at)));
        }
        Some((
            Self(field(self.0, parent_at)?),
            field(self.0, len_at)?,
            field(self.0, name_at)?,
        ))
    }
}

/// The page cache key of what a descriptor is open on: its superblock's device and its
/// inode's number.
fn inode_of(mount: Mount, dentry: Dentry) -> Option<InodeKey> {
    let inode: u64 = field(dentry.address(), offset(|o| &o.dentry_inode))?;
    Some(InodeKey {
        dev: field(mount.sb, offset(|o| &o.sb_dev))?,
        _pad: 0,
        ino: field(inode, offset(|o| &o.inode_ino))?,
    })
}

/// The current process's working directory: the mount it was reached through, and its
/// dentry. Plain loads all the way.
fn cwd() -> Option<(Mount, Dentry)> {
    let fs = task().follow(offset(|o| &o.task_fs))?;
    // fs->pwd is a struct path: mnt then dentry (checked by the agent).
    let at = offset(|o| &o.fs_pwd_mnt);
    let mnt = fs.follow(at)?;
    Some((Mount::of(mnt), Dentry::of(Typed(fs.read(at + 8)))))
}

/// The current process's mount namespace (from its nsproxy) and root: what its absolute
/// paths mean; and the namespace's inode number, which the agent checks.
fn namespace_of(nsproxy: Typed) -> Option<(NamespaceKey, u32)> {
    let mnt_ns = nsproxy.follow(offset(|o| &o.nsproxy_mnt_ns))?;
    let key = NamespaceKey {
        namespace: mnt_ns.read(offset(|o| &o.mnt_ns_id)),
        root: root_dentry()?,
    };
    Some((key, mnt_ns.read(offset(|o| &o.mnt_ns_inum))))
}

fn nsproxy() -> Option<Typed> {
    task().follow(offset(|o| &o.task_nsproxy))
}

fn root_dentry() -> Option<u64> {
    let fs = task().follow(offset(|o| &o.task_fs))?;
    Some(fs.read(offset(|o| &o.fs_root_dentry)))
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

/// Places a dentry, reached through `mount`, under one of `ROOTS` by walking up its
/// parents, whatever mount or namespace it was reached through: a tree bound elsewhere
/// in a container is still the tree, a look-alike mounted at the same path is another
/// superblock. Every open on the node comes here: most leave at the superblock test.
fn locate(mount: Mount, dentry: Dentry) -> Option<Located> {
    let slot = SUPERBLOCK_SLOTS.get(filter::superblock_slot(mount.sb))?;
    let known = match slot.count {
        0 => return None,
        1 if slot.address == mount.sb => slot.superblock,
        // SAFETY: plain value copy.
        _ => unsafe { *SUPERBLOCKS.get(&mount.sb)? },
    };
    // Only the cache is on this disk: what matters is reached through hocus's binds
    // (mounts rooted inside the cache), not through the disk's own mount.
    if known.flags & (superblock::WATCHED | superblock::SNAPSHOT_VIEW) == 0
        && mount.root == known.root
    {
        return None;
    }
    let buf = WALK.get_ptr_mut(0)?;
    // SAFETY: per-CPU scratch owned by this program run.
    let buf = unsafe { &mut *buf };
    let mut pos = MAX_PATH;
    let mut d = dentry;
    for _ in 0..WALK_DEPTH {
        // SAFETY: plain value copy. One lookup rather than a comparison per root: the
        // verifier then follows one "found" path per step, not one per root. A typed
        // dentry is a key like its address (the loader is privileged).
        if let Some(&root) = unsafe { ROOTS.get(&d.0) } {
            return Some(Located {
                root,
                start: pos as u32,
            });
        }
        let (parent, len, name) = d.up()?;
        if parent.0 == d.0 {
            return None; // the filesystem's root, above every watched tree
        }
        let len = len as usize;
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

/// syscall_exit, on `tp_btf/sys_exit`: every syscall of every process on the node passes
/// here, so anything not traced costs a plain load (its number, from the saved
/// registers) and one table lookup, and a process not followed (`hocus_common::follow`)
/// one more load of its bit. The arguments are read from the saved registers
/// too (the kernel does not change them) and the result is the tracepoint's second
/// argument. Opens are placed by what they opened; failed lookups and mutations by
/// where their path lies; reads add their bytes to the open file; the first write to a
/// file is reported once it succeeded; a close forgets its descriptor; a mount makes
/// learned views stale. Nothing runs at syscall entry: a program there would cost
/// every syscall on the node a second run.
#[btf_tracepoint(function = "sys_exit")]
pub fn syscall_exit(ctx: BtfTracePointContext) -> i32 {
    let _ = try_syscall_exit(&ctx);
    0
}

/// Whether `syscall_exit` follows process `tgid` (`hocus_common::follow`): one array
/// load, for every traced syscall on the node.
fn is_followed(tgid: u32) -> bool {
    global(&TRACE_EVERY_PROCESS) != 0 || in_followed(tgid)
}

fn in_followed(id: u32) -> bool {
    FOLLOWED
        .get(follow::word(id))
        .is_none_or(|w| w & follow::bit(id) != 0)
}

/// Follows `id` from now on: a process, or a thread a followed process made.
fn follow(id: u32) {
    if id == 0 || global(&TRACE_EVERY_PROCESS) != 0 {
        return;
    }
    set_bit(&FOLLOWED, id);
}

/// Stops following `id` (gone).
fn unfollow(id: u32) {
    clear_bit(&FOLLOWED, id);
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
fn may_reach_watched(thread: u32) -> bool {
    if global(&PATHS_BY_REQUEST) == 0 || clear_bit(&REQUESTED, thread) {
        return true;
    }
    match (nsproxy(), HOME.get(0)) {
        (Some(nsproxy), Some(home)) => nsproxy.0 != home.nsproxy,
        _ => true,
    }
}

/// Whether process `tgid` may hold a watched descriptor (false: certainly not).
fn may_hold_files(tgid: u32) -> bool {
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

/// A close of a watched descriptor is reported by exactly one program run: the close's
/// exit, or the exit of another thread's open that took the freed number first (a close
/// and an open of one process race for the number when nothing runs at syscall entry).
/// Whoever swaps the entry's `file` for 0 reports it; the entry's facts are read before.
/// Returns the entry's file id and bytes read if this run claimed its close.
fn claim_close(entry: *mut OpenFile) -> Option<(u64, u64)> {
    // SAFETY: map value pointer, valid for this program run; the file is read first, as
    // an open republishing the entry writes it last.
    let (file, file_id, bytes) = unsafe {
        (
            core::ptr::read_volatile(&raw const (*entry).file),
            core::ptr::read_volatile(&raw const (*entry).file_id),
            core::ptr::read_volatile(&raw const (*entry).bytes_read),
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
    claimed.then_some((file_id, bytes))
}

/// Removes process `tgid`'s entry for descriptor `key`, if it has one.
fn forget_open_file(key: &FdKey) {
    if OPEN_FILES.remove(key).is_ok() {
        count_held(key.tgid, u32::MAX);
    }
}

/// The open watched file descriptor `fd` of a read, write, ftruncate or mmap names:
/// filtered and looked up first (almost every descriptor is not one), then refused for
/// a 32-bit syscall, whose arguments are not where `l` says.
#[inline(always)]
fn watched_file(fd: u32, tgid: u32) -> Option<*mut OpenFile> {
    if !may_hold_files(tgid) {
        return None;
    }
    let file = OPEN_FILES.get_ptr_mut(&FdKey { tgid, fd })?;
    // SAFETY: map value pointer, valid for this program run.
    if unsafe { core::ptr::read_volatile(&raw const (*file).file) } == 0 || is_compat() {
        return None; // closed (its number not reused by a watched file since)
    }
    Some(file)
}

/// What descriptor `fd`, just opened, is: its `struct file`'s address and where it
/// lies, if under a root.
fn opened(fd: u32) -> Option<(u64, Located)> {
    let file = file_at(fd)?;
    let (mount, dentry) = file.place()?;
    Some((file.address(), locate(mount, dentry)?))
}

/// The checks of `is_compat` (a read of the task) come after the cheap tests that turn
/// away almost every syscall on the node, and before anything is changed or sent.
fn try_syscall_exit(ctx: &BtfTracePointContext) -> Option<()> {
    let regs = Typed(ctx.arg(0));
    let nr: i64 = regs.read(offset(|o| &o.regs_nr));
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
    // After the mount, whoever made it: a view learned while it was under way is stale.
    if l.op == op::MOUNTS_CHANGE {
        mounts_change();
        return Some(());
    }
    if !is_followed(tgid) {
        return None;
    }
    let args = Args::of(regs);
    let header = |kind, file_id, open_flags| Header {
        kind,
        tgid,
        file_id,
        bytes: 0,
        open_flags,
    };
    match l.op {
        op::READ if ret > 0 => {
            let file = watched_file(args.get(l.fd)? as u32, tgid)?;
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
        // A close, or a dup2/dup3 onto the descriptor, whatever the result: what the
        // descriptor holds now tells whether it still holds the watched file.
        op::CLOSE => {
            if !may_hold_files(tgid) {
                return None;
            }
            let fd = args.get(l.fd)? as u32;
            let key = FdKey { tgid, fd };
            let entry = OPEN_FILES.get_ptr_mut(&key)?;
            // SAFETY: map value pointer, valid for this program run.
            let file = unsafe { core::ptr::read_volatile(&raw const (*entry).file) };
            if file == 0 || is_compat() {
                return None;
            }
            // Still the same file (a failed close or dup2, a dup2 onto itself); or
            // another thread of the process opened a file at the freed number since and
            // that open's exit took the entry: it is that file's now.
            if file_at(fd).map(File::address) == Some(file) {
                return Some(());
            }
            // The entry stays, closed: an open of another thread may be taking it for
            // the number at this moment, and a delete would lose that open. The next
            // open at the number reuses it; the agent removes a gone process's.
            let (file_id, bytes) = claim_close(entry)?;
            let h = Header {
                bytes,
                ..header(kind::CLOSE, file_id, 0)
            };
            emit(&h, &no_path(), 0);
        }
        // A failed write changes nothing.
        op::WRITE | op::FTRUNCATE if (l.op == op::WRITE && ret > 0) || ret == 0 => {
            let file = watched_file(args.get(l.fd)? as u32, tgid)?;
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
            let fd = args.get(l.fd)? as i32;
            if fd < 0 {
                return None;
            }
            let file = watched_file(fd as u32, tgid)?;
            // SAFETY: map value pointer, valid for this program run.
            let file_id = unsafe { (*file).file_id };
            let (mount, dentry) = file_at(fd as u32)?.place()?;
            let inode = inode_of(mount, dentry)?;
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
            // The descriptor number may still name a watched file whose close was not seen
            // (closed by exec or close_range), or whose close's exit has not run yet
            // (another thread's close, racing this open for the number): it is reported
            // closed here, so that no close is lost uncounted. Filtered and looked up
            // first: almost every open on the node misses.
            let stale = if may_hold_files(tgid) {
                OPEN_FILES.get_ptr_mut(&key)
            } else {
                None
            };
            if let Some(old) = stale {
                if is_compat() {
                    return None;
                }
                if let Some((file_id, bytes)) = claim_close(old) {
                    let h = Header {
                        bytes,
                        ..header(kind::CLOSE, file_id, 0)
                    };
                    emit(&h, &no_path(), 0);
                }
            }
            let Some((file, located)) = opened(ret as u32) else {
                if stale.is_some() {
                    forget_open_file(&key);
                }
                return Some(());
            };
            if is_compat() {
                return None;
            }
            let file_id = next_id();
            match stale {
                // The entry again, for this file: its file last, which publishes it.
                // SAFETY: map value pointer, valid for this program run.
                Some(old) => unsafe {
                    (*old).file_id = file_id;
                    (*old).bytes_read = 0;
                    (*old).written = 0;
                    core::ptr::write_volatile(&raw mut (*old).file, file);
                },
                None => {
                    let entry = OpenFile {
                        file_id,
                        file,
                        ..Default::default()
                    };
                    // Counted before it exists, so a filter never says "none" wrongly.
                    count_held(tgid, 1);
                    if OPEN_FILES.insert(&key, &entry, BPF_NOEXIST).is_err() {
                        count_held(tgid, u32::MAX);
                        count(counter::LOST_OPEN_FILES_FULL);
                    }
                }
            }
            let target = Target {
                located: Some(located),
                ..no_path()
            };
            emit(
                &header(kind::OPEN, file_id, open_flags(&args, l)),
                &target,
                0,
            );
        }
        op::RENAME if ret == 0 => {
            if !may_reach_watched(pid_tgid as u32) || is_compat() {
                return None;
            }
            // One after the other: both use the same walk buffer.
            if let Some(t) = path_target(args.dfd(l.dfd), args.get(l.path)?, 0) {
                emit(&header(kind::RENAME_FROM, 0, 0), &t, 0);
            }
            if let Some(t) = path_target(args.dfd(l.dfd2), args.get(l.path2)?, 1) {
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
            // A write a read-only bind refused made no request: looked at whatever.
            let flags = if k == kind::REFUSED_WRITE {
                let flags = open_flags(&args, l);
                if l.op == op::OPEN && flags & (O_ACCMODE | O_CREAT | O_TRUNC) == 0 {
                    return Some(()); // a read-only open cannot be a refused write
                }
                flags
            } else if may_reach_watched(pid_tgid as u32) {
                0
            } else {
                return None;
            };
            // One call site: the verifier follows the walk once, not once per kind.
            let t = path_target(args.dfd(l.dfd), args.get(l.path)?, 0)?;
            if is_compat() {
                return None;
            }
            emit(&header(k, 0, flags), &t, 0);
        }
    }
    Some(())
}

/// An open's flags: an argument, or in the `struct open_how` an argument points to.
fn open_flags(args: &Args, l: &SyscallLayout) -> u32 {
    match l.flags_from {
        flags_from::ARG => args.get(l.flags).unwrap_or(0) as u32,
        flags_from::OPEN_HOW => args.get(l.flags).map_or(0, |how| {
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

/// floor, on `tp_btf/sys_exit`: returns at once. Only `cargo xtask bench overhead`
/// attaches it (`hocus-agent trace-floor`), to measure what any program there costs the
/// node, whatever it does.
#[btf_tracepoint(function = "sys_exit")]
pub fn floor(_ctx: BtfTracePointContext) -> i32 {
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
        follow(child);
    } else if in_followed(forker) {
        follow(child);
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
    // A read from a watched mount's server, whatever the filesystem.
    let _ = tripped(key.dev);
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

/// fuse_request, on `fuse:fuse_request_send`: a request to a FUSE filesystem (sshfs ...),
/// made in the context of the process that needs it. While `syscall_exit` rests, the
/// first one to a watched mount (a lookup, a stat, an open) wakes it; other filesystems
/// never pass here, so resting costs them nothing.
///
/// ```text
/// field:dev_t connection;                    offset:8;  size:4; signed:0;
/// field:uint64_t unique;                     offset:16; size:8; signed:0;
/// field:enum fuse_opcode opcode;             offset:24; size:4; signed:0;
/// ```
#[tracepoint]
pub fn fuse_request(ctx: TracePointContext) -> u32 {
    // SAFETY: the offset comes from the tracepoint's format file.
    if let Ok(dev) = unsafe { ctx.read_at::<u32>(global(&FUSE_CONNECTION_OFFSET) as usize) } {
        if let Some(thread) = tripped(dev) {
            if global(&PATHS_BY_REQUEST) != 0 {
                set_bit(&REQUESTED, thread);
            }
        }
    }
    0
}

/// A tripwire: if `dev` is a watched mount's device, the current process is followed
/// from now on (this very syscall too: its exit comes after), and a resting
/// `syscall_exit` is asked to attach again, once. The agent's own work on the mount
/// (copies, checks) is neither. Returns the thread, if `dev` is watched.
fn tripped(dev: u32) -> Option<u32> {
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
    if unsafe { *state } != rest::RESTING {
        return thread;
    }
    // SAFETY: as above. Two CPUs may both get here: the agent wakes once either way.
    unsafe { *state = rest::WAKING };
    let h = Header {
        kind: kind::WAKE,
        tgid,
        file_id: 0,
        bytes: 0,
        open_flags: 0,
    };
    emit(&h, &no_path(), 0);
    thread
}

fn is_watched_device(dev: u32) -> bool {
    for i in 0..MAX_WATCHED {
        match WATCHED_DEVICES.get(i).copied() {
            Some(0) | None => return false,
            Some(d) if d == dev => return true,
            Some(_) => {}
        }
    }
    false
}

/// sched_process_exit: forget the exiting thread's job, and stop following it; the
/// process too once its last thread is gone (`group_dead`). The exiting task is the
/// current one.
///
/// ```text
/// field:char comm[16];                       offset:8;  size:16; signed:0;
/// field:pid_t pid;                           offset:24; size:4;  signed:1;
/// field:int prio;                            offset:28; size:4;  signed:1;
/// field:bool group_dead;                     offset:32; size:1;  signed:0;
/// ```
#[tracepoint]
pub fn process_exit(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (thread, tgid) = (pid_tgid as u32, (pid_tgid >> 32) as u32);
    // Keyed by the exiting thread: a leader's entry, or one a thread got at its clone.
    let _ = JOBS.remove(&thread);
    if thread != tgid {
        unfollow(thread);
    }
    // SAFETY: the offset comes from the tracepoint's format file.
    let group_dead: u8 =
        unsafe { ctx.read_at(global(&EXIT_GROUP_DEAD_OFFSET) as usize) }.unwrap_or(0);
    if group_dead != 0 {
        unfollow(tgid);
    }
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
    // One read of user memory tells an absolute path and gives the prefix test its
    // first eight bytes; a short path at the end of a page is read a byte at a time.
    let word = FirstWord::of(user_path);
    let first = if word.known == u64::MAX {
        word.bytes as u8
    } else {
        // SAFETY: user pointer, read with the helper that tolerates faults.
        unsafe { bpf_probe_read_user(user_path as *const u8) }.ok()?
    };
    if first == b'/' {
        return absolute_target(user_path, word, slot);
    }
    let (mount, dentry) = if dfd == AT_FDCWD {
        cwd()?
    } else {
        file_at(dfd as u32)?.place()?
    };
    let located = locate(mount, dentry)?;
    let (_, mut t) = read_target(user_path, slot)?;
    t.located = Some(located);
    Some(t)
}

/// The first eight bytes of a user path, for a test against the prefixes' first words
/// before the whole path is copied. They may not be readable at once (a short path at
/// the end of a page): then `known` is 0 and every prefix may match. (Not an Option: the
/// verifier refuses the undefined payload of a None that LLVM may pass along.)
#[derive(Clone, Copy)]
struct FirstWord {
    bytes: u64,
    /// All ones if the bytes were read, else 0.
    known: u64,
}

impl FirstWord {
    fn of(user_path: u64) -> Self {
        // SAFETY: user pointer, read with the helper that tolerates faults.
        match unsafe { bpf_probe_read_user(user_path as *const u64) } {
            Ok(bytes) => Self {
                bytes,
                known: u64::MAX,
            },
            Err(_) => Self { bytes: 0, known: 0 },
        }
    }
}

/// Whether a path starting with `word` may lie under `w` (its first eight bytes agree).
fn may_match(word: FirstWord, w: &Watched) -> bool {
    (word.bytes ^ w.words[0]) & w.masks[0] & word.known == 0
}

/// An absolute path means what it means to the agent in the agent's own namespace and
/// root, and in the namespaces it made for jobs; elsewhere (a container) it means what
/// that namespace's mounts say, which the agent learns from its mountinfo.
fn absolute_target(user_path: u64, word: FirstWord, slot: u32) -> Option<Target> {
    let nsproxy = nsproxy()?;
    let home = HOME.get(0)?;
    let at_home = nsproxy.0 == home.nsproxy;
    // One read for most processes on the node (they share the agent's nsproxy).
    let key = if at_home {
        None
    } else {
        Some(namespace_of(nsproxy)?)
    };
    // SAFETY: plain lookup.
    let own = key.is_none_or(|(k, _)| unsafe { KNOWN_NAMESPACES.get(&k) }.is_some());
    if own {
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
    entry.submit(if h.kind == kind::WAKE || pending >= WAKEUP_BYTES {
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
