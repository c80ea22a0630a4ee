//! Partial copies with the kernel's real pre-content events, on this machine's local
//! filesystem, read by real processes (python3). The network file is a local file here;
//! the daemon's tests read them through a real network mount.

use std::{
    fs::{self, File, OpenOptions},
    os::unix::fs::{FileExt, MetadataExt},
    path::Path,
    process::{Child, Command, Output, Stdio},
    sync::{Arc, atomic::Ordering},
    thread,
    time::Duration,
};

use super::{
    filler::{Filler, Limits},
    guard::{Guard, pidfd_open},
    pre_content::{Group, probe},
    *,
};

const MIB: u64 = 1 << 20;

/// Pre-content events on this kernel and filesystem; on a machine without them (before
/// 6.14) the tests say so and pass, except in CI, whose machines have them.
fn supported(dir: &Path) -> bool {
    match probe(dir) {
        Ok(()) => true,
        Err(e) if std::env::var_os("CI").is_none() => {
            eprintln!("no pre-content events here ({e}): not tested");
            false
        }
        Err(e) => panic!("CI machines have pre-content events (6.14+): {e}"),
    }
}

/// A "network" file of `size` bytes whose every byte says where it is, and a partial
/// copy of it holding `ranges` (grains).
fn network_and_copy(dir: &Path, size: u64, ranges: &[(u32, u32)]) -> (File, Arc<PartialCopy>) {
    let bytes: Vec<u8> = (0..size).map(|i| (i % 251) as u8 + 1).collect();
    fs::write(dir.join("network"), &bytes).unwrap();
    let copy = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(dir.join("copy"))
        .unwrap();
    let mut held = Extents::default();
    for (s, e) in ranges {
        held.add(*s, *e);
    }
    let source = File::open(dir.join("network")).unwrap();
    let partial = PartialCopy::new("network".into(), source, copy.try_clone().unwrap()).unwrap();
    partial.fill_all(&held).unwrap();
    (copy, Arc::new(partial))
}

/// A python3 reading `path` as `script` says (`f`: the file, open for reading).
fn reader(path: &Path, script: &str) -> Child {
    Command::new("python3")
        .arg("-c")
        .arg(format!(
            "import mmap, os, sys\nf = open('{}', 'rb', buffering=0)\n{script}",
            path.display()
        ))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3")
}

fn finished(child: Child) -> Output {
    child.wait_with_output().unwrap()
}

/// What python printed: the bytes read, as the sum of their values, or the error.
fn said(out: &Output) -> String {
    let both = [out.stdout.as_slice(), out.stderr.as_slice()].concat();
    String::from_utf8_lossy(&both).trim().to_owned()
}

/// The sum python prints for bytes `[from, to)` of the network file.
fn sum(from: u64, to: u64) -> u64 {
    (from..to).map(|i| (i % 251) + 1).sum()
}

/// A network file of `size` bytes and its partial copy holding the first MiB, served
/// by a filler of its own; None where the kernel has no pre-content events.
fn served(size: u64) -> Option<(tempfile::TempDir, File, Arc<PartialCopy>, Filler)> {
    let dir = tempfile::tempdir().unwrap();
    if !supported(dir.path()) {
        return None;
    }
    let (copy, partial) = network_and_copy(dir.path(), size, &[(0, 16)]);
    let filler = Filler::start(Group::new().unwrap(), Limits::default()).unwrap();
    filler.serve(partial.clone(), &copy).unwrap();
    Some((dir, copy, partial, filler))
}

fn allocated(file: &File) -> u64 {
    file.metadata().unwrap().blocks() * 512
}

#[test]
fn a_served_copy_takes_ranges_learned_after_it_was_made_and_then_reads_need_no_fill() {
    // 16 MiB, the first MiB held; a job had read 4 MiB from 8 MiB meanwhile.
    let Some((dir, copy, partial, filler)) = served(16 * MIB) else {
        return;
    };
    let mut ranges = Extents::default();
    ranges.add(0, 16);
    ranges.add(128, 192);
    let (growth, lacks) = filler.growth("network", &ranges).expect("it lacks 4 MiB");
    assert_eq!(lacks, 4 * MIB);
    // Its writes are its own: a reader of the copy meanwhile is not kept waiting on them.
    growth.fill(&ranges).unwrap();
    assert_eq!(partial.filled().grains(), [(0, 16), (128, 192)]);
    assert_eq!(allocated(&copy), 5 * MIB);
    assert!(filler.growth("network", &ranges).is_none(), "nothing left");
    // A job reading those 4 MiB again is served with no fill.
    let out = finished(reader(
        &dir.path().join("copy"),
        "print(sum(os.pread(f.fileno(), 4 << 20, 8 << 20)))",
    ));
    assert_eq!(said(&out), sum(8 * MIB, 12 * MIB).to_string());
    assert_eq!(filler.counts.bytes_filled.load(Ordering::Relaxed), 0);
    // Another name is no copy of this one.
    assert!(filler.growth("elsewhere", &ranges).is_none());
}

/// More accesses waiting at once than the kernel queues for a group by default (16,384,
/// `fs.fanotify.max_queued_events`): every one waits for its answer. With the default
/// queue the kernel drops the events past it and lets their reads through unanswered,
/// and they read the holes' zeros (a user's thousands of threads did that to another
/// user's job: issue 51).
#[test]
fn past_the_kernels_default_queue_every_access_still_waits_for_its_answer() {
    let dir = tempfile::tempdir().unwrap();
    if !supported(dir.path()) {
        return;
    }
    // 16 MiB, the first MiB held; nothing answers until the threads have all asked.
    let (copy, _partial) = network_and_copy(dir.path(), 16 * MIB, &[(0, 16)]);
    // The kernel's default bound, lowered to 1,000 for the group made here (a group
    // takes it from fs.fanotify.max_queued_events when it is made): 1,200 accesses
    // then pass it. Thousands more would be slow to answer: each answer wakes every
    // access waiting on the group.
    let sysctl = "/proc/sys/fs/fanotify/max_queued_events";
    let was = fs::read_to_string(sysctl).unwrap();
    fs::write(sysctl, "1000").unwrap();
    let group = Group::new();
    fs::write(sysctl, was.trim()).unwrap();
    let group = group.unwrap();
    group.mark(&copy).unwrap();
    let threads = 1_200;
    let mut child = reader(
        &dir.path().join("copy"),
        &format!(
            "import _thread, time\nlock = _thread.allocate_lock()\nback = [0, 0]\ndef read(i):\n    try:\n        b = os.pread(f.fileno(), 4096, (16 + i % 240) << 16)\n        zeros = b.count(0) == len(b)\n    except OSError:\n        zeros = False\n    with lock:\n        back[0] += 1\n        back[1] += zeros\nfor i in range({threads}):\n    _thread.start_new_thread(read, (i,))\ntime.sleep(3)\nprint(back[0], back[1], flush=True)\nwhile back[0] < {threads}:\n    time.sleep(0.1)\nprint(back[0], back[1], flush=True)\n"
        ),
    );
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let first = lines.next().unwrap().unwrap();
    // Then every one is denied (EIO), as the filler does past its own bound.
    let mut buf = vec![0u8; 4096];
    let mut denied = 0;
    let mut poll = libc::pollfd {
        fd: group.fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd. Two seconds with no event: none is left (some were dropped).
    while denied < threads && unsafe { libc::poll(&raw mut poll, 1, 2000) } > 0 {
        for a in group.wait(&mut buf).unwrap() {
            group.answer(&a, false).unwrap();
            denied += 1;
        }
    }
    let last = lines.next().unwrap().unwrap();
    assert!(finished(child).status.success());
    assert_eq!(
        first, "0 0",
        "reads came back unanswered (back, of them zeros)"
    );
    assert_eq!(denied, threads, "every access asked");
    assert_eq!(
        last,
        format!("{threads} 0"),
        "every read failed, none read zeros"
    );
}

#[test]
fn ranges_not_local_are_filled_from_the_network_file_when_read() {
    // 16 MiB, the first MiB held (16 grains).
    let Some((dir, copy, partial, filler)) = served(16 * MIB) else {
        return;
    };
    assert_eq!(allocated(&copy), MIB, "a sparse file holding the first MiB");

    // A read of 4 KiB at 10 MiB, then one in the held MiB.
    let out = finished(reader(
        &dir.path().join("copy"),
        "print(sum(os.pread(f.fileno(), 4096, 10 << 20)), sum(os.pread(f.fileno(), 100, 5000)))",
    ));
    assert_eq!(
        said(&out),
        format!("{} {}", sum(10 * MIB, 10 * MIB + 4096), sum(5000, 5100))
    );
    // The grain of 64 KiB it fell in was filled, nothing else.
    assert_eq!(partial.filled().grains(), [(0, 16), (160, 161)]);
    assert_eq!(allocated(&copy), MIB + 65536);

    // A reader going through 2 MiB in order from 4 MiB gets read-ahead.
    let out = finished(reader(
        &dir.path().join("copy"),
        "f.seek(4 << 20)\nprint(sum(sum(f.read(65536)) for _ in range(32)))",
    ));
    assert_eq!(said(&out), sum(4 * MIB, 6 * MIB).to_string());
    let filled = partial.filled();
    assert!(
        filled.gaps(64, 96).is_empty() && filled.gaps(96, 100).is_empty(),
        "read ahead: {filled:?}"
    );

    // A mapping asks for all it maps, at the mmap.
    let out = finished(reader(
        &dir.path().join("copy"),
        "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\nprint(sum(m[(12 << 20):(12 << 20) + 1000]))",
    ));
    assert_eq!(said(&out), sum(12 * MIB, 12 * MIB + 1000).to_string());
    assert_eq!(partial.filled().grains(), [(0, 256)]);
    assert!(filler.counts.allowed.load(Ordering::Relaxed) >= 3);
    assert_eq!(
        fs::read(dir.path().join("copy")).unwrap(),
        fs::read(dir.path().join("network")).unwrap()
    );
    // Whole now, so unmarked: its reads no longer ask the filler at all.
    let allowed = filler.counts.allowed.load(Ordering::Relaxed);
    let out = finished(reader(
        &dir.path().join("copy"),
        "print(sum(os.pread(f.fileno(), 4096, 7 << 20)))",
    ));
    assert_eq!(said(&out), sum(7 * MIB, 7 * MIB + 4096).to_string());
    assert_eq!(filler.counts.allowed.load(Ordering::Relaxed), allowed);
}

#[test]
fn a_changed_network_file_fails_the_read_with_eio_and_the_copy_goes() {
    let Some((dir, _copy, partial, _filler)) = served(4 * MIB) else {
        return;
    };
    // The server's file is rewritten in place: same size, new bytes, new mtime.
    thread::sleep(Duration::from_millis(20));
    File::options()
        .write(true)
        .open(dir.path().join("network"))
        .unwrap()
        .write_all_at(&[0xee; 4096], 3 * MIB)
        .unwrap();
    let out = finished(reader(
        &dir.path().join("copy"),
        "print(sum(os.pread(f.fileno(), 4096, 3 << 20)))",
    ));
    assert!(!out.status.success());
    assert!(said(&out).contains("Input/output error"), "{}", said(&out));
    assert!(partial.dropped());
    // Nothing of the new version was written into the old one's copy.
    assert_eq!(partial.filled().grains(), [(0, 16)]);
}

#[test]
fn without_a_guard_a_group_that_goes_away_lets_a_waiting_read_see_zeros() {
    // What the kernel does, and why the guard exists: checked, so that a kernel that
    // changes it is noticed.
    let dir = tempfile::tempdir().unwrap();
    if !supported(dir.path()) {
        return;
    }
    let (copy, _) = network_and_copy(dir.path(), 4 * MIB, &[]);
    let group = Group::new().unwrap();
    group.mark(&copy).unwrap();
    let waiting = reader(
        &dir.path().join("copy"),
        "print(sum(os.pread(f.fileno(), 4096, 1 << 20)))",
    );
    waits_in_the_kernel(&waiting, "the reader waits for the group's answer");
    drop(group);
    assert_eq!(said(&finished(waiting)), "0", "the hole's zeros");
}

#[test]
fn a_daemon_gone_fails_reads_with_eio_and_the_next_one_takes_the_group_back() {
    let dir = tempfile::tempdir().unwrap();
    if !supported(dir.path()) {
        return;
    }
    let (copy, partial) = network_and_copy(dir.path(), 4 * MIB, &[(0, 16)]);
    // The "daemon" the guard stands by for: a process of its own, to be killed.
    // Killed however the test ends: else the guard it stands by for outlives a failure.
    let mut daemon = KilledOnDrop(Command::new("sleep").arg("600").spawn().unwrap());
    let daemon_pidfd = pidfd_open(daemon.0.id() as i32).unwrap();
    let filler = Filler::start(Group::new().unwrap(), Limits::default()).unwrap();
    filler.serve(partial.clone(), &copy).unwrap();
    let guard = Guard::start(filler.group_fd(), &daemon_pidfd).unwrap();
    let guard_pid = guard.pid();
    // The daemon's filler is gone (its threads with it), the group is not: the guard
    // holds it. A read of a hole waits...
    drop(filler);
    let waiting = reader(
        &dir.path().join("copy"),
        "print(sum(os.pread(f.fileno(), 4096, 2 << 20)))",
    );
    waits_in_the_kernel(&waiting, "the reader waits for an answer");
    // ...until the daemon is gone: then it fails, and so does the next, never zeros.
    daemon.0.kill().unwrap();
    daemon.0.wait().unwrap();
    let out = finished(waiting);
    assert!(said(&out).contains("Input/output error"), "{}", said(&out));
    let out = finished(reader(
        &dir.path().join("copy"),
        "print(sum(os.pread(f.fileno(), 4096, 3 << 20)))",
    ));
    assert!(said(&out).contains("Input/output error"), "{}", said(&out));
    // A held range reads as ever (no event is answered but with EIO: reads of it fail
    // too while no daemon runs; what matters is that no hole reads as data).

    // The next daemon finds the guard, takes the group back with its marks and serves
    // the copy again.
    let found = Guard::find(guard_pid).unwrap();
    assert!(
        Guard::find(std::process::id() as i32).is_err(),
        "not a guard"
    );
    let group = Group::from_fd(found.adopt().unwrap());
    assert!(
        !Path::new(&format!("/proc/{guard_pid}")).exists() || {
            // Reaped by its parent (this test process, which forked it) shortly.
            thread::sleep(Duration::from_millis(200));
            !fs::read_to_string(format!("/proc/{guard_pid}/status"))
                .is_ok_and(|s| s.contains("hocus-guard"))
        }
    );
    let filler = Filler::start(group, Limits::default()).unwrap();
    filler.serve(partial, &copy).unwrap();
    let out = finished(reader(
        &dir.path().join("copy"),
        "print(sum(os.pread(f.fileno(), 4096, 3 << 20)))",
    ));
    assert_eq!(said(&out), sum(3 * MIB, 3 * MIB + 4096).to_string());
}

#[test]
fn a_copy_made_before_is_resumed_holding_the_whole_grains_it_has() {
    let dir = tempfile::tempdir().unwrap();
    if !supported(dir.path()) {
        return;
    }
    // Grains 0-16 and 160-161 held; then, as a fill cut short would, half a grain more
    // (a hole after it), and the short last grain of the file.
    let size = 16 * MIB + 1000;
    let (copy, made) = network_and_copy(dir.path(), size, &[(0, 16), (160, 161)]);
    copy.write_all_at(&[7u8; 32768], 200 << 16).unwrap();
    copy.write_all_at(&[7u8; 1000], 16 * MIB).unwrap();
    drop(made);
    let held = held_grains(&copy, size).unwrap();
    assert_eq!(held.grains(), [(0, 16), (160, 161), (256, 257)]);

    let source = File::open(dir.path().join("network")).unwrap();
    let resumed = PartialCopy::resume("network".into(), source, copy.try_clone().unwrap()).unwrap();
    assert_eq!(resumed.filled().grains(), held.grains());
    // Served, it fills the half grain's whole grain from the network.
    let resumed = Arc::new(resumed);
    let filler = Filler::start(Group::new().unwrap(), Limits::default()).unwrap();
    filler.serve(resumed.clone(), &copy).unwrap();
    let out = finished(reader(
        &dir.path().join("copy"),
        "print(sum(os.pread(f.fileno(), 65536, 200 << 16)))",
    ));
    assert_eq!(said(&out), sum(200 << 16, 201 << 16).to_string());
    // A copy whose size is not the network file's is not resumed.
    let source = File::open(dir.path().join("network")).unwrap();
    copy.set_len(size + 1).unwrap();
    assert!(PartialCopy::resume("network".into(), source, copy).is_err());
}

#[test]
fn a_retired_copy_fails_what_it_lacks_until_released_and_its_fills_are_counted() {
    let Some((dir, _copy, _partial, filler)) = served(4 * MIB) else {
        return;
    };
    assert_eq!(filler.held(), [("network".to_owned(), MIB)]);
    let out = finished(reader(
        &dir.path().join("copy"),
        "print(sum(os.pread(f.fileno(), 4096, 2 << 20)))",
    ));
    assert_eq!(said(&out), sum(2 * MIB, 2 * MIB + 4096).to_string());
    assert_eq!(filler.held(), [("network".to_owned(), MIB + 65536)]);

    // The cache dropped it: what it lacks fails, never zeros; what it holds reads.
    filler.retire("network");
    assert!(filler.held().is_empty());
    let out = finished(reader(
        &dir.path().join("copy"),
        "print(sum(os.pread(f.fileno(), 4096, 3 << 20)))",
    ));
    assert!(said(&out).contains("Input/output error"), "{}", said(&out));
    // Released (no job runs): unmarked, its reads ask nothing any more.
    filler.release_retired();
    let allowed = filler.counts.allowed.load(Ordering::Relaxed);
    let out = finished(reader(
        &dir.path().join("copy"),
        "print(sum(os.pread(f.fileno(), 100, 0)))",
    ));
    assert_eq!(said(&out), sum(0, 100).to_string());
    assert_eq!(filler.counts.allowed.load(Ordering::Relaxed), allowed);
}

#[test]
fn a_retired_copy_a_daemon_before_made_stays_marked() {
    let Some((dir, copy, _partial, filler)) = served(4 * MIB) else {
        return;
    };
    // Taken up again as the next daemon would, then dropped by the cache.
    let source = File::open(dir.path().join("network")).unwrap();
    let resumed = PartialCopy::resume("network".into(), source, copy.try_clone().unwrap());
    filler.serve(Arc::new(resumed.unwrap()), &copy).unwrap();
    filler.retire("network");
    filler.release_retired();
    let out = finished(reader(
        &dir.path().join("copy"),
        "print(sum(os.pread(f.fileno(), 4096, 3 << 20)))",
    ));
    assert!(said(&out).contains("Input/output error"), "{}", said(&out));
}

#[test]
fn trimming_punches_the_chunks_read_least_lately_and_a_read_of_them_fills_again() {
    // 16 MiB, the first MiB held (made, never read since: the coldest).
    let Some((dir, copy, partial, filler)) = served(16 * MIB) else {
        return;
    };
    let read = |at: u64| {
        let out = finished(reader(
            &dir.path().join("copy"),
            &format!("print(sum(os.pread(f.fileno(), 4096, {at})))"),
        ));
        assert_eq!(said(&out), sum(at, at + 4096).to_string());
    };
    // Filled: a grain at 5 MiB, one at 9 MiB; then 5 MiB read again (the hottest).
    read(5 * MIB);
    read(9 * MIB);
    read(5 * MIB + 8192);
    assert_eq!(allocated(&copy), MIB + 2 * 65536);
    let heat = partial.heat();
    assert_eq!(heat.iter().map(|h| h.chunk).collect::<Vec<_>>(), [0, 5, 9]);
    assert!(
        heat[0].order == 0 && heat[2].order < heat[1].order,
        "{heat:?}"
    );

    // Open in another process (a job's child that outlived it): never punched.
    let mut holder = Command::new("python3")
        .arg("-c")
        .arg(format!(
            "import sys
f = open('{}', 'rb')
print('open', flush=True)
sys.stdin.read()",
            dir.path().join("copy").display()
        ))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = [0u8; 5];
    std::io::Read::read_exact(holder.stdout.as_mut().unwrap(), &mut line).unwrap();
    assert!(filler.trim_coldest(MIB + 1).is_empty());
    drop(holder.stdin.take());
    holder.wait().unwrap();

    // A MiB and a byte to free: the first MiB, then the grain at 9 MiB.
    let trimmed = filler.trim_coldest(MIB + 1);
    assert_eq!(trimmed, [("network".to_owned(), MIB + 65536)]);
    assert_eq!(filler.held(), [("network".to_owned(), 65536)]);
    assert_eq!(allocated(&copy), 65536, "punched out of the file");
    assert_eq!(partial.filled().grains(), [(80, 81)]);
    // What was punched reads right again, filled from the network; never zeros.
    let filled = filler.counts.bytes_filled.load(Ordering::Relaxed);
    read(100);
    read(9 * MIB);
    assert_eq!(
        filler.counts.bytes_filled.load(Ordering::Relaxed),
        filled + 2 * 65536
    );
    assert_eq!(filler.counts.failed.load(Ordering::Relaxed), 0);
    // Nothing to free, nothing punched.
    assert!(filler.trim_coldest(0).is_empty());
}

/// Waits (10 s at most: a Python reader under load starts slowly) until `process` is
/// blocked in the kernel (state D), as a read waiting on a fill is.
fn waits_in_the_kernel(process: &std::process::Child, what: &str) {
    let status =
        || fs::read_to_string(format!("/proc/{}/status", process.id())).unwrap_or_default();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !status().contains("State:\tD") {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: after 10 s its state is {:?}",
            status().lines().find(|l| l.starts_with("State:"))
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// A child process killed when this goes, however the test ends.
struct KilledOnDrop(std::process::Child);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
