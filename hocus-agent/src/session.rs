//! Job sessions: `hocus-agent run -- CMD` asks the daemon over the control socket to
//! start CMD in a new mount namespace where local copies stand in for network files.
//!
//! The job runs as the caller (uid, gid, groups from SO_PEERCRED and /proc), with the
//! caller's environment, working directory and standard descriptors (passed with
//! SCM_RIGHTS), in a session of its own. The client forwards the signals it gets
//! (Ctrl-C, SIGTERM, ...) to the job's process group and exits with the job's status.
//! The job never gains a privilege: every bind is read-only, nosuid, nodev, and the
//! copies keep their owners and modes, so the kernel refuses what the network would.

use std::{
    ffi::CString,
    io::{BufRead, BufReader, IoSlice, Read, Write},
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::{ffi::OsStrExt, net::UnixStream, process::CommandExt},
    },
    path::{Path, PathBuf},
    process::{Command, ExitCode, Stdio},
    thread,
};

use anyhow::{Context, Result, bail};
use nix::sys::{
    signal::{SigSet, Signal},
    socket::{ControlMessage, MsgFlags, sendmsg},
};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::{
    access::Caller,
    control::{self, Ask, Call, ClientError, Response},
    mountns,
};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRequest {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: PathBuf,
}

/// A line the client sends during the session.
#[derive(Debug, Serialize, Deserialize)]
struct Forward {
    signal: i32,
}

/// The server side of a session, on the connection's own thread.
pub fn serve(
    stream: UnixStream,
    caller: Caller,
    run: RunRequest,
    fds: Vec<OwnedFd>,
    rest: Vec<u8>,
    calls: &mpsc::Sender<Call>,
) -> Result<()> {
    let refuse = |message: String| control::send(&stream, &Response::Error { message });
    if run.argv.is_empty() {
        return refuse("no command to run".into());
    }
    let Ok([stdin, stdout, stderr]) = <[OwnedFd; 3]>::try_from(fds) else {
        return refuse("send the standard input, output and error along with the request".into());
    };
    let binds = match control::ask(calls, caller.clone(), Ask::Binds)?.blocking_recv() {
        Some(Response::Binds(b)) => b,
        _ => return refuse("the daemon has no binds to give".into()),
    };
    // This thread moves to the job's namespace and forks the job from there.
    if let Err(e) = mountns::enter_new_namespace() {
        return refuse(format!("cannot make a mount namespace: {e}"));
    }
    let mut made = Vec::new();
    for b in binds {
        match mountns::bind_read_only(&b) {
            Ok(()) => made.push(b),
            Err(e) => log::debug!("not binding {}: {e}", b.target.display()),
        }
    }
    // The kernel marks whatever this thread forks as job `id`; the daemon learns the job
    // before it starts, so its first opens are attributed.
    // SAFETY: gettid has no preconditions.
    let id = unsafe { libc::gettid() } as u32;
    let job = Ask::JobStarting {
        id,
        binds: made.clone(),
    };
    control::ask(calls, caller.clone(), job)?.blocking_recv();
    let mut child = match spawn(&caller, &run, [stdin, stdout, stderr]) {
        Ok(child) => child,
        Err(e) => return refuse(format!("cannot start {}: {e}", run.argv[0])),
    };
    let pid = child.id() as i32;
    log::info!(
        "job {pid} ({}) for uid {} with {} local copies in place",
        run.argv[0],
        caller.uid,
        made.len()
    );
    control::send(
        &stream,
        &Response::Started {
            pid,
            binds: made.len(),
        },
    )?;

    // Signals from the client go to the job's process group; a client that goes away
    // hangs the job up, as a closed terminal would.
    let reader = stream.try_clone()?;
    thread::spawn(move || {
        let mut lines = BufReader::new(Read::chain(std::io::Cursor::new(rest), reader)).lines();
        loop {
            let signal = match lines.next() {
                Some(Ok(line)) => match serde_json::from_str::<Forward>(&line) {
                    Ok(f) if (1..=64).contains(&f.signal) => f.signal,
                    _ => continue,
                },
                _ => libc::SIGHUP,
            };
            // SAFETY: plain kill(2) on the job's process group.
            if unsafe { libc::kill(-pid, signal) } != 0 || signal == libc::SIGHUP {
                break;
            }
        }
    });
    let status = child.wait()?;
    let _ = control::ask(calls, caller, Ask::JobEnded { id });
    use std::os::unix::process::ExitStatusExt;
    control::send(
        &stream,
        &Response::Exited {
            code: status.code(),
            signal: status.signal(),
        },
    )
}

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

/// The caller's limits and umask, read from the kernel (never from the client's word).
fn inherited(caller: &Caller) -> Result<(Limits, libc::mode_t)> {
    let limits = parse_limits(&std::fs::read_to_string(format!(
        "/proc/{}/limits",
        caller.pid
    ))?)?;
    let status = std::fs::read_to_string(format!("/proc/{}/status", caller.pid))?;
    let umask = status
        .lines()
        .find_map(|l| l.strip_prefix("Umask:"))
        .and_then(|v| libc::mode_t::from_str_radix(v.trim(), 8).ok())
        .context("no Umask in /proc/PID/status")?;
    Ok((limits, umask))
}

/// Starts the job as the caller, in a session of its own.
fn spawn(
    caller: &Caller,
    run: &RunRequest,
    [stdin, stdout, stderr]: [OwnedFd; 3],
) -> Result<std::process::Child> {
    let (limits, umask) = inherited(caller)?;
    // The caller's cgroups (a batch job's limits and accounting), opened before the fork.
    let cgroups: Vec<std::fs::File> = crate::cgroups::procs_files(caller.pid)?
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
    let groups: Vec<libc::gid_t> = caller.groups.clone();
    let cwd = CString::new(run.cwd.as_os_str().as_bytes())?;
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
            // Nothing of the daemon's beyond stdin, stdout and stderr reaches the job, not
            // even descriptors it inherited without close-on-exec. CLOEXEC rather than
            // close: std's exec error pipe must live until the exec.
            const CLOSE_RANGE_CLOEXEC: libc::c_uint = 4;
            if libc::syscall(
                libc::SYS_close_range,
                3,
                libc::c_uint::MAX,
                CLOSE_RANGE_CLOEXEC,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
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

/// The client side: `hocus-agent run -- CMD ARGS`. Returns the job's exit status.
pub fn run(socket: &Path, argv: Vec<String>) -> Result<ExitCode> {
    let request = control::Request::Run(RunRequest {
        argv,
        env: std::env::vars().collect(),
        cwd: std::env::current_dir().context("the current directory")?,
    });
    let stream = match control::connect(socket) {
        Ok(s) => s,
        Err(ClientError::NoDaemon(_)) => bail!(
            "no hocus-agent daemon is running (nothing at {}): start it with sudo hocus-agent --watch PATH, or run the command without hocus",
            socket.display()
        ),
        Err(ClientError::Other(e)) => return Err(e),
    };
    // Signals are taken by a thread and forwarded; block them everywhere else first.
    let mut forwarded = SigSet::empty();
    for s in [
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGHUP,
        Signal::SIGQUIT,
        Signal::SIGUSR1,
        Signal::SIGUSR2,
    ] {
        forwarded.add(s);
    }
    forwarded.thread_block()?;
    let mut line = serde_json::to_vec(&request)?;
    line.push(b'\n');
    let std_fds = [0, 1, 2];
    sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(&line)],
        &[ControlMessage::ScmRights(&std_fds)],
        MsgFlags::empty(),
        None,
    )
    .context("sending the request")?;
    let mut signals = stream.try_clone()?;
    thread::spawn(move || {
        while let Ok(signal) = forwarded.wait() {
            let mut out = serde_json::to_vec(&Forward {
                signal: signal as i32,
            })
            .unwrap_or_default();
            out.push(b'\n');
            if signals.write_all(&out).is_err() {
                break;
            }
        }
    });
    for line in BufReader::new(stream).lines() {
        let line = line.context("the daemon went away during the job")?;
        match serde_json::from_str::<Response>(&line)? {
            Response::Started { .. } => {}
            Response::Exited {
                code: Some(code), ..
            } => return Ok(ExitCode::from(code as u8)),
            Response::Exited { signal, .. } => {
                return Ok(ExitCode::from(128 + signal.unwrap_or(0) as u8));
            }
            Response::Error { message } => bail!("the daemon refused: {message}"),
            _ => {}
        }
    }
    bail!("the daemon went away during the job")
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
