//! Slurm with job_container/tmpfs, as many sites run it: each job has a mount namespace
//! of its own with a private /tmp and /dev/shm before any task starts. hocus's plugin
//! makes each task a namespace inside it and binds there; the job keeps its private /tmp.
//! (The mount and the daemon live under /var/tmp here: a job cannot see the node's /tmp.)

use std::path::Path;

use hocus_tests::{
    Agent, NetworkMount, assert_success,
    slurm::{Options, slurm_with},
};

const PYTHON: &str = "/usr/bin/python3";

#[test]
fn tasks_in_a_private_tmp_job_container_get_the_local_copies() {
    let cluster = slurm_with(Options {
        job_container_tmpfs: true,
        ..Options::default()
    });
    let parent = Path::new("/var/tmp");
    let net = NetworkMount::start_under(parent);
    net.put_python_package("env/lib");
    net.installed_long_ago("env");
    let agent = Agent::start_under(parent, &["--watch", net.mount.to_str().unwrap()]);
    cluster.plugin(Some(&format!("socket={}", agent.socket.display())));
    // The node's /tmp holds a marker the job must not see: its /tmp is its own.
    let marker = tempfile::Builder::new()
        .prefix("hocus-node-tmp-")
        .tempfile()
        .unwrap();
    let script = format!(
        "import os, mypkg.core; print(mypkg.core.VALUE + 1, os.path.exists('{}'))",
        marker.path().display()
    );
    let lib = net.path("env/lib");
    let job = || {
        let out = cluster.as_user(
            "srun",
            &["--quiet", PYTHON, "-c", &script],
            &[
                ("PYTHONPATH", lib.to_str().unwrap()),
                ("PYTHONDONTWRITEBYTECODE", "1"),
            ],
        );
        assert_success(&out);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(job(), "42 False\n");
    agent.wait_for_snapshot(&lib);
    let before = net.server_log().len();
    assert_eq!(job(), "42 False\n");
    let reached = net.job_requests_inside("env", before);
    assert!(
        reached.is_empty(),
        "the job's imports reached the server:\n{}\n{}",
        reached.join("\n"),
        cluster.slurmd_log()
    );
    assert!(
        agent.log().contains("1 local copies in place"),
        "{}",
        agent.log()
    );
}
