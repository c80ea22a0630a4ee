//! `cargo xtask`: set up a machine, build, run and test hocus.

mod agent;
mod bench;
mod host;
#[cfg(test)]
mod layout;
mod package;
mod setup;
mod suites;
mod vm;
mod whole_run;

use agent::build;
use host::as_root;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "hocus developer workflows")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what this machine lacks to build and test hocus (Debian packages,
    /// bpf-linker, the `bpf` rustup toolchain). Idempotent; needs root.
    Setup,
    /// Build hocus-agent (with its eBPF programs embedded).
    Build {
        #[arg(long)]
        release: bool,
    },
    /// Build and run hocus-agent as root, e.g. `cargo xtask run -- --watch /home`: the
    /// release build, the binary the package ships.
    Run {
        /// Run the debug build instead.
        #[arg(long)]
        debug: bool,
        /// Arguments for hocus-agent.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Build and run the unit tests and the root integration tests (real eBPF, a real
    /// sshfs mount over loopback).
    Test {
        /// Only integration tests whose name contains this.
        filter: Option<String>,
    },
    /// Build the Debian package (target/package/hocus_VERSION_amd64.deb): the daemon,
    /// its systemd unit (not enabled), /etc/hocus/agent.toml, the Slurm plugin and its
    /// plugstack snippet, man pages, shell completions, the docs.
    Package,
    /// Benchmarks that print ratios against a baseline measured in the same run.
    #[command(subcommand)]
    Bench(Bench),
    /// The kernel rig: Debian's stock kernels (5.10, 6.1, 6.12) booted under QEMU with
    /// this machine's root filesystem, running hocus, a command or the integration
    /// tests there (also against kernel NFS, which this kernel lacks).
    #[command(subcommand)]
    Vm(vm::Vm),
    /// `bench overhead`'s loop in a process of its own: prints seconds per iteration.
    #[command(hide = true)]
    SyscallLoop {
        dir: PathBuf,
        iterations: usize,
        /// Run a few iterations here first (a watched tree: the process is a user of it).
        #[arg(long)]
        touch: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum Bench {
    /// Epochs over a dataset twice the RAM budget on a real network mount: plain reads
    /// against reads through hocus's copies and pins, page cache emptied every epoch.
    Dataset {
        #[arg(long, default_value_t = 64)]
        files: usize,
        /// Size of each file.
        #[arg(long, default_value_t = 4)]
        file_mib: usize,
        #[arg(long, default_value_t = 4)]
        epochs: usize,
        /// Round trip between the client and the server of the network mount, in ms
        /// (1: a cluster's link; 0: bare loopback).
        #[arg(long, default_value_t = 1.0)]
        round_trip_ms: f64,
        /// A smoke run (CI): 8 files of 1 MiB, two epochs.
        #[arg(long)]
        quick: bool,
    },
    /// `import numpy, scipy, pandas` from a network mount with the page cache emptied
    /// every second: local disk, plain, warm and under `hocus-agent run`.
    Imports {
        #[command(flatten)]
        runs: Runs,
        /// Only this program (repeatable; default: every one).
        #[arg(long, value_enum)]
        only: Vec<bench::ImportCase>,
    },
    /// `import numpy, scipy, pandas` as an ordinary user's srun job on a real one-node
    /// Slurm cluster, page cache emptied every second: from local disk, from the
    /// network with --hocus=off, and with hocus's SPANK plugin (nothing added).
    Slurm(Runs),
    /// A Slurm job on 1, 2, ... nodes of a real multi-node cluster with a saved
    /// profile: the file server's bytes and the time to warm every node's cache, each
    /// node reading the server (direct) against the nodes sharing (the relay), the
    /// server's link rate-limited.
    Fanout {
        /// Nodes of the cluster (jobs on 1 ..= this many).
        #[arg(long, default_value_t = 4)]
        nodes: usize,
        /// MiB of the working set (4 MiB files, and 64 small ones).
        #[arg(long, default_value_t = 128)]
        mib: usize,
        /// The file server's link, in Mbit/s.
        #[arg(long, default_value_t = 200)]
        server_mbit: u32,
        /// Each node's link, in Mbit/s.
        #[arg(long, default_value_t = 1000)]
        node_mbit: u32,
        /// A smoke run (CI): three nodes, 8 MiB.
        #[arg(long)]
        quick: bool,
    },
    /// What the file server is asked, by its own count, when a Slurm job imports a
    /// package of many modules on 1, 2, 4, ... nodes: plainly, and with every node's
    /// daemon warm from a saved profile; then what the warm daemons ask with no job
    /// running; and a model of 1,024 nodes fitted to the rows.
    Server {
        /// The node counts of the jobs (the cluster has the largest).
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
        nodes: Vec<usize>,
        /// Subpackages of the package imported.
        #[arg(long, default_value_t = 50)]
        subpackages: usize,
        /// Modules in each subpackage (50 x 40: 2,051 modules in all).
        #[arg(long, default_value_t = 40)]
        modules: usize,
        /// Seconds the warm daemons are watched with no job running.
        #[arg(long, default_value_t = 60)]
        idle_secs: u64,
        /// A smoke run (CI): one and three nodes, 4 x 8 modules, 10 s idle.
        #[arg(long)]
        quick: bool,
    },
    /// What hocus costs processes: a loop of open / read / close / failed stat on an
    /// unwatched local directory (in a process that never touches a watched tree, and in
    /// one that does) and on a watched network mount, with nothing attached, with empty
    /// programs on the same tracepoints (the floor), and with the daemon; then real
    /// programs (git status, du, find, tar) on unwatched data, with no daemon and with
    /// it in both modes (a FUSE mount; a local directory, every process followed).
    Overhead {
        /// Rounds of each condition of the loops, interleaved (the median is shown); 0
        /// leaves the loops out.
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Loop iterations per round on the unwatched directory.
        #[arg(long, default_value_t = 300_000)]
        iterations: usize,
        /// Loop iterations per round on the watched mount (each waits on the network).
        #[arg(long, default_value_t = 1_000)]
        watched_iterations: usize,
        /// Round trip between the client and the server of the network mount, in ms.
        #[arg(long, default_value_t = 1.0)]
        round_trip_ms: f64,
        /// A smoke run (CI): one short round.
        #[arg(long)]
        quick: bool,
        /// Rounds of the real programs' case (git status, du, find, tar on unwatched
        /// data, with no daemon and with it in both modes); 0 leaves it out.
        #[arg(long, default_value_t = 7)]
        program_rounds: usize,
        /// Another build of hocus-agent to measure as well (e.g. the previous release).
        #[arg(long, value_name = "BINARY")]
        compare_with: Option<PathBuf>,
    },
    /// A site-wide profile imported into a running daemon: import time, the daemon's
    /// memory above its empty size, status and export times, CPU while idle.
    Scale {
        /// Files in the synthetic profile (and a fifth as many missing names).
        #[arg(long, default_value_t = 1_000_000)]
        files: usize,
        /// Seconds to watch the idle daemon's CPU: longer than its revalidation interval
        /// (30 s), whose periodic work is part of what idle costs.
        #[arg(long, default_value_t = 35)]
        idle_secs: u64,
        /// A smoke run (CI): 20,000 files.
        #[arg(long)]
        quick: bool,
    },
    /// Threads opening a file and failing lookups on a watched tmpfs as fast as they
    /// can: events the daemon handles per second, and whether what it lost is exactly
    /// what the ring buffer dropped.
    Events {
        #[arg(long, default_value_t = 2)]
        threads: usize,
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// A smoke run (CI): one second.
        #[arg(long)]
        quick: bool,
    },
    /// A job reading scattered 1 MiB chunks of a big file on a real network mount: what
    /// it read, what its profile's byte ranges hold, what the cache holds after it, and
    /// its time from the network and from a local disk.
    Ranges {
        /// The file's size.
        #[arg(long, default_value_t = 1024)]
        file_mib: usize,
        /// Chunks of 1 MiB the job reads.
        #[arg(long, default_value_t = 64)]
        chunks: usize,
        /// The size of the file a `numpy.memmap` job reads the same chunks of.
        #[arg(long, default_value_t = 4096)]
        memmap_mib: usize,
        #[arg(long, default_value_t = 1.0)]
        round_trip_ms: f64,
        /// Runs of the job again from the cache and from a local disk (their medians).
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// A smoke run (CI): 8 chunks of a 64 MiB file.
        #[arg(long)]
        quick: bool,
    },
    /// Every benchmark above, one after the other, with their defaults (or, with
    /// --quick, their smoke runs: what CI runs so that none of them rots).
    All {
        #[arg(long)]
        quick: bool,
    },
}

fn main() {
    // `cargo install` puts bpf-linker in ~/.cargo/bin, which the eBPF build must find.
    if let Some(home) = std::env::var_os("HOME") {
        let bin = Path::new(&home).join(".cargo/bin");
        let path = std::env::var_os("PATH").unwrap_or_default();
        let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
        if !dirs.contains(&bin) {
            dirs.push(bin);
            let joined = std::env::join_paths(dirs).expect("PATH entries are valid");
            // SAFETY: single-threaded at this point.
            unsafe { std::env::set_var("PATH", joined) };
        }
    }
    if let Err(e) = run(Cli::parse()) {
        eprintln!("xtask: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Cmd::Setup => setup::run(),
        Cmd::Build { release } => build(release).map(drop),
        Cmd::Run { debug, args } => {
            let agent = build(!debug)?;
            let mut cmd = as_root(&agent);
            cmd.args(&args);
            // exec, so that Ctrl-C and the exit status are the agent's own
            let err = std::os::unix::process::CommandExt::exec(&mut cmd);
            Err(err).context("starting hocus-agent")
        }
        Cmd::Test { filter } => {
            whole_run::test(filter, |agent| bench(agent, Bench::All { quick: true }))
        }
        Cmd::Vm(v) => vm::run(v),
        Cmd::Package => {
            let agent = build(true)?;
            package::build(&agent).map(drop)
        }
        Cmd::Bench(b) => {
            let agent = build(true)?;
            bench(&agent, b)
        }
        Cmd::SyscallLoop {
            dir,
            iterations,
            touch,
        } => bench::syscall_loop_process(&dir, iterations, touch.as_deref()),
    }
}

/// Runs one benchmark (or all) against the hocus-agent binary `agent`.
fn bench(agent: &Path, b: Bench) -> Result<()> {
    match b {
        Bench::Dataset {
            files,
            file_mib,
            epochs,
            round_trip_ms,
            quick,
        } => {
            let d = if quick {
                bench::Dataset::quick()
            } else {
                bench::Dataset {
                    files: files.max(2),
                    file_mib: file_mib.max(1),
                    epochs: epochs.max(2),
                    round_trip: millis(round_trip_ms),
                }
            };
            bench::dataset(agent, &d)
        }
        Bench::Imports { runs: r, only } => {
            bench::imports(agent, r.runs(), millis(r.round_trip_ms), &only, r.quick)
        }
        Bench::Slurm(r) => bench::slurm_imports(agent, r.runs(), millis(r.round_trip_ms)),
        Bench::Overhead {
            rounds,
            iterations,
            watched_iterations,
            round_trip_ms,
            quick,
            program_rounds,
            compare_with,
        } => {
            let round_trip = millis(round_trip_ms);
            let o = if quick {
                bench::Overhead::quick(round_trip)
            } else {
                bench::Overhead {
                    rounds,
                    local_iterations: iterations.max(10),
                    watched_iterations: watched_iterations.max(10),
                    round_trip,
                    compare_with,
                    program_rounds,
                }
            };
            bench::overhead(agent, &o)
        }
        Bench::Events {
            threads,
            seconds,
            quick,
        } => {
            let e = if quick {
                bench::Events::quick()
            } else {
                bench::Events {
                    threads: threads.max(1),
                    duration: std::time::Duration::from_secs_f64(seconds.max(0.1)),
                }
            };
            bench::events(agent, &e)
        }
        Bench::Scale {
            files,
            idle_secs,
            quick,
        } => {
            let s = if quick {
                bench::Scale::quick()
            } else {
                bench::Scale {
                    files: files.max(10),
                    idle: std::time::Duration::from_secs(idle_secs.max(1)),
                    poll_at_least: std::time::Duration::from_secs(35),
                }
            };
            bench::scale(agent, &s)
        }
        Bench::Fanout {
            nodes,
            mib,
            server_mbit,
            node_mbit,
            quick,
        } => {
            let f = if quick {
                bench::Fanout::quick()
            } else {
                bench::Fanout {
                    nodes: nodes.max(2),
                    mib: mib.max(4),
                    server_mbit: server_mbit.max(1),
                    node_mbit: node_mbit.max(1),
                }
            };
            bench::fanout(agent, &f)
        }
        Bench::Server {
            nodes,
            subpackages,
            modules,
            idle_secs,
            quick,
        } => {
            let s = if quick {
                bench::Server::quick()
            } else {
                let nodes: Vec<usize> = nodes.into_iter().filter(|&n| n > 0).collect();
                if nodes.is_empty() {
                    bail!("--nodes takes node counts of 1 or more, e.g. 1,2,4,8,16");
                }
                bench::Server {
                    nodes,
                    subpackages: subpackages.max(1),
                    modules: modules.max(1),
                    idle: std::time::Duration::from_secs(idle_secs.max(1)),
                }
            };
            bench::server(agent, &s)
        }
        Bench::Ranges {
            file_mib,
            chunks,
            memmap_mib,
            round_trip_ms,
            runs,
            quick,
        } => {
            let r = if quick {
                bench::Ranges::quick()
            } else {
                bench::Ranges {
                    file_mib: file_mib.max(2),
                    memmap_mib: memmap_mib.max(2),
                    chunks: chunks.max(1),
                    round_trip: millis(round_trip_ms),
                    runs: runs.max(1),
                }
            };
            bench::ranges(agent, &r)
        }
        Bench::All { quick } => {
            // Each with the defaults its command line has (or its smoke run).
            for name in BENCHMARKS {
                println!("\n== bench {name}");
                if name == "fanout" || name == "server" {
                    // A cluster of its own kind (many nodes): a process of its own, as
                    // a test binary has one cluster.
                    let mut cmd = Command::new(std::env::current_exe()?);
                    cmd.args(["bench", name]);
                    if quick {
                        cmd.arg("--quick");
                    }
                    let status = cmd.status()?;
                    if !status.success() {
                        bail!("bench {name} failed ({status})");
                    }
                    continue;
                }
                bench(agent, parsed(name, quick)?)?;
            }
            Ok(())
        }
    }
}

/// What `bench all` runs, in this order.
const BENCHMARKS: [&str; 9] = [
    "dataset", "imports", "overhead", "events", "scale", "slurm", "fanout", "server", "ranges",
];

/// The benchmark `name` with the defaults of its command line, or its smoke run.
fn parsed(name: &str, quick: bool) -> Result<Bench> {
    let quick = quick.then_some("--quick");
    let cli = Cli::try_parse_from(["cargo xtask", "bench", name].into_iter().chain(quick))?;
    match cli.command {
        Cmd::Bench(b) => Ok(b),
        _ => bail!("{name} is not a benchmark"),
    }
}

/// How the import benchmarks run.
#[derive(clap::Args, Debug)]
struct Runs {
    /// Runs of each (the median is shown).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Round trip between the client and the server of the network mount, in ms
    /// (1: a cluster's link; 0: bare loopback).
    #[arg(long, default_value_t = 1.0)]
    round_trip_ms: f64,
    /// A smoke run (CI): one run of each, without the runs that are only there to
    /// compare (imports: the whole tree's copy, the warm network).
    #[arg(long)]
    quick: bool,
}

impl Runs {
    fn runs(&self) -> usize {
        if self.quick { 1 } else { self.runs.max(1) }
    }
}

fn millis(ms: f64) -> std::time::Duration {
    std::time::Duration::from_secs_f64(ms.max(0.0) / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_all_runs_every_benchmark_with_its_command_line_defaults() {
        for name in BENCHMARKS {
            assert!(matches!(parsed(name, true), Ok(b) if !matches!(b, Bench::All { .. })));
        }
        let Ok(Bench::Dataset { files, quick, .. }) = parsed("dataset", false) else {
            panic!("dataset parses");
        };
        assert_eq!((files, quick), (64, false));
        assert!(parsed("nonsense", true).is_err());
    }
}
