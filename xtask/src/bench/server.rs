//! `cargo xtask bench server`: what the file server is asked, by its own count, when a
//! Slurm job imports a Python package of many modules on N nodes of a real multi-node
//! cluster on this machine: plainly (no daemon), and with every node's daemon warm (a
//! saved profile prefetched by an earlier job). Then what the warm daemons ask it while
//! no job runs. A model fitted to the points says what 1,024 nodes would cost.
//!
//! The server is sshfs's: its SFTP server logs every open, close, listing and stat by
//! path (its reads and the listings' pages are not logged: they are counted as bytes).
//! Each node's client keeps what it was told for a second (`dcache_timeout=1`, the
//! kernel's FUSE entry and attribute times): each round waits past that, so a plain
//! job's client starts cold, as a client of a server that does not answer from a cache
//! of its own would. The daemons' own counts by purpose (`status`) are shown beside.

use std::{
    collections::BTreeMap,
    fs,
    os::unix::fs::PermissionsExt,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use hocus_tests::{
    Agent, NetworkMount,
    slurm::{Node, Options, SERVER_ADDR, Slurm, slurm_with},
};

use super::common::{saved_profile, write_figures};

pub struct Server {
    /// Jobs on each of these many nodes (the cluster has the largest).
    pub nodes: Vec<usize>,
    /// The package: subpackages, and modules in each.
    pub subpackages: usize,
    pub modules: usize,
    /// How long the warm daemons are watched with no job running.
    pub idle: Duration,
}

impl Server {
    /// A smoke run (CI): one and three nodes, 4 x 8 modules, 10 s idle.
    pub fn quick() -> Self {
        Self {
            nodes: vec![1, 3],
            subpackages: 4,
            modules: 8,
            idle: Duration::from_secs(10),
        }
    }
}

const KEY: &str = "serverbench";
const PACKAGE: &str = "benchpkg";
const IMPORT: &str = "import benchpkg; print(benchpkg.COUNT)";
/// Past what every node's client keeps (1 s) and what a job-start check is reused for
/// on a node (1 s): each round starts cold for the client and for hocus.
const BETWEEN_ROUNDS: Duration = Duration::from_millis(2500);

/// Writes the package on the server's side: `benchpkg` importing each subpackage,
/// each importing its modules. Returns the number of modules.
fn package(net: &NetworkMount, subpackages: usize, modules: usize) -> usize {
    let subs: Vec<String> = (0..subpackages).map(|i| format!("s{i:02}")).collect();
    net.put(
        &format!("env/lib/{PACKAGE}/__init__.py"),
        format!(
            "from . import {}\nCOUNT = {}\n",
            subs.join(", "),
            1 + subpackages * (1 + modules)
        )
        .as_bytes(),
    );
    for sub in &subs {
        let mods: Vec<String> = (0..modules).map(|j| format!("m{j:03}")).collect();
        net.put(
            &format!("env/lib/{PACKAGE}/{sub}/__init__.py"),
            format!("from . import {}\n", mods.join(", ")).as_bytes(),
        );
        for m in &mods {
            // A module of a realistic size, all its own (a compiled file would be written
            // by the job: PYTHONDONTWRITEBYTECODE).
            let body: String = (0..40)
                .map(|k| format!("def f{k}(x):\n    return x * {k} + {}\n", m.len()))
                .collect();
            net.put(&format!("env/lib/{PACKAGE}/{sub}/{m}.py"), body.as_bytes());
        }
    }
    1 + subpackages * (1 + modules)
}

/// What the server was asked for paths under `rel` since its log was `before` long:
/// every logged request (open, close, listing, stat). Those lines are kept beside the
/// figures as `server-ROUND.log`, to see what was asked.
fn asked_inside(net: &NetworkMount, rel: &str, before: usize, round: &str) -> Result<u64> {
    let inside = format!("\"{}", net.server_path(rel).display());
    let log = net.server_log();
    let asked: Vec<&str> = log[before..]
        .lines()
        .filter(|l| l.contains(&inside))
        .collect();
    let dir = crate::host::target_dir().join("bench");
    fs::create_dir_all(&dir)?;
    fs::write(dir.join(format!("server-{round}.log")), asked.join("\n"))?;
    Ok(asked.len() as u64)
}

/// The daemons' own counts of operations on the network mount, by purpose.
fn counted(agents: &[Agent]) -> BTreeMap<String, u64> {
    let mut by = BTreeMap::new();
    for a in agents {
        for e in a.status()["server"].as_array().into_iter().flatten() {
            if let (Some(p), Some(n)) = (e["purpose"].as_str(), e["operations"].as_u64()) {
                *by.entry(p.to_owned()).or_insert(0) += n;
            }
        }
    }
    by
}

fn since(now: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    now.iter()
        .map(|(p, n)| (p.clone(), n - before.get(p).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// The entries node1's last job start checked against the server itself.
fn entries_checked(agent: &Agent) -> Option<u64> {
    let log = agent.log();
    let line = log.lines().rfind(|l| l.contains("job start: "))?;
    line.split(" entries checked")
        .next()?
        .split(' ')
        .next_back()?
        .parse()
        .ok()
}

/// Waits until every daemon has settled (each takes seconds to show it: at once).
fn settled(agents: &[Agent]) {
    std::thread::scope(|s| {
        for a in agents {
            s.spawn(|| a.settled());
        }
    });
}

/// Least squares of `y = a + b x`.
fn fit(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    let (sx, sy) = points
        .iter()
        .fold((0.0, 0.0), |(sx, sy), (x, y)| (sx + x, sy + y));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = points.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
    let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let b = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (my - b * mx, b)
}

struct Cluster<'a> {
    slurm: &'a Slurm,
    net: NetworkMount,
    args: Vec<String>,
}

impl Cluster<'_> {
    /// A fresh daemon on each of the first `n` nodes.
    fn daemons(&self, n: usize) -> Vec<Agent> {
        self.slurm.nodes[..n]
            .iter()
            .map(|node| self.daemon(node))
            .collect()
    }

    /// A fresh daemon on `node`: an empty cache.
    fn daemon(&self, node: &Node) -> Agent {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        self.slurm.agent_on(node, &args)
    }

    /// The import as the test user's job on the first `n` nodes; its seconds.
    fn job(&self, n: usize) -> Result<f64> {
        self.job_running(n, &["/usr/bin/python3", "-c", IMPORT])
    }

    /// `program` as the test user's job on the first `n` nodes; its seconds.
    fn job_running(&self, n: usize, program: &[&str]) -> Result<f64> {
        let names: Vec<String> = (1..=n).map(|i| format!("node{i}")).collect();
        let lib = self.net.path("env/lib");
        let started = Instant::now();
        let out = self.slurm.as_user(
            "srun",
            &[
                "--quiet",
                &format!("--nodelist={}", names.join(",")),
                &format!("--nodes={n}"),
                &format!("--hocus-profile={KEY}"),
            ]
            .into_iter()
            .chain(program.iter().copied())
            .collect::<Vec<_>>(),
            &[
                ("PYTHONPATH", lib.to_str().unwrap()),
                ("PYTHONDONTWRITEBYTECODE", "1"),
            ],
        );
        let seconds = started.elapsed().as_secs_f64();
        if !out.status.success() {
            bail!(
                "the job on {n} nodes failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(seconds)
    }

    /// The import as a job array of `tasks` one-node tasks (`sbatch --array`), a node
    /// each, none on node `exclude`; its seconds.
    fn array(&self, tasks: usize, exclude: &str) -> Result<f64> {
        let dir = tempfile::Builder::new()
            .prefix("hocus-array-")
            .tempdir_in("/tmp")?;
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755))?;
        let script = dir.path().join("task.sh");
        fs::write(
            &script,
            format!("#!/bin/sh\nexec /usr/bin/python3 -c '{IMPORT}'\n"),
        )?;
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755))?;
        let lib = self.net.path("env/lib");
        let started = Instant::now();
        let out = self.slurm.as_user(
            "sbatch",
            &[
                "--wait",
                "--quiet",
                &format!("--array=0-{}", tasks - 1),
                "--nodes=1",
                "--exclusive",
                &format!("--exclude={exclude}"),
                &format!("--hocus-profile={KEY}"),
                "-o",
                "/dev/null",
                script.to_str().unwrap(),
            ],
            &[
                ("PYTHONPATH", lib.to_str().unwrap()),
                ("PYTHONDONTWRITEBYTECODE", "1"),
            ],
        );
        let seconds = started.elapsed().as_secs_f64();
        if !out.status.success() {
            bail!(
                "the {tasks}-task array failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(seconds)
    }
}

/// The bytes of the package's files on the server: its working set.
fn working_set(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => working_set(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// The node the saved profile names as holding its files (the last epilog that saved it).
fn holder_of(profiles: &Path) -> Option<String> {
    let saved = profiles.join(format!("hocus-test/{KEY}.json"));
    let profile: serde_json::Value = serde_json::from_slice(&fs::read(saved).ok()?).ok()?;
    profile["holder"]["node"].as_str().map(str::to_owned)
}

pub fn server(agent_bin: &Path, s: &Server) -> Result<()> {
    super::common::for_slurm(agent_bin)?;
    let most = s.nodes.iter().copied().max().context("no node counts")?;
    if most < 2 {
        bail!("a job array needs at least 2 nodes: give --nodes up to 2 or more");
    }
    let slurm = slurm_with(Options {
        nodes: most.max(2),
        ..Options::default()
    });
    let holder = slurm.server.context("a server namespace")?;
    let net = NetworkMount::start_serving_from(holder, SERVER_ADDR);
    let modules = package(&net, s.subpackages, s.modules);
    net.installed_long_ago("env");
    for node in &slurm.nodes {
        net.mount_in_namespace_of(node.holder, &net.mount);
    }
    let profiles = tempfile::Builder::new()
        .prefix("hocus-profiles-")
        .tempdir_in("/var/tmp")?;
    fs::set_permissions(profiles.path(), fs::Permissions::from_mode(0o1777))?;
    let c = Cluster {
        slurm,
        args: vec![
            "--watch".into(),
            net.mount.to_str().unwrap().into(),
            "--job-profiles".into(),
            format!("{}/{{user}}", profiles.path().display()),
        ],
        net,
    };
    c.slurm.plugin(Some(""));
    println!(
        "\n`import {PACKAGE}` ({modules} modules) as a job on N nodes; the server's count of what it was asked (opens, closes, listings, stats) under the package's tree"
    );

    // Plain: no daemon on any node.
    let mut plain = Vec::new();
    for &n in &s.nodes {
        std::thread::sleep(BETWEEN_ROUNDS);
        let before = c.net.server_log().len();
        let seconds = c.job(n)?;
        plain.push((
            n,
            asked_inside(&c.net, "env", before, &format!("plain-{n}"))?,
            seconds,
        ));
    }

    // A job array of a task per node but node1's, each a node of its own: plainly, each
    // task reads the working set from the server.
    let tasks = most - 1;
    let working_set = working_set(&c.net.server_path(&format!("env/lib/{PACKAGE}")));
    std::thread::sleep(BETWEEN_ROUNDS);
    let before = c.net.server_log().len();
    let plain_array_s = c.array(tasks, "node1")?;
    let plain_array = (
        c.net.bytes_served_inside("env", before),
        asked_inside(&c.net, "env", before, "plain-array")?,
    );

    // A first job learns the working set; its epilog saves the profile.
    {
        let _learning = c.daemons(1);
        c.job(1)?;
        saved_profile(profiles.path(), KEY)?;
    }
    // Fresh daemons on every node, warmed by a job whose prologs prefetch the profile
    // (the nodes passing it among themselves).
    let agents = c.daemons(most);
    std::thread::sleep(BETWEEN_ROUNDS);
    let before = c.net.server_log().len();
    c.job(most)?;
    settled(&agents);
    let warming = asked_inside(&c.net, "env", before, "warming")?;

    // Warm: each round a job on the first n nodes, every daemon settled after it.
    let mut warm = Vec::new();
    for &n in &s.nodes {
        std::thread::sleep(BETWEEN_ROUNDS);
        let (before, counted_before) = (c.net.server_log().len(), counted(&agents));
        let seconds = c.job(n)?;
        settled(&agents);
        let asked = asked_inside(&c.net, "env", before, &format!("hocus-{n}"))?;
        let by = since(&counted(&agents), &counted_before);
        warm.push((n, asked, seconds, by, entries_checked(&agents[0])));
    }

    // The same user's next job on one node: what they may read was found for the same
    // copies (docs/fanout.md, "The same user's next job").
    std::thread::sleep(BETWEEN_ROUNDS);
    let (before, counted_before) = (c.net.server_log().len(), counted(&agents));
    c.job(1)?;
    settled(&agents);
    let next = (
        asked_inside(&c.net, "env", before, "hocus-1-next")?,
        since(&counted(&agents), &counted_before),
        entries_checked(&agents[0]),
    );

    // What each daemon did, beside the figures.
    for (agent, node) in agents.iter().zip(&c.slurm.nodes) {
        fs::write(
            crate::host::target_dir().join(format!("bench/server-{}-daemon.log", node.name)),
            agent.log(),
        )?;
    }

    // Idle: no job running, every cache warm.
    let (before, counted_before) = (c.net.server_log().len(), counted(&agents));
    std::thread::sleep(s.idle);
    let idle = asked_inside(&c.net, "env", before, "idle")?;
    let idle_by = since(&counted(&agents), &counted_before);
    let idle_per_node_minute = idle as f64 / most as f64 / (s.idle.as_secs_f64() / 60.0);

    // The server stops answering as a job starts on every node (issue 52, step 7): each
    // node's start binds nothing unconfirmed, within its bound; once the server answers
    // again, the next job's starts bind their copies.
    std::thread::sleep(BETWEEN_ROUNDS);
    let silent = {
        let paused = c.net.pause_server();
        let seconds = c.job_running(most, &["/bin/true"])?;
        let starts: Vec<(u64, f64)> = agents.iter().map(Agent::last_start_bound).collect();
        drop(paused);
        std::thread::sleep(BETWEEN_ROUNDS);
        c.job(most)?;
        settled(&agents);
        let after: Vec<u64> = agents.iter().map(|a| a.last_start_bound().0).collect();
        (seconds, starts, after)
    };

    // The same array on nodes that never ran the job (fresh daemons, empty caches) but
    // for the node the saved profile names as holding its files: their prologs take the
    // copies from it (docs/fanout.md). Once as the plugin's defaults have it (the prolog
    // waits 5 s for the prefetch, then the job starts and reads what is not there yet
    // from the server), once waiting for the whole prefetch.
    let mut agents = agents;
    let mut hocus_arrays = Vec::new();
    for (round, plugin) in [
        ("hocus-array", ""),
        ("hocus-array-waited", "prefetch_timeout=300"),
    ] {
        // The last epilog that saved the profile (a task of the round before) names it.
        let holder = holder_of(profiles.path()).context("the saved profile names no holder")?;
        agents = agents
            .into_iter()
            .zip(&c.slurm.nodes)
            .map(|(agent, node)| {
                if node.name == holder {
                    return agent;
                }
                // Its port and socket free before the fresh one takes them.
                drop(agent);
                c.daemon(node)
            })
            .collect();
        c.slurm.plugin(Some(plugin));
        std::thread::sleep(BETWEEN_ROUNDS);
        let before = c.net.server_log().len();
        let seconds = c.array(tasks, &holder)?;
        settled(&agents);
        hocus_arrays.push((
            c.net.bytes_served_inside("env", before),
            asked_inside(&c.net, "env", before, round)?,
            seconds,
            holder,
        ));
        for (agent, node) in agents.iter().zip(&c.slurm.nodes) {
            let log = format!("bench/server-{}-{round}-daemon.log", node.name);
            fs::write(crate::host::target_dir().join(log), agent.log())?;
        }
    }
    c.slurm.plugin(Some(""));

    println!(
        "\n{:>3} {:>14} {:>9} {:>14} {:>9} {:>12}   DAEMONS' OWN COUNT",
        "N", "PLAIN: ASKED", "SECONDS", "HOCUS: ASKED", "SECONDS", "HOCUS/PLAIN"
    );
    let mut rows = Vec::new();
    for ((n, p_asked, p_s), (_, h_asked, h_s, by, _)) in plain.iter().zip(&warm) {
        println!(
            "{n:>3} {p_asked:>14} {p_s:>8.2}s {h_asked:>14} {h_s:>8.2}s {:>11.2}x   {by:?}",
            *h_asked as f64 / (*p_asked).max(1) as f64
        );
        rows.push(serde_json::json!({
            "nodes": n,
            "plain_asked": p_asked,
            "plain_seconds": p_s,
            "hocus_asked": h_asked,
            "hocus_seconds": h_s,
            "hocus_counted": by,
        }));
    }
    let one = warm.iter().find(|w| w.0 == 1);
    let bound = one.and_then(|w| w.4);
    if let (Some(one), Some(bound)) = (one, bound) {
        println!(
            "\nA warm job start on one node: {} asked for {bound} entries bound ({:.2} a bound entry; goal <= 1); the cold plain import on one node: {} ({:.0}%; goal <= 35%)",
            one.1,
            one.1 as f64 / bound.max(1) as f64,
            plain[0].1,
            one.1 as f64 * 100.0 / plain[0].1.max(1) as f64,
        );
        println!(
            "The same user's next job start on one node: {} asked ({:.2} a bound entry); the daemons counted {:?}",
            next.0,
            next.0 as f64 / next.2.or(Some(bound)).unwrap_or(1).max(1) as f64,
            next.1
        );
        if let Some(last) = warm.last().filter(|w| w.0 > 1) {
            println!(
                "A warm job start on {} nodes: {:.2}x one node's (goal <= 1.2x)",
                last.0,
                last.1 as f64 / one.1.max(1) as f64
            );
        }
    }
    let share = |bytes: u64| bytes as f64 / working_set.max(1) as f64;
    println!(
        "A {tasks}-task job array, a node each but the one the saved profile names, on fresh daemons, the {working_set}-byte working set (goal: the server sends <= 1.2x):\n  \
         plain:                               {:>10} bytes ({:.2}x) in {plain_array_s:.2} s, asked {}",
        plain_array.0,
        share(plain_array.0),
        plain_array.1,
    );
    for ((bytes, asked, seconds, holder), how) in hocus_arrays.iter().zip([
        "hocus, the prolog waits 5 s:        ",
        "hocus, the prolog waits the prefetch:",
    ]) {
        println!(
            "  {how} {bytes:>10} bytes ({:.2}x) in {seconds:.2} s, asked {asked} (held by {holder})",
            share(*bytes)
        );
    }
    let (silent_s, starts, after) = &silent;
    let slowest = starts.iter().map(|s| s.1).fold(0.0, f64::max);
    println!(
        "The server silent as a job starts on {most} nodes: {} of {most} starts bound nothing unconfirmed ({} copies bound in all), the slowest check {slowest:.0} ms (bound: 2 s), the job {silent_s:.2} s; answering again, the next job's starts bound {} copies on {} of {most} nodes",
        starts.iter().filter(|s| s.0 == 0).count(),
        starts.iter().map(|s| s.0).sum::<u64>(),
        after.iter().sum::<u64>(),
        after.iter().filter(|&&n| n > 0).count(),
    );
    println!(
        "Warming {most} fresh daemons from the saved profile (the prolog's prefetch, passed node to node): {warming} asked"
    );
    println!(
        "Idle, every cache warm, no job: {idle} asked in {:.0} s by {most} daemons, {idle_per_node_minute:.1} a node a minute (goal <= 10); the daemons counted {idle_by:?}",
        s.idle.as_secs_f64()
    );

    // The model: asked = a + b N, fitted to each column.
    let points = |f: &dyn Fn(usize) -> u64| -> Vec<(f64, f64)> {
        (0..s.nodes.len())
            .map(|i| (s.nodes[i] as f64, f(i) as f64))
            .collect()
    };
    let (pa, pb) = fit(&points(&|i| plain[i].1));
    let (ha, hb) = fit(&points(&|i| warm[i].1));
    let at = |a: f64, b: f64, n: f64| a + b * n;
    println!(
        "\nModel, asked = a + b N (least squares of the rows): plain {pa:.0} + {pb:.1} N, hocus {ha:.0} + {hb:.1} N.\n\
         At 1,024 nodes: plain {:.0}, hocus {:.0} ({:.3}x). It assumes what the rows show \
         holds on: each node's plain import asks the server alone; with hocus the relay \
         tree's root checks the copies once and each other node adds only its binds' own \
         lookups (a constant per bind, not per entry); a parent's verdict comes within 1 s \
         (tree depth log8 N: 4 levels at 1,024 nodes, each a round trip on the nodes' \
         network, not the server); no node's copies are stale.",
        at(pa, pb, 1024.0),
        at(ha, hb, 1024.0),
        at(ha, hb, 1024.0) / at(pa, pb, 1024.0).max(1.0),
    );
    write_figures(
        "server",
        &serde_json::json!({
            "modules": modules,
            "rows": rows,
            "entries_bound_one_node": bound,
            "next_one_node": {"asked": next.0, "counted": next.1, "entries_bound": next.2},
            "silent_server": {
                "job_seconds": silent.0,
                "starts": silent.1.iter().map(|(bound, ms)| serde_json::json!({"bound": bound, "ms": ms})).collect::<Vec<_>>(),
                "bound_after": silent.2,
            },
            "warming_asked": warming,
            "array": {
                "tasks": tasks,
                "working_set_bytes": working_set,
                "plain": {"bytes": plain_array.0, "asked": plain_array.1, "seconds": plain_array_s},
                "hocus": {"bytes": hocus_arrays[0].0, "asked": hocus_arrays[0].1, "seconds": hocus_arrays[0].2},
                "hocus_prefetch_waited": {"bytes": hocus_arrays[1].0, "asked": hocus_arrays[1].1, "seconds": hocus_arrays[1].2},
            },
            "idle_asked": idle,
            "idle_seconds": s.idle.as_secs_f64(),
            "idle_per_node_minute": idle_per_node_minute,
            "idle_counted": idle_by,
            "model": {
                "plain": {"a": pa, "b": pb, "at_1024": at(pa, pb, 1024.0)},
                "hocus": {"a": ha, "b": hb, "at_1024": at(ha, hb, 1024.0)},
            },
        }),
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_model_is_the_least_squares_line() {
        let (a, b) = super::fit(&[(1.0, 5.0), (2.0, 7.0), (4.0, 11.0)]);
        assert!((a - 3.0).abs() < 1e-9 && (b - 2.0).abs() < 1e-9, "{a} {b}");
        let (a, b) = super::fit(&[(3.0, 9.0)]);
        assert!((a - 9.0).abs() < 1e-9 && b == 0.0, "{a} {b}");
    }
}
