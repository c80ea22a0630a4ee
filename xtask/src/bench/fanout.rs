//! `cargo xtask bench fanout`: a Slurm job on N nodes (1, 2, 3, ... of a real
//! multi-node cluster on this machine) with a saved profile, each node's daemon fresh:
//! the bytes the file server sends and the time until every node's cache holds the
//! working set, each node reading the server itself (`relay-port = 0`: direct) against
//! the nodes passing it among themselves (the relay: shared). The server's link is
//! rate-limited (tc tbf) below the nodes' so that it is the bottleneck, as on a cluster
//! whose file server many nodes start from at once.

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use hocus_tests::{
    Agent, NetworkMount,
    slurm::{Options, SERVER_ADDR, slurm_with},
};

use super::common::{saved_profile, write_figures};

pub struct Fanout {
    /// Nodes of the cluster; jobs on 1 ..= this many.
    pub nodes: usize,
    /// MiB of the working set (4 MiB files), besides 64 small files.
    pub mib: usize,
    /// The server's link and each node's, in Mbit/s.
    pub server_mbit: u32,
    pub node_mbit: u32,
}

impl Fanout {
    /// A smoke run (CI): three nodes, 8 MiB.
    pub fn quick() -> Self {
        Self {
            nodes: 3,
            mib: 8,
            server_mbit: 200,
            node_mbit: 1000,
        }
    }
}

const SMALL_FILES: usize = 64;
const KEY: &str = "fanbench";
const READ_ALL: &str = "import os, sys\nfor d, _, names in os.walk(sys.argv[1]):\n    for n in names:\n        open(os.path.join(d, n), 'rb').read()";

/// Caps `holder`'s eth0 at `mbit` (egress: what it sends).
fn limit(holder: u32, mbit: u32) -> Result<()> {
    let ok = Command::new("nsenter")
        .args([
            "-t",
            &holder.to_string(),
            "-n",
            "--",
            "tc",
            "qdisc",
            "replace",
        ])
        .args(["dev", "eth0", "root", "tbf"])
        .args([
            "rate",
            &format!("{mbit}mbit"),
            "burst",
            "1mb",
            "latency",
            "100ms",
        ])
        .status()
        .context("running tc")?
        .success();
    if !ok {
        bail!("tc could not limit a namespace's link (sch_tbf)");
    }
    Ok(())
}

/// Bytes that are not zeros (a copy keeps zeros as holes) and not all alike.
fn content(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn fanout(agent_bin: &Path, f: &Fanout) -> Result<()> {
    super::common::for_slurm(agent_bin)?;
    let cluster = slurm_with(Options {
        nodes: f.nodes.max(2),
        ..Options::default()
    });
    let server = cluster.server.context("a server namespace")?;
    let net = NetworkMount::start_serving_from(server, SERVER_ADDR);
    let mut bytes = 0u64;
    for i in 0..(f.mib / 4).max(1) {
        let data = content(i as u64 + 1, 4 << 20);
        bytes += data.len() as u64;
        net.put(&format!("env/data/part-{i:03}.bin"), &data);
    }
    for i in 0..SMALL_FILES {
        let data = content(1000 + i as u64, 4096);
        bytes += data.len() as u64;
        net.put(&format!("env/lib/mod_{i:03}.py"), &data);
    }
    let files = (f.mib / 4).max(1) + SMALL_FILES;
    net.installed_long_ago("env");
    for node in &cluster.nodes {
        net.mount_in_namespace_of(node.holder, &net.mount);
        limit(node.holder, f.node_mbit)?;
    }
    limit(server, f.server_mbit)?;
    let profiles = tempfile::Builder::new()
        .prefix("hocus-profiles-")
        .tempdir_in("/var/tmp")?;
    fs::set_permissions(profiles.path(), fs::Permissions::from_mode(0o1777))?;
    let template = format!("{}/{{user}}", profiles.path().display());
    let mount = net.mount.to_str().unwrap().to_owned();
    let daemons = |n: usize, relay: bool| -> Vec<Agent> {
        let mut args = vec!["--watch", &mount, "--job-profiles", &template];
        if !relay {
            args.extend_from_slice(&["--relay-port", "0"]);
        }
        cluster.nodes[..n]
            .iter()
            .map(|node| cluster.agent_on(node, &args))
            .collect()
    };
    let job = |n: usize, command: &[&str]| -> Result<()> {
        let names: Vec<String> = (1..=n).map(|i| format!("node{i}")).collect();
        let (nodelist, nodes) = (
            format!("--nodelist={}", names.join(",")),
            format!("--nodes={n}"),
        );
        let mut args = vec!["--quiet", &nodelist, &nodes, "--hocus-profile", KEY];
        args.extend_from_slice(command);
        let out = cluster.as_user("srun", &args, &[]);
        if !out.status.success() {
            bail!(
                "the job failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    };

    // A first job on every node reads the working set; its epilog saves the profile.
    cluster.plugin(Some(""));
    {
        let _agents = daemons(f.nodes, true);
        let env = net.path("env");
        job(
            f.nodes,
            &["/usr/bin/python3", "-c", READ_ALL, env.to_str().unwrap()],
        )?;
        saved_profile(profiles.path(), KEY)?;
    }

    println!(
        "\na job with a saved profile of {files} files ({:.1} MiB) on N nodes, each node's daemon fresh; the server's link {} Mbit/s, each node's {} Mbit/s",
        bytes as f64 / (1 << 20) as f64,
        f.server_mbit,
        f.node_mbit
    );
    println!(
        "\n{:>2} {:>16} {:>14} {:>16} {:>14} {:>14}",
        "N", "DIRECT: SERVED", "SECONDS", "SHARED: SERVED", "SECONDS", "SERVED, SHARED"
    );
    let mut rows = Vec::new();
    for n in 1..=f.nodes {
        let mut row = Vec::new();
        for relay in [false, true] {
            let agents = daemons(n, relay);
            let before = net.server_log().len();
            let started = Instant::now();
            job(n, &["/bin/true"])?;
            warm(&agents, files)?;
            let seconds = started.elapsed().as_secs_f64();
            let served = net.bytes_served_inside("env", before);
            row.push((served, seconds));
        }
        let [(direct_b, direct_s), (shared_b, shared_s)] = row[..] else {
            unreachable!()
        };
        println!(
            "{n:>2} {:>12.1} MiB {:>13.2}s {:>12.1} MiB {:>13.2}s {:>13.2}x",
            direct_b as f64 / (1 << 20) as f64,
            direct_s,
            shared_b as f64 / (1 << 20) as f64,
            shared_s,
            shared_b as f64 / bytes as f64,
        );
        rows.push(serde_json::json!({
            "nodes": n,
            "direct_served_bytes": direct_b,
            "direct_seconds": direct_s,
            "shared_served_bytes": shared_b,
            "shared_seconds": shared_s,
            "shared_served_vs_working_set": shared_b as f64 / bytes as f64,
        }));
    }
    println!(
        "\nSERVED, SHARED: the server's bytes over the working set's (goal: <= 1.2x, whatever N)"
    );
    write_figures(
        "fanout",
        &serde_json::json!({
            "working_set_bytes": bytes,
            "working_set_files": files,
            "server_mbit": f.server_mbit,
            "node_mbit": f.node_mbit,
            "rows": rows,
        }),
    )
}

/// Waits until every daemon holds the `files` of the working set, copies done.
fn warm(agents: &[Agent], files: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let done = agents.iter().all(|a| {
            let c = a.cache();
            c["cached_files"].as_u64().unwrap_or(0) >= files as u64
                && c["copying"].as_u64() == Some(0)
        });
        if done {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the caches were not warm within 600 s:\n{}",
                agents.iter().map(|a| a.log()).collect::<String>()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
