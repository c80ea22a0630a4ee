//! A Slurm job's own profile, kept where the same user's next job with the same key finds
//! it on any node: `KEY.json` in a directory of the user's (`job-profiles`: by default
//! `~/.cache/hocus/profiles` in their home; an admin may name one on a shared
//! filesystem). The job's epilog saves it, the next job's prolog prefetches from it.
//!
//! Both run as the user: the file is written and opened on a thread that took the user's
//! filesystem identity, so root never follows a path the user controls, and a profile
//! read is checked like any profile a user sends (watched paths only, what they may
//! read). Only root may ask (hocus's SPANK plugin, in the job's prolog and epilog).

use std::{
    ffi::CString,
    fs::{self, File},
    os::{
        fd::OwnedFd,
        unix::{ffi::OsStrExt, fs::DirBuilderExt},
    },
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::Result;
use hocus_control::{JobProfile, Response};
use tokio::sync::mpsc;

use crate::{
    control::{
        calls::{Setup, ask_once, copies_expected, read_to_prefetch},
        messages::{Answer, Ask, Call, JobNodes, Query},
        refusal::Refusal,
    },
    profile::{
        format::{Holder, Profile, ProfileWriter},
        staging::Staging,
    },
    redirect::{
        access::{Caller, ProfileCheck, Taken, as_caller},
        remembered::Expected,
        verdicts,
    },
    shared::{relay, replace},
};

/// Keys name files: letters, digits, `.`, `_`, `-`, not starting with a dot.
const MAX_KEY: usize = 128;

/// Whether `key` may name a profile file.
pub fn check_key(key: &str) -> Result<(), Refusal> {
    let fine = !key.is_empty()
        && key.len() <= MAX_KEY
        && !key.starts_with('.')
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if fine {
        Ok(())
    } else {
        Err(Refusal::new(
            "malformed",
            format!(
                "the profile key {key:?} is not a name: letters, digits, '.', '_', '-' (at most {MAX_KEY}, not starting with '.')"
            ),
        ))
    }
}

/// The user's profile directory: `template` with {home}, {user} and {uid} filled in.
pub fn dir_for(template: &str, uid: u32) -> Result<PathBuf, Refusal> {
    let unknown = |why: String| Refusal::new("unknown_user", why);
    let user = nix::unistd::User::from_uid(uid.into())
        .map_err(|e| unknown(format!("looking up uid {uid}: {e}")))?
        .ok_or_else(|| unknown(format!("uid {uid} has no entry in the user database")))?;
    let dir = template
        .replace("{home}", &user.dir.to_string_lossy())
        .replace("{user}", &user.name)
        .replace("{uid}", &uid.to_string());
    if !dir.starts_with('/') {
        return Err(Refusal::new(
            "settings",
            format!("job-profiles gives {dir:?}, not an absolute path: fix the daemon's settings"),
        ));
    }
    Ok(PathBuf::from(dir))
}

/// The job's user, as the files are written and read: the groups Slurm gave, else
/// those of the user database.
fn user(job: &JobProfile) -> Caller {
    let groups = if job.groups.is_empty() {
        database_groups(job.uid, job.gid)
    } else {
        job.groups.clone()
    };
    Caller {
        pid: 0,
        uid: job.uid,
        gid: job.gid,
        groups,
        pidfd: None,
    }
}

fn database_groups(uid: u32, gid: u32) -> Vec<u32> {
    let name = nix::unistd::User::from_uid(uid.into())
        .ok()
        .flatten()
        .and_then(|u| CString::new(u.name).ok());
    let groups = name.and_then(|n| nix::unistd::getgrouplist(&n, gid.into()).ok());
    groups.map_or_else(
        || vec![gid],
        |g| g.into_iter().map(|g| g.as_raw()).collect(),
    )
}

/// Where `job`'s profile is, checked: the user's directory, and the file in it.
fn place(caller: &Caller, job: &JobProfile, setup: &Setup) -> Result<(PathBuf, PathBuf), Refusal> {
    if !caller.is_root() {
        return Err(Refusal::new(
            "not_root",
            "only root keeps Slurm jobs' profiles (hocus's SPANK plugin does, in a job's prolog and epilog)",
        ));
    }
    check_key(&job.key)?;
    let dir = dir_for(&setup.job_profiles, job.uid)?;
    let file = dir.join(format!("{}.json", job.key));
    Ok((dir, file))
}

/// The epilog's request: writes the job's own working set to `DIR/KEY.json` as the user
/// (a temporary file renamed over it once whole).
pub fn save(
    caller: &Caller,
    job: &JobProfile,
    calls: &mpsc::Sender<Call>,
    setup: &Setup,
) -> Result<Response, Refusal> {
    let (dir, path) = place(caller, job, setup)?;
    let taken = Ask::TakeJobProfile {
        slurm_job: job.job_id,
    };
    let profile = match ask_once(calls, caller.clone(), taken)? {
        Answer::JobProfile(p) => p,
        Answer::Refused(r) => return Err(r),
        _ => return Err(Refusal::new("stopping", "the daemon is stopping")),
    };
    let (files, missing) = (profile.files.len(), profile.missing.len());
    if files == 0 {
        // An empty profile would only replace a useful one.
        return Err(Refusal::new(
            "nothing_to_save",
            format!(
                "Slurm job {} opened no watched file on this node: nothing saved",
                job.job_id
            ),
        ));
    }
    let holder = hold(caller, job, &profile, calls);
    let written = as_caller(&user(job), {
        let path = path.clone();
        move || write_profile(&dir, &path, &profile, holder.as_ref())
    });
    let failed = |e: String| Refusal::new("write_error", e);
    match written {
        Ok(Ok(())) => {
            log::info!(
                "Slurm job {}: its profile ({files} files, {missing} missing names) saved as uid {} to {}",
                job.job_id,
                job.uid,
                path.display()
            );
            Ok(Response::Saved {
                path,
                files,
                missing,
            })
        }
        Ok(Err(e)) => Err(failed(format!(
            "writing {} as uid {}: {e:#}",
            path.display(),
            job.uid
        ))),
        Err(e) => Err(failed(format!("{e:#}"))),
    }
}

/// This node, as the holder of `profile`'s files the saved profile names, once the relay
/// serves them from here to any node's daemon (docs/fanout.md); None when the relay is
/// off or Slurm did not name the node.
fn hold(
    caller: &Caller,
    job: &JobProfile,
    profile: &Profile,
    calls: &mpsc::Sender<Call>,
) -> Option<Holder> {
    let me = job.node.clone()?;
    let held = Ask::RelayHeld {
        job_id: job.job_id,
        me: me.clone(),
        files: profile.files.iter().map(|f| f.path.clone()).collect(),
    };
    match ask_once(calls, caller.clone(), held) {
        Ok(Answer::Ready) => Some(Holder {
            node: me,
            job: job.job_id,
        }),
        _ => None,
    }
}

/// Writes `profile` to `path` in `dir` (made if missing, 0700), replacing it only once
/// whole (`shared::replace::replace_with`), naming the node holding its files. Runs as
/// the user.
fn write_profile(
    dir: &Path,
    path: &Path,
    profile: &Profile,
    holder: Option<&Holder>,
) -> Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    replace::replace_with(path, |out| {
        let mut w = ProfileWriter::new(out);
        w.part(profile)?;
        w.finish_held(holder)?;
        Ok(())
    })
}

/// The prolog's request: opens `DIR/KEY.json` as the user and checks it as a profile
/// the user sent; the prefetch to ask the daemon's loop for, as the job's user. A job
/// on several nodes is made known to the relay first: its children may then ask this
/// node for its verdicts of what the user may read as it finds them, and this node asks
/// its own parent for them (`redirect::verdicts`).
pub fn prefetch(
    caller: &Caller,
    job: &JobProfile,
    calls: &mpsc::Sender<Call>,
    setup: &Setup,
) -> Result<(Caller, Ask), Refusal> {
    let (_, path) = place(caller, job, setup)?;
    let user = user(job);
    let opened = as_caller(&user, {
        let path = path.clone();
        move || open_profile(&path)
    });
    let fd = match opened {
        Ok(Ok(fd)) => fd,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Refusal::new(
                "no_profile",
                format!("no profile at {} yet", path.display()),
            ));
        }
        Ok(Err(e)) => {
            return Err(Refusal::new(
                "read_error",
                format!("opening {} as uid {}: {e}", path.display(), job.uid),
            ));
        }
        Err(e) => return Err(Refusal::new("read_error", format!("{e:#}"))),
    };
    let relay = job_nodes(job);
    // What this node gives its children in the job's tree must be found now: it takes
    // the user's verdicts found before only where it has none (a job of one node, a
    // leaf of the tree).
    let leaf = relay.as_ref().is_none_or(|nodes| {
        let me = nodes.nodes.iter().position(|n| *n == nodes.me).unwrap_or(0);
        me * setup.fanout_width + 1 >= nodes.nodes.len()
    });
    let expected = Arc::new(copies_expected(caller, calls));
    let read = match &relay {
        Some(nodes) => read_across(fd, setup, &user, nodes, calls, caller, (expected, leaf)),
        None => {
            let check = ProfileCheck {
                job_id: Some(job.job_id),
                parent: None,
                expected,
                recall: true,
            };
            read_to_prefetch(fd, setup, &user, &check).map(|(staged, taken)| (staged, taken, None))
        }
    };
    let (staged, taken, parent) =
        read.map_err(|r| Refusal::new(r.reason, format!("{}: {}", path.display(), r.message)))?;
    let mut from = Vec::new();
    if let Some(parent) = parent {
        from.push(format!("{} entries as node {parent} found", taken.parent));
    }
    if taken.remembered > 0 {
        from.push(format!(
            "{} as this node found for its earlier jobs, their copies unchanged",
            taken.remembered
        ));
    }
    let from_parent = match from.is_empty() {
        true => String::new(),
        false => format!(
            "; what uid {} may read: {}, the rest checked here",
            job.uid,
            from.join(", ")
        ),
    };
    log::info!(
        "Slurm job {}: prefetching from {} ({} files, {} missing names{from_parent})",
        job.job_id,
        path.display(),
        staged.files,
        staged.missing
    );
    let query = Query::Prefetch {
        staged: Box::new(staged),
        relay,
        node: job.node.clone(),
    };
    Ok((user, Ask::Client(query)))
}

/// A job's profile on one of its several `nodes`, read and checked as its `user`: made
/// known to the relay first, its children may ask this node for its verdicts as it finds
/// them, and this node asks its own parent for them; with how many it took from which
/// parent. A read that fails leaves the job unknown to the relay here.
fn read_across(
    fd: OwnedFd,
    setup: &Setup,
    user: &Caller,
    nodes: &JobNodes,
    calls: &mpsc::Sender<Call>,
    root: &Caller,
    (expected, recall): (Arc<Expected>, bool),
) -> Result<(Staging, Taken, Option<String>), Refusal> {
    let job_id = nodes.job_id;
    verdicts::begin(job_id, verdicts::job_user(user.uid, user.gid, &user.groups));
    let parent = match ask_once(calls, root.clone(), Ask::RelayJob(nodes.clone())) {
        Ok(Answer::Parent(parent)) => parent,
        _ => None,
    };
    let check = ProfileCheck {
        job_id: Some(job_id),
        parent: parent.clone(),
        expected,
        recall,
    };
    let read = read_to_prefetch(fd, setup, user, &check);
    verdicts::end(job_id);
    match read {
        Ok((staged, taken)) => Ok((staged, taken, parent.map(|p| p.name.clone()))),
        Err(r) => {
            let _ = ask_once(calls, root.clone(), Ask::RelayForget(job_id));
            Err(r)
        }
    }
}

/// The job's nodes, if it has several and this one is among them: they share the
/// working set (docs/fanout.md). A list that cannot be read only means no sharing.
fn job_nodes(job: &JobProfile) -> Option<JobNodes> {
    let (list, me) = (job.nodes.as_deref()?, job.node.clone()?);
    let nodes = match relay::expand(list) {
        Ok(n) => n,
        Err(e) => {
            log::warn!(
                "Slurm job {}: {e}; its nodes do not share its files",
                job.job_id
            );
            return None;
        }
    };
    (nodes.len() > 1 && nodes.contains(&me)).then_some(JobNodes {
        job_id: job.job_id,
        nodes,
        me,
    })
}

/// Opens a profile file without following a symlink at its name (as the user).
fn open_profile(path: &Path) -> std::io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: valid C string; the descriptor is owned on success. O_NONBLOCK: a FIFO
    // put there does not hang the open (read_profile refuses anything but a file).
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: just opened, owned by nobody else.
    Ok(OwnedFd::from(unsafe {
        <File as std::os::fd::FromRawFd>::from_raw_fd(fd)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_plain_file_names() {
        for good in ["train", "resnet-50_v2.1", "A"] {
            assert!(check_key(good).is_ok(), "{good}");
        }
        for bad in ["", ".hidden", "../x", "a/b", "a b", "x\0", &"k".repeat(200)] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_directory_template_names_the_users_home() {
        let dir = dir_for("{home}/.cache/hocus/profiles", 0).unwrap();
        assert_eq!(dir, PathBuf::from("/root/.cache/hocus/profiles"));
        assert_eq!(
            dir_for("/shared/hocus/{user}/{uid}", 0).unwrap(),
            PathBuf::from("/shared/hocus/root/0")
        );
        assert!(dir_for("relative/{user}", 0).is_err());
    }
}
