//! Placement: which files of a working set get a local SSD copy, and which of those are
//! pinned in RAM, within budgets.
//!
//! The most valuable bytes first: value is the network time a local copy saves per byte
//! it takes (opens, and bytes read, through `read` or by faulting mapped pages in),
//! first-touch order breaking ties. Scan resistance comes from stability: a file holding a place keeps it
//! unless a candidate is at least twice as valuable. An epoch scan in random order
//! touches every file equally, so the files placed first keep their places epoch after
//! epoch, instead of churning the way an LRU page cache does.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
};

use crate::{
    profile::{
        extents::Extents,
        shortlist::{File, Shortlist},
    },
    shared::settings::Settings,
};

/// A candidate must be this many times as valuable as a placed file to take its place.
const KEEP_FACTOR: f64 = 2.0;
const PAGE: u64 = 4096;
/// Reading this much over a cluster link costs about what one open does: a round trip
/// or two (1 ms at 1 ms RTT) moves ~128 KiB at ~128 MB/s.
const BYTES_LIKE_AN_OPEN: f64 = (128 << 10) as f64;
/// The least share of a budget a file copied in part is given when its ranges do not
/// fit what is left: a data loader's chunk.
const MIN_SHARE: u64 = 1 << 20;

/// What may be cached at all: `--include-ext` and `--exclude`.
#[derive(Debug, Clone, Default)]
pub struct Filters {
    /// Suffixes such as `.py`; empty: everything.
    pub include_ext: Vec<String>,
    pub exclude: Vec<PathBuf>,
}

impl Filters {
    /// `--include-ext` and `--exclude` as set.
    pub fn of(settings: &Settings) -> Filters {
        Filters {
            include_ext: settings
                .include_ext
                .as_deref()
                .map(Filters::parse_extensions)
                .unwrap_or_default(),
            exclude: settings.exclude.clone().unwrap_or_default(),
        }
    }

    pub fn admits(&self, path: &str) -> bool {
        let ext_ok = self.include_ext.is_empty()
            || self.include_ext.iter().any(|e| path.ends_with(e.as_str()));
        ext_ok && !self.exclude.iter().any(|x| Path::new(path).starts_with(x))
    }

    /// Parses `--include-ext .py,.pyc,so` (a missing dot is added).
    pub fn parse_extensions(list: &str) -> Vec<String> {
        list.split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| {
                if e.starts_with('.') {
                    e.to_owned()
                } else {
                    format!(".{e}")
                }
            })
            .collect()
    }
}

/// A file chosen: its place in the shortlist, and its path borrowed from it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice<'a> {
    pub path: &'a str,
    pub size: u64,
    /// What its copy takes of the budgets: its size, or the bytes of the ranges jobs read
    /// for a file copied in part (or what was left of the SSD budget: `cut`).
    pub bytes: u64,
    /// A file copied in part given less than its ranges: the rest of the SSD budget
    /// (its copy holds that much of them, its coldest chunks punched out).
    pub cut: bool,
    /// Its place in the shortlist ([`File::at`]).
    pub at: u32,
    /// Pinned in RAM as well as copied to SSD.
    pub pinned: bool,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Placement<'a> {
    /// Files to hold on SSD, in first-touch order (the copy order).
    pub files: Vec<Choice<'a>>,
    pub ssd_bytes: u64,
    pub ram_bytes: u64,
}

impl Placement<'_> {
    #[cfg(test)]
    pub fn pinned(&self) -> impl Iterator<Item = &Choice<'_>> {
        self.files.iter().filter(|c| c.pinned)
    }
}

/// Whether a file of the profile may be placed at all. Files written recently are kept
/// out by the keeper (they are "unstable" for a while after each change); a file that
/// was written once and is stable since (a compilation cache entry) is cached like any;
/// a file opened for writing again and again, or refused to a job's write, never is.
pub fn cacheable(f: &File, filters: &Filters) -> bool {
    f.opens > 0 && filters.admits(f.path) && !f.kept_on_the_network()
}

fn parent(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(dir, _)| dir)
}

/// What a copy of a file takes when it is copied whole: its size.
#[cfg(test)]
pub fn whole_file(f: &File) -> u64 {
    f.size
}

/// The ranges a partial copy of `f` would hold, where partial copies are made from
/// `partial_from` bytes (0: never): it is that big and jobs read it in part, never
/// mapping it. A file jobs read whole gets a whole copy (pinned, shared, no read
/// asking).
pub fn copied_in_part<'v>(
    f: &File,
    shortlist: &'v Shortlist,
    partial_from: u64,
) -> Option<&'v Extents> {
    if partial_from == 0 || f.size < partial_from {
        return None;
    }
    f.ranges(shortlist).filter(|ranges| !ranges.whole(f.size))
}

/// What a copy of `f` takes where partial copies are made from `partial_from` bytes:
/// the bytes of its ranges, or its size.
pub fn takes_in_part(f: &File, shortlist: &Shortlist, partial_from: u64) -> u64 {
    copied_in_part(f, shortlist, partial_from).map_or(f.size, |r| r.bytes(f.size))
}

/// The network time a local copy of `f` taking `bytes` saves, in opens, per page it
/// takes. A shared library opened once but faulted in for megabytes is worth its pages;
/// one opened once and barely touched is not.
fn value(f: &File, bytes: u64) -> f64 {
    let saved = f64::from(f.opens) + f.bytes_read as f64 / BYTES_LIKE_AN_OPEN;
    saved / bytes.div_ceil(PAGE).max(1) as f64
}

/// Chooses the files to hold. `takes` says what a copy of each takes of the budgets
/// (a file copied in part: the bytes of its ranges, so a 40 GB file read in part fits
/// where its whole copy never would). A file copied in part whose ranges do not fit
/// what is left of a budget gets the rest (at least [`MIN_SHARE`]): its chunks are its
/// own to share out. `held` says which hold a place now (on SSD), and `pinned_now`
/// which are pinned: they keep their places unless clearly outvalued.
///
/// Files are weighed by their place in `files` (a shortlist's, 100k site-wide): no path is
/// copied or hashed, and what is chosen is a flag per candidate.
pub fn place<'a>(
    files: &[File<'a>],
    filters: &Filters,
    ssd_budget: u64,
    ram_budget: u64,
    takes: &dyn Fn(&File) -> u64,
    held: &dyn Fn(&str) -> bool,
    pinned_now: &dyn Fn(&str) -> bool,
) -> Placement<'a> {
    let (budgets, held) = ((ssd_budget, ram_budget), (held, pinned_now));
    place_keeping(files, filters, budgets, takes, held, &|_| false)
}

/// Whether a file (by path) is so: held, pinned, kept.
pub type Says<'s> = &'s dyn Fn(&str) -> bool;

/// [`place`], where the files `kept` says are kept on SSD before any other is weighed
/// (copies running jobs use: docs/security.md): they take their bytes of the SSD budget
/// first, whatever they are worth.
pub fn place_keeping<'a>(
    files: &[File<'a>],
    filters: &Filters,
    (ssd_budget, ram_budget): (u64, u64),
    takes: &dyn Fn(&File) -> u64,
    (held, pinned_now): (Says, Says),
    kept: Says,
) -> Placement<'a> {
    // A directory with a file opened for writing again and again (a lock) is a store
    // its users manage: there a file written waits until a later job reads it back (an
    // entry just put). Its writer reading it does not count: JAX reads every `-atime`
    // file at each put to choose what to evict, then rewrites them at every hit, which a
    // read-only copy would refuse.
    let locked: HashSet<&str> = files
        .iter()
        .filter(|f| f.opened_for_writing())
        .map(|f| parent(f.path))
        .collect();
    let candidates: Vec<&File<'a>> = files
        .iter()
        .filter(|f| cacheable(f, filters))
        .filter(|f| f.read_back || !f.changed() || !locked.contains(parent(f.path)))
        .collect();
    let bytes: Vec<u64> = candidates.iter().map(|f| takes(f)).collect();
    // Which candidates (by position) fit `budget`, weighing `bytes`, the most valuable
    // first; and the share each gets.
    let fill = |budget: u64,
                bonus: &dyn Fn(&str) -> bool,
                first: &dyn Fn(&str) -> bool,
                bytes: &[Option<u64>]| {
        let mut ranked: Vec<(f64, u32)> = (0..candidates.len())
            .filter(|c| bytes[*c].is_some())
            .map(|c| {
                let f = candidates[c];
                let v = value(f, bytes[c].unwrap_or_default());
                let v = if first(f.path) {
                    f64::INFINITY
                } else if bonus(f.path) {
                    v * KEEP_FACTOR
                } else {
                    v
                };
                (v, c as u32)
            })
            .collect();
        ranked.sort_by(|(va, a), (vb, b)| {
            let (a, b) = (candidates[*a as usize], candidates[*b as usize]);
            vb.total_cmp(va)
                .then(a.first_touch_ns.cmp(&b.first_touch_ns))
                .then(a.path.cmp(b.path))
        });
        let mut left = budget;
        let mut chosen: Vec<Option<u64>> = vec![None; candidates.len()];
        for (_, c) in ranked {
            let (c, size) = (c as usize, bytes[c as usize].unwrap_or_default());
            let in_part = size < candidates[c].size;
            if size <= left {
                left -= size;
                chosen[c] = Some(size);
            } else if in_part && left >= MIN_SHARE {
                chosen[c] = Some(left);
                left = 0;
            }
        }
        chosen
    };
    let all: Vec<Option<u64>> = bytes.iter().copied().map(Some).collect();
    let on_ssd = fill(ssd_budget, held, kept, &all);
    let in_ram = fill(ram_budget, pinned_now, &|_| false, &on_ssd);
    let mut order: Vec<u32> = (0..candidates.len() as u32)
        .filter(|c| on_ssd[*c as usize].is_some())
        .collect();
    order.sort_by(|a, b| {
        let (a, b) = (candidates[*a as usize], candidates[*b as usize]);
        (a.first_touch_ns, a.path).cmp(&(b.first_touch_ns, b.path))
    });
    let chosen: Vec<Choice<'a>> = order
        .into_iter()
        .map(|c| {
            let f = candidates[c as usize];
            Choice {
                path: f.path,
                size: f.size,
                bytes: on_ssd[c as usize].unwrap_or_default(),
                cut: on_ssd[c as usize] < Some(bytes[c as usize]),
                at: f.at() as u32,
                pinned: in_ram[c as usize].is_some(),
            }
        })
        .collect();
    Placement {
        ssd_bytes: chosen.iter().map(|c| c.bytes).sum(),
        ram_bytes: chosen.iter().filter(|c| c.pinned).map(|c| c.bytes).sum(),
        files: chosen,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{format::FileEntry, shortlist::Shortlist};

    /// The files of a shortlist of `files` (leaked: a test's placement borrows from it).
    fn listed(files: &[FileEntry]) -> Vec<File<'static>> {
        Box::leak(Box::new(Shortlist::of_files(files)))
            .files()
            .collect()
    }

    fn file(path: &str, size: u64, opens: u64, first: u64) -> FileEntry {
        FileEntry {
            path: path.into(),
            size,
            opens,
            first_touch_ns: first,
            ..Default::default()
        }
    }

    /// `f`, opened `n` times with write access.
    fn opened_for_writing(n: u64, f: FileEntry) -> FileEntry {
        FileEntry {
            write_opens: n,
            ..f
        }
    }

    #[test]
    fn files_opened_for_writing_again_and_again_or_refused_stay_on_the_network() {
        let filters = Filters::default();
        let lock = opened_for_writing(5, file("/net/cache/.lockfile", 0, 5, 0));
        let upgraded = opened_for_writing(2, file("/net/env/numpy/core.py", 100, 300, 0));
        let installed = opened_for_writing(1, file("/net/env/new.py", 100, 1, 0));
        let refused = FileEntry {
            refused: true,
            ..file("/net/cache/entry-atime", 8, 9, 0)
        };
        let four = listed(&[lock.clone(), upgraded, installed, refused]);
        assert!(!cacheable(&four[0], &filters));
        assert!(cacheable(&four[1], &filters), "read far more than written");
        assert!(
            cacheable(&four[2], &filters),
            "written once, then left alone"
        );
        assert!(!cacheable(&four[3], &filters));
        // Beside the lock, an entry written waits, though its writer read it again and
        // again (JAX's -atime files at each put); once a later job reads it back it is
        // placed. Elsewhere no file waits.
        let written_only = opened_for_writing(1, file("/net/cache/jit_f-atime", 8, 4, 1));
        let read_back = FileEntry {
            read_back: true,
            ..opened_for_writing(1, file("/net/cache/jit_f-cache", 8, 2, 2))
        };
        let elsewhere = opened_for_writing(1, file("/net/other/jit_g-cache", 8, 1, 3));
        let files = [lock, written_only, read_back, elsewhere];
        let p = place(
            &listed(&files),
            &filters,
            1 << 30,
            0,
            &whole_file,
            &|_| false,
            &|_| false,
        );
        let held: Vec<&str> = p.files.iter().map(|c| c.path).collect();
        assert_eq!(
            held,
            vec!["/net/cache/jit_f-cache", "/net/other/jit_g-cache"]
        );
    }

    #[test]
    fn the_most_valuable_bytes_come_first_within_budgets() {
        let files = vec![
            file("/n/big-cold", 1 << 20, 1, 0),
            file("/n/small-hot", 4096, 50, 1),
            file("/n/mid", 64 << 10, 10, 2),
            file("/n/probed-only", 4096, 0, 3),
        ];
        let p = place(
            &listed(&files),
            &Filters::default(),
            100 << 10,
            8192,
            &whole_file,
            &|_| false,
            &|_| false,
        );
        let held: Vec<_> = p.files.iter().map(|c| (c.path, c.pinned)).collect();
        assert_eq!(held, [("/n/small-hot", true), ("/n/mid", false)]);
        assert_eq!((p.ssd_bytes, p.ram_bytes), (4096 + (64 << 10), 4096));
        assert!(p.ssd_bytes <= 100 << 10 && p.ram_bytes <= 8192);
    }

    #[test]
    fn a_library_faulted_in_for_megabytes_outranks_one_barely_touched() {
        // Two 8 MiB shared objects, each opened once: one mapped and faulted in whole
        // (its pages counted as bytes read), one only opened. Room for one.
        let used = FileEntry {
            bytes_read: 8 << 20,
            ..file("/n/lib/libused.so", 8 << 20, 1, 1)
        };
        let unused = FileEntry {
            bytes_read: 832, // ld.so's read of the ELF header
            ..file("/n/lib/libunused.so", 8 << 20, 1, 0)
        };
        let files = [unused, used];
        let p = place(
            &listed(&files),
            &Filters::default(),
            9 << 20,
            0,
            &whole_file,
            &|_| false,
            &|_| false,
        );
        let held: Vec<_> = p.files.iter().map(|c| c.path).collect();
        assert_eq!(held, ["/n/lib/libused.so"]);
    }

    #[test]
    fn ties_are_broken_by_first_touch_and_the_copy_order_is_first_touch() {
        let files: Vec<_> = (0..10)
            .map(|i| file(&format!("/n/{i}"), 4096, 1, 10 - i))
            .collect();
        let p = place(
            &listed(&files),
            &Filters::default(),
            3 * 4096,
            4096,
            &whole_file,
            &|_| false,
            &|_| false,
        );
        let order: Vec<_> = p.files.iter().map(|c| c.path).collect();
        assert_eq!(order, ["/n/9", "/n/8", "/n/7"]);
        assert!(p.files[0].pinned && !p.files[1].pinned);
    }

    #[test]
    fn an_epoch_scan_keeps_a_stable_subset() {
        // 100 equal files, room for 50 in RAM. Epoch after epoch in a new order, the
        // pinned set must not change, also mid-epoch when some files are one read ahead.
        let n = 100;
        let mut files: Vec<_> = (0..n)
            .map(|i| file(&format!("/d/{i}"), 1 << 20, 1, i))
            .collect();
        let budget = 50 << 20;
        let first = place(
            &listed(&files),
            &Filters::default(),
            u64::MAX,
            budget,
            &whole_file,
            &|_| false,
            &|_| false,
        );
        let pinned: HashSet<String> = first.pinned().map(|c| c.path.to_owned()).collect();
        let held: HashSet<String> = first.files.iter().map(|c| c.path.to_owned()).collect();
        assert_eq!(pinned.len(), 50);
        let mut order: Vec<usize> = (0..n as usize).collect();
        for epoch in 2..6u64 {
            order.reverse();
            order.rotate_left(7 * epoch as usize);
            for (k, i) in order.iter().enumerate() {
                files[*i].opens = epoch;
                if k % 10 == 0 {
                    let p = place(
                        &listed(&files),
                        &Filters::default(),
                        u64::MAX,
                        budget,
                        &whole_file,
                        &|p| held.contains(p),
                        &|p| pinned.contains(p),
                    );
                    let now: HashSet<String> = p.pinned().map(|c| c.path.to_owned()).collect();
                    assert_eq!(
                        now, pinned,
                        "epoch {epoch}, after {k} files: the pinned set churned"
                    );
                }
            }
        }
    }

    #[test]
    fn a_clearly_hotter_file_takes_a_place() {
        let files = vec![file("/n/old", 4096, 5, 0), file("/n/new", 4096, 11, 1)];
        let held: HashSet<String> = ["/n/old".to_owned()].into();
        let p = place(
            &listed(&files),
            &Filters::default(),
            4096,
            4096,
            &whole_file,
            &|p| held.contains(p),
            &|p| held.contains(p),
        );
        assert_eq!(p.files[0].path, "/n/new");
    }

    #[test]
    fn filters_include_extensions_and_exclude_trees() {
        let f = Filters {
            include_ext: Filters::parse_extensions(".py, pyc,.so"),
            exclude: vec!["/n/secret".into()],
        };
        assert!(f.admits("/n/a.py") && f.admits("/n/a.pyc") && f.admits("/n/x.so"));
        assert!(!f.admits("/n/a.txt"));
        assert!(!f.admits("/n/secret/a.py"));
        assert!(f.admits("/n/secretive/a.py"));
    }
}
