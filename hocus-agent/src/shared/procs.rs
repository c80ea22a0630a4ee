//! The processes of this machine, as /proc lists them now (any may end while they are
//! read: what is read of each is checked by its reader).

use std::{fs, io};

/// The pids /proc lists.
pub fn pids() -> io::Result<impl Iterator<Item = u32>> {
    Ok(fs::read_dir("/proc")?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok()))
}

/// The real uid of process `pid` (its `Uid:` line's first field): whom it acts for,
/// which neither a setuid program nor `prctl(PR_SET_DUMPABLE)` changes (the owner of
/// `/proc/PID` does). None once it is gone.
pub fn real_uid(pid: i32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_processs_real_uid_is_read_and_a_gone_ones_is_none() {
        // SAFETY: plain getuid(2).
        let me = unsafe { libc::getuid() };
        assert_eq!(super::real_uid(std::process::id() as i32), Some(me));
        assert_eq!(super::real_uid(i32::MAX), None);
    }
}
