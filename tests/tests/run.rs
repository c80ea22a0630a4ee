//! `hocus-agent run`: jobs in a mount namespace where local copies stand in for network
//! files, read-only, for root and for ordinary users.

use std::{
    fs,
    os::unix::{fs::PermissionsExt, process::CommandExt},
    path::Path,
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use hocus_tests::{Agent, NetworkMount, assert_success, read_all, wait_until};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The mountinfo lines of the job's own namespace that bind onto the mount.
const BINDS: &str = "awk '$5 ~ \"^/\" {print $5, $6}' /proc/self/mountinfo";

/// `cat PATH` as a job under hocus: what it printed, and the server's log meanwhile.
fn cat_in_job(agent: &Agent, net: &NetworkMount, path: &Path) -> (String, String) {
    let before = net.server_log().len();
    let out = agent
        .cli(&["run", "--", "cat", path.to_str().unwrap()])
        .current_dir("/")
        .output()
        .unwrap();
    (text(&out.stdout), net.server_log()[before..].to_owned())
}

/// Whether the server's `log` shows the file `rel` (of the share) opened.
fn opened(net: &NetworkMount, log: &str, rel: &str) -> bool {
    let open = format!("open \"{}", net.server_path(rel).display());
    log.lines().any(|l| l.contains(&open))
}

/// What `cmd` (Python, plainly or as a job) printed, run from / with `pythonpath` and
/// no bytecode written; it must succeed.
fn python_output(cmd: &mut Command, pythonpath: impl AsRef<std::ffi::OsStr>) -> String {
    let out = cmd
        .env("PYTHONPATH", pythonpath)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .current_dir("/")
        .output()
        .unwrap();
    assert_success(&out);
    text(&out.stdout)
}

fn cached(agent: &Agent, path: &std::path::Path) {
    let copy = agent.local_copy(path);
    // On disk, and taken into the daemon's cache (what jobs get bound).
    wait_until(30, "the copy", || {
        copy.exists() && agent.cache()["cached_files"].as_u64() > Some(0)
    });
}

#[test]
fn a_job_sees_local_copies_read_only_at_the_network_paths() {
    local_copies_read_only(Agent::start);
}

/// The same as on a kernel before 5.12, where binds are made read-only by a remount
/// (no `mount_setattr`), with every other fallback too.
#[test]
fn a_job_sees_local_copies_read_only_with_every_fallback() {
    local_copies_read_only(|args| Agent::start_with_fallbacks("all", args));
}

fn local_copies_read_only(start: fn(&[&str]) -> Agent) {
    let net = NetworkMount::start();
    let file = net.put("env/lib/mod.py", b"X = 1\n");
    let agent = start(&["--watch", net.mount.to_str().unwrap()]);
    read_all(&file);
    cached(&agent, &file);
    let out = agent.run_job(&format!("{BINDS}; cat {}; exit 7", file.display()));
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    // The mount that serves the file in the job (the file itself, or the snapshot of a
    // directory above it) is a read-only, nosuid, nodev bind, not the network mount.
    let serving = stdout
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(point, _)| file.starts_with(point))
        .max_by_key(|(point, _)| point.len())
        .unwrap_or_else(|| panic!("no mount serves {}: {stdout}", file.display()));
    assert!(
        Path::new(serving.0).starts_with(&net.mount) && Path::new(serving.0) != net.mount,
        "{stdout}"
    );
    assert!(serving.1.starts_with("ro,nosuid,nodev"), "{stdout}");
    assert!(stdout.ends_with("X = 1\n"), "{stdout}");
    // Nothing leaks back to the host.
    let host = fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !host.contains(&format!(" {} ", serving.0)),
        "a bind leaked to the host"
    );
}

#[test]
fn a_write_into_a_copy_fails_is_counted_and_the_file_goes_back_to_the_network() {
    let net = NetworkMount::start();
    let file = net.put("data/table.csv", b"a,b\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    read_all(&file);
    cached(&agent, &file);
    let copy = agent.local_copy(&file);
    let out = agent.run_job(&format!("echo 1,2 >> {}", file.display()));
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("Read-only file system"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        fs::read(net.server_path("data/table.csv")).unwrap(),
        b"a,b\n",
        "nothing reached the share"
    );
    // Counted, logged, and the copy is gone: nothing was written to the cache either.
    wait_until(5, "the copy to be dropped", || !copy.exists());
    assert_eq!(agent.status()["tally"]["writes_refused"], 1);
    assert!(agent.log().contains("got EROFS"), "{}", agent.log());
    // A later job works on the network file itself: its write lands on the share.
    let out = agent.run_job(&format!("{BINDS}; echo 1,2 >> {}", file.display()));
    assert_success(&out);
    assert!(
        !text(&out.stdout).contains("table.csv"),
        "bound again: {}",
        text(&out.stdout)
    );
    assert_eq!(
        fs::read(net.server_path("data/table.csv")).unwrap(),
        b"a,b\n1,2\n"
    );
}

#[test]
fn an_ordinary_user_runs_a_job_as_themselves_without_sudo() {
    let net = NetworkMount::start();
    let public = net.put("shared/public.txt", b"hello\n");
    let secret = net.put("shared/root-only.key", b"secret\n");
    fs::set_permissions(
        net.server_path("shared/root-only.key"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    read_all(&public);
    read_all(&secret);
    cached(&agent, &public);
    cached(&agent, &secret);
    let (uid, gid) = hocus_tests::test_user();
    let work = tempfile::tempdir().unwrap();
    fs::set_permissions(work.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let script = format!(
        "id -u; id -g; pwd; cat {}; cat {} 2>/dev/null || echo denied; exit 3",
        public.display(),
        secret.display()
    );
    let out = agent
        .cli(&["run", "--", "sh", "-c", &script])
        .current_dir(work.path())
        .uid(uid)
        .gid(gid)
        .env("HOCUS_TEST_VAR", "kept")
        .output()
        .unwrap();
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines,
        [
            uid.to_string().as_str(),
            gid.to_string().as_str(),
            work.path().to_str().unwrap(),
            "hello",
            "denied"
        ]
    );
    // and outside, the same
    let outside = Command::new("cat")
        .arg(&secret)
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    assert!(!outside.status.success());
    // The environment comes along.
    let out = agent
        .cli(&["run", "--", "sh", "-c", "echo $HOCUS_TEST_VAR"])
        .current_dir(work.path())
        .uid(uid)
        .gid(gid)
        .env("HOCUS_TEST_VAR", "kept")
        .output()
        .unwrap();
    assert_eq!(text(&out.stdout), "kept\n");
}

#[test]
fn signals_reach_the_job_and_its_status_comes_back() {
    let net = NetworkMount::start();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    let (uid, gid) = hocus_tests::test_user();
    let mut child = agent
        .cli(&[
            "run",
            "--",
            "sh",
            "-c",
            "trap 'echo got-term; exit 42' TERM; echo ready; while :; do sleep 0.1; done",
        ])
        .current_dir("/")
        .uid(uid)
        .gid(gid)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 6];
    std::io::Read::read_exact(&mut stdout, &mut first).unwrap();
    assert_eq!(&first, b"ready\n");
    // SAFETY: plain kill(2) on our child, the hocus-agent client.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    assert_eq!(rest, "got-term\n");
    assert_eq!(status.code(), Some(42));
}

#[test]
fn a_change_on_the_server_during_the_job_is_seen_at_its_next_open() {
    let net = NetworkMount::start();
    let file = net.put("conf/settings.py", b"MODE = 'old'\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap(), "--revalidate", "1"]);
    read_all(&file);
    cached(&agent, &file);
    let server = net.server_path("conf/settings.py");
    let job = agent
        .cli(&[
            "run",
            "--",
            "sh",
            "-c",
            // Reads again until it sees the change (within --revalidate; 30 s at most).
            &format!(
                "cat {f}; for i in $(seq 150); do grep -q new {f} && break; sleep 0.2; done; cat {f}",
                f = file.display()
            ),
        ])
        .current_dir("/")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (first, job) = first_line(job);
    assert_eq!(first, "MODE = 'old'\n", "{}", agent.log());
    fs::write(&server, b"MODE = 'new' # changed on the server\n").unwrap();
    let out = job.wait_with_output().unwrap();
    assert_eq!(
        text(&out.stdout),
        "MODE = 'new' # changed on the server\n",
        "{}",
        agent.log()
    );
    assert!(
        agent.log().contains("detached 1 binds in job"),
        "{}",
        agent.log()
    );
}

#[test]
fn a_compilation_cache_directory_stays_shared() {
    // Like JAX's persistent cache: entries written once (by rank 0 of a job on this
    // node, so the tracer sees the directory written), read by many jobs; new entries
    // appear while jobs run, and jobs write entries of their own.
    let net = NetworkMount::start();
    fs::create_dir_all(net.server_path("jax-cache")).unwrap();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap(), "--revalidate", "2"]);
    let entry = net.path("jax-cache/jit_f-0001");
    fs::write(&entry, [1u8; 4096]).unwrap();
    read_all(&entry);
    // Stable since its write: bound file by file; the directory itself is never held.
    cached(&agent, &entry);
    assert!(
        agent.cache()["snapshots"].as_array().unwrap().is_empty(),
        "a written directory was snapshotted"
    );
    let dir = net.path("jax-cache");
    let job = agent
        .cli(&[
            "run",
            "--",
            "sh",
            "-c",
            &format!(
                // Looks until the other writer's entry shows (30 s at most).
                "{BINDS} | grep -c jit_f-0001; for i in $(seq 150); do [ -e {d}/jit_f-0002 ] && break; sleep 0.2; done; ls {d}; echo mine > {d}/jit_g-0003",
                d = dir.display()
            ),
        ])
        .current_dir("/")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (first, job) = first_line(job);
    assert_eq!(first, "1\n", "the entry is bound");
    // Another writer (another node) adds an entry while the job runs.
    fs::write(net.server_path("jax-cache/jit_f-0002"), b"from rank 0").unwrap();
    let out = job.wait_with_output().unwrap();
    assert_success(&out);
    assert_eq!(
        text(&out.stdout),
        "jit_f-0001\njit_f-0002\n",
        "the entry is bound, the directory shared"
    );
    assert_eq!(
        fs::read(net.server_path("jax-cache/jit_g-0003")).unwrap(),
        b"mine\n",
        "the job's entry is on the share"
    );
}

#[test]
fn run_without_a_daemon_says_what_to_do() {
    let out = Command::new(hocus_tests::agent_bin())
        .args(["--socket", "/nonexistent/agent.sock", "run", "--", "true"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("no hocus-agent daemon is running")
            && err.contains("sudo hocus-agent --watch"),
        "{err}"
    );
}

#[test]
fn a_python_environment_is_served_from_its_snapshot_without_touching_the_network() {
    let net = NetworkMount::start();
    net.put("env/lib/mypkg/__init__.py", b"from . import core\n");
    net.put("env/lib/mypkg/core.py", b"VALUE = 41\n");
    net.put(
        "env/lib/mypkg/cold.py",
        b"raise SystemExit('never imported')\n",
    );
    net.put("env/empty/README", b"nothing to import here\n");
    // Directories changed within seconds of the snapshot are listed from the server at
    // job start (coherence); the server's log cannot tell the daemon's checks from the
    // job's requests, so the environment is an old one and the check interval the
    // default (30 s).
    net.installed_long_ago("env");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    let pythonpath = format!(
        "{}:{}",
        net.path("env/empty").display(),
        net.path("env/lib").display()
    );
    let script = "import mypkg.core; print(mypkg.core.VALUE + 1)";
    let python = |under_hocus: bool| {
        let mut cmd = if under_hocus {
            agent.cli(&["run", "--", "python3", "-c", script])
        } else {
            let mut c = Command::new("python3");
            c.args(["-c", script]);
            c
        };
        python_output(&mut cmd, &pythonpath)
    };
    // The first run teaches hocus the working set; the directories of Python's path
    // are snapshotted, each of its own.
    assert_eq!(python(false), "42\n");
    let env = net.path("env");
    agent.wait_for_snapshot(&env.join("lib"));
    agent.wait_for_snapshot(&env.join("empty"));
    let inside = format!("\"{}/", net.server_path("env").display());
    let before = net.server_log().len();
    assert_eq!(python(true), "42\n", "the same output under hocus");
    let requests = net.job_requests_inside("env", before);
    assert!(
        requests.is_empty(),
        "the job's lookups reached the server:\n{}",
        requests.join("\n")
    );
    // And without hocus they do: the log does record such requests. (A kernel NFS
    // client would answer from its own caches of names and pages what it asked a
    // moment ago: forgotten first, as a node's memory pressure would.)
    fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    let before = net.server_log().len();
    assert_eq!(python(false), "42\n");
    assert!(
        net.server_log()[before..]
            .lines()
            .any(|l| l.contains(&inside)),
        "{}",
        &net.server_log()[before..]
    );
    // A cold module is in the snapshot too, as a name: its bytes stayed on the server
    // (a lazy snapshot holds the working set's) until a job reads it, through the
    // snapshot's overlay.
    let cold = net.path("env/lib/mypkg/cold.py");
    let opened_cold = |log: &str| opened(&net, log, "env/lib/mypkg/cold.py");
    assert!(!opened_cold(&net.server_log()), "{}", net.server_log());
    let reads = |agent: &Agent| {
        let s = &agent.cache()["served"][0];
        let n = |k: &str| s[k].as_u64().unwrap_or(0);
        (n("read_ram") + n("read_ssd"), n("read_network"))
    };
    let (local_before, network_before) = reads(&agent);
    let (out, log) = cat_in_job(&agent, &net, &cold);
    assert_eq!(out, "raise SystemExit('never imported')\n");
    if whole_snapshots(&agent) {
        // Its bytes are the snapshot's too: read locally.
        assert!(!opened_cold(&log), "{log}");
        let (local_after, network_after) = reads(&agent);
        assert_eq!(
            (local_after - local_before, network_after),
            (out.len() as u64, network_before),
            "{:#}",
            agent.cache()
        );
        return;
    }
    assert!(opened_cold(&log), "{log}");
    // Its bytes count as the network's, though its name was the snapshot's.
    let (local_after, network_after) = reads(&agent);
    assert_eq!(local_after, local_before, "{:#}", agent.cache());
    assert_eq!(
        network_after - network_before,
        out.len() as u64,
        "{:#}",
        agent.cache()
    );
    // Read on the node, it joins the working set after the snapshot was taken: its
    // copy fills the snapshot's stub, and later jobs read it locally.
    read_all(&cold);
    cached(&agent, &cold);
    agent.settled();
    let (out, log) = cat_in_job(&agent, &net, &cold);
    assert_eq!(out, "raise SystemExit('never imported')\n");
    assert!(
        !opened_cold(&log),
        "a file copied after its snapshot was taken is still read from the server:\n{log}\n{}",
        agent.log()
    );
}

#[test]
fn directories_no_job_used_are_shown_from_the_network_until_jobs_use_them() {
    let net = NetworkMount::start();
    net.put("env/lib/mypkg/__init__.py", b"from . import core\n");
    net.put("env/lib/mypkg/core.py", b"VALUE = 41\n");
    net.put("env/lib/mypkg/tests/__init__.py", b"");
    net.put("env/lib/mypkg/tests/check.py", b"OK = 'tests imported'\n");
    net.put("env/lib/data/notes.txt", b"read from the network\n");
    net.installed_long_ago("env");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    let python = |script: &str| {
        let mut job = agent.cli(&["run", "--", "python3", "-c", script]);
        python_output(&mut job, net.path("env/lib"))
    };
    // The first job teaches hocus the working set: mypkg, not its tests, not data/.
    assert_eq!(
        python("import mypkg.core; print(mypkg.core.VALUE + 1)"),
        "42\n"
    );
    let env = net.path("env");
    let lib = env.join("lib");
    agent.wait_for_snapshot(&lib);
    if whole_snapshots(&agent) {
        // Before Linux 6.13 a snapshot is a whole copy (docs/kernels.md): it leaves no
        // directory on the network, and a name made there since makes the next job
        // read the network.
        return whole_snapshots_hold_unused_directories_too(&agent, &net);
    }
    assert!(
        agent
            .log()
            .contains("2 directories no job used shown from the network"),
        "{}",
        agent.log()
    );
    // A job whose lookups all stay on the node.
    let local_job = |script: &str, printed: &str| {
        let before = net.server_log().len();
        assert_eq!(python(script), printed);
        let requests = net.job_requests_inside("env/lib", before);
        assert!(
            requests.is_empty(),
            "the job's lookups reached the server:\n{}\n{}",
            requests.join("\n"),
            agent.log()
        );
    };
    // The used part is the snapshot's.
    local_job("import mypkg.core; print(mypkg.core.VALUE + 1)", "42\n");
    // The rest shows what the network holds now, not when the snapshot was taken: a
    // file made there since is seen.
    net.put("env/lib/mypkg/tests/later.py", b"");
    // (Long ago: a directory changed just before a snapshot is listed at job start.)
    net.installed_long_ago("env/lib/mypkg/tests");
    let out = agent.run_job(&format!("ls {}/lib/mypkg/tests", env.display()));
    assert_success(&out);
    let listed = text(&out.stdout);
    assert!(
        listed.contains("later.py") && listed.contains("check.py"),
        "{listed}"
    );
    // Used now: the snapshot is taken again with it, every name there local; the
    // tests a job imports then are copied in, and the next job imports them without
    // the network.
    wait_until(30, "the snapshot taken again", || {
        agent
            .log()
            .contains("which it left on the network: it is taken again")
            && agent.cache()["snapshots"]
                .as_array()
                .is_some_and(|s| s.iter().any(|p| p == lib.to_str().unwrap()))
    });
    assert!(
        agent
            .log()
            .contains("1 directories no job used shown from the network"),
        "{}",
        agent.log()
    );
    // Taken again, not invalidated: nothing it held had changed.
    assert_eq!(agent.cache()["invalidations"], 0);
    for _ in 0..2 {
        assert_eq!(
            python("import mypkg.tests.check as c; print(c.OK)"),
            "tests imported\n"
        );
    }
    wait_until(30, "the imported tests copied", || {
        agent.cache()["cached_files"].as_u64() >= Some(4)
    });
    agent.settled();
    local_job(
        "import mypkg.tests.check as c; print(c.OK)",
        "tests imported\n",
    );
    // A job reads and writes where no job went before as it would without hocus: the
    // network takes the write, not the cache.
    let out = agent.run_job(&format!(
        "cat {lib}/data/notes.txt && echo out > {lib}/data/out.txt",
        lib = lib.display()
    ));
    assert_success(&out);
    assert_eq!(text(&out.stdout), "read from the network\n");
    assert_eq!(
        fs::read(net.server_path("env/lib/data/out.txt")).unwrap(),
        b"out\n"
    );
}

/// Whether this kernel's snapshots are whole copies (before Linux 6.13: docs/kernels.md).
fn whole_snapshots(agent: &Agent) -> bool {
    agent
        .log()
        .contains("snapshots: copies of every file of their tree: this kernel cannot")
}

/// Where snapshots are whole copies (the kernel's route): the directories no job used are
/// in the snapshot too, and what the network holds since is what the next job sees.
fn whole_snapshots_hold_unused_directories_too(agent: &Agent, net: &NetworkMount) {
    assert!(
        agent
            .log()
            .contains("0 directories no job used shown from the network"),
        "{}",
        agent.log()
    );
    let lib = net.path("env/lib");
    let (out, log) = cat_in_job(agent, net, &lib.join("data/notes.txt"));
    assert_eq!(out, "read from the network\n");
    assert!(!opened(net, &log, "env/lib/data/notes.txt"), "{log}");
    let later = net.put("env/lib/mypkg/tests/later.py", b"");
    // Once a plain process sees it (a client may trust what it cached a moment), and
    // past the second a job start's confirmation serves the next (`confirm::REUSE`).
    wait_until(30, "a plain process to see the new name", || later.exists());
    thread::sleep(Duration::from_millis(1100));
    let out = agent.run_job(&format!("ls {}/mypkg/tests", lib.display()));
    assert_success(&out);
    let listed = text(&out.stdout);
    assert!(
        listed.contains("later.py") && listed.contains("check.py"),
        "{listed}"
    );
}

#[test]
fn whole_snapshots_hold_cold_files_too() {
    // What kernels without lazy overlays get; here asked for.
    let net = NetworkMount::start();
    net.put("env/mypkg/__init__.py", b"VALUE = 41\n");
    net.put("env/mypkg/cold.py", b"never imported\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap(), "--whole-snapshots"]);
    assert!(
        agent
            .log()
            .contains("snapshots: copies of every file of their tree (whole-snapshots)")
    );
    let script = "import mypkg; print(mypkg.VALUE + 1)";
    let python = |cmd: &mut Command| python_output(cmd, net.path("env"));
    assert_eq!(python(Command::new("python3").args(["-c", script])), "42\n");
    let env = net.path("env");
    agent.wait_for_snapshot(&env);
    assert!(
        agent.log().contains("0 files (0 B) left on the network"),
        "{}",
        agent.log()
    );
    assert_eq!(
        python(&mut agent.cli(&["run", "--", "python3", "-c", script])),
        "42\n"
    );
    // The cold file's bytes are local: a job reads it without the server.
    let (out, log) = cat_in_job(&agent, &net, &env.join("mypkg/cold.py"));
    assert_eq!(out, "never imported\n");
    assert!(!opened(&net, &log, "env/mypkg/cold.py"), "{log}");
}

#[test]
fn a_write_into_a_snapshot_fails_and_the_tree_goes_back_to_the_network() {
    let net = NetworkMount::start();
    net.put("dataset/part-0.csv", b"x\n1\n");
    net.put("dataset/part-1.csv", b"x\n2\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap(), "--revalidate", "1"]);
    read_all(&net.path("dataset/part-0.csv"));
    let dataset = net.path("dataset");
    wait_until(30, "a snapshot of the dataset", || {
        agent.cache()["snapshots"]
            .as_array()
            .is_some_and(|s| s.iter().any(|p| p == dataset.to_str().unwrap()))
    });
    let out = agent.run_job(&format!("echo new > {}/part-2.csv", dataset.display()));
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("Read-only file system"),
        "{}",
        text(&out.stderr)
    );
    assert!(!net.server_path("dataset/part-2.csv").exists());
    wait_until(5, "the snapshot to be dropped", || {
        agent.cache()["snapshots"]
            .as_array()
            .is_some_and(|s| s.is_empty())
    });
    assert_eq!(agent.status()["tally"]["writes_refused"], 1);
    assert!(
        agent.log().contains("dropping the snapshot"),
        "{}",
        agent.log()
    );
    // The next job writes to the network share.
    let out = agent.run_job(&format!("echo new > {}/part-2.csv", dataset.display()));
    assert_success(&out);
    assert_eq!(
        fs::read(net.server_path("dataset/part-2.csv")).unwrap(),
        b"new\n"
    );
}

#[test]
fn a_job_has_the_callers_limits_and_umask_and_no_descriptor_of_the_daemon() {
    callers_limits_and_no_descriptor(Agent::start);
}

/// The same as on a kernel before 5.11, whose `close_range` cannot mark descriptors
/// close-on-exec: the daemon marked what it inherited at start.
#[test]
fn a_job_gets_no_descriptor_of_the_daemon_with_every_fallback() {
    callers_limits_and_no_descriptor(|args| Agent::start_with_fallbacks("all", args));
}

fn callers_limits_and_no_descriptor(start: fn(&[&str]) -> Agent) {
    let net = NetworkMount::start();
    let agent = start(&["--watch", net.mount.to_str().unwrap()]);
    let (uid, gid) = hocus_tests::test_user();
    let mut cmd = agent.cli(&[
        "run",
        "--",
        "sh",
        "-c",
        "ulimit -l; umask; ls /proc/self/fd",
    ]);
    cmd.current_dir("/").uid(uid).gid(gid);
    // SAFETY: runs in the forked child before exec; plain syscalls.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 1234 * 1024,
                rlim_max: 1234 * 1024,
            };
            libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit);
            libc::umask(0o027);
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    assert_success(&out);
    let lines: Vec<String> = text(&out.stdout).lines().map(str::to_owned).collect();
    assert_eq!(
        lines[0], "1234",
        "the daemon's unlimited memlock must not reach the job"
    );
    assert_eq!(lines[1], "0027");
    // 0, 1, 2 and the directory ls itself reads.
    assert_eq!(
        lines[2..],
        ["0", "1", "2", "3"],
        "descriptors leaked into the job"
    );
}

#[test]
fn a_job_runs_in_its_callers_cgroups_not_the_daemons() {
    // A batch system puts each job in a cgroup with its limits; a job started through
    // hocus must stay inside it. Here: a cgroup made for the caller in each hierarchy
    // this machine has of the two that hold limits: v1's memory (this machine) and v2
    // (Debian's default since 11, the rig's guests).
    let net = NetworkMount::start();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    let name = format!("hocus-test-{}", std::process::id());
    let made = caller_cgroups()
        .into_iter()
        .map(|(line, dir)| (line, dir.join(&name)))
        .collect::<Vec<_>>();
    assert!(
        !made.is_empty(),
        "neither a memory cgroup v1 nor a cgroup v2 hierarchy is mounted"
    );
    struct Remove(Vec<std::path::PathBuf>);
    impl Drop for Remove {
        fn drop(&mut self) {
            for d in &self.0 {
                let _ = fs::remove_dir(d);
            }
        }
    }
    let _remove = Remove(made.iter().map(|(_, d)| d.clone()).collect());
    for (_, dir) in &made {
        fs::create_dir(dir).unwrap();
    }
    let procs: Vec<_> = made.iter().map(|(_, d)| d.join("cgroup.procs")).collect();
    let mut cmd = agent.cli(&["run", "--", "cat", "/proc/self/cgroup"]);
    cmd.current_dir("/");
    // SAFETY: runs in the forked child before exec: open and write, then exec.
    unsafe {
        cmd.pre_exec(move || procs.iter().try_for_each(|p| fs::write(p, "0")));
    }
    let out = cmd.output().unwrap();
    assert_success(&out);
    let job = text(&out.stdout);
    for (prefix, _) in &made {
        let line = job
            .lines()
            .find(|l| l.starts_with(prefix.as_str()))
            .unwrap();
        assert!(
            line.ends_with(&format!("/{name}")),
            "the job is not in its caller's cgroup: {line}"
        );
    }
    let daemon = fs::read_to_string(format!("/proc/{}/cgroup", agent.pid())).unwrap();
    assert!(!daemon.contains(&name), "the daemon moved instead");
}

/// This process's cgroup directories in the memory v1 and the v2 hierarchies, each with
/// the start of its line in /proc/self/cgroup (`N:memory:`, `0::`).
fn caller_cgroups() -> Vec<(String, std::path::PathBuf)> {
    let own = fs::read_to_string("/proc/self/cgroup").unwrap();
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
    // The mount point of the hierarchy whose type and options `wanted` accepts.
    let mounted = |wanted: &dyn Fn(&str, &str) -> bool| {
        mountinfo.lines().find_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let mut r = right.split(' ');
            let (fs_type, options) = (r.next()?, r.nth(1)?);
            wanted(fs_type, options)
                .then(|| left.split(' ').nth(4).map(std::path::PathBuf::from))?
        })
    };
    let mut out = Vec::new();
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let mount = match controllers {
            "" => mounted(&|t, _| t == "cgroup2"),
            "memory" => mounted(&|t, o| t == "cgroup" && o.split(',').any(|o| o == "memory")),
            _ => None,
        };
        if let Some(m) = mount {
            out.push((
                format!("{id}:{controllers}:"),
                m.join(path.trim_start_matches('/')),
            ));
        }
    }
    out
}

/// The first line a job printed, and the job with the rest of its output still to read.
fn first_line(mut job: std::process::Child) -> (String, std::process::Child) {
    use std::io::Read;
    let mut out = job.stdout.take().expect("stdout piped");
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while out.read(&mut byte).unwrap_or(0) == 1 {
        line.push(byte[0]);
        if byte[0] == b'\n' {
            break;
        }
    }
    job.stdout = Some(out);
    (String::from_utf8_lossy(&line).into_owned(), job)
}
