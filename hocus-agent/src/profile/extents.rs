//! The byte ranges jobs read of one file, as extents of grains (`hocus_common::ranges`,
//! 64 KiB): sorted, apart (two that touch are one), and bounded. Past the bound the two
//! extents with the smallest gap between them become one, so a file keeps the shape of
//! what was read at a coarser grain rather than losing any of it.

use hocus_common::ranges::{GRAIN, GRAIN_SHIFT};

/// Extents a file keeps at most: a shuffled epoch over a file makes one per chunk it
/// read (64 of 1 MiB over a 1 GiB file); 1024 of them cost 8 KiB.
pub const MAX_PER_FILE: usize = 1024;

/// Grains `[start, end)` a file's readers read, in order, none touching another.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Extents(Vec<(u32, u32)>);

impl Extents {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Every grain of a file of `size` bytes: what a profile says with no ranges for a
    /// file it read (the whole file), so that joined with other ranges it stays whole.
    pub fn all_of(size: u64) -> Self {
        Self(vec![(0, grain(size.saturating_add(GRAIN - 1)))])
    }

    /// Bytes held on the heap.
    pub fn heap_bytes(&self) -> usize {
        self.0.capacity() * size_of::<(u32, u32)>()
    }

    /// The extents, in grains.
    pub fn grains(&self) -> &[(u32, u32)] {
        &self.0
    }

    pub fn iter(&self) -> std::slice::Iter<'_, (u32, u32)> {
        self.0.iter()
    }

    /// The grains of `[start, end)` none of the extents hold, as extents.
    pub fn gaps(&self, start: u32, end: u32) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        let mut at = start;
        let first = self.0.partition_point(|e| e.1 <= start);
        for &(s, e) in &self.0[first..] {
            if s >= end {
                break;
            }
            if s > at {
                out.push((at, s));
            }
            at = at.max(e);
        }
        if at < end {
            out.push((at, end));
        }
        out
    }

    /// Adds grains `[start, end)`, joined with those they overlap or touch.
    pub fn add(&mut self, start: u32, end: u32) {
        if start >= end {
            return;
        }
        // The first extent that ends at or after `start` (touching counts), and the
        // first after it that starts past `end`: those between are joined.
        let first = self.0.partition_point(|e| e.1 < start);
        let last = first + self.0[first..].partition_point(|e| e.0 <= end);
        let joined = match self.0[first..last] {
            [] => (start, end),
            ref touched => (
                touched[0].0.min(start),
                touched[touched.len() - 1].1.max(end),
            ),
        };
        self.0.splice(first..last, [joined]);
    }

    /// Takes grains `[start, end)` out (an extent they cut in the middle becomes two).
    pub fn remove(&mut self, start: u32, end: u32) {
        if start >= end {
            return;
        }
        let first = self.0.partition_point(|e| e.1 <= start);
        let last = first + self.0[first..].partition_point(|e| e.0 < end);
        let mut kept = Vec::with_capacity(2);
        if let Some(&(s, _)) = self.0.get(first).filter(|_| first < last) {
            if s < start {
                kept.push((s, start));
            }
        }
        if last > first {
            let e = self.0[last - 1].1;
            if e > end {
                kept.push((end, e));
            }
        }
        self.0.splice(first..last, kept);
    }

    /// The first extents, in the file's order, up to `bytes` of a file of `size` bytes
    /// (the last one cut short, in whole grains).
    pub fn cut_to(&self, bytes: u64, size: u64) -> Extents {
        let mut left = bytes;
        let mut out = Extents::default();
        for &(s, e) in &self.0 {
            let held = Extents(vec![(s, e)]).bytes(size);
            if held <= left {
                out.0.push((s, e));
                left -= held;
                continue;
            }
            let grains = (left >> GRAIN_SHIFT) as u32;
            if grains > 0 {
                out.0.push((s, s + grains));
            }
            break;
        }
        out
    }

    /// Adds every extent of `other`.
    pub fn add_all(&mut self, other: &Extents) {
        for &(start, end) in &other.0 {
            self.add(start, end);
        }
    }

    /// Joins the extents with the smallest gaps between them until at most `max` are
    /// left (at least one): nothing read is lost, some grains not read are taken in.
    pub fn coarsen(&mut self, max: usize) {
        let max = max.max(1);
        if self.0.len() <= max {
            return;
        }
        let mut gaps: Vec<u32> = self.0.windows(2).map(|w| w[1].0 - w[0].1).collect();
        gaps.sort_unstable();
        // Joining every gap below the `n`th smallest, then gaps equal to it while too
        // many are left, leaves exactly `max`.
        let n = self.0.len() - max;
        let cut = gaps[n - 1];
        let mut equal_left = n - gaps.iter().take_while(|g| **g < cut).count();
        let mut out: Vec<(u32, u32)> = Vec::with_capacity(max);
        for &e in &self.0 {
            match out.last_mut() {
                Some(last) if e.0 - last.1 < cut => last.1 = e.1,
                Some(last) if e.0 - last.1 == cut && equal_left > 0 => {
                    last.1 = e.1;
                    equal_left -= 1;
                }
                _ => out.push(e),
            }
        }
        self.0 = out;
    }

    /// As byte ranges `[start, end)`, the last cut at `size` (unless 0: not known).
    pub fn to_bytes(&self, size: u64) -> Vec<[u64; 2]> {
        self.0
            .iter()
            .map(|&(s, e)| {
                let (start, end) = (u64::from(s) << GRAIN_SHIFT, u64::from(e) << GRAIN_SHIFT);
                match size {
                    0 => [start, end],
                    size => [start.min(size), end.min(size)],
                }
            })
            .filter(|[s, e]| s < e)
            .collect()
    }

    /// The bytes they hold of a file of `size` bytes (0: not known).
    pub fn bytes(&self, size: u64) -> u64 {
        self.to_bytes(size)
            .iter()
            .map(|[start, end]| end - start)
            .sum()
    }

    /// Whether they hold every grain of a file of `size` bytes (then they say no more
    /// than "the whole file").
    pub fn whole(&self, size: u64) -> bool {
        size > 0 && matches!(self.0[..], [(0, end)] if u64::from(end) << GRAIN_SHIFT >= size)
    }

    /// From byte ranges as a profile file gives them: each widened to whole grains,
    /// joined, and bounded by [`MAX_PER_FILE`]. None if one is not a range (its end
    /// before its start).
    pub fn from_bytes(ranges: &[[u64; 2]]) -> Option<Self> {
        let mut out = Extents::default();
        for &[start, end] in ranges {
            if end < start {
                return None;
            }
            if end == start {
                continue;
            }
            let first = grain(start);
            let last = grain(end.saturating_add(GRAIN - 1));
            out.add(first, last);
            // Bounded as it grows: a hostile file of a million ranges costs no more.
            if out.len() > 2 * MAX_PER_FILE {
                out.coarsen(MAX_PER_FILE);
            }
        }
        out.coarsen(MAX_PER_FILE);
        Some(out)
    }
}

fn grain(byte: u64) -> u32 {
    (byte >> GRAIN_SHIFT).min(u64::from(u32::MAX)) as u32
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn extents_join_where_they_touch_and_stay_apart_across_gaps() {
        let mut e = Extents::default();
        e.add(10, 20);
        e.add(30, 40);
        e.add(20, 25); // touches the first
        e.add(50, 60);
        assert_eq!(e.grains(), [(10, 25), (30, 40), (50, 60)]);
        e.add(24, 51); // spans the middle
        assert_eq!(e.grains(), [(10, 60)]);
        e.add(0, 1);
        e.add(5, 5); // empty
        assert_eq!(e.grains(), [(0, 1), (10, 60)]);
    }

    #[test]
    fn gaps_are_what_no_extent_holds() {
        let mut e = Extents::default();
        e.add(10, 20);
        e.add(30, 40);
        assert_eq!(e.gaps(0, 50), [(0, 10), (20, 30), (40, 50)]);
        assert_eq!(e.gaps(12, 18), []);
        assert_eq!(e.gaps(15, 35), [(20, 30)]);
        assert_eq!(e.gaps(40, 41), [(40, 41)]);
        assert_eq!(Extents::default().gaps(3, 5), [(3, 5)]);
    }

    #[test]
    fn grains_taken_out_split_what_they_cut_and_a_cut_keeps_the_first_bytes() {
        let mut e = Extents::default();
        e.add(10, 20);
        e.add(30, 40);
        e.remove(15, 32);
        assert_eq!(e.grains(), [(10, 15), (32, 40)]);
        e.remove(33, 35);
        assert_eq!(e.grains(), [(10, 15), (32, 33), (35, 40)]);
        e.remove(0, 10);
        e.remove(40, 50);
        assert_eq!(e.len(), 3);
        e.remove(0, 100);
        assert!(e.is_empty());

        let mut e = Extents::default();
        e.add(0, 4);
        e.add(10, 20);
        let g = GRAIN;
        assert_eq!(e.cut_to(7 * g + 100, 100 * g).grains(), [(0, 4), (10, 13)]);
        assert_eq!(e.cut_to(2 * g, 100 * g).grains(), [(0, 2)]);
        assert_eq!(e.cut_to(u64::MAX, 100 * g), e);
        assert!(e.cut_to(100, 100 * g).is_empty());
    }

    #[test]
    fn coarsening_joins_the_smallest_gaps_first_and_loses_nothing() {
        let mut e = Extents::default();
        for (s, end) in [(0, 1), (2, 3), (10, 11), (30, 31), (31 + 2, 34)] {
            e.add(s, end);
        }
        e.coarsen(3);
        assert_eq!(e.grains(), [(0, 3), (10, 11), (30, 34)]);
        e.coarsen(1);
        assert_eq!(e.grains(), [(0, 34)]);
    }

    #[test]
    fn bytes_are_cut_at_the_size_and_widened_to_grains_coming_in() {
        let mut e = Extents::default();
        e.add(0, 1);
        e.add(16, 32);
        assert_eq!(e.to_bytes(0), [[0, GRAIN], [1 << 20, 2 << 20]]);
        assert_eq!(e.to_bytes(1_500_000), [[0, GRAIN], [1 << 20, 1_500_000]]);
        assert_eq!(e.to_bytes(100), [[0, 100]]);
        let back = Extents::from_bytes(&[[1, 2], [(1 << 20) + 5, 1_500_000]]).unwrap();
        assert_eq!(back.grains(), [(0, 1), (16, 23)]);
        assert!(Extents::from_bytes(&[[5, 4]]).is_none());
        assert!(!back.whole(2 << 20), "two extents with a gap");
        let front = Extents::from_bytes(&[[0, 100]]).unwrap();
        assert!(front.whole(GRAIN - 1) && front.whole(GRAIN) && !front.whole(GRAIN + 1));
    }

    proptest! {
        #[test]
        fn every_grain_added_stays_held_and_extents_stay_apart(
            adds in prop::collection::vec((0u32..4000, 1u32..100), 1..300),
            max in 1usize..40,
        ) {
            let mut e = Extents::default();
            for (s, n) in &adds {
                e.add(*s, s + n);
            }
            let held = |e: &Extents, g: u32| e.grains().iter().any(|(s, end)| *s <= g && g < *end);
            for (s, n) in &adds {
                prop_assert!(held(&e, *s) && held(&e, s + n - 1));
            }
            e.coarsen(max);
            prop_assert!(e.len() <= max);
            for w in e.grains().windows(2) {
                prop_assert!(w[0].0 < w[0].1 && w[0].1 < w[1].0);
            }
            for (s, n) in &adds {
                prop_assert!(held(&e, *s) && held(&e, s + n - 1));
            }
        }

        #[test]
        fn grains_taken_out_are_held_no_more_and_the_rest_still_are(
            adds in prop::collection::vec((0u32..400, 1u32..40), 1..30),
            removes in prop::collection::vec((0u32..400, 1u32..40), 1..10),
        ) {
            let mut e = Extents::default();
            let mut want = [false; 440];
            for (s, n) in &adds {
                e.add(*s, s + n);
                want[*s as usize..(s + n) as usize].fill(true);
            }
            for (s, n) in &removes {
                e.remove(*s, s + n);
                want[*s as usize..(s + n) as usize].fill(false);
            }
            for w in e.grains().windows(2) {
                prop_assert!(w[0].0 < w[0].1 && w[0].1 < w[1].0);
            }
            for (g, w) in want.iter().enumerate() {
                prop_assert_eq!(e.gaps(g as u32, g as u32 + 1).is_empty(), *w);
            }
        }
    }
}
