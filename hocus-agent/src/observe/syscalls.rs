//! Which syscalls hocus traces, what each means for the profile, and which of its
//! arguments the kernel program reads: their positions, from the syscall's tracefs
//! format, so by name (the registers of the positions come from BTF, `btf.rs`).

use std::path::Path;

use anyhow::{Context, Result};
use hocus_common::{NO_FIELD, SyscallLayout, flags_from, op};

use crate::observe::tracefs::Format;

/// A traced syscall: its name (as in `sys_enter_<name>`), number, meaning and the names
/// of its argument fields.
pub struct Traced {
    pub name: &'static str,
    pub nr: i64,
    pub op: u8,
    pub flags_from: u8,
    pub dfd: Option<&'static str>,
    pub path: Option<&'static str>,
    pub dfd2: Option<&'static str>,
    pub path2: Option<&'static str>,
    pub flags: Option<&'static str>,
    pub fd: Option<&'static str>,
    /// A positioned read's offset.
    pub pos: Option<&'static str>,
}

const fn path_op(
    name: &'static str,
    nr: i64,
    dfd: Option<&'static str>,
    op: u8,
    path: &'static str,
) -> Traced {
    Traced {
        dfd,
        path: Some(path),
        ..no_args(name, nr, op)
    }
}

const fn open_op(
    name: &'static str,
    nr: i64,
    dfd: Option<&'static str>,
    path: &'static str,
    flags_from: u8,
    flags: Option<&'static str>,
) -> Traced {
    Traced {
        flags_from,
        flags,
        ..path_op(name, nr, dfd, op::OPEN, path)
    }
}

const fn rename_op(
    name: &'static str,
    nr: i64,
    dfds: Option<(&'static str, &'static str)>,
) -> Traced {
    let (dfd, dfd2) = match dfds {
        Some((a, b)) => (Some(a), Some(b)),
        None => (None, None),
    };
    Traced {
        dfd2,
        path2: Some("newname"),
        ..path_op(name, nr, dfd, op::RENAME, "oldname")
    }
}

const fn fd_op(name: &'static str, nr: i64, op: u8) -> Traced {
    Traced {
        fd: Some("fd"),
        ..no_args(name, nr, op)
    }
}

/// A read at an offset, which is argument `pos`.
const fn positioned(name: &'static str, nr: i64, pos: &'static str) -> Traced {
    Traced {
        pos: Some(pos),
        ..fd_op(name, nr, op::READ)
    }
}

/// A syscall whose arguments do not matter, only that it happens (and succeeds).
const fn no_args(name: &'static str, nr: i64, op: u8) -> Traced {
    Traced {
        name,
        nr,
        op,
        flags_from: flags_from::NONE,
        dfd: None,
        path: None,
        dfd2: None,
        path2: None,
        flags: None,
        fd: None,
        pos: None,
    }
}

/// Every traced syscall. A syscall missing from this kernel is skipped with a warning.
pub fn all() -> Vec<Traced> {
    use libc::*;
    let dfd = Some("dfd");
    vec![
        open_op(
            "openat",
            SYS_openat,
            dfd,
            "filename",
            flags_from::ARG,
            Some("flags"),
        ),
        open_op(
            "openat2",
            SYS_openat2,
            dfd,
            "filename",
            flags_from::OPEN_HOW,
            Some("how"),
        ),
        open_op(
            "open",
            SYS_open,
            None,
            "filename",
            flags_from::ARG,
            Some("flags"),
        ),
        open_op(
            "creat",
            SYS_creat,
            None,
            "pathname",
            flags_from::CREAT,
            None,
        ),
        path_op("newfstatat", SYS_newfstatat, dfd, op::LOOKUP, "filename"),
        path_op("statx", SYS_statx, dfd, op::LOOKUP, "filename"),
        path_op("newstat", SYS_stat, None, op::LOOKUP, "filename"),
        path_op("newlstat", SYS_lstat, None, op::LOOKUP, "filename"),
        path_op("access", SYS_access, None, op::LOOKUP, "filename"),
        path_op("faccessat", SYS_faccessat, dfd, op::LOOKUP, "filename"),
        path_op("faccessat2", SYS_faccessat2, dfd, op::LOOKUP, "filename"),
        path_op("unlink", SYS_unlink, None, op::UNLINK, "pathname"),
        path_op("unlinkat", SYS_unlinkat, dfd, op::UNLINK, "pathname"),
        path_op("rmdir", SYS_rmdir, None, op::RMDIR, "pathname"),
        path_op("mkdir", SYS_mkdir, None, op::MKDIR, "pathname"),
        path_op("mkdirat", SYS_mkdirat, dfd, op::MKDIR, "pathname"),
        path_op("truncate", SYS_truncate, None, op::TRUNCATE, "path"),
        rename_op("rename", SYS_rename, None),
        rename_op("renameat", SYS_renameat, Some(("olddfd", "newdfd"))),
        rename_op("renameat2", SYS_renameat2, Some(("olddfd", "newdfd"))),
        fd_op("read", SYS_read, op::READ),
        positioned("pread64", SYS_pread64, "pos"),
        fd_op("readv", SYS_readv, op::READ),
        // On 64-bit the low half is the whole offset (the high one is shifted out).
        positioned("preadv", SYS_preadv, "pos_l"),
        positioned("preadv2", SYS_preadv2, "pos_l"),
        fd_op("write", SYS_write, op::WRITE),
        fd_op("pwrite64", SYS_pwrite64, op::WRITE),
        fd_op("writev", SYS_writev, op::WRITE),
        fd_op("pwritev", SYS_pwritev, op::WRITE),
        fd_op("pwritev2", SYS_pwritev2, op::WRITE),
        fd_op("ftruncate", SYS_ftruncate, op::FTRUNCATE),
        fd_op("mmap", SYS_mmap, op::MMAP),
        fd_op("close", SYS_close, op::CLOSE),
        // dup2 and dup3 close their target descriptor first, without a close.
        Traced {
            fd: Some("newfd"),
            ..no_args("dup2", SYS_dup2, op::CLOSE)
        },
        Traced {
            fd: Some("newfd"),
            ..no_args("dup3", SYS_dup3, op::CLOSE)
        },
        no_args("unshare", SYS_unshare, op::NEW_NAMESPACE),
        // The agent entering an attached task's namespace: paths there mean what they
        // mean to it (the task made it from the node's; hocus binds in it).
        no_args("setns", SYS_setns, op::NEW_NAMESPACE),
        no_args("mount", SYS_mount, op::MOUNTS_CHANGE),
        no_args("umount", SYS_umount2, op::MOUNTS_CHANGE),
        no_args("move_mount", SYS_move_mount, op::MOUNTS_CHANGE),
        no_args("pivot_root", SYS_pivot_root, op::MOUNTS_CHANGE),
    ]
}

impl Traced {
    /// Resolves the argument names to their positions in this kernel's
    /// `sys_enter_<name>` record.
    pub fn layout(&self, tracefs: &Path) -> Result<SyscallLayout> {
        let format = Format::read(tracefs, "syscalls", &format!("sys_enter_{}", self.name))?;
        let offset = |field: Option<&str>| -> Result<u16> {
            field.map_or(Ok(NO_FIELD), |f| {
                format.argument_position(f).map(|i| i as u16)
            })
        };
        let layout = (|| -> Result<SyscallLayout> {
            Ok(SyscallLayout {
                op: self.op,
                flags_from: self.flags_from,
                dfd: offset(self.dfd)?,
                path: offset(self.path)?,
                dfd2: offset(self.dfd2)?,
                path2: offset(self.path2)?,
                flags: offset(self.flags)?,
                fd: offset(self.fd)?,
                pos: offset(self.pos)?,
            })
        })();
        layout.with_context(|| format!("syscall {}", self.name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_fit_the_kernel_table() {
        for t in all() {
            assert!(
                (0..hocus_common::MAX_SYSCALL_NR as i64).contains(&t.nr),
                "{} has number {}",
                t.name,
                t.nr
            );
        }
    }

    #[test]
    fn every_path_op_names_a_path_and_every_fd_op_a_descriptor() {
        for t in all() {
            match t.op {
                op::READ | op::WRITE | op::FTRUNCATE | op::CLOSE | op::MMAP => {
                    assert!(t.fd.is_some(), "{}", t.name)
                }
                op::NEW_NAMESPACE | op::MOUNTS_CHANGE => {}
                _ => assert!(t.path.is_some(), "{}", t.name),
            }
        }
    }

    #[test]
    fn arguments_are_found_by_name() {
        let tracefs = crate::observe::tracefs::root().unwrap();
        let openat = all().into_iter().find(|t| t.name == "openat").unwrap();
        let l = openat.layout(&tracefs).unwrap();
        // openat(dfd, filename, flags, mode)
        assert_eq!((l.dfd, l.path, l.flags, l.fd), (0, 1, 2, NO_FIELD));
        let renameat = all().into_iter().find(|t| t.name == "renameat").unwrap();
        let l = renameat.layout(&tracefs).unwrap();
        // renameat(olddfd, oldname, newdfd, newname)
        assert_eq!((l.dfd, l.path, l.dfd2, l.path2), (0, 1, 2, 3));
        // pread64(fd, buf, count, pos), preadv2(fd, vec, vlen, pos_l, pos_h, flags)
        for (name, pos) in [
            ("pread64", 3),
            ("preadv", 3),
            ("preadv2", 3),
            ("read", NO_FIELD),
        ] {
            let t = all().into_iter().find(|t| t.name == name).unwrap();
            let l = t.layout(&tracefs).unwrap();
            assert_eq!((l.fd, l.pos), (0, pos), "{name}");
        }
    }
}
