//! The control socket's language (/run/hocus/agent.sock): one JSON request line, then
//! JSON response lines (one, or progress, or a job's session), and what a connection
//! hands the daemon's loop. Anyone may connect; every request is answered according to
//! the caller's credentials, taken from the socket.

use std::{os::fd::OwnedFd, path::PathBuf, sync::Arc};

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::{
    profile::{format::Profile, staging::Staging, working_set::ExportOrder},
    redirect::{access::Caller, jobs::SlurmTask, mountns::Bind, spawn::JobCommand},
    shared::status::{Progress, Refused, Status},
};

/// A request line is at most this long (a run request carries its caller's environment).
pub const MAX_REQUEST_LINE: usize = 4 << 20;
/// A profile sent to the daemon is at most this large (a million files is ~250 MB).
pub const MAX_PROFILE_BYTES: u64 = 1 << 30;

/// What a client sends: one JSON line, with descriptors (SCM_RIGHTS) where said.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "request", rename_all = "snake_case")]
pub enum Request {
    Status,
    Export {
        root: Option<PathBuf>,
    },
    /// Merge the profile read from the one descriptor sent along (the client opened the
    /// file; the daemon never opens a path a user names).
    Import,
    /// Merge the profile read from the descriptor sent along and warm the cache from it
    /// now, reporting progress.
    Prefetch,
    /// Change the budgets of the running daemon (root only), in bytes.
    Budgets {
        ssd: Option<u64>,
        ram: Option<u64>,
    },
    /// Run a command in a namespace where local copies stand in for network files; the
    /// standard descriptors come along (SCM_RIGHTS).
    Run(JobCommand),
    /// Make the binds in the caller's own mount namespace (root only: hocus's Slurm
    /// plugin, as a task starts). The namespace is the connecting process's.
    Attach(AttachTask),
    /// Save a Slurm job's own working set for the user's next job with the same key
    /// (root only: the plugin, in the job's epilog).
    SaveJobProfile(JobProfile),
    /// Prefetch from the profile the user's last job with this key saved, reporting
    /// progress (root only: the plugin, in the job's prolog).
    PrefetchJobProfile(JobProfile),
}

/// A Slurm job's profile: whose job, and under which key it is kept.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobProfile {
    pub job_id: u32,
    pub uid: u32,
    pub gid: u32,
    #[serde(default)]
    pub groups: Vec<u32>,
    pub key: String,
    /// The job's nodes as Slurm writes them (`SLURM_NODELIST`, e.g. `node[1-3]`) and
    /// this one's name: the prolog's prefetch then shares the working set among them.
    #[serde(default)]
    pub nodes: Option<String>,
    #[serde(default)]
    pub node: Option<String>,
}

/// A multi-node job whose nodes pass its working set among themselves
/// (docs/fanout.md): every node of it in Slurm's order, and this one.
#[derive(Debug, Clone)]
pub struct JobNodes {
    pub job_id: u32,
    pub nodes: Vec<String>,
    pub me: String,
}

/// What a node holds of a file another node of the job asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Holding {
    /// Its copy, valid when last checked.
    Copy(PathBuf),
    /// Not yet: a copy or a prefetch is under way.
    Coming,
    No,
}

/// Whose task asks to be attached, and of which job, as Slurm says: for the counts
/// and the job's profile (the binds are the same for everyone).
#[derive(Debug, Serialize, Deserialize)]
pub struct AttachTask {
    pub uid: u32,
    #[serde(default)]
    pub job_id: Option<u32>,
}

impl Request {
    /// How many descriptors must come with the request: exactly these, no more.
    pub fn descriptors(&self) -> usize {
        match self {
            Request::Import | Request::Prefetch => 1,
            Request::Run(_) => 3,
            _ => 0,
        }
    }
}

/// A client's request as the daemon's loop gets it, its profile read already.
#[derive(Debug)]
pub enum Query {
    Status,
    Export {
        root: Option<PathBuf>,
    },
    /// A profile a client sent, read and checked by its connection.
    Import(Box<Staging>),
    /// The same, to warm the cache from now; a Slurm job's prolog prefetch on one of its
    /// several nodes shares it with them (`relay`).
    Prefetch {
        staged: Box<Staging>,
        relay: Option<JobNodes>,
    },
    Budgets {
        ssd: Option<u64>,
        ram: Option<u64>,
    },
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "response", rename_all = "snake_case")]
pub enum Response {
    Status(Box<Status>),
    /// A part of an exported profile, in file order (the first carries the start); an
    /// export ends with `Exported`.
    Profile(Profile),
    /// The export is complete: so many entries were sent.
    Exported {
        files: usize,
        missing: usize,
        dirs: usize,
    },
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
    /// A job's profile was saved: where, and what it holds.
    Saved {
        path: PathBuf,
        files: usize,
        missing: usize,
    },
    /// Internal: a Slurm job's own working set.
    #[serde(skip)]
    JobProfile(Profile),
    Relay(Holding),
    /// The caller's namespace has `binds` local copies in place.
    Attached {
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
    /// Internal: an export's order, and its next part (none when all were given).
    #[serde(skip)]
    Export {
        order: Box<ExportOrder>,
        part: Option<Profile>,
    },
}

/// What a connection asks of the daemon's loop: a client's request, or one of the
/// steps of a job session.
pub enum Ask {
    Client(Query),
    /// The binds to make in a new job's namespace.
    Binds,
    /// A job starts in namespace `ns` with these binds (to detach on changes, and to
    /// tell hits from misses). Its id is the thread about to fork it (`hocus-agent run`),
    /// or the attached `task`'s pid, which is followed until that process exits.
    /// Answered with `Response::Ready`, or `Error` if it cannot be followed.
    JobStarting {
        id: u32,
        binds: Vec<Bind>,
        ns: OwnedFd,
        task: Option<Arc<OwnedFd>>,
        /// The snapshot views among the binds (their mounts), with the network
        /// directory each stands for: files opened in them are placed there.
        views: Vec<(OwnedFd, PathBuf)>,
        /// The Slurm job, for an attached task.
        slurm: Option<SlurmTask>,
    },
    JobEnded {
        id: u32,
    },
    /// The next part of an export under way (its order comes back with it).
    ExportPart(Box<ExportOrder>),
    /// Slurm job `slurm_job`'s own working set, taken: its epilog saves it.
    TakeJobProfile {
        slurm_job: u32,
    },
    /// Copies a job-start check found changed or gone on the network: drop them.
    Stale {
        sources: Vec<PathBuf>,
    },
    /// Node `from`, proven by a root munge credential, asks to fetch Slurm job
    /// `job_id`'s files from this node, which it names `to` (`Ready` or `Error`).
    RelayJoin {
        job_id: u32,
        from: String,
        to: String,
    },
    /// Node `from` of the job asks for `source` (`Relay` or `Error`).
    RelayFile {
        job_id: u32,
        from: String,
        source: String,
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
