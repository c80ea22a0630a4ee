//! hocus-agent: a root daemon that watches jobs on network filesystems with eBPF, keeps
//! their working-set profile, holds the hot files close (SSD copies, RAM pins) and
//! redirects jobs to them; and the commands that talk to it.
//!
//! The code follows the path a file takes, one folder per stage, each importing only
//! those below it (docs/architecture.md):
//!
//! ```text
//!   cli        the commands people type                    faces
//!   daemon     wires the stages; the keeper decides          |
//!   control    the control socket   report  metrics, logs    v
//!   redirect   namespaces, binds, jobs                      stages
//!   cache      copies, snapshots, pins
//!   place      budgets, placement, plan
//!   observe    eBPF, the kernel's events
//!   profile    the working set and its format
//!   shared     settings, sizes, status, log lines
//! ```

mod cache;
mod cli;
mod control;
mod daemon;
mod observe;
mod place;
mod profile;
mod redirect;
mod report;
mod shared;

fn main() -> std::process::ExitCode {
    cli::main()
}
