//! What the handlers of a connection share: the settings they need (`Setup`), asking the
//! daemon's loop (`ask`), answering the client (`send`), refusing it (`Refusal`), and
//! reading a profile a client sent, checked as the caller (`read_profile`).

use std::{
    fs,
    io::{Read, Write},
    os::{fd::OwnedFd, unix::net::UnixStream},
    path::{Path, PathBuf},
};

use anyhow::Result;
use tokio::sync::mpsc;

use crate::{
    control::protocol::{Ask, Call, MAX_PROFILE_BYTES, Response},
    profile::{format::read_stream, staging::Staging},
    redirect::access::{self, Caller},
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
}

/// Why a request was refused before it reached the daemon's loop.
pub struct Refusal {
    pub reason: &'static str,
    pub message: String,
}

pub fn refusal(reason: &'static str, message: impl Into<String>) -> Refusal {
    Refusal {
        reason,
        message: message.into(),
    }
}

/// Reads a profile from the descriptor a client sent (at most [`MAX_PROFILE_BYTES`], in
/// the documented format), a batch at a time, into a staging of its own: only sound
/// paths inside `trees` that the caller may read, vouched for as the caller.
pub fn read_profile(
    fd: Option<OwnedFd>,
    trees: &[PathBuf],
    caller: &Caller,
) -> Result<Staging, Refusal> {
    let Some(fd) = fd else {
        return Err(refusal(
            "wrong_descriptors",
            "send the profile's descriptor",
        ));
    };
    let file = fs::File::from(fd);
    // A pipe or socket could be held open and never written: only a file is read.
    let len = match file.metadata() {
        Ok(m) if m.is_file() => m.len(),
        _ => {
            return Err(refusal(
                "bad_profile",
                "send the profile as a regular file's descriptor",
            ));
        }
    };
    if len > MAX_PROFILE_BYTES {
        return Err(refusal(
            "too_large",
            format!("a profile is at most {MAX_PROFILE_BYTES} bytes"),
        ));
    }
    let mut staged = Staging::new(trees);
    let mut batch = |p| {
        staged.take(p, |p| {
            access::filter_for(p, caller).map_err(|e| format!("{e:#}"))?;
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
    let started = read_stream(
        file.take(MAX_PROFILE_BYTES),
        Path::new("the profile sent"),
        "export it again",
        PROFILE_BATCH,
        &mut batch,
    )
    .map_err(|e| refusal("bad_profile", e.to_string()))?;
    staged.started_at(started);
    if let Some(first) = staged.refused.first() {
        log::warn!(
            "refused {} entries of a profile from uid {}, e.g. {}: {}",
            staged.refused_total,
            caller.uid,
            first.path,
            first.why
        );
    }
    Ok(staged)
}

/// Hands `ask` to the daemon's loop; its answers arrive on the returned receiver.
pub fn ask(
    calls: &mpsc::Sender<Call>,
    caller: Caller,
    ask: Ask,
) -> Result<mpsc::UnboundedReceiver<Response>> {
    let (reply, answers) = mpsc::unbounded_channel();
    calls
        .blocking_send(Call { caller, ask, reply })
        .map_err(|_| anyhow::anyhow!("the daemon is shutting down"))?;
    Ok(answers)
}

pub fn send(mut stream: &UnixStream, response: &Response) -> Result<()> {
    let mut out = serde_json::to_vec(response)?;
    out.push(b'\n');
    stream.write_all(&out)?;
    Ok(())
}
