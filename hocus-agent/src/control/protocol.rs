//! The control socket's language (/run/hocus/agent.sock): one JSON request line, then
//! JSON response lines (one, or progress, or a job's session), and what a connection
//! hands the daemon's loop. Anyone may connect; every request is answered according to
//! the caller's credentials, taken from the socket.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::{
    profile::format::Profile,
    redirect::{access::Caller, mountns::Bind, spawn::JobCommand},
    shared::status::{Progress, Refused, Status},
};

/// Requests carry whole profiles; bound them so a client cannot exhaust the daemon.
pub const MAX_REQUEST_BYTES: u64 = 512 << 20;

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "request", rename_all = "snake_case")]
pub enum Request {
    Status,
    Export {
        root: Option<PathBuf>,
    },
    Import {
        profile: Profile,
    },
    /// Merge the profile and warm the cache from it now, reporting progress.
    Prefetch {
        profile: Profile,
    },
    /// Change the budgets of the running daemon (root only), in bytes.
    Budgets {
        ssd: Option<u64>,
        ram: Option<u64>,
    },
    /// Run a command in a namespace where local copies stand in for network files; the
    /// standard descriptors come along (SCM_RIGHTS).
    Run(JobCommand),
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "response", rename_all = "snake_case")]
pub enum Response {
    Status(Box<Status>),
    Profile(Profile),
    Imported {
        files: usize,
        missing: usize,
        /// Entries refused (at most `REFUSED_SHOWN`), and how many in all.
        #[serde(default)]
        refused: Vec<Refused>,
        #[serde(default)]
        refused_total: usize,
    },
    Progress(Progress),
    /// Internal: the binds for a job's namespace.
    Binds(Vec<Bind>),
    /// The job runs, as `pid`, with `binds` local copies in place.
    Started {
        pid: i32,
        binds: usize,
    },
    /// The job ended: its exit code, or the signal that ended it.
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
    },
    Error {
        message: String,
    },
    /// Internal: a request was carried out.
    Ready,
}

/// What a connection asks of the daemon's loop: a client's request, or one of the
/// steps of a job session.
pub enum Ask {
    Client(Request),
    /// The binds to make in a new job's namespace.
    Binds,
    /// The calling thread (`id`) is about to fork a job in its namespace, with these
    /// binds (to detach on changes, and to tell hits from misses). Answered with
    /// `Response::Ready`.
    JobStarting {
        id: u32,
        binds: Vec<Bind>,
    },
    JobEnded {
        id: u32,
    },
}

/// A request with its caller, waiting for the daemon's answer: one response, or several
/// (progress) until the sender is dropped.
pub struct Call {
    pub caller: Caller,
    pub ask: Ask,
    pub reply: mpsc::UnboundedSender<Response>,
}

/// A line the client sends during the session.
#[derive(Debug, Serialize, Deserialize)]
pub struct Forward {
    pub signal: i32,
}
