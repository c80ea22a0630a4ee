//! Slurm jobs get hocus's local copies through its SPANK plugin, with nothing changed in
//! how users submit them; and a job never breaks because of hocus. A real one-node
//! cluster (munged, slurmctld, slurmd), jobs submitted by an ordinary user with `srun`
//! and `sbatch`.

use std::{fs, os::unix::fs::PermissionsExt, process::Output};

use hocus_tests::{
    Agent, BackgroundJob, NetworkMount, assert_success, file_entry, names_in, sample_names,
    slurm::slurm, wait_until,
};

/// Debian's interpreter: the test user's environment has no other.
const PYTHON: &str = "/usr/bin/python3";
const SCRIPT: &str = "import mypkg.core; print(mypkg.core.VALUE + 1)";

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A Python environment on the mount, as the test user imports it.
fn environment(net: &NetworkMount) -> String {
    net.put_python_package("env/lib");
    net.put("env/empty/README", b"nothing to import here\n");
    net.installed_long_ago("env");
    format!(
        "{}:{}",
        net.path("env/empty").display(),
        net.path("env/lib").display()
    )
}

fn srun(args: &[&str], pythonpath: &str) -> Output {
    let mut all = vec!["--quiet"];
    all.extend_from_slice(args);
    all.extend_from_slice(&[PYTHON, "-c", SCRIPT]);
    slurm().as_user(
        "srun",
        &all,
        &[("PYTHONPATH", pythonpath), ("PYTHONDONTWRITEBYTECODE", "1")],
    )
}

fn served(agent: &Agent) -> (u64, u64) {
    let s = agent.cache();
    let sum = |key: &str| {
        s["served"]
            .as_array()
            .map_or(0, |a| a.iter().map(|t| t[key].as_u64().unwrap_or(0)).sum())
    };
    (sum("opens_local"), sum("lookups_local"))
}

/// The cluster with the plugin talking to a daemon that learned the environment from a
/// first job and holds its snapshot.
fn learned() -> (
    &'static hocus_tests::slurm::Slurm,
    NetworkMount,
    String,
    Agent,
) {
    let cluster = slurm();
    let net = NetworkMount::start();
    let pythonpath = environment(&net);
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    cluster.plugin(Some(&format!("socket={}", agent.socket.display())));
    assert_success(&srun(&[], &pythonpath));
    // Each directory of Python's path is snapshotted.
    agent.wait_for_snapshot(&net.path("env/lib"));
    agent.wait_for_snapshot(&net.path("env/empty"));
    (cluster, net, pythonpath, agent)
}

#[test]
fn a_plain_srun_job_imports_from_local_copies_and_off_jobs_are_untouched() {
    let cluster = slurm();
    let net = NetworkMount::start();
    let pythonpath = environment(&net);
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    cluster.plugin(Some(&format!("socket={}", agent.socket.display())));

    // A first job teaches hocus the working set (it reads the network: nothing is
    // copied yet).
    let out = srun(&[], &pythonpath);
    assert_success(&out);
    assert_eq!(text(&out.stdout), "42\n");
    // Each directory of Python's path is snapshotted.
    agent.wait_for_snapshot(&net.path("env/lib"));
    agent.wait_for_snapshot(&net.path("env/empty"));

    // The next job, submitted the same way, imports from the local snapshot: the same
    // output, and no request of it reaches the server.
    let before = net.server_log().len();
    let (opens, lookups) = served(&agent);
    let out = srun(&[], &pythonpath);
    assert_success(&out);
    assert_eq!(text(&out.stdout), "42\n", "{}", text(&out.stderr));
    let reached = net.job_requests_inside("env", before);
    assert!(
        reached.is_empty(),
        "the job's imports reached the server:\n{}\n{}",
        reached.join("\n"),
        cluster.slurmd_log()
    );
    let (opens_now, lookups_now) = served(&agent);
    assert!(
        opens_now > opens && lookups_now > lookups,
        "the daemon counted no local opens and failed lookups for the job: {:#}",
        agent.cache()
    );
    assert!(agent.log().contains("task "), "{}", agent.log());
    // Counted for the Slurm job too, in status and the metrics, until and after it ends.
    let job = agent.cache()["slurm_jobs"]
        .as_array()
        .and_then(|j| j.last().cloned())
        .unwrap_or_else(|| panic!("no Slurm job in {:#}", agent.cache()));
    let served = &job["served"];
    assert_eq!(served["opens_network"], 0, "{job}");
    assert!(served["opens_local"].as_u64() >= Some(2), "{job}");
    assert!(served["lookups_local"].as_u64() >= Some(1), "{job}");
    assert_eq!(job["tasks"], 1, "{job}");
    let id = job["job_id"].as_u64().unwrap();
    wait_until(10, "the task's end", || {
        agent.cache()["slurm_jobs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|j| j["job_id"] == id && j["tasks_running"] == 0)
    });
    let metrics = agent.metrics();
    let local = format!("hocus_slurm_job_opens_total{{job=\"{id}\",served=\"local\"}} ");
    assert!(metrics.contains(&local), "{metrics}");
    // The per-job families are documented, and only they.
    let per_job = |names: std::collections::BTreeSet<String>| -> Vec<String> {
        names
            .into_iter()
            .filter(|n| n.starts_with("hocus_slurm_job_"))
            .collect()
    };
    let docs = fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md"));
    assert_eq!(
        per_job(sample_names(&metrics)),
        per_job(names_in(&docs.unwrap()))
    );
    let out = agent.cli(&["status"]).output().unwrap();
    assert!(
        text(&out.stdout).contains(&format!("Slurm job {id} (uid ")),
        "{}",
        text(&out.stdout)
    );
    // Opened in the snapshot's overlay, the modules still count in the profile, under
    // their network paths.
    let p = agent.export();
    let core = file_entry(&p, &net.path("env/lib/mypkg/core.py")).unwrap();
    assert_eq!(core["opens"], 2, "{core}");

    // --hocus=off: the same job reads the network, as without hocus.
    net.drop_client_caches();
    let before = net.server_log().len();
    let out = srun(&["--hocus=off"], &pythonpath);
    assert_success(&out);
    assert_eq!(text(&out.stdout), "42\n");
    assert!(
        !net.job_requests_inside("env", before).is_empty(),
        "a --hocus=off job was served locally"
    );

    // A value the plugin does not know is the user's mistake, said by srun at once;
    // the job runs without hocus.
    net.drop_client_caches();
    let before = net.server_log().len();
    let out = srun(&["--hocus=maybe"], &pythonpath);
    assert_success(&out);
    assert!(
        text(&out.stderr).contains("--hocus=maybe: say on or off; this job runs without hocus"),
        "{}",
        text(&out.stderr)
    );
    assert!(!net.job_requests_inside("env", before).is_empty());
}

#[test]
fn jobs_run_as_without_hocus_when_the_daemon_is_down_or_the_plugin_is_off() {
    let cluster = slurm();
    let net = NetworkMount::start();
    let pythonpath = environment(&net);

    // No daemon at the socket: the job runs, and the node's log says why once.
    let gone = tempfile::tempdir().unwrap();
    let socket = gone.path().join("agent.sock");
    cluster.plugin(Some(&format!("socket={}", socket.display())));
    let out = srun(&[], &pythonpath);
    assert_success(&out);
    assert_eq!(text(&out.stdout), "42\n");
    wait_until(10, "the plugin's line in slurmd's log", || {
        cluster.slurmd_log().contains(&format!(
            "hocus-agent is not running (nothing at {})",
            socket.display()
        ))
    });

    // A socket that accepts and never answers: the prolog waits its prefetch's time (the
    // default, 5 s, within srun's wait for the launch), the task its timeout, and the
    // job runs.
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    cluster.plugin(Some(&format!("socket={} timeout=1", socket.display())));
    let out = srun(&[], &pythonpath);
    assert_success(&out);
    assert_eq!(text(&out.stdout), "42\n");
    drop(listener);
    wait_until(10, "the plugin's timeouts in slurmd's log", || {
        let log = cluster.slurmd_log();
        log.contains("running without local copies: hocus-agent did not answer within 1.0 s")
            && log.contains("no prefetch: hocus-agent did not answer within 5.0 s")
    });

    // Turned off on the node: the plugin does nothing, even when the daemon is up.
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    cluster.plugin(Some(&format!("socket={} off", agent.socket.display())));
    let out = srun(&["--hocus=on"], &pythonpath);
    assert_success(&out);
    assert_eq!(text(&out.stdout), "42\n");
    assert!(!agent.log().contains("task "), "{}", agent.log());

    // A plugstack line with a mistake: jobs still run.
    cluster.plugin(Some("sokket=/nowhere"));
    let out = srun(&[], &pythonpath);
    assert_success(&out);
    cluster.plugin(None);
    let _ = fs::remove_file(&socket);
}

#[test]
fn a_batch_script_and_the_steps_it_starts_get_the_local_copies() {
    let (cluster, net, pythonpath, agent) = learned();

    // The script imports, then starts a step that imports: both are tasks.
    let dir = tempfile::tempdir().unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let script = dir.path().join("job.sh");
    fs::write(
        &script,
        format!("#!/bin/sh\n{PYTHON} -c '{SCRIPT}'\nsrun --quiet {PYTHON} -c '{SCRIPT}'\n"),
    )
    .unwrap();
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    let output = dir.path().join("out.txt");
    let before = net.server_log().len();
    let out = cluster.as_user(
        "sbatch",
        &[
            "--wait",
            "--quiet",
            "-o",
            output.to_str().unwrap(),
            script.to_str().unwrap(),
        ],
        &[
            ("PYTHONPATH", pythonpath.as_str()),
            ("PYTHONDONTWRITEBYTECODE", "1"),
        ],
    );
    assert_success(&out);
    assert_eq!(fs::read_to_string(&output).unwrap(), "42\n42\n");
    let reached = net.job_requests_inside("env", before);
    assert!(
        reached.is_empty(),
        "the batch job's imports reached the server:\n{}",
        reached.join("\n")
    );
    // The batch script's task and the step's task, each attached.
    let attached = agent
        .log()
        .lines()
        .filter(|l| l.contains("of Slurm job") && l.contains("2 local copies in place"))
        .count();
    assert_eq!(attached, 2, "{}", agent.log());
}

#[test]
fn a_bind_that_fails_leaves_the_job_reading_the_network() {
    let (_cluster, net, pythonpath, agent) = learned();
    // The snapshots' local trees vanish behind the daemon's back (a failing cache
    // disk): their binds cannot be made.
    for dir in ["env/lib", "env/empty"] {
        let local = agent
            .cache_dir
            .join("trees")
            .join(net.path(dir).strip_prefix("/").unwrap());
        assert!(local.is_dir(), "no snapshot at {}", local.display());
        fs::remove_dir_all(&local).unwrap();
    }
    net.drop_client_caches();
    let before = net.server_log().len();
    let out = srun(&[], &pythonpath);
    assert_success(&out);
    assert_eq!(text(&out.stdout), "42\n");
    assert!(!net.job_requests_inside("env", before).is_empty());
    // Both tasks, the first (nothing learned yet) and this one, ran without binds.
    let bare = agent
        .log()
        .lines()
        .filter(|l| l.contains("of Slurm job") && l.contains(": 0 local copies in place"))
        .count();
    assert_eq!(bare, 2, "{}", agent.log());
}

/// A directory where each user may make their own profile directory (`{user}` below it).
fn profiles_home() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("hocus-profiles-")
        .tempdir_in("/var/tmp")
        .unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o1777)).unwrap();
    dir
}

#[test]
fn the_epilog_saves_the_jobs_profile_as_its_user_and_the_next_job_starts_prefetched() {
    use std::os::unix::fs::MetadataExt;
    let cluster = slurm();
    let net = NetworkMount::start();
    let pythonpath = environment(&net);
    let home = profiles_home();
    let template = format!("{}/{{user}}", home.path().display());
    let watch = [
        "--watch",
        net.mount.to_str().unwrap(),
        "--job-profiles",
        &template,
    ];
    let mut agent = Agent::start(&watch);
    cluster.plugin(Some(&format!("socket={}", agent.socket.display())));

    // A first job named "trainer": nothing kept yet; its epilog keeps what it used.
    assert_success(&srun(&["--job-name=trainer"], &pythonpath));
    let saved = home.path().join("hocus-test/trainer.json");
    wait_until(30, "the epilog's profile", || saved.exists());
    let (uid, _) = hocus_tests::test_user();
    let meta = fs::metadata(&saved).unwrap();
    assert_eq!(meta.uid(), uid, "written as the job's user");
    assert_eq!(meta.mode() & 0o777, 0o600);
    let profile: serde_json::Value = serde_json::from_slice(&fs::read(&saved).unwrap()).unwrap();
    let core = net.path("env/lib/mypkg/core.py");
    assert!(file_entry(&profile, &core).is_some(), "{profile:#}");
    assert!(
        cluster
            .slurmd_log()
            .contains(r#"no prefetch: hocus-agent refused: no profile at"#),
        "{}",
        cluster.slurmd_log()
    );

    // Another node: a daemon that has never seen the environment. The next job named
    // "trainer" finds it prefetched before its first task (by its prolog, which reads
    // the server meanwhile): every open and failed lookup of the job is local.
    agent.stop();
    let agent = Agent::start(&watch);
    cluster.plugin(Some(&format!("socket={}", agent.socket.display())));
    let out = srun(&["--job-name=trainer"], &pythonpath);
    assert_success(&out);
    assert_eq!(text(&out.stdout), "42\n");
    let job = agent.cache()["slurm_jobs"][0].clone();
    let served = &job["served"];
    assert!(served["opens_local"].as_u64() >= Some(2), "{job}");
    assert!(served["lookups_local"].as_u64() >= Some(1), "{job}");
    assert_eq!(
        (&served["opens_network"], &served["lookups_network"]),
        (&serde_json::json!(0), &serde_json::json!(0)),
        "{job}\n{}",
        cluster.slurmd_log()
    );
    assert!(
        cluster
            .slurmd_log()
            .contains(r#"prefetched 2 of 2 files and 1 of 1 trees from profile "trainer""#),
        "{}",
        cluster.slurmd_log()
    );

    // A hostile or broken profile in the user's directory: refused, the job still runs.
    let (uid, gid) = hocus_tests::test_user();
    let as_user = |script: &str| {
        use std::os::unix::process::CommandExt;
        let out = std::process::Command::new("sh")
            .args(["-c", script])
            .uid(uid)
            .gid(gid)
            .output()
            .unwrap();
        assert_success(&out);
    };
    let dir = saved.parent().unwrap().display().to_string();
    for (name, make) in [
        ("shadow", format!("ln -s /etc/shadow {dir}/shadow.json")),
        ("garbage", format!("printf 'not json' > {dir}/garbage.json")),
        (
            "outside",
            format!(
                "sed 's|{}|/etc/shadow|' {} > {dir}/outside.json",
                core.display(),
                saved.display()
            ),
        ),
    ] {
        as_user(&make);
        let out = srun(&[&format!("--hocus-profile={name}")], &pythonpath);
        assert_success(&out);
        assert_eq!(text(&out.stdout), "42\n", "{name}");
    }
    wait_until(10, "the refusals in slurmd's log", || {
        let log = cluster.slurmd_log();
        log.contains("shadow.json as uid 999: Too many levels of symbolic links")
            && log.contains("garbage.json: the profile sent is not a hocus profile")
    });
    // The profile naming a file outside the watched tree is taken without it.
    assert!(
        agent
            .log()
            .contains("e.g. /etc/shadow: is outside every watched tree"),
        "{}",
        agent.log()
    );
    let p = agent.export();
    assert!(file_entry(&p, std::path::Path::new("/etc/shadow")).is_none());
}

#[test]
fn tasks_starting_together_ask_the_server_once() {
    let (_cluster, _net, pythonpath, agent) = learned();
    // Two tasks of one step start at once: one checks the snapshots (env/lib and
    // env/empty) against the server, the other is given their confirmations (less than
    // a second old).
    let out = srun(&["--ntasks=2"], &pythonpath);
    assert_success(&out);
    assert_eq!(text(&out.stdout), "42\n42\n");
    let starts: Vec<String> = agent
        .log()
        .lines()
        .filter(|l| l.contains("job start: 2 local copies confirmed"))
        .map(str::to_owned)
        .collect();
    assert_eq!(starts.len(), 2, "{}", agent.log());
    // Logged as each ends: in either order.
    let by = |n: u32| {
        starts
            .iter()
            .filter(|l| {
                l.contains(&format!(
                    ", {} confirmed by another job's start just before",
                    2 * n
                ))
            })
            .count()
    };
    assert_eq!((by(0), by(1)), (1, 1), "{starts:#?}");
}

/// A Slurm job keeps its own profile (its epilog saves it), which must hold its hits;
/// yet while all its opens hit, the tracer rests: opens through its task's binds are
/// reported by fanotify marks on their mounts. A file the job opens for the first time
/// while the tracer rests is counted as its hit and is in the profile its epilog saves,
/// and nothing wakes the tracer.
#[test]
fn a_slurm_job_whose_opens_all_hit_runs_at_rest_and_its_profile_still_holds_them() {
    served_slurm_job(None);
}

/// Without the marks (`HOCUS_FALLBACKS=bind-opens`: a kernel without fanotify's mount
/// ids), the tracer follows a Slurm job all along: it never rests, and the profile
/// holds the same files.
#[test]
fn without_the_marks_a_slurm_job_is_followed_all_along() {
    served_slurm_job(Some("bind-opens"));
}

/// A Slurm job that opens two local copies again and again, then a third; with
/// `fallbacks`, the daemon takes them.
fn served_slurm_job(fallbacks: Option<&str>) {
    let cluster = slurm();
    let net = NetworkMount::start();
    let files = ["a", "b", "c"].map(|n| net.put(&format!("env/lib/rest_{n}.py"), b"V = 1\n"));
    let names = files.clone().map(|f| f.display().to_string());
    let home = profiles_home();
    let template = format!("{}/{{user}}", home.path().display());
    let args = [
        "--watch",
        net.mount.to_str().unwrap(),
        "--job-profiles",
        &template,
        "--rest-after",
        "3",
    ];
    let agent = match fallbacks {
        Some(f) => Agent::start_with_fallbacks(f, &args),
        None => Agent::start(&args),
    };
    cluster.plugin(Some(&format!("socket={}", agent.socket.display())));
    let way = agent.route("Slurm jobs' own profiles while the tracer rests");
    let marked = fallbacks.is_none();
    assert_eq!(way.starts_with("opens through"), marked, "{way}");
    // A first job reads all three from the network; the daemon copies them.
    let cat_all = format!("cat {} >/dev/null", names.join(" "));
    assert_success(&cluster.as_user("srun", &["--quiet", "sh", "-c", &cat_all], &[]));
    wait_until(60, "local copies of all three", || {
        files.iter().all(|f| agent.local_copy(f).exists())
    });
    agent.settled();

    // A second job, named "served": opens a and b again and again; told to, opens c
    // (its first open of it, a hit), and goes on until told to end.
    let flags = tempfile::tempdir_in("/tmp").unwrap();
    // The job's user writes its shell's pid there.
    fs::set_permissions(flags.path(), fs::Permissions::from_mode(0o1777)).unwrap();
    let (first, second) = (flags.path().join("c"), flags.path().join("end"));
    let hits = format!("cat {} {} >/dev/null", names[0], names[1]);
    let until = |flag: &std::path::Path| {
        format!(
            "i=0; while [ ! -e {} ] && [ $i -lt 900 ]; do {hits}; sleep 0.1; i=$((i+1)); done",
            flag.display()
        )
    };
    let pid = flags.path().join("pid");
    let script = format!(
        "echo $$ > {}; {}; cat {} >/dev/null; {}",
        pid.display(),
        until(&first),
        names[2],
        until(&second)
    );
    let job = cluster
        .command_as_user(
            "srun",
            &["--quiet", "--job-name=served", "sh", "-c", &script],
            &[],
        )
        .spawn()
        .unwrap();
    let mut job = BackgroundJob(job, pid);
    // Its task runs (its shell wrote its pid): the job's start, and the wake it makes,
    // are behind. Under emulation srun takes seconds to get there, and a wake counted
    // after `woke` was read looked like a hit's.
    wait_until(60, "the served job's task to run", || job.1.exists());
    let tracing = |agent: &Agent| agent.status()["tracing"].clone();
    let opens_local = |agent: &Agent| {
        agent.cache()["slurm_jobs"]
            .as_array()
            .and_then(|jobs| jobs.iter().max_by_key(|j| j["job_id"].as_u64()).cloned())
            .map_or(0, |j| j["served"]["opens_local"].as_u64().unwrap_or(0))
    };
    if marked {
        wait_until(30, "the tracer to rest while the Slurm job runs", || {
            let t = tracing(&agent);
            t["resting"] == true && t["with_jobs"] == true
        });
    } else {
        // Twice the time it would take to rest (time itself is the subject here).
        std::thread::sleep(std::time::Duration::from_secs(6));
    }
    let woke = tracing(&agent)["wakeups"].as_u64().unwrap();
    // Its hits are counted, at rest or followed.
    let before = opens_local(&agent);
    wait_until(10, "the job's hits to be counted", || {
        opens_local(&agent) >= before + 10
    });
    fs::write(&first, "").unwrap();
    std::thread::sleep(std::time::Duration::from_secs(2));
    // (Asked while the job runs: once it ends, an idle daemon may rest and wake again.)
    let t = tracing(&agent);
    assert_eq!(t["resting"] == true, marked, "{t}");
    assert_eq!(t["wakeups"].as_u64(), Some(woke), "a hit woke it: {t}");
    fs::write(&second, "").unwrap();
    assert!(job.wait(), "{}", cluster.slurmd_log());

    // The epilog saved the job's profile: c (opened only while the tracer rested, where
    // it rests) is in it.
    let saved = home.path().join("hocus-test/served.json");
    wait_until(30, "the epilog's profile", || saved.exists());
    let profile: serde_json::Value = serde_json::from_slice(&fs::read(&saved).unwrap()).unwrap();
    for f in &files {
        let entry = file_entry(&profile, f)
            .unwrap_or_else(|| panic!("{} not in the job's profile: {profile:#}", f.display()));
        assert!(entry["opens"].as_u64() >= Some(1), "{entry}");
    }
}
