//! Learning from the requests a FUSE mount's server gets (`fuse:fuse_request_send` and
//! `fuse_request_end`, read as BTF-typed tracepoints), instead of from every syscall on
//! the node: what the programs read of a request, the files they follow by the handle
//! the server gave, and the opcodes (`enum fuse_opcode`) they tell apart.

/// Where the kernel keeps what the request programs read, from its BTF. Byte offsets;
/// all 0 where the kernel has no such tracepoint (the programs are then not attached).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestOffsets {
    /// fuse_req.args (struct fuse_args *)
    pub req_args: u32,
    /// fuse_req.in.h: a struct fuse_in_header (len, opcode, unique, nodeid ...)
    pub req_in: u32,
    /// fuse_req.out.h: a struct fuse_out_header (len, error, unique)
    pub req_out: u32,
    /// fuse_req.fm, then fuse_mount.fc, then fuse_conn.dev: the mount's device
    pub req_mount: u32,
    pub mount_conn: u32,
    pub conn_dev: u32,
    /// fuse_args.in_args and out_args: arrays of { size, value } (16 bytes each)
    pub args_in: u32,
    pub args_out: u32,
    /// task_struct.nameidata: the path walk under way in the current task, if any
    pub task_nameidata: u32,
    /// nameidata.path (mnt, then dentry) and nameidata.last (a qstr: len at +4, name
    /// at +8)
    pub nd_path: u32,
    pub nd_last: u32,
    /// dentry.d_shortname (d_iname before 6.14): a name short enough is kept inside the
    /// dentry, so a request's name argument that points there names its dentry
    pub dentry_inline_name: u32,
    /// Not an offset: the BTF id of `struct dentry`, to type one found by its name
    /// (`kfunc::RDONLY_CAST`).
    pub dentry_type: u32,
}

/// The opcodes the request programs read (`enum fuse_opcode`).
pub mod opcode {
    pub const LOOKUP: u32 = 1;
    pub const SETATTR: u32 = 4;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const RELEASE: u32 = 18;
    pub const OPENDIR: u32 = 27;
    pub const RELEASEDIR: u32 = 29;
    pub const CREATE: u32 = 35;
    pub const RENAME2: u32 = 45;
}

/// `fuse_setattr_in.valid`: the size changes, through an open file (`fh`) or not.
pub const FATTR_SIZE: u32 = 1 << 3;
pub const FATTR_FH: u32 = 1 << 6;

/// `O_DIRECTORY`: set on what an OPENDIR opened, whatever flags the process gave.
pub const O_DIRECTORY: u32 = 0o200000;

/// A file a FUSE mount's server opened, by the handle it gave (`fh`): each open has its
/// own, so two processes reading one file are counted apart. Also, with `fh` 0 and
/// `nodeid` the request's number, an open whose reply is awaited.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RequestKey {
    /// The mount's device (the kernel's encoding).
    pub dev: u32,
    pub _pad: u32,
    pub nodeid: u64,
    pub fh: u64,
}

impl RequestKey {
    /// Request or file `nodeid` of mount `dev`, open with handle `fh` (0 for a request).
    pub const fn new(dev: u32, nodeid: u64, fh: u64) -> Self {
        Self {
            dev,
            _pad: 0,
            nodeid,
            fh,
        }
    }
}

/// Files opened through watched FUSE mounts that the request programs follow.
pub const MAX_REQUEST_FILES: u32 = 16384;
/// Of those the NFS programs follow, a user's at most: no user's opens take the table.
pub const MAX_REQUEST_FILES_PER_USER: u32 = MAX_REQUEST_FILES / 8;
/// Users whose NFS files the programs count at once.
pub const MAX_REQUEST_USERS: u32 = 4096;
/// Opens whose reply (with the server's handle) is awaited.
pub const MAX_PENDING_OPENS: u32 = 4096;
/// Threads in an NFS change (unlink, rmdir, rename, truncate) whose answer is awaited.
pub const MAX_PENDING_CHANGES: u32 = 4096;
