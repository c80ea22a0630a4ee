//! `cargo xtask bench imports`: Python programs users run (imports of numpy, scipy and
//! pandas; JAX with its compilation cache; a whole scientific environment), from a share
//! with a realistic round trip, plainly and under hocus, against local disk, in one run.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use hocus_tests::{Agent, NetworkMount};

use super::common::{
    BusyCores, Daemon, EmptyingPageCache, agent_on_local_disk, drop_caches, median, network,
    numpy_packages, request_kinds, write_figures,
};
use crate::host;

/// `cargo xtask bench imports`: `import numpy, scipy, pandas` from a directory on a real
/// network mount, with the page cache emptied once a second during the runs (the
/// misbehaving node): from local disk (the same files, on the server's side), plain from
/// the network, warm (again right away), and under `hocus-agent run`, each as a ratio to
/// local disk, in the same run. The goal is within 1.2x of local disk. A `smoke` run
/// (CI's) leaves out what only compares: the whole tree's copy and the warm network.
pub fn imports(
    agent_bin: &Path,
    runs: usize,
    round_trip: Duration,
    only: &[ImportCase],
    smoke: bool,
) -> Result<()> {
    if !host::is_root() {
        bail!("the benchmark mounts filesystems and loads eBPF programs: run it as root");
    }
    // SAFETY: single-threaded at this point.
    unsafe { std::env::set_var("HOCUS_AGENT_BIN", agent_bin) };
    let wanted =
        |c: ImportCase| only.contains(&c) || (only.is_empty() && c != ImportCase::Environment);
    let net = network(round_trip);
    let mut cases = Vec::new();
    if wanted(ImportCase::Numpy) {
        let case = Case {
            name: "import numpy, scipy, pandas",
            packages: numpy_packages()?,
            site: "site",
            script: "import numpy, scipy, scipy.linalg, scipy.sparse, pandas",
            env: &[],
            whole_tree_goal: false,
        };
        cases.push(run_case(&net, runs, round_trip, &case, smoke)?);
    }
    if wanted(ImportCase::Jax) {
        let case = Case {
            name: "import jax, then three jitted functions from its persistent cache on the share",
            packages: hocus_tests::jax_packages(),
            site: "jaxsite",
            script: JAX_SCRIPT,
            env: &[("JAX_PLATFORMS", "cpu")],
            whole_tree_goal: false,
        };
        cases.push(run_case(&net, runs, round_trip, &case, smoke)?);
    }
    if wanted(ImportCase::Environment) {
        let case = Case {
            name: "import numpy, scipy.stats, pandas from a whole scientific environment",
            packages: hocus_tests::python_packages(
                "scientific-environment",
                &[
                    "numpy",
                    "scipy",
                    "pandas",
                    "scikit-learn",
                    "matplotlib",
                    "sympy",
                    "statsmodels",
                    "jupyterlab",
                    "networkx",
                    "dask",
                    "distributed",
                    "bokeh",
                    "numba",
                ],
            ),
            site: "envsite",
            script: "import numpy, scipy.stats, pandas",
            env: &[],
            whole_tree_goal: true,
        };
        cases.push(run_case(&net, runs, round_trip, &case, smoke)?);
    }
    write_figures(
        "imports",
        &serde_json::json!({
            "runs": runs,
            "round_trip_ms": round_trip.as_secs_f64() * 1000.0,
            "cases": cases,
        }),
    )
}

/// A cold prefetch of `profile` by a fresh daemon (`extra` its options) on a disk of its
/// own, caches emptied: its seconds, and the machine's busy time meanwhile
/// (`BusyCores::seconds`).
/// The snapshot of `remote` must be in place after it.
fn cold_prefetch(
    net: &NetworkMount,
    extra: &[&str],
    profile: &Path,
    remote: &Path,
) -> Result<(f64, (f64, f64), Daemon)> {
    let (disk, a) = agent_on_local_disk(net, extra);
    drop_caches()?;
    let log_before = net.server_log().len();
    let busy = BusyCores::start();
    let t = Instant::now();
    let warmed = a
        .cli(&["prefetch", "--profile", profile.to_str().unwrap()])
        .output()?;
    let (seconds, busy) = (t.elapsed().as_secs_f64(), busy.seconds(t.elapsed()));
    if !warmed.status.success() {
        bail!(
            "prefetching failed: {}",
            String::from_utf8_lossy(&warmed.stderr)
        );
    }
    if !a.cache()["snapshots"]
        .as_array()
        .is_some_and(|s| s.iter().any(|p| p == remote.to_str().unwrap()))
    {
        bail!(
            "no snapshot of {} after the prefetch:\n{}",
            remote.display(),
            a.log()
        );
    }
    if std::env::var_os("HOCUS_BENCH_LOG").is_some() {
        println!(
            "the server's requests during the prefetch: {:?}",
            request_kinds(&net.server_log()[log_before..])
        );
    }
    Ok((seconds, busy, (disk, a)))
}

/// The programs of the imports benchmark.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum ImportCase {
    /// `import numpy, scipy, pandas`.
    Numpy,
    /// `import jax` and three functions from its compilation cache.
    Jax,
    /// `import numpy, scipy.stats, pandas` from a whole scientific environment (1.1 GB,
    /// ~41k entries: scikit-learn, matplotlib, sympy, statsmodels, jupyterlab, dask,
    /// numba beside them), as users keep one on a share: the working set is a tenth of
    /// the tree. Not run unless asked (`--only environment`): it installs ~1 GB once.
    Environment,
}

/// One program of the imports benchmark: its packages are copied to the share at
/// `site`; it may write in `<site>-data` beside them.
struct Case {
    name: &'static str,
    packages: PathBuf,
    site: &'static str,
    script: &'static str,
    env: &'static [(&'static str, &'static str)],
    /// Whether the goal of 10x less than copying the whole tree applies: a working set
    /// a small part of its tree (a whole environment), not packages most of which it
    /// uses.
    whole_tree_goal: bool,
}

/// JAX with its persistent compilation cache beside its packages (on the share, or on
/// local disk for the local case): the first run fills it, the others read it.
const JAX_SCRIPT: &str = r#"
import os, jax, jax.numpy as jnp
site = os.environ['PYTHONPATH']
jax.config.update('jax_compilation_cache_dir', site + '-data')
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
x = jnp.arange(8.0)
for f in (lambda v: jnp.sin(v) * 2, lambda v: jnp.cos(v) + v, lambda v: (v ** 2).sum()):
    jax.block_until_ready(jax.jit(f)(x))
"#;

fn run_case(
    net: &NetworkMount,
    runs: usize,
    round_trip: Duration,
    case: &Case,
    smoke: bool,
) -> Result<serde_json::Value> {
    let copied = std::process::Command::new("cp")
        .arg("-a")
        .arg(&case.packages)
        .arg(net.server_path(case.site))
        .status()?;
    if !copied.success() {
        bail!("copying the packages to the server side failed");
    }
    // Beside the packages: a directory the case may write (JAX's compilation cache).
    std::fs::create_dir_all(net.server_path(&format!("{}-data", case.site)))?;
    let local = net.server_path(case.site);
    let remote = net.path(case.site);
    let script = case.script;

    // Empty the page cache once a second while the runs go on.
    let emptying = EmptyingPageCache::start();
    let time = |cmd: &mut std::process::Command| -> Result<f64> {
        let t = Instant::now();
        let out = cmd.output()?;
        if !out.status.success() {
            bail!(
                "the import failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(t.elapsed().as_secs_f64())
    };
    let python = |path: &Path| {
        let mut c = std::process::Command::new("python3");
        c.args(["-c", script])
            .env("PYTHONPATH", path)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .envs(case.env.iter().copied())
            .current_dir("/");
        c
    };
    let runs_of = |f: &mut dyn FnMut() -> Result<f64>| -> Result<f64> {
        let mut v = Vec::new();
        for _ in 0..runs {
            v.push(f()?);
        }
        Ok(median(&v))
    };
    println!(
        "\n{}; {runs} rounds of each (median), interleaved; page cache emptied every second; network round trip {:.1} ms",
        case.name,
        round_trip.as_secs_f64() * 1000.0
    );
    let local_alone_s = runs_of(&mut || time(&mut python(&local)))?;
    // Default revalidation (30 s): re-checking a big snapshot against the network costs
    // a walk of the tree, which a shorter interval would add to every run.
    // A first daemon learns the working set; the one measured starts with an empty
    // cache and warms it from the exported profile, caches emptied: a cold prefetch.
    let learner = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    time(&mut python(&remote))?;
    let profile_dir = tempfile::tempdir()?;
    let profile = profile_dir.path().join("imports.json");
    let exported = learner
        .cli(&[
            "profile",
            "export",
            "--root",
            remote.to_str().unwrap(),
            "--out",
            profile.to_str().unwrap(),
        ])
        .output()?;
    drop(learner);
    if !exported.status.success() {
        bail!(
            "exporting the profile failed: {}",
            String::from_utf8_lossy(&exported.stderr)
        );
    }
    // The baseline: reading just the working set's files, 8 readers in parallel.
    let working_set: Vec<(PathBuf, u64)> = {
        let p: serde_json::Value = serde_json::from_slice(&std::fs::read(&profile)?)?;
        p["files"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|f| Some((PathBuf::from(f["path"].as_str()?), f["size"].as_u64()?)))
            .collect()
    };
    // Rounds of a cold prefetch (a daemon with an empty cache of its own, page cache
    // emptied) and of the readers, interleaved: the machine's background is shared.
    // The baseline of what hocus did before snapshots were lazy: the whole tree copied
    // (a whole snapshot), once, before any other daemon runs (it would see the copies).
    let whole_s = match smoke {
        true => None,
        false => {
            let (whole_s, _, (disk, whole)) =
                cold_prefetch(net, &["--whole-snapshots"], &profile, &remote)?;
            // The daemon before its disk (a tuple would drop the disk first: busy).
            drop(whole);
            drop(disk);
            Some(whole_s)
        }
    };
    let (mut prefetch_v, mut parallel_v, mut agent) = (vec![], vec![], None);
    // With the cores the machine kept busy meanwhile: on a fixture where client, server,
    // encryption and the delaying proxy share the machine, both may be bound by CPU.
    let (mut prefetch_busy_v, mut parallel_busy_v) = (vec![], vec![]);
    for _ in 0..runs {
        // The daemon before its disk: the disk is unmounted when dropped.
        if let Some((disk, a)) = agent.take() {
            drop(a);
            drop(disk);
        }
        let (seconds, busy, (disk, a)) = cold_prefetch(net, &[], &profile, &remote)?;
        prefetch_v.push(seconds);
        prefetch_busy_v.push(busy);
        drop_caches()?;
        let busy = BusyCores::start();
        let t = Instant::now();
        read_in_parallel(&working_set, 8);
        parallel_v.push(t.elapsed().as_secs_f64());
        parallel_busy_v.push(busy.seconds(t.elapsed()));
        agent = Some((disk, a));
    }
    let (_disk, agent) = agent.expect("at least one round");
    let (prefetch_s, parallel_s) = (median(&prefetch_v), median(&parallel_v));
    let busy = |v: &[(f64, f64)]| median(&v.iter().map(|(b, s)| b / s).collect::<Vec<_>>());
    let (prefetch_busy, parallel_busy) = (busy(&prefetch_busy_v), busy(&parallel_busy_v));
    let tree_bytes: u64 = walk_bytes(&local);
    let c = agent.cache();
    let held = c["cached_bytes"].as_u64().unwrap_or(0) + c["snapshot_bytes"].as_u64().unwrap_or(0);
    let ws_bytes: u64 = working_set.iter().map(|(_, s)| s).sum();
    println!(
        "\ncold prefetch of the working set ({} files, {:.1} MiB; the tree {:.1} MiB), median of {runs}: {prefetch_s:.2} s, {:.2}x reading those files with 8 parallel readers ({parallel_s:.2} s; goal <= 1.5x: {}); {:.1} MiB copied, {:.1}x less than the tree",
        working_set.len(),
        ws_bytes as f64 / 1048576.0,
        tree_bytes as f64 / 1048576.0,
        prefetch_s / parallel_s,
        if prefetch_s / parallel_s <= 1.5 {
            "met"
        } else {
            "not met"
        },
        held as f64 / 1048576.0,
        tree_bytes as f64 / held.max(1) as f64,
    );
    println!(
        "the machine's {} cores were {prefetch_busy:.2} busy during the prefetch, {parallel_busy:.2} during the readers",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    if let Some(whole_s) = whole_s {
        let whole_goal = match (case.whole_tree_goal, whole_s / prefetch_s >= 10.0) {
            (false, _) => "the goal of >= 10x is for a whole environment: --only environment",
            (true, true) => "goal >= 10x: met",
            (true, false) => "goal >= 10x: not met",
        };
        println!(
            "copying the whole tree (a whole snapshot, what hocus did before), once: {whole_s:.2} s; the cold prefetch takes {:.1}x less ({whole_goal})",
            whole_s / prefetch_s,
        );
    }
    // Rounds: each condition once per round, so they share the machine's background.
    let (mut local_v, mut plain_v, mut warm_v, mut hocus_v) = (vec![], vec![], vec![], vec![]);
    for _ in 0..runs {
        local_v.push(time(&mut python(&local))?);
        plain_v.push(time(&mut python(&remote))?);
        if !smoke {
            warm_v.push(time(&mut python(&remote))?);
        }
        let mut cmd = agent.cli(&["run", "--", "python3", "-c", script]);
        cmd.env("PYTHONPATH", &remote)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .envs(case.env.iter().copied())
            .current_dir("/");
        let log_before = net.server_log().len();
        hocus_v.push(time(&mut cmd)?);
        if std::env::var_os("HOCUS_BENCH_LOG").is_some() {
            // What a job under `run` asked the server, its start's check included.
            println!(
                "the server's requests during a job under run: {:?}",
                request_kinds(&net.server_log()[log_before..])
            );
        }
    }
    let (local_s, plain_s, hocus_s) = (median(&local_v), median(&plain_v), median(&hocus_v));
    let warm_s = (!warm_v.is_empty()).then(|| median(&warm_v));
    drop(emptying);
    println!("\n{:<28} {:>9} {:>12}", "", "SECONDS", "VS LOCAL");
    for (name, s) in [
        ("local disk, no daemon", Some(local_alone_s)),
        ("local disk", Some(local_s)),
        ("network, plain", Some(plain_s)),
        ("network, warm", warm_s),
        ("network, hocus-agent run", Some(hocus_s)),
    ] {
        match s {
            Some(s) => println!("{name:<28} {s:>8.3}s {:>11.2}x", s / local_s),
            None => println!("{name:<28} {:>9} (not in a smoke run)", "-"),
        }
    }
    // What checking a job's copies against the network adds to its start (the daemon
    // logs it for each job).
    let mut checks: Vec<f64> = agent
        .log()
        .lines()
        .filter_map(|l| {
            let rest = l.split("confirmed against the network in ").nth(1)?;
            rest.split(" ms").next()?.parse().ok()
        })
        .collect();
    checks.sort_by(f64::total_cmp);
    if let Some(m) = checks.get(checks.len() / 2) {
        println!(
            "\njob start: checking the copies against the network took {m:.1} ms (median of {} jobs; goal <= 300 ms)",
            checks.len()
        );
    }
    let c = agent.cache();
    println!(
        "\nhocus held {} as a snapshot; {} pinned in RAM. Goal: within 1.2x of local disk: {}",
        remote.display(),
        c["pinned_bytes"].as_u64().unwrap_or(0),
        if hocus_s / local_s <= 1.2 {
            "met"
        } else {
            "not met"
        }
    );
    if std::env::var_os("HOCUS_BENCH_LOG").is_some() {
        println!("\n--- the daemon's log ---\n{}", agent.log());
    }
    Ok(serde_json::json!({
        "case": case.name,
        "working_set_files": working_set.len(),
        "working_set_bytes": ws_bytes,
        "tree_bytes": tree_bytes,
        "held_bytes": held,
        "prefetch_seconds": prefetch_s,
        "parallel_readers_seconds": parallel_s,
        "prefetch_rounds_seconds": prefetch_v,
        "parallel_readers_rounds_seconds": parallel_v,
        "prefetch_vs_readers": prefetch_s / parallel_s,
        "whole_tree_seconds": whole_s,
        "whole_tree_vs_prefetch": whole_s.map(|w| w / prefetch_s),
        "prefetch_busy_cores": prefetch_busy,
        "parallel_readers_busy_cores": parallel_busy,
        "local_alone_seconds": local_alone_s,
        "local_seconds": local_s,
        "plain_seconds": plain_s,
        "warm_seconds": warm_s,
        "hocus_run_seconds": hocus_s,
        "hocus_run_vs_local": hocus_s / local_s,
        "job_start_check_ms": checks.get(checks.len() / 2),
    }))
}

/// Reads every file of `files` to its end, `readers` at a time.
fn read_in_parallel(files: &[(PathBuf, u64)], readers: usize) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..readers {
            s.spawn(|| {
                let mut buf = vec![0u8; 1 << 20];
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some((path, _)) = files.get(i) else { break };
                    if let Ok(mut f) = std::fs::File::open(path) {
                        while matches!(std::io::Read::read(&mut f, &mut buf), Ok(n) if n > 0) {}
                    }
                }
            });
        }
    });
}

/// The bytes of the regular files under `dir`.
fn walk_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => walk_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}
