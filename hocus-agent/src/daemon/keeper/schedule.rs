//! When each copy or snapshot a running job has bound is next compared with the
//! network, as NFS's attribute cache times its own checks (`acregmin`..`acregmax`):
//! first `--revalidate` after its job's start confirmed it, each check that finds it
//! unchanged doubling the wait up to `--revalidate-max`, a change starting it again.
//! What no running job binds is forgotten: the next job's start checks it.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

/// A bound entry's next check, and the wait it was given.
#[derive(Clone, Copy, Debug)]
struct Due {
    at: Instant,
    wait: Duration,
}

#[derive(Default)]
pub struct Schedule {
    /// By bound target (a copy's network path, a snapshot's root). Bounded by what
    /// running jobs bind.
    due: HashMap<PathBuf, Due>,
}

impl Schedule {
    /// Of `bound` (what running jobs bind now), the targets due at `now`; one not seen
    /// before was confirmed at its job's start, and is due `first` later. What is no
    /// longer bound is forgotten.
    pub fn due(
        &mut self,
        bound: &HashSet<&Path>,
        now: Instant,
        first: Duration,
    ) -> HashSet<PathBuf> {
        self.due
            .retain(|target, _| bound.contains(target.as_path()));
        let mut out = HashSet::new();
        for target in bound {
            let d = self.due.entry(target.to_path_buf()).or_insert(Due {
                at: now + first,
                wait: first,
            });
            if d.at <= now {
                out.insert(target.to_path_buf());
            }
        }
        out
    }

    /// `target` was checked at `now` and found unchanged: its wait doubles, up to
    /// `longest`.
    pub fn unchanged(&mut self, target: &Path, now: Instant, longest: Duration) {
        if let Some(d) = self.due.get_mut(target) {
            d.wait = (d.wait * 2).min(longest.max(d.wait));
            d.at = now + d.wait;
        }
    }

    /// `target` changed (its copy or snapshot is gone): bound again, it starts over.
    pub fn changed(&mut self, target: &Path) {
        self.due.remove(target);
    }

    /// Every bound target, checked now whatever its wait (a change no request could
    /// place); found unchanged, each waits twice as long after, as after any check.
    pub fn all(bound: &HashSet<&Path>) -> HashSet<PathBuf> {
        bound.iter().map(|p| p.to_path_buf()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unchanged_entry_waits_twice_as_long_each_time_up_to_the_longest() {
        let (a, b) = (Path::new("/net/a"), Path::new("/net/b"));
        let bound: HashSet<&Path> = [a, b].into();
        let mut s = Schedule::default();
        let t0 = Instant::now();
        let (first, longest) = (Duration::from_secs(3), Duration::from_secs(10));
        let secs = |n| t0 + Duration::from_secs(n);
        // Just confirmed at its job's start: due `first` later.
        assert!(s.due(&bound, t0, first).is_empty());
        assert_eq!(s.due(&bound, secs(3), first).len(), 2);
        s.unchanged(a, secs(3), longest);
        s.changed(b);
        // a waits 6 s now; b starts over.
        assert!(s.due(&bound, secs(6), first).is_empty());
        assert_eq!(
            s.due(&bound, secs(9), first),
            [a.to_path_buf(), b.to_path_buf()].into()
        );
        s.unchanged(a, secs(9), longest);
        s.unchanged(b, secs(9), longest);
        // a: 10 s at most; b: 6 s.
        assert_eq!(s.due(&bound, secs(15), first), [b.to_path_buf()].into());
        assert_eq!(s.due(&bound, secs(19), first).len(), 2);
        // No longer bound: forgotten, and bound again it starts over.
        let only_b: HashSet<&Path> = [b].into();
        s.due(&only_b, secs(20), first);
        assert!(!s.due(&bound, secs(21), first).contains(a));
        assert!(s.due(&bound, secs(24), first).contains(a));
    }
}
