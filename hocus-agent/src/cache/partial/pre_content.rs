//! fanotify's pre-content events (Linux 6.14): a group of class `FAN_CLASS_PRE_CONTENT`
//! marks a partial copy's inode with `FAN_PRE_ACCESS`, and every read of it (and every
//! `mmap`, for the whole range it maps) waits until the group answers, its range in the
//! event (`FAN_EVENT_INFO_TYPE_RANGE`). Writes to a marked file ask too (the filler's
//! own, to the copy, are let through at once). Checked on this kind of machine (6.18,
//! ext4): a `pread` at 10 MiB asks for exactly its 4 KiB; an `mmap` of 16 MiB asks for
//! all 16 at the `mmap`; `FAN_DENY` with `EIO` fails the read with EIO; and **a group
//! that goes away with an event unanswered allows it: the reader reads the hole's
//! zeros** — which is why a guard holds the group while the daemon lives (`guard`).

use crate::shared::fanotify;
use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
};

/// `FAN_PRE_ACCESS` (uapi 6.14; not in every libc yet).
pub const FAN_PRE_ACCESS: u64 = 0x0010_0000;
/// `FAN_EVENT_INFO_TYPE_RANGE`: the event's info record with the range asked for.
const INFO_TYPE_RANGE: u8 = 6;
/// `FAN_DENY_ERRNO(EIO)`: a denial that fails the access with EIO (6.14).
pub const DENY_EIO: u32 = libc::FAN_DENY | ((libc::EIO as u32 & 0xff) << 24);

/// A pre-content group: its descriptor is close-on-exec, so no job ever holds it.
#[derive(Debug)]
pub struct Group(OwnedFd);

/// One access waiting for an answer: the range asked for, and a descriptor of the file
/// opened without notification.
#[derive(Debug)]
pub struct Asked {
    pub file: OwnedFd,
    /// The process asking (its thread group).
    pub pid: i32,
    pub offset: u64,
    pub count: u64,
}

impl Group {
    /// A new group, blocking reads (its reader is a thread of its own). Its queue has
    /// no bound: past the default one (16,384 events) the kernel drops a permission
    /// event and lets its access through unanswered, and a read of a hole gets zeros,
    /// so one user's thousands of reads would have made another's job read zeros.
    /// Each event queued is an access blocked in its own thread, which bounds it; the
    /// filler fails those past `Limits::pending` at once.
    pub fn new() -> io::Result<Self> {
        let flags = libc::FAN_CLASS_PRE_CONTENT | libc::FAN_CLOEXEC | libc::FAN_UNLIMITED_QUEUE;
        // Read-only: a job reads a copy through a read-only bind, where a descriptor for
        // writing cannot be opened (the kernel would deny the read, EPERM).
        let event_flags = libc::O_RDONLY | libc::O_CLOEXEC | libc::O_LARGEFILE;
        // SAFETY: plain flags; the descriptor is owned on success.
        let fd = unsafe { libc::fanotify_init(flags, event_flags as libc::c_uint) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just made, owned by nothing else.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// The group held by a descriptor taken back (from a guard).
    pub fn from_fd(fd: OwnedFd) -> Self {
        Self(fd)
    }

    pub fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// Marks the inode `file` is open on: its reads wait for this group from now on.
    /// Fails where the kernel has no pre-content events (EINVAL before 6.14) or the
    /// filesystem does not allow them.
    pub fn mark(&self, file: &impl AsRawFd) -> io::Result<()> {
        self.mark_op(libc::FAN_MARK_ADD, file)
    }

    /// Removes the mark of `file`'s inode (its copy is dropped or whole).
    pub fn unmark(&self, file: &impl AsRawFd) -> io::Result<()> {
        self.mark_op(libc::FAN_MARK_REMOVE, file)
    }

    fn mark_op(&self, op: libc::c_uint, file: &impl AsRawFd) -> io::Result<()> {
        let link =
            std::ffi::CString::new(format!("/proc/self/fd/{}", file.as_raw_fd())).expect("no NUL");
        // SAFETY: a valid descriptor and C string.
        let r = unsafe {
            libc::fanotify_mark(
                self.0.as_raw_fd(),
                op,
                FAN_PRE_ACCESS,
                libc::AT_FDCWD,
                link.as_ptr(),
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits for accesses and returns those read at once (at most ~170: 24 bytes each).
    pub fn wait(&self, buf: &mut [u8]) -> io::Result<Vec<Asked>> {
        loop {
            // SAFETY: a buffer of its own length.
            let n = unsafe { libc::read(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(e);
            }
            return Ok(parse(&buf[..n as usize]));
        }
    }

    /// Answers an access: allowed, or failed with EIO.
    pub fn answer(&self, asked: &Asked, allow: bool) -> io::Result<()> {
        answer(self.0.as_raw_fd(), asked.file.as_raw_fd(), allow)
    }
}

/// Writes the answer for the event whose descriptor is `event_fd` to group `group`.
pub fn answer(group: RawFd, event_fd: RawFd, allow: bool) -> io::Result<()> {
    let response = libc::fanotify_response {
        fd: event_fd,
        response: if allow { libc::FAN_ALLOW } else { DENY_EIO },
    };
    // SAFETY: a plain struct of its own size.
    let n = unsafe {
        libc::write(
            group,
            (&raw const response).cast(),
            size_of::<libc::fanotify_response>(),
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The events in `buf`, each with its descriptor (owned from here on) and range.
fn parse(buf: &[u8]) -> Vec<Asked> {
    fanotify::events(buf)
        .filter(|(m, _)| m.fd >= 0)
        .map(|(m, info)| {
            // SAFETY: the kernel installed this descriptor for us.
            let file = unsafe { OwnedFd::from_raw_fd(m.fd) };
            let (offset, count) = range(info);
            Asked {
                file,
                pid: m.pid,
                offset,
                count,
            }
        })
        .collect()
}

/// The range an event's info records name; the whole file (0, u64::MAX) if none does.
fn range(mut info: &[u8]) -> (u64, u64) {
    // struct fanotify_event_info_range: a header (type, pad, len), 4 bytes of padding,
    // then offset and count.
    while info.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([info[2], info[3]]));
        if len < 4 || len > info.len() {
            break;
        }
        if info[0] == INFO_TYPE_RANGE && len >= 24 {
            let word = |at: usize| u64::from_ne_bytes(info[at..at + 8].try_into().expect("8"));
            return (word(8), word(16));
        }
        info = &info[len..];
    }
    (0, u64::MAX)
}

/// Whether partial copies can be made in the cache at `dir`: a pre-content group made
/// and a file there marked. The error says why not (a kernel before 6.14: EINVAL; a
/// filesystem that does not allow them).
pub fn probe(dir: &std::path::Path) -> io::Result<()> {
    let group = Group::new()?;
    let file = tempfile::tempfile_in(dir)?;
    group.mark(&file)?;
    group.unmark(&file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_record_is_found_among_others() {
        let mut info = vec![1u8, 0, 8, 0, 0, 0, 0, 0]; // another record, 8 bytes
        info.extend_from_slice(&[INFO_TYPE_RANGE, 0, 24, 0, 0, 0, 0, 0]);
        info.extend_from_slice(&(10u64 << 20).to_ne_bytes());
        info.extend_from_slice(&4096u64.to_ne_bytes());
        assert_eq!(range(&info), (10 << 20, 4096));
        assert_eq!(range(&info[..4]), (0, u64::MAX));
        assert_eq!(range(&[9, 0, 0, 0]), (0, u64::MAX), "a zero length ends it");
    }
}
