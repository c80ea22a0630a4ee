//! Log lines: the daemon's own messages, and the per-file lines operators switch on
//! (`--log-hits`, `--log-misses`, `--log-writes`, after the seed's inform_cache_hit /
//! miss / write). Each per-file line names the file, the process and the reason, in the
//! message and, with `--log-format json`, as fields of its own.

use std::{
    io::Write,
    sync::atomic::{AtomicBool, Ordering},
};

use log::kv::{self, VisitSource};
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

/// Starts logging to stderr at RUST_LOG's level (default info), as text or JSON lines.
pub fn init() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format(|buf, record| {
            if JSON.load(Ordering::Relaxed) {
                let mut line = serde_json::Map::new();
                line.insert("time".into(), buf.timestamp_micros().to_string().into());
                line.insert("level".into(), record.level().as_str().into());
                line.insert("message".into(), record.args().to_string().into());
                let _ = record.key_values().visit(&mut Fields(&mut line));
                writeln!(buf, "{}", serde_json::Value::Object(line))
            } else {
                writeln!(
                    buf,
                    "[{} {:<5}] {}",
                    buf.timestamp_seconds(),
                    record.level(),
                    record.args()
                )
            }
        })
        .init();
}

struct Fields<'a>(&'a mut serde_json::Map<String, serde_json::Value>);

impl<'kvs> VisitSource<'kvs> for Fields<'_> {
    fn visit_pair(&mut self, key: kv::Key<'kvs>, value: kv::Value<'kvs>) -> Result<(), kv::Error> {
        let value = match value.to_u64() {
            Some(n) => n.into(),
            None => value.to_string().into(),
        };
        self.0.insert(key.as_str().to_owned(), value);
        Ok(())
    }
}
