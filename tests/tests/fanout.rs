//! Many nodes (issue 14): a real cluster of three nodes on one machine, each a network and
//! mount namespace with its own sshfs mount of one file server (in a namespace of its
//! own: its log is the truth of what it served), its own slurmd and its own hocus-agent
//! (its /run/hocus its own, so the plugin's default socket is that node's). A job spans
//! the three nodes, submitted by an ordinary user.

use std::{
    fs,
    os::unix::{
        fs::{FileExt, MetadataExt, PermissionsExt},
        process::CommandExt,
    },
    process::{Command, Stdio},
    thread,
};

use hocus_tests::{
    Agent, NetworkMount, assert_success, repeating_bytes,
    slurm::{Node, Options, SERVER_ADDR, Slurm, slurm_with},
    wait_until,
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
    daemon_with(node, net, &[])
}

/// The same, with more flags.
fn daemon_with(node: &Node, net: &NetworkMount, more: &[&str]) -> Agent {
    let mut args = vec!["--watch", net.mount.to_str().unwrap()];
    args.extend_from_slice(more);
    slurm_with(Options {
        nodes: NODES,
        ..Options::default()
    })
    .agent_on(node, &args)
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
    for agent in &agents {
        agent.wait_for_snapshot(&lib);
    }
    // Each node read the working set from the server itself: what issue 14 is to
    // share (today every node's daemon and job ask the server on their own).
    let read = net.bytes_served_inside("env", before);
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

/// What the relay tests share: the cluster, the server with the package and a data
/// file the job reads (the working set, of `working_set` bytes), and a directory where
/// the user's job profiles are kept (the same on every node, as a network home is).
struct Shared {
    cluster: &'static Slurm,
    net: NetworkMount,
    working_set: u64,
    profiles: tempfile::TempDir,
}

/// 2 MiB the job reads besides the modules.
const DATA: usize = 2 << 20;
const READ_DATA: &str = "import os, mypkg.core; d = open(os.path.join(os.path.dirname(mypkg.core.__file__), 'data.bin'), 'rb').read(); print(mypkg.core.VALUE + 1, len(d))";

fn shared() -> Shared {
    let (cluster, net, package) = cluster();
    let data: Vec<u8> = (0..DATA).map(|i| (i * 7 % 251) as u8).collect();
    net.put("env/lib/mypkg/data.bin", &data);
    net.installed_long_ago("env");
    let profiles = tempfile::Builder::new()
        .prefix("hocus-profiles-")
        .tempdir_in("/var/tmp")
        .unwrap();
    fs::set_permissions(profiles.path(), fs::Permissions::from_mode(0o1777)).unwrap();
    Shared {
        cluster,
        net,
        working_set: package + DATA as u64,
        profiles,
    }
}

impl Shared {
    fn template(&self) -> String {
        format!("{}/{{user}}", self.profiles.path().display())
    }

    /// A fresh daemon on every node: empty caches, as nodes that never ran the job.
    fn daemons(&self) -> Vec<Agent> {
        self.daemons_with(&[])
    }

    fn daemons_with(&self, more: &[&str]) -> Vec<Agent> {
        let template = self.template();
        let mut args = vec!["--job-profiles", &template];
        args.extend_from_slice(more);
        self.cluster
            .nodes
            .iter()
            .map(|n| daemon_with(n, &self.net, &args))
            .collect()
    }

    /// The job, on every node, keyed `fan`: its output.
    fn job(&self) -> std::process::Output {
        self.job_running(READ_DATA)
    }

    /// The same, running Python `script`.
    fn job_running(&self, script: &str) -> std::process::Output {
        let lib = self.net.path("env/lib");
        self.cluster.as_user(
            "srun",
            &[
                "--quiet",
                &format!("--nodes={NODES}"),
                "--hocus-profile=fan",
                "/usr/bin/python3",
                "-c",
                script,
            ],
            &[
                ("PYTHONPATH", lib.to_str().unwrap()),
                ("PYTHONDONTWRITEBYTECODE", "1"),
            ],
        )
    }

    /// A first job on other daemons saved the profile under `fan`.
    fn learned(&self) {
        self.learned_running(READ_DATA, &[]);
    }

    /// The same, the job running `script`, the daemons given `more` flags.
    fn learned_running(&self, script: &str, more: &[&str]) {
        let agents = self.daemons_with(more);
        self.cluster.plugin(Some(""));
        let out = self.job_running(script);
        assert_success(&out);
        let saved = self.profiles.path().join("hocus-test/fan.json");
        wait_until(30, "the epilog's profile", || saved.exists());
        drop(agents);
    }

    /// Every copy `agent` holds is the network file's bytes; how many it holds.
    fn copies_are_the_sources(&self, agent: &Agent, node: &Node) -> usize {
        let mut checked = 0;
        for rel in ["mypkg/__init__.py", "mypkg/core.py", "mypkg/data.bin"] {
            let source = self.net.path(&format!("env/lib/{rel}"));
            let copy = agent.local_copy(&source);
            if let Ok(bytes) = fs::read(&copy) {
                let want = fs::read(self.net.server_path(&format!("env/lib/{rel}"))).unwrap();
                assert!(bytes == want, "{}: {} differs", node.name, copy.display());
                checked += 1;
            }
        }
        // Nothing half-written is left where copies are made.
        let tmp = agent.dir.path().join("cache/tmp");
        let left: Vec<_> = fs::read_dir(&tmp)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("copy-"))
            })
            .collect();
        assert!(left.is_empty(), "{}: {left:?}", node.name);
        checked
    }
}

/// The metrics of `node`'s daemon, served in the node's network namespace.
fn metrics_of(agent: &Agent, node: &Node) -> String {
    let url = format!("http://{}/metrics", agent.metrics_addr());
    let out = Command::new("nsenter")
        .args(["-t", &node.holder.to_string(), "-n", "--", "python3", "-c"])
        .arg("import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())")
        .arg(url)
        .output()
        .unwrap();
    assert_success(&out);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn copied_from_peers(agent: &Agent) -> u64 {
    agent.cache()["copied_from_peers_bytes"]
        .as_u64()
        .unwrap_or(0)
}

#[test]
fn a_jobs_nodes_read_its_saved_working_set_from_the_server_once() {
    let s = shared();
    s.learned();
    // Nodes that never ran the job: each prolog prefetches from the saved profile,
    // node1 from the server, node2 and node3 from node1.
    let agents = s.daemons();
    let before = s.net.server_log().len();
    let out = s.job();
    assert_success(&out);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("42 {DATA}\n").repeat(NODES)
    );
    for agent in &agents {
        agent.settled();
    }
    let served = s.net.bytes_served_inside("env", before);
    assert!(
        served * 10 <= s.working_set * 12,
        "the server sent {served} bytes of a {} byte working set to {NODES} nodes",
        s.working_set
    );
    // What the job's user may read of the profile was asked of the server by node1's
    // prolog alone: node2 and node3 took its verdicts (issue 52).
    let access: Vec<u64> = agents.iter().map(|a| a.asked_for("access")).collect();
    assert!(
        access[0] > 0 && access[1..].iter().all(|&a| a == 0),
        "permission checks asked by each node: {access:?}"
    );
    for agent in &agents[1..] {
        let log = agent.log();
        let taken = log
            .lines()
            .find_map(|l| {
                l.split("may read: ")
                    .nth(1)?
                    .split(' ')
                    .next()?
                    .parse()
                    .ok()
            })
            .unwrap_or(0u64);
        assert!(
            taken > 0 && log.contains(&format!("{taken} entries as node node1 found")),
            "{log}"
        );
    }
    for (i, (agent, node)) in agents.iter().zip(&s.cluster.nodes).enumerate() {
        assert_eq!(s.copies_are_the_sources(agent, node), 3, "{}", agent.log());
        let from_peers = copied_from_peers(agent);
        if i == 0 {
            assert_eq!(from_peers, 0, "node1 reads the server");
        } else {
            assert!(
                from_peers >= s.working_set,
                "{}: {from_peers} bytes from node1\n{}",
                node.name,
                agent.log()
            );
            let sample = format!("hocus_copied_bytes_total{{from=\"peer\"}} {from_peers}");
            let metrics = metrics_of(agent, node);
            assert!(metrics.contains(&sample), "{}: {metrics}", node.name);
        }
    }
}

impl Shared {
    /// The job on node `node` alone, keyed `fan`: its output.
    fn job_on(&self, node: &str) -> std::process::Output {
        let lib = self.net.path("env/lib");
        self.cluster.as_user(
            "srun",
            &[
                "--quiet",
                "--nodes=1",
                &format!("--nodelist={node}"),
                "--hocus-profile=fan",
                "/usr/bin/python3",
                "-c",
                READ_DATA,
            ],
            &[
                ("PYTHONPATH", lib.to_str().unwrap()),
                ("PYTHONDONTWRITEBYTECODE", "1"),
            ],
        )
    }

    /// The saved profile, once its holder is `node` (the epilog that saved it ran there).
    fn saved_by(&self, node: &str) -> serde_json::Value {
        let saved = self.profiles.path().join("hocus-test/fan.json");
        let mut profile = serde_json::Value::Null;
        wait_until(30, &format!("the profile saved by {node}'s epilog"), || {
            profile = fs::read(&saved)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default();
            profile["holder"]["node"] == node
        });
        profile
    }
}

#[test]
fn the_next_job_fetches_its_working_set_from_the_node_whose_job_saved_it() {
    let s = shared();
    let agents = s.daemons();
    s.cluster.plugin(Some(""));
    // Two jobs on node1: the first saves the profile, the second prefetches from it (from
    // the server) and saves it again: node1's cache holds its files, and says so.
    for _ in 0..2 {
        assert_success(&s.job_on("node1"));
        s.saved_by("node1");
    }
    agents[0].settled();
    let held = s.saved_by("node1");
    assert!(held["holder"]["job"].as_u64().is_some(), "{held}");
    // An array of two tasks on node2 and node3 (which never ran the job), a node each: both
    // prologs' copies come from node1 as the tasks start together.
    let dir = tempfile::Builder::new()
        .prefix("hocus-array-")
        .tempdir_in("/tmp")
        .unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let script = dir.path().join("task.sh");
    fs::write(
        &script,
        format!("#!/bin/sh\nexec /usr/bin/python3 -c \"{READ_DATA}\"\n"),
    )
    .unwrap();
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    let lib = s.net.path("env/lib");
    let before = s.net.server_log().len();
    let out = s.cluster.as_user(
        "sbatch",
        &[
            "--wait",
            "--quiet",
            "--array=0-1",
            "--nodes=1",
            "--exclusive",
            "--exclude=node1",
            "--hocus-profile=fan",
            "-o",
            &format!("{}/out-%a.txt", dir.path().display()),
            script.to_str().unwrap(),
        ],
        &[
            ("PYTHONPATH", lib.to_str().unwrap()),
            ("PYTHONDONTWRITEBYTECODE", "1"),
        ],
    );
    assert_success(&out);
    for task in 0..2 {
        let said = fs::read_to_string(dir.path().join(format!("out-{task}.txt"))).unwrap();
        assert_eq!(said, format!("42 {DATA}\n"), "task {task}");
    }
    for (agent, node) in agents.iter().zip(&s.cluster.nodes).skip(1) {
        agent.settled();
        let from_node1 = copied_from_peers(agent);
        assert!(
            from_node1 >= s.working_set,
            "{} took {from_node1} bytes from node1\n{}",
            node.name,
            agent.log()
        );
        assert!(
            agent.log().contains("from node node1 (") && agent.log().contains("which held them"),
            "{}",
            agent.log()
        );
        assert_eq!(s.copies_are_the_sources(agent, node), 3, "{}", agent.log());
    }
    let served = s.net.bytes_served_inside("env", before);
    assert!(
        served * 10 <= s.working_set,
        "the server sent {served} bytes of a {} byte working set node1 held to a 2-task array",
        s.working_set
    );
    // Both tasks' epilogs saved the profile (the last one's stands) before the user's turn.
    for agent in &agents[1..] {
        wait_until(30, "the task's epilog", || {
            agent.log().contains("its profile (")
        });
    }

    // The user names in their profile a holder of their own choosing: a job node1 never
    // ran, and then a node with no daemon. A node that never ran the job (node3 anew)
    // proves neither, reads the server, and the job runs on copies of the server's bytes.
    let agents = {
        let mut agents = agents;
        drop(agents.pop());
        let template = s.template();
        let fresh = daemon_with(&s.cluster.nodes[2], &s.net, &["--job-profiles", &template]);
        agents.push(fresh);
        agents
    };
    let saved = s.profiles.path().join("hocus-test/fan.json");
    for (node, job) in [("node1", 999_999), ("login", 1)] {
        let forge = format!(
            "import json, sys; p = json.load(open(sys.argv[1])); p['holder'] = {{'node': '{node}', 'job': {job}}}; json.dump(p, open(sys.argv[1], 'w'))"
        );
        let out = s
            .cluster
            .as_user("python3", &["-c", &forge, saved.to_str().unwrap()], &[]);
        assert_success(&out);
        let before = s.net.server_log().len();
        let out = s.job_on("node3");
        assert_success(&out);
        assert_eq!(String::from_utf8_lossy(&out.stdout), format!("42 {DATA}\n"));
        agents[2].settled();
        assert_eq!(copied_from_peers(&agents[2]), 0, "{}", agents[2].log());
        assert_eq!(s.copies_are_the_sources(&agents[2], &s.cluster.nodes[2]), 3);
        if node == "node1" {
            // Its copies came from the server: the first time only.
            let served = s.net.bytes_served_inside("env", before);
            assert!(served >= s.working_set, "the server sent {served} bytes");
            assert!(
                agents[0]
                    .log()
                    .contains("Slurm job 999999 is not known here"),
                "{}",
                agents[0].log()
            );
        }
        // The next round's forgery overwrites the epilog's save.
        s.saved_by("node3");
    }
}

/// The last job start `agent` logged: its copies confirmed, the entries it checked
/// against the server itself, and the copies its parent node vouched for.
/// The daemon's log line of its last job start.
fn last_start_line(agent: &Agent) -> String {
    let log = agent.log();
    log.lines()
        .rfind(|l| l.contains("job start: "))
        .unwrap_or_else(|| panic!("no job start in {log}"))
        .to_owned()
}

fn last_start(agent: &Agent) -> (u64, u64, u64) {
    let line = last_start_line(agent);
    let number_before = |word: &str| -> u64 {
        line.split(word)
            .next()
            .and_then(|l| l.split(' ').next_back()?.parse().ok())
            .unwrap_or(0)
    };
    (
        agent.last_start_bound().0,
        number_before(" entries checked"),
        number_before(" vouched for by node"),
    )
}

/// What `agent` counted asking the server for job starts.
fn job_start_operations(agent: &Agent) -> u64 {
    agent.asked_for("job_start")
}

/// A job's start is checked against the server once for all its nodes: node2 and
/// node3 ask node1, their parent, to vouch for their copies' checks, and node1 answers
/// for those it checked itself just before (or checks them then, once for all). The
/// server's operations for a step on three nodes are about those of a step on one.
#[test]
fn a_jobs_start_is_checked_against_the_server_once_for_all_its_nodes() {
    let s = shared();
    s.learned();
    // No revalidation of the batch script's binds while the steps are counted.
    let agents = s.daemons_with(&["--revalidate", "600"]);
    let dir = tempfile::tempdir().unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let d = dir.path().display();
    let node1 = &s.cluster.nodes[0].name;
    let script = dir.path().join("job.sh");
    fs::write(
        &script,
        format!(
            "#!/bin/sh\n\
             step() {{ srun --quiet \"$@\" /usr/bin/python3 -c '{SCRIPT}'; }}\n\
             between() {{ touch {d}/$1; while [ ! -e {d}/go$1 ]; do sleep 0.1; done; }}\n\
             step --nodes={NODES}\nbetween 0\n\
             step --nodes=1 --nodelist={node1}\nbetween 1\n\
             step --nodes={NODES}\n"
        ),
    )
    .unwrap();
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    let output = dir.path().join("out.txt");
    let lib = s.net.path("env/lib");
    let job = s
        .cluster
        .command_as_user(
            "sbatch",
            &[
                "--wait",
                "--quiet",
                &format!("--nodes={NODES}"),
                "--hocus-profile=fan",
                "-o",
                output.to_str().unwrap(),
                script.to_str().unwrap(),
            ],
            &[
                ("PYTHONPATH", lib.to_str().unwrap()),
                ("PYTHONDONTWRITEBYTECODE", "1"),
            ],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // What the server did, and what each daemon asked it for job starts, once the step
    // before has ended; then the next step.
    let counts = |step: usize| {
        let marker = dir.path().join(step.to_string());
        wait_until(120, &format!("step {step}"), || marker.exists());
        for agent in &agents {
            agent.settled();
        }
        let counted: Vec<u64> = agents.iter().map(job_start_operations).collect();
        (s.net.server_log().len(), counted)
    };
    // What the server was asked since `before` of the package's directory and below:
    // the job's own reads there are its snapshot's, local, so these are the daemons'
    // job-start checks and their binds' lookups.
    let package = format!("\"{}", s.net.server_path("env/lib/mypkg").display());
    let asked_since = |before: usize| {
        s.net.server_log()[before..]
            .lines()
            .filter(|l| l.contains(&package))
            .count() as u64
    };
    let go = |step: usize| {
        // Past what a check is reused for on a node (1 s).
        thread::sleep(std::time::Duration::from_millis(1500));
        fs::write(dir.path().join(format!("go{step}")), "").unwrap();
    };
    let (log0, counted0) = counts(0);
    go(0);
    let (log1, counted1) = counts(1);
    let one_node = asked_since(log0);
    let one_node_counted = counted1[0] - counted0[0];
    let (binds, entries, _) = last_start(&agents[0]);
    go(1);
    let out = job.wait_with_output().unwrap();
    assert_success(&out);
    assert_eq!(
        fs::read_to_string(&output).unwrap(),
        "42\n".repeat(2 * NODES + 1)
    );
    for agent in &agents {
        agent.settled();
    }
    let all_nodes = asked_since(log1);
    let counted: Vec<u64> = agents
        .iter()
        .zip(&counted1)
        .map(|(a, before)| job_start_operations(a) - before)
        .collect();
    eprintln!(
        "a step on node1 alone: the server was asked {one_node} times of the snapshot's {entries} entries (node1 counted {one_node_counted} for its {binds} copies); a step on {NODES} nodes: {all_nodes} times, the daemons counted {counted:?}"
    );
    // node1 checked its copies against the server, at both steps: at the second for
    // its own start, or for a child that asked first, its own start then reusing that
    // check; node2 and node3 checked none themselves: node1 vouched for every one.
    assert!(binds >= 1 && entries >= 4, "{}", agents[0].log());
    let own = agents[0].log();
    let own = own.lines().rfind(|l| l.contains("job start: ")).unwrap();
    assert!(
        own.contains(&format!("{entries} entries checked"))
            || own.contains(&format!(
                "{binds} confirmed by another job's start just before"
            )),
        "{own}"
    );
    for (agent, node) in agents.iter().zip(&s.cluster.nodes).skip(1) {
        let (copies, checked, vouched) = last_start(agent);
        assert!(
            copies == binds && checked == 0 && vouched == copies,
            "{}: {copies} copies, {checked} entries checked, {vouched} vouched for\n{}",
            node.name,
            agent.log()
        );
        assert_eq!(s.copies_are_the_sources(agent, node), 3, "{}", node.name);
    }
    // What node2 and node3 add to the server is their binds' own lookups (the tree,
    // the target: two per copy, counted), not a check of the entries: the step on
    // three nodes asks it what the step on one did, and those (here 4, then 6; each
    // node checking for itself, 4 more a node).
    let lookups = (NODES as u64 - 1) * 2 * binds;
    assert!(
        counted[1..].iter().all(|&c| c <= 2 * binds) && all_nodes <= one_node + lookups,
        "the server was asked {all_nodes} times for a step on {NODES} nodes, {one_node} for one; the others counted {:?}",
        &counted[1..]
    );
}

/// How long `agent`'s last job start took to confirm its copies.
fn last_start_took_ms(agent: &Agent) -> f64 {
    agent.last_start_bound().1
}

/// A server that stops answering while a job starts on three nodes: each node's start
/// waits no longer than one node's check is bounded (2 s, 2.1 s measured; a child
/// waiting for its parent and then for its own check would take 3.6 s), its parent's
/// vouching included, and binds nothing it could not confirm; once the server answers again,
/// the next job's start is checked once for all and runs on the local copies.
#[test]
fn a_silent_server_as_a_job_starts_on_three_nodes_binds_nothing_and_holds_no_node() {
    let s = shared();
    s.learned();
    let agents = s.daemons_with(&["--revalidate", "600"]);
    assert_success(&s.job());
    for agent in &agents {
        agent.settled();
    }
    let paused = s.net.pause_server();
    let out = s.cluster.as_user(
        "srun",
        &[
            "--quiet",
            &format!("--nodes={NODES}"),
            "--hocus-profile=fan",
            "/bin/echo",
            "ran",
        ],
        &[],
    );
    assert_success(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ran\n".repeat(NODES));
    for (agent, node) in agents.iter().zip(&s.cluster.nodes) {
        let (copies, _, vouched) = last_start(agent);
        let took = last_start_took_ms(agent);
        eprintln!(
            "{}: a job start on a silent server took {took} ms",
            node.name
        );
        assert!(
            copies == 0 && vouched == 0 && took < 3000.0,
            "{}: {copies} copies bound, {vouched} vouched for, in {took} ms\n{}",
            node.name,
            agent.log()
        );
    }
    drop(paused);
    let out = s.job();
    assert_success(&out);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("42 {DATA}\n").repeat(NODES)
    );
    for (agent, node) in agents.iter().zip(&s.cluster.nodes) {
        let (copies, _, vouched) = last_start(agent);
        let expected = if node.name == s.cluster.nodes[0].name {
            0
        } else {
            copies
        };
        assert!(
            copies >= 1 && vouched == expected,
            "{}: {copies} copies bound, {vouched} vouched for\n{}",
            node.name,
            agent.log()
        );
        agent.settled();
        s.copies_are_the_sources(agent, node);
    }
}

#[test]
fn in_a_chain_each_node_passes_on_what_its_parent_passed_it() {
    let s = shared();
    s.learned();
    // One child per node: node1 -> node2 -> node3. node3's copies come from node2,
    // which serves them as they land from node1, checked against node1's hash.
    let agents = s.daemons_with(&["--fanout-width", "1"]);
    let before = s.net.server_log().len();
    assert_success(&s.job());
    for agent in &agents {
        agent.settled();
    }
    let served = s.net.bytes_served_inside("env", before);
    assert!(served * 10 <= s.working_set * 12, "{served} bytes served");
    assert!(
        agents[2]
            .log()
            .contains("node node3 fetches its files from node node2"),
        "{}",
        agents[2].log()
    );
    for (agent, node) in agents.iter().zip(&s.cluster.nodes).skip(1) {
        assert_eq!(s.copies_are_the_sources(agent, node), 3, "{}", agent.log());
        assert!(
            copied_from_peers(agent) >= s.working_set,
            "{}: {}",
            node.name,
            agent.log()
        );
    }
}

#[test]
fn a_relaying_node_killed_mid_job_leaves_its_children_on_the_server() {
    let s = shared();
    s.learned();
    let mut agents = s.daemons();
    // node1's daemon stalls as the job starts (stopped: it answers no one, its kernel
    // still accepts connections), and is killed while node2 and node3 wait on it: their
    // copies go to the server instead, and the job, node1's task too, runs (there
    // without hocus).
    agents[0].signal(libc::SIGSTOP);
    let job = thread::scope(|scope| {
        let job = scope.spawn(|| s.job());
        for child in &agents[1..] {
            wait_until(30, "the node to ask node1", || {
                child.log().contains("fetches its files from node node1")
            });
        }
        thread::sleep(std::time::Duration::from_millis(500));
        agents[0].kill9();
        job.join().unwrap()
    });
    assert_success(&job);
    assert_eq!(
        String::from_utf8_lossy(&job.stdout),
        format!("42 {DATA}\n").repeat(NODES)
    );
    for (agent, node) in agents.iter().zip(&s.cluster.nodes).skip(1) {
        wait_until(60, "the node's copies", || {
            agent.settled();
            s.copies_are_the_sources(agent, node) == 3
        });
        let log = agent.log();
        assert!(
            log.contains("this node fetches the rest from the network"),
            "{}: {log}",
            node.name
        );
        assert_eq!(copied_from_peers(agent), 0, "{}", node.name);
    }
}

#[test]
fn a_jobs_nodes_pass_on_the_ranges_they_hold_of_a_big_file() {
    const MIB: usize = 1 << 20;
    let s = shared();
    let big = repeating_bytes(32 * MIB, 253, 0);
    s.net.put("env/lib/mypkg/big.bin", &big);
    s.net.installed_long_ago("env");
    // 1 MiB at 4, 12 and 20 MiB of a 32 MiB file: copied in part (from 8 MiB).
    let at = [4 * MIB, 12 * MIB, 20 * MIB];
    let script = format!(
        "import os, mypkg.core\n\
         fd = os.open(os.path.join(os.path.dirname(mypkg.core.__file__), 'big.bin'), os.O_RDONLY)\n\
         print(sum(sum(os.pread(fd, {MIB}, at)) for at in {at:?}))"
    );
    let want: u64 = at
        .iter()
        .flat_map(|a| &big[*a..a + MIB])
        .map(|b| u64::from(*b))
        .sum();
    let partial = ["--partial-from", "8M"];
    s.learned_running(&script, &partial);
    // The job's own profile holds where its reads lay, as the node's does.
    let saved = s.profiles.path().join("hocus-test/fan.json");
    let saved: serde_json::Value = serde_json::from_slice(&fs::read(saved).unwrap()).unwrap();
    let entry = saved["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"].as_str().unwrap().ends_with("/big.bin"))
        .unwrap();
    let want_ranges: Vec<[usize; 2]> = at.iter().map(|a| [*a, a + MIB]).collect();
    assert_eq!(entry["ranges"], serde_json::json!(want_ranges), "{entry:#}");
    // Nodes that never ran the job: node1 fills the ranges from the server, node2 and
    // node3 take the grains node1 holds, hashed as node1 filled them.
    let agents = s.daemons_with(&partial);
    let route = agents[0].route("big files read in part");
    assert!(route.starts_with("partial copies"), "{route}");
    let before = s.net.server_log().len();
    let out = s.job_running(&script);
    assert_success(&out);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("{want}\n").repeat(NODES)
    );
    for agent in &agents {
        agent.settled();
    }
    // The modules and the ranges (this job reads no data.bin).
    let ranges = (at.len() * MIB) as u64;
    let working_set = s.working_set - DATA as u64 + ranges;
    let served = s.net.bytes_served_inside("env", before);
    assert!(
        served * 10 <= working_set * 12,
        "the server sent {served} bytes of a {working_set} byte working set to {NODES} nodes"
    );
    let source = s.net.path("env/lib/mypkg/big.bin");
    for (i, (agent, node)) in agents.iter().zip(&s.cluster.nodes).enumerate() {
        // A partial copy, its ranges the network's bytes (read through the daemon's
        // marks: held, so nothing is filled), nothing else held.
        let local = agent.local_copy(&source);
        let file = fs::File::open(&local).unwrap();
        let m = file.metadata().unwrap();
        assert_eq!(m.len(), big.len() as u64, "{}", node.name);
        assert!(
            m.blocks() * 512 <= ranges * 12 / 10,
            "{}: {} bytes held\n{}",
            node.name,
            m.blocks() * 512,
            agent.log()
        );
        for a in at {
            let mut got = vec![0u8; MIB];
            file.read_exact_at(&mut got, a as u64).unwrap();
            assert!(
                got == big[a..a + MIB],
                "{}: the range at {a} differs",
                node.name
            );
        }
        let from_peers = copied_from_peers(agent);
        if i == 0 {
            assert_eq!(from_peers, 0, "node1 reads the server");
        } else {
            assert!(
                from_peers >= working_set,
                "{}: {from_peers} bytes from node1\n{}",
                node.name,
                agent.log()
            );
        }
    }
}

/// Asks node1's relay, from the login namespace (no node of the job), as `user`, with
/// a credential saying `payload`: the relay's first answer line.
fn ask_relay(s: &Shared, user: &str, payload: &str, path: &str) -> String {
    const CLIENT: &str = r#"
import socket, subprocess, struct, sys
sock, payload, path = sys.argv[1:4]
cred = subprocess.run(["munge", "-S", sock, "-s", payload], capture_output=True, text=True, check=True).stdout.strip()
c = socket.create_connection(("10.77.0.11", 9743), timeout=20)
c.sendall(("HOCUS-RELAY 2\n" + cred + "\n").encode())
f = c.makefile("rb")
line = f.readline().decode().strip()
if line.startswith("OK "):
    line = "OK"
    c.sendall(struct.pack(">I", len(path)) + path.encode())
    status = f.read(1)
    line += " status=%d" % (status[0] if status else -1)
print(line)
"#;
    let mut cmd = Command::new("runuser");
    cmd.args(["-u", user, "--", "python3", "-c", CLIENT])
        .arg(&s.cluster.munge_socket)
        .args([payload, path]);
    let out = s
        .cluster
        .at_login(cmd)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_success(&out);
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn no_one_outside_the_job_fetches_from_a_node() {
    let s = shared();
    s.learned();
    let agents = s.daemons();
    let out = s.job();
    assert_success(&out);
    let job_id: u32 = agents[0]
        .log()
        .lines()
        .find_map(|l| {
            l.split("Slurm job ")
                .nth(1)?
                .split(':')
                .next()?
                .parse()
                .ok()
        })
        .expect("node1 logged the job");
    let data = s.net.path("env/lib/mypkg/data.bin");
    let data = data.to_str().unwrap();
    // An ordinary user's credential, naming a node of the job: refused.
    let as_user = ask_relay(
        &s,
        "hocus-test",
        &format!("hocus-relay job={job_id} from=node2 to=node1"),
        data,
    );
    assert!(
        as_user.starts_with("NO ") && as_user.contains("uid"),
        "{as_user}"
    );
    // Nor for the files the job left on node1 for later jobs (its epilog saved there).
    let held_as_user = ask_relay(
        &s,
        "hocus-test",
        &format!("hocus-relay-held job={job_id} from=login to=node1"),
        data,
    );
    assert!(
        held_as_user.starts_with("NO ") && held_as_user.contains("uid"),
        "{held_as_user}"
    );
    // Root, but not a node of the job: refused.
    let outsider = ask_relay(
        &s,
        "root",
        &format!("hocus-relay job={job_id} from=login to=node1"),
        data,
    );
    assert!(
        outsider.starts_with("NO ") && outsider.contains("not one of"),
        "{outsider}"
    );
    // Another job's: refused.
    let other_job = ask_relay(
        &s,
        "root",
        &format!("hocus-relay job={} from=node2 to=node1", job_id + 1000),
        data,
    );
    assert!(other_job.starts_with("NO "), "{other_job}");
    // A node of the job gets the job's files, and nothing else (/etc/shadow).
    let member = ask_relay(
        &s,
        "root",
        &format!("hocus-relay job={job_id} from=node2 to=node1"),
        data,
    );
    assert_eq!(member, "OK status=0");
    let shadow = ask_relay(
        &s,
        "root",
        &format!("hocus-relay job={job_id} from=node2 to=node1"),
        "/etc/shadow",
    );
    assert_eq!(shadow, "OK status=1");
    let log = agents[0].log();
    assert!(log.contains("relay: refused"), "{log}");
}

/// A user's listener on node1's relay port, taken before node1's daemon starts: it
/// answers every child `OK` and offers its own bytes of data.bin, with their hash and the
/// network file's size and mtime. Run in node1's namespaces as the test user.
/// An ordinary user's listener on a relay port, answering each child that greets it
/// with the best proof a user can make: on its first connection a munge credential of
/// its own saying exactly what the parent's would (the job and both nodes from the
/// child's own credential, which it decodes; the hash the credential binds to, from the
/// test through `dir`), on its second the child's own credential (root's) sent back,
/// after that a bare `OK`. Then it offers its own bytes of `target` with their hash.
const IMPOSTOR: &str = r#"
import os, socket, struct, subprocess, sys, threading, time
port, target, forged, hash_hex, log, sock, dir = sys.argv[1:8]
port, forged = int(port), open(forged, "rb").read()
lock, count = threading.Lock(), [0]
def note(what):
    with lock, open(log, "a") as l:
        l.write(what + "\n")
def proof(n, cred):
    said = subprocess.run(["unmunge", "-S", sock], input=cred, capture_output=True, text=True, check=True).stdout
    payload = said.split("\n\n", 1)[1].strip()
    job, child, parent = (w.split("=", 1)[1] for w in payload.split()[1:])
    with open(os.path.join(dir, "cred.%d" % n), "w") as f:
        f.write(cred)
    bound = os.path.join(dir, "bound.%d" % n)
    while not os.path.exists(bound):
        time.sleep(0.02)
    payload = "hocus-relay-parent job=%s from=%s to=%s for=%s" % (job, parent, child, open(bound).read())
    return subprocess.run(["munge", "-S", sock, "-s", payload], capture_output=True, text=True, check=True).stdout.strip()
def serve(c):
    with lock:
        n = count[0]
        count[0] += 1
    f = c.makefile("rb")
    f.readline()
    cred = f.readline().decode().strip()
    if n == 0:
        c.sendall(("OK " + proof(n, cred) + "\n").encode())
        note("greeted: own credential")
    elif n == 1:
        c.sendall(("OK " + cred + "\n").encode())
        note("greeted: replayed")
    else:
        c.sendall(b"OK\n")
        note("greeted: bare")
    while True:
        n = f.read(4)
        if len(n) < 4:
            return
        n = struct.unpack(">I", n)[0]
        if n & (1 << 31):
            return
        path = f.read(n).decode()
        if path != target:
            c.sendall(bytes([1]))
            continue
        st = os.stat(path)
        c.sendall(bytes([0]) + struct.pack(">Qq", st.st_size, st.st_mtime_ns) + bytes.fromhex(hash_hex) + forged)
        note("forged " + path)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port))
s.listen(64)
note("listening")
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

/// Writes `bound.N` in `dir` for each `cred.N` the impostor leaves there: the hash a
/// parent's proof binds that credential to (`shared::relay::proof`), which a user
/// could compute as well; until `stop`.
fn bind_credentials(dir: &std::path::Path, stop: &std::sync::atomic::AtomicBool) {
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        for n in 0..8 {
            let (cred, bound) = (
                dir.join(format!("cred.{n}")),
                dir.join(format!("bound.{n}")),
            );
            if let Ok(cred) = fs::read_to_string(&cred)
                && !bound.exists()
            {
                let tmp = dir.join(format!("bound.{n}.tmp"));
                fs::write(&tmp, blake3::hash(cred.as_bytes()).to_hex().as_bytes()).unwrap();
                fs::rename(&tmp, &bound).unwrap();
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn a_users_listener_on_a_parents_relay_port_hands_no_child_its_bytes() {
    let s = shared();
    s.learned();
    let node1 = &s.cluster.nodes[0];
    let data = s.net.path("env/lib/mypkg/data.bin");
    let genuine = fs::read(s.net.server_path("env/lib/mypkg/data.bin")).unwrap();
    // The impostor's bytes, as long as the file's, and their true hash.
    let dir = tempfile::Builder::new()
        .prefix("hocus-impostor-")
        .tempdir_in("/tmp")
        .unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let forged: Vec<u8> = b"FORGED-BY-an-ordinary-user "
        .iter()
        .copied()
        .cycle()
        .take(genuine.len())
        .collect();
    let forged_file = dir.path().join("forged");
    fs::write(&forged_file, &forged).unwrap();
    let hash = blake3::hash(&forged).to_hex().to_string();
    let log = dir.path().join("log");
    let mut impostor = Command::new("nsenter")
        .args(["-t", &node1.holder.to_string(), "-n", "-m", "--"])
        .args([
            "runuser",
            "-u",
            "hocus-test",
            "--",
            "python3",
            "-c",
            IMPOSTOR,
            "9743",
        ])
        .arg(&data)
        .arg(&forged_file)
        .arg(&hash)
        .arg(&log)
        .arg(&s.cluster.munge_socket)
        .arg(dir.path())
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    // runuser's child, Python, goes with its group.
    let stop = |impostor: &mut std::process::Child| {
        // SAFETY: a signal to the group this test made.
        unsafe { libc::kill(-(impostor.id() as i32), libc::SIGKILL) };
        let _ = impostor.wait();
    };
    let said = || fs::read_to_string(&log).unwrap_or_default();
    wait_until(20, "the impostor listening on node1's relay port", || {
        said().contains("listening")
    });
    // node1's daemon cannot take the port, and says so; the job runs on every node.
    let agents = s.daemons();
    let done = std::sync::atomic::AtomicBool::new(false);
    let out = std::thread::scope(|scope| {
        scope.spawn(|| bind_credentials(dir.path(), &done));
        let out = s.job();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        out
    });
    stop(&mut impostor);
    assert_success(&out);
    assert!(
        agents[0]
            .log()
            .contains("relay: cannot listen on port 9743"),
        "{}",
        agents[0].log()
    );
    // The attack was made: both children greeted the impostor, one given the user's
    // own credential of the parent's proof, the other its own credential back.
    assert!(
        said().contains("greeted: own credential") && said().contains("greeted: replayed"),
        "the children did not both ask node1: {}",
        said()
    );
    let uid = hocus_tests::test_user().0;
    let logs: String = agents[1..].iter().map(|a| a.log()).collect();
    assert!(
        logs.contains(&format!("its credential is uid {uid}'s, not root's"))
            && logs.contains("its credential is root's but says \"hocus-relay job="),
        "{logs}"
    );
    for (agent, node) in agents.iter().zip(&s.cluster.nodes).skip(1) {
        agent.settled();
        // Nothing came from it: the children's copies are the server's bytes, and
        // their job starts' checks their own.
        assert!(!said().contains("forged"), "{}: {}", node.name, said());
        assert_eq!(copied_from_peers(agent), 0, "{}", agent.log());
        // Its parent was known and asked for nothing (a child with no parent at all
        // would say nothing of vouching).
        let start = last_start_line(agent);
        assert!(
            start.contains(", 0 vouched for by node node1, 0 entries vouched for)"),
            "{start}"
        );
        // Nor its verdicts of what the job's user may read: checked here.
        assert!(
            agent
                .log()
                .contains("may read: 0 entries as node node1 found")
                && agent.asked_for("access") > 0,
            "{}",
            agent.log()
        );
        assert!(
            agent
                .log()
                .contains("is not proven to be that node's hocus daemon"),
            "{}",
            agent.log()
        );
        s.copies_are_the_sources(agent, node);
        let copy = agent.local_copy(&data);
        if let Ok(bytes) = fs::read(&copy) {
            assert!(
                bytes == genuine,
                "{}: data.bin is the impostor's",
                node.name
            );
        }
    }
}
