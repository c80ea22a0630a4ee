//! hocus-agent: a root daemon that watches jobs on network filesystems with eBPF and
//! keeps their working-set profile, and the commands that talk to it.

mod access;
mod budget;
mod cache;
mod cgroups;
mod commands;
mod control;
mod copy;
mod daemon;
mod keeper;
mod mountns;
mod mounts;
mod observe;
mod pins;
mod placement;
mod plan;
mod profile;
mod session;
mod show;
mod snapshot;
mod store;
mod syscalls;
mod tracefs;
mod tracer;

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::{Args, Parser, Subcommand};

/// Observe what jobs do on network filesystems (NFS, Lustre, GPFS, sshfs ...) and keep
/// their working-set profile: hot files in first-touch order, failed lookups, writes.
///
/// Without a command, runs the daemon in the foreground (as root). It needs no change to
/// anyone's code: eBPF tracepoints see every process's opens, failed lookups, reads and
/// writes on the watched trees.
#[derive(Parser, Debug)]
#[command(name = "hocus-agent", version, propagate_version = true)]
#[command(after_help = "Examples:
  sudo hocus-agent --watch /home              watch /home, keep the profile in /var/lib/hocus
  hocus-agent profile show                    the hottest files and trees, at a glance
  hocus-agent profile export --out job.json   save the profile for the next job or node
  sudo hocus-agent profile import job.json    merge a profile exported elsewhere")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    #[command(flatten)]
    daemon: DaemonArgs,

    /// The daemon's control socket.
    #[arg(long, global = true, value_name = "PATH", default_value = control::DEFAULT_SOCKET)]
    socket: PathBuf,

    /// Where the daemon keeps its profile (used directly when no daemon runs).
    #[arg(long, global = true, value_name = "DIR", default_value = store::DEFAULT_STATE_DIR)]
    state_dir: PathBuf,
}

#[derive(Args, Debug)]
struct DaemonArgs {
    /// A tree to watch (repeatable, at most 8). Default: every network filesystem mount.
    #[arg(long, value_name = "PATH")]
    watch: Vec<PathBuf>,

    /// How often the profile is written to the state directory.
    #[arg(long, value_name = "SECONDS", default_value_t = 10)]
    save_interval: u64,

    #[command(flatten)]
    cache: CacheArgs,
}

/// Where hot files are copied and pinned, and within which budgets.
#[derive(Args, Debug, Clone)]
struct CacheArgs {
    /// The local cache directory (on SSD); made root-only (0700).
    #[arg(long, value_name = "DIR", default_value = cache::DEFAULT_CACHE_DIR)]
    cache_dir: PathBuf,

    /// Bytes of copies to hold on SSD (e.g. 50G). Default: half the free space of the
    /// cache filesystem, leaving a reserve.
    #[arg(long, value_name = "SIZE")]
    ssd_budget: Option<budget::Size>,

    /// Bytes of copies to pin in RAM (e.g. 4G or 10%).
    #[arg(long, value_name = "SIZE|PCT", default_value = "10%")]
    ram_budget: budget::Size,

    /// Only cache files with these endings (e.g. .py,.pyc,.so). Default: every file.
    #[arg(long, value_name = "LIST")]
    include_ext: Option<String>,

    /// Never cache files under this path (repeatable).
    #[arg(long, value_name = "PATH")]
    exclude: Vec<PathBuf>,

    /// How often copies are checked against the network file (size, mtime, ctime, inode).
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    revalidate: u64,

    /// Copies made at once.
    #[arg(long, value_name = "N", default_value_t = 4)]
    copy_workers: usize,
}

impl CacheArgs {
    fn filters(&self) -> placement::Filters {
        placement::Filters {
            include_ext: self
                .include_ext
                .as_deref()
                .map(placement::Filters::parse_extensions)
                .unwrap_or_default(),
            exclude: self.exclude.clone(),
        }
    }

    /// Budgets in bytes: the SSD's from the cache filesystem, the RAM's from MemTotal.
    fn budgets(&self) -> anyhow::Result<(u64, u64)> {
        let mut probe = self.cache_dir.as_path();
        while !probe.exists() {
            probe = probe.parent().unwrap_or(std::path::Path::new("/"));
        }
        let (free, total) = budget::fs_space(probe)?;
        let ssd = match self.ssd_budget {
            Some(size) => size.of(total),
            None => budget::default_ssd_budget(free, total),
        };
        Ok((ssd, self.ram_budget.of(budget::mem_total()?)))
    }

    fn config(&self) -> anyhow::Result<keeper::Config> {
        let (ssd_budget, ram_budget) = self.budgets()?;
        Ok(keeper::Config {
            cache_dir: self.cache_dir.clone(),
            ssd_budget,
            ram_budget,
            filters: self.filters(),
            revalidate: Duration::from_secs(self.revalidate.max(1)),
            trees: Vec::new(),
            copy_workers: self.copy_workers,
        })
    }
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Export, show or import working-set profiles.
    #[command(subcommand)]
    Profile(ProfileCommand),
    /// Warm the daemon's SSD cache and RAM pins from an exported profile, before a job
    /// starts (the pins outlive this command).
    Prefetch {
        /// The exported profile.
        #[arg(long, value_name = "FILE")]
        profile: PathBuf,
    },
    /// Print the placement the daemon would choose for a profile, and the read time and
    /// memory of its workload before and after, from costs measured on the mount. Copies
    /// nothing.
    Plan {
        /// The exported profile.
        #[arg(long, value_name = "FILE")]
        profile: PathBuf,
        /// Print CSV (one line per file) instead of a table.
        #[arg(long)]
        csv: bool,
        #[command(flatten)]
        cache: CacheArgs,
    },
    /// Run a command where hocus's local copies stand in for the network files: a new
    /// mount namespace with read-only binds. Works without sudo: the daemon starts the
    /// command as you, with your environment, directory and terminal.
    Run {
        /// Prefetch this exported profile first.
        #[arg(long, value_name = "FILE")]
        profile: Option<PathBuf>,
        /// The command and its arguments (after --).
        #[arg(last = true, required = true, value_name = "CMD")]
        command: Vec<String>,
    },
    /// Change the running daemon's budgets (root); copies and pins beyond them are
    /// released at once.
    Budget {
        /// New SSD budget (e.g. 20G).
        #[arg(long, value_name = "SIZE")]
        ssd: Option<budget::Size>,
        /// New RAM budget (e.g. 2G or 5%).
        #[arg(long, value_name = "SIZE|PCT")]
        ram: Option<budget::Size>,
    },
    /// What the daemon watches, what it has seen, and whatever it could not deliver.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
enum ProfileCommand {
    /// Write the profile as JSON (docs/profile-format.md), to stdout or a file. Ordinary
    /// users get only the entries of files they can read.
    Export {
        /// Only entries under this directory.
        #[arg(long, value_name = "PATH")]
        root: Option<PathBuf>,
        /// Write here (atomically) instead of to stdout.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Print the hottest files and trees, the failed lookups and the totals.
    Show {
        /// Only entries under this directory.
        #[arg(long, value_name = "PATH")]
        root: Option<PathBuf>,
        /// Show an exported profile file instead of the daemon's.
        #[arg(long, value_name = "FILE")]
        file: Option<PathBuf>,
        /// Rows per table.
        #[arg(long, default_value_t = 15)]
        top: usize,
    },
    /// Merge an exported profile into the daemon's (or, as root without a daemon, into
    /// the state directory's).
    Import {
        /// The exported profile.
        file: PathBuf,
    },
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_target(false)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        None => cli.daemon.cache.config().and_then(|cache| {
            daemon::run(daemon::Options {
                watch: cli.daemon.watch,
                state_dir: cli.state_dir,
                socket: cli.socket,
                save_interval: Duration::from_secs(cli.daemon.save_interval.max(1)),
                cache: Some(cache),
            })
        }),
        Some(command) => {
            let ctx = commands::Context {
                socket: cli.socket,
                state_dir: cli.state_dir,
            };
            match command {
                Command::Status { json } => commands::status(&ctx, json),
                Command::Profile(ProfileCommand::Export { root, out }) => {
                    commands::export(&ctx, root, out)
                }
                Command::Profile(ProfileCommand::Show { root, file, top }) => {
                    commands::show(&ctx, root, file, top)
                }
                Command::Profile(ProfileCommand::Import { file }) => commands::import(&ctx, &file),
                Command::Prefetch { profile } => commands::prefetch(&ctx, &profile),
                Command::Run { profile, command } => {
                    let prefetched = match profile {
                        Some(p) => commands::prefetch(&ctx, &p),
                        None => Ok(()),
                    };
                    return match prefetched.and_then(|()| session::run(&ctx.socket, command)) {
                        Ok(code) => code,
                        Err(e) => {
                            eprintln!("hocus-agent: {e:#}");
                            ExitCode::FAILURE
                        }
                    };
                }
                Command::Budget { ssd, ram } => commands::budget(&ctx, ssd, ram),
                Command::Plan {
                    profile,
                    csv,
                    cache,
                } => cache
                    .config()
                    .and_then(|config| plan::run(&profile, &config, csv)),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hocus-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}
