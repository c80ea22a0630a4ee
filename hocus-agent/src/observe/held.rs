//! What a process holds open, from /proc. A resting tracer is woken by a process's
//! first request to a watched mount and attached again some milliseconds later: a file
//! that process opened in between has no entry in the kernel's table, but while the
//! process still holds it, its descriptor names it here. Read from the kernel's own
//! account (the descriptor's path and flags): nothing on the network is touched.

use std::{
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

/// Descriptors looked at per process, at most: a process holding more is a server,
/// not a job opening its inputs, and the rest are left alone.
const MAX_DESCRIPTORS: usize = 4096;

/// `O_PATH` as /proc's fdinfo shows it (octal): such a descriptor reads nothing.
const O_PATH: u64 = 0o10000000;

/// A file process `pid` holds open: its path as the kernel names it, and its owner.
pub struct Held {
    pub path: PathBuf,
    pub uid: u32,
    pub comm: String,
}

/// The files (not directories) `pid` holds open whose path `keep` accepts.
pub fn files_open(pid: u32, mut keep: impl FnMut(&Path) -> bool) -> Vec<Held> {
    let proc = PathBuf::from(format!("/proc/{pid}"));
    let Ok(meta) = fs::metadata(&proc) else {
        return Vec::new(); // gone
    };
    let comm = fs::read_to_string(proc.join("comm"))
        .map(|c| c.trim_end().to_owned())
        .unwrap_or_default();
    let Ok(fds) = fs::read_dir(proc.join("fd")) else {
        return Vec::new();
    };
    let mut held = Vec::new();
    for fd in fds.flatten().take(MAX_DESCRIPTORS) {
        let Ok(path) = fs::read_link(fd.path()) else {
            continue;
        };
        if !path.is_absolute() || !keep(&path) {
            continue; // a pipe, a socket, or not watched
        }
        let info = proc.join("fdinfo").join(fd.file_name());
        if flags(&info).is_none_or(|f| f & O_PATH != 0) || !is_file(&fd.path()) {
            continue;
        }
        held.push(Held {
            path,
            uid: meta.uid(),
            comm: comm.clone(),
        });
    }
    held
}

/// Whether the descriptor at `link` (/proc/PID/fd/N) is a regular file, from what the
/// kernel holds of it (`AT_STATX_DONT_SYNC`: no request to the server).
fn is_file(link: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(link.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statx fills `buf`; all zeroes is a valid `statx`.
    let mut buf: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `buf` is writable.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_STATX_DONT_SYNC,
            libc::STATX_TYPE,
            &mut buf,
        )
    };
    rc == 0 && u32::from(buf.stx_mode) & libc::S_IFMT == libc::S_IFREG
}

/// The `flags:` line of an fdinfo file (octal).
fn flags(fdinfo: &Path) -> Option<u64> {
    let text = fs::read_to_string(fdinfo).ok()?;
    let line = text.lines().find_map(|l| l.strip_prefix("flags:"))?;
    u64::from_str_radix(line.trim(), 8).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_files_a_process_holds_and_not_its_directories() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("held.txt");
        fs::write(&file, "x").unwrap();
        let _f = fs::File::open(&file).unwrap();
        let _d = fs::File::open(dir.path()).unwrap();
        let under = |p: &Path| p.starts_with(dir.path());
        let held = files_open(std::process::id(), under);
        let paths: Vec<&Path> = held.iter().map(|h| h.path.as_path()).collect();
        assert_eq!(paths, vec![file.as_path()]);
        assert_eq!(held[0].uid, nix::unistd::geteuid().as_raw());
        assert!(files_open(u32::MAX, under).is_empty());
    }
}
