//! A job belongs in its caller's cgroups, not the daemon's: on a cluster the caller is a
//! batch job whose cgroup holds its memory and CPU limits and its accounting. These are
//! the `cgroup.procs` files of a process's cgroups in every mounted hierarchy (v1 and v2).

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::observe::mounts::{self, Mount};

/// The `cgroup.procs` files of the cgroups a process's `/proc/PID/cgroup` names.
pub fn procs_files(cgroup: &str) -> Result<Vec<PathBuf>> {
    Ok(resolve(cgroup, &mounts::read()?, &|p: &Path| p.exists()))
}

/// Pairs each line of /proc/PID/cgroup (`ID:controllers:path`) with its hierarchy's
/// mount; keeps the files `exists` accepts.
fn resolve(text: &str, mounts: &[Mount], exists: &dyn Fn(&Path) -> bool) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let mount = if controllers.is_empty() {
            mounts.iter().find(|m| m.fs_type == "cgroup2")
        } else {
            mounts.iter().filter(|m| m.fs_type == "cgroup").find(|m| {
                let opts: Vec<&str> = m.super_options.split(',').collect();
                controllers.split(',').all(|c| opts.contains(&c))
            })
        };
        let Some(mount) = mount else { continue };
        // In a cgroup namespace the mount's root may not be the hierarchy's root.
        let rel = Path::new(path)
            .strip_prefix(&mount.root)
            .unwrap_or(Path::new(path));
        let rel = rel.strip_prefix("/").unwrap_or(rel);
        let procs = mount.mount_point.join(rel).join("cgroup.procs");
        if exists(&procs) && !out.contains(&procs) {
            out.push(procs);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    #[test]
    fn finds_this_process_cgroups() {
        let files = procs_files(&fs::read_to_string("/proc/self/cgroup").unwrap()).unwrap();
        let pid = std::process::id().to_string();
        // Whatever hierarchies this machine mounts, this process is listed in each.
        for f in &files {
            let procs = fs::read_to_string(f).unwrap();
            assert!(
                procs.lines().any(|l| l == pid),
                "{} does not list {pid}",
                f.display()
            );
        }
    }

    #[test]
    fn pairs_lines_with_hierarchies() {
        let mounts = mounts::parse(
            "30 1 0:26 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n\
             31 1 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n\
             32 1 0:28 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n\
             33 1 0:29 /slurm /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n",
        )
        .unwrap();
        let found = resolve(
            "5:pids:/slurm/uid_1000/job_7\n4:memory:/slurm/job_7\n2:cpu,cpuacct:/\n1:name=systemd:/x\n0::/user.slice\n",
            &mounts,
            &|_| true,
        );
        let expected = [
            "/sys/fs/cgroup/pids/uid_1000/job_7/cgroup.procs",
            "/sys/fs/cgroup/memory/slurm/job_7/cgroup.procs",
            "/sys/fs/cgroup/cpu,cpuacct/cgroup.procs",
            "/sys/fs/cgroup/unified/user.slice/cgroup.procs",
        ];
        assert_eq!(
            found,
            expected.map(PathBuf::from),
            "name=systemd has no mount here and is skipped"
        );
        assert!(resolve("4:memory:/gone\n", &mounts, &|_| false).is_empty());
    }
}
