//! When a partial copy's 1 MiB chunks were last read or filled, as runs of chunks
//! touched at once: one access of a huge range (a mapping of terabytes) is one run, not
//! an entry per chunk. Each run has the order of the touch among all (which chunk is
//! colder), the second on the daemon's clock (whether a read allowed then could still
//! be under way, or a fill then is too fresh to undo), and whether a read of it was
//! allowed or it was only filled (a fill whose read is refused may take it back). Whose
//! fill brought each chunk in is kept the same way: the user it counts against.

use std::{collections::BTreeMap, sync::OnceLock, time::Instant};

/// An access, as a run keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Touch {
    /// Among all accesses to partial copies: higher is later.
    pub order: u64,
    /// Seconds since the daemon's clock started ([`now`]).
    pub secs: u32,
    /// A read of it was allowed (not only filled).
    pub allowed: bool,
}

/// Runs of chunks by their first: `start -> (end, value)`, apart.
#[derive(Debug)]
struct Runs<T>(BTreeMap<u32, (u32, T)>);

impl<T> Default for Runs<T> {
    fn default() -> Self {
        Self(BTreeMap::new())
    }
}

impl<T: Copy> Runs<T> {
    /// Chunks `[start, end)` have `value` now.
    fn set(&mut self, start: u32, end: u32, value: T) {
        if start >= end {
            return;
        }
        self.cut(start, end);
        self.0.insert(start, (end, value));
    }

    /// What chunk `chunk` has, if anything.
    fn of(&self, chunk: u32) -> Option<T> {
        let (_, &(end, value)) = self.0.range(..=chunk).next_back()?;
        (chunk < end).then_some(value)
    }

    /// The runs that meet `[start, end)`, cut to it.
    fn within(&self, start: u32, end: u32) -> impl Iterator<Item = (u32, u32, T)> + '_ {
        let first = self
            .0
            .range(..=start)
            .next_back()
            .map_or(start, |(s, _)| *s);
        self.0
            .range(first..end)
            .filter(move |(_, (e, _))| *e > start)
            .map(move |(s, (e, v))| ((*s).max(start), (*e).min(end), *v))
    }

    /// Takes `[start, end)` out of every run, keeping what lies on either side.
    fn cut(&mut self, start: u32, end: u32) {
        let overlapping: Vec<u32> = self
            .0
            .range(..end)
            .rev()
            .take_while(|(_, (e, _))| *e > start)
            .map(|(s, _)| *s)
            .collect();
        for s in overlapping {
            let (e, value) = self.0.remove(&s).expect("just listed");
            if s < start {
                self.0.insert(s, (start, value));
            }
            if e > end {
                self.0.insert(end, (e, value));
            }
        }
    }
}

/// A copy's chunks: when each was last touched, and whose fill brought it in (the user
/// its bytes count against within the SSD budget's room for fills; none: the
/// placement's).
#[derive(Debug, Default)]
pub struct Heat {
    touched: Runs<Touch>,
    filled_by: Runs<u32>,
}

impl Heat {
    /// Chunks `[start, end)` were read by `touch`.
    pub fn touch(&mut self, start: u32, end: u32, touch: Touch) {
        self.touched.set(start, end, touch);
    }

    /// Chunks `[start, end)` were filled for a read of user `uid`'s.
    pub fn filled_by(&mut self, start: u32, end: u32, uid: u32) {
        self.filled_by.set(start, end, uid);
    }

    /// Chunk `chunk` is held no more: it has no heat, and is no one's.
    pub fn forget(&mut self, chunk: u32) {
        let end = chunk.saturating_add(1);
        self.touched.cut(chunk, end);
        self.filled_by.cut(chunk, end);
    }

    /// When chunk `chunk` was last read, if it was.
    pub fn of(&self, chunk: u32) -> Option<Touch> {
        self.touched.of(chunk)
    }

    /// Whose fill brought chunk `chunk` in, if a fill did.
    pub fn owner(&self, chunk: u32) -> Option<u32> {
        self.filled_by.of(chunk)
    }

    /// The chunks of `[start, end)` filled and not allowed to be read since.
    pub fn only_filled(&self, start: u32, end: u32) -> Vec<u32> {
        self.touched
            .within(start, end)
            .filter(|(_, _, t)| !t.allowed)
            .flat_map(|(s, e, _)| s..e)
            .collect()
    }

    /// Runs kept.
    #[cfg(test)]
    pub fn runs(&self) -> usize {
        self.touched.0.len()
    }
}

/// Seconds on the daemon's clock (monotonic, from its first use).
pub fn now() -> u32 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(order: u64) -> Touch {
        Touch {
            order,
            secs: 0,
            allowed: true,
        }
    }

    #[test]
    fn a_huge_access_is_one_run_and_later_ones_split_it() {
        let mut heat = Heat::default();
        heat.touch(0, 15 << 20, at(1));
        assert_eq!(heat.runs(), 1);
        heat.touch(100, 102, at(2));
        assert_eq!(heat.runs(), 3);
        assert_eq!(heat.of(99), Some(at(1)));
        assert_eq!(heat.of(100), Some(at(2)));
        assert_eq!(heat.of(101), Some(at(2)));
        assert_eq!(heat.of(102), Some(at(1)));
        assert_eq!(heat.of(15 << 20), None);
        heat.forget(101);
        assert_eq!(heat.of(101), None);
        assert_eq!(heat.of(100), Some(at(2)));
        // One access over all of them makes one run again.
        heat.touch(0, 15 << 20, at(3));
        assert_eq!(heat.runs(), 1);
        assert_eq!(heat.of(101), Some(at(3)));
    }

    #[test]
    fn chunks_only_filled_are_told_from_those_read() {
        let mut heat = Heat::default();
        let filled = Touch {
            allowed: false,
            ..at(4)
        };
        heat.touch(10, 14, filled);
        heat.touch(20, 24, filled);
        heat.touch(12, 13, at(5));
        assert_eq!(heat.only_filled(0, 100), [10, 11, 13, 20, 21, 22, 23]);
        assert_eq!(heat.only_filled(11, 21), [11, 13, 20]);
        assert!(heat.only_filled(30, 40).is_empty());
    }

    #[test]
    fn a_chunk_is_the_last_fillers_until_it_is_punched() {
        let mut heat = Heat::default();
        heat.filled_by(0, 8, 1001);
        heat.filled_by(4, 6, 1002);
        heat.touch(0, 8, at(1));
        assert_eq!(heat.owner(3), Some(1001));
        assert_eq!(heat.owner(4), Some(1002));
        assert_eq!(heat.owner(6), Some(1001));
        assert_eq!(heat.owner(8), None);
        heat.forget(4);
        assert_eq!(heat.owner(4), None);
        assert_eq!(heat.of(4), None);
        assert_eq!(heat.owner(5), Some(1002));
    }
}
