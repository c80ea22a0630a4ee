//! Opening a directory the daemon then works beneath (a watched tree, the cache), by a
//! path it canonicalized, and what lies beneath it: without following a symlink on any
//! component, so that one swapped in since (a user's own mount point lies in a directory
//! the user owns) is refused instead of leading the daemon elsewhere.

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::ffi::OsStrExt,
    },
    path::Path,
};

/// The /proc link that names what `fd` names (an O_PATH descriptor's file, or a mount's
/// root), for the calls that take a path and not a descriptor.
pub fn magic_link(fd: &impl AsRawFd) -> CString {
    CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).expect("no NUL in a number")
}

/// `openat2`'s resolve flags that follow no symlink and no magic link on any component.
pub const NO_SYMLINKS: u64 = libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;

/// A descriptor of directory `path` that names it without opening it (`O_PATH`): the
/// directory it was when opened, whatever happens to the path later. ELOOP if the path
/// goes through a symlink.
pub fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    openat2(
        libc::AT_FDCWD,
        path,
        libc::O_PATH | libc::O_DIRECTORY,
        NO_SYMLINKS,
    )
}

/// `rel` opened beneath directory `dir` with `flags`, following no symlink or magic link
/// on any component and never leaving `dir` (`RESOLVE_BENEATH`). ELOOP for a path
/// through a symlink, EXDEV for one that leaves `dir` (see [`is_refusal`]).
pub fn open_beneath(dir: &OwnedFd, rel: &Path, flags: libc::c_int) -> io::Result<OwnedFd> {
    let resolve = libc::RESOLVE_BENEATH | NO_SYMLINKS;
    openat2(dir.as_raw_fd(), rel, flags | libc::O_NOFOLLOW, resolve)
}

/// Regular file `rel` beneath directory `dir`, opened for reading as [`open_beneath`]
/// opens it, and only once it is known to be one: what the name is is asked first of
/// a descriptor that opens nothing (`O_PATH`), and that very inode is then opened,
/// non-blocking, and asked again. A FIFO, a socket or a device a user put in a
/// profile is refused before anything opens it (a FIFO's open waits for a writer, for
/// ever); InvalidData says so. On a path-based network filesystem (SFTP) the server
/// opens by name, so a name swapped on the server between the two steps is still
/// opened there; the check after the open refuses it.
pub fn open_regular_beneath(dir: &OwnedFd, rel: &Path) -> io::Result<std::fs::File> {
    use std::os::unix::fs::MetadataExt;
    let path = open_beneath(dir, rel, libc::O_PATH)?;
    let named = std::fs::File::from(path.try_clone()?).metadata()?;
    if !named.is_file() {
        return Err(not_regular(rel));
    }
    // SAFETY: a C string; the descriptor returned is new and ours.
    let fd = unsafe {
        libc::open(
            magic_link(&path).as_ptr(),
            libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor we own.
    let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let opened = file.metadata()?;
    if !opened.is_file() || (opened.dev(), opened.ino()) != (named.dev(), named.ino()) {
        return Err(not_regular(rel));
    }
    // Reads of a regular file block as reads do, whatever the flag says; cleared so
    // that no filesystem reads it otherwise.
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(file.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK);
    }
    Ok(file)
}

fn not_regular(rel: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{} is not a regular file", rel.display()),
    )
}

/// Whether `e`, from [`open_beneath`] or [`open_dir`], is a refusal (a path through a
/// symlink, out of its directory, or with a NUL byte) rather than a failure of the
/// filesystem.
pub fn is_refusal(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::InvalidInput
        || matches!(e.raw_os_error(), Some(libc::ELOOP) | Some(libc::EXDEV))
}

/// `openat2(dir, path, flags | O_CLOEXEC, resolve)`: InvalidInput for a NUL byte in the
/// path.
pub fn openat2(dir: RawFd, path: &Path, flags: libc::c_int, resolve: u64) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // struct open_how (linux/openat2.h); libc's is non-exhaustive.
    #[repr(C)]
    struct OpenHow {
        flags: u64,
        mode: u64,
        resolve: u64,
    }
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve,
    };
    // SAFETY: valid pointers for the duration of the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir,
            c.as_ptr(),
            &how as *const OpenHow,
            size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_regular_file_is_opened_for_reading() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        std::fs::write(real.join("file"), b"bytes").unwrap();
        let fifo = CString::new(real.join("fifo").as_os_str().as_bytes()).unwrap();
        // SAFETY: a C string.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
        std::os::unix::fs::symlink(real.join("file"), real.join("link")).unwrap();
        let tree = open_dir(&real).unwrap();
        let mut f = open_regular_beneath(&tree, Path::new("file")).unwrap();
        let mut got = String::new();
        std::io::Read::read_to_string(&mut f, &mut got).unwrap();
        assert_eq!(got, "bytes");
        // SAFETY: fcntl on an open descriptor.
        let flags = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) };
        assert_eq!(flags & libc::O_NONBLOCK, 0, "reads block as a file's do");
        // A FIFO without a writer: refused at once, not waited on for ever.
        let started = std::time::Instant::now();
        let e = open_regular_beneath(&tree, Path::new("fifo")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        // A symlink: named by a handle of its own (O_PATH), and no regular file.
        let e = open_regular_beneath(&tree, Path::new("link")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        let e = open_regular_beneath(&tree, Path::new("/dev/null")).unwrap_err();
        assert!(is_refusal(&e), "{e}");
    }

    #[test]
    fn opens_a_directory_but_not_through_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        std::fs::create_dir(real.join("tree")).unwrap();
        std::os::unix::fs::symlink(real.join("tree"), real.join("link")).unwrap();
        std::os::unix::fs::symlink("/etc", real.join("tree").join("etc")).unwrap();
        assert!(open_dir(&real.join("tree")).is_ok());
        for through in ["link", "tree/etc"] {
            let e = open_dir(&real.join(through)).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{through}");
        }
        let e = open_dir(&real.join("missing")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(!is_refusal(&e));
    }

    #[test]
    fn beneath_a_directory_nothing_goes_through_a_symlink_or_out() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        std::fs::create_dir_all(real.join("tree/d")).unwrap();
        std::fs::write(real.join("tree/d/f"), b"x").unwrap();
        std::os::unix::fs::symlink(&real, real.join("tree/up")).unwrap();
        let tree = open_dir(&real.join("tree")).unwrap();
        assert!(open_beneath(&tree, Path::new("d/f"), libc::O_RDONLY).is_ok());
        for (rel, why) in [("up/tree/d/f", libc::ELOOP), ("../tree/d/f", libc::EXDEV)] {
            let e = open_beneath(&tree, Path::new(rel), libc::O_RDONLY).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(why), "{rel}");
            assert!(is_refusal(&e), "{rel}");
        }
        let e = open_beneath(&tree, Path::new("d/\0"), libc::O_RDONLY).unwrap_err();
        assert!(is_refusal(&e), "a NUL byte");
    }
}
