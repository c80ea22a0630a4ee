//! Face **cli**: the commands people type, one file each. The daemon itself starts from
//! here too (no subcommand). Each command asks the running daemon over the control
//! socket, or, where that makes sense as root, reads the state directory directly.
//!
//! May use: everything below it.

mod budget;
mod context;
mod floor;
mod generate;
mod plan;
mod prefetch;
mod profile;
mod run;
mod status;

use std::{path::PathBuf, process::ExitCode};

use clap::{CommandFactory, Parser, Subcommand};

use self::context::Context;
use crate::{
    daemon,
    place::budget::Budgets,
    report::logs,
    shared::{settings::Settings, size::Size},
};

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
  hocus-agent status                          what the daemon holds, and whether it helps
  hocus-agent profile show                    the hottest files and trees, at a glance
  hocus-agent profile export --out job.json   save the profile for the next job or node
  sudo hocus-agent profile import job.json    merge a profile exported elsewhere
  hocus-agent run -- python train.py          run a job on the local copies
  hocus-agent --check-config                  validate /etc/hocus/agent.toml and print it

The daemon's settings come from its flags, then the config file (every flag has a key
of the same name: ssd-budget = \"50G\"), then the defaults. SIGHUP reloads the file.
Metrics: http://127.0.0.1:9742/metrics (docs/metrics.md).")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    #[command(flatten)]
    daemon: Settings,

    /// The config file [default: /etc/hocus/agent.toml, if it exists].
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,

    /// Validate the configuration (file and flags), print the effective one, and exit.
    #[arg(long)]
    check_config: bool,
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
    /// nothing. Uses the daemon's settings (config file), changed by the flags below.
    Plan {
        /// The exported profile.
        #[arg(long, value_name = "FILE")]
        profile: PathBuf,
        /// Print CSV (one line per file) instead of a table.
        #[arg(long)]
        csv: bool,
        #[command(flatten)]
        cache: plan::PlanCache,
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
        ssd: Option<Size>,
        /// New RAM budget (e.g. 2G or 5%).
        #[arg(long, value_name = "SIZE|PCT")]
        ram: Option<Size>,
    },
    /// What the daemon watches, what it has seen, and whatever it could not deliver.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Attach a program that returns at once where hocus's programs go, print "ready",
    /// and stay until killed: what tracing costs the node before any work is done
    /// (`cargo xtask bench overhead`). Root.
    #[command(hide = true)]
    TraceFloor,
    /// Write the man pages or a shell's completions of hocus-agent into a directory
    /// (what the package installs).
    #[command(hide = true)]
    Generate {
        #[command(subcommand)]
        what: GenerateCommand,
    },
}

#[derive(Subcommand, Debug)]
enum GenerateCommand {
    /// hocus-agent.1 and a page per command.
    Man {
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
    /// The completion script for a shell.
    Completions {
        shell: clap_complete::Shell,
        #[arg(value_name = "DIR")]
        dir: PathBuf,
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

/// Parses the command line and runs the command (or the daemon).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = Settings::config_path(cli.config.as_deref());
    // The daemon and `plan` need the whole configuration; other commands only the socket
    // and state directory, and do without a config file they cannot read.
    let daemon_like = cli.command.is_none()
        || cli.check_config
        || matches!(cli.command, Some(Command::Plan { .. }));
    let settings = match Settings::effective(&cli.daemon, config.as_deref()) {
        Ok(s) => s,
        Err(e) if daemon_like || cli.config.is_some() => {
            eprintln!("hocus-agent: {e:#}");
            return ExitCode::from(2);
        }
        Err(_) => cli.daemon.clone().or(Settings::defaults()),
    };
    settings.apply_logging();
    logs::init();
    let result = if cli.check_config {
        Budgets::of(&settings)
            .and_then(|b| settings.describe(config.as_deref(), b.ssd))
            .map(|text| print!("{text}"))
    } else {
        match cli.command {
            None => daemon::run(daemon::Options {
                settings,
                flags: cli.daemon,
                config,
            }),
            Some(command) => {
                let ctx = Context {
                    socket: settings.socket(),
                    state_dir: settings.state_dir(),
                };
                match command {
                    Command::Status { json } => status::run(&ctx, json),
                    Command::Profile(ProfileCommand::Export { root, out }) => {
                        profile::export(&ctx, root, out)
                    }
                    Command::Profile(ProfileCommand::Show { root, file, top }) => {
                        profile::show(&ctx, root, file, top)
                    }
                    Command::Profile(ProfileCommand::Import { file }) => {
                        profile::import(&ctx, &file)
                    }
                    Command::Prefetch { profile } => prefetch::run(&ctx, &profile),
                    Command::Run { profile, command } => {
                        return match run::run(&ctx, profile.as_deref(), command) {
                            Ok(code) => code,
                            Err(e) => {
                                eprintln!("hocus-agent: {e:#}");
                                ExitCode::FAILURE
                            }
                        };
                    }
                    Command::Budget { ssd, ram } => budget::run(&ctx, ssd, ram),
                    Command::TraceFloor => floor::run(),
                    Command::Generate { what } => match what {
                        GenerateCommand::Man { dir } => generate::man(Cli::command(), &dir),
                        GenerateCommand::Completions { shell, dir } => {
                            generate::completions(Cli::command(), shell, &dir)
                        }
                    },
                    Command::Plan {
                        profile,
                        csv,
                        cache,
                    } => plan::run(&profile, csv, cache, settings),
                }
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
