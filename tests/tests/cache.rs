//! Prefetch and pin on the real network mount: budgets, scan resistance, residency,
//! consistency, and the faults a cache must survive.

use std::{
    fs,
    os::unix::{
        fs::{MetadataExt, PermissionsExt},
        process::CommandExt,
    },
    path::{Path, PathBuf},
    process::{Command, Output},
};

use hocus_tests::{Agent, NetworkMount, assert_success, read_all, wait_until};
use serde_json::Value;

const MIB: u64 = 1 << 20;

/// `n` files of `size` bytes under `dir` on the server, distinct contents.
fn dataset(net: &NetworkMount, dir: &str, n: usize, size: usize) -> Vec<PathBuf> {
    (0..n)
        .map(|i| {
            // Never all zeros: a copy of zeros is sparse, and these stand for real data.
            let mut content = vec![(i % 251) as u8 + 1; size];
            content[..8].copy_from_slice(&(i as u64).to_le_bytes());
            net.put(&format!("{dir}/part-{i:03}.bin"), &content)
        })
        .collect()
}

/// A new pseudo-random order of 0..n for each seed.
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    order
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// Bytes of regular files under `dir`.
fn disk_usage(dir: &Path) -> (u64, usize) {
    let mut total = (0, 0);
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else {
                total.0 += m.len();
                total.1 += 1;
            }
        }
    }
    total
}

#[test]
fn budgets_are_never_exceeded() {
    let net = NetworkMount::start();
    let files = dataset(&net, "data", 30, MIB as usize);
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--ssd-budget",
        "10M",
        "--ram-budget",
        "4M",
    ]);
    for _ in 0..2 {
        for f in &files {
            read_all(f);
        }
    }
    let c = agent.settled();
    assert_eq!(
        (n(&c["ssd_budget"]), n(&c["ram_budget"])),
        (10 * MIB, 4 * MIB)
    );
    assert_eq!(n(&c["cached_bytes"]), 10 * MIB, "{c:#}");
    assert_eq!(n(&c["pinned_bytes"]), 4 * MIB, "{c:#}");
    let (bytes, count) = disk_usage(&agent.cache_dir.join("files"));
    assert_eq!(
        (bytes, count as u64),
        (10 * MIB, n(&c["cached_files"])),
        "the disk holds what the index says"
    );
    assert!(disk_usage(&agent.cache_dir.join("tmp")).1 == 0);
    let mode = fs::metadata(&agent.cache_dir).unwrap();
    assert_eq!(
        (mode.uid(), mode.mode() & 0o777),
        (0, 0o700),
        "the cache root is root's, 0700"
    );
}

/// Reads every file named on the command line, in that order, with read(2).
const READ_FILES: &str = "import sys\nfor p in sys.argv[1:]:\n    open(p, 'rb').read()";

/// Bytes jobs read, by where they came from: (RAM, SSD, network), over all trees.
fn served_bytes(cache: &serde_json::Value) -> (u64, u64, u64) {
    let served = cache["served"].as_array().unwrap();
    let sum = |k: &str| served.iter().map(|s| n(&s[k])).sum::<u64>();
    (sum("read_ram"), sum("read_ssd"), sum("read_network"))
}

#[test]
fn an_epoch_scan_twice_the_ram_budget_keeps_a_stable_pinned_subset() {
    // 32 files of 512 KiB: 16 MiB read in a new random order each epoch, 8 MiB of RAM.
    // Each epoch is a `hocus-agent run` job, so local copies serve what they hold.
    let net = NetworkMount::start();
    let files = dataset(&net, "train", 32, 512 << 10);
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap(), "--ram-budget", "8M"]);
    let epoch = |seed| {
        let mut args = vec!["run", "--", "python3", "-c", READ_FILES];
        let order: Vec<&str> = shuffled(files.len(), seed)
            .into_iter()
            .map(|i| files[i].to_str().unwrap())
            .collect();
        args.extend(order);
        assert_success(&agent.cli(&args).output().unwrap());
    };
    epoch(1);
    let mut before = agent.settled();
    assert_eq!(n(&before["pinned_bytes"]), 8 * MIB, "{before:#}");
    assert_eq!(
        served_bytes(&before),
        (0, 0, 16 * MIB),
        "the first epoch reads the network: {before:#}"
    );
    let ideal = 8.0 / 16.0;
    for seed in 2..5 {
        epoch(seed);
        // Let the reads of this epoch arrive.
        let after = agent.settled();
        let (ram0, ssd0, net0) = served_bytes(&before);
        let (ram, ssd, network) = served_bytes(&after);
        let (ram, ssd, network) = (ram - ram0, ssd - ssd0, network - net0);
        assert_eq!(
            ram + ssd + network,
            16 * MIB,
            "every byte read is accounted for: {after:#}"
        );
        assert_eq!(network, 0, "every file has a local copy now: {after:#}");
        let share = ram as f64 / (16 * MIB) as f64;
        eprintln!(
            "epoch {seed}: {:.1}% of bytes read came from pinned copies (ideal {:.0}%)",
            share * 100.0,
            ideal * 100.0
        );
        assert!(
            share >= 0.9 * ideal,
            "epoch {seed}: pinned share {share:.3} < 90% of {ideal}"
        );
        assert_eq!(n(&after["pinned_bytes"]), 8 * MIB);
        before = after;
    }
}

/// Pages of `path` resident in memory, and its page count.
fn resident_pages(path: &Path) -> (usize, usize) {
    let f = fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    let page = 4096;
    let pages = len.div_ceil(page);
    // SAFETY: a read-only shared mapping of a file we opened, unmapped below.
    unsafe {
        let addr = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
        );
        assert_ne!(addr, libc::MAP_FAILED);
        let mut vec = vec![0u8; pages];
        assert_eq!(libc::mincore(addr, len, vec.as_mut_ptr()), 0);
        libc::munmap(addr, len);
        (vec.iter().filter(|b| **b & 1 == 1).count(), pages)
    }
}

#[test]
fn pinned_copies_stay_resident_through_drop_caches() {
    let net = NetworkMount::start();
    let files = dataset(&net, "hot", 8, MIB as usize);
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap(), "--ram-budget", "4M"]);
    for f in &files {
        read_all(f);
    }
    let c = agent.settled();
    assert_eq!(
        (n(&c["cached_files"]), n(&c["pinned_files"])),
        (8, 4),
        "{c:#}"
    );
    fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    let mut resident = 0;
    let mut evicted = 0;
    for f in &files {
        let (r, pages) = resident_pages(&agent.local_copy(f));
        if r == pages {
            resident += 1;
        } else if r == 0 {
            evicted += 1;
        }
    }
    assert_eq!(resident, 4, "the 4 pinned copies stay in RAM");
    assert_eq!(
        evicted, 4,
        "the unpinned copies were dropped with the page cache"
    );
}

#[test]
fn a_change_on_the_server_is_seen_not_the_stale_copy() {
    let net = NetworkMount::start();
    let file = net.put("lib/model.py", b"VERSION = 1\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap(), "--revalidate", "1"]);
    read_all(&file);
    let copy = agent.local_copy(&file);
    wait_until(30, "the first copy", || {
        fs::read(&copy).is_ok_and(|c| c == b"VERSION = 1\n")
    });
    // Behind the client's back. No job runs: nothing asks the server until one starts.
    fs::write(net.server_path("lib/model.py"), b"VERSION = 2 # longer\n").unwrap();
    agent.wait_for_revalidations(2);
    assert_eq!(n(&agent.cache()["invalidations"]), 0);
    // The next job's start finds the copy stale: the job reads the network, the copy
    // is dropped, then fetched again once stable; the old content never comes back.
    let out = agent.run_job(&format!("cat {}", file.display()));
    assert_success(&out);
    assert_eq!(out.stdout, b"VERSION = 2 # longer\n");
    wait_until(30, "the copy of the new version", || {
        fs::read(&copy).is_ok_and(|c| c == b"VERSION = 2 # longer\n")
    });
    let c = agent.cache();
    assert!(n(&c["invalidations"]) >= 1, "{c:#}");
    assert!(
        agent.log().contains("model.py changed: dropping its copy"),
        "{}",
        agent.log()
    );
}

#[test]
fn a_write_seen_by_the_tracer_drops_the_copy_at_once() {
    let net = NetworkMount::start();
    let file = net.put("cache/entry.bin", &[1u8; 4096]);
    // A long revalidation interval: only the tracer can notice the write in time.
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--revalidate",
        "3600",
    ]);
    read_all(&file);
    let copy = agent.local_copy(&file);
    wait_until(30, "the copy", || copy.exists());
    use std::io::Write;
    fs::OpenOptions::new()
        .append(true)
        .open(&file)
        .unwrap()
        .write_all(b"more")
        .unwrap();
    wait_until(5, "the copy to be dropped after a write", || !copy.exists());
    assert!(
        agent.log().contains("changed: dropping its copy"),
        "{}",
        agent.log()
    );
}

#[test]
fn a_full_cache_filesystem_evicts_and_says_so() {
    let net = NetworkMount::start();
    let files = dataset(&net, "big", 16, MIB as usize);
    let small = tempfile::tempdir().unwrap();
    let cache = small.path().join("cache");
    fs::create_dir_all(&cache).unwrap();
    let status = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m", "hocus-test-cache"])
        .arg(&cache)
        .status()
        .unwrap();
    assert!(status.success(), "mounting a 4 MiB tmpfs");
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(cache.clone());
    // The budget says 64 MiB; the filesystem holds 4.
    let mut agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--cache-dir",
        cache.to_str().unwrap(),
        "--ssd-budget",
        "64M",
        "--ram-budget",
        "1M",
    ]);
    for f in &files {
        read_all(f);
    }
    let c = agent.settled();
    assert!(agent.is_running(), "{}", agent.log());
    assert!(n(&c["cache_full_events"]) >= 1, "{c:#}");
    assert!(agent.log().contains("is full"), "{}", agent.log());
    assert!(
        n(&c["cached_bytes"]) <= 4 * MIB && n(&c["ssd_budget"]) < 4 * MIB,
        "{c:#}"
    );
    assert!(
        n(&c["cached_files"]) >= 1,
        "it still caches what fits: {c:#}"
    );
    assert_eq!(
        disk_usage(&cache.join("tmp")).1,
        0,
        "no partial copy is left"
    );
    let (bytes, count) = disk_usage(&cache.join("files"));
    assert_eq!(
        (bytes, count as u64),
        (n(&c["cached_bytes"]), n(&c["cached_files"]))
    );
    agent.stop();
}

#[test]
fn kill_9_mid_copy_leaves_no_half_written_file() {
    let net = NetworkMount::start();
    // 256 MiB (sparse on the server, but every byte crosses the network).
    let big = net.server_path("data/huge.bin");
    fs::create_dir_all(big.parent().unwrap()).unwrap();
    fs::File::create(&big).unwrap().set_len(256 * MIB).unwrap();
    let file = net.path("data/huge.bin");
    let args = ["--watch", net.mount.to_str().unwrap(), "--ram-budget", "1M"];
    let agent = Agent::start(&args);
    // Open and close it: the profile has it, and the daemon starts copying.
    drop(fs::File::open(&file).unwrap());
    let tmp = agent.cache_dir.join("tmp");
    wait_until(30, "a copy in progress", || disk_usage(&tmp).0 > 0);
    let mut agent = agent;
    agent.kill9();
    assert!(
        disk_usage(&tmp).0 > 0,
        "the kill left a half-written temporary file"
    );
    assert!(
        !agent.local_copy(&file).exists(),
        "no copy under its final name yet"
    );
    let (dir, state_dir) = agent.into_dirs();

    let agent = Agent::start_with_state(dir, state_dir, &args);
    assert!(
        agent.log().contains("removed 1 unfinished copies"),
        "{}",
        agent.log()
    );
    // Whatever is under the final name now is whole.
    let c = agent.settled();
    let copy = agent.local_copy(&file);
    if copy.exists() {
        assert_eq!(fs::metadata(&copy).unwrap().len(), 256 * MIB);
        assert_eq!(n(&c["cached_files"]), 1);
    }
    assert_eq!(disk_usage(&tmp).1, 0);
}

#[test]
fn a_symlink_swapped_in_does_not_expose_a_file_outside_the_tree() {
    let net = NetworkMount::start();
    let file = net.put("proj/data/table.csv", b"a,b\n1,2\n");
    // Outside the export, on the server: what a swapped-in symlink would point at.
    let outside = net.root().join("outside");
    fs::create_dir_all(&outside).unwrap();
    fs::write(outside.join("table.csv"), b"SECRET").unwrap();
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--revalidate",
        "3600",
    ]);
    // Record the profile, then swap the directory for a symlink before hocus copies.
    let kept = tempfile::tempdir().unwrap();
    let profile = kept.path().join("job.json");
    read_all(&file);
    let out = agent
        .cli(&["profile", "export", "--out", profile.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success());
    // The first daemon goes before the second starts: its copy of the file, made before
    // the swap, would be a use of the file the second one sees and copies on its own
    // while the client still holds the old directory (sshfs resolves paths on the
    // server: a swap shows on the client only once its cached entry expires).
    drop(agent);
    let agent2 = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    fs::rename(
        net.server_path("proj/data"),
        net.server_path("proj/data.real"),
    )
    .unwrap();
    std::os::unix::fs::symlink(&outside, net.server_path("proj/data")).unwrap();
    wait_until(10, "the client to see the symlink", || {
        fs::symlink_metadata(net.path("proj/data")).is_ok_and(|m| m.file_type().is_symlink())
    });
    let out = agent2
        .cli(&["prefetch", "--profile", profile.to_str().unwrap()])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_success(&out);
    assert!(said.contains("1 not cached"), "{said}");
    assert!(
        !agent2.local_copy(&file).exists(),
        "a file outside the tree was copied"
    );
    assert!(agent2.log().contains("symlink"), "{}", agent2.log());
}

#[test]
fn a_users_file_keeps_owner_group_mode_and_mtime_and_stays_theirs() {
    let net = NetworkMount::start();
    let (uid, gid) = hocus_tests::test_user();
    let file = net.put("home/user/notes.txt", b"private notes\n");
    let server = net.server_path("home/user/notes.txt");
    std::os::unix::fs::chown(&server, Some(uid), Some(gid)).unwrap();
    fs::set_permissions(&server, fs::Permissions::from_mode(0o640)).unwrap();
    let status = Command::new("touch")
        .args(["-m", "-d", "2021-03-04 05:06:07"])
        .arg(&server)
        .status()
        .unwrap();
    assert!(status.success());
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    // The user reads it (so hocus copies it with the user's credentials).
    let out = Command::new("cat")
        .arg(&file)
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    assert_success(&out);
    let copy = agent.local_copy(&file);
    wait_until(30, "the copy", || copy.exists());
    let (src, local) = (fs::metadata(&file).unwrap(), fs::metadata(&copy).unwrap());
    assert_eq!((local.uid(), local.gid()), (uid, gid));
    assert_eq!(local.mode() & 0o7777, 0o640);
    assert_eq!(
        (local.mtime(), local.mtime_nsec()),
        (src.mtime(), src.mtime_nsec())
    );
    assert_eq!(fs::read(&copy).unwrap(), b"private notes\n");
    // Another user cannot get at it through the cache: its root is root's 0700.
    let other = Command::new("cat")
        .arg(&copy)
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    assert!(!other.status.success(), "nobody read a copy in the cache");
}

#[test]
fn prefetch_warms_a_new_daemon_before_the_job() {
    let net = NetworkMount::start();
    let files = dataset(&net, "env", 6, 256 << 10);
    let first = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    for f in &files {
        read_all(f);
    }
    let shared = tempfile::tempdir().unwrap();
    let profile = shared.path().join("job.json");
    let out = first
        .cli(&["profile", "export", "--out", profile.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success());
    drop(first);

    // Another node: nothing read yet, the profile arrives before the job.
    let node = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--ram-budget",
        "512K",
    ]);
    let out = node
        .cli(&["prefetch", "--profile", profile.to_str().unwrap()])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_success(&out);
    assert!(
        said.contains("prefetched 6 files (1.5 MiB) into the SSD cache"),
        "{said}"
    );
    assert!(
        said.contains("and 1 tree as a snapshot (1.5 MiB)"),
        "the clean directory is held whole: {said}"
    );
    assert!(
        said.contains("; 2 files (512.0 KiB) pinned in RAM"),
        "{said}"
    );
    // The pins outlive the command.
    let c = node.cache();
    assert_eq!(
        (n(&c["cached_files"]), n(&c["pinned_files"])),
        (6, 2),
        "{c:#}"
    );
    for f in &files {
        assert_eq!(fs::read(node.local_copy(f)).unwrap(), fs::read(f).unwrap());
    }
}

/// More files than the daemon hands its copy workers at once (1024): the rest wait
/// their turn, each copy that ends starts the next, and the prefetch waits for them all.
/// `prefetch` of a profile of `files` (a file gone from the network is listed with 13
/// bytes), all in directory `dir`, which was written to: a directory written to is never
/// held as a snapshot, so they are copied one by one.
fn prefetch_file_by_file(agent: &Agent, dir: &Path, files: &[PathBuf]) -> Output {
    let entries: Vec<Value> = files
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let size = fs::metadata(f).map_or(13, |m| m.len());
            serde_json::json!({"path": f, "size": size, "mtime_ns": 0, "opens": 1,
                "bytes_read": size, "first_touch_ns": i, "last_touch_ns": i,
                "users": 1, "uids": [0], "written": false})
        })
        .collect();
    let profile = serde_json::json!({"version": 1, "started_unix_ns": 1, "files": entries,
        "missing": [], "dirs": [{"path": dir, "opens": 1, "mutated": true}]});
    let path = agent.dir.path().join("file-by-file.json");
    fs::write(&path, profile.to_string()).unwrap();
    agent
        .cli(&["prefetch", "--profile", path.to_str().unwrap()])
        .output()
        .unwrap()
}

#[test]
fn a_prefetch_of_more_files_than_copies_at_once_gets_them_all() {
    const FILES: usize = 1500;
    let net = NetworkMount::start();
    let files: Vec<PathBuf> = (0..FILES)
        .map(|i| net.put(&format!("many/f{i:04}.py"), format!("# {i}\n").as_bytes()))
        .collect();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    let out = prefetch_file_by_file(&agent, &net.path("many"), &files);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains(&format!("prefetched {FILES} files")),
        "{said}\n{}",
        agent.log()
    );
    let c = agent.cache();
    assert_eq!(n(&c["cached_files"]), FILES as u64, "{c:#}");
    assert!(c["snapshots"].as_array().is_none_or(Vec::is_empty), "{c:#}");
    for f in [&files[0], &files[1023], &files[1024], &files[FILES - 1]] {
        assert_eq!(fs::read(agent.local_copy(f)).unwrap(), fs::read(f).unwrap());
    }
}

/// A site-wide profile imported on a node whose server no longer has most of its files:
/// the log sums them up per tree, not a line each (it once wrote 5,822), and the count
/// is in status.
#[test]
fn files_of_an_imported_profile_gone_from_the_server_are_said_in_one_line() {
    const GONE: usize = 400;
    let net = NetworkMount::start();
    let kept = net.put("old/kept.py", b"# still here\n");
    let mut files = vec![kept.clone()];
    files.extend((1..=GONE).map(|i| net.path(&format!("old/gone{i}.py"))));
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    assert_success(&prefetch_file_by_file(&agent, &net.path("old"), &files));
    assert!(agent.local_copy(&kept).exists(), "{}", agent.log());
    let line = format!(
        "files not cached, gone from the network: {GONE} in {}",
        net.mount.display()
    );
    wait_until(30, "the summed-up line", || agent.log().contains(&line));
    let log = agent.log();
    assert!(!log.contains("not caching"), "{log}");
    let c = agent.cache();
    assert_eq!(
        n(&c["copy_failures_by_reason"]["gone"]),
        GONE as u64,
        "{c:#}"
    );
}

#[test]
fn plan_shows_the_placement_and_times_without_copying() {
    let net = NetworkMount::start();
    let files = dataset(&net, "d", 10, 256 << 10);
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    for f in &files {
        read_all(f);
    }
    assert!(fs::metadata(net.path("d/missing.py")).is_err());
    let profile = agent.dir.path().join("job.json");
    assert!(
        agent
            .cli(&["profile", "export", "--out", profile.to_str().unwrap()])
            .status()
            .unwrap()
            .success()
    );
    let scratch = tempfile::tempdir().unwrap();
    let cache = scratch.path().join("plan-cache");
    let plan = |extra: &[&str]| {
        let out = Command::new(hocus_tests::agent_bin())
            .args([
                "plan",
                "--profile",
                profile.to_str().unwrap(),
                "--cache-dir",
                cache.to_str().unwrap(),
            ])
            .args(["--ssd-budget", "1M", "--ram-budget", "512K"])
            .args(extra)
            .output()
            .unwrap();
        assert_success(&out);
        String::from_utf8(out.stdout).unwrap()
    };
    let table = plan(&[]);
    let files_in = |tier: &str| -> Option<String> {
        let line = table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(tier))?;
        line.split_whitespace().nth(1).map(str::to_owned)
    };
    assert_eq!(files_in("ram").as_deref(), Some("2"), "{table}");
    assert_eq!(files_in("ssd").as_deref(), Some("2"), "{table}");
    assert_eq!(files_in("network").as_deref(), Some("6"), "{table}");
    assert!(
        table.contains("simulated time of the profile's workload: before"),
        "{table}"
    );
    assert!(table.contains("1 failed lookups"), "{table}");
    let csv = plan(&["--csv"]);
    let lines: Vec<_> = csv.lines().collect();
    assert_eq!(lines[0], "path,size,opens,bytes_read,tier,before_s,after_s");
    assert_eq!(lines.len(), 11);
    assert_eq!(lines.iter().filter(|l| l.contains(",ram,")).count(), 2);
    assert!(!cache.exists(), "plan copies nothing");

    // A 96 MiB file jobs read 512 KiB of: placed as a partial copy, weighed by its
    // ranges, within the 1 MiB budget; read whole, it stays on the network.
    let big = net.put("d/big.h5", &vec![7u8; 96 << 20]);
    let mut p: serde_json::Value = serde_json::from_slice(&fs::read(&profile).unwrap()).unwrap();
    let entry = |ranges: serde_json::Value| {
        serde_json::json!({"path": big, "size": 96u64 << 20, "opens": 50, "bytes_read": 512 << 10,
            "first_touch_ns": 1, "written": false, "uids": [0], "ranges": ranges})
    };
    let tier_of_big = |p: &serde_json::Value| {
        fs::write(&profile, serde_json::to_vec(p).unwrap()).unwrap();
        let csv = plan(&["--csv"]);
        let line = csv
            .lines()
            .find(|l| l.contains("big.h5"))
            .unwrap()
            .to_owned();
        line.split(',').nth(4).unwrap().to_owned()
    };
    p["files"]
        .as_array_mut()
        .unwrap()
        .push(entry(serde_json::json!([[0, 512 << 10]])));
    assert_ne!(tier_of_big(&p), "network");
    p["files"].as_array_mut().unwrap().pop();
    p["files"]
        .as_array_mut()
        .unwrap()
        .push(entry(serde_json::json!([])));
    assert_eq!(tier_of_big(&p), "network");
}

#[test]
fn bad_profiles_for_prefetch_and_plan_get_clear_errors() {
    let net = NetworkMount::start();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    fs::write(&bad, b"{\"version\": 1, \"files\": [{").unwrap();
    let missing = dir.path().join("nope.json");
    for (path, message) in [
        (&bad, "is not a hocus profile or is truncated"),
        (&missing, "does not exist"),
    ] {
        for args in [vec!["prefetch", "--profile"], vec!["plan", "--profile"]] {
            let out = agent.cli(&args).arg(path).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success());
            assert!(
                err.contains(message) && err.contains(path.to_str().unwrap()),
                "{args:?}: {err}"
            );
        }
    }
}

#[test]
fn shrinking_the_ram_budget_releases_pins_at_once() {
    let net = NetworkMount::start();
    let files = dataset(&net, "w", 8, MIB as usize);
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap(), "--ram-budget", "6M"]);
    for f in &files {
        read_all(f);
    }
    assert_eq!(n(&agent.settled()["pinned_bytes"]), 6 * MIB);
    // Only root changes budgets.
    let (uid, gid) = hocus_tests::test_user();
    let out = agent
        .cli(&["budget", "--ram", "2M"])
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("only root"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = agent.cli(&["budget", "--ram", "2M"]).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_success(&out);
    assert!(said.contains("RAM 2.0 MiB (2.0 MiB pinned)"), "{said}");
    let c = agent.cache();
    assert_eq!(
        (n(&c["pinned_bytes"]), n(&c["pinned_files"])),
        (2 * MIB, 2),
        "{c:#}"
    );
    assert_eq!(n(&c["cached_files"]), 8, "the copies stay on SSD");
}

#[test]
fn vm_max_map_count_limits_pinning_and_the_daemon_says_so() {
    let net = NetworkMount::start();
    let files = dataset(&net, "m", 10, 64 << 10);
    // The daemon reads the limit when it starts and leaves 2048 mappings to itself:
    // allow it 4 pins. The lowered limit is restored right after, also on failure.
    struct Restore(String);
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = fs::write("/proc/sys/vm/max_map_count", &self.0);
        }
    }
    let restore = Restore(fs::read_to_string("/proc/sys/vm/max_map_count").unwrap());
    fs::write("/proc/sys/vm/max_map_count", (2048 + 4).to_string()).unwrap();
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--ram-budget",
        "64M",
    ]);
    drop(restore);
    for f in &files {
        read_all(f);
    }
    let c = agent.settled();
    assert_eq!(
        (n(&c["cached_files"]), n(&c["pinned_files"])),
        (10, 4),
        "{c:#}"
    );
    assert_eq!(c["limited_by_map_count"], true, "{c:#}");
    assert!(
        agent.log().contains("raise it (sysctl vm.max_map_count)"),
        "{}",
        agent.log()
    );
    let out = agent.cli(&["status"]).output().unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("pinning is limited by vm.max_map_count")
    );
}

#[test]
fn a_file_written_once_is_cached_once_it_is_stable() {
    // A compilation cache entry: written on this node, then only read.
    let net = NetworkMount::start();
    fs::create_dir_all(net.server_path("jax-cache")).unwrap();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap(), "--revalidate", "2"]);
    let entry = net.path("jax-cache/module-1234");
    fs::write(&entry, vec![7u8; 8192]).unwrap();
    let written_at = std::time::Instant::now();
    read_all(&entry);
    let copy = agent.local_copy(&entry);
    wait_until(30, "the copy of the stable entry", || copy.exists());
    assert!(
        written_at.elapsed() >= std::time::Duration::from_secs(2),
        "copied before it was stable"
    );
    assert_eq!(fs::read(&copy).unwrap(), vec![7u8; 8192]);
    let p = agent.export();
    assert_eq!(
        hocus_tests::file_entry(&p, &entry).unwrap()["written"],
        true
    );
}

/// Sends SIGTERM and returns how long the daemon took to exit (cleanly).
fn stop_timed(agent: &mut Agent) -> std::time::Duration {
    let started = std::time::Instant::now();
    agent.stop();
    started.elapsed()
}

#[test]
fn sigterm_mid_copy_and_mid_snapshot_stops_promptly_and_the_next_daemon_starts_clean() {
    let net = NetworkMount::start();
    // A 4 GiB file (sparse on the server; every byte crosses the network when copied).
    let big = net.server_path("data/huge.bin");
    fs::create_dir_all(big.parent().unwrap()).unwrap();
    fs::File::create(&big).unwrap().set_len(4096 * MIB).unwrap();
    let file = net.path("data/huge.bin");
    let mount = net.mount.to_str().unwrap().to_owned();
    let mut agent = Agent::start(&["--watch", &mount, "--ram-budget", "1M"]);
    drop(fs::File::open(&file).unwrap());
    let tmp = agent.cache_dir.join("tmp");
    wait_until(30, "the copy of 4 GiB under way", || disk_usage(&tmp).0 > 0);
    let took = stop_timed(&mut agent);
    eprintln!("SIGTERM during a 4 GiB copy: stopped in {took:?}");
    assert!(
        took.as_secs() < 10,
        "SIGTERM during a 4 GiB copy took {took:?}:\n{}",
        agent.log()
    );
    assert!(
        !agent.local_copy(&file).exists(),
        "the copy was abandoned, not finished first"
    );
    let (dir, state_dir) = agent.into_dirs();

    // Right after: the socket is free, the half copy is removed. This daemon leaves the
    // big file alone and takes a snapshot of a 30k-file tree a job used.
    let excluded = net.path("data");
    let args = [
        "--watch",
        &mount,
        "--exclude",
        excluded.to_str().unwrap(),
        "--ram-budget",
        "1M",
    ];
    let mut agent = Agent::start_with_state(dir, state_dir, &args);
    assert!(
        agent.log().contains("removed 1 unfinished copies"),
        "{}",
        agent.log()
    );
    for d in 0..30 {
        let dir = net.server_path(&format!("env/pkg{d}"));
        fs::create_dir_all(&dir).unwrap();
        for f in 0..1000 {
            fs::write(dir.join(format!("m{f}.py")), b"x = 1\n").unwrap();
        }
    }
    // A file of every directory: a snapshot walks the directories jobs used (and is
    // taken of the highest one: env, where a file was read too).
    let top = net.put("env/README", b"thirty packages\n");
    read_all(&top);
    for d in 0..30 {
        read_all(&net.path(&format!("env/pkg{d}/m0.py")));
    }
    assert!(fs::metadata(net.path("env/pkg0/nope.py")).is_err());
    wait_until(60, "a snapshot of env under way", || {
        agent.log().contains("taking a snapshot of")
    });
    let took = stop_timed(&mut agent);
    eprintln!("SIGTERM during a snapshot: stopped in {took:?}");
    assert!(
        took.as_secs() < 10,
        "SIGTERM during a snapshot took {took:?}:\n{}",
        agent.log()
    );
    assert!(
        !agent.log().contains(" in place in "),
        "the snapshot was abandoned, not finished first:\n{}",
        agent.log()
    );
    let (dir, state_dir) = agent.into_dirs();
    // The half-taken snapshot was in tmp/; the next start removes it before anything.
    let agent = Agent::start_with_state(dir, state_dir, &args);
    let log = agent.log();
    let removed: u64 = log
        .split("removed ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        removed >= 1,
        "the abandoned snapshot was not cleared:\n{log}"
    );
    let trees = agent.cache_dir.join("trees");
    assert_eq!(
        disk_usage(&trees).1,
        0,
        "no partial tree is left among the snapshots"
    );
}
