//! What a user was found to be allowed to read, remembered by this node (issue 52): a
//! Slurm job's prolog checks the job's profile as its user, an operation an entry on the
//! server (NFS's ACCESS), and then the job's start checks every copy it binds (NFS's
//! GETATTR): two operations an entry for a warm start. The next job of the same user
//! (uid, gid and groups as Slurm gives them) takes the verdict found for an entry before
//! when this node's copy of it still expects the identity it expected then (size, times,
//! inode, mode, owner and group, as the server gave them; a chmod, chown or ACL change
//! moves one, and the job start that sees it drops the copy). A missing name's verdict
//! rides on its directory's identity.
//!
//! What a verdict decides is only what the user's profile brings into this node's
//! cache: a job reads a bind through the network's own directories, with the copy's own
//! owner, mode and ACLs, so the kernel refuses it what the network would. Only the same
//! user's own verdicts are taken, so no user learns through it what another's jobs
//! hold. Bounded: [`MAX_USERS`] users, [`MAX_ENTRIES`] entries each and [`MAX_ALL`] in
//! all (about 64 bytes each), each kept [`KEPT_FOR`] from its check.

use std::{
    collections::HashMap,
    path::Path,
    sync::Mutex,
    time::{Duration, Instant},
};

use crate::{
    redirect::{mountns::Bind, vouch},
    shared::relay::{Entry, Hash, JobUser},
};

/// Users whose verdicts are kept at once: the one asked longest ago goes first.
const MAX_USERS: usize = 64;
/// Entries kept per user; past it, what more is found is not kept.
const MAX_ENTRIES: usize = 1 << 18;
/// Entries kept for all users: past it, the users asked longest ago are forgotten.
const MAX_ALL: usize = 1 << 20;
/// How long after its check a verdict is taken.
const KEPT_FOR: Duration = Duration::from_secs(3600);

/// The identity this node's copies expect at each network path (a copied file, each
/// entry of a snapshot), as a digest, by a digest of the path (a cache of a million
/// entries costs 48 MB while a prefetch is read, not its paths again).
#[derive(Default)]
pub struct Expected(HashMap<u128, Hash>);

fn key(path: &str) -> u128 {
    short(blake3::hash(path.as_bytes()).as_bytes())
}

fn short(h: &Hash) -> u128 {
    u128::from_le_bytes(h[..16].try_into().expect("16 bytes"))
}

/// An entry as kept: its kind and a digest of its path.
fn entry_key(kind: Entry, path: &str) -> u128 {
    key(path) ^ (kind as u128)
}

impl Expected {
    pub fn of(binds: &[Bind]) -> Self {
        let mut expected = HashMap::new();
        for bind in binds {
            for (path, id, _) in vouch::expected(bind) {
                if let Some(path) = path.to_str() {
                    expected.insert(key(path), vouch::digest(id));
                }
            }
        }
        Self(expected)
    }

    /// The identity an entry's verdict rides on: its own, or a missing name's directory's.
    fn of_entry(&self, kind: Entry, path: &str) -> Option<&Hash> {
        match kind {
            Entry::Missing => self.0.get(&key(Path::new(path).parent()?.to_str()?)),
            Entry::File | Entry::Dir => self.0.get(&key(path)),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// By entry: whether they may read it, when its check began, and the identity it rode on.
type Kept = HashMap<u128, (bool, Instant, u128)>;

struct User {
    user: JobUser,
    asked: Instant,
    kept: Kept,
}

static USERS: Mutex<Vec<User>> = Mutex::new(Vec::new());

/// The verdict kept for `user` of an entry, where this node's copy still expects the
/// identity it expected when it was found: whether they may read it, and when its check
/// began.
pub fn recall(
    user: &JobUser,
    expected: &Expected,
    kind: Entry,
    path: &str,
) -> Option<(bool, Instant)> {
    let now_expected = expected.of_entry(kind, path)?;
    let mut users = USERS.lock().unwrap_or_else(|e| e.into_inner());
    let kept = users.iter_mut().find(|u| u.user == *user)?;
    kept.asked = Instant::now();
    let &(may, began, then) = kept.kept.get(&entry_key(kind, path))?;
    (then == short(now_expected) && began.elapsed() < KEPT_FOR).then_some((may, began))
}

/// Keeps what was found for `user` of entries this node holds copies of.
pub fn remember<'a>(
    user: &JobUser,
    expected: &Expected,
    found: impl IntoIterator<Item = (&'a (Entry, String), &'a (bool, Instant))>,
) {
    let mut users = USERS.lock().unwrap_or_else(|e| e.into_inner());
    let at = match users.iter().position(|u| u.user == *user) {
        Some(at) => at,
        None => {
            if users.len() >= MAX_USERS {
                let oldest = (0..users.len()).min_by_key(|&i| users[i].asked);
                users.swap_remove(oldest.unwrap_or(0));
            }
            users.push(User {
                user: user.clone(),
                asked: Instant::now(),
                kept: Kept::new(),
            });
            users.len() - 1
        }
    };
    let kept = &mut users[at].kept;
    kept.retain(|_, (_, began, _)| began.elapsed() < KEPT_FOR);
    for ((kind, path), &(may, began)) in found {
        let Some(id) = expected.of_entry(*kind, path) else {
            continue;
        };
        let key = entry_key(*kind, path);
        if kept.len() >= MAX_ENTRIES && !kept.contains_key(&key) {
            break;
        }
        kept.insert(key, (may, began, short(id)));
    }
    users[at].asked = Instant::now();
    while users.len() > 1 && users.iter().map(|u| u.kept.len()).sum::<usize>() > MAX_ALL {
        let oldest = (0..users.len()).min_by_key(|&i| users[i].asked);
        users.swap_remove(oldest.unwrap_or(0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expected(paths: &[(&str, u8)]) -> Expected {
        Expected(paths.iter().map(|&(p, id)| (key(p), [id; 32])).collect())
    }

    #[test]
    fn a_users_verdict_is_taken_only_while_the_copy_expects_what_it_did() {
        let alice = JobUser {
            uid: 9_001,
            gid: 9_001,
            groups: vec![9_001],
        };
        let in_group = JobUser {
            groups: vec![9_001, 9_002],
            ..alice.clone()
        };
        let held = expected(&[("/net/env/a.py", 1), ("/net/env", 2)]);
        let began = Instant::now();
        let found = [
            ((Entry::File, "/net/env/a.py".to_owned()), (true, began)),
            ((Entry::Missing, "/net/env/no.py".to_owned()), (true, began)),
            // Not held here: not kept.
            ((Entry::File, "/net/other.py".to_owned()), (true, began)),
        ];
        remember(&alice, &held, found.iter().map(|(k, v)| (k, v)));
        assert_eq!(
            recall(&alice, &held, Entry::File, "/net/env/a.py"),
            Some((true, began))
        );
        assert_eq!(
            recall(&alice, &held, Entry::Missing, "/net/env/no.py"),
            Some((true, began))
        );
        assert_eq!(recall(&alice, &held, Entry::File, "/net/other.py"), None);
        // Another user, or the same uid with other groups, takes none of them.
        assert_eq!(recall(&in_group, &held, Entry::File, "/net/env/a.py"), None);
        // The copy expects another identity now (a chmod at the source, a new version):
        // checked again; so is a missing name whose directory changed.
        let changed = expected(&[("/net/env/a.py", 3), ("/net/env", 4)]);
        assert_eq!(recall(&alice, &changed, Entry::File, "/net/env/a.py"), None);
        assert_eq!(
            recall(&alice, &changed, Entry::Missing, "/net/env/no.py"),
            None
        );
        // No copy of it any more: checked again.
        assert_eq!(
            recall(&alice, &Expected::default(), Entry::File, "/net/env/a.py"),
            None
        );
    }
}
