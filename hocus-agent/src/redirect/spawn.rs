//! Starting a job: the process a `run` session (or, later, a scheduler) asks for, forked
//! from a thread already in the job's mount namespace, as the caller, with the caller's
//! limits, umask, groups and cgroups, in a session of its own. The job never gains a
//! privilege: every bind is read-only, nosuid, nodev, and the copies keep their owners and
//! modes, so the kernel refuses what the network would.

use std::{
    ffi::CString,
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::{ffi::OsStrExt, process::CommandExt},
    },
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};
use hocus_control::JobCommand;

use crate::{
    redirect::{access::Caller, cgroups},
    shared::kernel,
};

/// Resource limits every job gets from its caller, not from the daemon (whose
/// RLIMIT_MEMLOCK may be unlimited), by their names in /proc/PID/limits.
const LIMITS: [(&str, libc::__rlimit_resource_t); 16] = [
    ("Max cpu time", libc::RLIMIT_CPU),
    ("Max file size", libc::RLIMIT_FSIZE),
    ("Max data size", libc::RLIMIT_DATA),
    ("Max stack size", libc::RLIMIT_STACK),
    ("Max core file size", libc::RLIMIT_CORE),
    ("Max resident set", libc::RLIMIT_RSS),
    ("Max processes", libc::RLIMIT_NPROC),
    ("Max open files", libc::RLIMIT_NOFILE),
    ("Max locked memory", libc::RLIMIT_MEMLOCK),
    ("Max address space", libc::RLIMIT_AS),
    ("Max file locks", libc::RLIMIT_LOCKS),
    ("Max pending signals", libc::RLIMIT_SIGPENDING),
    ("Max msgqueue size", libc::RLIMIT_MSGQUEUE),
    ("Max nice priority", libc::RLIMIT_NICE),
    ("Max realtime priority", libc::RLIMIT_RTPRIO),
    ("Max realtime timeout", libc::RLIMIT_RTTIME),
];

type Limits = Vec<(libc::__rlimit_resource_t, libc::rlimit)>;

/// Parses /proc/PID/limits: `Max locked memory   8388608   8388608   bytes`.
fn parse_limits(text: &str) -> Result<Limits> {
    let value = |v: &str| -> Result<libc::rlim_t> {
        if v == "unlimited" {
            Ok(libc::RLIM_INFINITY)
        } else {
            v.parse().with_context(|| format!("a limit of {v:?}"))
        }
    };
    let mut out = Vec::new();
    for (name, resource) in LIMITS {
        let line = text
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("no {name:?} in the limits"))?;
        let mut fields = line[name.len()..].split_whitespace();
        let (Some(soft), Some(hard)) = (fields.next(), fields.next()) else {
            bail!("malformed limit line {line:?}");
        };
        out.push((
            resource,
            libc::rlimit {
                rlim_cur: value(soft)?,
                rlim_max: value(hard)?,
            },
        ));
    }
    Ok(out)
}

/// Starts the job as the caller, in a session of its own, with what it inherits from the
/// caller read now (limits, umask, groups, cgroups, no_new_privs): never from the
/// client's word, and only while the caller is still the process that connected.
pub fn spawn(
    caller: &Caller,
    run: &JobCommand,
    [stdin, stdout, stderr]: [OwnedFd; 3],
) -> Result<std::process::Child> {
    let process = caller.process().map_err(anyhow::Error::msg)?;
    let limits = parse_limits(&process.limits)?;
    let umask = process.umask;
    let no_new_privs = process.no_new_privs;
    // The caller's cgroups (a batch job's limits and accounting), opened before the fork.
    let cgroups: Vec<std::fs::File> = cgroups::procs_files(&process.cgroup)?
        .iter()
        .map(|f| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(f)
                .with_context(|| format!("opening {}", f.display()))
        })
        .collect::<Result<_>>()?;
    let mut cmd = Command::new(&run.argv[0]);
    cmd.args(&run.argv[1..])
        .env_clear()
        .envs(run.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::from(stdin))
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(stderr));
    let (uid, gid) = (caller.uid, caller.gid);
    let groups: Vec<libc::gid_t> = process.groups.clone();
    let cwd = CString::new(run.cwd.as_os_str().as_bytes())?;
    let close_range_forced = kernel::forced("close-range");
    // SAFETY: runs in the forked child before exec, calling only async-signal-safe
    // syscalls on data prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            // Into the caller's cgroups first, while still root. "0" moves the writer.
            for cgroup in &cgroups {
                if libc::write(cgroup.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            for (resource, limit) in &limits {
                if libc::setrlimit(*resource, limit) != 0 {
                    // Raising a hard limit past the daemon's needs CAP_SYS_RESOURCE: keep
                    // the daemon's hard limit then, and lower what can be lowered.
                    let mut now = libc::rlimit {
                        rlim_cur: 0,
                        rlim_max: 0,
                    };
                    libc::getrlimit(*resource, &mut now);
                    let clamped = libc::rlimit {
                        rlim_cur: limit.rlim_cur.min(now.rlim_max),
                        rlim_max: limit.rlim_max.min(now.rlim_max),
                    };
                    if libc::setrlimit(*resource, &clamped) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
            }
            libc::umask(umask);
            // A caller confined by no_new_privs gets a job confined so too.
            if no_new_privs && libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Nothing of the daemon's beyond stdin, stdout and stderr reaches the job, not
            // even descriptors it inherited without close-on-exec. CLOEXEC rather than
            // close: std's exec error pipe must live until the exec. Before 5.11 the
            // kernel has no CLOSE_RANGE_CLOEXEC (EINVAL): the daemon marked what it
            // inherited close-on-exec at start (`close_inherited_on_exec`), and opens
            // everything else so.
            const CLOSE_RANGE_CLOEXEC: libc::c_uint = 4;
            if !close_range_forced
                && libc::syscall(
                    libc::SYS_close_range,
                    3,
                    libc::c_uint::MAX,
                    CLOSE_RANGE_CLOEXEC,
                ) != 0
            {
                let e = std::io::Error::last_os_error();
                if !matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) {
                    return Err(e);
                }
            }
            if libc::setsid() < 0
                || libc::setgroups(groups.len(), groups.as_ptr()) != 0
                || libc::setresgid(gid, gid, gid) != 0
                || libc::setresuid(uid, uid, uid) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // As the caller: their permissions decide whether they may be there.
            if libc::chdir(cwd.as_ptr()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(cmd.spawn()?)
}

/// Marks every descriptor this process inherited (beyond stdin, stdout and stderr)
/// close-on-exec, so that no job gets one, on kernels whose `close_range` cannot do it
/// as the job starts (before 5.11). Call once, at start.
pub fn close_inherited_on_exec() {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|fd| *fd > 2)
        .collect();
    for fd in fds {
        // SAFETY: plain fcntl on a descriptor number; one closed since fails harmlessly.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_limits() {
        let text = std::fs::read_to_string("/proc/self/limits").unwrap();
        let limits = parse_limits(&text).unwrap();
        assert_eq!(limits.len(), LIMITS.len());
        for (resource, limit) in limits {
            let mut now = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: reads this process's own limit.
            unsafe { libc::getrlimit(resource, &mut now) };
            assert_eq!(
                (limit.rlim_cur, limit.rlim_max),
                (now.rlim_cur, now.rlim_max),
                "{resource}"
            );
        }
        assert!(parse_limits("Max cpu time  x  y  seconds").is_err());
    }
}
