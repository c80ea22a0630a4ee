//! What the handlers of a connection share: the settings they need (`Setup`), the
//! client they answer (`Client`: responses written, refusals counted and written),
//! asking the daemon's loop (`ask`), and reading a profile a client sent, checked as the
//! caller (`read_profile`).

use std::{
    fs,
    io::{Read, Write},
    os::{fd::OwnedFd, unix::net::UnixStream},
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::{Result, bail};
use hocus_control::{MAX_PROFILE_BYTES, Response};
use tokio::sync::mpsc;

use crate::{
    control::{
        gate::Gate,
        messages::{Answer, Ask, Call},
        refusal::Refusal,
    },
    profile::{format::read_stream, staging::Staging},
    redirect::{
        access::{self, Caller, ProfileCheck, Taken},
        bind_opens::BindOpens,
        remembered::Expected,
    },
};

/// Entries of a profile sent checked at a time (one permission check each, as the user).
const PROFILE_BATCH: usize = 16_384;

/// What connections need to know of the daemon's settings.
#[derive(Debug, Clone)]
pub struct Setup {
    /// The watched trees: the only paths a profile sent may name.
    pub trees: Vec<PathBuf>,
    /// Where Slurm jobs' own profiles are kept (`job-profiles`: a template).
    pub job_profiles: String,
    /// Where a Slurm task's binds are marked, so that its opens are seen while the
    /// tracer rests (none on a kernel without fanotify's mount ids).
    pub bind_opens: Option<Arc<BindOpens>>,
    /// The working set's bound (`max-profile-entries`): what root's profiles bring in.
    pub max_profile_entries: usize,
    /// Entries (files, missing names, directories) a profile an ordinary user sends
    /// brings in (`max-user-profile-entries`); the rest are left out, counted as
    /// refused. It is held in memory until taken in, one per user at a time.
    pub max_user_profile_entries: usize,
    /// Children per node in a multi-node job's tree (`fanout-width`), as the daemon
    /// started.
    pub fanout_width: usize,
}

/// A connected client, as the handlers of its requests answer it.
pub struct Client<'a> {
    pub stream: &'a UnixStream,
    gate: &'a Gate,
    uid: u32,
}

impl<'a> Client<'a> {
    pub fn new(stream: &'a UnixStream, gate: &'a Gate, uid: u32) -> Self {
        Self { stream, gate, uid }
    }

    pub fn send(&self, response: &Response) -> Result<()> {
        send(self.stream, response)
    }

    /// Tells the client why not, counted by its reason.
    pub fn refuse(&self, r: Refusal) -> Result<()> {
        self.gate
            .refuse(r.reason, &format!("uid {}: {}", self.uid, r.message));
        self.send(&r.response())
    }

    /// Answers the client: the response, or why not.
    pub fn reply(&self, result: Result<Response, Refusal>) -> Result<()> {
        match result {
            Ok(response) => self.send(&response),
            Err(r) => self.refuse(r),
        }
    }

    /// Passes the loop's answers on to the client until the loop is done.
    pub fn forward(&self, mut answers: mpsc::UnboundedReceiver<Answer>) -> Result<()> {
        while let Some(answer) = answers.blocking_recv() {
            match answer {
                Answer::Client(response) => self.send(&response)?,
                Answer::Refused(r) => return self.refuse(r),
                other => bail!("the daemon answered {other:?}, which is not for a client"),
            }
        }
        Ok(())
    }
}

/// Writes one response line.
pub fn send(mut stream: &UnixStream, response: &Response) -> Result<()> {
    let mut out = serde_json::to_vec(response)?;
    out.push(b'\n');
    stream.write_all(&out)?;
    Ok(())
}

/// Hands `ask` to the daemon's loop; its answers arrive on the returned receiver.
pub fn ask(
    calls: &mpsc::Sender<Call>,
    caller: Caller,
    ask: Ask,
) -> Result<mpsc::UnboundedReceiver<Answer>, Refusal> {
    let (reply, answers) = mpsc::unbounded_channel();
    calls
        .blocking_send(Call { caller, ask, reply })
        .map_err(|_| Refusal::new("stopping", "the daemon is shutting down; try again"))?;
    Ok(answers)
}

/// Asks the loop and waits for its one answer.
pub fn ask_once(calls: &mpsc::Sender<Call>, caller: Caller, asked: Ask) -> Result<Answer, Refusal> {
    ask(calls, caller, asked)?
        .blocking_recv()
        .ok_or_else(|| Refusal::new("stopping", "the daemon is shutting down; try again"))
}

/// Reads a profile from the descriptor a client sent (at most [`MAX_PROFILE_BYTES`], in
/// the documented format), a batch at a time, into a staging of its own: only sound
/// paths inside the watched trees that the caller may read, vouched for as the caller.
pub fn read_profile(
    fd: Option<OwnedFd>,
    setup: &Setup,
    caller: &Caller,
) -> Result<Staging, Refusal> {
    read_with(fd, setup, caller, None).map(|(staged, _)| staged)
}

/// What this node's copies expect now (none if the keeper cannot say).
pub fn copies_expected(caller: &Caller, calls: &mpsc::Sender<Call>) -> Expected {
    match ask_once(calls, caller.clone(), Ask::CopiesExpect) {
        Ok(Answer::Binds(binds)) => Expected::of(&binds),
        _ => Expected::default(),
    }
}

/// [`read_profile`] of a profile to prefetch: a Slurm job's own in its prolog, checked
/// as its user once for all its nodes, or a user's own (`access::filter_for_job`); with
/// how many entries' verdicts came from this node's parent, and from what this node
/// found before.
pub fn read_to_prefetch(
    fd: OwnedFd,
    setup: &Setup,
    caller: &Caller,
    job: &ProfileCheck,
) -> Result<(Staging, Taken), Refusal> {
    read_with(Some(fd), setup, caller, Some(job))
}

fn read_with(
    fd: Option<OwnedFd>,
    setup: &Setup,
    caller: &Caller,
    job: Option<&ProfileCheck>,
) -> Result<(Staging, Taken), Refusal> {
    let Some(fd) = fd else {
        return Err(Refusal::new(
            "wrong_descriptors",
            "send the profile's descriptor",
        ));
    };
    let file = fs::File::from(fd);
    // A pipe or socket could be held open and never written: only a file is read.
    let len = match file.metadata() {
        Ok(m) if m.is_file() => m.len(),
        _ => {
            return Err(Refusal::new(
                "bad_profile",
                "send the profile as a regular file's descriptor",
            ));
        }
    };
    if len > MAX_PROFILE_BYTES {
        return Err(Refusal::new(
            "too_large",
            format!("a profile is at most {MAX_PROFILE_BYTES} bytes"),
        ));
    }
    let most = if caller.is_root() {
        setup.max_profile_entries
    } else {
        setup.max_user_profile_entries
    };
    let mut staged = Staging::for_user(&setup.trees, caller.uid, most);
    let mut taken = Taken::default();
    let mut batch = |p| {
        staged.take(p, |p| {
            taken += access::filter_for_job(p, caller, job).map_err(|e| format!("{e:#}"))?;
            if !caller.is_root() {
                // An ordinary user vouches only for what they can read, and as
                // themselves; what keeps a file off the cache for everyone (writes
                // refused to a job, opens for writing) only the daemon's own
                // observation, or root, says.
                for f in &mut p.files {
                    f.uids = vec![caller.uid];
                    f.refused = false;
                    f.write_opens = 0;
                }
            }
            Ok(())
        })
    };
    let head = read_stream(
        file.take(MAX_PROFILE_BYTES),
        Path::new("the profile sent"),
        "export it again",
        PROFILE_BATCH,
        &mut batch,
    )
    .map_err(|e| Refusal::new("bad_profile", e.to_string()))?;
    staged.headed(head);
    if let Some(first) = staged.refused.first() {
        log::warn!(
            "refused {} entries of a profile from uid {}, e.g. {}: {}",
            staged.refused_total,
            caller.uid,
            first.path,
            first.why
        );
    }
    Ok((staged, taken))
}
