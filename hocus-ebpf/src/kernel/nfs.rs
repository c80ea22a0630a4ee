//! What the NFS programs read of the NFS client's arguments: a file's flags, the
//! superblock a dentry lies on, whether a setattr changes the size, the file of a
//! kiocb.

use hocus_common::nfs_learn::{ATTR_SIZE, NfsOffsets};

use super::{
    Typed,
    files::{Dentry, File, Mount},
    offset,
};
use crate::agent::global;

/// Set by the agent from the kernel's BTF before loading.
#[unsafe(no_mangle)]
static NFS_OFFSETS: NfsOffsets = NfsOffsets {
    file_flags: 0,
    iattr_valid: 0,
    kiocb_pos: 0,
};

/// The offset `f` picks from `NFS_OFFSETS`: a constant to the verifier.
pub fn at(f: fn(&NfsOffsets) -> &u32) -> u32 {
    global(f(&NFS_OFFSETS))
}

/// The flags `file` (a hooked function's typed argument) was opened with.
pub fn flags(file: Typed) -> u32 {
    file.read(at(|o| &o.file_flags))
}

/// A dentry (a hooked function's typed argument) and the superblock it lies on, as
/// `locate` takes them: a watched superblock is placed whatever mount it is reached
/// through.
pub fn placed(dentry: Typed) -> (Mount, Dentry) {
    let sb = Typed(dentry.read(offset(|o| &o.dentry_sb))).address();
    (Mount { root: 0, sb }, Dentry::of(dentry))
}

/// Whether the struct iattr at `attr` changes the size.
pub fn resizes(attr: Typed) -> bool {
    attr.read::<u32>(at(|o| &o.iattr_valid)) & ATTR_SIZE != 0
}

/// The file a kiocb (`nfs_file_read`'s, `nfs_file_write`'s) is on: its first field.
pub fn file_of_kiocb(kiocb: Typed) -> Option<File> {
    Some(File::of(kiocb.follow(0)?))
}

/// Where a kiocb's I/O stands in its file (`ki_pos`): past what a read returned.
pub fn position(kiocb: Typed) -> u64 {
    kiocb.read(at(|o| &o.kiocb_pos))
}
