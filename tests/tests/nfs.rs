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
