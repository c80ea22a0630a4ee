//! Job sessions, each on its connection's own thread. `run`: the job's namespace and
//! binds, the job itself (forked from this thread, in that namespace), the signals its
//! client forwards, and its exit status. `attach`: a process that made a mount
//! namespace of its own (a Slurm task, through hocus's SPANK plugin) gets the binds in
//! it; its end is noticed by its pidfd.

use std::{
    io::{BufRead, BufReader, Read},
    os::{fd::OwnedFd, unix::net::UnixStream},
    path::PathBuf,
    sync::{Arc, Mutex},
    thread,
    time::Instant,
};

use anyhow::Result;
use nix::{
    sys::wait::{Id, WaitPidFlag, waitid},
    unistd::Pid,
};
use tokio::sync::mpsc;

use hocus_control::{AttachTask, Forward, JobCommand, Response};

use crate::{
    control::{
        calls::{Client, ask, ask_once},
        messages::{Answer, Ask, Call},
        refusal::Refusal,
    },
    redirect::{
        access::Caller,
        bind_opens::BindOpens,
        confirm,
        jobs::{JobStart, SlurmTask},
        mountns::{self, Bind},
        spawn,
    },
    shared::user::User,
};

/// The binds for a job starting now: the daemon's, each confirmed against the network
/// (what changed since it was copied is not bound, and its copy goes). A node of a
/// multi-node Slurm job asks its parent node to vouch for them first.
fn confirmed_binds(
    calls: &mpsc::Sender<Call>,
    caller: &Caller,
    slurm_job: Option<u32>,
) -> Result<Vec<Bind>, Refusal> {
    let binds = match ask_once(calls, caller.clone(), Ask::Binds)? {
        Answer::Binds(b) => b,
        Answer::Refused(r) => return Err(r),
        _ => return Err(Refusal::new("busy", "the daemon has no binds to give")),
    };
    let parent =
        match slurm_job.map(|job_id| ask_once(calls, caller.clone(), Ask::JobParent { job_id })) {
            Some(Ok(Answer::Parent(p))) => p,
            _ => None,
        };
    let started = Instant::now();
    let (checked, reused) = confirm::confirm_reusing(
        binds,
        confirm::JOB_START_CHECK,
        job_user(caller),
        parent.as_deref(),
    );
    let by = parent.map_or(String::new(), |p| {
        format!(
            ", {} vouched for by node {}, {} entries vouched for",
            reused.vouched, p.name, reused.vouched_entries
        )
    });
    log::info!(
        "job start: {} local copies confirmed against the network in {:.1} ms, {} entries checked ({} stale, {} not checked in time, {} confirmed by another job's start just before{by})",
        checked.binds.len(),
        started.elapsed().as_secs_f64() * 1000.0,
        checked.entries,
        checked.stale.len(),
        checked.unchecked,
        reused.recent,
    );
    if !checked.stale.is_empty() {
        let _ = ask(
            calls,
            caller.clone(),
            Ask::Stale {
                sources: checked.stale,
            },
        );
    }
    Ok(checked.binds)
}

/// What `bind_all` made: the binds, the snapshot overlays among them with the network
/// directory each stands for, the ids of the mounts marked (if every one was), and how
/// long mounting them took.
struct Made {
    binds: Vec<Bind>,
    overlays: Vec<(OwnedFd, PathBuf)>,
    marked: Option<Vec<u64>>,
    took: std::time::Duration,
}

/// Who the network is asked as for a job: its user (root may be squashed there). An
/// attached Slurm task's caller is root, and stays root.
fn job_user(caller: &Caller) -> Option<User> {
    (!caller.is_root()).then(|| User {
        uid: caller.uid,
        gid: caller.gid,
        groups: caller.groups.clone(),
    })
}

/// Makes each bind it can in this thread's namespace, looking the targets up as `user`;
/// with `marks`, marks each bind's mount so that opens through it are reported.
fn bind_all(binds: Vec<Bind>, user: Option<&User>, marks: Option<&BindOpens>) -> Made {
    let started = std::time::Instant::now();
    let mut made = Vec::new();
    let mut overlays = Vec::new();
    let mut marked = marks.map(|_| Vec::new());
    for b in binds {
        match mountns::bind_read_only(&b, user) {
            Ok(mount) => {
                if let (Some(ids), Some(marks)) = (&mut marked, marks) {
                    match marks.mark(&mount) {
                        Ok(id) => ids.push(id),
                        Err(e) => {
                            log::warn!(
                                "opens through the bind on {} cannot be reported ({e}): the task is followed by the tracer all along",
                                b.target.display()
                            );
                            marks.forget(ids.len());
                            marked = None;
                        }
                    }
                }
                if b.lazy {
                    overlays.push((mount, b.target.clone()));
                }
                made.push(b);
            }
            Err(e) => mountns::say_not_bound(&b.target, &e),
        }
    }
    Made {
        binds: made,
        overlays,
        marked,
        took: started.elapsed(),
    }
}

/// Gives the caller's own mount namespace the binds. Only root may ask (hocus's SPANK
/// plugin, in a Slurm task not yet its user's): the namespace is the calling process's,
/// taken from its pidfd, and never the node's own. The task is followed as a job until
/// it exits, its accesses counted as hits or misses.
/// A Slurm task's binds are marked with `marks` (its Slurm job's own profile must learn
/// its hits, and the tracer may rest meanwhile).
pub fn attach(
    client: &Client,
    caller: Caller,
    task: AttachTask,
    calls: &mpsc::Sender<Call>,
    marks: Option<&BindOpens>,
) -> Result<()> {
    client.reply(attached(caller, &task, calls, marks).map(|binds| Response::Attached { binds }))
}

fn attached(
    caller: Caller,
    task: &AttachTask,
    calls: &mpsc::Sender<Call>,
    marks: Option<&BindOpens>,
) -> Result<usize, Refusal> {
    if !caller.is_root() {
        return Err(Refusal::new(
            "not_root",
            "only root gives a namespace hocus's binds (hocus's Slurm plugin does, as a task starts); use hocus-agent run",
        ));
    }
    let Some(pidfd) = caller.pidfd.clone() else {
        return Err(Refusal::new(
            "identity",
            "the process that connected is gone",
        ));
    };
    let binds = confirmed_binds(calls, &caller, task.job_id)?;
    // This thread moves into the task's namespace (it ends with the connection).
    let ns = mountns::enter_namespace_of(&pidfd).map_err(|e| {
        Refusal::new(
            "namespace",
            format!("cannot enter the task's mount namespace: {e}"),
        )
    })?;
    let marks = marks.filter(|_| task.job_id.is_some());
    let Made {
        binds: made,
        overlays,
        marked,
        took,
    } = bind_all(binds, job_user(&caller).as_ref(), marks);
    let id = caller.pid as u32;
    let job = JobStart {
        id,
        binds: made.clone(),
        ns,
        task: Some(pidfd),
        overlays,
        marked,
        slurm: task.job_id.map(|job_id| SlurmTask {
            job_id,
            uid: task.uid,
        }),
    };
    if let Answer::Refused(r) = ask_once(calls, caller, Ask::JobStarting(job))? {
        // A job the daemon cannot follow would keep binds nobody detaches when their
        // files change: the task runs on the network instead.
        mountns::unbind_here(&made);
        return Err(r);
    }
    log::info!(
        "task {id} of Slurm job {} for uid {}: {} local copies in place (mounted in {:.1} ms)",
        task.job_id.map_or("?".into(), |j| j.to_string()),
        task.uid,
        made.len(),
        took.as_secs_f64() * 1000.0
    );
    Ok(made.len())
}

/// A `hocus-agent run` session: the job's namespace and binds, the job itself, the
/// signals its client forwards, and its exit status.
pub fn run(
    client: &Client,
    caller: Caller,
    run: JobCommand,
    fds: Vec<OwnedFd>,
    rest: Vec<u8>,
    calls: &mpsc::Sender<Call>,
) -> Result<()> {
    if run.argv.is_empty() {
        return client.refuse(Refusal::new("malformed", "no command to run"));
    }
    let Ok([stdin, stdout, stderr]) = <[OwnedFd; 3]>::try_from(fds) else {
        return client.refuse(Refusal::new(
            "wrong_descriptors",
            "send the standard input, output and error along with the request",
        ));
    };
    let binds = match confirmed_binds(calls, &caller, None) {
        Ok(b) => b,
        Err(r) => return client.refuse(r),
    };
    // This thread moves to the job's namespace and forks the job from there.
    let ns = match mountns::enter_new_namespace() {
        Ok(ns) => ns,
        Err(e) => {
            return client.refuse(Refusal::new(
                "namespace",
                format!("cannot make a mount namespace: {e}"),
            ));
        }
    };
    let Made {
        binds: made,
        overlays,
        took,
        ..
    } = bind_all(binds, job_user(&caller).as_ref(), None);
    // The kernel marks whatever this thread forks as job `id`; the daemon learns the job
    // before it starts, so its first opens are attributed.
    // SAFETY: gettid has no preconditions.
    let id = unsafe { libc::gettid() } as u32;
    let job = JobStart {
        id,
        binds: made.clone(),
        ns,
        task: None,
        overlays,
        marked: None,
        slurm: None,
    };
    // A job the keeper does not follow still runs (its accesses count as misses); none
    // starts while the daemon stops.
    if let Err(r) = ask_once(calls, caller.clone(), Ask::JobStarting(job)) {
        return client.refuse(r);
    }
    // From here on the keeper follows the job: it is forgotten however this ends.
    let result = run_job(
        client,
        &caller,
        &run,
        [stdin, stdout, stderr],
        made.len(),
        took,
        rest,
    );
    let _ = ask(calls, caller, Ask::JobEnded { id });
    result
}

/// Starts the job and sees it to its end: it is reaped however its client behaves.
fn run_job(
    client: &Client,
    caller: &Caller,
    run: &JobCommand,
    std_fds: [OwnedFd; 3],
    binds: usize,
    took: std::time::Duration,
    rest: Vec<u8>,
) -> Result<()> {
    let mut child = match spawn::spawn(caller, run, std_fds) {
        Ok(child) => child,
        Err(e) => {
            let message = format!("cannot start {}: {e}", run.argv[0]);
            return client.refuse(Refusal::new("cannot_start", message));
        }
    };
    let pid = child.id() as i32;
    log::info!(
        "job {pid} ({}) for uid {} with {binds} local copies in place (mounted in {:.1} ms)",
        run.argv[0],
        caller.uid,
        took.as_secs_f64() * 1000.0
    );
    // A client already gone is told nothing more; its job is hung up below, as by a
    // closed terminal, when the forwarder meets the end of the connection.
    let told = client.send(&Response::Started { pid, binds });

    // Signals from the client go to the job's process group. Once the job has exited (its
    // leader still unreaped, so its process group id cannot be anyone else's),
    // forwarding stops for good before the job is reaped.
    let ended = Arc::new(Mutex::new(false));
    let stream = client.stream;
    let forwarding = stream
        .try_clone()
        .map_err(anyhow::Error::from)
        .and_then(|reader| {
            let ended = Arc::clone(&ended);
            Ok(thread::Builder::new()
                .name("hocus-signals".into())
                .spawn(move || forward_signals(pid, rest, reader, &ended))?)
        });
    if let Err(e) = &forwarding {
        log::warn!("job {pid}: its client's signals cannot reach it ({e}); hanging it up");
        // SAFETY: plain kill(2) on the job's process group, whose leader is unreaped.
        unsafe { libc::kill(-pid, libc::SIGHUP) };
    }
    let exited = waitid(
        Id::Pid(Pid::from_raw(pid)),
        WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT,
    );
    *ended.lock().unwrap_or_else(|e| e.into_inner()) = true;
    let _ = stream.shutdown(std::net::Shutdown::Read);
    if let Ok(t) = forwarding {
        let _ = t.join();
    }
    if let Err(e) = exited {
        log::warn!("job {pid}: waiting for it failed: {e}");
    }
    let status = child.wait()?;
    told?;
    use std::os::unix::process::ExitStatusExt;
    client.send(&Response::Exited {
        code: status.code(),
        signal: status.signal(),
    })
}

/// Forwards the signals the client sends (one JSON line each) to the job's process group
/// until the job has ended; a client that goes away hangs the job up.
fn forward_signals(pid: i32, rest: Vec<u8>, reader: UnixStream, ended: &Mutex<bool>) {
    let mut lines = BufReader::new(Read::chain(std::io::Cursor::new(rest), reader)).lines();
    loop {
        let signal = match lines.next() {
            Some(Ok(line)) => match serde_json::from_str::<Forward>(&line) {
                Ok(f) if (1..=64).contains(&f.signal) => f.signal,
                _ => continue,
            },
            _ => libc::SIGHUP,
        };
        // Checked and sent under the lock the reaper takes: never after the job ended.
        let ended = ended.lock().unwrap_or_else(|e| e.into_inner());
        if *ended {
            return;
        }
        // SAFETY: plain kill(2) on the job's process group, whose leader is unreaped.
        if unsafe { libc::kill(-pid, signal) } != 0 || signal == libc::SIGHUP {
            return;
        }
    }
}
