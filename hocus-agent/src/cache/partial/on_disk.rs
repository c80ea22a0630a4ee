//! What a partial copy's own file holds, as its filesystem says (`held_grains`), and
//! reading a file until a buffer is full (`read_full`).

use std::{
    fs::File,
    io,
    os::{fd::AsRawFd, unix::fs::FileExt},
};

use super::GRAIN;
use crate::profile::extents::Extents;

/// The whole grains of `file` (`size` bytes) that hold data, as the filesystem says
/// (`SEEK_DATA`, `SEEK_HOLE`). A fill writes each grain whole before it counts it, and
/// writes only what it checked to be of the copy's version; a fill cut short (the daemon
/// killed mid-write) leaves a grain in part, which this leaves out: it is filled again.
pub fn held_grains(file: &File, size: u64) -> io::Result<Extents> {
    let fd = file.as_raw_fd();
    let seek = |at: u64, whence| {
        // SAFETY: a plain lseek on a descriptor we hold.
        let r = unsafe { libc::lseek(fd, at as libc::off_t, whence) };
        match r {
            -1 => {
                let e = io::Error::last_os_error();
                // ENXIO: no data at or after `at`.
                if e.raw_os_error() == Some(libc::ENXIO) {
                    Ok(None)
                } else {
                    Err(e)
                }
            }
            at => Ok(Some(at as u64)),
        }
    };
    let last = size.div_ceil(GRAIN).min(u64::from(u32::MAX)) as u32;
    let mut held = Extents::default();
    let mut at = 0;
    while at < size {
        let Some(data) = seek(at, libc::SEEK_DATA)? else {
            break;
        };
        let hole = seek(data, libc::SEEK_HOLE)?.unwrap_or(size).min(size);
        let start = data.div_ceil(GRAIN).min(u64::from(last)) as u32;
        // Data to the end holds the last grain, short as it may be.
        let end = if hole >= size {
            last
        } else {
            (hole / GRAIN) as u32
        };
        if start < end {
            held.add(start, end);
        }
        at = hole.max(data + 1);
    }
    Ok(held)
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
pub fn read_full(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}
