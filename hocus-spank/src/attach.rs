//! One task's attachment: its own mount namespace, made a slave of the node's (nothing
//! mounted in it reaches anyone else, the node's mounts still reach it), then hocus-agent
//! asked to bind its local copies in it. The daemon takes the namespace from the
//! connection's own process (its pidfd), never from anything this side says.

use std::{ffi::CString, io, os::unix::ffi::OsStrExt, path::Path};

use hocus_control::{AttachTask, Request, Response};

use crate::{daemon::Daemon, settings::Settings};

/// Whose task this is, as Slurm says.
#[derive(Debug, Clone)]
pub struct Job {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub job_id: Option<u32>,
}

/// Gives the calling process (a Slurm task, still root) hocus's binds; returns how many.
/// `Err` says why the task runs without them; the task is then exactly as it was, but
/// for a namespace of its own that sees every mount of the node.
pub fn attach(settings: &Settings, job: &Job) -> Result<usize, String> {
    let mut daemon = Daemon::connect(&settings.socket, settings.timeout)?;
    let cwd = std::env::current_dir().ok();
    own_namespace().map_err(|e| format!("cannot make the task a mount namespace: {e}"))?;
    daemon.send(&Request::Attach(AttachTask {
        uid: job.uid,
        job_id: job.job_id,
    }))?;
    let binds = match daemon.answer()? {
        Response::Attached { binds } => binds,
        other => return Err(format!("unexpected answer from hocus-agent: {other:?}")),
    };
    // The task's working directory was entered before the binds: entered again by its
    // path, it is the local copy when one is bound there now.
    if let Some(cwd) = cwd {
        if binds > 0 {
            if let Err(e) = chdir_as(job, &cwd) {
                return Err(format!(
                    "binds made, but the working directory {} could not be entered again: {e}",
                    cwd.display()
                ));
            }
        }
    }
    Ok(binds)
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A new mount namespace for this process, a slave of the node's.
fn own_namespace() -> io::Result<()> {
    // SAFETY: plain syscalls with valid arguments.
    unsafe {
        check(libc::unshare(libc::CLONE_NEWNS))?;
        check(libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_SLAVE | libc::MS_REC,
            std::ptr::null(),
        ))
    }
}

/// Changes directory with the job user's filesystem rights (root's would reach what the
/// user cannot), on this thread only; root's are back afterwards.
fn chdir_as(job: &Job, dir: &Path) -> io::Result<()> {
    let dir = CString::new(dir.as_os_str().as_bytes()).map_err(|_| io::ErrorKind::InvalidInput)?;
    // SAFETY: plain syscalls; raw setgroups/setfsuid change this thread alone (glibc's
    // wrappers of setgroups would change every thread).
    unsafe {
        let mut saved = [0 as libc::gid_t; 256];
        let n = libc::getgroups(saved.len() as libc::c_int, saved.as_mut_ptr());
        check(n)?;
        check(libc::syscall(libc::SYS_setgroups, job.groups.len(), job.groups.as_ptr()) as _)?;
        let fsgid = libc::setfsgid(job.gid);
        let fsuid = libc::setfsuid(job.uid);
        let result = check(libc::chdir(dir.as_ptr()));
        libc::setfsuid(fsuid as libc::uid_t);
        libc::setfsgid(fsgid as libc::gid_t);
        libc::syscall(libc::SYS_setgroups, n as usize, saved.as_ptr());
        result
    }
}
