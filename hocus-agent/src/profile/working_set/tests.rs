//! The working set's tests: recording, merging, reading out, exporting.

use std::path::{Path, PathBuf};

use super::{export::FileOrder, *};
use crate::profile::{
    format::{FORMAT_VERSION, FileEntry, to_json},
    shortlist::Shortlist,
};

const T0: u64 = 1_700_000_000_000_000_000;

fn sample() -> WorkingSet {
    let mut ws = WorkingSet::new(T0);
    assert!(ws.open("/net/env/a.py", 1000, T0 + 10));
    assert!(!ws.open("/net/env/a.py", 1001, T0 + 50));
    ws.open("/net/env/b.so", 1000, T0 + 20);
    ws.set_attributes(
        "/net/env/a.py",
        Attributes {
            size: 42,
            mtime_ns: 7,
        },
    );
    ws.add_bytes_read("/net/env/a.py", 84);
    ws.missing("/net/env/nope.py", T0 + 5);
    ws.missing("/net/env/nope.py", T0 + 6);
    ws.mark_written("/net/out/log.txt", T0 + 30);
    ws.dir_opened("/net/env");
    ws.dir_mutated("/net/out");
    ws
}

#[test]
fn an_export_in_parts_is_the_profile_as_it_began() {
    let mut ws = sample();
    ws.missing("/net/env/a.py-x", T0 + 7);
    ws.missing("/net/env/a.py/x", T0 + 8);
    let whole = ws.to_profile();
    let mut order = ws.export_order(None);
    let mut all = ws.export_part(&mut order, 2).unwrap();
    // Recorded mid-export: facts of entries in the order show, new entries do not.
    ws.add_bytes_read("/net/out/log.txt", 5);
    ws.open("/net/env/late.py", 1000, T0 + 1);
    while let Some(part) = ws.export_part(&mut order, 2) {
        // (Fewer while the names are being sorted, a slice per part.)
        assert!(part.len() <= 2);
        all.files.extend(part.files);
        all.missing.extend(part.missing);
        all.dirs.extend(part.dirs);
    }
    let mut want = whole.clone();
    want.files[2].bytes_read += 5;
    assert_eq!(all, want);
    // Names ordered as strings: `a.py-x` and `a.py/x` around `nope.py`.
    let names: Vec<&str> = whole.missing.iter().map(|m| m.path.as_str()).collect();
    assert_eq!(
        names,
        ["/net/env/a.py-x", "/net/env/a.py/x", "/net/env/nope.py"]
    );
    // Under a root, as `retain_under` keeps; an empty export still carries the start.
    let mut order = ws.export_order(Some(Path::new("/net/env")));
    let under = ws.export_part(&mut order, usize::MAX).unwrap();
    let mut want = ws.to_profile();
    want.retain_under(Path::new("/net/env"));
    assert_eq!(under, want);
    let mut order = ws.export_order(Some(Path::new("/elsewhere")));
    assert_eq!(ws.export_part(&mut order, 9).unwrap().started_unix_ns, T0);
    assert!(ws.export_part(&mut order, 9).is_none());
}

#[test]
fn an_export_of_more_names_than_a_slice_sorts_them_across_parts() {
    let mut ws = sample();
    let n = crate::profile::paths::SlicedSort::SLICE * 2 + 5;
    for i in (0..n).rev() {
        ws.missing(&format!("/net/env/many/m{i}.py"), T0 + 9);
    }
    let whole = ws.to_profile();
    let mut order = ws.export_order(None);
    let (mut all, mut parts) = (Profile::default(), 0);
    while let Some(part) = ws.export_part(&mut order, 4096) {
        if parts == 0 {
            all.version = part.version;
            all.started_unix_ns = part.started_unix_ns;
        }
        parts += 1;
        all.files.extend(part.files);
        all.missing.extend(part.missing);
        all.dirs.extend(part.dirs);
    }
    assert_eq!(all, whole);
    // The first part gives the files and reads the first slice of names; 2 more slices
    // are read and 3 runs sorted, one a part, before the first name is given, then
    // 4096 a part (the directories sorted meanwhile, given with the last names).
    assert_eq!(parts, 1 + 4 + n.div_ceil(4096));
}

#[test]
fn records_opens_in_first_touch_order() {
    let p = sample().to_profile();
    let order: Vec<_> = p.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(
        order,
        ["/net/env/a.py", "/net/env/b.so", "/net/out/log.txt"]
    );
    let a = &p.files[0];
    assert_eq!((a.opens, a.bytes_read, a.size, a.mtime_ns), (2, 84, 42, 7));
    assert_eq!((a.first_touch_ns, a.last_touch_ns), (10, 50));
    assert_eq!((a.users, a.uids.clone()), (2, vec![1000, 1001]));
    assert!(!a.written);
    assert!(p.files[2].written);
    assert_eq!(p.missing[0].lookups, 2);
    assert_eq!(p.dirs.len(), 2);
}

#[test]
fn the_hottest_of_many_are_those_a_full_sort_finds() {
    // Agrees with sorting everything (ties by path), few of many or many of few.
    for count in [100u32, 1000] {
        let mut ws = WorkingSet::default();
        for i in 0..count {
            let path = format!("/net/f{i:04}");
            // Opens 1..=7 over and over: many ties, broken by path.
            for _ in 0..(i * 7919 % 7 + 1) {
                ws.open(&path, 1000, u64::from(i));
            }
        }
        let mut all = ws.to_profile().files;
        all.sort_by(|a, b| b.opens.cmp(&a.opens).then_with(|| a.path.cmp(&b.path)));
        let hottest: Vec<_> = ws.hottest(10).into_iter().map(|f| f.opens).collect();
        let expected: Vec<_> = all.iter().take(10).map(|f| f.opens).collect();
        assert_eq!(hottest, expected, "{count} files");
    }
}

/// The same work done on a set whose records and leaf names went to disk (in fours,
/// in sixteen bytes) and on one that kept them in memory.
#[test]
fn records_on_disk_answer_as_records_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let mut on_disk = WorkingSet::new(T0);
    on_disk.files = Records::spilling(Some(dir.path().to_owned()), 4);
    on_disk.paths = Paths::spilling(dir.path(), 16);
    let mut in_memory = WorkingSet::new(T0);
    in_memory.files = Records::spilling(None, 4);
    for ws in [&mut on_disk, &mut in_memory] {
        for i in 0..50u64 {
            let path = format!("/net/env/d{}/f{i}.py", i % 3);
            ws.open(&path, 1000 + (i % 4) as u32, T0 + 100 - i);
            ws.set_attributes(
                &path,
                Attributes {
                    size: i * 4096,
                    mtime_ns: i as i64,
                },
            );
        }
        // Saved: what changes after it changes records already on disk.
        assert_eq!(ws.take_changes().unwrap().len(), 50);
        for i in (0..50u64).step_by(7) {
            let path = format!("/net/env/d{}/f{i}.py", i % 3);
            ws.open(&path, 2000, T0 + 200 + i);
            ws.add_bytes_read(&path, i * 10);
        }
        ws.opened_for_writing("/net/env/d1/f4.py", T0 + 300);
        ws.mark_written("/net/env/d2/f5.py", T0 + 301);
        ws.missing("/net/env/d0/nope.py", T0 + 5);
    }
    let changes = |ws: &mut WorkingSet| ws.take_changes().unwrap();
    assert_eq!(changes(&mut on_disk), changes(&mut in_memory));
    assert_eq!(on_disk.to_profile(), in_memory.to_profile());
    assert_eq!(on_disk.hottest(5), in_memory.hottest(5));
    assert_eq!(on_disk.for_placement(10), in_memory.for_placement(10));
    let roots = [PathBuf::from("/net/env/d1"), PathBuf::from("/net/env")];
    let (top, totals) = on_disk.summary(3, &roots);
    assert_eq!((top, totals.clone()), in_memory.summary(3, &roots));
    assert_eq!(totals[0].files, 17);
    assert_eq!(totals[1].files, 50);
    assert_eq!(totals[1].missing, 1);
    let f = "/net/env/d2/f8.py";
    assert_eq!(on_disk.attributes(f), in_memory.attributes(f));
    assert_eq!(on_disk.to_profile().files.len(), 50);
    assert!(on_disk.files.len() > 0 && dir.path().read_dir().unwrap().count() == 0);
}

#[test]
fn an_export_in_recording_order_lists_nothing_and_one_out_of_order_sorts() {
    let mut ws = WorkingSet::new(T0);
    for i in 0..5 {
        ws.open(&format!("/net/{}", 9 - i), 1000, T0 + 10 * i);
    }
    let order = ws.export_order(None);
    assert!(matches!(order.files, FileOrder::Recorded(5)), "{order:?}");
    let paths = |ws: &WorkingSet| -> Vec<String> {
        ws.to_profile().files.into_iter().map(|f| f.path).collect()
    };
    assert_eq!(
        paths(&ws),
        ["/net/9", "/net/8", "/net/7", "/net/6", "/net/5"]
    );
    // Under a root that leaves some out, or touched before the rest: listed.
    ws.open("/other/x", 1000, T0 + 90);
    assert!(matches!(
        ws.export_order(Some(Path::new("/net"))).files,
        FileOrder::Listed(_)
    ));
    ws.merge(Profile {
        files: vec![FileEntry {
            path: "/net/early".into(),
            opens: 1,
            first_touch_ns: 15,
            ..Default::default()
        }],
        ..Default::default()
    });
    assert!(matches!(ws.export_order(None).files, FileOrder::Listed(_)));
    assert_eq!(
        paths(&ws),
        [
            "/net/9",
            "/net/8",
            "/net/early",
            "/net/7",
            "/net/6",
            "/net/5",
            "/other/x"
        ]
    );
}

#[test]
fn files_touched_at_once_export_by_path() {
    let mut ws = WorkingSet::new(T0);
    for name in ["d", "b", "c", "a"] {
        ws.open(&format!("/net/{name}"), 1000, T0 + 7);
    }
    ws.open("/net/0", 1000, T0 + 9);
    ws.open("/net/z", 1000, T0 + 1);
    let order: Vec<String> = ws.to_profile().files.into_iter().map(|f| f.path).collect();
    assert_eq!(
        order,
        ["/net/z", "/net/a", "/net/b", "/net/c", "/net/d", "/net/0"]
    );
}

#[test]
fn placement_gets_one_missing_name_per_directory_when_bounded() {
    let mut ws = WorkingSet::default();
    for (name, lookups) in [("/net/a/x.so", 1), ("/net/a/y.so", 5), ("/net/a/z.so", 2)] {
        for _ in 0..lookups {
            ws.missing(name, 1);
        }
    }
    ws.missing("/net/b/w.py", 1);
    ws.open("/net/a/real.py", 1000, 1);
    let mut missing: Vec<_> = ws
        .for_placement(2)
        .missing
        .into_iter()
        .map(|m| (m.path, m.lookups))
        .collect();
    missing.sort();
    assert_eq!(
        missing,
        [("/net/a/y.so".to_owned(), 5), ("/net/b/w.py".to_owned(), 1)]
    );
}

/// A bounded shortlist holds the hottest by opens per page, and also the files written
/// or opened for writing, however cold: they keep copies off the cache. Each once.
#[test]
fn a_bounded_view_keeps_the_files_written_or_opened_for_writing() {
    let mut ws = WorkingSet::default();
    for i in 0..10 {
        for _ in 0..5 {
            ws.open(&format!("/net/hot{i}.py"), 1000, 1);
        }
    }
    ws.mark_written("/net/out.log", 2);
    ws.opened_for_writing("/net/lock", 3);
    // Hot and written: in the shortlist once.
    ws.mark_written("/net/hot1.py", 4);
    let shortlist = ws.for_placement(3);
    let mut paths: Vec<&str> = shortlist.files().map(|f| f.path).collect();
    paths.sort();
    assert_eq!(
        paths,
        [
            "/net/hot0.py",
            "/net/hot1.py",
            "/net/hot2.py",
            "/net/lock",
            "/net/out.log"
        ]
    );
}

#[test]
fn format_round_trips() {
    let p = sample().to_profile();
    let back = Profile::from_json(&to_json(&p), Path::new("x.json"), "").unwrap();
    assert_eq!(back, p);
    // and a working set rebuilt from it exports the same profile
    assert_eq!(WorkingSet::from_profile(back).to_profile(), p);
}

#[test]
fn merging_adds_counts_and_keeps_earliest_touch() {
    let mut ws = sample();
    let mut other = WorkingSet::new(T0 + 1_000);
    other.open("/net/env/a.py", 2000, T0 + 1_003);
    other.set_attributes(
        "/net/env/a.py",
        Attributes {
            size: 43,
            mtime_ns: 9,
        },
    );
    other.open("/net/env/c.py", 2000, T0 + 1_001);
    other.missing("/net/env/nope.py", T0 + 1_002);
    other.mark_written("/net/env/b.so", T0 + 1_004);
    ws.merge(other.to_profile());
    let p = ws.to_profile();
    let get = |path: &str| p.files.iter().find(|f| f.path == path).unwrap().clone();
    let a = get("/net/env/a.py");
    assert_eq!(a.opens, 3);
    assert_eq!(
        a.first_touch_ns, 3,
        "the merged profile's offset 3 is earlier than 10"
    );
    assert_eq!((a.size, a.mtime_ns), (43, 9), "newer attributes win");
    assert_eq!(a.uids, [1000, 1001, 2000]);
    assert!(get("/net/env/b.so").written);
    assert_eq!(get("/net/env/c.py").opens, 1);
    assert_eq!(p.missing[0].lookups, 3);
    assert_eq!(p.started_unix_ns, T0);
}

#[test]
fn merging_is_additive_when_done_twice() {
    let p = sample().to_profile();
    let mut ws = WorkingSet::from_profile(p.clone());
    ws.merge(p);
    let doubled = ws.to_profile();
    assert_eq!(doubled.files[0].opens, 4);
    assert_eq!(doubled.files[0].bytes_read, 168);
    assert_eq!(doubled.missing[0].lookups, 4);
    assert_eq!(doubled.dirs[0].opens, 2);
}

#[test]
fn filters_by_root() {
    let mut p = sample().to_profile();
    p.retain_under(Path::new("/net/env"));
    assert_eq!(p.files.len(), 2);
    assert_eq!(p.missing.len(), 1);
    assert_eq!(p.dirs.len(), 1);
    // a sibling with a common string prefix is not under the root
    let mut p = sample().to_profile();
    p.retain_under(Path::new("/net/en"));
    assert!(p.files.is_empty());
}

#[test]
fn a_bounded_working_set_drops_new_reads_but_keeps_writes() {
    let mut ws = WorkingSet::new(T0);
    ws.set_limit(2);
    assert!(ws.open("/net/a", 1, T0));
    ws.missing("/net/nope", T0);
    assert!(!ws.open("/net/b", 1, T0), "full: not recorded");
    ws.missing("/net/nope2", T0);
    ws.dir_opened("/net/d");
    assert!(!ws.open("/net/a", 1, T0 + 1), "known entries still count");
    ws.mark_written("/net/out", T0);
    assert_eq!(ws.counts(), (2, 1, 0));
    assert_eq!(ws.dropped(), 3);
    let p = ws.to_profile();
    assert!(p.files.iter().any(|f| f.path == "/net/out" && f.written));
    assert_eq!(
        p.files.iter().find(|f| f.path == "/net/a").unwrap().opens,
        2
    );
}

/// JAX with a size limit: a job puts an entry and its `-atime` file, and reads every
/// `-atime` file again at each later put; the next job reads the entry back and rewrites
/// the `-atime`. Only the entry is read back.
#[test]
fn a_file_is_read_back_by_a_later_job_not_by_its_writer() {
    let mut ws = WorkingSet::new(T0);
    let (entry, atime) = ("/net/cache/jit_f-cache", "/net/cache/jit_f-atime");
    let back = |ws: &WorkingSet, path: &str| {
        let p = ws.to_profile();
        p.files.iter().find(|f| f.path == path).unwrap().read_back
    };
    ws.job_started(T0 + 1);
    for (path, at) in [(entry, 10), (atime, 11)] {
        ws.open(path, 1000, T0 + at);
        ws.opened_for_writing(path, T0 + at);
        ws.mark_written(path, T0 + at);
    }
    ws.open(atime, 1000, T0 + 20);
    ws.open("/net/env/a.py", 1000, T0 + 21);
    assert!(!back(&ws, entry) && !back(&ws, atime), "its writer read it");
    ws.job_started(T0 + 100);
    ws.open(entry, 1000, T0 + 110);
    ws.open(atime, 1000, T0 + 111);
    ws.opened_for_writing(atime, T0 + 111);
    ws.open("/net/env/a.py", 1000, T0 + 112);
    assert!(back(&ws, entry), "a later job read it");
    assert!(!back(&ws, atime), "rewritten since");
    assert!(!back(&ws, "/net/env/a.py"), "never written");
    // The flag outlives a save and a restore.
    let restored = WorkingSet::from_profile(ws.to_profile());
    assert!(back(&restored, entry) && !back(&restored, atime));
}

/// The shortlist built a record at a time, the loop answering between slices, is the shortlist
/// built at once; and a set that changes between slices still gives a whole shortlist.
#[test]
fn a_view_built_in_slices_is_the_view_built_at_once() {
    let mut ws = WorkingSet::default();
    for i in 0..40u64 {
        for _ in 0..(i % 7 + 1) {
            ws.open(&format!("/net/d{}/f{i}.py", i % 4), 1000, i);
        }
        ws.missing(&format!("/net/d{}/m{i}.so", i % 4), i);
    }
    ws.mark_written("/net/d0/f3.py", 50);
    ws.dir_opened("/net/d1");
    for n in [5, 100] {
        let mut build = ws.shortlist_build(n);
        let mut slices = 0;
        let shortlist = loop {
            slices += 1;
            if let Some(shortlist) = ws.build_shortlist(&mut build, 1) {
                break shortlist;
            }
        };
        assert!(slices > 40, "{slices} slices");
        // One missing name per directory comes in no particular order.
        let sorted = |mut v: Shortlist| {
            v.missing.sort_by(|a, b| a.path.cmp(&b.path));
            v
        };
        assert_eq!(sorted(shortlist), sorted(ws.for_placement(n)), "n = {n}");
    }
    let mut build = ws.shortlist_build(5);
    let mut turn = 0;
    let shortlist = loop {
        turn += 1;
        ws.open(&format!("/net/new/f{turn}.py"), 1000, 100 + turn);
        if let Some(shortlist) = ws.build_shortlist(&mut build, 3) {
            break shortlist;
        }
    };
    assert!(shortlist.len() >= 5, "{}", shortlist.len());
    assert_eq!(shortlist.missing.len(), 4, "one per directory");
}

/// What is read out of a set (a status's summary) is kept while its edits stay the
/// same: every kind of change moves them, and a set taken whole in place of an empty
/// one counts on past both.
#[test]
fn every_change_moves_the_edits() {
    let mut ws = WorkingSet::default();
    let mut last = ws.edits();
    let mut moved = |ws: &WorkingSet, what: &str| {
        assert!(ws.edits() > last, "{what} did not move the edits");
        last = ws.edits();
    };
    ws.open("/net/a.py", 1000, 1);
    moved(&ws, "an open");
    ws.set_attributes(
        "/net/a.py",
        Attributes {
            size: 5,
            mtime_ns: 1,
        },
    );
    moved(&ws, "attributes");
    ws.add_bytes_read("/net/a.py", 10);
    moved(&ws, "bytes read");
    ws.mark_written("/net/a.py", 2);
    moved(&ws, "a write");
    ws.opened_for_writing("/net/a.py", 3);
    moved(&ws, "an open for writing");
    ws.mark_refused("/net/a.py", 4);
    moved(&ws, "a refusal");
    ws.missing("/net/nope", 5);
    moved(&ws, "a failed lookup");
    ws.dir_opened("/net");
    moved(&ws, "a listing");
    ws.dir_mutated("/net");
    moved(&ws, "a directory changed");
    ws.all_changed();
    moved(&ws, "everything changed");
    // A save takes the changes, not their count: what was read out before it holds.
    let before = ws.edits();
    ws.take_changes();
    assert_eq!(ws.edits(), before, "a save moved the edits");

    // An empty set that saw changes takes a set whole (an import into a fresh daemon):
    // its edits count on past its own, never back to the other's.
    let mut empty = WorkingSet::default();
    empty.all_changed();
    empty.all_changed();
    let seen = empty.edits();
    let mut small = WorkingSet::default();
    small.open("/net/w", 0, 1);
    assert!(small.edits() < seen);
    empty.merge_state(small);
    assert!(empty.edits() > seen);
}

#[test]
fn ranges_of_big_files_are_kept_bounded_exported_and_merged() {
    let mut ws = WorkingSet::new(T0);
    let big = "/net/data/train.h5";
    ws.open(big, 1000, T0 + 1);
    ws.set_attributes(
        big,
        Attributes {
            size: 1 << 30,
            mtime_ns: 1,
        },
    );
    ws.open("/net/env/small.py", 1000, T0 + 2);
    // Read before its size was known: kept until it is, then dropped if it is small.
    ws.open("/net/env/soon.py", 1000, T0 + 3);
    ws.read_range("/net/env/soon.py", 0, 1);
    ws.set_attributes(
        "/net/env/small.py",
        Attributes {
            size: 900,
            mtime_ns: 1,
        },
    );
    // 1 MiB at 10 MiB, 1 MiB at 100 MiB (grains of 64 KiB), and a small file read whole.
    ws.read_range(big, 160, 176);
    ws.read_range(big, 1600, 1616);
    ws.read_range(big, 176, 177); // touches the first
    let edits = ws.edits();
    ws.read_range(big, 161, 170); // held already: no change to save
    assert_eq!(ws.edits(), edits);
    ws.read_range("/net/env/small.py", 0, 1);
    ws.read_range("/net/not-opened", 0, 100);
    let p = ws.to_profile();
    let file = |p: &Profile, path: &str| p.files.iter().find(|f| f.path == path).cloned();
    assert_eq!(
        file(&p, big).unwrap().ranges,
        [[10 << 20, (11 << 20) + 65536], [100 << 20, 101 << 20]]
    );
    assert!(file(&p, "/net/env/small.py").unwrap().ranges.is_empty());
    assert_eq!(file(&p, "/net/env/soon.py").unwrap().ranges, [[0, 65536]]);
    ws.set_attributes(
        "/net/env/soon.py",
        Attributes {
            size: 4000,
            mtime_ns: 1,
        },
    );
    assert!(
        file(&ws.to_profile(), "/net/env/soon.py")
            .unwrap()
            .ranges
            .is_empty()
    );
    assert!(file(&p, "/net/not-opened").is_none());

    // Placement sees them (what a partial copy would hold).
    let shortlist = ws.for_placement(100);
    let f = shortlist.files().find(|f| f.path == big).unwrap();
    assert_eq!(
        f.ranges(&shortlist).unwrap().grains(),
        [(160, 177), (1600, 1616)]
    );
    assert!(
        shortlist
            .files()
            .find(|f| f.path == "/net/env/small.py")
            .unwrap()
            .ranges(&shortlist)
            .is_none()
    );

    // Through the file format and back, and merged with another job's ranges.
    let back = Profile::from_json(&to_json(&p), Path::new("x"), "").unwrap();
    assert_eq!(back, p);
    let mut other = WorkingSet::new(T0);
    other.merge(back);
    let mut more = Profile {
        version: FORMAT_VERSION,
        started_unix_ns: T0,
        files: vec![FileEntry {
            path: big.into(),
            size: 1 << 30,
            mtime_ns: 1,
            ranges: vec![[(101 << 20) + 1, 102 << 20], [5, 6]],
            ..Default::default()
        }],
        ..Default::default()
    };
    other.merge(more.clone());
    assert_eq!(
        file(&other.to_profile(), big).unwrap().ranges,
        [
            [0, 65536],
            [10 << 20, (11 << 20) + 65536],
            [100 << 20, 102 << 20]
        ]
    );
    // A range whose end is before its start is not a range: the file's are left alone.
    more.files[0].ranges = vec![[9, 3]];
    other.merge(more.clone());
    assert_eq!(file(&other.to_profile(), big).unwrap().ranges.len(), 3);

    // A profile that read the file whole (it gives no ranges) makes it whole: joined
    // with what it had, and after it, by a job's reads in part, and through a restore.
    let mut said_whole = more.clone();
    said_whole.files[0].ranges = vec![];
    said_whole.files[0].bytes_read = 1 << 30;
    let mut opened_only = said_whole.clone();
    opened_only.files[0].bytes_read = 0;
    other.merge(opened_only);
    assert_eq!(file(&other.to_profile(), big).unwrap().ranges.len(), 3);
    other.merge(said_whole);
    assert!(file(&other.to_profile(), big).unwrap().ranges.is_empty());
    let read_whole = |ws: &WorkingSet| {
        let shortlist = ws.for_placement(100);
        let f = shortlist.files().find(|f| f.path == big).unwrap();
        f.ranges(&shortlist).is_none()
    };
    assert!(read_whole(&other));
    other.read_range(big, 50, 51);
    assert!(read_whole(&other));
    let mut restored = WorkingSet::new(T0);
    for e in other.to_profile().into_entries() {
        restored.restore(e);
    }
    restored.read_range(big, 50, 51);
    assert!(read_whole(&restored));

    // Read whole, a big file says nothing more than a file with no ranges.
    let mut whole = WorkingSet::new(T0);
    whole.open(big, 1000, T0);
    whole.set_attributes(
        big,
        Attributes {
            size: 3 << 20,
            mtime_ns: 1,
        },
    );
    whole.read_range(big, 0, 48);
    assert!(file(&whole.to_profile(), big).unwrap().ranges.is_empty());

    // One file's extents are bounded: past the bound, the smallest gaps are joined.
    for i in 0..2 * crate::profile::extents::MAX_PER_FILE as u32 {
        ws.read_range(big, 4000 + 3 * i, 4001 + 3 * i);
    }
    let kept = file(&ws.to_profile(), big).unwrap().ranges;
    assert_eq!(kept.len(), crate::profile::extents::MAX_PER_FILE);
    assert_eq!(kept.last().unwrap()[1], (4000 + 3 * 2047 + 1) << 16);
    // So does a set that holds it whole (a staged prefetch: its ranges in full, no
    // bytes read said) merged into one that holds it in part.
    let mut staged = WorkingSet::new(T0);
    more.files[0].ranges = vec![[0, 1 << 30]];
    staged.merge(more);
    ws.merge_set(&staged);
    assert!(read_whole(&ws));
}
