use super::*;
use hocus_common::ROOT_NONE;

use crate::observe::places::Watch;
use hocus_common::MAX_PATH;

fn event(kind: u8, path: &str) -> Event {
    let mut e = Event {
        kind,
        _pad: [0; 3],
        flags: 0,
        tgid: std::process::id(),
        uid: 1000,
        time_ns: 1,
        file_id: 7,
        bytes: 0,
        open_flags: 0,
        path_len: path.len() as u32 + 1,
        job: 0,
        root: ROOT_NONE,
        base_len: 0,
        namespace: NamespaceKey::default(),
        generation: 0,
        ns_inum: 0,
        _pad2: 0,
        comm: *b"python3\0\0\0\0\0\0\0\0\0",
        base: [0; MAX_PATH],
        path: [0; MAX_PATH],
    };
    e.path[..path.len()].copy_from_slice(path.as_bytes());
    e
}

/// An event the kernel placed under root `root`, at `base` below it.
fn placed(kind: u8, root: u32, base: &str, path: &str) -> Event {
    let mut e = event(kind, path);
    if path.is_empty() {
        e.path_len = 0;
    }
    e.root = root;
    e.base_len = base.len() as u32;
    e.base[..base.len()].copy_from_slice(base.as_bytes());
    e
}

fn observer() -> Observer {
    let places = Places::new(
        vec![Watch {
            path: "/mnt/net".into(),
            aliases: vec!["/home/net".into()],
        }],
        vec!["/mnt/net".into(), "/".into()],
        1,
    );
    Observer::new(places, Views::new(Vec::new()))
}

#[test]
fn follows_a_file_from_open_to_close() {
    let (mut o, mut ws) = (observer(), WorkingSet::new(0));
    o.handle(&event(kind::OPEN, "/mnt/net/a/../b.py"), &mut ws);
    // the file is read while open; a sweep counts the first 100 bytes
    let key = FdKey {
        tgid: std::process::id(),
        fd: 3,
    };
    let file = OpenFile {
        file_id: 7,
        bytes_read: 100,
        ..Default::default()
    };
    assert!(o.sweep(&[(key, file)], &[], &mut ws).is_empty());
    let mut close = event(kind::CLOSE, "");
    close.path_len = 0;
    close.bytes = 250;
    o.handle(&close, &mut ws);
    let p = ws.to_profile();
    assert_eq!(p.files.len(), 1);
    assert_eq!(p.files[0].path, "/mnt/net/b.py");
    assert_eq!((p.files[0].opens, p.files[0].bytes_read), (1, 250));
    assert!(o.to_stat.contains("/mnt/net/b.py"));
}

#[test]
fn forgets_files_whose_close_was_lost() {
    let (mut o, mut ws) = (observer(), WorkingSet::new(0));
    o.handle(&event(kind::OPEN, "/mnt/net/a.py"), &mut ws);
    // The kernel no longer has it (closed, close event lost): forgotten at the
    // second sweep that misses it, not the first.
    o.sweep(&[], &[], &mut ws);
    assert_eq!(o.open.len(), 1);
    o.sweep(&[], &[], &mut ws);
    assert!(o.open.is_empty());
    // An open file the kernel still has is kept.
    o.handle(&event(kind::OPEN, "/mnt/net/b.py"), &mut ws);
    let key = FdKey {
        tgid: std::process::id(),
        fd: 3,
    };
    let file = OpenFile {
        file_id: 7,
        ..Default::default()
    };
    for _ in 0..3 {
        assert!(o.sweep(&[(key, file)], &[], &mut ws).is_empty());
    }
    assert_eq!(o.open.len(), 1);
    // A process that is gone: its files are closed and the kernel entry forgotten.
    let dead = FdKey {
        tgid: u32::MAX - 1,
        fd: 3,
    };
    assert_eq!(o.sweep(&[(dead, file)], &[], &mut ws), vec![dead]);
    assert!(o.open.is_empty());
}

#[test]
fn drops_paths_that_leave_the_tree_and_maps_aliases() {
    let (mut o, mut ws) = (observer(), WorkingSet::new(0));
    o.handle(&event(kind::MISSING, "/mnt/net/../etc/passwd"), &mut ws);
    o.handle(&event(kind::MISSING, "/home/net/x/nope.py"), &mut ws);
    let p = ws.to_profile();
    assert_eq!(p.missing.len(), 1);
    assert_eq!(p.missing[0].path, "/mnt/net/x/nope.py");
    assert_eq!(o.tally.outside_watched, 1);
}

#[test]
fn places_events_under_their_root() {
    let (mut o, mut ws) = (observer(), WorkingSet::new(0));
    // A directory opened through a container's bind of the tree, then a failed lookup
    // relative to it, and a file opened through hocus's bind of its local copy.
    let mut dir = placed(kind::OPEN, 0, "/pkg", "");
    dir.open_flags = O_DIRECTORY;
    dir.file_id = 1;
    o.handle(&dir, &mut ws);
    o.handle(&placed(kind::MISSING, 0, "/pkg", "sub/mod.py"), &mut ws);
    o.handle(&placed(kind::OPEN, 1, "/mnt/net/lib/a.py", ""), &mut ws);
    // `..` from a directory climbs where the process is, not where the tree is.
    o.handle(&placed(kind::MISSING, 0, "/pkg", "../x.py"), &mut ws);
    // A copy of something outside the watched trees is not watched.
    o.handle(&placed(kind::OPEN, 1, "/etc/passwd", ""), &mut ws);
    let p = ws.to_profile();
    assert_eq!(p.missing.len(), 1);
    assert_eq!(p.missing[0].path, "/mnt/net/pkg/sub/mod.py");
    assert_eq!(p.dirs[0].path, "/mnt/net/pkg");
    assert_eq!(p.files.len(), 1, "a directory is not a file");
    assert_eq!(p.files[0].path, "/mnt/net/lib/a.py");
    assert_eq!((o.tally.unresolved, o.tally.outside_watched), (1, 1));
}

#[test]
fn what_local_copies_served_teaches_nothing_new() {
    let (mut o, mut ws) = (observer(), WorkingSet::new(0));
    // Opened through hocus's bind of its copy, read, closed: hits, nothing learned.
    let mut hit = placed(kind::OPEN, 1, "/mnt/net/lib/a.py", "");
    hit.file_id = 1;
    o.handle(&hit, &mut ws);
    let key = FdKey {
        tgid: std::process::id(),
        fd: 3,
    };
    let read = |bytes_read| OpenFile {
        file_id: 1,
        bytes_read,
        ..Default::default()
    };
    o.sweep(&[(key, read(100))], &[], &mut ws);
    let mut close = placed(kind::CLOSE, 1, "", "");
    close.file_id = 1;
    close.bytes = 200;
    o.handle(&close, &mut ws);
    assert_eq!(o.learned, 0);
    assert_eq!(ws.to_profile().files[0].bytes_read, 200, "hits still count");
    // A write refused on a copy is news; so is an open, a read and a failed lookup
    // that reached the network.
    o.handle(
        &placed(kind::REFUSED_WRITE, 1, "/mnt/net/lib/a.py", ""),
        &mut ws,
    );
    assert_eq!(o.learned, 1);
    let mut miss = event(kind::OPEN, "/mnt/net/lib/b.py");
    miss.file_id = 2;
    o.handle(&miss, &mut ws);
    assert_eq!(o.learned, 2);
    let read_b = OpenFile {
        file_id: 2,
        bytes_read: 10,
        ..Default::default()
    };
    o.sweep(&[(key, read_b)], &[], &mut ws);
    assert_eq!(o.learned, 3);
    o.handle(&event(kind::MISSING, "/mnt/net/lib/c.py"), &mut ws);
    assert_eq!(o.learned, 4);
}

#[test]
fn finds_the_watched_files_a_woken_process_holds() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("held.py");
    std::fs::write(&file, "x").unwrap();
    let tree = dir.path().to_str().unwrap();
    let places = Places::new(
        vec![Watch {
            path: tree.into(),
            aliases: vec![],
        }],
        vec![tree.into(), "/".into()],
        1,
    );
    let mut o = Observer::new(places, Views::new(Vec::new()));
    let mut ws = WorkingSet::new(0);
    let _held = std::fs::File::open(&file).unwrap();
    o.found_open(std::process::id(), &mut ws);
    let path = file.to_str().unwrap();
    assert_eq!(ws.to_profile().files[0].path, path);
    assert_eq!((o.learned, o.accesses.len()), (1, 1));
    // Known from its open event already: not counted twice.
    let mut open = event(kind::OPEN, path);
    open.file_id = 9;
    o.handle(&open, &mut ws);
    o.found_open(std::process::id(), &mut ws);
    assert_eq!(ws.to_profile().files[0].opens, 2);
}

#[test]
fn marks_writes_and_mutated_directories() {
    let (mut o, mut ws) = (observer(), WorkingSet::new(0));
    let mut create = event(kind::OPEN, "/mnt/net/out/new.txt");
    create.open_flags = O_CREAT | O_EXCL | 1;
    o.handle(&create, &mut ws);
    let mut renamed = event(kind::RENAME_TO, "/mnt/net/out/final.txt");
    renamed.file_id = 0; // from a syscall's exit: made
    o.handle(&renamed, &mut ws);
    let p = ws.to_profile();
    assert!(p.files.iter().all(|f| f.written));
    assert_eq!(p.files.len(), 2);
    assert!(p.dirs.iter().any(|d| d.path == "/mnt/net/out" && d.mutated));
}

/// The NFS programs' change numbered `number` (at its function's entry), and the
/// server's answer to it (at its exit).
fn nfs_change(kind: u8, path: &str, number: u64) -> Event {
    let mut e = event(kind, path);
    e.file_id = number;
    e
}

fn answer(number: u64, ret: i64) -> Event {
    let mut e = event(kind::CHANGE_ANSWERED, "");
    e.path_len = 0;
    e.file_id = number;
    e.bytes = ret as u64;
    e
}

#[test]
fn an_nfs_change_counts_only_once_the_server_accepted_it() {
    let (mut o, mut ws) = (observer(), WorkingSet::new(0));
    let written = |ws: &WorkingSet, path: &str| {
        ws.to_profile()
            .files
            .iter()
            .any(|f| f.path == path && f.written)
    };
    // Refused (ENOTEMPTY, EACCES): nothing changed, no copy to drop.
    o.handle(&nfs_change(kind::UNLINK, "/mnt/net/a.py", 11), &mut ws);
    assert!(o.changed.is_empty(), "not before the answer");
    o.handle(&answer(11, -13), &mut ws);
    o.handle(&nfs_change(kind::RMDIR, "/mnt/net/env", 12), &mut ws);
    o.handle(&answer(12, -39), &mut ws);
    assert!(o.changed.is_empty() && !written(&ws, "/mnt/net/a.py"));
    assert!(ws.to_profile().dirs.iter().all(|d| !d.mutated));
    // Accepted: counted, both names of a rename.
    o.handle(&nfs_change(kind::RENAME_FROM, "/mnt/net/b.py", 13), &mut ws);
    o.handle(&nfs_change(kind::RENAME_TO, "/mnt/net/c.py", 14), &mut ws);
    o.handle(&answer(13, 0), &mut ws);
    o.handle(&answer(14, 0), &mut ws);
    assert_eq!(o.changed, ["/mnt/net/b.py", "/mnt/net/c.py"]);
    assert!(written(&ws, "/mnt/net/b.py") && written(&ws, "/mnt/net/c.py"));
    // An answer never seen (lost with a full ring buffer) counts the change as made
    // once it is overdue: its copies go.
    o.changed.clear();
    o.handle(&nfs_change(kind::TRUNCATE, "/mnt/net/d.py", 15), &mut ws);
    let at = o.unix_ns(1);
    o.answers_overdue(at + changes::AWAITED_NS - 1, &mut ws);
    assert!(o.changed.is_empty());
    o.answers_overdue(at + changes::AWAITED_NS, &mut ws);
    assert_eq!(o.changed, ["/mnt/net/d.py"]);
    assert!(o.awaiting.is_empty());
}

/// The request programs' events for a LOOKUP on mount `dev`: asked (by the directory it
/// is in, under root 0, and the name), then answered "no such name" (no path).
fn lookup(dev: u32, unique: u64, base: &str, name: &str) -> (Event, Event) {
    let mut asked = placed(kind::LOOKUP_ASKED, 0, base, name);
    asked.file_id = unique;
    asked.bytes = u64::from(dev);
    let mut failed = event(kind::LOOKUP_FAILED, "");
    failed.path_len = 0;
    failed.file_id = unique;
    failed.bytes = u64::from(dev);
    (asked, failed)
}

#[test]
fn a_lookup_the_server_answered_no_such_name_is_a_failed_lookup() {
    let (mut o, mut ws) = (observer(), WorkingSet::new(0));
    let (asked, failed) = lookup(40, 9, "/pkg", "missing.so");
    let (found, _) = lookup(40, 10, "/pkg", "there.py");
    o.handle(&asked, &mut ws);
    o.handle(&found, &mut ws);
    // Asked is no news: only the answer is.
    assert_eq!(o.learned, 0);
    assert_eq!(ws.to_profile().missing.len(), 0);
    // The same request number on another mount answers nothing here.
    let (_, elsewhere) = lookup(41, 9, "", "");
    o.handle(&elsewhere, &mut ws);
    assert_eq!(ws.to_profile().missing.len(), 0);
    o.handle(&failed, &mut ws);
    let p = ws.to_profile();
    assert_eq!(p.missing.len(), 1);
    assert_eq!(p.missing[0].path, "/mnt/net/pkg/missing.so");
    assert_eq!(o.learned, 1);
    assert_eq!(o.accesses.last().map(|a| a.what), Some(What::Missing));
    // An answer comes once.
    o.handle(&failed, &mut ws);
    assert_eq!(o.tally.failed_lookups, 1);
}

#[test]
fn lookups_never_answered_are_forgotten_oldest_first() {
    let (mut o, mut ws) = (observer(), WorkingSet::new(0));
    for unique in 0..MAX_ASKED as u64 + 10 {
        o.handle(&lookup(40, unique, "", "x").0, &mut ws);
    }
    assert_eq!(o.asked.len(), MAX_ASKED);
    // The oldest went; the newest answers.
    o.handle(&lookup(40, 0, "", "").1, &mut ws);
    o.handle(&lookup(40, MAX_ASKED as u64 + 9, "", "").1, &mut ws);
    assert_eq!(o.tally.failed_lookups, 1);
}

#[test]
fn a_file_the_request_programs_follow_is_counted_until_its_release() {
    let (mut o, mut ws) = (observer(), WorkingSet::new(0));
    o.handle(&event(kind::OPEN, "/mnt/net/data.bin"), &mut ws);
    let file = OpenFile {
        file_id: 7,
        bytes_read: 4096,
        ..Default::default()
    };
    // No descriptor holds it in the syscall program's table: the request programs'
    // entry keeps it open, sweep after sweep, and its bytes are counted.
    for _ in 0..3 {
        assert!(o.sweep(&[], &[file], &mut ws).is_empty());
    }
    assert_eq!(o.open.len(), 1);
    let mut release = event(kind::CLOSE, "");
    release.path_len = 0;
    release.bytes = 8192;
    o.handle(&release, &mut ws);
    let p = ws.to_profile();
    assert_eq!((p.files[0].opens, p.files[0].bytes_read), (1, 8192));
    assert!(o.open.is_empty());
}

#[test]
fn where_a_jobs_reads_lay_goes_to_its_job_too() {
    let (mut o, mut ws) = (observer(), WorkingSet::new(0));
    let mut open = event(kind::OPEN, "/mnt/net/big.bin");
    open.job = 5;
    o.handle(&open, &mut ws);
    let file = OpenFile {
        file_id: 7,
        run: hocus_common::ranges::pack(16, 32),
        ..Default::default()
    };
    // Sweep after sweep reads the run under way: it goes once.
    o.sweep(&[], &[file], &mut ws);
    o.sweep(&[], &[file], &mut ws);
    let grains: Vec<(u32, What)> = o
        .accesses
        .iter()
        .filter(|a| matches!(a.what, What::Grains(..)))
        .map(|a| (a.job, a.what))
        .collect();
    assert_eq!(grains, [(5, What::Grains(16, 32))]);
    // No job's: the node's working set only.
    let mut o = observer();
    o.handle(&event(kind::OPEN, "/mnt/net/big.bin"), &mut ws);
    o.sweep(&[], &[file], &mut ws);
    assert!(
        !o.accesses
            .iter()
            .any(|a| matches!(a.what, What::Grains(..)))
    );
}
