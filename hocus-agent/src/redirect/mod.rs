//! Stage **redirect**: jobs on the local copies. Checking them against the network as
//! a job starts (`confirm`), mount namespaces and read-only binds (`mountns`), starting
//! a job as its caller (`spawn`, `cgroups`), who the caller is (`identity`), who may see
//! what (`access`), which bind served a job's open (`jobs`), the binds an earlier
//! daemon left in jobs that outlived it (`leftovers`), and opens through a Slurm task's
//! binds, reported by fanotify (`bind_opens`); a multi-node job's start checked once
//! for all its nodes, its parent node vouching for its checks (`vouch`), and what its
//! user may read found once for all its nodes (`verdicts`) and, for the same user's next
//! jobs, remembered while the copies are unchanged (`remembered`).
//!
//! May use: `cache`, `observe`, `profile`, `shared`.

pub mod access;
pub mod bind_opens;
pub mod cgroups;
pub mod confirm;
pub mod identity;
pub mod jobs;
pub mod leftovers;
pub mod mountns;
pub mod remembered;
pub mod spawn;
pub mod verdicts;
pub mod vouch;
