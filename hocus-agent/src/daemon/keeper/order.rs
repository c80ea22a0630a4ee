//! What the keeper is told: its configuration at start (`Config`), live changes
//! (`Reconfigure`), and the orders the daemon's loop sends through the handle (`Order`).

use std::{
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Result;
use hocus_control::status::{CacheStatus, Progress};
use tokio::sync::{mpsc, oneshot};

use crate::{
    cache::relay::{Holding, Parent},
    observe::events::Access,
    place::{budget::Budgets, placement::Filters},
    profile::{format::Profile, shortlist::Shortlist},
    redirect::{jobs::JobStart, mountns::Bind},
    shared::settings::Settings,
};

pub struct Config {
    pub cache_dir: PathBuf,
    pub ssd_budget: u64,
    pub ram_budget: u64,
    pub filters: Filters,
    pub revalidate: Duration,
    /// The longest wait between two checks of a bound entry (`Schedule`).
    pub revalidate_max: Duration,
    pub trees: Vec<PathBuf>,
    pub copy_workers: usize,
    /// Snapshots hold every file's bytes, even where lazy ones would work.
    pub whole_snapshots: bool,
    /// Files read in part at least this big get partial copies; 0: none.
    pub partial_from: u64,
    /// A read of a partial copy whose fill makes no progress this long fails with EIO.
    pub fill_timeout: Duration,
}

impl Config {
    /// The keeper's part of the settings; the watched trees are set once known.
    pub fn of(settings: &Settings) -> Result<Config> {
        let budgets = Budgets::of(settings)?;
        Ok(Config {
            cache_dir: settings.cache_dir(),
            ssd_budget: budgets.ssd,
            ram_budget: budgets.ram,
            filters: Filters::of(settings),
            revalidate: settings.revalidate(),
            // Set from the watched mounts where not given, once they are known.
            revalidate_max: settings.revalidate_max().unwrap_or(settings.revalidate()),
            trees: Vec::new(),
            copy_workers: settings.copy_workers.unwrap_or(8),
            whole_snapshots: settings.whole_snapshots.unwrap_or(false),
            partial_from: settings.partial_from.map_or(0, |s| s.of(0)),
            fill_timeout: settings.fill_timeout(),
        })
    }
}

/// Live settings (SIGHUP).
pub struct Reconfigure {
    pub ssd_budget: u64,
    pub ram_budget: u64,
    pub filters: Filters,
    pub revalidate: Duration,
    /// None: the watched mounts' own, as at start.
    pub revalidate_max: Option<Duration>,
}

/// The newest working set waiting to be placed.
pub type Latest = Arc<Mutex<Option<Shortlist>>>;

pub enum Order {
    /// The working set changed: place its latest version (in `Latest`) again. At most
    /// one is queued: a keeper behind on placements skips to the newest.
    PlaceLatest,
    /// The tracer saw the file written, truncated, renamed or unlinked.
    Invalidate(String),
    /// A change on a watched tree could not be placed: every copy is compared with the
    /// network now, not at the next revalidation.
    RevalidateNow,
    /// Processes opened, failed to find or read watched files: what one read of the
    /// kernel side found, in order.
    Accesses(Vec<Access>),
    Reconfigure(Reconfigure),
    /// Place these files now and report progress until their copies are done; copies
    /// come from the job's parent node first, if there is one (docs/fanout.md).
    Prefetch(Profile, Progressing, Option<Arc<Parent>>),
    /// Where this node's copy of a file is, for a job's other node asking for it.
    LocalCopy(String, oneshot::Sender<Holding>),
    /// Its status, and where each file is held: "ram", "ssd" or "network".
    Status(Vec<String>, oneshot::Sender<(CacheStatus, Vec<String>)>),
    /// New budgets (bytes); pins and copies beyond them are released.
    Budgets {
        ssd: Option<u64>,
        ram: Option<u64>,
    },
    /// The binds a new job's namespace gets: every valid copy.
    Binds(oneshot::Sender<Vec<Bind>>),
    /// A job starts in its mount namespace with its binds (an attached Slurm task's job
    /// is counted per Slurm job too). Sent before the job runs: the job's first opens
    /// come after it in this queue.
    JobStarting(JobStart),
    JobEnded {
        id: u32,
    },
    /// A job tried to write the file through its read-only copy: never redirect it again.
    Refused(String),
    Stop,
}

/// Where a prefetch's progress goes.
pub type Progressing = mpsc::UnboundedSender<Progress>;

/// Orders waiting for the keeper; a daemon loop sending more waits (bounded memory).
pub const ORDER_QUEUE: usize = 4096;
