//! What identifies a version of a file: a local copy stands for the network file while
//! these are unchanged.

use std::{fs, os::unix::fs::MetadataExt};

use serde::{Deserialize, Serialize};

/// What identifies a version of a file: a copy is valid while these are unchanged. The
/// mode and owner are part of it: a permission change must reach jobs, and some network
/// filesystems (sshfs) do not move ctime on chmod or chown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    pub ino: u64,
    /// Type and permission bits (st_mode); 0 in an index written before they were kept,
    /// which then fails its first revalidation.
    #[serde(default)]
    pub mode: u32,
    #[serde(default)]
    pub uid: u32,
    #[serde(default)]
    pub gid: u32,
}

/// FUSE's superblock magic (statfs f_type). A FUSE filesystem numbers inodes itself,
/// and sshfs (and most others, without options such as `use_ino`) gives a file a new
/// number whenever the kernel forgets its inode: after every page-cache eviction.
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

/// Whether the filesystem of `fd` keeps a file's inode number for as long as the file
/// lives (NFS file ids, Lustre, GPFS, CephFS, local disks), so that a new number means a
/// new file. FUSE does not.
pub fn stable_inodes(fd: &impl std::os::fd::AsFd) -> bool {
    nix::sys::statfs::fstatfs(fd).map_or(true, |s| s.filesystem_type().0 != FUSE_SUPER_MAGIC)
}

impl Identity {
    /// The identity of a file on a filesystem whose inode numbers are stable or not:
    /// where they are not, the number says nothing and is left out (0).
    pub fn on(m: &fs::Metadata, stable_inodes: bool) -> Self {
        let mut id = Self::of(m);
        if !stable_inodes {
            id.ino = 0;
        }
        id
    }

    pub fn is_dir(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFDIR
    }

    pub fn is_symlink(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFLNK
    }

    /// From a `statx` answer (`STATX_BASIC_STATS`).
    pub fn of_statx(s: &libc::statx, stable_inodes: bool) -> Self {
        let ns = |t: libc::statx_timestamp| t.tv_sec * 1_000_000_000 + i64::from(t.tv_nsec);
        Self {
            size: s.stx_size,
            mtime_ns: ns(s.stx_mtime),
            ctime_ns: ns(s.stx_ctime),
            ino: if stable_inodes { s.stx_ino } else { 0 },
            mode: u32::from(s.stx_mode),
            uid: s.stx_uid,
            gid: s.stx_gid,
        }
    }

    pub fn of(m: &fs::Metadata) -> Self {
        Self {
            size: m.size(),
            mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
            ctime_ns: m.ctime() * 1_000_000_000 + m.ctime_nsec(),
            ino: m.ino(),
            mode: m.mode(),
            uid: m.uid(),
            gid: m.gid(),
        }
    }
}
