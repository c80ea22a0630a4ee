//! Byte ranges jobs read, as the kernel side follows them: in grains of
//! [`GRAIN_SHIFT`] bytes, one run of grains per open file (or mapped inode) at a time.
//! A read that touches the run extends it; one that does not reports the run
//! ([`RangeRead`]) and starts another. A file read front to back is one run, reported
//! at its close; a shuffled epoch is a report per jump, never one per read.

/// A grain is 64 KiB: small enough that 1 MiB read at any offset holds at most 1.125
/// MiB of grains (the partial copies' budget), large enough that a 4 KiB read loop
/// stays in one grain for 16 reads, and a 40 GB file is 610 000 grains (a `u32` holds
/// 256 TiB).
pub const GRAIN_SHIFT: u32 = 16;
pub const GRAIN: u64 = 1 << GRAIN_SHIFT;

/// Grains `[start, end)` packed as `start << 32 | end`: one word, stored and loaded
/// whole by threads that read one file at once. 0 (an empty run) is none.
pub const fn pack(start: u32, end: u32) -> u64 {
    ((start as u64) << 32) | end as u64
}

/// The grains of a packed run.
pub const fn unpack(run: u64) -> (u32, u32) {
    ((run >> 32) as u32, run as u32)
}

/// The run of grains bytes `[offset, offset + len)` touch (`len` > 0), packed.
pub const fn grains(offset: u64, len: u64) -> u64 {
    let start = offset >> GRAIN_SHIFT;
    let end = ((offset.saturating_add(len) - 1) >> GRAIN_SHIFT) + 1;
    pack(clamp(start), clamp(end))
}

const fn clamp(grain: u64) -> u32 {
    if grain > u32::MAX as u64 {
        u32::MAX
    } else {
        grain as u32
    }
}

/// `run` and `more` as one run if they overlap or touch; None if a gap lies between.
/// An empty `run` (0) takes `more`.
pub const fn join(run: u64, more: u64) -> Option<u64> {
    if run == 0 {
        return Some(more);
    }
    let (a, b) = (unpack(run), unpack(more));
    if b.0 > a.1 || a.0 > b.1 {
        return None;
    }
    let start = if a.0 < b.0 { a.0 } else { b.0 };
    let end = if a.1 > b.1 { a.1 } else { b.1 };
    Some(pack(start, end))
}

/// A run of grains an open file (`file_id`) read, reported when the file's next read
/// jumped away from it or at its close: 24 bytes in the ring, where an [`Event`] takes
/// a kilobyte. Told apart by its size and `kind` (`kind::RANGE`).
///
/// [`Event`]: crate::Event
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RangeRead {
    pub kind: u8,
    pub _pad: [u8; 7],
    pub file_id: u64,
    pub run: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_become_runs_of_grains() {
        assert_eq!(unpack(grains(0, 1)), (0, 1));
        assert_eq!(unpack(grains(0, GRAIN)), (0, 1));
        assert_eq!(unpack(grains(GRAIN - 1, 2)), (0, 2));
        assert_eq!(unpack(grains(10 << 20, 1 << 20)), (160, 176));
        assert_eq!(unpack(grains(u64::MAX - 1, 1)).1, u32::MAX);
        assert_ne!(grains(0, 1), 0, "a run is never the empty word");
    }

    #[test]
    fn runs_join_when_they_touch_and_not_across_a_gap() {
        let (a, b, c) = (pack(0, 4), pack(4, 8), pack(9, 10));
        assert_eq!(join(0, a), Some(a));
        assert_eq!(join(a, b), Some(pack(0, 8)));
        assert_eq!(join(b, a), Some(pack(0, 8)));
        assert_eq!(join(pack(0, 8), pack(2, 3)), Some(pack(0, 8)));
        assert_eq!(join(b, c), None);
        assert_eq!(join(c, a), None);
    }
}
