//! The keeper's decisions, as plain functions of what it knows: which files may be
//! placed at all (admission), what a new placement means for the copies and pins held
//! (evictions, unpins, copies, pins), and what a change to a file drops. No filesystem,
//! no clock: the keeper applies the answers through its workers.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
};

use crate::{
    place::placement::{self, Choice, Filters},
    profile::shortlist::{File, Shortlist},
};

/// What the keeper knows about files beyond the profile.
#[derive(Default)]
pub struct Known<'a> {
    /// The watched trees.
    pub trees: &'a [PathBuf],
    /// Seen changing lately (fetched again once stable).
    pub unstable: HashSet<&'a str>,
    /// Whose copy failed lately.
    pub failed: HashSet<&'a str>,
    /// Jobs tried to write them through a read-only copy: never redirected again.
    pub refused: HashSet<&'a str>,
}

/// The files of the working set that may be placed: under a watched tree, and neither
/// changing, failing nor refused.
pub fn admitted<'a>(shortlist: &'a Shortlist, known: &Known) -> Vec<File<'a>> {
    shortlist
        .files()
        .filter(|f| {
            let p = f.path;
            !known.unstable.contains(p) && !known.failed.contains(p) && !known.refused.contains(p)
        })
        .filter(|f| known.trees.iter().any(|t| Path::new(f.path).starts_with(t)))
        .collect()
}

/// What held copies and pins there are now.
pub struct Held<'a> {
    /// Copies in the cache.
    pub cached: &'a dyn Fn(&str) -> bool,
    /// Copies under way.
    pub copying: &'a dyn Fn(&str) -> bool,
    /// Pinned (or being pinned).
    pub pinned: &'a dyn Fn(&str) -> bool,
    /// Every copy in the cache (those `cached` says yes to), and what each takes.
    pub copies: Vec<(&'a str, u64)>,
    /// Copies running jobs use: kept whatever a placement (another user's prefetch among
    /// them) wants instead.
    pub in_use: &'a dyn Fn(&str) -> bool,
}

/// How to move from what is held to a new placement. The placement's paths are
/// borrowed from the files placed (the keeper's shortlist: 100k of them, site-wide).
#[derive(Debug, Default, PartialEq)]
pub struct Moves<'a> {
    /// The placement: each wanted file, and whether it is to be pinned, in first-touch
    /// order.
    pub wanted: Vec<Choice<'a>>,
    /// Held copies no longer wanted.
    pub evict: Vec<String>,
    /// Pins no longer wanted (the copy stays).
    pub unpin: Vec<String>,
    /// Held copies to pin.
    pub pin: Vec<&'a str>,
    /// Files to copy, by their place in `wanted` (first-touch order).
    pub copy: Vec<u32>,
}

impl<'a> Moves<'a> {
    /// The files to copy.
    pub fn copies(&self) -> impl Iterator<Item = &Choice<'a>> {
        self.copy.iter().map(|c| &self.wanted[*c as usize])
    }
}

/// Places the admitted files within the budgets, each taking what `takes` says (see
/// [`placement::place`]), and says how to get there: room is made first (evictions,
/// unpins), then copies and pins start.
pub fn moves<'a>(
    admitted: &[File<'a>],
    filters: &Filters,
    (ssd_budget, ram_budget): (u64, u64),
    takes: &dyn Fn(&File) -> u64,
    held: &Held,
) -> Moves<'a> {
    let holding = |p: &str| (held.cached)(p) || (held.copying)(p);
    // The copies jobs use that this placement does not weigh take their bytes first.
    let in_use: Vec<(&str, u64)> = held
        .copies
        .iter()
        .copied()
        .filter(|(p, _)| (held.in_use)(p))
        .collect();
    let weighed: HashSet<&str> = if in_use.is_empty() {
        HashSet::new()
    } else {
        admitted.iter().map(|f| f.path).collect()
    };
    let elsewhere: u64 = in_use
        .iter()
        .filter(|(p, _)| !weighed.contains(p))
        .map(|(_, bytes)| bytes)
        .sum();
    let placed = placement::place_keeping(
        admitted,
        filters,
        (ssd_budget.saturating_sub(elsewhere), ram_budget),
        takes,
        (&holding, held.pinned),
        held.in_use,
    );
    let mut out = Moves::default();
    // The held copies still wanted, and whether pinned.
    let mut kept: HashMap<&str, bool> = HashMap::new();
    for (i, choice) in placed.files.iter().enumerate() {
        let path = choice.path;
        if (held.cached)(path) {
            kept.insert(path, choice.pinned);
            if choice.pinned && !(held.pinned)(path) {
                out.pin.push(path);
            }
        } else if !(held.copying)(path) {
            out.copy.push(i as u32);
        }
    }
    let mut cached: Vec<&str> = held.copies.iter().map(|(p, _)| *p).collect();
    cached.sort_unstable();
    for source in cached {
        match kept.get(source) {
            None if (held.in_use)(source) => {}
            None => out.evict.push(source.to_owned()),
            Some(false) if (held.pinned)(source) => out.unpin.push(source.to_owned()),
            _ => {}
        }
    }
    out.wanted = placed.files;
    out
}

/// The snapshot root (a key of `roots`) that holds `path`, and what it maps to: a
/// change there drops it. By `path`'s ancestors, not by every root: a site-wide
/// working set has thousands of snapshots, and this is asked for every file.
pub fn snapshot_holding<'a, V>(
    path: &Path,
    roots: &'a HashMap<PathBuf, V>,
) -> Option<(&'a PathBuf, &'a V)> {
    if roots.is_empty() {
        return None;
    }
    path.ancestors().find_map(|dir| roots.get_key_value(dir))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::format::FileEntry;

    fn file(path: &str, opens: u64, size: u64, first: u64) -> FileEntry {
        FileEntry {
            path: path.into(),
            opens,
            size,
            first_touch_ns: first,
            ..Default::default()
        }
    }

    fn set<'a>(items: &[&'a str]) -> HashSet<&'a str> {
        items.iter().copied().collect()
    }

    /// The moves from what is held (copies, copies under way, pins) to a placement of
    /// `admitted` within these budgets.
    fn moves_from<'a>(
        admitted: &[File<'a>],
        (ssd, ram): (u64, u64),
        cached: &[&str],
        copying: &[&str],
        pinned: &[&str],
    ) -> Moves<'a> {
        let held = Held {
            cached: &|p| cached.contains(&p),
            copying: &|p| copying.contains(&p),
            pinned: &|p| pinned.contains(&p),
            copies: cached.iter().map(|p| (*p, 0)).collect(),
            in_use: &|_| false,
        };
        moves(
            admitted,
            &Filters::default(),
            (ssd, ram),
            &placement::whole_file,
            &held,
        )
    }

    fn copies<'a>(m: &Moves<'a>) -> Vec<(&'a str, u64)> {
        m.copies().map(|c| (c.path, c.size)).collect()
    }

    #[test]
    fn copies_running_jobs_use_are_kept_and_take_their_bytes_first() {
        let cached = ["/net/job/a.py", "/net/job/b.py", "/net/idle.py"];
        let in_use = ["/net/job/a.py", "/net/job/b.py"];
        let held = Held {
            cached: &|p| cached.contains(&p),
            copying: &|_| false,
            pinned: &|_| false,
            copies: cached.iter().map(|p| (*p, 300)).collect(),
            in_use: &|p| in_use.contains(&p),
        };
        // What a placement of `files` within 1000 B evicts and copies.
        let moves_to = |files: &[FileEntry]| {
            let shortlist = Shortlist::of_files(files);
            let admitted: Vec<File> = shortlist.files().collect();
            let m = moves(
                &admitted,
                &Filters::default(),
                (1000, 0),
                &placement::whole_file,
                &held,
            );
            let copied: Vec<(String, u64)> = copies(&m)
                .into_iter()
                .map(|(p, size)| (p.to_owned(), size))
                .collect();
            (m.evict, copied)
        };
        // Another user's prefetch places one small file of theirs: the copies a running
        // job uses stay, whatever that placement weighs, and count against the budget.
        // The idle copy goes; those in use leave 400 B: the 600 B file does not fit.
        let (evict, copied) = moves_to(&[
            file("/net/theirs.txt", 1, 30, 1),
            file("/net/big.bin", 1, 600, 2),
        ]);
        assert_eq!(evict, ["/net/idle.py"]);
        assert_eq!(copied, [("/net/theirs.txt".to_owned(), 30)]);
        // A copy in use that the placement weighs is kept before any other, however
        // little it is worth.
        let (evict, copied) = moves_to(&[
            file("/net/job/a.py", 1, 300, 1),
            file("/net/hot.py", 1000, 800, 2),
        ]);
        assert!(
            evict.iter().all(|p| !in_use.contains(&p.as_str())),
            "{evict:?}"
        );
        assert!(copied.is_empty(), "{copied:?}");
    }

    #[test]
    fn admission_leaves_out_changing_failing_refused_and_unwatched_files() {
        let trees = vec![PathBuf::from("/net")];
        let files = vec![
            file("/net/ok.py", 1, 10, 1),
            file("/net/changing.py", 1, 10, 2),
            file("/net/failing.py", 1, 10, 3),
            file("/net/refused.py", 1, 10, 4),
            file("/elsewhere/x.py", 1, 10, 5),
            file("/network/look-alike.py", 1, 10, 6),
        ];
        let known = Known {
            trees: &trees,
            unstable: set(&["/net/changing.py"]),
            failed: set(&["/net/failing.py"]),
            refused: set(&["/net/refused.py"]),
        };
        let shortlist = Shortlist::of_files(&files);
        let paths: Vec<&str> = admitted(&shortlist, &known)
            .iter()
            .map(|f| f.path)
            .collect();
        assert_eq!(paths, ["/net/ok.py"]);
    }

    #[test]
    fn a_new_placement_evicts_the_unwanted_and_copies_the_new_in_first_touch_order() {
        // 100 bytes of SSD: b and c (hotter per byte) displace a.
        let files = [
            file("/net/a", 1, 60, 1),
            file("/net/c", 9, 40, 3),
            file("/net/b", 9, 40, 2),
        ];
        let shortlist = Shortlist::of_files(&files);
        let admitted: Vec<File> = shortlist.files().collect();
        let m = moves_from(&admitted, (100, 0), &["/net/a"], &[], &[]);
        assert_eq!(m.evict, ["/net/a"]);
        assert_eq!(copies(&m), [("/net/b", 40), ("/net/c", 40)]);
        assert!(m.pin.is_empty() && m.unpin.is_empty());
    }

    #[test]
    fn a_file_copied_in_part_takes_the_bytes_of_its_ranges_not_its_size() {
        // A 40 GiB file jobs read 64 MiB of, and a 512 MiB file read whole, under 1 GiB.
        let big = FileEntry {
            bytes_read: 64 << 20,
            ranges: vec![[1 << 30, (1 << 30) + (64 << 20)]],
            ..file("/net/data/train.h5", 1, 40 << 30, 1)
        };
        let files = [big, file("/net/env/lib.so", 1, 512 << 20, 2)];
        let shortlist = Shortlist::of_files(&files);
        let admitted: Vec<File> = shortlist.files().collect();
        let held = Held {
            cached: &|_| false,
            copying: &|_| false,
            pinned: &|_| false,
            copies: Vec::new(),
            in_use: &|_| false,
        };
        // Partial copies from 1 MiB, or none (every copy whole).
        let within = |ssd: u64, partial_from: u64| {
            let takes = |f: &File| placement::takes_in_part(f, &shortlist, partial_from);
            moves(&admitted, &Filters::default(), (ssd, 0), &takes, &held)
        };
        let m = within(1 << 30, 1 << 20);
        let placed: Vec<_> = m.wanted.iter().map(|c| (c.path, c.bytes)).collect();
        assert_eq!(
            placed,
            [
                ("/net/data/train.h5", 64 << 20),
                ("/net/env/lib.so", 512 << 20)
            ]
        );
        // Weighed by its size, it never fits.
        let m = within(1 << 30, 0);
        assert_eq!(copies(&m), [("/net/env/lib.so", 512 << 20)]);
        // Its ranges larger than the budget: it gets all of it (its chunks share out).
        let m = within(32 << 20, 1 << 20);
        let placed: Vec<_> = m.wanted.iter().map(|c| (c.path, c.bytes, c.cut)).collect();
        assert_eq!(placed, [("/net/data/train.h5", 32 << 20, true)]);
        // Not below a chunk's worth; and a whole file is never cut.
        assert!(within(1 << 19, 1 << 20).wanted.is_empty());
        assert!(within(1 << 20, 0).wanted.is_empty());
    }

    #[test]
    fn copies_under_way_are_not_started_again_and_pins_follow_the_ram_budget() {
        let files = [
            file("/net/hot", 100, 4096, 1),
            file("/net/warm", 10, 4096, 2),
        ];
        let shortlist = Shortlist::of_files(&files);
        let admitted: Vec<File> = shortlist.files().collect();
        // Room for both on SSD, one in RAM: the hottest is pinned, the other unpinned.
        let cached = ["/net/hot", "/net/warm"];
        let m = moves_from(&admitted, (1 << 20, 4096), &cached, &[], &["/net/warm"]);
        assert!(m.evict.is_empty() && m.copy.is_empty());
        assert_eq!(m.pin, ["/net/hot"]);
        assert_eq!(m.unpin, ["/net/warm"]);
        let wanted: Vec<_> = m.wanted.iter().map(|c| (c.path, c.pinned, c.at)).collect();
        assert_eq!(wanted, [("/net/hot", true, 0), ("/net/warm", false, 1)]);

        let m = moves_from(&admitted, (1 << 20, 0), &[], &["/net/hot"], &[]);
        assert_eq!(copies(&m), [("/net/warm", 4096)]);
    }

    #[test]
    fn a_write_under_a_snapshot_drops_that_snapshot_only() {
        let roots: HashMap<PathBuf, u8> = [
            (PathBuf::from("/net/env"), 1),
            (PathBuf::from("/net/data"), 2),
        ]
        .into();
        let holding = |p: &str| snapshot_holding(Path::new(p), &roots).map(|(_, v)| *v);
        assert_eq!(holding("/net/env/lib/x.py"), Some(1));
        assert_eq!(holding("/net/env"), Some(1));
        assert_eq!(holding("/net/environ/x"), None);
        assert_eq!(holding("/net/out.log"), None);
        assert_eq!(holding("/net"), None);
    }
}
