//! hocus's SPANK plugin: Slurm loads it into `srun`, `sbatch` and every task's
//! `slurmstepd`, and in each task's privileged start (before the task becomes its user)
//! gives the task a mount namespace of its own in which hocus-agent binds its local
//! copies, read-only. Users change nothing in how they submit jobs.
//!
//! It never breaks a job: with the daemon down, refusing, slow or failing, the task runs
//! exactly as it would without hocus, and one line in the job's log says why.
//!
//! Listed in a plugstack file (`contrib/slurm/plugstack.conf.d/hocus.conf`):
//!
//! ```text
//! optional /usr/lib/hocus/hocus_spank.so [socket=PATH] [timeout=SECONDS] [off]
//! ```

mod attach;
mod settings;

use std::error::Error;

use slurm_spank::{Context, LogLevel, Plugin, SpankHandle, SpankOption, spank_log};

pub use settings::{Choice, Settings};

// SPANK_PLUGIN!(b"hocus", <the installed Slurm's version>, Hocus), from build.rs.
include!(concat!(env!("OUT_DIR"), "/plugin.rs"));

/// The `--hocus` option users see in `srun --help` and `sbatch --help`.
const OPTION: &str = "hocus";

#[derive(Default)]
struct Hocus {
    settings: Settings,
}

fn log(level: LogLevel, message: &str) {
    spank_log(level, &format!("hocus: {message}"));
}

// SAFETY (the trait's contract): Slurm calls a plugin's callbacks one at a time.
unsafe impl Plugin for Hocus {
    /// Nothing to set up: the default would install a global `tracing` subscriber,
    /// which another Rust plugin in the same process may already have done.
    fn setup(&self, _spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        Ok(())
    }

    fn init(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        let args = spank.plugin_argv().unwrap_or_default();
        match Settings::parse(&args) {
            Ok(s) => self.settings = s,
            // A mistake in plugstack.conf must not stop jobs: say it, run without hocus.
            Err(e) => {
                log(LogLevel::Error, &format!("{e}; hocus is off on this node"));
                self.settings = Settings::off();
            }
        }
        if matches!(
            spank.context()?,
            Context::Local | Context::Remote | Context::Allocator
        ) {
            spank.register_option(SpankOption::new(OPTION).takes_value("on|off").usage(
                "hocus local copies of network files for this job's tasks (default on; \
                     off: every task reads the network filesystems directly)",
            ))?;
        }
        Ok(())
    }

    /// A value other than on or off is the user's mistake: `srun`/`sbatch` say so on
    /// the user's terminal (an optional plugin cannot stop them), and the job runs
    /// without hocus, which never breaks it.
    fn init_post_opt(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        let value = spank.get_option_value(OPTION).ok().flatten();
        match Choice::parse(value.as_deref()) {
            Ok(Choice::On) => {}
            Ok(Choice::Off) => self.settings.enabled = false,
            Err(e) => {
                log(
                    LogLevel::Error,
                    &format!("{e}; this job runs without hocus"),
                );
                self.settings.enabled = false;
            }
        }
        Ok(())
    }

    /// The task, still root and not yet its user's: a namespace of its own, hocus's
    /// binds in it. Every failure is logged and swallowed.
    fn task_init_privileged(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        if !self.settings.enabled {
            return Ok(());
        }
        let job = attach::Job {
            uid: spank.job_uid().unwrap_or(u32::MAX),
            gid: spank.job_gid().unwrap_or(u32::MAX),
            groups: spank.job_supplementary_gids().unwrap_or_default(),
            job_id: spank.job_id().ok(),
        };
        if job.uid == u32::MAX || job.gid == u32::MAX {
            log(
                LogLevel::Error,
                "Slurm did not say whose job this is; running it without hocus",
            );
            return Ok(());
        }
        match attach::attach(&self.settings, &job) {
            Ok(binds) => log(
                LogLevel::Verbose,
                &format!("{binds} local copies in place for this task"),
            ),
            Err(e) => log(
                LogLevel::Info,
                &format!("running without local copies: {e}"),
            ),
        }
        Ok(())
    }
}
