//! The event records the kernel side sends the agent through the ring buffer: what
//! happened (`kind`), on what path (`Event`), and the counts of what could not be sent
//! (`counter`). Byte ranges read travel in records of their own (`ranges::RangeRead`).

use crate::{MAX_PATH, NamespaceKey};

/// Kinds of event in the ring buffer.
pub mod kind {
    pub const OPEN: u8 = 1;
    pub const MISSING: u8 = 2;
    pub const CLOSE: u8 = 3;
    pub const WRITE: u8 = 4;
    pub const TRUNCATE: u8 = 5;
    pub const UNLINK: u8 = 6;
    pub const RMDIR: u8 = 7;
    pub const MKDIR: u8 = 8;
    pub const RENAME_FROM: u8 = 9;
    pub const RENAME_TO: u8 = 10;
    /// A write, create, truncate, rename or unlink failed with EROFS (a job wrote into a
    /// read-only local copy).
    pub const REFUSED_WRITE: u8 = 13;
    /// A process in a mount namespace whose view the kernel does not hold (or holds from
    /// before a mount changed) looked up an absolute path: learn its view.
    pub const LEARN_VIEW: u8 = 14;
    /// A watched open file (`Event::file_id`) was mapped for the first time: the pages
    /// that enter its page cache are counted in `MAPPED` under it from now on.
    pub const MAPPED: u8 = 15;
    /// The syscall program rests, and a process (`Event::tgid`) made a watched mount
    /// work (a request to a watched FUSE mount, pages entering a watched mount's page
    /// cache): attach it again.
    pub const WAKE: u8 = 16;
    /// A FUSE LOOKUP was sent for the path (`requests`): `file_id` is its request
    /// number, `bytes` the mount's device. Only a `LOOKUP_FAILED` makes it a failed
    /// lookup.
    pub const LOOKUP_ASKED: u8 = 17;
    /// The server answered that LOOKUP (`file_id`, `bytes` as above): no such name.
    pub const LOOKUP_FAILED: u8 = 18;
    /// A run of grains an open file read (`ranges::RangeRead`, not an `Event`).
    pub const RANGE: u8 = 19;
    /// What the NFS server answered a change reported at its function's entry with its
    /// number in `file_id` (`bytes`: the function's return, 0 accepted): the change
    /// counts only once accepted.
    pub const CHANGE_ANSWERED: u8 = 20;
}

/// Event flags.
pub mod ev {
    /// The path was longer than `MAX_PATH` and was cut.
    pub const PATH_TRUNCATED: u32 = 1;
}

/// One thing that happened on a watched path. Where it happened is `root` (an index of
/// `Roots`, or `ROOT_NONE`), then `base` (the kernel's own path from that root to the
/// file, or to the directory a relative path starts from: `/a/b`, or empty), then `path`
/// (what the process passed, relative to `base`; absolute when `root` is `ROOT_NONE`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Event {
    pub kind: u8,
    pub _pad: [u8; 3],
    pub flags: u32,
    pub tgid: u32,
    pub uid: u32,
    /// `bpf_ktime_get_ns()` at the event.
    pub time_ns: u64,
    /// The open file this is about (open, close, write, truncate through a descriptor).
    pub file_id: u64,
    /// Bytes read through the descriptor (close).
    pub bytes: u64,
    pub open_flags: u32,
    pub path_len: u32,
    /// The `hocus-agent run` job of the process (the daemon thread that started it), or 0.
    pub job: u32,
    pub root: u32,
    pub base_len: u32,
    /// For `ROOT_VIEW` and `LEARN_VIEW`: the namespace, and `MOUNT_GENERATION` then.
    pub namespace: NamespaceKey,
    pub generation: u64,
    pub ns_inum: u32,
    pub _pad2: u32,
    pub comm: [u8; 16],
    pub base: [u8; MAX_PATH],
    pub path: [u8; MAX_PATH],
}

/// Per-CPU counters the kernel side keeps; whatever could not be delivered is counted.
pub mod counter {
    pub const EVENTS_SENT: u32 = 0;
    pub const LOST_RING_FULL: u32 = 1;
    pub const LOST_OPEN_FILES_FULL: u32 = 2;
    pub const PATH_UNREADABLE: u32 = 3;
    pub const PATH_TRUNCATED: u32 = 4;
    /// Of `LOST_RING_FULL`: open events (the profile misses those opens).
    pub const LOST_OPENS: u32 = 5;
    /// Of `LOST_RING_FULL`: failed lookups.
    pub const LOST_FAILED_LOOKUPS: u32 = 6;
    /// An absolute path from a mount namespace (or chroot) that is not the agent's or a
    /// job's, and whose view is not learned yet: what it names is unknown, so it is
    /// dropped (the agent is asked to learn the view).
    pub const FOREIGN_NAMESPACE: u32 = 7;
    /// A file deeper below its root than the kernel side walks.
    pub const PATH_TOO_DEEP: u32 = 8;
    /// A change by a name (unlink, rmdir, mkdir, rename, truncate by path) that the
    /// request programs could place neither by its dentry nor by the syscall's path (a
    /// long name given as an absolute path in a namespace not learned).
    pub const CHANGE_UNPLACED: u32 = 9;
    /// Of the opens the NFS programs follow, those of a user who had
    /// `MAX_REQUEST_FILES_PER_USER` open already: reported closed at once (their reads
    /// are not learned; other users' are).
    pub const LOST_OPEN_FILES_OF_USER: u32 = 10;
    pub const COUNT: u32 = 11;
    /// Metric-style names, by index.
    pub const NAMES: [&str; COUNT as usize] = [
        "events_sent",
        "lost_ring_buffer_full",
        "lost_open_files_map_full",
        "path_unreadable",
        "path_truncated",
        "lost_open_events",
        "lost_failed_lookup_events",
        "foreign_namespace",
        "path_too_deep",
        "change_unplaced",
        "lost_open_files_of_user",
    ];
}
