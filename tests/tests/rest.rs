//! Tracing rests. With nothing to learn for `--rest-after` seconds (no job, or every
//! job's requests hitting local copies; nothing reached the network or changed a tree)
//! the daemon detaches its syscall program, so the node's processes pay nothing for it;
//! the first use of a watched mount (while served jobs run: a request that reads or
//! changes it), or a job starting, attaches it again. The kernel's own account of the
//! daemon's BPF links (fdinfo) says what is attached.

use std::{fs, os::unix::process::CommandExt, path::Path, process::Command};

use hocus_tests::{
    Agent, BackgroundJob, NetworkMount, assert_success, file_entry, kernel_at_least,
    missing_lookups, test_user, wait_until,
};
use serde_json::Value;

const SYSCALLS: &str = "syscall_exit";

fn tracing(agent: &Agent) -> Value {
    agent.status()["tracing"].clone()
}

fn wait_resting(agent: &Agent, rests: u64) {
    wait_until(30, "the tracer to rest", || {
        let t = tracing(agent);
        t["resting"] == true && t["rests"] == rests
    });
    assert!(
        !agent.attached().iter().any(|t| t == SYSCALLS),
        "resting, yet attached to {:?}",
        agent.attached()
    );
}

/// A daemon that learns jobs from their syscalls: where the kernel has the FUSE request
/// programs or hooks the NFS client's functions, they learn jobs at rest instead
/// (tests/requests.rs), and these tests are of the route every other kernel and
/// filesystem takes.
fn start(net: &NetworkMount) -> Agent {
    let args = ["--watch", net.mount.to_str().unwrap(), "--rest-after", "5"];
    let agent = Agent::start_with_fallbacks("fuse-requests,nfs-functions", &args);
    let links = agent.attached();
    assert!(links.iter().any(|t| t == SYSCALLS), "{links:?}");
    // The tripwires stay attached while it rests: the mount's own, and pages entering
    // the page cache.
    // On NFS, beside its path walks' hook, those of the requests that read or change the
    // mount, which tell a served job's misses apart.
    let tripwires: &[&str] = match net.nfs {
        Some(_) => &[
            "nfs_access",
            "filemap_add",
            "nfs_lookup",
            "nfs_create",
            "nfs_atomic_open",
            "nfs_change",
        ],
        None => &["fuse_request", "filemap_add"],
    };
    // Before 5.15 a tracepoint's program is attached through a perf event, which names
    // no program in fdinfo: there, what wakes the rest below is the proof.
    if kernel_at_least(5, 15) {
        for &tripwire in tripwires {
            assert!(links.iter().any(|t| t == tripwire), "{links:?}");
        }
    }
    agent
}

/// An ordinary user's Python importing a module from the mount, as a plain process.
fn import_as_user(dir: &Path, module: &str) -> String {
    let (uid, gid) = test_user();
    let out = Command::new("python3")
        .args([
            "-c",
            &format!(
                "import sys; sys.path.insert(0, {dir:?}); import {module}; print({module}.VALUE)"
            ),
        ])
        .current_dir("/")
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    assert_success(&out);
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn an_idle_daemon_rests_and_the_first_use_of_the_mount_wakes_it() {
    let net = NetworkMount::start();
    let module = net.put("env/lib/rested.py", b"VALUE = 41 + 1\n");
    let agent = start(&net);
    wait_resting(&agent, 1);

    // Work elsewhere on the node does not wake it: Python from the local disk, and a
    // loop of opens, reads and failed lookups in a local directory.
    let local = tempfile::tempdir().unwrap();
    fs::write(local.path().join("local.py"), "VALUE = 7\n").unwrap();
    assert_eq!(import_as_user(local.path(), "local"), "7");
    for i in 0..2000 {
        fs::read(local.path().join("local.py")).unwrap();
        assert!(fs::metadata(local.path().join(format!("nope{i}"))).is_err());
    }
    let t = tracing(&agent);
    assert_eq!(
        (t["resting"].as_bool(), t["wakeups"].as_u64()),
        (Some(true), Some(0)),
        "{t}"
    );
    assert!(!agent.attached().iter().any(|t| t == SYSCALLS));

    // An ordinary user's import from the watched mount: its first request wakes it, and
    // the import is in the profile.
    let lib = module.parent().unwrap();
    assert_eq!(import_as_user(lib, "rested"), "42");
    wait_until(10, "the tracer to wake", || {
        tracing(&agent)["resting"] == false
    });
    assert!(agent.attached().iter().any(|t| t == SYSCALLS));
    let t = tracing(&agent);
    assert_eq!(t["wakeups"].as_u64(), Some(1), "{t}");
    // The program is attached some milliseconds after the first request: an import
    // that gets to its open first is not seen (docs/overhead.md). The next one is (on
    // a slow machine the tracer may have rested again in between: the next import
    // then wakes it again, and may be the one not seen).
    let mut p = Value::Null;
    for _ in 0..5 {
        assert_eq!(import_as_user(lib, "rested"), "42");
        p = agent.export();
        if file_entry(&p, &module).is_some_and(|f| f["opens"].as_u64() >= Some(1)) {
            break;
        }
    }
    let f = file_entry(&p, &module).unwrap_or_else(|| panic!("not learned: {p:#}"));
    assert!(f["opens"].as_u64() >= Some(1), "{f}");
    assert!(
        agent.log().contains("tracing wakes: process"),
        "{}",
        agent.log()
    );

    // Nothing more to learn: it rests again, a rest after each wake.
    let woken = tracing(&agent)["wakeups"].as_u64().unwrap();
    wait_resting(&agent, 1 + woken);
    assert!(agent.metrics().contains("hocus_tracing_resting 1"));
    assert!(agent.metric("hocus_tracing_wakeups_total") == woken);
}

#[test]
fn a_job_started_at_rest_is_followed_from_its_first_open() {
    let net = NetworkMount::start();
    let file = net.put("data/input.txt", b"hello from the network\n");
    let missing = net.path("data/nope.py");
    let agent = start(&net);
    wait_resting(&agent, 1);
    // The job's first process looks up a name that is not there, by its absolute path,
    // then reads a file. The daemon attached the syscall program before it made the
    // job's namespace, so it knows that namespace (its paths mean what they mean to the
    // daemon) and follows the job from its first syscall.
    let script = format!("test ! -e {} && cat {}", missing.display(), file.display());
    let out = agent.run_job(&script);
    assert_success(&out);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "hello from the network\n"
    );
    let status = agent.status();
    let job_opens: u64 = status["cache"]["served"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["job_opens"].as_u64().unwrap())
        .sum();
    assert_eq!(job_opens, 1, "{status:#}");
    assert_eq!(
        missing_lookups(&agent.export(), &missing),
        Some(1),
        "{:#}",
        agent.export()
    );
    assert_eq!(
        status["tracing"]["wakeups"].as_u64(),
        Some(1),
        "{:#}",
        status["tracing"]
    );
    wait_resting(&agent, 2);
}

/// Whether the daemon may rest while jobs run (`status`'s route: where its tripwires
/// tell a served job's misses apart).
fn rests_with_jobs(agent: &Agent) -> bool {
    agent.route("tracing while jobs run").starts_with("rests")
}

fn opens_local(agent: &Agent) -> u64 {
    agent.cache()["served"][0]["opens_local"].as_u64().unwrap()
}

/// Runs a first job that reads `a` and `b` from the network, and waits for the daemon's
/// copies of both. Returns both paths, for a shell.
fn learn_copies(agent: &Agent, a: &Path, b: &Path) -> String {
    let both = format!("{} {}", a.display(), b.display());
    assert_success(&agent.run_job(&format!("cat {both} >/dev/null")));
    wait_until(60, "local copies of both", || {
        agent.local_copy(a).exists() && agent.local_copy(b).exists()
    });
    agent.settled();
    both
}

/// A job that opens `both` again and again (every open a hit, each path walk through
/// the mount's directories checked with the server once the kernel's entry times out)
/// until `flag` exists (or for 90 s at most: a failed test leaves no job behind), then
/// runs `then`.
fn served_loop(agent: &Agent, both: &str, flag: &Path, then: &str) -> BackgroundJob {
    let pid = flag.with_extension("pid");
    let script = format!(
        "echo $$ > {pid}; i=0; while [ ! -e {flag} ] && [ $i -lt 900 ]; do cat {both} >/dev/null; sleep 0.1; i=$((i+1)); done; {then}",
        pid = pid.display(),
        flag = flag.display(),
    );
    let child = agent
        .cli(&["run", "--", "sh", "-c", &script])
        .current_dir("/")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    BackgroundJob(child, pid)
}

fn wait_resting_with_jobs(agent: &Agent) {
    wait_until(30, "the tracer to rest while the job runs", || {
        let t = tracing(agent);
        t["resting"] == true && t["with_jobs"] == true
    });
    assert!(!agent.attached().iter().any(|t| t == SYSCALLS));
}

#[test]
fn a_job_whose_opens_all_hit_runs_at_rest_and_its_first_miss_wakes_it() {
    let net = NetworkMount::start();
    let a = net.put("env/lib/hit_a.py", b"VALUE = 'a'\n");
    let b = net.put("env/lib/hit_b.py", b"VALUE = 'b'\n");
    let first = net.put("data/first_miss.txt", b"held open while the tracer wakes\n");
    let second = net.put("data/second_miss.txt", b"read once it is awake\n");
    let agent = start(&net);
    let both = learn_copies(&agent, &a, &b);
    // A second job opens the copies again and again until told to go on: then it opens
    // a file no copy serves and holds it, and reads another.
    let go = tempfile::tempdir().unwrap();
    let flag = go.path().join("go");
    let then = format!(
        "exec 3< {}; sleep 2; cat <&3 >/dev/null; cat {} >/dev/null",
        first.display(),
        second.display()
    );
    let mut job = served_loop(&agent, &both, &flag, &then);

    // The FUSE tripwire reads each request's opcode; NFS's hooks of the requests that
    // read or change the mount are attached (`start`): both tell a served job's misses.
    assert!(rests_with_jobs(&agent), "{:#}", agent.status()["routes"]);

    // Every request hits: it rests while the job runs, the job's hits uncounted.
    wait_resting_with_jobs(&agent);
    let uncounted = opens_local(&agent);
    let woke = tracing(&agent)["wakeups"].as_u64().unwrap();
    std::thread::sleep(std::time::Duration::from_secs(3));
    let t = tracing(&agent);
    assert_eq!(
        (t["resting"].as_bool(), t["wakeups"].as_u64()),
        (Some(true), Some(woke)),
        "path walks woke it: {t}"
    );
    assert_eq!(opens_local(&agent), uncounted);
    assert!(
        agent
            .log()
            .contains("jobs run whose requests all hit local copies"),
        "{}",
        agent.log()
    );

    // The first miss wakes it; the file the job still holds is learned, the next one
    // is seen by the syscall program.
    fs::write(&flag, "").unwrap();
    wait_until(10, "the job's miss to wake the tracer", || {
        tracing(&agent)["resting"] == false
    });
    assert!(agent.attached().iter().any(|t| t == SYSCALLS));
    assert!(job.wait());
    let p = agent.export();
    for miss in [&first, &second] {
        let f =
            file_entry(&p, miss).unwrap_or_else(|| panic!("{} not learned: {p:#}", miss.display()));
        assert!(f["opens"].as_u64() >= Some(1), "{f}");
    }
    let t = tracing(&agent);
    assert_eq!(t["wakeups"].as_u64(), Some(woke + 1), "{t}");
    assert!(t["resting_with_jobs_secs"].as_u64() >= Some(3), "{t}");
    assert!(agent.metric("hocus_tracing_resting_with_jobs_seconds_total") >= 3);
}

#[test]
fn a_rest_with_jobs_goes_on_when_they_end_and_then_any_use_wakes_it() {
    let net = NetworkMount::start();
    let a = net.put("env/lib/ends_a.py", b"VALUE = 'a'\n");
    let b = net.put("env/lib/ends_b.py", b"VALUE = 'b'\n");
    let agent = start(&net);
    let both = learn_copies(&agent, &a, &b);
    let go = tempfile::tempdir().unwrap();
    let flag = go.path().join("go");
    let mut job = served_loop(&agent, &both, &flag, "true");
    wait_resting_with_jobs(&agent);
    std::thread::sleep(std::time::Duration::from_secs(2));
    // The job ends without a miss: the rest goes on, now without jobs.
    fs::write(&flag, "").unwrap();
    assert!(job.wait());
    wait_until(30, "a rest with no job running", || {
        let t = tracing(&agent);
        t["resting"] == true && t["with_jobs"] == false && agent.cache()["jobs_running"] == 0
    });
    assert!(!agent.attached().iter().any(|t| t == SYSCALLS));
    // A lookup of a name nobody looked up: while served jobs ran, one of their path walks
    // could make it, and it was no news; with no job, any use of the mount wakes it.
    let woke = tracing(&agent)["wakeups"].as_u64().unwrap();
    assert!(fs::metadata(net.path("data/never_there.py")).is_err());
    wait_until(10, "the lookup to wake the tracer", || {
        tracing(&agent)["resting"] == false
    });
    let t = tracing(&agent);
    assert_eq!(t["wakeups"].as_u64(), Some(woke + 1), "{t}");
    assert!(t["resting_with_jobs_secs"].as_u64() >= Some(2), "{t}");
}
