//! Which partial copies a process other than the daemon has open or mapped: with no
//! job running, those are never punched (a read allowed just before a punch could meet
//! the hole, and a job's process may outlive the job the daemon knew: a child left
//! running); while jobs run, those mapped are never punched (a mapping reads what its
//! `mmap` was allowed whenever it likes).

use std::{collections::HashSet, fs, os::unix::fs::MetadataExt};

use crate::shared::procs;

/// A file by device and inode, as `stat` gives them.
pub type Key = (u64, u64);

/// Of `keys`, those some process but this one (and `also_ours`, the guard) has open or
/// mapped, as /proc shows them now. A process that ends while it is read is skipped.
pub fn opened_by_others(keys: &HashSet<Key>, also_ours: Option<i32>) -> HashSet<Key> {
    used_by_others(keys, also_ours, true)
}

/// Of `keys`, those some process but this one (and `also_ours`) has mapped.
pub fn mapped_by_others(keys: &HashSet<Key>, also_ours: Option<i32>) -> HashSet<Key> {
    used_by_others(keys, also_ours, false)
}

fn used_by_others(keys: &HashSet<Key>, also_ours: Option<i32>, open: bool) -> HashSet<Key> {
    let mut found = HashSet::new();
    if keys.is_empty() {
        return found;
    }
    let Ok(pids) = procs::pids() else {
        // Not knowing is as good as all of them open.
        return keys.clone();
    };
    let ours = [Some(std::process::id()), also_ours.map(|p| p as u32)];
    for pid in pids {
        if ours.contains(&Some(pid)) {
            continue;
        }
        if open && let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) {
            for fd in fds.flatten() {
                if let Ok(m) = fs::metadata(fd.path()) {
                    let key = (m.dev(), m.ino());
                    if keys.contains(&key) {
                        found.insert(key);
                    }
                }
            }
        }
        if let Ok(maps) = fs::read_to_string(format!("/proc/{pid}/maps")) {
            found.extend(maps.lines().filter_map(mapped).filter(|k| keys.contains(k)));
        }
    }
    found
}

/// The file a line of /proc/PID/maps maps (`addr perms offset maj:min inode path`).
fn mapped(line: &str) -> Option<Key> {
    let mut fields = line.split_whitespace().skip(3);
    let (major, minor) = fields.next()?.split_once(':')?;
    let ino: u64 = fields.next()?.parse().ok()?;
    let major = u32::from_str_radix(major, 16).ok()?;
    let minor = u32::from_str_radix(minor, 16).ok()?;
    (ino != 0).then(|| (libc::makedev(major, minor), ino))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    #[test]
    fn a_file_another_process_holds_open_or_mapped_is_found_and_others_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let key = |p: &std::path::Path| {
            let m = fs::metadata(p).unwrap();
            (m.dev(), m.ino())
        };
        let (open, mapped, idle) = (
            dir.path().join("open"),
            dir.path().join("mapped"),
            dir.path().join("idle"),
        );
        for p in [&open, &mapped, &idle] {
            fs::write(p, vec![1u8; 8192]).unwrap();
        }
        // Held by this process only: not found.
        let _mine = fs::File::open(&idle).unwrap();
        let keys: HashSet<Key> = [key(&open), key(&mapped), key(&idle)].into();
        assert!(opened_by_others(&keys, None).is_empty());
        // One process holds a file open, another a mapping of one (its descriptor closed).
        let mut holder = Command::new("python3")
            .arg("-c")
            .arg(format!(
                "import mmap, sys\nf = open('{}', 'rb')\ng = open('{}', 'rb')\nm = mmap.mmap(g.fileno(), 0, prot=mmap.PROT_READ)\ng.close()\nprint('ready', flush=True)\nsys.stdin.read()",
                open.display(),
                mapped.display()
            ))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(holder.stdout.as_mut().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line.trim(), "ready");
        let found = opened_by_others(&keys, None);
        assert_eq!(found, [key(&open), key(&mapped)].into());
        // Unless it is the one named as ours.
        assert!(opened_by_others(&keys, Some(holder.id() as i32)).is_empty());
        drop(holder.stdin.take());
        holder.wait().unwrap();
        assert!(opened_by_others(&keys, None).is_empty());
    }
}
