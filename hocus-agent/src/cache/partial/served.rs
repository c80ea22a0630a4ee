//! The copies the filler serves, by the file each is (device and inode, as an event's
//! descriptor shows it), and the writes this process makes to them: a fill's or a
//! punch's own events are let through at once, or it would wait on itself.

use std::{
    collections::HashMap,
    fs::File,
    io,
    mem::ManuallyDrop,
    os::fd::{AsRawFd, FromRawFd},
    sync::{Arc, Mutex},
};

use super::{PartialCopy, open_elsewhere::Key};

/// The copies served, by the file each is.
pub type Copies = Mutex<HashMap<Key, Arc<PartialCopy>>>;

/// Copies being written by a fill, by device and inode, with how many fills write each:
/// the writes' own events are allowed as they come.
pub type Writing = Mutex<HashMap<Key, usize>>;

/// A write of this process to copy `key` under way (a fill, a punch): the events it
/// raises are let through until it is dropped.
pub struct OwnWrite<'a> {
    writing: &'a Writing,
    key: Key,
}

impl<'a> OwnWrite<'a> {
    pub fn of(writing: &'a Writing, key: Key) -> Self {
        *writing
            .lock()
            .expect("not poisoned")
            .entry(key)
            .or_default() += 1;
        Self { writing, key }
    }
}

impl Drop for OwnWrite<'_> {
    fn drop(&mut self) {
        let mut writing = self.writing.lock().expect("not poisoned");
        if let Some(n) = writing.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                writing.remove(&self.key);
            }
        }
    }
}

/// The device and inode of `file`: how an event's descriptor is matched to its copy.
pub fn key_of(file: &impl AsRawFd) -> io::Result<Key> {
    // SAFETY: the descriptor stays open: the File made here is never dropped.
    let file = ManuallyDrop::new(unsafe { File::from_raw_fd(file.as_raw_fd()) });
    let m = file.metadata()?;
    Ok((
        std::os::unix::fs::MetadataExt::dev(&m),
        std::os::unix::fs::MetadataExt::ino(&m),
    ))
}
