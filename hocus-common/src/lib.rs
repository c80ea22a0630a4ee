//! The contract between hocus's eBPF programs and its agent: map keys and values, the
//! event record, and the constants both sides agree on. Everything is `#[repr(C)]` and
//! plain data, so the same bytes mean the same thing on both sides.
#![cfg_attr(not(test), no_std)]

/// Longest path the kernel side copies; longer paths arrive truncated and flagged.
pub const MAX_PATH: usize = 512;
/// Longest watched prefix.
pub const MAX_PREFIX: usize = 256;
/// Words of a watched prefix.
pub const PREFIX_WORDS: usize = MAX_PREFIX / 8;
/// How many trees can be watched.
pub const MAX_TREES: usize = 8;
/// Entries of the kernel's prefix table: the trees.
pub const MAX_WATCHED: u32 = MAX_TREES as u32;
/// Size of the syscall-number-indexed layout table.
pub const MAX_SYSCALL_NR: u32 = 512;
/// `AT_FDCWD`, the "relative to the working directory" descriptor.
pub const AT_FDCWD: i32 = -100;
/// A field a syscall does not have.
pub const NO_FIELD: u16 = u16::MAX;
/// Size of the kernel's event ring buffer.
pub const RING_BYTES: u32 = 16 << 20;
/// Entries in the table of open watched files.
pub const MAX_OPEN_FILES: u32 = 65536;
/// Processes whose `hocus-agent run` job the kernel side remembers.
pub const MAX_PROCESSES: u32 = 65536;
/// Directories the kernel places files under: the watched trees, then the cache's
/// copies (`files/`) and snapshots (`trees/`).
pub const MAX_ROOTS: usize = 12;
/// Lazy snapshots' overlays in jobs' namespaces, which the kernel side places
/// files under, beside the roots: `Event::root` `FIRST_OVERLAY_ROOT` and up.
pub const MAX_OVERLAY_ROOTS: u32 = 4096;
pub const FIRST_OVERLAY_ROOT: u32 = MAX_ROOTS as u32;
/// `Event::root` of a path that is absolute in the agent's own view of the mounts.
pub const ROOT_NONE: u32 = u32::MAX;
/// Mount namespaces whose paths the kernel side takes as the agent's own: the agent's,
/// and those it makes for jobs.
pub const MAX_KNOWN_NAMESPACES: u32 = 4096;
/// Superblocks the kernel side looks at.
pub const MAX_SUPERBLOCKS: u32 = 32 + MAX_OVERLAY_ROOTS;
/// `Event::root` of an absolute path in another mount namespace's view (`Event::namespace`).
pub const ROOT_VIEW: u32 = u32::MAX - 1;
/// Other mount namespaces (containers) whose view of the watched trees the kernel holds.
pub const MAX_VIEWS: u32 = 1024;
/// Paths at which one namespace sees watched trees.
pub const VIEW_PREFIXES: usize = 4;
/// Watched files whose mapped pages the kernel side counts (by inode; least recently
/// touched forgotten first).
pub const MAX_MAPPED: u32 = 8192;

/// Filters that turn away what is not watched with one array load instead of a hash
/// lookup. A slot counts the entries of a hash map that fall in it, so a zero says
/// "certainly not there"; anything else only "look it up".
pub mod filter {
    /// Slots for processes, by thread group id: `HELD` counts the `OPEN_FILES` entries
    /// the kernel side made, `RELEASED` those the agent removed (each array has one
    /// writer, so neither needs a lock): equal, the process holds no watched file.
    pub const PROCESS_SLOTS: u32 = 1 << 16;
    /// Slots for `SUPERBLOCKS`, by address (`SuperblockSlot`, written by the agent only).
    pub const SUPERBLOCK_SLOTS: u32 = 1 << 12;

    pub const fn process_slot(tgid: u32) -> u32 {
        tgid & (PROCESS_SLOTS - 1)
    }

    /// Superblocks are allocated a few KiB each: the bits above 2 KiB tell them apart.
    pub const fn superblock_slot(sb: u64) -> u32 {
        (sb >> 11) as u32 & (SUPERBLOCK_SLOTS - 1)
    }
}

/// The processes `syscall_exit` follows (`FOLLOWED`): jobs and their descendants from
/// their start, and any other process from its first request to a watched mount's
/// server (a FUSE request, a page read from it), which is seen in full. Every other
/// process's syscalls are turned away after one array load: the node's work that never
/// touches a watched tree pays the floor and no more. A table with one byte for every
/// process id the kernel can hand out (`PID_MAX_LIMIT`, 2^22 on 64-bit): a thread group
/// id, or the thread id of a thread a followed process made, until it exits. No two
/// processes share a byte, so nobody can crowd another out of the table; and a byte, not
/// a bit, so that following or forgetting one is a plain store, which every kernel has
/// (an atomic OR on a word of bits needs 5.12) and which no other CPU's store undoes.
pub mod follow {
    /// The kernel's `PID_MAX_LIMIT` on 64-bit: no process id reaches it.
    pub const IDS: u32 = 1 << 22;
    /// Ids per entry of the table: a cache line of bytes.
    pub const PER_ENTRY: usize = 64;
    pub const ENTRIES: u32 = IDS / PER_ENTRY as u32;
    pub type Entry = [u8; PER_ENTRY];

    /// The entry that holds `id`'s byte.
    pub const fn entry(id: u32) -> u32 {
        id / PER_ENTRY as u32
    }

    /// `id`'s byte in its entry.
    pub const fn byte(id: u32) -> usize {
        id as usize % PER_ENTRY
    }
}

/// Kernel functions (kfuncs) the programs call. Rust eBPF cannot declare one (aya has
/// no extern kfunc declarations), so a program calls a helper number no kernel has, and
/// the agent rewrites each such call, before loading, into a call of the kfunc by its id
/// in the kernel's BTF; on a kernel without it, into a copy of the first argument, on a
/// path the programs never take there (`KernelOffsets::file_pointer_type` is 0).
pub mod kfunc {
    /// `bpf_rdonly_cast(address, btf_id)` (6.2): the object at `address` as BTF type
    /// `btf_id`, whose fields the program then reads with plain loads instead of a
    /// helper call each. The verifier inlines it: it costs nothing.
    pub const RDONLY_CAST: i32 = 0x6b66_0001;
    pub const RDONLY_CAST_NAME: &str = "bpf_rdonly_cast";
}

/// What a traced syscall means for the profile.
pub mod op {
    pub const NONE: u8 = 0;
    /// open, openat, openat2, creat: success opens a file, ENOENT is a failed lookup.
    pub const OPEN: u8 = 1;
    /// stat and access family: only ENOENT matters (a failed lookup).
    pub const LOOKUP: u8 = 2;
    pub const UNLINK: u8 = 3;
    pub const RMDIR: u8 = 4;
    pub const MKDIR: u8 = 5;
    /// rename family: two paths.
    pub const RENAME: u8 = 6;
    pub const TRUNCATE: u8 = 7;
    /// read family on a descriptor: bytes are added up in the kernel.
    pub const READ: u8 = 8;
    /// write family on a descriptor: marks the open file written.
    pub const WRITE: u8 = 9;
    pub const FTRUNCATE: u8 = 10;
    /// close, and dup2/dup3 (which close their target): forgets a watched descriptor.
    pub const CLOSE: u8 = 11;
    /// unshare: when the agent's own thread makes a job's mount namespace, the kernel
    /// side takes paths in it as the agent's own.
    pub const NEW_NAMESPACE: u8 = 12;
    /// mount, umount2, move_mount, pivot_root: what absolute paths mean may change, in
    /// this namespace and (by propagation) in others; every learned view is stale.
    pub const MOUNTS_CHANGE: u8 = 13;
    /// mmap of a descriptor: a watched file mapped is read by page faults, not `read`,
    /// so the pages that enter its page cache from then on are counted.
    pub const MMAP: u8 = 14;
}

/// What the kernel side knows about a superblock (`SUPERBLOCKS`).
pub mod superblock {
    /// A watched tree is on it: every file opened on it is placed.
    pub const WATCHED: u32 = 1;
    /// The cache is on it: only files reached through a bind mount (hocus's binds of
    /// local copies) are placed, so other opens on the same disk cost one comparison.
    pub const CACHE: u32 = 2;
    /// A snapshot's overlay in a job (an overlay hocus made): every file opened on it is
    /// placed, under the overlay's root.
    pub const SNAPSHOT_OVERLAY: u32 = 4;
}

/// A superblock the kernel side looks at (`SUPERBLOCKS`, by address).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Superblock {
    /// `superblock` flags.
    pub flags: u32,
    pub _pad: u32,
    /// Its root directory's dentry (`s_root`): a mount rooted there is the filesystem's
    /// own, not one of hocus's binds.
    pub root: u64,
}

/// A slot of `SUPERBLOCK_SLOTS` (`filter::superblock_slot`): how many of `SUPERBLOCKS`
/// fall in it, and when that is one, which and what it is, so most opens on the node
/// are answered by one array load: none here, or this one. More than one: look it up.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SuperblockSlot {
    pub count: u32,
    pub _pad: u32,
    pub address: u64,
    pub superblock: Superblock,
}

/// Where the kernel keeps the fields the programs read, from the kernel's BTF (Rust eBPF
/// has no CO-RE relocations). Byte offsets; dotted names are nested fields.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOffsets {
    pub task_files: u32,
    pub task_fs: u32,
    pub task_nsproxy: u32,
    pub files_fdt: u32,
    pub fdt_fd: u32,
    /// file.f_path (a struct path: mnt, then dentry)
    pub file_mnt: u32,
    /// fs_struct.pwd (a struct path)
    pub fs_pwd_mnt: u32,
    /// fs_struct.root.dentry
    pub fs_root_dentry: u32,
    pub dentry_parent: u32,
    /// dentry.d_name.len
    pub dentry_name_len: u32,
    /// dentry.d_name.name
    pub dentry_name: u32,
    /// vfsmount.mnt_root, followed by mnt_sb
    pub vfsmount_root: u32,
    pub sb_root: u32,
    pub sb_dev: u32,
    pub nsproxy_mnt_ns: u32,
    /// A mount namespace's id that is never reused.
    pub mnt_ns_id: u32,
    /// Its inode number (what /proc/PID/ns/mnt shows; reused after the namespace goes).
    pub mnt_ns_inum: u32,
    /// file.f_pos: where a read without an offset started, less what it returned
    pub file_pos: u32,
    /// pt_regs.orig_ax: the syscall number, which `ax` no longer holds at exit.
    pub regs_nr: u32,
    /// task_struct.thread_info.status, whose `TS_COMPAT` bit marks a 32-bit syscall
    /// (numbered and passed differently: it must not be read as a 64-bit one).
    pub thread_status: u32,
    /// dentry.d_inode
    pub dentry_inode: u32,
    /// dentry.d_sb: the superblock a dentry given on its own lies on
    pub dentry_sb: u32,
    /// inode.i_ino
    pub inode_ino: u32,
    /// task_struct.signal, the thread group's shared state
    pub task_signal: u32,
    /// signal_struct.live: the group's threads not yet exiting; 0 at the last one's
    /// `sched_process_exit` (what `group_dead` says on kernels whose record has it).
    pub signal_live: u32,
    /// The pt_regs fields holding a syscall's six arguments, by position: constants
    /// (read-only data) for the verifier, so each is read with a plain load.
    pub regs_args: [u32; 6],
    /// Not an offset: the BTF id of a struct whose first field points to a `struct file`
    /// (`kiocb`). A descriptor table's slot cast to it (`kfunc::RDONLY_CAST`) reads as a
    /// typed file; 0 on a kernel without the kfunc, where slots and files are read with
    /// the helper instead.
    pub file_pointer_type: u32,
}

/// How another mount namespace sees the watched trees, learned by the agent from
/// /proc/PID/mountinfo: the paths at which it sees them (a coarse filter; the agent
/// resolves each path precisely), valid while `MOUNT_GENERATION` is `generation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct View {
    pub generation: u64,
    pub prefixes: [Watched; VIEW_PREFIXES],
}

/// The agent's own mount namespace and root, compared first: most processes share them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Home {
    pub nsproxy: u64,
    pub root: u64,
}

/// A mount namespace and a root directory: together they say what an absolute path means.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NamespaceKey {
    pub namespace: u64,
    /// The address of the root directory's dentry.
    pub root: u64,
}

/// The agent asks the kernel side what one of its own descriptors is, which both finds
/// the addresses `Roots` needs and checks the offsets: the answers must agree with what
/// `fstat` and the directory's name say.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Calibration {
    /// The agent thread that asks (`bpf_get_current_pid_tgid` of it).
    pub thread: u64,
    pub fd: i32,
    /// Set by the kernel side once answered.
    pub done: u32,
    pub dentry: u64,
    pub superblock: u64,
    /// The superblock's root directory (`s_root`).
    pub superblock_root: u64,
    /// The superblock's `s_dev`, in the kernel's encoding (major << 20 | minor).
    pub dev: u32,
    pub name_len: u32,
    /// The asking thread's working directory's dentry.
    pub cwd: u64,
    pub namespace: NamespaceKey,
    pub nsproxy: u64,
    pub ns_inum: u32,
    pub _pad: u32,
    /// The inode number of the descriptor's file.
    pub ino: u64,
    pub name: [u8; 64],
}

impl Default for Calibration {
    fn default() -> Self {
        Self {
            thread: 0,
            fd: -1,
            done: 0,
            dentry: 0,
            superblock: 0,
            superblock_root: 0,
            dev: 0,
            name_len: 0,
            cwd: 0,
            namespace: NamespaceKey::default(),
            nsproxy: 0,
            ns_inum: 0,
            _pad: 0,
            ino: 0,
            name: [0; 64],
        }
    }
}

/// Where an open syscall keeps its flags.
pub mod flags_from {
    pub const NONE: u8 = 0;
    /// A plain syscall argument.
    pub const ARG: u8 = 1;
    /// The first u64 of the `struct open_how` the argument points to (openat2).
    pub const OPEN_HOW: u8 = 2;
    /// `creat(2)`: always `O_CREAT | O_WRONLY | O_TRUNC`.
    pub const CREAT: u8 = 3;
}

/// Which of a syscall's arguments the programs read: each field is the argument's
/// position (0 to 5, from the tracefs format, by name), `NO_FIELD` for none; the
/// registers of the positions are `KernelOffsets::regs_args`. Indexed by syscall number.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyscallLayout {
    pub op: u8,
    pub flags_from: u8,
    pub dfd: u16,
    pub path: u16,
    pub dfd2: u16,
    pub path2: u16,
    pub flags: u16,
    pub fd: u16,
    /// The offset a positioned read (pread64, preadv, preadv2) reads at.
    pub pos: u16,
}

/// An entry of the kernel's prefix table: a watched tree (a path matches it when it
/// continues it with `/` or ends there). Only absolute paths are compared with it.
/// The path is stored as little-endian words with masks over its bytes, so that the
/// kernel compares eight bytes at a time in a loop whose bound does not depend on the
/// data (the verifier cannot prune loops bounded by a path's length).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Watched {
    /// Bytes in the path, without a trailing slash; 0 ends the table.
    pub len: u32,
    pub _pad: u32,
    pub words: [u64; PREFIX_WORDS],
    pub masks: [u64; PREFIX_WORDS],
}

impl Watched {
    /// The entry for `path` (no trailing slash, shorter than `MAX_PREFIX`).
    pub fn new(path: &[u8]) -> Option<Self> {
        if path.len() >= MAX_PREFIX || path.is_empty() {
            return None;
        }
        let mut w = Self {
            len: path.len() as u32,
            _pad: 0,
            words: [0; PREFIX_WORDS],
            masks: [0; PREFIX_WORDS],
        };
        for (i, b) in path.iter().enumerate() {
            w.words[i / 8] |= u64::from(*b) << (8 * (i % 8));
            w.masks[i / 8] |= 0xff << (8 * (i % 8));
        }
        Some(w)
    }

    /// Whether the entry is in use (a view's unused prefixes are all zeros).
    #[inline(always)]
    pub fn is_set(&self) -> bool {
        self.masks[0] != 0
    }

    /// Whether a path whose first eight bytes are `first` may lie under it: they agree
    /// with its first word. `known` is all ones if those bytes were read, else 0 (then
    /// any path may). A test before a whole path is copied from user memory.
    #[inline(always)]
    pub fn may_hold(&self, first: u64, known: u64) -> bool {
        (first ^ self.words[0]) & self.masks[0] & known == 0
    }

    /// Whether `path` (NUL-terminated in its buffer) lies under it: it is the tree
    /// itself, or continues it with `/`. Eight bytes at a time over the whole prefix
    /// size, the differences gathered without a branch: the words past the tree's end
    /// have no mask. A loop that left at the first difference or the last word gave the
    /// verifier two ways out of every word, each followed into the rest of the program:
    /// 40% of what it walked in `syscall_exit`, where six of these are inlined, and
    /// seconds of every daemon start under emulation. Straight, it is 32 words of
    /// loads and xors, a few dozen nanoseconds for the failed lookups that reach it.
    #[inline(always)]
    pub fn holds(&self, path: &PathBuf) -> bool {
        let mut differs = 0;
        for i in 0..PREFIX_WORDS {
            // SAFETY: `PathBuf` is 8-byte aligned and i < PREFIX_WORDS <= MAX_PATH / 8.
            let word = unsafe { *path.bytes.as_ptr().cast::<u64>().add(i) };
            differs |= (word ^ self.words[i]) & self.masks[i];
        }
        let next = path.bytes[self.len as usize & (MAX_PREFIX - 1)];
        differs == 0 && (next == 0 || next == b'/')
    }
}

/// A descriptor of a process.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FdKey {
    pub tgid: u32,
    pub fd: u32,
}

/// A watched file some process has open, with what it has read so far.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct OpenFile {
    pub file_id: u64,
    pub bytes_read: u64,
    pub written: u32,
    /// The user whose open it was (the NFS programs' bound per user; else 0).
    pub uid: u32,
    /// The run of grains being read (`ranges`), not reported yet; 0: none.
    pub run: u64,
    /// The `struct file` the descriptor held when opened: a close tells by it whether
    /// another thread's open has taken the number since. 0: closed, its close reported
    /// (the entry stays until the number is used again or the process is gone).
    pub file: u64,
}

/// A file's page cache, as `filemap:mm_filemap_add_to_page_cache` names it: the
/// superblock's `s_dev` (the kernel's encoding) and the inode number.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct InodeKey {
    pub dev: u32,
    pub _pad: u32,
    pub ino: u64,
}

/// A watched file some process mapped: the pages that entered its page cache since
/// (the first mapping's open file and job name it for the agent).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Mapped {
    pub file_id: u64,
    pub pages: u64,
    /// The run of grains being faulted in (`ranges`), not reported yet; 0: none.
    pub run: u64,
}

/// Scratch space for one path; 8-byte aligned so it can be read a word at a time.
#[repr(C, align(8))]
pub struct PathBuf {
    pub bytes: [u8; MAX_PATH],
}

pub mod events;
pub mod nfs_learn;
pub mod ranges;
pub mod requests;
pub mod rest;

pub use events::{Event, counter, ev, kind};

#[cfg(feature = "user")]
mod user {
    use super::*;

    // SAFETY: all of these are repr(C) plain data without padding holes that carry meaning.
    unsafe impl aya::Pod for SyscallLayout {}
    unsafe impl aya::Pod for Watched {}
    unsafe impl aya::Pod for FdKey {}
    unsafe impl aya::Pod for OpenFile {}
    unsafe impl aya::Pod for Superblock {}
    unsafe impl aya::Pod for SuperblockSlot {}
    unsafe impl aya::Pod for KernelOffsets {}
    unsafe impl aya::Pod for NamespaceKey {}
    unsafe impl aya::Pod for Calibration {}
    unsafe impl aya::Pod for View {}
    unsafe impl aya::Pod for Home {}
    unsafe impl aya::Pod for InodeKey {}
    unsafe impl aya::Pod for Mapped {}
    unsafe impl aya::Pod for requests::RequestOffsets {}
    unsafe impl aya::Pod for nfs_learn::NfsOffsets {}
    unsafe impl aya::Pod for requests::RequestKey {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(s: &str) -> PathBuf {
        let mut p = PathBuf {
            bytes: [0; MAX_PATH],
        };
        p.bytes[..s.len()].copy_from_slice(s.as_bytes());
        p
    }

    fn first_word(s: &str) -> u64 {
        let mut b = [0u8; 8];
        let n = s.len().min(8);
        b[..n].copy_from_slice(&s.as_bytes()[..n]);
        u64::from_le_bytes(b)
    }

    #[test]
    fn a_watched_tree_holds_itself_and_what_continues_it_with_a_slash() {
        let w = Watched::new(b"/home/ada/env").unwrap();
        assert!(w.is_set());
        for inside in ["/home/ada/env", "/home/ada/env/", "/home/ada/env/lib/x.py"] {
            assert!(w.holds(&path(inside)), "{inside}");
        }
        for outside in [
            "/home/ada/envy",
            "/home/ada/en",
            "/home/ada",
            "/home/bob/env/x",
            "",
        ] {
            assert!(!w.holds(&path(outside)), "{outside}");
        }
    }

    #[test]
    fn prefixes_longer_than_a_word_and_at_the_limit_are_compared_whole() {
        let long = format!("/{}", "d".repeat(MAX_PREFIX - 2));
        let w = Watched::new(long.as_bytes()).unwrap();
        assert!(w.holds(&path(&long)));
        assert!(w.holds(&path(&format!("{long}/f"))));
        let mut other = long.clone().into_bytes();
        other[200] = b'e';
        assert!(!w.holds(&path(std::str::from_utf8(&other).unwrap())));
        assert!(Watched::new(format!("/{}", "d".repeat(MAX_PREFIX - 1)).as_bytes()).is_none());
        assert!(Watched::new(b"").is_none());
    }

    #[test]
    fn the_first_word_turns_away_only_paths_that_cannot_lie_under_the_tree() {
        let w = Watched::new(b"/srv").unwrap();
        assert!(w.may_hold(first_word("/srv/data"), u64::MAX));
        assert!(
            w.may_hold(first_word("/srvx"), u64::MAX),
            "decided by holds, later"
        );
        assert!(!w.may_hold(first_word("/usr/lib"), u64::MAX));
        // Bytes not read: every path may lie under it.
        assert!(w.may_hold(0, 0));
        let unset = View {
            generation: 0,
            prefixes: [Watched {
                len: 0,
                _pad: 0,
                words: [0; PREFIX_WORDS],
                masks: [0; PREFIX_WORDS],
            }; VIEW_PREFIXES],
        };
        assert!(!unset.prefixes[0].is_set());
    }

    #[test]
    fn every_process_id_has_a_byte_of_its_own() {
        let ids = [0, 1, 63, 64, 65, 4_194_303];
        for (i, a) in ids.iter().enumerate() {
            assert!(follow::entry(*a) < follow::ENTRIES);
            for b in &ids[i + 1..] {
                assert!(
                    follow::entry(*a) != follow::entry(*b) || follow::byte(*a) != follow::byte(*b),
                    "{a} and {b}"
                );
            }
        }
    }

    #[test]
    fn filter_slots_fall_inside_their_arrays() {
        for tgid in [0, 1, 4242, u32::MAX] {
            assert!(filter::process_slot(tgid) < filter::PROCESS_SLOTS);
        }
        for sb in [0, 0xffff_8880_1234_5000, u64::MAX] {
            assert!(filter::superblock_slot(sb) < filter::SUPERBLOCK_SLOTS);
        }
    }
}
