//! What a Slurm job's user may read, found once for all its nodes (issue 52): each
//! node's prolog checks the job's profile as the user (`access::filter_for_job`), one
//! permission check an entry, and on N nodes the server was asked N times. Now a node
//! with a parent in the job's tree (docs/fanout.md) asks it first for its verdicts, on
//! the relay's proven connection; the parent answers for the entries its own prolog
//! checked for the same user, waiting (within the time the child allows) for those it
//! has not reached yet, and never asks the server anything for a child. A verdict
//! taken is at most [`FRESH`] old when its check began, as recent as what a plain NFS
//! client answers from its attribute and access caches (`acregmin`, 3 s); what is not
//! answered in time the child checks itself. Each node keeps what it found and took,
//! for its own children.

use std::{
    collections::HashMap,
    sync::{Condvar, Mutex},
    time::{Duration, Instant},
};

use crate::{
    cache::relay::Parent,
    shared::relay::{Entry, JobUser, Verdict},
};

/// A verdict older than this when taken is checked again.
pub const FRESH: Duration = Duration::from_secs(3);
/// How long a child waits for its parent's verdicts of one batch of a profile: about
/// what checking them itself would take.
const ASK_WITHIN: Duration = Duration::from_secs(2);
/// Entries asked of the parent at once.
const ASKED_AT_ONCE: usize = 1024;
/// Entries a node finds before it gives them to its children (and then at the end of
/// each part of a profile).
pub const GIVEN_EVERY: usize = 256;
/// Jobs whose verdicts a node keeps at once: the oldest is forgotten first.
const MAX_JOBS: usize = 64;

/// What was found of a job's profile, by entry: whether its user may read it, and when
/// the check began.
type Found = HashMap<(Entry, String), (bool, Instant)>;

struct Job {
    job_id: u32,
    user: JobUser,
    found: Found,
    /// When its prolog's check was over: nothing more is coming.
    over: Option<Instant>,
}

static JOBS: Mutex<Vec<Job>> = Mutex::new(Vec::new());
/// Woken as verdicts are found and checks end.
static FOUND: Condvar = Condvar::new();

/// The user as the verdicts name them: groups sorted, each once.
pub fn job_user(uid: u32, gid: u32, groups: &[u32]) -> JobUser {
    let mut groups = groups.to_vec();
    groups.sort_unstable();
    groups.dedup();
    JobUser { uid, gid, groups }
}

/// A job's prolog begins checking its profile as `user`: its children wait for what
/// it finds. Jobs whose checks ended long enough ago that nothing they found can be
/// given are forgotten.
pub fn begin(job_id: u32, user: JobUser) {
    let mut jobs = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    jobs.retain(|j| j.job_id != job_id && j.over.is_none_or(|at| at.elapsed() < FRESH));
    if jobs.len() >= MAX_JOBS {
        jobs.remove(0);
    }
    jobs.push(Job {
        job_id,
        user,
        found: Found::new(),
        over: None,
    });
}

/// Verdicts found (or taken from this node's parent) for `job_id`'s profile. What is
/// too old to give is forgotten: what is kept is bounded by what a prolog checks in
/// [`FRESH`].
pub fn record(job_id: u32, found: impl IntoIterator<Item = ((Entry, String), (bool, Instant))>) {
    let mut jobs = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(job) = jobs.iter_mut().find(|j| j.job_id == job_id) {
        job.found.retain(|_, (_, at)| at.elapsed() < FRESH);
        job.found.extend(found);
    }
    FOUND.notify_all();
}

/// `job_id`'s prolog's check is over (done or failed).
pub fn end(job_id: u32) {
    let mut jobs = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(job) = jobs.iter_mut().find(|j| j.job_id == job_id) {
        job.over = Some(Instant::now());
    }
    FOUND.notify_all();
}

/// The answer to a child of `job_id` asking for the verdicts of `items` for `user`:
/// each, once found here (within `allowed`), with how long ago its check began; None
/// where this node has none for that user, or finds none in time.
pub fn answer(
    job_id: u32,
    user: &JobUser,
    items: &[(Entry, String)],
    allowed: Duration,
) -> Vec<Verdict> {
    let deadline = Instant::now() + allowed.min(ASK_WITHIN);
    let mut jobs = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let Some(job) = jobs.iter().find(|j| j.job_id == job_id && j.user == *user) else {
            return vec![None; items.len()];
        };
        let verdicts: Vec<Verdict> = items
            .iter()
            .map(|item| {
                let &(may, at) = job.found.get(item)?;
                Some((may, at.elapsed())).filter(|(_, age)| *age < FRESH)
            })
            .collect();
        let now = Instant::now();
        if job.over.is_some() || now >= deadline || verdicts.iter().all(Option::is_some) {
            return verdicts;
        }
        jobs = FOUND
            .wait_timeout(jobs, deadline - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// `parent`'s verdicts of `items` for `user`, those whose check began less than
/// [`FRESH`] ago, with when it began. Asked a part at a time, so that this node keeps
/// pace with its parent's check; a part the parent has nothing for (it is behind, or
/// has no such entries) ends the asking: this node checks the rest itself.
pub fn asked_of(parent: &Parent, user: &JobUser, items: &[(Entry, &str)]) -> Found {
    let mut found = Found::new();
    for part in items.chunks(ASKED_AT_ONCE) {
        let Some((sent, verdicts)) = parent.verdicts(user, part, ASK_WITHIN) else {
            break;
        };
        let before = found.len();
        found.extend(part.iter().zip(verdicts).filter_map(|(&(kind, path), v)| {
            let (may, age) = v?;
            // Its check began `age` before it answered, which was after `sent`: at the
            // latest then, judged by how long before this node asked.
            let began = sent.checked_sub(age)?;
            (sent.saturating_duration_since(began) < FRESH)
                .then(|| ((kind, path.to_owned()), (may, began)))
        }));
        if found.len() == before {
            break;
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_is_given_what_the_parent_found_for_the_same_user_once_found() {
        let (job, user) = (4_000_001, job_user(1000, 1000, &[27, 1000, 27]));
        assert_eq!(user.groups, [27, 1000]);
        let item = |p: &str| (Entry::File, p.to_owned());
        begin(job, user.clone());
        record(job, [(item("/net/a"), (true, Instant::now()))]);
        // Found later, while the child waits.
        let later = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            record(job, [(item("/net/b"), (false, Instant::now()))]);
        });
        let asked = [item("/net/a"), item("/net/b")];
        let v = answer(job, &user, &asked, Duration::from_secs(5));
        later.join().unwrap();
        assert!(
            matches!(v[..], [Some((true, _)), Some((false, _))]),
            "{v:?}"
        );
        // Another user, or another kind of entry: no verdict.
        let other = job_user(1001, 1000, &[1000]);
        assert_eq!(answer(job, &other, &asked, Duration::ZERO), [None, None]);
        let dir = [(Entry::Dir, "/net/a".to_owned())];
        assert_eq!(answer(job, &user, &dir, Duration::ZERO), [None]);
        // Once the check is over, nothing more is waited for.
        end(job);
        let started = Instant::now();
        let none = answer(job, &user, &[item("/net/c")], Duration::from_secs(5));
        assert_eq!(none, [None]);
        assert!(started.elapsed() < Duration::from_secs(1));
        // Too old to give.
        let old = Instant::now().checked_sub(FRESH).unwrap();
        record(job, [(item("/net/d"), (true, old))]);
        assert_eq!(
            answer(job, &user, &[item("/net/d")], Duration::ZERO),
            [None]
        );
    }
}
