//! Coherence: a copy stands for the network file exactly as long as the file is
//! unchanged, and page-cache evictions (which renumber inodes on FUSE) are not changes.

use std::{
    collections::HashSet,
    fs,
    os::unix::fs::MetadataExt,
    process::Command,
    thread,
    time::{Duration, SystemTime},
};

use hocus_tests::{Agent, NetworkMount, assert_success, read_all, wait_until};

/// Imports `module` (a plain process, not a job) with `env/empty` before `env/lib` on
/// the path: the misses in env/empty make hocus snapshot env.
fn import_through_env(net: &NetworkMount, module: &str) {
    let out = Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .env(
            "PYTHONPATH",
            format!(
                "{}:{}",
                net.path("env/empty").display(),
                net.path("env/lib").display()
            ),
        )
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .current_dir("/")
        .output()
        .unwrap();
    assert_success(&out);
}

/// A daemon whose revalidation is far away: only the job-start check can see a change
/// in time.
fn checking_only_at_job_start(net: &NetworkMount) -> Agent {
    Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--revalidate",
        "3600",
    ])
}

fn drop_caches() {
    fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
}

#[test]
fn page_cache_drops_invalidate_nothing_unchanged_and_a_real_change_is_still_caught() {
    let net = NetworkMount::start();
    net.put("env/lib/mypkg/__init__.py", b"from . import core\n");
    net.put("env/lib/mypkg/core.py", b"VALUE = 41\n");
    net.put("env/empty/README", b"nothing to import here\n");
    let data = net.put("data/one.bin", b"version 1\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap(), "--revalidate", "1"]);
    // An import that misses in env/empty makes hocus snapshot env/lib (and env/empty);
    // the data file is copied on its own.
    import_through_env(&net, "mypkg.core");
    read_all(&data);
    let env = net.path("env/lib");
    let snapshots = |a: &Agent| {
        a.cache()["snapshots"]
            .as_array()
            .is_some_and(|s| s.iter().any(|p| p == env.to_str().unwrap()))
    };
    wait_until(30, "the snapshot and the copy", || {
        snapshots(&agent) && agent.local_copy(&data).exists()
    });
    let invalidations = |a: &Agent| a.cache()["invalidations"].as_u64().unwrap();
    let before = invalidations(&agent);
    // Evictions, each followed by at least one revalidation: the inode numbers this
    // sshfs gives change (or this test would prove nothing), the files do not. NFS's
    // are the server's file ids, which do not change: identity is made of them there.
    let mut inodes = HashSet::new();
    // 12 here; HOCUS_TEST_DROPS=100 for the goal (about two minutes).
    let drops: usize = std::env::var("HOCUS_TEST_DROPS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(12);
    for _ in 0..drops {
        drop_caches();
        inodes.insert(fs::metadata(&data).unwrap().ino());
        read_all(&net.path("env/lib/mypkg/core.py"));
        thread::sleep(Duration::from_millis(1200));
    }
    match net.nfs {
        None => assert!(
            inodes.len() > 1,
            "sshfs kept its inode numbers through evictions: {inodes:?}"
        ),
        Some(_) => assert_eq!(inodes.len(), 1, "NFS's file ids changed: {inodes:?}"),
    }
    assert_eq!(invalidations(&agent), before, "{}", agent.cache());
    assert!(
        snapshots(&agent),
        "the snapshot was dropped: {}",
        agent.cache()
    );
    assert!(agent.local_copy(&data).exists());
    assert_eq!(agent.cache()["copying"], 0, "nothing is left in flight");
    // A real change on the server, of the same size: caught by its mtime.
    let server = net.server_path("data/one.bin");
    fs::write(&server, b"version 2\n").unwrap();
    let later = SystemTime::now() + Duration::from_secs(10);
    fs::File::options()
        .write(true)
        .open(&server)
        .unwrap()
        .set_modified(later)
        .unwrap();
    wait_until(30, "the changed file invalidated", || {
        invalidations(&agent) > before
    });
}

#[test]
fn a_file_opened_for_writing_again_and_again_is_never_bound_and_a_fresh_install_still_is() {
    let net = NetworkMount::start();
    let lock = net.put("cache/.lockfile", b"");
    let entry = net.put("cache/entry.bin", b"compiled\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap(), "--revalidate", "1"]);
    // Jobs take the lock (opened read-write, never written) and read the entry, as a
    // compilation cache's users do.
    let python = |script: String| {
        let out = Command::new("python3")
            .args(["-c", &script])
            .output()
            .unwrap();
        assert_success(&out);
    };
    for _ in 0..4 {
        python(format!(
            "open({lock:?}, 'r+').close(); open({entry:?}).read()",
            lock = lock.display().to_string(),
            entry = entry.display().to_string()
        ));
    }
    // A package installed on the mount (written once), then imported a few times.
    let pkg = net.path("env/newpkg.py");
    fs::create_dir_all(pkg.parent().unwrap()).unwrap();
    fs::write(&pkg, b"X = 1\n").unwrap();
    for _ in 0..3 {
        read_all(&pkg);
    }
    wait_until(30, "the entry and the installed package copied", || {
        agent.local_copy(&entry).exists() && agent.local_copy(&pkg).exists()
    });
    agent.wait_for_revalidations(3);
    assert!(
        !agent.local_copy(&lock).exists(),
        "the lock file was copied: {}",
        agent.cache()
    );
    // A job can still take the lock and write it: it is not bound read-only.
    let out = agent
        .python_job(&format!(
            "f = open({:?}, 'r+'); f.write('held'); f.close()",
            lock.display().to_string()
        ))
        .output()
        .unwrap();
    assert_success(&out);
    assert_eq!(
        fs::read_to_string(net.server_path("cache/.lockfile")).unwrap(),
        "held"
    );
    let profile = agent.export();
    let f = hocus_tests::file_entry(&profile, &lock).unwrap();
    assert!(f["write_opens"].as_u64() >= Some(4), "{f}");
}

/// Another node rewrites a module in place (`open(..., "w")`: same inode, no name added
/// or removed, so no directory of the snapshot changes): a job started after it imports
/// the new module, as a plain `python3` on the mount does.
#[test]
fn a_module_rewritten_in_place_inside_a_snapshot_is_imported_as_the_server_has_it() {
    let net = NetworkMount::start();
    net.put("env/lib/mypkg/__init__.py", b"from . import core\n");
    let core = net.put("env/lib/mypkg/core.py", b"VALUE = 1\n");
    net.put("env/empty/README", b"nothing to import here\n");
    let agent = checking_only_at_job_start(&net);
    import_through_env(&net, "mypkg");
    agent.wait_for_snapshot(&net.path("env/lib"));
    let job = format!(
        "PYTHONPATH={}:{} PYTHONDONTWRITEBYTECODE=1 python3 -c 'import mypkg.core; print(mypkg.core.VALUE)'",
        net.path("env/empty").display(),
        net.path("env/lib").display()
    );
    let value = || {
        let out = agent.run_job(&job);
        assert_success(&out);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(value(), "1\n");
    // A second later (mtimes in whole seconds over SFTP), rewritten in place.
    thread::sleep(Duration::from_millis(1100));
    let on_server = net.server_path("env/lib/mypkg/core.py");
    let ino = fs::metadata(&on_server).unwrap().ino();
    fs::write(&on_server, b"VALUE = 22\n").unwrap();
    assert_eq!(fs::metadata(&on_server).unwrap().ino(), ino);
    wait_until(30, "a plain process to see the change", || {
        fs::read(&core).is_ok_and(|b| b == b"VALUE = 22\n")
    });
    assert_eq!(value(), "22\n");
    // The snapshot went, and the module's own stale copy with it.
    wait_until(10, "the stale copy dropped or made again", || {
        fs::read(agent.local_copy(&core)).map_or(true, |b| b == b"VALUE = 22\n")
    });
}

#[test]
fn a_new_job_sees_what_the_network_holds_not_an_older_copy() {
    let net = NetworkMount::start();
    let kept = net.put("cache/kept.bin", b"same\n");
    let rewritten = net.put("cache/rewritten.bin", b"old\n");
    let deleted = net.put("cache/deleted.bin", b"to be deleted\n");
    net.put("env/lib/mypkg/__init__.py", b"");
    net.put("env/empty/README", b"nothing to import here\n");
    let agent = checking_only_at_job_start(&net);
    for f in [&kept, &rewritten, &deleted] {
        read_all(f);
    }
    import_through_env(&net, "mypkg");
    let env = net.path("env/lib");
    wait_until(30, "the copies and the snapshot", || {
        let c = agent.cache();
        [&kept, &rewritten, &deleted]
            .iter()
            .all(|f| agent.local_copy(f).exists())
            && c["snapshots"]
                .as_array()
                .is_some_and(|s| s.iter().any(|p| p == env.to_str().unwrap()))
    });
    // Changed on the server: a file rewritten, one deleted, a module added to the
    // snapshotted tree. A plain process on the mount sees it all first.
    fs::write(net.server_path("cache/rewritten.bin"), b"new, longer\n").unwrap();
    fs::remove_file(net.server_path("cache/deleted.bin")).unwrap();
    let added = net.put("env/lib/mypkg/added.py", b"ADDED = 1\n");
    wait_until(30, "a plain process to see the changes", || {
        fs::read(&rewritten).is_ok_and(|b| b == b"new, longer\n")
            && !deleted.exists()
            && added.exists()
    });
    // Jobs started now see the same: the first drops the stale snapshots, the second
    // is offered the copies of the files one by one, and drops the stale ones.
    let script = format!(
        "cat {r}; test -e {d} && echo present || echo absent; cat {k}; cat {a}",
        r = rewritten.display(),
        d = deleted.display(),
        k = kept.display(),
        a = added.display()
    );
    for _ in 0..2 {
        let out = agent.run_job(&script);
        assert_success(&out);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "new, longer\nabsent\nsame\nADDED = 1\n"
        );
    }
    wait_until(10, "the stale copies dropped", || {
        !agent.local_copy(&deleted).exists() && !agent.local_copy(&rewritten).exists()
    });
    assert!(agent.local_copy(&kept).exists());
}

/// Whether the daemon's last job got local copies (None: it logged none yet).
fn served_last_job(agent: &Agent) -> Option<bool> {
    let log = agent.log();
    let last = log
        .lines()
        .rev()
        .find(|l| l.contains("local copies in place"))?;
    Some(!last.contains("with 0 local copies"))
}

/// A job may outlive the daemon that bound its local copies (a restart, an upgrade, a
/// crash): nobody is left then to take a copy away when its file changes on the
/// network. A daemon that stops takes its binds out of the running jobs, and one that
/// starts takes away those a killed daemon left: the jobs read the network from then on,
/// never an older copy.
#[test]
fn a_job_that_outlives_its_daemon_reads_the_network_not_an_older_copy() {
    let net = NetworkMount::start();
    let one = net.put("env/one.py", b"one = 1\n");
    let two = net.put("env/two.py", b"two = 1\n");
    let args = ["--watch", net.mount.to_str().unwrap()];
    let mut agent = Agent::start(&args);
    read_all(&one);
    read_all(&two);
    wait_until(30, "the copies", || {
        agent.local_copy(&one).exists() && agent.local_copy(&two).exists()
    });
    let flags = tempfile::tempdir().unwrap();
    // A job that reads `file` once now (from its copy, it says) and again when told to.
    let job = |agent: &Agent, file: &std::path::Path| {
        let go = flags.path().join(file.file_name().unwrap());
        let script = format!(
            // At most a minute, should the test fail before it says go.
            "cat {file}; echo started >&2; i=0; \
             while [ ! -e {go} ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; cat {file}",
            file = file.display(),
            go = go.display()
        );
        let mut child = agent
            .cli(&["run", "--", "sh", "-c", &script])
            .current_dir("/")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut started = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stderr.take().unwrap()),
            &mut started,
        )
        .unwrap();
        assert_eq!(started, "started\n");
        wait_until(10, "the job's start logged", || {
            served_last_job(agent).is_some()
        });
        assert!(
            served_last_job(agent).unwrap(),
            "the job got no local copy:\n{}",
            agent.log()
        );
        (child, go)
    };
    let finish = |(child, go): (std::process::Child, std::path::PathBuf)| {
        fs::write(go, b"").unwrap();
        String::from_utf8(child.wait_with_output().unwrap().stdout).unwrap()
    };

    // A daemon stopped (SIGTERM) while a job reads its copy.
    let running = job(&agent, &one);
    let log = agent.stop();
    fs::write(net.server_path("env/one.py"), b"one = 2\n").unwrap();
    assert_eq!(finish(running), "one = 1\none = 2\n", "{log}");
    assert!(log.contains("local copies out of 1 running jobs"), "{log}");

    // A daemon killed (SIGKILL) while a job reads its copy: the next one takes it away.
    let (dir, state_dir) = agent.into_dirs();
    let mut agent = Agent::start_with_state(dir, state_dir, &args);
    // Copies found at start are bound once revalidated.
    wait_until(30, "the copies bound again", || {
        assert_success(&agent.run_job("true"));
        served_last_job(&agent) == Some(true)
    });
    let running = job(&agent, &two);
    agent.kill9();
    fs::write(net.server_path("env/two.py"), b"two = 2\n").unwrap();
    let (dir, state_dir) = agent.into_dirs();
    let agent = Agent::start_with_state(dir, state_dir, &args);
    assert_eq!(finish(running), "two = 1\ntwo = 2\n", "{}", agent.log());
    assert!(
        agent.log().contains("bound in 1 jobs that outlived it"),
        "{}",
        agent.log()
    );
}
