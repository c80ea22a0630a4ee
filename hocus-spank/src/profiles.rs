//! A job's own profile, kept under a key for the user's next job: the prolog asks the
//! daemon to prefetch from the profile the last job with the key saved (waiting at most
//! `prefetch_timeout`: the job starts anyway), the epilog asks it to save this job's.
//! The key is `--hocus-profile=KEY`, else the job's name.

use std::{process::Command, time::Duration};

use hocus_control::{JobProfile, Request, Response, status::Progress};

use crate::{attach::Job, daemon::Daemon, settings::Settings};

/// How long the job name may take to look up, when Slurm does not give it.
const NAME_LOOKUP: Duration = Duration::from_secs(5);

/// The key: `option` (`--hocus-profile`), else the job's name (from the environment,
/// else from `squeue`).
pub fn key(option: Option<&str>, job_id: u32) -> Result<String, String> {
    if let Some(k) = option.filter(|k| !k.is_empty()) {
        return Ok(k.to_owned());
    }
    if let Some(name) = std::env::var("SLURM_JOB_NAME")
        .ok()
        .filter(|n| !n.is_empty())
    {
        return Ok(name);
    }
    let mut child = Command::new("squeue")
        .args(["--noheader", "--format=%j", "--jobs"])
        .arg(job_id.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run squeue for the job's name: {e}"))?;
    let started = std::time::Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if started.elapsed() < NAME_LOOKUP => {
                std::thread::sleep(Duration::from_millis(20));
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err("squeue did not give the job's name in time".into());
            }
        }
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("squeue: {e}"))?;
    let name = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if name.is_empty() {
        return Err("squeue did not know the job's name".into());
    }
    Ok(name)
}

/// The job's profile as the daemon keeps it; a prolog's names the job's nodes and this
/// one (from the prolog's environment), so that they share the job's files
/// (docs/fanout.md).
fn job_profile(job: &Job, job_id: u32, key: &str) -> JobProfile {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    JobProfile {
        job_id,
        uid: job.uid,
        gid: job.gid,
        groups: job.groups.clone(),
        key: key.to_owned(),
        nodes: env("SLURM_JOB_NODELIST").or_else(|| env("SLURM_NODELIST")),
        node: env("SLURMD_NODENAME"),
    }
}

/// Prefetches from the profile saved under `key`, until done or `prefetch_timeout`;
/// returns what to log.
pub fn prefetch(settings: &Settings, job: &Job, job_id: u32, key: &str) -> Result<String, String> {
    let mut daemon = Daemon::connect(&settings.socket, settings.prefetch_timeout)?;
    daemon.send(&Request::PrefetchJobProfile(job_profile(job, job_id, key)))?;
    let mut last = None;
    loop {
        match daemon.answer() {
            Ok(Response::Progress(Progress {
                files_done,
                files_total,
                trees_done,
                trees_total,
                finished,
                ..
            })) => {
                let said = format!(
                    "prefetched {files_done} of {files_total} files and {trees_done} of {trees_total} trees from profile {key:?}"
                );
                if finished {
                    return Ok(said);
                }
                last = Some(said);
            }
            Ok(other) => return Err(format!("unexpected answer from hocus-agent: {other:?}")),
            // Out of time: the job starts; the daemon goes on warming its cache.
            Err(e) => {
                return match last {
                    Some(said) => Ok(format!("{said} when the prolog's time was up ({e})")),
                    None => Err(e),
                };
            }
        }
    }
}

/// Saves this job's working set under `key`; returns what to log.
pub fn save(settings: &Settings, job: &Job, job_id: u32, key: &str) -> Result<String, String> {
    let mut daemon = Daemon::connect(&settings.socket, settings.timeout)?;
    daemon.send(&Request::SaveJobProfile(job_profile(job, job_id, key)))?;
    match daemon.answer()? {
        Response::Saved {
            path,
            files,
            missing,
        } => Ok(format!(
            "profile {key:?} saved to {} ({files} files, {missing} missing names)",
            path.display()
        )),
        other => Err(format!("unexpected answer from hocus-agent: {other:?}")),
    }
}
