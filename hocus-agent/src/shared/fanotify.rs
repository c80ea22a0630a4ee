//! Reading a fanotify group: the events in what one `read` returned.

/// The events in `buf` (whole ones: the kernel never splits one), each with the info
/// records that follow its metadata. The descriptor each carries is the caller's to
/// own and close.
pub fn events(mut buf: &[u8]) -> impl Iterator<Item = (libc::fanotify_event_metadata, &[u8])> {
    const META: usize = size_of::<libc::fanotify_event_metadata>();
    std::iter::from_fn(move || {
        if buf.len() < META {
            return None;
        }
        // SAFETY: at least META bytes; read unaligned.
        let m: libc::fanotify_event_metadata =
            unsafe { std::ptr::read_unaligned(buf.as_ptr().cast()) };
        let len = m.event_len as usize;
        if len < META || len > buf.len() {
            return None;
        }
        let (event, rest) = buf.split_at(len);
        buf = rest;
        Some((m, &event[usize::from(m.metadata_len).clamp(META, len)..]))
    })
}
