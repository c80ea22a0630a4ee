//! Many nodes (issue 14): a real cluster of three nodes on one machine, each a network and
//! mount namespace with its own sshfs mount of one file server (in a namespace of its
//! own: its log is the truth of what it served), its own slurmd and its own hocus-agent
//! (its /run/hocus its own, so the plugin's default socket is that node's). A job spans
//! the three nodes, submitted by an ordinary user.

use std::{fs, process::Command};

use hocus_tests::{
    Agent, NetworkMount, assert_success,
    slurm::{Node, Options, SERVER_ADDR, Slurm, slurm_with},
};

const NODES: usize = 3;
const SCRIPT: &str = "import mypkg.core; print(mypkg.core.VALUE + 1)";

/// The cluster, the server with a Python package on it (of this many bytes), mounted
/// on every node.
fn cluster() -> (&'static Slurm, NetworkMount, u64) {
    let cluster = slurm_with(Options {
        nodes: NODES,
        ..Options::default()
    });
    let server = cluster.server.expect("a server namespace");
    let net = NetworkMount::start_serving_from(server, SERVER_ADDR);
    let working_set = net.put_python_package("env/lib");
    net.installed_long_ago("env");
    for node in &cluster.nodes {
        net.mount_in_namespace_of(node.holder, &net.mount);
    }
    (cluster, net, working_set)
}

/// Node `node`'s daemon, its control socket at /run/hocus/agent.sock on that node.
fn daemon(node: &Node, net: &NetworkMount) -> Agent {
    let agent =
        Agent::start_in_namespace_of(node.holder, &["--watch", net.mount.to_str().unwrap()]);
    fs::create_dir_all("/run/hocus").unwrap();
    let bound = Command::new("nsenter")
        .args([
            "-t",
            &node.holder.to_string(),
            "-m",
            "--",
            "mount",
            "--bind",
        ])
        .arg(agent.dir.path())
        .arg("/run/hocus")
        .status()
        .unwrap();
    assert!(
        bound.success(),
        "binding {}'s daemon at /run/hocus",
        node.name
    );
    agent
}

/// The bytes the server sent of files under `rel` since its log was `before` long.
fn served_bytes(net: &NetworkMount, rel: &str, before: usize) -> u64 {
    let inside = format!("close \"{}/", net.server_path(rel).display());
    net.server_log()[before..]
        .lines()
        .filter(|l| l.contains(&inside))
        .filter_map(|l| {
            l.split(" bytes read ")
                .nth(1)?
                .split(' ')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

#[test]
fn a_job_across_three_nodes_runs_on_each_nodes_local_copies() {
    let (cluster, net, working_set) = cluster();
    let agents: Vec<Agent> = cluster.nodes.iter().map(|n| daemon(n, &net)).collect();
    cluster.plugin(Some(""));
    let lib = net.path("env/lib");
    let job = || {
        let out = cluster.as_user(
            "srun",
            &[
                "--quiet",
                &format!("--nodes={NODES}"),
                "/usr/bin/python3",
                "-c",
                SCRIPT,
            ],
            &[
                ("PYTHONPATH", lib.to_str().unwrap()),
                ("PYTHONDONTWRITEBYTECODE", "1"),
            ],
        );
        assert_success(&out);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // Each node learns the environment from the first job, on its own mount.
    let before = net.server_log().len();
    assert_eq!(job(), "42\n".repeat(NODES));
    let env = net.path("env");
    for agent in &agents {
        agent.wait_for_snapshot(&env);
    }
    // Each node read the working set from the server itself: what issue 14 is to
    // share (today every node's daemon and job ask the server on their own).
    let read = served_bytes(&net, "env", before);
    assert!(read >= NODES as u64 * working_set, "{read} bytes served");

    // The next job runs on each node's local snapshot: every task attached with it,
    // and no job request reached the server.
    let before = net.server_log().len();
    assert_eq!(job(), "42\n".repeat(NODES));
    let reached = net.job_requests_inside("env", before);
    assert!(reached.is_empty(), "{}", reached.join("\n"));
    for (agent, node) in agents.iter().zip(&cluster.nodes) {
        assert!(
            agent.log().contains(": 1 local copies in place"),
            "{}: {}",
            node.name,
            agent.log()
        );
        let jobs = agent.cache()["slurm_jobs"].clone();
        let local: u64 = jobs
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|j| j["served"]["opens_local"].as_u64())
            .sum();
        assert!(local >= 2, "{}: {jobs}", node.name);
    }
}
