//! `cargo xtask bench slurm`: `import numpy, scipy, pandas` as an ordinary user's Slurm
//! job (`srun`), from a share with a realistic round trip, the page cache emptied every
//! second: from local disk (the same files, on the server's side), from the network with
//! hocus off (`--hocus=off`), and from the network with hocus's SPANK plugin (a plain
//! `srun`, nothing added). Each as a ratio to local disk, rounds interleaved, in one run
//! on a real one-node cluster. The daemon learns the working set from a first job.

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use hocus_tests::slurm::slurm;

use super::common::{
    EmptyingPageCache, agent_on_local_disk, median, network, numpy_packages, wait_for,
    write_figures,
};

/// Debian's interpreter: the test user's environment has no other.
const PYTHON: &str = "/usr/bin/python3";
const SCRIPT: &str = "import numpy, scipy, scipy.linalg, scipy.sparse, pandas";

pub fn slurm_imports(agent_bin: &Path, runs: usize, round_trip: Duration) -> Result<()> {
    super::common::for_slurm(agent_bin)?;
    let packages = numpy_packages()?;
    let cluster = slurm();
    let net = network(round_trip);
    let copied = Command::new("cp")
        .arg("-a")
        .arg(&packages)
        .arg(net.server_path("site"))
        .status()?;
    if !copied.success() {
        bail!("copying the packages to the server side failed");
    }
    let (local, remote) = (net.server_path("site"), net.path("site"));
    let (_disk, agent) = agent_on_local_disk(&net, &[]);
    cluster.plugin(Some(&format!("socket={}", agent.socket.display())));

    let job = |site: &Path, extra: &[&str]| -> Result<f64> {
        let mut args = vec!["--quiet"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&[PYTHON, "-c", SCRIPT]);
        let site = site.to_str().unwrap();
        let t = Instant::now();
        let out = cluster.as_user(
            "srun",
            &args,
            &[("PYTHONPATH", site), ("PYTHONDONTWRITEBYTECODE", "1")],
        );
        let s = t.elapsed().as_secs_f64();
        if !out.status.success() {
            bail!(
                "the job failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(s)
    };
    // The first job teaches the daemon the working set; the snapshot follows.
    job(&remote, &[])?;
    let what = format!("a snapshot of {}", remote.display());
    wait_for(&agent, 600, &what, || {
        agent.cache()["snapshots"]
            .as_array()
            .is_some_and(|s| s.iter().any(|p| p == remote.to_str().unwrap()))
    })?;
    agent.settled();

    println!(
        "\n{SCRIPT} as an ordinary user's srun job; {runs} rounds of each (median), interleaved; page cache emptied every second; network round trip {:.1} ms",
        round_trip.as_secs_f64() * 1000.0
    );
    let emptying = EmptyingPageCache::start();
    let (mut local_v, mut off_v, mut on_v) = (vec![], vec![], vec![]);
    for _ in 0..runs {
        local_v.push(job(&local, &["--hocus=off"])?);
        off_v.push(job(&remote, &["--hocus=off"])?);
        on_v.push(job(&remote, &[])?);
    }
    drop(emptying);
    let (local_s, off_s, on_s) = (median(&local_v), median(&off_v), median(&on_v));
    println!("\n{:<36} {:>9} {:>12}", "", "SECONDS", "VS LOCAL");
    for (name, s) in [
        ("srun, local disk", local_s),
        ("srun --hocus=off, network", off_s),
        ("srun, network, hocus's plugin", on_s),
    ] {
        println!("{name:<36} {s:>8.3}s {:>11.2}x", s / local_s);
    }
    let jobs = agent.cache()["slurm_jobs"].clone();
    let local_opens: u64 = jobs
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|j| j["served"]["opens_local"].as_u64())
        .sum();
    println!(
        "\nthe plugin's jobs: {local_opens} opens served by local copies (the daemon's per-job counts)"
    );
    write_figures(
        "slurm",
        &serde_json::json!({
            "runs": runs,
            "round_trip_ms": round_trip.as_secs_f64() * 1000.0,
            "local_seconds": local_s,
            "hocus_off_seconds": off_s,
            "hocus_on_seconds": on_s,
            "hocus_off_vs_local": off_s / local_s,
            "hocus_on_vs_local": on_s / local_s,
            "local_opens_of_the_plugins_jobs": local_opens,
        }),
    )
}
