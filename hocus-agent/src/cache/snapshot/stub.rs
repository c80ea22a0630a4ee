//! A lazy snapshot's stubs: a cold file held as metadata only, its bytes redirected
//! to the network through overlayfs's data-only layer.

use std::{
    fs, io,
    os::{
        fd::OwnedFd,
        unix::{ffi::OsStrExt, fs::OpenOptionsExt},
    },
    path::Path,
};

use nix::sys::stat::FileStat;

use crate::shared::attrs::{self, Times};

/// Writes the stub of a cold file into a lazy snapshot: a sparse file of its size, owner,
/// mode, ACLs and times, marked for overlayfs as metadata only (`trusted.overlay.metacopy`)
/// with its bytes at `/rel` in the data layer, the snapshot's network directory
/// (`trusted.overlay.redirect`). `from` is the network file, opened without following.
pub fn write_stub(from: &OwnedFd, rel: &Path, dst: &Path, m: &FileStat) -> io::Result<()> {
    let f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dst)?;
    f.set_len(m.st_size as u64)?;
    let redirect = Path::new("/").join(rel);
    attrs::set_xattr(&f, METACOPY, b"")?;
    attrs::set_xattr(
        &f,
        c"trusted.overlay.redirect",
        redirect.as_os_str().as_bytes(),
    )?;
    attrs::copy_xattrs(from, &f)?;
    attrs::own(&f, m.st_uid, m.st_gid, m.st_mode)?;
    Times::of_stat(m).set(&f)
}

/// overlayfs's mark of a file whose bytes are in a data-only layer.
const METACOPY: &std::ffi::CStr = c"trusted.overlay.metacopy";

/// Whether `path` (in a snapshot) is a stub: its bytes are on the network.
pub fn is_stub(path: &Path) -> bool {
    attrs::has_xattr(path, METACOPY)
}
