//! The filler's accesses waiting for a fill, shared fairly among the node's users: each
//! user may have `per_user` waiting, all of them together `total` (each holds a
//! descriptor and a thread blocked in the kernel); a user past their share is refused,
//! never another. When all are taken, a user below the heaviest one's count takes the
//! place of that user's newest access (failed instead). A free worker serves the user
//! with the fewest fills under way, users in turn among equals, so one user's fills
//! never keep every worker from the others; a long fill goes back to its user's queue
//! between pieces ([`Shares::again`]).

use std::{
    collections::{HashMap, VecDeque},
    sync::{Condvar, Mutex},
};

/// What a user has waiting.
struct User<T> {
    /// Accesses not taken by a worker yet, oldest first.
    queued: VecDeque<T>,
    /// Accesses admitted and not done: queued, and being filled.
    admitted: usize,
    /// Being filled by a worker now.
    filling: usize,
    /// When this user was last served (a count of turns): the longest waiting goes first
    /// among users with as few fills under way.
    served_at: u64,
}

struct Inner<T> {
    users: HashMap<u32, User<T>>,
    admitted: usize,
    turns: u64,
    closed: bool,
}

pub struct Shares<T> {
    inner: Mutex<Inner<T>>,
    queued: Condvar,
    total: usize,
    per_user: usize,
}

/// What became of an access offered to [`Shares::admit`].
#[derive(Debug, PartialEq, Eq)]
pub enum Admission<T> {
    Queued,
    /// Its user has their share, or all places are taken by users with no more than
    /// theirs: to be failed.
    Refused(T),
    /// Queued in the place of the newest access of another user (`uid`, then the
    /// access), to be failed.
    Displaced(u32, T),
}

impl<T> Shares<T> {
    pub fn new(total: usize, per_user: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                users: HashMap::new(),
                admitted: 0,
                turns: 0,
                closed: false,
            }),
            queued: Condvar::new(),
            total: total.max(1),
            per_user: per_user.clamp(1, total.max(1)),
        }
    }

    /// Queues `access` of user `uid`, if their share and the places left allow.
    pub fn admit(&self, uid: u32, access: T) -> Admission<T> {
        let mut inner = self.inner.lock().expect("not poisoned");
        let mine = inner.users.get(&uid).map_or(0, |u| u.admitted);
        if mine >= self.per_user {
            return Admission::Refused(access);
        }
        let mut displaced: Option<(u32, T)> = None;
        if inner.admitted >= self.total {
            // The heaviest user with an access still queued, if heavier than this one
            // would be with it.
            let heaviest = inner
                .users
                .iter()
                .filter(|(u, user)| **u != uid && !user.queued.is_empty())
                .max_by_key(|(_, user)| user.admitted)
                .filter(|(_, user)| user.admitted > mine + 1)
                .map(|(&u, _)| u);
            let Some(heaviest) = heaviest else {
                return Admission::Refused(access);
            };
            let user = inner.users.get_mut(&heaviest).expect("just found");
            displaced = user.queued.pop_back().map(|a| (heaviest, a));
            user.admitted -= 1;
            if user.admitted == 0 {
                inner.users.remove(&heaviest);
            }
            inner.admitted -= 1;
        }
        if !inner.users.contains_key(&uid) {
            // A user new here waits behind those already waiting.
            inner.turns += 1;
            let served_at = inner.turns;
            inner.users.insert(
                uid,
                User {
                    queued: VecDeque::new(),
                    admitted: 0,
                    filling: 0,
                    served_at,
                },
            );
        }
        let user = inner.users.get_mut(&uid).expect("just made");
        user.queued.push_back(access);
        user.admitted += 1;
        inner.admitted += 1;
        drop(inner);
        self.queued.notify_one();
        displaced.map_or(Admission::Queued, |(u, a)| Admission::Displaced(u, a))
    }

    /// The next access to fill, and its user: of the user with the fewest fills under
    /// way, the one served longest ago among equals. Waits for one; None once closed.
    pub fn next(&self) -> Option<(u32, T)> {
        let mut inner = self.inner.lock().expect("not poisoned");
        loop {
            if inner.closed {
                return None;
            }
            let chosen = inner
                .users
                .iter()
                .filter(|(_, u)| !u.queued.is_empty())
                .min_by_key(|(_, u)| (u.filling, u.served_at))
                .map(|(&uid, _)| uid);
            if let Some(uid) = chosen {
                inner.turns += 1;
                let turn = inner.turns;
                let user = inner.users.get_mut(&uid).expect("just found");
                user.filling += 1;
                user.served_at = turn;
                let access = user.queued.pop_front().expect("not empty");
                return Some((uid, access));
            }
            inner = self.queued.wait(inner).expect("not poisoned");
        }
    }

    /// `access`, taken by [`Shares::next`], is not done: back to the front of its user's
    /// queue, behind the other users' turns.
    pub fn again(&self, uid: u32, access: T) {
        let mut inner = self.inner.lock().expect("not poisoned");
        if let Some(user) = inner.users.get_mut(&uid) {
            user.filling -= 1;
            user.queued.push_front(access);
        }
        drop(inner);
        self.queued.notify_one();
    }

    /// An access taken by [`Shares::next`] is done: its place is free.
    pub fn done(&self, uid: u32) {
        let mut inner = self.inner.lock().expect("not poisoned");
        let Some(user) = inner.users.get_mut(&uid) else {
            return;
        };
        user.filling -= 1;
        user.admitted -= 1;
        if user.admitted == 0 {
            inner.users.remove(&uid);
        }
        inner.admitted -= 1;
    }

    /// Ends [`Shares::next`]'s waits: the workers stop.
    pub fn close(&self) {
        self.inner.lock().expect("not poisoned").closed = true;
        self.queued.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_past_their_share_is_refused_and_no_other() {
        let shares = Shares::new(8, 3);
        for i in 0..3 {
            assert_eq!(shares.admit(1001, i), Admission::Queued);
        }
        assert_eq!(shares.admit(1001, 3), Admission::Refused(3));
        assert_eq!(shares.admit(0, 10), Admission::Queued);
        // Done, a place is the user's again.
        let (uid, _) = shares.next().unwrap();
        assert_eq!(uid, 1001);
        shares.done(uid);
        assert_eq!(shares.admit(1001, 4), Admission::Queued);
    }

    #[test]
    fn when_all_places_are_taken_the_heaviest_users_newest_access_gives_way() {
        let shares = Shares::new(6, 4);
        for i in 0..4 {
            assert_eq!(shares.admit(1001, i), Admission::Queued);
        }
        for i in 0..2 {
            assert_eq!(shares.admit(1002, 10 + i), Admission::Queued);
        }
        // Full: another user takes the place of 1001's newest.
        assert_eq!(shares.admit(0, 20), Admission::Displaced(1001, 3));
        // 1001 (3) is still heavier than 0 would be (2): it gives way again.
        assert_eq!(shares.admit(0, 21), Admission::Displaced(1001, 2));
        // Now no one is heavier than 0 would be with one more (3): refused.
        assert_eq!(shares.admit(0, 22), Admission::Refused(22));
        // Nor does the heaviest take from the lighter ones.
        assert_eq!(shares.admit(1001, 5), Admission::Refused(5));
    }

    #[test]
    fn workers_serve_the_user_with_the_fewest_fills_under_way_in_turn() {
        let shares = Shares::new(100, 50);
        for i in 0..10 {
            assert_eq!(shares.admit(1001, i), Admission::Queued);
        }
        assert_eq!(shares.admit(0, 100), Admission::Queued);
        assert_eq!(shares.admit(0, 101), Admission::Queued);
        // The flood came first, yet the next worker serves 0 (none under way) right
        // after 1001's first.
        assert_eq!(shares.next(), Some((1001, 0)));
        assert_eq!(shares.next(), Some((0, 100)));
        // Both have one under way: 1001 was served longest ago.
        assert_eq!(shares.next(), Some((1001, 1)));
        assert_eq!(shares.next(), Some((0, 101)));
        // A long fill put back goes first for its user, but after the others' turns.
        shares.again(0, 101);
        shares.done(1001);
        assert_eq!(shares.next(), Some((1001, 2)));
        assert_eq!(shares.next(), Some((0, 101)));
    }

    #[test]
    fn a_closed_queue_ends_the_workers_waits() {
        let shares = std::sync::Arc::new(Shares::<u32>::new(4, 4));
        let s = shares.clone();
        let worker = std::thread::spawn(move || s.next());
        std::thread::sleep(std::time::Duration::from_millis(50));
        shares.close();
        assert_eq!(worker.join().unwrap(), None);
    }
}
