//! What a connection's thread and the daemon's loop say to each other, inside the
//! process: a client's request as the loop gets it, its profile read and checked already
//! (`Query`); the steps of a job's session and of the relay (`Ask`); and the loop's
//! answers (`Answer`). The wire a client speaks is `hocus_control`'s.

use std::{path::PathBuf, sync::Arc};

use hocus_control::Response;
use tokio::sync::mpsc;

use crate::{
    cache::relay::{Holding, Parent},
    control::refusal::Refusal,
    profile::{format::Profile, staging::Staging, working_set::export::ExportOrder},
    redirect::{access::Caller, jobs::JobStart, mountns::Bind},
};

/// A multi-node job whose nodes pass its working set among themselves
/// (docs/fanout.md): every node of it in Slurm's order, and this one.
#[derive(Debug, Clone)]
pub struct JobNodes {
    pub job_id: u32,
    pub nodes: Vec<String>,
    pub me: String,
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
    /// several nodes shares it with them (`relay`). `node`: this node's name, as Slurm
    /// calls it, for a job's prolog: copies may come from the node that held the
    /// profile's files as it was saved (`Staging::holder`).
    Prefetch {
        staged: Box<Staging>,
        relay: Option<JobNodes>,
        node: Option<String>,
    },
    Budgets {
        ssd: Option<u64>,
        ram: Option<u64>,
    },
}

/// What a connection asks of the daemon's loop: a client's request, or one of the
/// steps of a job session or of the relay.
pub enum Ask {
    Client(Query),
    /// The binds to make in a new job's namespace.
    Binds,
    /// A job starts (answered `Ready`, or refused if it cannot be followed).
    JobStarting(JobStart),
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
    /// `job_id`'s files from this node, which it names `to` (`Ready` or refused): as
    /// one of the job's nodes, or (`held`) for a later job, what the job left here.
    RelayJoin {
        job_id: u32,
        from: String,
        to: String,
        held: bool,
    },
    /// Node `from` asks for `source` of the job (`Relay` or refused), as it joined.
    RelayFile {
        job_id: u32,
        from: String,
        source: String,
        held: bool,
    },
    /// Node `from` of the job asks this node to vouch for its job start's checks: the
    /// binds this node would check for a job start of its own (`Binds`, or refused).
    RelayVouch {
        job_id: u32,
        from: String,
    },
    /// The parent node of Slurm job `job_id`'s tree, where this node has one
    /// (`Parent`).
    JobParent {
        job_id: u32,
    },
    /// A Slurm job on several nodes, whose prolog began here: its nodes may ask this
    /// node for it from now on (`Parent`: this node's parent in the job's tree, if any).
    RelayJob(JobNodes),
    /// A Slurm job whose prolog failed here: its nodes fetch nothing from this node.
    RelayForget(u32),
    /// The binds a job would have now, for what their copies expect (`Binds`): a
    /// prolog's, which starts no job.
    CopiesExpect,
    /// Slurm job `job_id`'s epilog here, on node `me`, saves its profile naming `files`:
    /// any node's daemon may fetch those from here for a later job (`Ready`), or the
    /// relay is off (refused).
    RelayHeld {
        job_id: u32,
        me: String,
        files: Vec<String>,
    },
}

/// What the loop answers a connection.
#[derive(Debug)]
pub enum Answer {
    /// A response for the client, sent on as it is.
    Client(Response),
    /// Not done: the connection tells the client, and counts it by its reason.
    Refused(Refusal),
    /// The binds for a job's namespace.
    Binds(Vec<Bind>),
    /// Done: a job registered, a node admitted to the relay.
    Ready,
    /// An export's order, and its next part (none when all were given).
    Export {
        order: Box<ExportOrder>,
        part: Option<Profile>,
    },
    /// A Slurm job's own working set.
    JobProfile(Profile),
    /// What this node holds of a file a job's other node asks for.
    Relay(Holding),
    /// A job's parent node, if this node has one in its tree.
    Parent(Option<Arc<Parent>>),
}

impl From<Response> for Answer {
    fn from(r: Response) -> Self {
        Answer::Client(r)
    }
}

impl From<Refusal> for Answer {
    fn from(r: Refusal) -> Self {
        Answer::Refused(r)
    }
}

/// A request with its caller, waiting for the daemon's answer: one, or several
/// (progress) until the sender is dropped.
pub struct Call {
    pub caller: Caller,
    pub ask: Ask,
    pub reply: mpsc::UnboundedSender<Answer>,
}
