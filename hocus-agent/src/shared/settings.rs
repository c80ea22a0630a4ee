//! The daemon's settings: defaults, then the config file (/etc/hocus/agent.toml), then
//! the command line. The file mirrors every daemon flag under the flag's own name
//! (`ssd-budget = "50G"`); an unknown key or a bad value is an error naming its line.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::{Deserialize, Serialize};

use crate::shared::{
    log_line,
    size::{Size, human},
};

pub const DEFAULT_CONFIG: &str = "/etc/hocus/agent.toml";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/hocus";
pub const DEFAULT_SOCKET: &str = hocus_control::DEFAULT_SOCKET;
pub const DEFAULT_JOB_PROFILES: &str = "{home}/.cache/hocus/profiles";
pub const DEFAULT_CACHE_DIR: &str = "/var/cache/hocus";
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:9742";
pub const DEFAULT_RELAY_PORT: u16 = 9743;
/// The kernel side compares against at most this many watched trees.
const MAX_WATCHED: usize = hocus_common::MAX_TREES;

/// Every daemon setting; unset ones fall back to the config file, then to the default
/// shown in `--help`.
#[derive(Args, Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Settings {
    /// A tree to watch (repeatable, at most 8). Default: every network filesystem mount.
    #[arg(long, value_name = "PATH")]
    pub watch: Option<Vec<PathBuf>>,

    /// Where the daemon keeps its profile (used directly when no daemon runs)
    /// [default: /var/lib/hocus].
    #[arg(long, global = true, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,

    /// The daemon's control socket [default: /run/hocus/agent.sock].
    #[arg(long, global = true, value_name = "PATH")]
    pub socket: Option<PathBuf>,

    /// How often the profile is written to the state directory, in seconds [default: 10].
    #[arg(long, value_name = "SECONDS")]
    pub save_interval: Option<u64>,

    /// The local cache directory (on SSD); made root-only (0700) [default: /var/cache/hocus].
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,

    /// Bytes of copies to hold on SSD (e.g. 50G). Default: half the free space of the
    /// cache filesystem, leaving a reserve.
    #[arg(long, value_name = "SIZE")]
    pub ssd_budget: Option<Size>,

    /// Bytes of copies to pin in RAM (e.g. 4G or 10% of RAM) [default: 10%].
    #[arg(long, value_name = "SIZE|PCT")]
    pub ram_budget: Option<Size>,

    /// Only cache files with these endings (e.g. .py,.pyc,.so). Default: every file.
    #[arg(long, value_name = "LIST")]
    pub include_ext: Option<String>,

    /// Never cache files under this path (repeatable).
    #[arg(long, value_name = "PATH")]
    pub exclude: Option<Vec<PathBuf>>,

    /// How often the copies running jobs have bound are checked against the network file
    /// (size, mtime, ctime, inode), in seconds; what no job has bound is checked at the
    /// next job's start, so an idle node asks the server nothing [default: 30].
    #[arg(long, value_name = "SECONDS")]
    pub revalidate: Option<u64>,

    /// The longest wait between two checks of a bound copy or snapshot, in seconds: each
    /// check that finds one unchanged doubles its wait from `revalidate` up to this, as
    /// an NFS client's attribute cache does [default: the watched NFS mounts' acregmax
    /// (or acdirmax, the lesser), else 60].
    #[arg(long, value_name = "SECONDS")]
    pub revalidate_max: Option<u64>,

    /// Seconds with nothing to learn (no job running, nothing done on the watched trees)
    /// after which the syscall program is detached, so that the node's processes pay
    /// nothing for tracing; the first use of a watched mount (a FUSE request, a page read
    /// from its server) attaches it again, and a job starting does before it runs.
    /// What processes do in the meantime is not seen. Where jobs are learned from the
    /// FUSE server's requests (status: "learning jobs"), it rests whatever runs, and this
    /// is how long a job given local copies has its hits counted after it starts. 0:
    /// never detach [default: 60].
    #[arg(long, value_name = "SECONDS")]
    pub rest_after: Option<u64>,

    /// Follow the syscalls of every process on the node. When every watched tree is on
    /// FUSE (sshfs ...), the syscall program follows jobs from their start and any other
    /// process from its first request to a watched mount, and turns every other process
    /// away at once, so that the node's work that never touches a watched tree pays no
    /// more than any attached program does; what a process outside jobs does through the
    /// client's caches alone before its first request is not seen. Trees on other
    /// filesystems (NFS, Lustre: their opens and failed lookups are not all requests)
    /// make the daemon follow every process anyway (docs/overhead.md) [default: false].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub trace_every_process: Option<bool>,

    /// Copies made at once: they wait on the network more than they work [default: 8].
    #[arg(long, value_name = "N")]
    pub copy_workers: Option<usize>,

    /// Snapshots copy every file of their tree, cold ones too, instead of leaving cold
    /// files on the network behind an overlay (what kernels without overlayfs data-only
    /// layers given as descriptors get anyway) [default: false].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub whole_snapshots: Option<bool>,

    /// A file at least this big that jobs read in part (the profile's byte ranges) and
    /// never mapped gets a partial copy: a sparse local file holding the ranges read,
    /// the rest filled from the network when a job reads it (docs/partial-copies.md;
    /// needs Linux 6.14's fanotify pre-content events on the cache's filesystem; whole
    /// copies elsewhere). Each read system call of such a copy waits on the daemon's
    /// answer (tens of µs) until it holds the whole file. 0: every copy whole [default: 64M].
    #[arg(long, value_name = "SIZE")]
    pub partial_from: Option<Size>,

    /// Seconds a read of a partial copy waits for its fill from the network to make
    /// progress (a server that does not answer); past them the read fails with EIO,
    /// never hangs [default: 30].
    #[arg(long, value_name = "SECONDS")]
    pub fill_timeout: Option<u64>,

    /// Entries (files, missing names, directories) the working set holds at most; beyond,
    /// new names read are not recorded (writes always are) [default: 2000000].
    #[arg(long, value_name = "N")]
    pub max_profile_entries: Option<usize>,

    /// Entries a profile an ordinary user sends (a prefetch, a job's own profile) brings
    /// in at most; the rest are refused, named and counted. Root's are bounded by
    /// max-profile-entries [default: 200000].
    #[arg(long, value_name = "N")]
    pub max_user_profile_entries: Option<usize>,

    /// Where a Slurm job's own profile is kept for the user's next job with the same key
    /// (`KEY.json`; written and read as the user): {home}, {user} and {uid} are the
    /// job's user's [default: {home}/.cache/hocus/profiles].
    #[arg(long, value_name = "TEMPLATE")]
    pub job_profiles: Option<String>,

    /// The TCP port on which the daemons of a multi-node Slurm job's nodes pass its
    /// working set among themselves (docs/fanout.md); 0: no relay [default: 9743].
    #[arg(long, value_name = "PORT")]
    pub relay_port: Option<u16>,

    /// Seconds without a byte from a job's parent node before this node fetches from
    /// the network itself [default: 5].
    #[arg(long, value_name = "SECONDS")]
    pub relay_timeout: Option<u64>,

    /// Nodes each node passes a job's working set on to [default: 8].
    #[arg(long, value_name = "N")]
    pub fanout_width: Option<usize>,

    /// munged's socket, for the credentials the relay's nodes prove themselves with.
    /// Default: munge's own.
    #[arg(long, value_name = "PATH")]
    pub munge_socket: Option<PathBuf>,

    /// Clients of the control socket served at once [default: 256].
    #[arg(long, value_name = "N")]
    pub max_clients: Option<usize>,

    /// Clients of the control socket one user may have at once [default: 16].
    #[arg(long, value_name = "N")]
    pub max_clients_per_user: Option<usize>,

    /// Where Prometheus metrics are served (http://ADDR/metrics) [default: 127.0.0.1:9742].
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<SocketAddr>,

    /// Serve no metrics.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub no_metrics: Option<bool>,

    /// Log every open a local copy served [default: false].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub log_hits: Option<bool>,

    /// Log every open and failed lookup that went to the network, with the reason
    /// [default: false].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub log_misses: Option<bool>,

    /// Log writes to watched files and copies written to the cache [default: true].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub log_writes: Option<bool>,

    /// How log lines are written [default: text].
    #[arg(long, value_name = "FORMAT")]
    pub log_format: Option<log_line::Format>,
}

/// Takes each setting from `$a`, or else from `$b`.
macro_rules! either {
    ($a:expr, $b:expr; $($field:ident),*) => {
        Settings { $($field: $a.$field.or($b.$field)),* }
    };
}

impl Settings {
    /// These settings, with the unset ones taken from `other`.
    pub fn or(self, other: Settings) -> Settings {
        either!(self, other; watch, state_dir, socket, save_interval, cache_dir, ssd_budget,
            ram_budget, include_ext, exclude, revalidate, revalidate_max, rest_after, trace_every_process,
            copy_workers, whole_snapshots, partial_from, fill_timeout, max_profile_entries, max_user_profile_entries, job_profiles, relay_port,
            relay_timeout, fanout_width, munge_socket, max_clients, max_clients_per_user,
            metrics_addr, no_metrics, log_hits, log_misses, log_writes, log_format)
    }

    /// The defaults (`watch` and `ssd-budget` depend on the machine: left unset).
    pub fn defaults() -> Settings {
        Settings {
            watch: None,
            state_dir: Some(DEFAULT_STATE_DIR.into()),
            socket: Some(DEFAULT_SOCKET.into()),
            save_interval: Some(10),
            cache_dir: Some(DEFAULT_CACHE_DIR.into()),
            ssd_budget: None,
            ram_budget: Some(Size::Percent(10.0)),
            include_ext: None,
            exclude: Some(Vec::new()),
            revalidate: Some(30),
            revalidate_max: None,
            rest_after: Some(60),
            trace_every_process: Some(false),
            copy_workers: Some(8),
            whole_snapshots: Some(false),
            partial_from: Some(Size::Bytes(64 << 20)),
            fill_timeout: Some(30),
            max_profile_entries: Some(2_000_000),
            max_user_profile_entries: Some(200_000),
            job_profiles: Some(DEFAULT_JOB_PROFILES.into()),
            relay_port: Some(DEFAULT_RELAY_PORT),
            relay_timeout: Some(5),
            fanout_width: Some(8),
            munge_socket: None,
            max_clients: Some(256),
            max_clients_per_user: Some(16),
            metrics_addr: Some(DEFAULT_METRICS_ADDR.parse().expect("a valid address")),
            no_metrics: Some(false),
            log_hits: Some(false),
            log_misses: Some(false),
            log_writes: Some(true),
            log_format: Some(log_line::Format::Text),
        }
    }

    /// Reads a config file.
    pub fn from_file(path: &Path) -> Result<Settings> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the config file {}", path.display()))?;
        toml::from_str(&text).map_err(|e| {
            anyhow::anyhow!(
                "{}: {}",
                path.display(),
                e.to_string()
                    .trim_end()
                    .replace("TOML parse error", "error")
            )
        })
    }

    /// The config file to read: the one named, else /etc/hocus/agent.toml if present.
    pub fn config_path(named: Option<&Path>) -> Option<PathBuf> {
        match named {
            Some(p) => Some(p.to_owned()),
            None => Some(PathBuf::from(DEFAULT_CONFIG)).filter(|p| p.exists()),
        }
    }

    /// `flags`, then the config file, then the defaults.
    pub fn effective(flags: &Settings, config: Option<&Path>) -> Result<Settings> {
        let file = match config {
            Some(path) => Settings::from_file(path)?,
            None => Settings::default(),
        };
        let s = flags.clone().or(file).or(Settings::defaults());
        s.check()?;
        Ok(s)
    }

    fn check(&self) -> Result<()> {
        if let Some(w) = &self.watch {
            if w.len() > MAX_WATCHED {
                bail!(
                    "at most {MAX_WATCHED} trees can be watched; {} are named",
                    w.len()
                );
            }
        }
        if self.copy_workers == Some(0) {
            bail!("copy-workers must be at least 1");
        }
        if self.max_clients == Some(0) || self.max_clients_per_user == Some(0) {
            bail!("max-clients and max-clients-per-user must be at least 1");
        }
        if self.fanout_width == Some(0) {
            bail!("fanout-width must be at least 1");
        }
        if self.max_profile_entries == Some(0) || self.max_user_profile_entries == Some(0) {
            bail!("max-profile-entries and max-user-profile-entries must be at least 1");
        }
        if matches!(self.partial_from, Some(Size::Percent(_))) {
            bail!("partial-from is a size (e.g. 64M), not a percentage");
        }
        Ok(())
    }

    pub fn state_dir(&self) -> PathBuf {
        self.state_dir
            .clone()
            .unwrap_or_else(|| DEFAULT_STATE_DIR.into())
    }

    pub fn job_profiles(&self) -> String {
        self.job_profiles
            .clone()
            .unwrap_or_else(|| DEFAULT_JOB_PROFILES.into())
    }

    pub fn socket(&self) -> PathBuf {
        self.socket.clone().unwrap_or_else(|| DEFAULT_SOCKET.into())
    }

    pub fn save_interval(&self) -> Duration {
        Duration::from_secs(self.save_interval.unwrap_or(10).max(1))
    }

    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        if self.no_metrics == Some(true) {
            None
        } else {
            self.metrics_addr
        }
    }

    /// Switches the per-file log lines as set.
    pub fn apply_logging(&self) {
        log_line::set(
            self.log_hits.unwrap_or(false),
            self.log_misses.unwrap_or(false),
            self.log_writes.unwrap_or(true),
            self.log_format.unwrap_or_default(),
        );
    }

    pub fn cache_dir(&self) -> PathBuf {
        self.cache_dir
            .clone()
            .unwrap_or_else(|| DEFAULT_CACHE_DIR.into())
    }

    pub fn max_profile_entries(&self) -> usize {
        self.max_profile_entries.unwrap_or(2_000_000)
    }

    pub fn max_user_profile_entries(&self) -> usize {
        self.max_user_profile_entries.unwrap_or(200_000)
    }

    /// The relay's port, if it is on.
    pub fn relay_port(&self) -> Option<u16> {
        Some(self.relay_port.unwrap_or(DEFAULT_RELAY_PORT)).filter(|p| *p != 0)
    }

    pub fn fill_timeout(&self) -> Duration {
        Duration::from_secs(self.fill_timeout.unwrap_or(30).max(1))
    }

    pub fn relay_timeout(&self) -> Duration {
        Duration::from_secs(self.relay_timeout.unwrap_or(5).max(1))
    }

    pub fn fanout_width(&self) -> usize {
        self.fanout_width.unwrap_or(8).max(1)
    }

    pub fn revalidate(&self) -> Duration {
        Duration::from_secs(self.revalidate.unwrap_or(30).max(1))
    }

    /// The longest wait between two checks of a bound entry, where set; never below
    /// `revalidate`.
    pub fn revalidate_max(&self) -> Option<Duration> {
        self.revalidate_max
            .map(|s| Duration::from_secs(s).max(self.revalidate()))
    }

    /// After how long with nothing to learn the syscall program rests; None: never.
    /// At least 5 s: a job session's steps (its check, its binds) come closer together.
    pub fn rest_after(&self) -> Option<Duration> {
        match self.rest_after.unwrap_or(60) {
            0 => None,
            secs => Some(Duration::from_secs(secs.max(5))),
        }
    }

    /// The settings that change only at a restart, by name, where `other` differs.
    pub fn restart_only_changes(&self, other: &Settings) -> Vec<&'static str> {
        let mut changed = Vec::new();
        let mut check = |name, differs: bool| {
            if differs {
                changed.push(name);
            }
        };
        check("watch", self.watch != other.watch);
        check("state-dir", self.state_dir != other.state_dir);
        check("socket", self.socket != other.socket);
        check("cache-dir", self.cache_dir != other.cache_dir);
        check(
            "trace-every-process",
            self.trace_every_process != other.trace_every_process,
        );
        check("copy-workers", self.copy_workers != other.copy_workers);
        check(
            "whole-snapshots",
            self.whole_snapshots != other.whole_snapshots,
        );
        check("partial-from", self.partial_from != other.partial_from);
        check("fill-timeout", self.fill_timeout() != other.fill_timeout());
        check("max-clients", self.max_clients != other.max_clients);
        check(
            "max-clients-per-user",
            self.max_clients_per_user != other.max_clients_per_user,
        );
        check("metrics-addr", self.metrics_addr() != other.metrics_addr());
        check("relay-port", self.relay_port() != other.relay_port());
        changed
    }

    /// The settings as a config file; `ssd_now` is what the machine's default SSD
    /// budget comes to, shown when none is set.
    pub fn describe(&self, source: Option<&Path>, ssd_now: u64) -> Result<String> {
        let mut out = format!(
            "# hocus-agent's effective configuration: defaults, {}, then flags\n",
            source.map_or("no config file".to_owned(), |p| p.display().to_string())
        );
        match &self.watch {
            None => {
                out.push_str("# watch: every network filesystem mounted when the daemon starts\n")
            }
            Some(trees) => {
                for t in trees {
                    if let Err(e) = std::fs::metadata(t) {
                        bail!("watch: cannot reach {}: {e}", t.display());
                    }
                }
            }
        }
        if self.ssd_budget.is_none() {
            out.push_str(&format!(
                "# ssd-budget: half the cache filesystem's free space less a reserve (now {})\n",
                human(ssd_now)
            ));
        }
        out.push_str(&toml::to_string(self)?);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_mirrors_the_flags() {
        let s: Settings = toml::from_str(
            r#"
watch = ["/home", "/scratch"]
ssd-budget = "50G"
ram-budget = "5%"
include-ext = ".py,.so"
revalidate = 60
metrics-addr = "0.0.0.0:9742"
log-hits = true
log-format = "json"
"#,
        )
        .unwrap();
        assert_eq!(s.ssd_budget, Some(Size::Bytes(50 << 30)));
        assert_eq!(s.ram_budget, Some(Size::Percent(5.0)));
        assert_eq!(s.log_format, Some(log_line::Format::Json));
        assert_eq!(s.watch.as_ref().map(Vec::len), Some(2));
    }

    #[test]
    fn errors_name_the_line() {
        let e = toml::from_str::<Settings>("revalidate = 5\nram-budgte = \"1G\"\n").unwrap_err();
        let text = e.to_string();
        assert!(text.contains("line 2"), "{text}");
        assert!(text.contains("ram-budgte"), "{text}");
        let e = toml::from_str::<Settings>("\n\nssd-budget = \"12 parsecs\"\n").unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("line 3") && text.contains("unknown unit"),
            "{text}"
        );
    }

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let flags = Settings {
            revalidate: Some(5),
            ..Default::default()
        };
        let file = Settings {
            revalidate: Some(60),
            copy_workers: Some(2),
            ..Default::default()
        };
        let s = flags.or(file).or(Settings::defaults());
        assert_eq!(s.revalidate, Some(5));
        assert_eq!(s.copy_workers, Some(2));
        assert_eq!(s.save_interval, Some(10));
    }

    #[test]
    fn the_description_reads_back() {
        let s = Settings {
            ssd_budget: Some(Size::Bytes(3 << 30)),
            ..Settings::defaults()
        };
        let text = s.describe(None, 0).unwrap();
        let back: Settings = toml::from_str(&text).unwrap();
        assert_eq!(back, s);
    }
}
