//! The processes of this machine, as /proc lists them now (any may end while they are
//! read: what is read of each is checked by its reader).

use std::{fs, io};

/// The pids /proc lists.
pub fn pids() -> io::Result<impl Iterator<Item = u32>> {
    Ok(fs::read_dir("/proc")?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok()))
}
