//! A profile taken in from outside the daemon's own observation (a client's import or
//! prefetch, a Slurm job's saved profile, root's import without a daemon), a batch at a
//! time, into a working set of its own: only sound paths inside the watched trees, and
//! only what its sender may vouch for. What was refused is named (the first
//! `REFUSED_SHOWN`) and counted. A user has one profile staged at a time (`Turn`).

use hocus_control::status::{REFUSED_SHOWN, Refused};
use std::{
    collections::BTreeSet,
    path::PathBuf,
    sync::{Condvar, Mutex},
};

use crate::profile::{
    format::{Head, Holder, Profile, keep_valid},
    working_set::WorkingSet,
};

/// A profile being taken in, and what it came to.
pub struct Staging {
    /// The only trees its paths may be in.
    trees: Vec<PathBuf>,
    pub set: WorkingSet,
    /// Files and missing names taken in.
    pub files: usize,
    pub missing: usize,
    /// Entries refused (at most `REFUSED_SHOWN`), and how many in all.
    pub refused: Vec<Refused>,
    pub refused_total: usize,
    /// The node it says held its files when it was saved (a Slurm job's profile).
    pub holder: Option<Holder>,
    /// Its sender's turn, given up once it is taken in (dropped).
    _turn: Option<Turn>,
    /// Entries it may bring in; those past it are left out, refused.
    most: usize,
}

/// The users with a profile staged now.
static STAGED: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());
static TURN_GIVEN_UP: Condvar = Condvar::new();

/// A user's turn to have a profile staged: their next waits until this one is taken in,
/// so that what a user's profiles hold in memory at once is one profile's worth, however
/// many they send together.
pub struct Turn(u32);

impl Turn {
    /// Waits for `uid`'s turn.
    pub fn take(uid: u32) -> Self {
        let mut staged = STAGED.lock().expect("not poisoned");
        while staged.contains(&uid) {
            staged = TURN_GIVEN_UP.wait(staged).expect("not poisoned");
        }
        staged.insert(uid);
        Self(uid)
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        STAGED.lock().expect("not poisoned").remove(&self.0);
        TURN_GIVEN_UP.notify_all();
    }
}

impl Staging {
    pub fn new(trees: &[PathBuf]) -> Self {
        Self {
            trees: trees.to_vec(),
            set: WorkingSet::new(0),
            files: 0,
            missing: 0,
            refused: Vec::new(),
            refused_total: 0,
            holder: None,
            _turn: None,
            most: usize::MAX,
        }
    }

    /// The same for a profile user `uid` sent, once it is their turn ([`Turn`]), bringing
    /// in at most `most` entries (files, missing names, directories).
    pub fn for_user(trees: &[PathBuf], uid: u32, most: usize) -> Self {
        Self {
            _turn: Some(Turn::take(uid)),
            most,
            ..Self::new(trees)
        }
    }

    fn entries(&self) -> usize {
        let (files, missing, dirs) = self.set.counts();
        files + missing + dirs
    }

    /// Takes in one batch: unsound paths and paths outside the trees are refused, then
    /// `vouch` keeps what the sender may vouch for (an error ends the staging), and the
    /// rest is merged.
    pub fn take(
        &mut self,
        mut batch: Profile,
        vouch: impl FnOnce(&mut Profile) -> Result<(), String>,
    ) -> Result<(), String> {
        if self.entries() >= self.most {
            self.leave_out(batch);
            return Ok(());
        }
        let refused = keep_valid(&mut batch, &self.trees);
        self.refused_total += refused.len();
        let room = REFUSED_SHOWN.saturating_sub(self.refused.len());
        self.refused.extend(refused.into_iter().take(room));
        vouch(&mut batch)?;
        self.files += batch.files.len();
        self.missing += batch.missing.len();
        self.set.merge(batch);
        Ok(())
    }

    /// Refuses all of `batch`: the profile brought in all it may.
    fn leave_out(&mut self, batch: Profile) {
        let n = batch.files.len() + batch.missing.len() + batch.dirs.len();
        if n == 0 {
            return;
        }
        if self.refused.len() < REFUSED_SHOWN {
            let first = (batch.files.first().map(|f| &f.path))
                .or(batch.missing.first().map(|m| &m.path))
                .or(batch.dirs.first().map(|d| &d.path));
            self.refused.push(Refused {
                path: first.map_or(String::new(), |p| p.escape_debug().to_string()),
                why: format!(
                    "past the {} entries a profile of this sender brings in (root may import a bigger one)",
                    self.most
                ),
            });
        }
        self.refused_total += n;
    }

    /// All batches are in: the profile started at `unix_ns`.
    /// What the profile said besides its entries, once all were read.
    pub fn headed(&mut self, head: Head) {
        self.set.started_unix_ns = head.started_unix_ns;
        self.holder = head.holder;
    }
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "Staging({} files, {} missing names, {} refused)",
            self.files, self.missing, self.refused_total
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::format::{FileEntry, MissingEntry};

    fn batch(paths: &[&str]) -> Profile {
        Profile {
            files: paths
                .iter()
                .map(|p| FileEntry {
                    path: (*p).into(),
                    opens: 1,
                    ..Default::default()
                })
                .collect(),
            missing: vec![MissingEntry {
                path: "/net/home/nope.py".into(),
                lookups: 2,
                first_touch_ns: 1,
            }],
            ..Default::default()
        }
    }

    #[test]
    fn a_users_second_profile_waits_until_their_first_is_taken_in() {
        let first = Staging::for_user(&[], 4242, 10);
        let (tx, rx) = std::sync::mpsc::channel();
        let second = std::thread::spawn(move || {
            let s = Staging::for_user(&[], 4242, 10);
            tx.send(()).unwrap();
            s
        });
        // Another user's is not held back.
        drop(Staging::for_user(&[], 4243, 10));
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(200))
                .is_err()
        );
        drop(first);
        rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        drop(second.join().unwrap());
    }

    #[test]
    fn past_its_bound_a_profile_brings_nothing_more_in_and_says_so() {
        let mut s = Staging::for_user(&[PathBuf::from("/net/home")], 4244, 3);
        s.take(batch(&["/net/home/a.py", "/net/home/b.py"]), |_| Ok(()))
            .unwrap();
        assert_eq!(s.entries(), 3);
        s.take(batch(&["/net/home/c.py"]), |_| Ok(())).unwrap();
        assert_eq!(s.entries(), 3);
        assert_eq!(s.refused_total, 2);
        assert!(
            s.refused[0].why.starts_with("past the 3 entries"),
            "{:?}",
            s.refused
        );
    }

    #[test]
    fn batches_are_checked_vouched_for_and_counted() {
        let mut s = Staging::new(&[PathBuf::from("/net/home")]);
        s.take(batch(&["/net/home/a.py", "/etc/shadow"]), |_| Ok(()))
            .unwrap();
        // The sender vouches only for what it may read.
        s.take(batch(&["/net/home/b.py", "/net/home/secret"]), |p| {
            p.files.retain(|f| f.path != "/net/home/secret");
            Ok(())
        })
        .unwrap();
        s.headed(Head {
            started_unix_ns: 42,
            holder: None,
        });
        assert_eq!((s.files, s.missing, s.refused_total), (2, 2, 1));
        assert_eq!(s.refused[0].path, "/etc/shadow");
        let p = s.set.to_profile();
        let paths: Vec<&str> = p.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["/net/home/a.py", "/net/home/b.py"]);
        assert_eq!((p.missing[0].lookups, p.started_unix_ns), (4, 42));
        let e = s.take(batch(&[]), |_| Err("no".into())).unwrap_err();
        assert_eq!(e, "no");
    }

    #[test]
    fn only_so_many_refusals_are_named_but_all_are_counted() {
        let mut s = Staging::new(&[PathBuf::from("/net/home")]);
        let outside: Vec<String> = (0..REFUSED_SHOWN + 5).map(|i| format!("/x/{i}")).collect();
        let outside: Vec<&str> = outside.iter().map(String::as_str).collect();
        s.take(batch(&outside), |_| Ok(())).unwrap();
        assert_eq!(s.refused.len(), REFUSED_SHOWN);
        assert_eq!(s.refused_total, REFUSED_SHOWN + 5);
    }
}
