//! hocus's SPANK plugin: Slurm loads it into `srun`, `sbatch`, each job's prolog and
//! epilog and every task's `slurmstepd`. In each task's privileged start (before the
//! task becomes its user) it gives the task a mount namespace of its own in which
//! hocus-agent binds its local copies, read-only. In the job's prolog it has the daemon
//! prefetch from the profile the user's last job with the same key saved; in its
//! epilog, save this job's. Users change nothing in how they submit jobs.
//!
//! It never breaks a job: with the daemon down, refusing, slow or failing, the job runs
//! exactly as it would without hocus, and one line in slurmd's log says why.
//!
//! Listed in a plugstack file (`contrib/slurm/plugstack.conf.d/hocus.conf`):
//!
//! ```text
//! optional /usr/lib/hocus/hocus_spank.so [socket=PATH] [timeout=SECONDS]
//!     [prefetch_timeout=SECONDS] [off]
//! ```

mod attach;
mod daemon;
mod profiles;
mod settings;

use std::error::Error;

use slurm_spank::{Context, LogLevel, Plugin, SpankHandle, SpankOption, spank_log};

pub use settings::{Choice, Settings};

// SPANK_PLUGIN!(b"hocus", <the installed Slurm's version>, Hocus), from build.rs.
include!(concat!(env!("OUT_DIR"), "/plugin.rs"));

/// The options users see in `srun --help` and `sbatch --help`.
const OPTION: &str = "hocus";
const PROFILE_OPTION: &str = "hocus-profile";

#[derive(Default)]
struct Hocus {
    settings: Settings,
}

fn log(level: LogLevel, message: &str) {
    spank_log(level, &format!("hocus: {message}"));
}

/// The plugstack line's settings. A mistake there must not stop jobs: it is said, and
/// hocus is off.
fn settings_of(spank: &SpankHandle) -> Settings {
    let args = spank.plugin_argv().unwrap_or_default();
    Settings::parse(&args).unwrap_or_else(|e| {
        log(LogLevel::Error, &format!("{e}; hocus is off on this node"));
        Settings::off()
    })
}

/// Whose job this is, as Slurm says; `None` (logged) if it does not say.
fn job_of(spank: &SpankHandle) -> Option<attach::Job> {
    let job = attach::Job {
        uid: spank.job_uid().ok()?,
        gid: spank.job_gid().ok()?,
        groups: spank.job_supplementary_gids().unwrap_or_default(),
        job_id: spank.job_id().ok(),
    };
    Some(job)
}

impl Hocus {
    /// Whether hocus is on for this job: on the node (plugstack), and by the user's
    /// `--hocus` (read here too: a prolog or epilog reads options, it processes none).
    fn wanted(&self, spank: &SpankHandle) -> bool {
        let value = spank.get_option_value(OPTION).ok().flatten();
        self.settings.enabled && Choice::parse(value.as_deref()) == Ok(Choice::On)
    }

    /// The job's profile, for the prolog's prefetch or the epilog's save. Slurm calls
    /// no `init` before a prolog or epilog: the plugstack line is read here.
    fn profile(&mut self, spank: &SpankHandle, what: &str, act: ProfileAct) {
        self.settings = settings_of(spank);
        if !self.wanted(spank) {
            return;
        }
        let (Some(job), Ok(job_id)) = (job_of(spank), spank.job_id()) else {
            log(
                LogLevel::Info,
                &format!("no {what}: Slurm did not say whose job this is"),
            );
            return;
        };
        let option = spank.get_option_value(PROFILE_OPTION).ok().flatten();
        let key = match profiles::key(option.as_deref(), job_id) {
            Ok(k) => k,
            Err(e) => return log(LogLevel::Info, &format!("no {what}: {e}")),
        };
        match act(&self.settings, &job, job_id, &key) {
            Ok(said) => log(LogLevel::Info, &format!("job {job_id}: {said}")),
            Err(e) => log(LogLevel::Info, &format!("job {job_id}: no {what}: {e}")),
        }
    }
}

type ProfileAct = fn(&Settings, &attach::Job, u32, &str) -> Result<String, String>;

// SAFETY (the trait's contract): Slurm calls a plugin's callbacks one at a time.
unsafe impl Plugin for Hocus {
    /// Nothing to set up: the default would install a global `tracing` subscriber,
    /// which another Rust plugin in the same process may already have done.
    fn setup(&self, _spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        Ok(())
    }

    fn init(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        self.settings = settings_of(spank);
        if matches!(
            spank.context()?,
            Context::Local | Context::Remote | Context::Allocator
        ) {
            spank.register_option(SpankOption::new(OPTION).takes_value("on|off").usage(
                "hocus local copies of network files for this job's tasks (default on; \
                 off: every task reads the network filesystems directly)",
            ))?;
            spank.register_option(SpankOption::new(PROFILE_OPTION).takes_value("KEY").usage(
                "the key under which hocus keeps this job's profile: the next job \
                     with the same key has it prefetched before it starts (default: \
                     the job's name)",
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

    /// Before the job's first task: prefetch from the profile kept under its key.
    fn job_prolog(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        self.profile(spank, "prefetch", profiles::prefetch);
        Ok(())
    }

    /// After its last task: keep what the job used under its key.
    fn job_epilog(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        self.profile(spank, "profile saved", profiles::save);
        Ok(())
    }

    /// The task, still root and not yet its user's: a namespace of its own, hocus's
    /// binds in it. Every failure is logged and swallowed.
    fn task_init_privileged(&mut self, spank: &mut SpankHandle) -> Result<(), Box<dyn Error>> {
        if !self.settings.enabled {
            return Ok(());
        }
        let Some(job) = job_of(spank) else {
            log(
                LogLevel::Error,
                "Slurm did not say whose job this is; running it without hocus",
            );
            return Ok(());
        };
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
