//! Partial copies (docs/partial-copies.md): a big file jobs read in part is held as the
//! ranges they read, bound into jobs like any copy, and what it lacks is filled from the
//! network when read, through the kernel's pre-content events (Linux 6.14; this
//! machine's kernel). Real sshfs, real daemon, real Python jobs.

use std::{
    fs,
    os::unix::{
        fs::{MetadataExt, PermissionsExt},
        process::CommandExt,
    },
    path::Path,
};

use hocus_tests::{Agent, NetworkMount, assert_success, repeating_bytes, wait_until};
use serde_json::json;

const MIB: u64 = 1 << 20;

/// What the file holds at byte `i`.
fn byte(i: u64) -> u8 {
    (i % 251) as u8 + 1
}

/// The sum of bytes `[from, from + n)`: what the jobs print for a read of them.
fn sum(from: u64, n: u64) -> u64 {
    (from..from + n).map(|i| u64::from(byte(i))).sum()
}

/// A daemon with partial copies from 8 MiB and an SSD budget of 16 MiB, and a 32 MiB
/// file on the network (twice the budget) that a profile says jobs read 1 MiB of, at
/// 4 MiB; prefetched. The copy takes the bytes of its ranges, so it fits.
fn prefetched(net: &NetworkMount) -> (Agent, std::path::PathBuf) {
    prefetched_with(net, &["--ssd-budget", "16M"])
}

/// The same with these settings (an SSD budget among them).
fn prefetched_with(net: &NetworkMount, settings: &[&str]) -> (Agent, std::path::PathBuf) {
    prefetched_through(net, &net.mount, settings)
}

/// The same, the daemon watching `mount`, a client of `net`'s server.
fn prefetched_through(
    net: &NetworkMount,
    mount: &Path,
    settings: &[&str],
) -> (Agent, std::path::PathBuf) {
    net.put(
        "data/train.bin",
        &repeating_bytes(32 * MIB as usize, 251, 1),
    );
    let data = mount.join("data/train.bin");
    let mut args = vec!["--watch", mount.to_str().unwrap(), "--partial-from", "8M"];
    args.extend_from_slice(settings);
    let agent = Agent::start(&args);
    let route = agent.route("big files read in part");
    assert!(route.starts_with("partial copies from 8.0 MiB"), "{route}");
    let profile = json!({
        "version": 2, "started_unix_ns": 1, "missing": [], "dirs": [],
        "files": [{"path": data, "size": 32 * MIB, "opens": 5, "bytes_read": MIB, "first_touch_ns": 1, "written": false, "uids": [0], "ranges": [[4 * MIB, 5 * MIB]]}],
    });
    let work = tempfile::tempdir().unwrap();
    let path = work.path().join("profile.json");
    fs::write(&path, serde_json::to_vec(&profile).unwrap()).unwrap();
    assert_success(
        &agent
            .cli(&["prefetch", "--profile", path.to_str().unwrap()])
            .output()
            .unwrap(),
    );
    agent.settled();
    (agent, data)
}

/// A job reading 4 KiB at each of `offsets` of `path`; what it printed (the sums, or
/// the error).
fn read_at(agent: &Agent, path: &Path, offsets: &[u64]) -> String {
    let out = agent.run_job(&format!(
        "python3 -c \"import os\nfd = os.open('{}', os.O_RDONLY)\nprint(*[sum(os.pread(fd, 4096, at)) for at in {offsets:?}])\" 2>&1",
        path.display()
    ));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn a_big_file_read_in_part_is_copied_in_part_and_filled_when_read() {
    let net = NetworkMount::start();
    let (agent, data) = prefetched(&net);
    let local = agent.local_copy(&data);
    let held = |f: &Path| fs::metadata(f).unwrap().blocks() * 512;
    // The file's size, holding the 1 MiB read: the cache counts what it holds.
    assert_eq!(fs::metadata(&local).unwrap().len(), 32 * MIB);
    assert_eq!(held(&local), MIB);
    let cache = agent.cache();
    assert_eq!(cache["cached_bytes"], MIB, "{cache:#}");
    // Pinned in RAM by the range it holds, its holes untouched (not filled by the pin).
    wait_until(10, "the partial copy pinned", || {
        agent.cache()["pinned_files"] == 1
    });
    assert_eq!(agent.cache()["pinned_bytes"], MIB);
    assert_eq!(held(&local), MIB);

    // A job reads the held range and one the copy lacks: both right, the second
    // filled from the network (its grain of 64 KiB), nothing else.
    let sums = read_at(&agent, &data, &[4 * MIB + 100, 20 * MIB]);
    assert_eq!(
        sums,
        format!("{} {}", sum(4 * MIB + 100, 4096), sum(20 * MIB, 4096))
    );
    assert_eq!(held(&local), MIB + 65536);
    // Budgets count what fills add.
    wait_until(10, "the fill counted in the cache's bytes", || {
        agent.cache()["cached_bytes"] == MIB + 65536
    });
    // The grain filled holds the file's bytes (read where it is held: a read of the
    // whole copy would fill it all, past the budget).
    let mut grain = vec![0u8; 65536];
    std::os::unix::fs::FileExt::read_exact_at(
        &fs::File::open(&local).unwrap(),
        &mut grain,
        20 * MIB,
    )
    .unwrap();
    assert!(
        grain
            .iter()
            .enumerate()
            .all(|(i, b)| *b == byte(20 * MIB + i as u64))
    );
}

#[test]
fn past_the_budget_the_chunks_read_least_lately_are_punched_out_and_read_right_again() {
    let net = NetworkMount::start();
    // Within 3 MiB: the copy holds the profile's MiB at 4 MiB, never read since.
    let (agent, data) = prefetched_with(&net, &["--ssd-budget", "3M"]);
    let local = agent.local_copy(&data);
    let held = |f: &Path| fs::metadata(f).unwrap().blocks() * 512;
    assert_eq!(held(&local), MIB);
    // A job reads 3 MiB at 20 MiB: its fill has room for 2 MiB; the MiB read least
    // lately (at 4 MiB, never read) is punched out to make the rest, not the copy
    // evicted nor the budget passed.
    let job = |at: u64, n: u64| {
        let out = agent.run_job(&format!(
            "python3 -c \"import os\nfd = os.open('{}', os.O_RDONLY)\nprint(sum(os.pread(fd, {n}, {at})))\" 2>&1",
            data.display()
        ));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            sum(at, n).to_string()
        );
    };
    job(20 * MIB, 3 * MIB);
    wait_until(20, "the coldest MiB punched out", || {
        agent.cache()["partial_bytes_trimmed"] == MIB
    });
    let cache = agent.settled();
    assert_eq!(
        (&cache["cached_files"], &cache["cached_bytes"]),
        (&json!(1), &json!(3 * MIB)),
        "{cache:#}"
    );
    assert_eq!(held(&local), 3 * MIB);
    assert!(
        agent.log().contains("read least lately punched out"),
        "{}",
        agent.log()
    );
    // The hot MiBs are read from the copy (nothing filled); the punched one reads
    // right, filled from the network again once the others were read long enough ago
    // to be punched while a job runs; nothing failed.
    let filled = agent.cache()["partial_bytes_filled"].as_u64().unwrap();
    job(20 * MIB, 3 * MIB);
    assert_eq!(agent.cache()["partial_bytes_filled"], filled);
    std::thread::sleep(std::time::Duration::from_secs(11));
    job(4 * MIB, 4096);
    assert_eq!(
        agent.cache()["partial_bytes_filled"].as_u64().unwrap(),
        filled + 65536
    );
    assert_eq!(agent.cache()["partial_reads_failed"], 0);
}

/// What python printed reading 4 KiB at `at` of `path` (the sum, or the error).
fn pread(path: &Path, at: u64) -> String {
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(format!(
            "import os\nfd = os.open('{}', os.O_RDONLY)\ntry:\n    print(sum(os.pread(fd, 4096, {at})))\nexcept OSError as e:\n    print(e.strerror)",
            path.display()
        ))
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn guard_of(agent: &Agent) -> Option<i32> {
    let pid: i32 = fs::read_to_string(agent.cache_dir.join("guard.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .is_ok_and(|c| c.trim() == "hocus-guard")
        .then_some(pid)
}

#[test]
fn a_killed_daemon_leaves_what_is_not_local_failing_never_zeros_and_the_next_serves_it_again() {
    let net = NetworkMount::start();
    let (mut agent, data) = prefetched(&net);
    let local = agent.local_copy(&data);
    let guard = guard_of(&agent).expect("a guard beside a daemon serving a partial copy");
    let ino = fs::metadata(&local).unwrap().ino();
    agent.kill9();
    // The daemon is gone, its guard is not: a read of what the copy lacks fails, never
    // reads the hole's zeros; so does one of what it holds (the guard fills nothing).
    assert_eq!(pread(&local, 24 * MIB), "Input/output error");
    assert_eq!(pread(&local, 4 * MIB), "Input/output error");
    assert_eq!(
        fs::metadata(&local).unwrap().blocks() * 512,
        MIB,
        "nothing written"
    );

    // The next daemon takes the group back from the guard (and stops it), finds the
    // network file unchanged and serves the same copy again: a job that still has it
    // bound (here: its very inode) reads what it lacks, filled from the network.
    let (dir, state) = agent.into_dirs();
    let watch = net.mount.to_str().unwrap().to_owned();
    let mut next =
        Agent::start_with_state(dir, state, &["--watch", &watch, "--partial-from", "8M"]);
    wait_until(10, "the old guard to stop", || {
        !Path::new(&format!("/proc/{guard}")).exists()
    });
    assert!(next.log().contains("took back the group"), "{}", next.log());
    assert!(
        guard_of(&next).is_some(),
        "a guard of its own for the group taken back"
    );
    wait_until(30, "the partial copy served again", || {
        next.log()
            .contains("the partial copy made before is served again")
    });
    assert_eq!(fs::metadata(&local).unwrap().ino(), ino, "the same copy");
    assert_eq!(pread(&local, 24 * MIB), sum(24 * MIB, 4096).to_string());
    assert_eq!(pread(&local, 4 * MIB), sum(4 * MIB, 4096).to_string());
    assert_eq!(fs::metadata(&local).unwrap().blocks() * 512, MIB + 65536);
    // And a new job is served by it.
    let sums = read_at(&next, &data, &[4 * MIB + 100, 28 * MIB]);
    assert_eq!(
        sums,
        format!("{} {}", sum(4 * MIB + 100, 4096), sum(28 * MIB, 4096))
    );
    assert_eq!(
        fs::metadata(&local).unwrap().blocks() * 512,
        MIB + 2 * 65536
    );
    assert_eq!(next.cache()["partial_bytes_filled"], 2 * 65536);

    // Stopped with no job running, it leaves no guard; the next daemon then finds the
    // copy unmarked and unserved, and drops it when it makes no partial copies.
    next.stop();
    assert!(guard_of(&next).is_none());
    let (dir, state) = next.into_dirs();
    let last = Agent::start_with_state(dir, state, &["--watch", &watch, "--partial-from", "0"]);
    wait_until(10, "the partial copy dropped", || !local.exists());
    assert!(
        last.log().contains("not served again: deleted"),
        "{}",
        last.log()
    );
}

#[test]
fn a_job_killed_while_it_waits_on_a_fill_goes_and_the_daemon_serves_the_next() {
    let net = NetworkMount::start();
    let (agent, data) = prefetched(&net);
    // A job started (its copies checked against the server), then the server hangs,
    // then the job reads what the copy lacks: it waits on the fill.
    let work = tempfile::tempdir().unwrap();
    let go = work.path().join("go");
    let mut client = agent
        .python_job(&format!(
            "import os, time\nfd = os.open('{}', os.O_RDONLY)\nwhile not os.path.exists('{}'): time.sleep(0.05)\nos.pread(fd, 4096, 20 << 20) # waits on a fill",
            data.display(),
            go.display()
        ))
        .spawn()
        .unwrap();
    // The job itself (the daemon forks it; `run` is its caller's end).
    let mut job = 0;
    wait_until(20, "the job started", || {
        job = fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
            .find(|pid| {
                fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains("# waits on a fill"))
                    && fs::read_to_string(format!("/proc/{pid}/comm"))
                        .is_ok_and(|c| c.starts_with("python"))
            })
            .unwrap_or(0);
        job > 0
    });
    let paused = net.pause_server();
    fs::write(&go, "").unwrap();
    wait_until(20, "the job waiting on the fill", || {
        fs::read_to_string(format!("/proc/{job}/wchan")).is_ok_and(|w| w.contains("fanotify"))
    });
    // Killed there, it goes at once: the wait is killable.
    // SAFETY: plain kill(2).
    unsafe { libc::kill(job, libc::SIGKILL) };
    let killed = std::time::Instant::now();
    client.wait().unwrap();
    assert!(killed.elapsed().as_secs() < 5, "{:?}", killed.elapsed());
    assert!(
        !Path::new(&format!("/proc/{job}/cmdline")).exists() || {
            std::thread::sleep(std::time::Duration::from_millis(500));
            !Path::new(&format!("/proc/{job}")).exists()
        }
    );
    drop(paused);
    // The fill ends with nobody to answer; the next job is served, the range too.
    let sums = read_at(&agent, &data, &[20 * MIB, 4 * MIB]);
    assert_eq!(
        sums,
        format!("{} {}", sum(20 * MIB, 4096), sum(4 * MIB, 4096))
    );
    assert_eq!(agent.cache()["partial_reads_failed"], 0);
}

#[test]
fn a_fill_the_server_does_not_answer_fails_the_read_at_the_bound_never_hangs() {
    let net = NetworkMount::start();
    let (agent, data) = prefetched_with(&net, &["--ssd-budget", "16M", "--fill-timeout", "2"]);
    // A job started (its copies checked against the server), then the server hangs,
    // then the job reads what the copy lacks.
    let work = tempfile::tempdir().unwrap();
    let go = work.path().join("go");
    let client = agent
        .python_job(&format!(
            "import os, time\nfd = os.open('{}', os.O_RDONLY)\nwhile not os.path.exists('{}'): time.sleep(0.05)\nt = time.monotonic()\ntry:\n    os.pread(fd, 4096, 20 << 20)\n    print('read')\nexcept OSError as e:\n    print(e.errno, round(time.monotonic() - t, 1))",
            data.display(),
            go.display()
        ))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_until(20, "the job started", || agent.cache()["jobs_running"] == 1);
    let paused = net.pause_server();
    fs::write(&go, "").unwrap();
    let out = client.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    // EIO, after the 2 s bound (and well before the default 30 s).
    let (errno, secs) = said.split_once(' ').expect(&said);
    assert_eq!(errno, "5", "{said}");
    let secs: f64 = secs.parse().unwrap();
    assert!((1.9..15.0).contains(&secs), "{said}");
    // Counted as the keeper takes the filler's counts (each second).
    wait_until(10, "the failed read counted", || {
        agent.cache()["partial_reads_failed"].as_u64() >= Some(1)
    });
    // Once the server answers, the same range reads right.
    drop(paused);
    let sums = read_at(&agent, &data, &[20 * MIB]);
    assert_eq!(sums, sum(20 * MIB, 4096).to_string());
}

#[test]
fn a_file_changed_on_the_server_between_two_jobs_is_read_new_never_mixed() {
    let net = NetworkMount::start();
    let (agent, data) = prefetched(&net);
    let sums = read_at(&agent, &data, &[4 * MIB, 20 * MIB]);
    assert_eq!(
        sums,
        format!("{} {}", sum(4 * MIB, 4096), sum(20 * MIB, 4096))
    );
    // Rewritten on the server, in place: the same size, every byte another, and a later
    // mtime (SFTP's are whole seconds).
    let mtime = |p: &std::path::Path| fs::metadata(p).unwrap().modified().unwrap();
    let before = mtime(&data);
    let new = repeating_bytes(32 * MIB as usize, 251, 8);
    while std::time::SystemTime::now() <= before + std::time::Duration::from_secs(1) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    fs::write(net.server_path("data/train.bin"), &new).unwrap();
    // The job starts once a plain process sees the change: sshfs's cache and the
    // kernel's each keep attributes a second (dcache_timeout=1), as NFS's attribute
    // cache would. A job started before that is served the copy, as a plain process
    // would be shown the file it saw.
    wait_until(30, "a plain process to see the rewrite", || {
        mtime(&data) != before
    });
    let new_sum = |at: u64| -> u64 {
        new[at as usize..at as usize + 4096]
            .iter()
            .map(|b| u64::from(*b))
            .sum()
    };
    // What the copy held, what a fill made local, and what neither had: all new.
    let sums = read_at(&agent, &data, &[4 * MIB, 20 * MIB, 28 * MIB]);
    assert_eq!(
        sums,
        format!(
            "{} {} {}",
            new_sum(4 * MIB),
            new_sum(20 * MIB),
            new_sum(28 * MIB)
        )
    );
}

#[test]
fn a_file_rewritten_in_place_under_a_jobs_open_copy_is_never_read_mixed() {
    let net = NetworkMount::start();
    // A client whose kernel keeps attributes and names 30 s and that keeps none of its
    // own, read-only (as datasets are often mounted): its reads invalidate no atime, and
    // a lookup by path asks nothing (a lookup's answer would refresh the attributes: CI
    // of ee1c51e), so nothing makes a plain stat ask the server within those 30 s. What
    // a fill checks must come from the server (on NFS, noatime and actimeo do the same).
    let client = net.another_client("ro,cache=no,attr_timeout=30,entry_timeout=30");
    let (agent, data) = prefetched_through(&net, &client.mount, &["--ssd-budget", "16M"]);
    let work = tempfile::tempdir().unwrap();
    let (ready, go) = (work.path().join("ready"), work.path().join("go"));
    // The job opens the file, reads the range its copy holds, and waits; then reads one
    // the copy lacks, after the rewrite.
    let script = format!(
        "import os, time\nfd = os.open('{data}', os.O_RDONLY)\nprint(sum(os.pread(fd, 4096, {held})))\nopen('{ready}', 'w').close()\nwhile not os.path.exists('{go}'): time.sleep(0.05)\ntry:\n    print(sum(os.pread(fd, 4096, {lacks})))\nexcept OSError as e:\n    print(os.strerror(e.errno))\n",
        data = data.display(),
        held = 4 * MIB,
        lacks = 20 * MIB,
        ready = ready.display(),
        go = go.display(),
    );
    let job = agent.python_job_started(&script);
    wait_until(60, "the job read the range its copy holds", || {
        ready.exists()
    });
    // Rewritten on the server, in place: every byte another, a later mtime (whole
    // seconds over SFTP). This client's kernel still shows the old attributes.
    let mtime = |p: &Path| fs::metadata(p).unwrap().modified().unwrap();
    let before = mtime(&data);
    let new = repeating_bytes(32 * MIB as usize, 251, 8);
    while std::time::SystemTime::now() <= before + std::time::Duration::from_secs(1) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    fs::write(net.server_path("data/train.bin"), &new).unwrap();
    assert_eq!(
        mtime(&data),
        before,
        "the client's attributes are not cached"
    );
    fs::write(&go, b"").unwrap();
    let out = job.wait_with_output().unwrap();
    assert_success(&out);
    let new_sum: u64 = new[20 * MIB as usize..20 * MIB as usize + 4096]
        .iter()
        .map(|b| u64::from(*b))
        .sum();
    // The old bytes where its copy held them; then the read of the new version's
    // bytes fails, never mixing the two.
    let printed = String::from_utf8_lossy(&out.stdout);
    assert_ne!(
        printed.lines().nth(1),
        Some(new_sum.to_string().as_str()),
        "one open file read two versions: {printed}\n{}",
        agent.log()
    );
    assert_eq!(
        printed.trim(),
        format!("{}\nInput/output error", sum(4 * MIB, 4096)),
        "{}",
        agent.log()
    );
    assert!(
        agent
            .log()
            .contains("the network file changed since its copy was made"),
        "{}",
        agent.log()
    );
}

#[test]
fn h5py_slices_are_served_by_a_partial_copy_and_a_numpy_memmap_by_a_whole_one() {
    let packages = hocus_tests::numpy_h5py();
    let net = NetworkMount::start();
    // 64 MiB of HDF5: a float32 dataset of 1024 rows of 64 KiB, row r holding
    // r * 16384 .. (r + 1) * 16384; and 16 MiB of frames a job maps.
    let (made, _) = hocus_tests::hdf5_rows(&packages);
    let h5 = net.put("data/train.h5", &made);
    let frames = net.put(
        "data/frames.u8",
        &hocus_tests::counting_bytes(16 * MIB as usize),
    );
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--partial-from",
        "8M",
    ]);
    // The sum of rows [a, b) of the dataset, as a job prints it.
    let rows = |a: u64, b: u64| -> String { (a * 16384..b * 16384).sum::<u64>().to_string() };
    let slice = |a: u64, b: u64| {
        format!(
            "import h5py\nwith h5py.File('{}', 'r') as f:\n    print(int(f['x'][{a}:{b}].astype('float64').sum()))",
            h5.display()
        )
    };
    let memmap = format!(
        "import numpy as np\nm = np.memmap('{}', dtype=np.uint8, mode='r')\nprint(int(m[3 << 20:4 << 20].sum()), int(m[9 << 20:10 << 20].sum()))",
        frames.display()
    );
    let frame_sum = |a: u64| -> u64 { (a * MIB..(a + 1) * MIB).map(|i| i % 251).sum() };
    let frames_read = format!("{} {}", frame_sum(3), frame_sum(9));

    // The first job reads from the network.
    assert_eq!(
        agent.python_with(&packages, &slice(500, 600)),
        rows(500, 600)
    );
    assert_eq!(agent.python_with(&packages, &memmap), frames_read);
    wait_until(60, "both files held", || {
        agent.local_copy(&h5).exists() && agent.local_copy(&frames).exists()
    });
    let c = agent.settled();
    let held = |f: &Path| fs::metadata(agent.local_copy(f)).unwrap().blocks() * 512;
    // The slice's rows (6.25 MiB) and HDF5's metadata, not the file; the mapped file whole.
    assert!(held(&h5) < 12 * MIB, "{} held of 64 MiB: {c:#}", held(&h5));
    assert_eq!(held(&frames), 16 * MIB);

    // The next jobs are served by them: the slice read again, another filled from the
    // network, the mapping from the whole copy.
    assert_eq!(
        agent.python_with(&packages, &slice(500, 600)),
        rows(500, 600)
    );
    let allowed = agent.cache()["partial_reads_allowed"].as_u64().unwrap();
    assert!(allowed > 0, "{:#}", agent.cache());
    assert_eq!(agent.cache()["partial_bytes_filled"], 0);
    assert_eq!(
        agent.python_with(&packages, &slice(100, 150)),
        rows(100, 150)
    );
    let c = agent.cache();
    assert!(
        c["partial_bytes_filled"].as_u64().unwrap() >= 50 * 65536,
        "{c:#}"
    );
    assert_eq!(c["partial_reads_failed"], 0, "{c:#}");
    assert_eq!(agent.python_with(&packages, &memmap), frames_read);
    eprintln!(
        "h5py: {} of 64 MiB held after slices of 6.25 and 3.1 MiB, the second filled ({} bytes; {} reads allowed)",
        held(&h5),
        c["partial_bytes_filled"],
        c["partial_reads_allowed"]
    );
}

/// Two users' partial copies: root's (the victim's) 32 MiB file and the test user's (the
/// attacker's) own 64 GiB of holes, each a profile saying jobs read 1 MiB at 4 MiB, on a
/// daemon with partial copies from 8 MiB and a 64 MiB SSD budget. The attacker's is
/// prefetched; the victim's once the attacker's job has it open ([`Self::victim_job`]:
/// a copy a running job uses, no prefetch evicts it).
struct TwoUsers {
    agent: Agent,
    data: std::path::PathBuf,
    holes: std::path::PathBuf,
    work: tempfile::TempDir,
    user: (u32, u32),
}

impl TwoUsers {
    fn start(net: &NetworkMount, settings: &[&str]) -> Self {
        let user @ (uid, gid) = hocus_tests::test_user();
        let data = net.put(
            "victim/train.bin",
            &repeating_bytes(32 * MIB as usize, 251, 1),
        );
        let dir = net.server_path("attacker");
        fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).unwrap();
        let holes_file = dir.join("holes.bin");
        fs::File::create(&holes_file)
            .unwrap()
            .set_len(64 << 30)
            .unwrap();
        std::os::unix::fs::chown(&holes_file, Some(uid), Some(gid)).unwrap();
        let holes = net.path("attacker/holes.bin");
        let mount = net.mount.to_str().unwrap();
        let mut args = vec![
            "--watch",
            mount,
            "--partial-from",
            "8M",
            "--ssd-budget",
            "64M",
        ];
        args.extend_from_slice(settings);
        let agent = Agent::start(&args);
        let route = agent.route("big files read in part");
        assert!(route.starts_with("partial copies from 8.0 MiB"), "{route}");
        let work = tempfile::tempdir().unwrap();
        fs::set_permissions(work.path(), fs::Permissions::from_mode(0o777)).unwrap();
        let two = Self {
            agent,
            data,
            holes,
            work,
            user,
        };
        let evil = two.profile("evil.json", &two.holes, 64 << 30, uid);
        assert_success(
            &two.agent
                .prefetch_as(&evil, user, "the attacker's prefetch"),
        );
        two.agent.settled();
        two
    }

    /// A file in the test's directory, which both users may write.
    fn path(&self, name: &str) -> std::path::PathBuf {
        self.work.path().join(name)
    }

    fn profile(&self, name: &str, file: &Path, size: u64, reader: u32) -> std::path::PathBuf {
        let entry = json!({"path": file, "size": size, "opens": 5, "bytes_read": MIB, "first_touch_ns": 1, "written": false, "uids": [reader], "ranges": [[4 * MIB, 5 * MIB]]});
        hocus_tests::profile_in(self.work.path(), name, vec![entry])
    }

    /// `hocus-agent run -- argv` as the attacker, its output piped; once it made the
    /// file `opened`.
    fn attacker_job(&self, argv: &[&std::ffi::OsStr]) -> std::process::Child {
        let (uid, gid) = self.user;
        let job = self
            .agent
            .cli(&["run", "--"])
            .args(argv)
            .current_dir("/")
            .uid(uid)
            .gid(gid)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        wait_until(60, "the attacker's job opened its copy", || {
            self.path("opened").exists()
        });
        job
    }

    /// Root prefetches its file, then starts Python `script` as its job, output piped;
    /// once it made the file `victim-ready`.
    fn victim_job(&self, script: &str) -> std::process::Child {
        let victims = self.profile("victim.json", &self.data, 32 * MIB, 0);
        self.agent.prefetch(&victims);
        self.agent.settled();
        assert!(
            self.agent.local_copy(&self.data).exists()
                && self.agent.local_copy(&self.holes).exists(),
            "{}",
            self.agent.log()
        );
        let job = self
            .agent
            .python_job(script)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        wait_until(60, "the victim's job opened its copy", || {
            self.path("victim-ready").exists()
        });
        job
    }
}

#[test]
fn one_users_flood_of_reads_of_holes_fails_no_read_of_another_users_job() {
    let net = NetworkMount::start();
    // Fills may wait for the server 2 minutes here: the test holds it a while.
    let two = TwoUsers::start(&net, &["--fill-timeout", "120"]);
    let (agent, data) = (&two.agent, &two.data);
    let path = |name: &str| two.path(name);
    // The attacker's job opens their copy and waits, on one CPU of the two (as Slurm
    // gives a job its own); then root's job opens its own and waits.
    let flood = path("hole_flood.py");
    fs::write(&flood, include_str!("../scripts/hole_flood.py")).unwrap();
    let held = (4 * MIB).to_string();
    let mut argv: Vec<std::ffi::OsString> = ["taskset", "--cpu-list", "1", "python3"]
        .iter()
        .map(|a| a.into())
        .collect();
    argv.extend([flood.into(), two.holes.clone().into(), held.clone().into()]);
    argv.extend(["opened", "go", "ready", "stop"].map(|n| path(n).into()));
    let attacker = two.attacker_job(&argv.iter().map(|a| a.as_os_str()).collect::<Vec<_>>());
    // The victim's job: 16 threads, each reading 4 KiB of a range its copy lacks.
    let offsets: Vec<u64> = (0..16).map(|i| 8 * MIB + i * MIB).collect();
    let script = format!(
        "import os, threading, time\nfd = os.open('{data}', os.O_RDONLY)\nos.pread(fd, 4096, {held})\nopen('{ready}', 'w').close()\nwhile not os.path.exists('{go}'): time.sleep(0.05)\nout = [None] * {n}\ndef read(i, at):\n    try:\n        out[i] = str(sum(os.pread(fd, 4096, at)))\n    except OSError as e:\n        out[i] = os.strerror(e.errno)\nthreads = [threading.Thread(target=read, args=(i, at)) for i, at in enumerate({offsets:?})]\nfor t in threads: t.start()\nopen('{asked}', 'w').close()\nfor t in threads: t.join()\nprint(*out, sep='\\n')\n",
        data = data.display(),
        ready = path("victim-ready").display(),
        go = path("victim-go").display(),
        asked = path("victim-asked").display(),
        n = offsets.len(),
    );
    let victim = two.victim_job(&script);
    // The server stops answering (nothing the filler waits for drains away), and the
    // attacker floods: 1,200 threads, each reading 4 KiB of a hole of their copy.
    let paused = net.pause_server();
    fs::write(path("go"), b"").unwrap();
    wait_until(120, "the attacker's 1,200 threads run", || {
        (0..4).all(|i| path(&format!("ready.{i}")).exists())
    });
    wait_until(
        60,
        "the attacker's flood is past what the filler lets wait",
        || agent.cache()["partial_reads_failed"].as_u64() > Some(0),
    );
    // The victim reads what its copy lacks; the reads reach the filler, and the
    // server answers again.
    fs::write(path("victim-go"), b"").unwrap();
    wait_until(60, "the victim's reads made", || {
        path("victim-asked").exists()
    });
    std::thread::sleep(std::time::Duration::from_secs(1));
    drop(paused);
    let victim = victim.wait_with_output().unwrap();
    fs::write(path("stop"), b"").unwrap();
    let flooded = attacker.wait_with_output().unwrap();
    assert_success(&flooded);
    assert_success(&victim);
    // Every one of the victim's reads got the file's bytes.
    let expect: Vec<String> = offsets
        .iter()
        .map(|&at| sum(at, 4096).to_string())
        .collect();
    let printed = String::from_utf8_lossy(&victim.stdout);
    let wrong = printed
        .lines()
        .zip(&expect)
        .filter(|(got, want)| got != want)
        .count();
    assert_eq!(
        printed.lines().collect::<Vec<_>>(),
        expect,
        "{wrong} of the victim's {} reads went wrong during the flood (the attacker's reads refused, by process: {})\n{}",
        expect.len(),
        String::from_utf8_lossy(&flooded.stdout)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(", "),
        agent.log()
    );
}

#[test]
fn a_users_mapping_past_the_ssd_budget_fills_no_more_than_it_and_other_jobs_read_right() {
    let net = NetworkMount::start();
    let two = TwoUsers::start(&net, &[]);
    let (agent, data, holes) = (&two.agent, &two.data, &two.holes);
    let path = |name: &str| two.path(name);
    const BUDGET: u64 = 64 * MIB;
    // The attacker's job maps 256 MiB of holes of their copy, four times the budget:
    // a mapping asks for all it maps at its mmap.
    let mapping = format!(
        "import mmap, os, time\nfd = os.open('{holes}', os.O_RDONLY)\nos.pread(fd, 4096, {held})\nopen('{opened}', 'w').close()\nwhile not os.path.exists('{go}'): time.sleep(0.05)\ntry:\n    m = mmap.mmap(fd, 256 << 20, prot=mmap.PROT_READ, offset=1 << 30)\n    print('mapped', sum(m[0:4096]))\nexcept OSError as e:\n    print(os.strerror(e.errno))\n",
        holes = holes.display(),
        held = 4 * MIB,
        opened = path("opened").display(),
        go = path("go").display(),
    );
    let argv = ["python3", "-c", &mapping].map(std::ffi::OsStr::new);
    let attacker = two.attacker_job(&argv);
    let script = format!(
        "import os, time\nfd = os.open('{data}', os.O_RDONLY)\nprint(sum(os.pread(fd, 4096, {held})))\nopen('{ready}', 'w').close()\nwhile not os.path.exists('{go}'): time.sleep(0.05)\nfor at in ({held}, {lacks}):\n    try:\n        print(sum(os.pread(fd, 4096, at)))\n    except OSError as e:\n        print(os.strerror(e.errno))\n",
        data = data.display(),
        held = 4 * MIB,
        lacks = 20 * MIB,
        ready = path("victim-ready").display(),
        go = path("victim-go").display(),
    );
    let victim = two.victim_job(&script);
    // The attack: the mapping is refused once the budget has no room (its own bytes
    // and what no job read lately punched first), never filled past it.
    fs::write(path("go"), b"").unwrap();
    let mapped = attacker.wait_with_output().unwrap();
    assert_success(&mapped);
    let said = String::from_utf8_lossy(&mapped.stdout).trim().to_owned();
    // Counted by the keeper each second.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let cache = agent.cache();
    let filled = cache["partial_bytes_filled"].as_u64().unwrap();
    let held = cache["cached_bytes"].as_u64().unwrap();
    // What fills may have under way past the last count: 4 workers' pieces of 4 MiB.
    assert!(
        held <= BUDGET + 16 * MIB && filled <= BUDGET + 16 * MIB,
        "the attacker's mapping ({said}) filled {} MiB: the cache holds {} MiB of a {} MiB budget\n{cache:#}\n{}",
        filled >> 20,
        held >> 20,
        BUDGET >> 20,
        agent.log()
    );
    assert_eq!(said, "Input/output error", "{}", agent.log());
    assert!(filled >= 32 * MIB, "the attack filled only {filled} bytes");
    assert!(
        agent.log().contains("the SSD budget has no room left"),
        "{}",
        agent.log()
    );
    // The victim's job reads right: its held range, and a range its copy lacked, filled
    // in room made by punching what no job read.
    fs::write(path("victim-go"), b"").unwrap();
    let out = victim.wait_with_output().unwrap();
    assert_success(&out);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!(
            "{held}\n{held}\n{lacks}",
            held = sum(4 * MIB, 4096),
            lacks = sum(20 * MIB, 4096)
        ),
        "{}",
        agent.log()
    );
}

#[test]
fn a_users_stream_through_holes_past_their_share_punches_their_own_chunks_not_another_jobs() {
    let net = NetworkMount::start();
    let two = TwoUsers::start(&net, &[]);
    let (agent, data, holes) = (&two.agent, &two.data, &two.holes);
    let path = |name: &str| two.path(name);
    // The attacker's job streams through 256 MiB of holes of their copy, 1 MiB a read,
    // until a read fails: four times the 64 MiB budget.
    let stream = format!(
        "import os, time\nfd = os.open('{holes}', os.O_RDONLY)\nos.pread(fd, 4096, {held})\nopen('{opened}', 'w').close()\nwhile not os.path.exists('{go}'): time.sleep(0.05)\nread = 0\ntry:\n    for at in range(1 << 30, (1 << 30) + (256 << 20), 1 << 20):\n        os.pread(fd, 1 << 20, at)\n        read += 1\n    print(read, 'MiB read')\nexcept OSError as e:\n    print(read, 'MiB read, then', os.strerror(e.errno))\n",
        holes = holes.display(),
        held = 4 * MIB,
        opened = path("opened").display(),
        go = path("go").display(),
    );
    let argv = ["python3", "-c", &stream].map(std::ffi::OsStr::new);
    let attacker = two.attacker_job(&argv);
    // The victim's job fills 16 MiB its copy lacked, then reads none of it for a while
    // (its chunks the coldest), then reads it all again.
    let script = format!(
        "import os, time\nfd = os.open('{data}', os.O_RDONLY)\nfor at in range({from_}, {to}, 1 << 20):\n    os.pread(fd, 1 << 20, at)\nopen('{ready}', 'w').close()\nwhile not os.path.exists('{go}'): time.sleep(0.05)\nfor at in range({from_}, {to}, 1 << 20):\n    try:\n        print(sum(os.pread(fd, 4096, at)))\n    except OSError as e:\n        print(os.strerror(e.errno))\n",
        data = data.display(),
        from_ = 8 * MIB,
        to = 24 * MIB,
        ready = path("victim-ready").display(),
        go = path("victim-go").display(),
    );
    let victim = two.victim_job(&script);
    let local = agent.local_copy(data);
    let held = || fs::metadata(&local).unwrap().blocks() * 512;
    let before = held();
    assert!(before >= 17 * MIB, "the victim's copy holds {before} bytes");
    // Past READ_AGO (10 s): the victim's chunks may be punched for room.
    std::thread::sleep(std::time::Duration::from_secs(11));
    fs::write(path("go"), b"").unwrap();
    let streamed = attacker.wait_with_output().unwrap();
    assert_success(&streamed);
    let said = String::from_utf8_lossy(&streamed.stdout).trim().to_owned();
    let after = held();
    assert!(
        after >= before,
        "the attacker's stream ({said}) punched {} MiB of the victim's running job's copy out\n{:#}\n{}",
        (before - after) >> 20,
        agent.cache(),
        agent.log()
    );
    assert!(
        said.ends_with("then Input/output error"),
        "{said}\n{}",
        agent.log()
    );
    assert!(
        agent.log().contains("this user's fills hold their share"),
        "{}",
        agent.log()
    );
    // The victim reads right what it held, filled by nothing.
    let filled = agent.cache()["partial_bytes_filled"].as_u64();
    fs::write(path("victim-go"), b"").unwrap();
    let out = victim.wait_with_output().unwrap();
    assert_success(&out);
    let expect: Vec<String> = (8..24).map(|m| sum(m * MIB, 4096).to_string()).collect();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .collect::<Vec<_>>(),
        expect,
        "{}",
        agent.log()
    );
    assert_eq!(agent.cache()["partial_bytes_filled"].as_u64(), filled);
}
