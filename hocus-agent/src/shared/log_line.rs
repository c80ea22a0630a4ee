//! The per-file log lines operators switch on (`--log-hits`, `--log-misses`,
//! `--log-writes`, after the seed's inform_cache_hit / miss / write): what a line says,
//! and whether it is wanted. Each names the file, the process and the reason, in the
//! message and as `log` key-values; `report::logs` writes them out, as text or JSON.

use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Which per-file lines are written, and how; changed live on SIGHUP.
static HITS: AtomicBool = AtomicBool::new(false);
static MISSES: AtomicBool = AtomicBool::new(false);
static WRITES: AtomicBool = AtomicBool::new(true);
static JSON: AtomicBool = AtomicBool::new(false);

pub fn set(hits: bool, misses: bool, writes: bool, format: Format) {
    HITS.store(hits, Ordering::Relaxed);
    MISSES.store(misses, Ordering::Relaxed);
    WRITES.store(writes, Ordering::Relaxed);
    JSON.store(format == Format::Json, Ordering::Relaxed);
}

pub fn hits() -> bool {
    HITS.load(Ordering::Relaxed)
}

pub fn misses() -> bool {
    MISSES.load(Ordering::Relaxed)
}

pub fn writes() -> bool {
    WRITES.load(Ordering::Relaxed)
}

/// Whether lines are written as JSON objects.
pub fn json() -> bool {
    JSON.load(Ordering::Relaxed)
}

/// A process, as a log line names it: `python3[4242]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Process {
    pub pid: u32,
    pub comm: String,
}

impl std::fmt::Display for Process {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.comm.is_empty() {
            write!(f, "pid {}", self.pid)
        } else {
            write!(f, "{}[{}]", self.comm, self.pid)
        }
    }
}

/// A per-file line: `hit: /home/a/x.py by python3[42]: pinned in RAM`.
pub fn file_line(event: &str, file: &str, process: Option<&Process>, reason: &str) {
    let (pid, comm) = process.map_or((0, ""), |p| (p.pid, p.comm.as_str()));
    let by = process.map(|p| format!(" by {p}")).unwrap_or_default();
    log::info!(
        target: "hocus::file",
        event = event, file = file, pid = pid, process = comm, reason = reason;
        "{event}: {file}{by}: {reason}"
    );
}
