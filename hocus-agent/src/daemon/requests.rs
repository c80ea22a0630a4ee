//! Answering the control socket without stalling the loop. A request is answered from
//! the loop's state as it is, once the sizes of the files seen before it are known (it
//! waits in a queue for that, up to [`STATS_WAIT`], while the loop goes on); anything that
//! may touch the network (the caller's permission checks) runs on a task of its own, and
//! what it checked comes back to the loop as a message. The loop dispatches
//! (`Daemon::answer`); what waits, and the work done off the loop, is here.

use std::{
    collections::HashSet,
    future::Future,
    time::{Duration, Instant},
};

use hocus_control::{
    Response,
    status::{Progress, Refused, TopFile},
};
use tokio::sync::mpsc;

use crate::{
    control::messages::{Answer, Query},
    profile::format::{FileEntry, Profile},
    redirect::access::{self, Caller},
};

/// How long a request waits for the sizes of files seen before it.
pub const STATS_WAIT: Duration = Duration::from_secs(30);

/// Entries of an export handed to its connection per turn of the loop.
pub const EXPORT_PART: usize = 8192;

/// Where a request's answers go.
pub type Reply = mpsc::UnboundedSender<Answer>;

/// A client request waiting for the stats under way.
pub struct Waiting {
    pub caller: Caller,
    pub request: Query,
    pub reply: Reply,
    since: Instant,
}

impl Waiting {
    pub fn new(caller: Caller, request: Query, reply: Reply) -> Self {
        Self {
            caller,
            request,
            reply,
            since: Instant::now(),
        }
    }
}

/// The requests of `waiting` to answer now: all of them once no stat is `pending`, else
/// those that waited too long (said in the log); the others stay.
pub fn due(waiting: &mut Vec<Waiting>, pending: usize) -> Vec<Waiting> {
    let all = pending == 0;
    let (due, still): (Vec<Waiting>, Vec<Waiting>) = std::mem::take(waiting)
        .into_iter()
        .partition(|w| all || w.since.elapsed() >= STATS_WAIT);
    *waiting = still;
    if !all && !due.is_empty() {
        log::warn!(
            "{pending} files could not be stat'ed within {} s; answering without their sizes",
            STATS_WAIT.as_secs()
        );
    }
    due
}

/// Sends a status, its hottest files narrowed to those `caller` may read, off the loop.
pub fn send_status(
    status: impl Future<Output = hocus_control::status::Status> + Send + 'static,
    caller: Caller,
    reply: Reply,
) {
    tokio::spawn(async move {
        let mut status = status.await;
        status.top = readable_by(status.top, &caller).await;
        let _ = reply.send(Response::Status(Box::new(status)).into());
    });
}

/// Passes a prefetch's progress on until it is finished; the first report names what
/// was refused of the profile.
pub fn send_progress(
    mut progress: mpsc::UnboundedReceiver<Progress>,
    refused: Vec<Refused>,
    refused_total: usize,
    reply: Reply,
) {
    let mut refused = Some(refused);
    tokio::spawn(async move {
        while let Some(mut p) = progress.recv().await {
            if let Some(r) = refused.take() {
                p.refused = r;
                p.refused_total = refused_total;
            }
            let finished = p.finished;
            if reply.send(Response::Progress(p).into()).is_err() || finished {
                break;
            }
        }
    });
}

/// The hottest files `caller` may read (all of them for root).
async fn readable_by(top: Vec<TopFile>, caller: &Caller) -> Vec<TopFile> {
    if caller.is_root() {
        return top;
    }
    let files = top
        .iter()
        .map(|t| FileEntry {
            path: t.path.clone(),
            ..Default::default()
        })
        .collect();
    let probe = Profile {
        files,
        ..Default::default()
    };
    let readable: HashSet<String> = match checked_for(probe, caller).await {
        Ok(p) => p.files.into_iter().map(|f| f.path).collect(),
        Err(_) => HashSet::new(),
    };
    top.into_iter()
        .filter(|t| readable.contains(&t.path))
        .collect()
}

/// The profile as `caller` may see it (permission checks may touch the network: they
/// run off the event loop's thread).
async fn checked_for(mut profile: Profile, caller: &Caller) -> Result<Profile, String> {
    let caller = caller.clone();
    match tokio::task::spawn_blocking(move || {
        access::filter_for(&mut profile, &caller).map(|()| profile)
    })
    .await
    {
        Ok(Ok(p)) => Ok(p),
        Ok(Err(e)) => Err(format!("{e:#}")),
        Err(e) => Err(e.to_string()),
    }
}
