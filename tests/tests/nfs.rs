//! What only kernel NFS does: a server that squashes root, and a client that caches
//! attributes for as long as its mount says. Built with the `kernel-nfs` feature and run
//! in the rig's guests (this machine's kernel has no NFS client):
//! `cargo xtask vm test --kernel 6.1 --fs nfs3 --test nfs`.

use std::{
    fs,
    io::ErrorKind,
    os::unix::{
        fs::{MetadataExt, PermissionsExt},
        process::CommandExt,
    },
    process::{Command, Output},
};

use hocus_tests::{Agent, NetworkMount, assert_success, nfs::Share, test_user, wait_until};

fn as_user(cmd: &mut Command) -> Output {
    let (uid, gid) = test_user();
    cmd.current_dir("/").uid(uid).gid(gid).output().unwrap()
}

/// Most sites export homes with root squashed: root on the node is nobody to the
/// server, so the daemon cannot read a user's private file as root. It copies it as the
/// user seen reading it; the copy keeps its owner and mode, and that user's jobs read
/// it on the node.
#[test]
fn under_root_squash_a_private_file_is_copied_as_its_reader_and_served_to_their_jobs() {
    let user = test_user();
    let net = NetworkMount::start_nfs(
        Some(user),
        Share {
            root_squash: true,
            options: "",
        },
    );
    let private = net.put("home/private.txt", b"only mine\n");
    fs::set_permissions(net.server_path("home"), fs::Permissions::from_mode(0o700)).unwrap();
    fs::set_permissions(
        net.server_path("home/private.txt"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    // Root on the node is squashed: the server refuses it.
    let refused = fs::read(&private).expect_err("root read a private file through the squash");
    assert_eq!(refused.kind(), ErrorKind::PermissionDenied, "{refused}");

    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    let out = as_user(Command::new("cat").arg(&private));
    assert_success(&out);
    assert_eq!(out.stdout, b"only mine\n");
    let copy = agent.local_copy(&private);
    wait_until(30, "the private file copied", || copy.exists());
    assert_eq!(fs::read(&copy).unwrap(), b"only mine\n");
    let meta = fs::metadata(&copy).unwrap();
    assert_eq!(
        (meta.uid(), meta.gid(), meta.mode() & 0o777),
        (user.0, user.1, 0o600)
    );

    // The user's job reads it from the copy, bound over the network path (the file's
    // own, or its directory's snapshot).
    let script = format!(
        "cat {p} && grep -cE ' {home}( |/private.txt )' /proc/self/mountinfo",
        p = private.display(),
        home = net.path("home").display()
    );
    let out = as_user(&mut agent.cli(&["run", "--", "sh", "-c", &script]));
    assert_success(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "only mine\n1\n");
}

/// A client that trusts its cached attributes for ten minutes (`actimeo=600`, as sites
/// set for software trees) still gives a job what the server holds: the job-start
/// check asks the server itself, whatever the client caches. A plain process on the
/// node, meanwhile, still sees the old size: NFS's own semantics, not the daemon's.
#[test]
fn a_job_sees_a_change_the_clients_attribute_cache_still_hides() {
    // At the share's root, which is never snapshotted: a copy of its own.
    a_job_sees_the_server_change_of("config.py");
}

/// The same for a file inside a snapshotted directory, rewritten in place on the
/// server (another node's write, no name added or removed): its directory did not
/// change, so the job-start check asks the server for each file of the snapshot too.
#[test]
fn a_job_sees_a_file_rewritten_in_place_inside_a_snapshot() {
    a_job_sees_the_server_change_of("sw/lib/config.py");
}

/// File `rel` of a share mounted with `actimeo=600`, read and copied, rewritten on the
/// server while the client's attribute cache holds the old size: a job reads the new.
fn a_job_sees_the_server_change_of(rel: &str) {
    let net = NetworkMount::start_nfs(
        None,
        Share {
            root_squash: false,
            options: "actimeo=600",
        },
    );
    let file = net.put(rel, b"VERSION = 1\n");
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--revalidate",
        "3600",
    ]);
    assert_eq!(fs::read(&file).unwrap(), b"VERSION = 1\n");
    wait_until(30, "the copy", || agent.local_copy(&file).exists());

    // Changed on the server: longer, and a second later (mtimes in whole seconds on
    // some servers).
    std::thread::sleep(std::time::Duration::from_millis(1100));
    fs::write(net.server_path(rel), b"VERSION = 22\n").unwrap();
    let cached_size = fs::metadata(&file).unwrap().len();
    assert_eq!(
        cached_size, 12,
        "the client's attribute cache should still hold the old size"
    );

    let out = agent.run_job(&format!("cat {}", file.display()));
    assert_success(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "VERSION = 22\n");
    wait_until(10, "the stale copy dropped or made again", || {
        fs::read(agent.local_copy(&file)).map_or(true, |b| b == b"VERSION = 22\n")
    });
}

/// Starts the guest's NFS server again (its threads), even if the test fails.
struct Restart;

impl Drop for Restart {
    fn drop(&mut self) {
        let _ = Command::new("rpc.nfsd").arg("8").status();
    }
}

/// A server that stops answering (its nfsd threads stopped: a hard mount then blocks
/// whoever asks it, retrying until it is back) does not hold a job's start longer than
/// the job-start check's bound: what could not be confirmed is not bound. The daemon
/// keeps answering meanwhile, and everything goes on once the server is back.
#[test]
fn a_silent_server_delays_a_job_by_the_checks_bound_and_the_daemon_keeps_answering() {
    let net = NetworkMount::start_nfs(None, Share::default());
    let file = net.put("sw/lib/tool.py", b"TOOL = 1\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    assert_eq!(fs::read(&file).unwrap(), b"TOOL = 1\n");
    wait_until(30, "the copy", || agent.local_copy(&file).exists());

    let restart = Restart;
    let out = Command::new("rpc.nfsd").arg("0").output().unwrap();
    assert_success(&out);
    let started = std::time::Instant::now();
    let out = agent.run_job("echo ran");
    assert_success(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ran\n");
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_secs(30),
        "the job waited {took:?} for a silent server:\n{}",
        agent.log()
    );
    // The copy could not be confirmed: it was not bound.
    let unchecked = agent.log().lines().rev().find_map(|l| {
        let (before, _) = l.split_once(" not checked in time")?;
        before.rsplit(' ').next()?.parse::<u64>().ok()
    });
    assert_eq!(unchecked, Some(1), "{}", agent.log());
    // The daemon answers while the server is silent.
    let status = agent.status();
    assert!(status["watched"].is_array(), "{status:#}");

    drop(restart);
    assert_eq!(fs::read(&file).unwrap(), b"TOOL = 1\n");
    let out = agent.run_job(&format!("cat {}", file.display()));
    assert_success(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "TOOL = 1\n");
}

/// At rest the daemon learns changes from the NFS client's functions, and each counts
/// once the server accepted it: a user's rename and rmdir the server refuses (onto, or
/// of, a directory not empty) change nothing in the profile and drop no copy (the
/// package's snapshot stays); an unlink it accepts drops the file's copy.
#[test]
fn a_change_the_server_refuses_counts_for_nothing_and_one_it_accepts_drops_the_copy() {
    let user = test_user();
    let net = NetworkMount::start_nfs(Some(user), Share::default());
    let module = net.put("env/pkg/core.py", b"VALUE = 41\n");
    net.put("env/busy/x.py", b"x\n");
    let watch = net.mount.to_str().unwrap();
    let agent = Agent::start(&["--watch", watch, "--rest-after", "5"]);
    let route = agent.route("learning jobs");
    assert!(
        route.starts_with("from the NFS client's functions"),
        "{route}"
    );
    wait_until(30, "the syscall program to rest", || {
        agent.status()["tracing"]["resting"] == true
    });
    let out = as_user(agent.cli(&["run", "--", "cat"]).arg(&module));
    assert_success(&out);
    let copy = agent.local_copy(&module);
    wait_until(60, "the module copied", || copy.exists());

    // At rest again: what follows is seen by the NFS client's functions alone.
    wait_until(30, "the syscall program to rest after the job", || {
        agent.status()["tracing"]["resting"] == true
    });
    let rests = agent.status()["tracing"]["rests"].clone();
    // The user renames the package over a directory that is not empty, and removes
    // that directory: the server refuses both.
    let (pkg, busy) = (net.path("env/pkg"), net.path("env/busy"));
    let script = format!(
        "mv -T {pkg} {busy}; echo mv $?; rmdir {busy}; echo rmdir $?",
        pkg = pkg.display(),
        busy = busy.display()
    );
    let out = as_user(Command::new("sh").args(["-c", &script]));
    assert_success(&out);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("mv 1") && said.contains("rmdir 1"), "{said}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not empty"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // What a change counted at the function's entry made of them: the package marked
    // written, both directories changed. Counted within a second (the daemon's sweep).
    std::thread::sleep(std::time::Duration::from_secs(3));
    let p = agent.export();
    assert!(
        hocus_tests::file_entry(&p, &pkg).is_none_or(|f| f["written"] != true),
        "{p:#}"
    );
    let mutated = hocus_tests::mutated_dirs(&p);
    assert!(mutated.is_empty(), "{mutated:?}\n{}", agent.log());
    assert!(copy.exists(), "{}", agent.log());
    assert_eq!(fs::read(&copy).unwrap(), b"VALUE = 41\n");
    assert!(
        !agent.log().contains("dropping the snapshot"),
        "{}",
        agent.log()
    );

    // Accepted: the module removed, its copy goes.
    let out = as_user(Command::new("rm").arg(&module));
    assert_success(&out);
    wait_until(10, "the removed module's copy to go", || !copy.exists());
    let t = &agent.status()["tracing"];
    assert!(t["resting"] == true && t["rests"] == rests, "{t}");
}

/// What the NFS programs follow of open files is bounded per user: one user holding
/// 17,000 NFS files open (more than the whole table's 16,384) blinds the learning of
/// no one else's job. Their opens past their share (2,048) are counted lost; root's
/// job, opening and reading a file meanwhile, is learned with its bytes.
#[test]
fn one_users_thousands_of_open_nfs_files_blind_no_other_jobs_learning() {
    let user = test_user();
    let net = NetworkMount::start_nfs(Some(user), Share::default());
    let theirs = net.put("attacker/held.txt", b"held\n");
    let data = net.put("victim/data.bin", &vec![5u8; 100_000]);
    let watch = net.mount.to_str().unwrap();
    let agent = Agent::start(&["--watch", watch, "--rest-after", "5"]);
    wait_until(30, "the syscall program to rest", || {
        agent.status()["tracing"]["resting"] == true
    });
    // 17 processes of the user's, each holding its file open 1,000 times.
    let work = tempfile::tempdir().unwrap();
    fs::set_permissions(work.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let (ready, stop) = (work.path().join("ready"), work.path().join("stop"));
    let script = format!(
        "import os, time\nfor i in range(17):\n    if os.fork() == 0:\n        held = [open('{theirs}', 'rb') for _ in range(1000)]\n        open('{ready}.%d' % i, 'w').close()\n        while not os.path.exists('{stop}'): time.sleep(0.1)\n        os._exit(0)\nfor _ in range(17): os.wait()\n",
        theirs = theirs.display(),
        ready = ready.display(),
        stop = stop.display(),
    );
    let (uid, gid) = user;
    let mut holder = Command::new("python3")
        .args(["-c", &script])
        .current_dir("/")
        .uid(uid)
        .gid(gid)
        .spawn()
        .unwrap();
    wait_until(180, "the user's 17,000 opens", || {
        (0..17).all(|i| work.path().join(format!("ready.{i}")).exists())
    });
    let lost = agent.kernel_counter("lost_open_files_of_user");
    // Root's job opens and reads its file while they are held, once the syscall
    // program rests again after its start (the NFS programs alone see it).
    let go = work.path().join("go");
    let woken = agent.status()["tracing"]["wakeups"].as_u64();
    let job = agent
        .cli(&["run", "--", "sh", "-c"])
        .arg(format!(
            "while [ ! -e {go} ]; do sleep 0.1; done; cat {data} >/dev/null",
            go = go.display(),
            data = data.display()
        ))
        .current_dir("/")
        .spawn()
        .unwrap();
    wait_until(60, "the syscall program to rest while the job runs", || {
        let t = &agent.status()["tracing"];
        t["wakeups"].as_u64() > woken && t["resting"] == true
    });
    fs::write(&go, b"").unwrap();
    let out = job.wait_with_output().unwrap();
    fs::write(&stop, b"").unwrap();
    let held = holder.wait().unwrap();
    assert_success(&out);
    assert!(held.success());
    assert!(
        lost >= 17_000 - 2_048 - 64,
        "{lost} of the user's opens counted past their share"
    );
    assert_eq!(agent.kernel_counter("lost_open_files_map_full"), 0);
    let p = agent.export();
    let entry = hocus_tests::file_entry(&p, &data).expect("the job's file is learned");
    assert_eq!(entry["bytes_read"], 100_000, "{entry}");
}
