//! What a local stand-in keeps of a network file besides its bytes: owner, group and mode
//! (set in that order: chown clears set-id bits), POSIX ACLs and user xattrs, and access
//! and modification times to the nanosecond (Python's `.pyc` files record their
//! source's mtime). Also the xattrs hocus keeps on its own files.

use std::{
    ffi::{CStr, CString},
    fs::{self, File},
    io,
    os::{
        fd::AsRawFd,
        unix::{
            ffi::OsStrExt,
            fs::{MetadataExt, PermissionsExt},
        },
    },
    path::Path,
};

use nix::sys::stat::FileStat;

use crate::shared::{asked, dirs};

/// Gives `f` owner `uid`, group `gid` and permission bits `mode`, in that order.
pub fn own(f: &File, uid: u32, gid: u32, mode: u32) -> io::Result<()> {
    std::os::unix::fs::fchown(f, Some(uid), Some(gid))?;
    // After chown, which clears set-id bits.
    f.set_permissions(fs::Permissions::from_mode(mode & 0o7777))
}

/// Access and modification times, as `futimens` and `utimensat` take them.
#[derive(Clone, Copy)]
pub struct Times([libc::timespec; 2]);

impl Times {
    pub fn of(m: &fs::Metadata) -> Self {
        Self::new((m.atime(), m.atime_nsec()), (m.mtime(), m.mtime_nsec()))
    }

    /// From a `stat` a walk made.
    pub fn of_stat(s: &FileStat) -> Self {
        Self::new((s.st_atime, s.st_atime_nsec), (s.st_mtime, s.st_mtime_nsec))
    }

    fn new(atime: (i64, i64), mtime: (i64, i64)) -> Self {
        let at = |(tv_sec, tv_nsec)| libc::timespec { tv_sec, tv_nsec };
        Self([at(atime), at(mtime)])
    }

    /// Sets them on the open file `f`.
    pub fn set(&self, f: &File) -> io::Result<()> {
        // SAFETY: valid pointer to two timespecs.
        if unsafe { libc::futimens(f.as_raw_fd(), self.0.as_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Sets them on `path` itself (a symlink is not followed).
    pub fn set_at(&self, path: &Path) -> io::Result<()> {
        let c = c_path(path)?;
        // SAFETY: valid C string and two timespecs.
        let ret = unsafe {
            libc::utimensat(
                libc::AT_FDCWD,
                c.as_ptr(),
                self.0.as_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if ret != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// Sets xattr `name` of the open file `f` to `value`.
pub fn set_xattr(f: &impl AsRawFd, name: &CStr, value: &[u8]) -> io::Result<()> {
    // SAFETY: a valid descriptor, NUL-terminated name, value of the given length.
    let ret = unsafe {
        libc::fsetxattr(
            f.as_raw_fd(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Reads xattr `name` of the open file `f` into `value`: its length.
pub fn get_xattr(f: &impl AsRawFd, name: &CStr, value: &mut [u8]) -> io::Result<usize> {
    // SAFETY: a valid descriptor, NUL-terminated name, buffer of the given size.
    let n = unsafe {
        libc::fgetxattr(
            f.as_raw_fd(),
            name.as_ptr(),
            value.as_mut_ptr().cast(),
            value.len(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Whether `path` itself (a symlink is not followed) has xattr `name`.
pub fn has_xattr(path: &Path, name: &CStr) -> bool {
    let Ok(c) = c_path(path) else {
        return false;
    };
    // SAFETY: valid C strings; a zero-sized query reads nothing.
    unsafe { libc::lgetxattr(c.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) >= 0 }
}

/// Copies the POSIX ACLs (access, and a directory's default) and the user xattrs. An
/// ACL that cannot be copied fails the copy: a copy keeps its source's permissions or is
/// not made. Filesystems without xattrs (sshfs) have none. `src` may be an O_PATH
/// descriptor: it is read through its /proc/self/fd link, which names it and nothing else.
pub fn copy_xattrs(src: &impl AsRawFd, dst: &File) -> io::Result<()> {
    let link = dirs::magic_link(src);
    let list = |buf: &mut [u8]| {
        asked::asked();
        // SAFETY: NUL-terminated path, buffer of the given size (empty: asks the size).
        let n = unsafe { libc::listxattr(link.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENOTSUP) => Ok(0),
            _ => Err(e),
        }
    };
    // Most files have none (and sshfs none at all): ask the size first, so that a snapshot
    // of thousands of files allocates nothing for them.
    let size = list(&mut [])?;
    if size == 0 {
        return Ok(());
    }
    // A name may be added between the two calls: room for it, and ERANGE fails the copy.
    let mut names = vec![0u8; size + 256];
    let n = list(&mut names)?;
    for name in names[..n].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let acl = name == b"system.posix_acl_access" || name == b"system.posix_acl_default";
        if !(acl || name.starts_with(b"user.")) {
            continue;
        }
        let Ok(cname) = CString::new(name) else {
            continue;
        };
        let mut value = vec![0u8; 64 << 10];
        asked::asked();
        // SAFETY: buffers of the given sizes, NUL-terminated strings.
        let len = unsafe {
            libc::getxattr(
                link.as_ptr(),
                cname.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        let set = len >= 0 && set_xattr(dst, &cname, &value[..len as usize]).is_ok();
        if !set && acl {
            return Err(io::Error::other(format!(
                "cannot copy {}: {}",
                String::from_utf8_lossy(name),
                io::Error::last_os_error()
            )));
        }
    }
    Ok(())
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xattrs_times_and_owner_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        fs::write(&src, b"x").unwrap();
        let (from, to) = (File::open(&src).unwrap(), File::create(&dst).unwrap());
        let name = c"user.hocus.test";
        set_xattr(
            &File::options().write(true).open(&src).unwrap(),
            name,
            b"v1",
        )
        .unwrap_or_else(|e| panic!("setxattr: {e} (the test needs a TMPDIR with user xattrs)"));
        assert!(has_xattr(&src, name) && !has_xattr(&dst, name));
        copy_xattrs(&from, &to).unwrap();
        let mut value = [0u8; 8];
        let n = get_xattr(&to, name, &mut value).unwrap();
        assert_eq!(&value[..n], b"v1");

        let then = Times::new((1_500_000_000, 1), (1_600_000_000, 123_456_789));
        then.set(&to).unwrap();
        let m = fs::metadata(&dst).unwrap();
        assert_eq!((m.mtime(), m.mtime_nsec()), (1_600_000_000, 123_456_789));
        assert_eq!((m.atime(), m.atime_nsec()), (1_500_000_000, 1));
        Times::of(&fs::metadata(&src).unwrap())
            .set_at(&dst)
            .unwrap();
        let (s, d) = (fs::metadata(&src).unwrap(), fs::metadata(&dst).unwrap());
        assert_eq!((d.mtime(), d.mtime_nsec()), (s.mtime(), s.mtime_nsec()));

        own(&to, 1234, 5678, 0o4750).unwrap();
        let m = fs::metadata(&dst).unwrap();
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (1234, 5678, 0o4750));
    }
}
