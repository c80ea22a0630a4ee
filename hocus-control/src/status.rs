//! What the daemon reports: `status` (and the metrics drawn from it) and a prefetch's
//! progress. Plain data, made by the daemon and its keeper, carried by the control
//! socket, rendered by the agent's `report`.

use std::{collections::BTreeMap, net::SocketAddr, path::PathBuf};

use serde::{Deserialize, Serialize};

/// Refused entries a reply names; the rest are counted.
pub const REFUSED_SHOWN: usize = 20;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WatchedMount {
    pub path: PathBuf,
    pub fs_type: String,
    pub network: bool,
}

/// The way one part of hocus works on the running kernel: with the kernel feature it
/// prefers, or a fallback where the kernel lacks it (docs/kernels.md).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Route {
    /// The part, in the user's words: "the current task", "snapshots" ...
    pub part: String,
    /// How it works here, and with what.
    pub way: String,
    /// Not the preferred way: this kernel lacks what that one needs.
    pub fallback: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    pub pid: u32,
    #[serde(default)]
    pub version: String,
    pub uptime_secs: u64,
    #[serde(default)]
    pub started_unix_secs: u64,
    pub state_dir: PathBuf,
    /// Where Prometheus metrics are served, if they are.
    #[serde(default)]
    pub metrics_addr: Option<SocketAddr>,
    pub watched: Vec<WatchedMount>,
    /// The working set under each watched tree.
    #[serde(default)]
    pub roots: Vec<RootTotals>,
    /// The hottest files (those the caller may read), and where hocus holds them.
    #[serde(default)]
    pub top: Vec<TopFile>,
    pub files: usize,
    pub missing: usize,
    pub dirs: usize,
    /// Memory the working set takes in the daemon, in bytes (an estimate).
    #[serde(default)]
    pub profile_bytes: u64,
    /// The bound on files + missing + dirs, and the new names not recorded beyond it.
    #[serde(default)]
    pub max_profile_entries: usize,
    #[serde(default)]
    pub profile_entries_dropped: u64,
    /// Accesses not counted as hits or misses: the cache keeper was busy and the most
    /// accesses held for it waited already.
    #[serde(default)]
    pub accesses_uncounted: u64,
    pub tally: Tally,
    /// Kernel counters by name (events sent, and every kind of loss).
    pub kernel: Vec<(String, u64)>,
    pub last_save_error: Option<String>,
    pub not_traced: Vec<String>,
    pub cache: Option<CacheStatus>,
    /// The control socket's clients and refusals.
    #[serde(default)]
    pub control: ControlStatus,
    /// Whether the syscall program is attached, or rests.
    #[serde(default)]
    pub tracing: TracingStatus,
    /// The running kernel (`uname -r`), and the way each part of hocus takes on it.
    #[serde(default)]
    pub kernel_release: String,
    #[serde(default)]
    pub routes: Vec<Route>,
    /// What the daemon asked of each watched network tree's server, by purpose.
    #[serde(default)]
    pub server: Vec<ServerAsked>,
    /// What each watched NFS mount's client sent its server (every process's), by
    /// operation, as its mountstats say.
    #[serde(default)]
    pub nfs_operations: Vec<NfsOperations>,
}

/// The daemon's calls on one watched tree for one purpose (job_start, revalidation,
/// copy, snapshot, fill, profile): each open, lookup, stat, listing and read counts
/// one (docs/metrics.md says what the server may see for them).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ServerAsked {
    pub mount: PathBuf,
    pub purpose: String,
    pub operations: u64,
    /// Bytes its reads brought.
    pub bytes: u64,
}

/// An NFS mount's client's count of the requests it sent, per operation (GETATTR,
/// LOOKUP, READ ...), with those never sent left out.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct NfsOperations {
    pub mount: PathBuf,
    pub operations: Vec<(String, u64)>,
}

/// The syscall program: attached while there is something to learn or a job to follow,
/// detached ("resting") after `rest-after` seconds of neither, until a watched mount is
/// used again.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TracingStatus {
    pub resting: bool,
    /// Seconds since it last rested or woke.
    pub since_secs: u64,
    /// Seconds of nothing to learn after which it rests (0: never).
    pub rest_after_secs: u64,
    /// Times it rested, and woke (by a job starting, or by activity on a watched mount).
    pub rests: u64,
    pub wakeups: u64,
    /// Seconds spent resting in all.
    pub resting_secs: u64,
    /// It rests while jobs run, every request of theirs hitting local copies: their
    /// hits are not counted meanwhile (a miss, a write, a job start wakes it).
    #[serde(default)]
    pub with_jobs: bool,
    /// Seconds spent resting while jobs ran, in all.
    #[serde(default)]
    pub resting_with_jobs_secs: u64,
    /// Processes (and threads of followed processes) the syscall program follows now:
    /// jobs, and processes that used a watched mount's server; unless `every_process`.
    #[serde(default)]
    pub followed: u64,
    #[serde(default)]
    pub every_process: bool,
}

/// The control socket: clients connected now, the limits, and what was refused, by
/// reason (too_many_clients, too_many_clients_of_user, timeout, too_large,
/// wrong_descriptors, malformed, bad_profile, ...).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ControlStatus {
    pub clients: usize,
    pub max_clients: usize,
    pub max_clients_per_user: usize,
    pub refused: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TopFile {
    pub path: String,
    pub opens: u64,
    pub size: u64,
    pub bytes_read: u64,
    /// "ram" (pinned), "ssd" (copied) or "network".
    pub held: String,
}

/// What the agent made of the events, for `status`.
#[derive(Debug, Default, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Tally {
    pub events: u64,
    pub opens: u64,
    pub failed_lookups: u64,
    pub mutations: u64,
    pub closes: u64,
    /// Paths that were not under a watched tree once normalized (`..`).
    pub outside_watched: u64,
    /// Relative paths whose process or directory was gone before they were resolved.
    pub unresolved: u64,
    /// Paths longer than the kernel copies.
    pub truncated: u64,
    /// Writes refused with EROFS on a watched path (a job writing into a local copy).
    #[serde(default)]
    pub writes_refused: u64,
}

/// The working set under one watched tree.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct RootTotals {
    pub root: PathBuf,
    pub files: usize,
    pub bytes: u64,
    /// Names looked up and not found.
    pub missing: usize,
}

/// Opens, failed lookups and bytes read under one watched tree, by who answered: a local
/// copy (in RAM when pinned, else on SSD) bound into a `hocus-agent run` job, or the
/// network.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct Served {
    pub root: PathBuf,
    pub opens_local: u64,
    pub opens_network: u64,
    /// Of all opens: those made by processes of `hocus-agent run` jobs.
    pub job_opens: u64,
    pub lookups_local: u64,
    pub lookups_network: u64,
    pub read_ram: u64,
    pub read_ssd: u64,
    pub read_network: u64,
}

/// Progress of a prefetch, streamed to the `prefetch` command.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct Progress {
    /// Entries of the profile refused (see `Refused`), at most [`REFUSED_SHOWN`].
    #[serde(default)]
    pub refused: Vec<Refused>,
    #[serde(default)]
    pub refused_total: usize,
    pub files_done: usize,
    pub files_total: usize,
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub failed: usize,
    /// Snapshots of whole trees taken for this prefetch.
    pub trees_done: usize,
    pub trees_total: usize,
    pub trees_failed: usize,
    pub tree_bytes_done: u64,
    pub tree_bytes_total: u64,
    pub pinned_files: usize,
    pub pinned_bytes: u64,
    pub finished: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct CacheStatus {
    pub cache_dir: PathBuf,
    pub ssd_budget: u64,
    pub ram_budget: u64,
    pub cached_files: usize,
    pub cached_bytes: u64,
    pub pinned_files: usize,
    pub pinned_bytes: u64,
    pub copying: usize,
    pub copies: u64,
    pub copied_bytes: u64,
    /// Of those, the bytes a job's parent node sent (docs/fanout.md); the rest came
    /// from the network.
    #[serde(default)]
    pub copied_from_peers_bytes: u64,
    /// Milliseconds copies spent on parent nodes (waiting for them and receiving).
    #[serde(default)]
    pub peer_wait_ms: u64,
    /// Every copy that did not land, by reason (the agent's `CopyError::reason`).
    #[serde(default)]
    pub copy_failures_by_reason: BTreeMap<String, u64>,
    pub invalidations: u64,
    /// Copies dropped to make room or because they fell out of the working set.
    #[serde(default)]
    pub evictions: u64,
    pub cache_full_events: u64,
    /// Partial copies (docs/partial-copies.md): reads of them the filler allowed, bytes
    /// it filled from the network, and reads it failed with EIO (the network file
    /// changed, could not be read, or was too slow).
    #[serde(default)]
    pub partial_reads_allowed: u64,
    #[serde(default)]
    pub partial_bytes_filled: u64,
    #[serde(default)]
    pub partial_reads_failed: u64,
    /// Bytes of partial copies punched out, coldest chunks first, to keep the cache
    /// within the SSD budget (eviction by range).
    #[serde(default)]
    pub partial_bytes_trimmed: u64,
    /// What local copies served, per watched tree.
    #[serde(default)]
    pub served: Vec<Served>,
    #[serde(default)]
    pub jobs_running: usize,
    #[serde(default)]
    pub jobs_started: u64,
    #[serde(default)]
    pub prefetches: u64,
    /// Revalidations finished (one every `revalidate` seconds): what a test (or an
    /// operator) waits on to know the keeper checked what running jobs have bound
    /// against the network since.
    #[serde(default)]
    pub revalidations: u64,
    /// Of them, those with nothing to check (no running job had a copy bound, or none
    /// was due): nothing was sent to the server.
    #[serde(default)]
    pub revalidations_idle: u64,
    /// Copies and snapshots those checks compared with the network, in all.
    #[serde(default)]
    pub revalidated_entries: u64,
    /// Copies and snapshots the prefetches under way still wait for.
    #[serde(default)]
    pub prefetch_remaining_files: usize,
    #[serde(default)]
    pub prefetch_remaining_bytes: u64,
    pub limited_by_map_count: bool,
    /// Trees held as snapshots, and the bytes they add to the cache.
    #[serde(default)]
    pub snapshots: Vec<PathBuf>,
    #[serde(default)]
    pub snapshot_bytes: u64,
    /// The last Slurm jobs whose tasks were attached (at most `SLURM_JOBS_SHOWN`, the
    /// oldest finished ones forgotten first), with what was served to them.
    #[serde(default)]
    pub slurm_jobs: Vec<SlurmJob>,
}

/// Slurm jobs `status` and the metrics show at most: a bound on the metrics' labels.
pub const SLURM_JOBS_SHOWN: usize = 32;

/// A Slurm job seen through hocus's SPANK plugin on this node.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SlurmJob {
    pub job_id: u32,
    pub uid: u32,
    /// Tasks attached, and of those still running.
    pub tasks: u64,
    pub tasks_running: u64,
    /// What the job's processes were served, on every watched tree (`root` is empty).
    pub served: Served,
}

/// An entry of a profile refused, and why (its path escaped for display).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refused {
    pub path: String,
    pub why: String,
}
