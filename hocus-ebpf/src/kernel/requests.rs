//! A FUSE request (`struct fuse_req`, a BTF-typed tracepoint's argument) and the path
//! walk under way in the current task (`struct nameidata`), read at the offsets the
//! agent found in the kernel's BTF (`REQUEST_OFFSETS`).

use hocus_common::requests::RequestOffsets;

use super::{
    Typed, current_task, field,
    files::{Dentry, Mount},
    offset,
};
use crate::agent::global;

/// Where the kernel keeps a request's fields and a walk's; set by the agent where it
/// attaches the request programs.
#[unsafe(no_mangle)]
static REQUEST_OFFSETS: RequestOffsets = RequestOffsets {
    req_args: 0,
    req_in: 0,
    req_out: 0,
    req_mount: 0,
    mount_conn: 0,
    conn_dev: 0,
    args_in: 0,
    args_out: 0,
    task_nameidata: 0,
    nd_path: 0,
    nd_last: 0,
    dentry_inline_name: 0,
    dentry_type: 0,
};

fn at(f: fn(&RequestOffsets) -> &u32) -> u32 {
    global(f(&REQUEST_OFFSETS))
}

/// An argument's size and value (a kernel address), as `struct fuse_in_arg` and
/// `struct fuse_arg` hold them.
const ARG_SIZE: u32 = 16;

/// A request to a FUSE mount's server.
#[derive(Clone, Copy)]
pub struct Request(Typed);

impl Request {
    pub fn of(req: u64) -> Self {
        Self(Typed(req))
    }

    /// `in.h.opcode`, `in.h.unique` and `in.h.nodeid` (struct fuse_in_header: len,
    /// opcode, unique, nodeid).
    pub fn opcode(self) -> u32 {
        self.0.read(at(|o| &o.req_in) + 4)
    }

    pub fn unique(self) -> u64 {
        self.0.read(at(|o| &o.req_in) + 8)
    }

    pub fn nodeid(self) -> u64 {
        self.0.read(at(|o| &o.req_in) + 16)
    }

    /// The reply's length and error (struct fuse_out_header: len, error).
    pub fn reply(self) -> (u32, i32) {
        let out = at(|o| &o.req_out);
        (self.0.read(out), self.0.read(out + 4))
    }

    /// The device of the mount the request is for (`fm->fc->dev`).
    pub fn dev(self) -> Option<u32> {
        let mount = self.0.follow(at(|o| &o.req_mount))?;
        let conn = mount.follow(at(|o| &o.mount_conn))?;
        Some(conn.read(at(|o| &o.conn_dev)))
    }

    /// Input argument `i`: its size and where its value lies.
    pub fn input(self, i: u32) -> Option<(u32, u64)> {
        self.argument(at(|o| &o.args_in) + i * ARG_SIZE)
    }

    /// Output argument `i`, as the reply filled it.
    pub fn output(self, i: u32) -> Option<(u32, u64)> {
        self.argument(at(|o| &o.args_out) + i * ARG_SIZE)
    }

    fn argument(self, offset: u32) -> Option<(u32, u64)> {
        let args = self.0.follow(at(|o| &o.req_args))?;
        Some((args.read(offset), args.read(offset + 8)))
    }

    /// The eight bytes `at` bytes into input argument `i` (an open's flags, a handle),
    /// if it holds at least `size` bytes.
    pub fn input_word(self, i: u32, at: u32, size: u32) -> Option<u64> {
        word(self.input(i)?, at, size)
    }

    /// The dentry whose name input argument `i` is, and the mount (its superblock) it is
    /// on: found where the name is kept inside the dentry (a name short enough), and
    /// checked by the dentry's own pointer to its name.
    pub fn named_dentry(self, i: u32) -> Option<(Mount, Dentry)> {
        let (_, name) = self.input(i)?;
        let address = name.checked_sub(u64::from(at(|o| &o.dentry_inline_name)))?;
        let named: u64 = field(address, offset(|o| &o.dentry_name))?;
        if named != name {
            return None;
        }
        let sb = field(address, offset(|o| &o.dentry_sb))?;
        // Its mount's root is not known, nor needed: the superblock is a watched one.
        let mount = Mount { root: 0, sb };
        Some((mount, Dentry::at(address, at(|o| &o.dentry_type))))
    }

    /// The first eight bytes of output argument `i` (a handle, a node id).
    pub fn output_word(self, i: u32) -> Option<u64> {
        word(self.output(i)?, 0, 8)
    }
}

/// The eight bytes `at` bytes into an argument (its size and where its value lies), if
/// it holds at least `size` bytes.
fn word((len, value): (u32, u64), at: u32, size: u32) -> Option<u64> {
    (len >= size).then_some(())?;
    field(value, at)
}

/// The path walk the current task is in: where it is (the directory looked in, or the
/// file being opened), and the last name it looked up (`len` bytes at `name`, not
/// terminated).
pub struct Walk {
    pub mount: Mount,
    pub dentry: Dentry,
    pub name_len: u32,
    pub name: u64,
}

/// The current task's walk, if it is in one.
pub fn walk() -> Option<Walk> {
    let nd = current_task().follow(at(|o| &o.task_nameidata))?;
    let path = at(|o| &o.nd_path);
    let mnt = nd.follow(path)?;
    let last = at(|o| &o.nd_last);
    Some(Walk {
        mount: Mount::of(mnt),
        dentry: Dentry::of(Typed(nd.read(path + 8))),
        name_len: nd.read(last + 4),
        name: nd.read(last + 8),
    })
}
