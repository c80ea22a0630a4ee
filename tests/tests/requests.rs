//! Learning from the filesystem. Where the kernel has the typed FUSE tracepoints
//! (`fuse_request_send`, `fuse_request_end`: newer than 6.12, FUSE built in), a daemon
//! watching only FUSE trees learns what jobs do from the requests its server gets; where
//! it has BTF for the NFS client's module (5.11 and later: Debian 12 and 13's kernels, in
//! the rig's guests), a daemon watching only NFS trees learns from the client's own
//! functions (fentry and fexit). Either way the syscall program rests the whole time: no
//! process on the node pays for a job being learned. The profile learned is checked
//! against what the syscall program learns from the same job (`HOCUS_FALLBACKS`
//! `fuse-requests` or `nfs-functions`). Where the kernel lacks them, the daemon says it
//! learns from syscalls.

use std::path::Path;

use hocus_tests::{
    Agent, NetworkMount, assert_success, file_entry, kernel_btf_names, repeating_bytes,
};
use serde_json::Value;

const SYSCALLS: &str = "syscall_exit";

/// How the daemon learns jobs on the tests' network mount, where the kernel lets it:
/// the route `status` says, the programs it attaches for it (some of them), and the
/// fallback that takes the syscall route instead.
struct Way {
    route: &'static str,
    programs: &'static [&'static str],
    fallback: &'static str,
}

fn way(net: &NetworkMount) -> Way {
    match net.nfs {
        None => Way {
            route: "from the requests",
            programs: &["fuse_sent", "fuse_ended"],
            fallback: "fuse-requests",
        },
        Some(_) => Way {
            route: "from the NFS client's functions",
            programs: &["nfs_opened", "nfs_read", "nfs_released", "nfs_looked_up"],
            fallback: "nfs-functions",
        },
    }
}

/// The way `status` says jobs are learned.
fn learning_route(agent: &Agent) -> String {
    agent.route("learning jobs")
}

/// Whether this kernel has what the filesystem's programs hook, typed: checked apart
/// from the daemon's own probe. FUSE: the request tracepoints, FUSE built in; NFS: BTF
/// for the client's module (or the client built in).
fn kernel_has_hooks(net: &NetworkMount) -> bool {
    match net.nfs {
        None => kernel_btf_names("btf_trace_fuse_request_send") && kernel_btf_names("fuse_req"),
        Some(_) => Path::new("/sys/kernel/btf/nfs").exists() || kernel_btf_names("nfs_file_open"),
    }
}

/// A daemon watching `net` that learns from the filesystem, once it rests: the syscall
/// program detached, the filesystem's programs attached. None (after checking that the
/// daemon says so) on a kernel without them.
fn resting_on_requests(net: &NetworkMount) -> Option<Agent> {
    resting_with(net, &[])
}

/// As `resting_on_requests`, the daemon given `more` arguments.
fn resting_with(net: &NetworkMount, more: &[&str]) -> Option<Agent> {
    let watch = net.mount.to_str().unwrap();
    let agent = Agent::start(&[&["--watch", watch, "--rest-after", "5"], more].concat());
    let route = learning_route(&agent);
    if !kernel_has_hooks(net) {
        assert!(route.starts_with("from their syscalls"), "{route}");
        return None;
    }
    let way = way(net);
    assert!(route.starts_with(way.route), "{route}");
    hocus_tests::wait_until(30, "the syscall program to rest", || {
        agent.status()["tracing"]["resting"] == true
    });
    let links = agent.attached();
    assert!(!links.iter().any(|l| l == SYSCALLS), "{links:?}");
    for program in way.programs {
        assert!(links.iter().any(|l| l == program), "{links:?}");
    }
    Some(agent)
}

/// The syscall program rests, as it did since the daemon first rested but while each
/// job started (it sees the namespace the job's session makes, then rests again).
fn still_resting(agent: &Agent) {
    let status = agent.status();
    let (t, jobs) = (&status["tracing"], &status["cache"]["jobs_started"]);
    assert_eq!(t["resting"], true, "{t}");
    assert_eq!(&t["wakeups"], jobs, "{t}");
    assert_eq!(t["rests"].as_u64(), jobs.as_u64().map(|j| j + 1), "{t}");
    assert!(!agent.attached().iter().any(|l| l == SYSCALLS));
}

/// The environment of `put_python_package` and a data file, for a job to import and
/// read.
fn put_workload(net: &NetworkMount) -> (std::path::PathBuf, std::path::PathBuf) {
    net.put_python_package("env/lib");
    let data = net.put("data/train.bin", &vec![7u8; 300_000]);
    (net.path("env/lib"), data)
}

/// A job that imports the package (no bytecode written) and reads the data file.
fn import_and_read(agent: &Agent, lib: &Path, data: &Path) {
    let out = agent.run_job(&format!(
        "PYTHONDONTWRITEBYTECODE=1 PYTHONPATH={} python3 -c 'import mypkg.core, sys; assert mypkg.core.VALUE == 41; sys.stdout.write(str(len(open(\"{}\", \"rb\").read())))'",
        lib.display(),
        data.display()
    ));
    assert_success(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "300000");
}

fn files(p: &Value) -> Vec<(String, u64, u64)> {
    let mut files: Vec<_> = p["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let path = f["path"].as_str().unwrap().to_owned();
            (
                path,
                f["opens"].as_u64().unwrap(),
                f["bytes_read"].as_u64().unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

/// The directories opened (listed), with how often.
fn dirs_opened(p: &Value) -> Vec<(String, u64)> {
    let mut dirs: Vec<_> = p["dirs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["opens"].as_u64().unwrap() > 0)
        .map(|d| {
            let path = d["path"].as_str().unwrap().to_owned();
            (path, d["opens"].as_u64().unwrap())
        })
        .collect();
    dirs.sort();
    dirs
}

fn missing(p: &Value) -> Vec<String> {
    p["missing"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["path"].as_str().unwrap().to_owned())
        .collect()
}

/// Whether `name` is `other` or a directory above it.
fn is_or_holds(name: &str, other: &str) -> bool {
    other == name
        || other
            .strip_prefix(name)
            .is_some_and(|rest| rest.starts_with('/'))
}

#[test]
fn a_job_is_learned_from_the_servers_requests_as_from_its_syscalls() {
    let net = NetworkMount::start();
    let (lib, data) = put_workload(&net);
    let Some(mut agent) = resting_on_requests(&net) else {
        return;
    };
    import_and_read(&agent, &lib, &data);
    still_resting(&agent);
    let by_requests = agent.export();
    agent.stop();

    // The same job, learned by the syscall program, from the same cold client cache.
    net.drop_client_caches();
    let watch = net.mount.to_str().unwrap();
    let agent = Agent::start_with_fallbacks(way(&net).fallback, &["--watch", watch]);
    assert!(learning_route(&agent).starts_with("from their syscalls"));
    import_and_read(&agent, &lib, &data);
    let by_syscalls = agent.export();

    // The same files, each opened as often and with as many bytes read from the server.
    assert_eq!(
        files(&by_requests),
        files(&by_syscalls),
        "{by_requests:#}\n{by_syscalls:#}"
    );
    // The same directories listed (the import system lists each package's directory).
    let dirs = dirs_opened(&by_requests);
    assert!(
        dirs.iter().any(|(d, _)| d.ends_with("/mypkg")),
        "{by_requests:#}\n{by_syscalls:#}"
    );
    assert_eq!(dirs, dirs_opened(&by_syscalls), "{by_syscalls:#}");
    let f = file_entry(&by_requests, &data).unwrap();
    assert_eq!(
        (f["opens"].as_u64(), f["bytes_read"].as_u64()),
        (Some(1), Some(300_000))
    );
    // The names the import system missed: a failed lookup names the first missing part
    // of a path (a directory), a failed syscall the whole path below it.
    let (asked, called) = (missing(&by_requests), missing(&by_syscalls));
    assert!(!asked.is_empty());
    for name in &called {
        assert!(
            asked.iter().any(|a| is_or_holds(a, name)),
            "{name} not in {asked:?}"
        );
    }
    for name in &asked {
        assert!(
            called.iter().any(|c| is_or_holds(name, c)),
            "{name} not in {called:?}"
        );
    }
}

#[test]
fn a_jobs_writes_renames_and_removals_are_seen_at_rest() {
    let net = NetworkMount::start();
    let (lib, _) = put_workload(&net);
    net.put("out/old.log", b"old\n");
    net.put("out/gone/x", b"x\n");
    net.put("out/result.txt", b"stale\n");
    // Truncated through a descriptor (`truncate`: ftruncate) and by its path
    // (truncate(2)).
    net.put("out/cut.txt", b"long enough\n");
    net.put("out/cut2.txt", b"long enough\n");
    // A name too long to be kept inside its dentry: placed by the path the job gave.
    let long = format!("out/{}.txt", "n".repeat(60));
    net.put(&long, b"long\n");
    let Some(agent) = resting_on_requests(&net) else {
        return;
    };
    // Python writes its bytecode as CPython does (a new directory, a temporary file,
    // renamed into place); the shell writes, renames over, removes.
    let out = agent.run_job(&format!(
        "PYTHONPATH={lib} env -u PYTHONDONTWRITEBYTECODE python3 -c 'import mypkg.core' && cd {out} && echo new > fresh.txt \
         && echo done > tmp.txt && mv tmp.txt result.txt && rm old.log gone/x && rmdir gone \
         && mkdir made && rm {long} && truncate -s 1 cut.txt \
         && python3 -c 'import os; os.truncate(\"cut2.txt\", 1)'",
        lib = lib.display(),
        out = net.path("out").display(),
        long = net.path(&long).display(),
    ));
    assert_success(&out);
    still_resting(&agent);
    let p = agent.export();
    let written = |rel: &str| file_entry(&p, &net.path(rel)).is_some_and(|f| f["written"] == true);
    for rel in [
        "out/fresh.txt",
        "out/result.txt",
        "out/old.log",
        "out/gone/x",
        "out/cut.txt",
        "out/cut2.txt",
    ] {
        assert!(written(rel), "{rel} not written in {p:#}");
    }
    let pycache = net.path("env/lib/mypkg/__pycache__");
    let pyc = std::fs::read_dir(net.server_path("env/lib/mypkg/__pycache__"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .find(|n| n.starts_with("core."))
        .expect("CPython wrote core's bytecode");
    assert!(
        written(&format!("env/lib/mypkg/__pycache__/{pyc}")),
        "{p:#}"
    );
    let changed = hocus_tests::mutated_dirs(&p);
    for dir in [
        pycache,
        net.path("out"),
        net.path("out/gone"),
        net.path("out/made"),
    ] {
        assert!(
            changed.contains(&dir.to_str().unwrap()),
            "{} not changed: {changed:?}",
            dir.display()
        );
    }
    // CPython's temporary name for a package's bytecode is longer than a dentry keeps
    // (`__init__.cpython-311.pyc.` and an id): placed by its path too (on FUSE; the NFS
    // client's functions are given the dentries).
    assert_eq!(agent.kernel_counter("change_unplaced"), 0);
}

/// A change the kernel side cannot place (by an absolute path, in a mount namespace not
/// learned, of a name too long for a dentry) has every copy a running job has bound
/// checked against the network at once; what no job has bound is checked by the next
/// job's start, so it asks nothing of the server from an idle node.
#[test]
fn a_change_no_request_can_place_checks_every_running_jobs_copy_at_once() {
    let net = NetworkMount::start();
    let long = format!("data/{}.csv", "c".repeat(60));
    let file = net.put(&long, b"a,b\n1,2\n");
    let Some(agent) = resting_on_requests(&net) else {
        return;
    };
    // A job reads it: learned, then copied.
    assert_success(&agent.run_job(&format!("cat {} >/dev/null", file.display())));
    hocus_tests::wait_until(60, "a copy of the file", || {
        agent.local_copy(&file).exists()
    });
    // A job that has it bound runs until told.
    let work = tempfile::tempdir().unwrap();
    let go = work.path().join("go");
    let job = agent.python_job_started(&format!(
        "import os, time\nwhile not os.path.exists({go:?}): time.sleep(0.05)",
        go = go.display().to_string()
    ));
    hocus_tests::wait_until(30, "the job running", || agent.cache()["jobs_running"] == 1);
    // Its hits are counted by the tracer for `--rest-after`; then the request programs
    // learn again.
    hocus_tests::wait_until(30, "the syscall program to rest again", || {
        agent.status()["tracing"]["resting"] == true
    });
    // A process in a mount namespace of its own, which the daemon has not learned,
    // renames it away by an absolute path, its name too long to be kept in a dentry:
    // no request names it in a way the kernel side can place.
    let renamed = net.path("data/renamed.csv");
    let out = std::process::Command::new("unshare")
        .args(["-m", "mv"])
        .arg(&file)
        .arg(&renamed)
        .output()
        .unwrap();
    assert_success(&out);
    if net.nfs.is_some() {
        // The NFS client's rename is given both dentries: placed whatever the names'
        // length or the caller's namespace, and the copy goes with the change.
        hocus_tests::wait_until(10, "the copy of the renamed file to go", || {
            !agent.local_copy(&file).exists()
        });
        assert_eq!(agent.kernel_counter("change_unplaced"), 0);
    } else {
        // (Both of its names: which is the long one is not known. sshfs is asked
        // twice: `mv` tries a rename that must not replace first, which it lacks.)
        hocus_tests::wait_until(30, "the unplaced change to be counted", || {
            agent.kernel_counter("change_unplaced") >= 2
        });
        // The running job's copies are compared with the network at once: the file's
        // is gone, long before the next revalidation (30 s).
        hocus_tests::wait_until(10, "the copy of the renamed file to go", || {
            !agent.local_copy(&file).exists()
        });
    }
    std::fs::write(&go, b"").unwrap();
    assert_success(&job.wait_with_output().unwrap());
}

#[test]
fn pages_a_job_maps_count_as_read_at_rest() {
    let net = NetworkMount::start();
    let data = net.put("data/mapped.bin", &vec![3u8; 300_000]);
    // Nothing is copied: the daemon's copy, made as soon as the job opened the file,
    // would read its pages into the page cache before the job's faults do (the CI's
    // 6.1 guest did), and pages the daemon read are not the job's.
    let Some(agent) = resting_with(&net, &["--include-ext", ".py"]) else {
        return;
    };
    net.drop_client_caches();
    // Mapped and touched page by page: no read(2) at all.
    let out = agent.run_job(&format!(
        "python3 -c 'import mmap; f = open(\"{}\", \"rb\"); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); print(sum(m[i] for i in range(0, len(m), 4096)))'",
        data.display()
    ));
    assert_success(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "222");
    still_resting(&agent);
    profiled(&agent, &data, "the mapped pages", |f| {
        f["bytes_read"].as_u64().unwrap() >= 300_000
    });
    let p = agent.export();
    assert_eq!(
        file_entry(&p, &data).unwrap()["opens"].as_u64(),
        Some(1),
        "{p:#}"
    );
}

const MIB: u64 = 1 << 20;
const GRAIN: u64 = 64 << 10;

/// A job reading a 48 MiB file here and there: `pread` of 1 MiB at 3, 20 (plus 100
/// bytes) and 40 MiB, `preadv` of 1 MiB at 44 MiB, two `read`s of 1 MiB from 30 MiB on
/// (at the file's position); and mapping another file, of 16 MiB, whose pages from 10 MiB
/// to 11 MiB it touches (MADV_RANDOM: no read-around). Apart, because every page that
/// enters a mapped file's page cache counts: the first file's read-ahead, still coming in
/// once it was mapped, joined its ranges. It holds the first file open across several
/// of the daemon's sweeps (a second each) before its reads at the file's position: a
/// file the kernel side still follows is not taken for one whose close was lost.
fn read_here_and_there(agent: &Agent, data: &Path, mapped: &Path) {
    let script = format!(
        "import mmap, os, time\n\
         fd = os.open('{}', os.O_RDONLY)\n\
         n = sum(len(os.pread(fd, {MIB}, at)) for at in ({}, {}, {}))\n\
         n += os.preadv(fd, [bytearray({MIB})], {})\n\
         time.sleep(4)\n\
         os.lseek(fd, {}, os.SEEK_SET)\n\
         n += len(os.read(fd, {MIB})) + len(os.read(fd, {MIB}))\n\
         m = mmap.mmap(os.open('{}', os.O_RDONLY), 0, prot=mmap.PROT_READ)\n\
         m.madvise(mmap.MADV_RANDOM)\n\
         n += len([m[i] for i in range({}, {}, 4096)]) * 4096\n\
         print(n)",
        data.display(),
        3 * MIB,
        20 * MIB + 100,
        40 * MIB,
        44 * MIB,
        30 * MIB,
        mapped.display(),
        10 * MIB,
        11 * MIB,
    );
    let out = agent.run_job(&format!("python3 -c \"{script}\""));
    assert_success(&out);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        (7 * MIB).to_string()
    );
}

/// The byte ranges profiled for `path`, once there are `at_least` of them (the last run
/// of a mapping is read from the kernel at a sweep).
fn ranges(agent: &Agent, path: &Path, at_least: usize) -> Vec<[u64; 2]> {
    let entry = profiled(agent, path, &format!("{at_least} ranges"), |f| {
        f["ranges"].as_array().is_some_and(|r| r.len() >= at_least)
    });
    serde_json::from_value(entry["ranges"].clone()).unwrap()
}

/// The profile's entry for `path` once `done` holds of it, waited for up to 30 s (on
/// the host: `patience`). On timeout it says what the profile and the tracer had, to
/// tell what was never reported from what was reported late.
fn profiled(agent: &Agent, path: &Path, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let bound = hocus_tests::patience(30);
    let deadline = std::time::Instant::now() + bound;
    let mut poll = hocus_tests::Poll::default();
    loop {
        let export = agent.export();
        let entry = file_entry(&export, path);
        if let Some(f) = entry.filter(|f| done(f)) {
            return f.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "waited {} s for {what} of {} to be profiled: {entry:#?}\ntracing: {:#}\n{}",
            bound.as_secs(),
            path.display(),
            agent.status()["tracing"],
            agent.log()
        );
        poll.pause();
    }
}

#[test]
fn the_byte_ranges_a_job_reads_are_profiled_by_every_route() {
    let net = NetworkMount::start();
    let data = net.put(
        "data/shards.bin",
        &repeating_bytes(48 * MIB as usize, 253, 0),
    );
    let mapped = net.put(
        "data/mapped.bin",
        &repeating_bytes(16 * MIB as usize, 241, 0),
    );
    let watch = net.mount.to_str().unwrap();
    // Nothing is copied: the daemon's own copy would fill the page cache first.
    let only_py = ["--include-ext", ".py"];

    // From the job's syscalls (and the pages its mapping faulted in): exactly what it
    // read, widened to grains of 64 KiB.
    let agent = Agent::start_with_fallbacks(
        way(&net).fallback,
        &[&["--watch", watch], &only_py[..]].concat(),
    );
    net.drop_client_caches();
    read_here_and_there(&agent, &data, &mapped);
    let by_syscalls = (ranges(&agent, &data, 5), ranges(&agent, &mapped, 1));
    assert_eq!(
        by_syscalls,
        (
            vec![
                [3 * MIB, 4 * MIB],
                [20 * MIB, 21 * MIB + GRAIN],
                [30 * MIB, 32 * MIB],
                [40 * MIB, 41 * MIB],
                [44 * MIB, 45 * MIB],
            ],
            vec![[10 * MIB, 11 * MIB]]
        ),
        "{:#}",
        agent.export()
    );
    drop(agent);

    // From the filesystem, at rest: on NFS the client's reads are the job's; on FUSE the
    // server's READs are what the page cache missed, read-ahead included: they hold
    // every range the job read and not much more.
    net.drop_client_caches();
    let Some(agent) = resting_with(&net, &only_py) else {
        return;
    };
    read_here_and_there(&agent, &data, &mapped);
    still_resting(&agent);
    let nfs = net.nfs.is_some();
    let by_filesystem = (
        ranges(&agent, &data, if nfs { 5 } else { 1 }),
        ranges(&agent, &mapped, 1),
    );
    if nfs {
        assert_eq!(by_filesystem, by_syscalls);
        return;
    }
    for (read, got) in [
        (&by_syscalls.0, &by_filesystem.0),
        (&by_syscalls.1, &by_filesystem.1),
    ] {
        for [start, end] in read {
            assert!(
                got.iter().any(|[s, e]| s <= start && end <= e),
                "[{start}, {end}) not in {got:?}"
            );
        }
        let total = |r: &[[u64; 2]]| r.iter().map(|[s, e]| e - s).sum::<u64>();
        assert!(
            total(got) <= total(read) * 3 / 2,
            "{got:?} against {read:?}"
        );
    }
}

/// Whether `ranges` hold all of `[start, end)`.
fn hold(ranges: &[[u64; 2]], start: u64, end: u64) -> bool {
    ranges.iter().any(|[s, e]| *s <= start && end <= *e)
}

fn held(ranges: &[[u64; 2]]) -> u64 {
    ranges.iter().map(|[s, e]| e - s).sum()
}

#[test]
fn what_numpy_memmap_and_h5py_read_of_big_files_is_profiled_as_ranges() {
    let packages = hocus_tests::numpy_h5py();
    let net = NetworkMount::start();
    // An HDF5 file of 64 MiB: a contiguous float32 dataset of 1024 rows of 64 KiB.
    let (made, offset) = hocus_tests::hdf5_rows(&packages);
    let h5 = net.put("data/train.h5", &made);
    let frames = net.put(
        "data/frames.u8",
        &hocus_tests::counting_bytes(128 * MIB as usize),
    );
    // Nothing copied: the daemon's own copy would fill the page cache first.
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--include-ext",
        ".py",
    ]);
    net.drop_client_caches();

    // A shuffled pass over four 1 MiB records of a memory-mapped array.
    let chunks = [3, 40, 77, 115];
    let sums = agent.python_with(
        &packages,
        &format!(
            "import numpy as np\n\
             m = np.memmap('{}', dtype=np.uint8, mode='r')\n\
             print(sum(int(m[a << 20:(a + 1) << 20].sum()) for a in {chunks:?}))",
            frames.display()
        ),
    );
    let want: u64 = chunks
        .iter()
        .flat_map(|a| (a * MIB..(a + 1) * MIB).map(|i| i % 251))
        .sum();
    assert_eq!(sums, want.to_string());
    // A slice of 100 rows of the dataset.
    let rows = agent.python_with(
        &packages,
        &format!(
            "import h5py\n\
             with h5py.File('{}', 'r') as f:\n    \
             print(f['x'][500:600].shape)",
            h5.display()
        ),
    );
    assert_eq!(rows, "(100, 16384)");

    let p = agent.export();
    assert_eq!(file_entry(&p, &frames).unwrap()["mapped"], true, "{p:#}");
    assert!(
        file_entry(&p, &h5).unwrap().get("mapped").is_none(),
        "{p:#}"
    );
    // The mapping: the pages its faults brought in, around each record, not the file.
    let mapped = ranges(&agent, &frames, 1);
    for a in chunks {
        assert!(hold(&mapped, a * MIB, (a + 1) * MIB), "{a} MiB: {mapped:?}");
    }
    assert!(held(&mapped) <= 96 * MIB, "{mapped:?}");
    // HDF5: the slice's rows, and its metadata at the front; read-ahead aside, no more.
    let read = ranges(&agent, &h5, 1);
    let (start, end) = (offset + 500 * 65536, offset + 600 * 65536);
    assert!(hold(&read, start, end), "[{start}, {end}): {read:?}");
    assert!(held(&read) <= (end - start) + 4 * MIB, "{read:?}");
    eprintln!(
        "profiled: memmap of 4 MiB as {} bytes in {} ranges; h5py slice of {} as {} in {}",
        held(&mapped),
        mapped.len(),
        end - start,
        held(&read),
        read.len()
    );
}
