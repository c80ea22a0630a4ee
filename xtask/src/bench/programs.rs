//! `cargo xtask bench overhead`'s second case: what the daemon costs programs nobody
//! here wrote, on data it does not watch (issue 36): `git status --ignored` over this
//! checkout and its build tree, `du -s /usr`, `find /usr/lib -name "*.py"`, and
//! `tar -cf - /usr/share/doc | wc -c`. Their CPU seconds (user + system, of the whole
//! pipeline: steadier than wall time on these machines) are measured with no daemon,
//! and with the daemon while a job runs whose reads it serves from its cache, in its
//! steady state, in both of its modes: watching a FUSE mount (its tripwire sees exactly
//! the requests that reach the server, so the tracer rests while the served job runs)
//! and watching a local directory (no tripwire: every process is followed all along,
//! the mode Lustre and GPFS get). Conditions are interleaved round by round; the ratios
//! are of medians measured in this run.

use std::{
    io::Write,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use hocus_tests::{Agent, NetworkMount};

use super::common::{median, wait_for};

/// The programs, as `sh -c` scripts (`{repo}`: this checkout).
const PROGRAMS: [(&str, &str); 4] = [
    (
        "git status --ignored",
        "git -C {repo} status --ignored --porcelain >/dev/null",
    ),
    ("du -s /usr", "du -s /usr >/dev/null"),
    (
        "find /usr/lib -name '*.py'",
        "find /usr/lib -name '*.py' >/dev/null",
    ),
    (
        "tar -cf - /usr/share/doc | wc -c",
        "tar -cf - /usr/share/doc 2>/dev/null | wc -c >/dev/null",
    ),
];

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    None,
    /// Watching the FUSE mount, a job served from the cache running.
    Fuse,
    /// Watching a local directory, a job served from the cache running.
    Local,
}

const MODES: [(Mode, &str); 3] = [
    (Mode::None, "no daemon"),
    (Mode::Fuse, "daemon on a FUSE mount, a served job running"),
    (
        Mode::Local,
        "daemon on a local directory (every process), a served job running",
    ),
];

/// CPU seconds (user + system) of this process's waited-for children so far.
fn children_cpu() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru);
        ru
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(ru.ru_utime) + secs(ru.ru_stime)
}

/// Runs `script` and returns its CPU seconds and wall seconds.
fn measure(script: &str) -> Result<(f64, f64)> {
    let before = children_cpu();
    let t = Instant::now();
    let status = Command::new("sh")
        .args(["-c", script])
        .stdin(Stdio::null())
        .status()
        .with_context(|| format!("running {script}"))?;
    let wall = t.elapsed().as_secs_f64();
    if !status.success() {
        bail!("`{script}` failed ({status})");
    }
    Ok((children_cpu() - before, wall))
}

/// Seconds with nothing to learn after which the daemons here rest (the least allowed):
/// the steady state is what is measured, reached sooner.
const REST_AFTER: &str = "5";

/// A daemon watching `watch`, with a job running whose read of `file` (under `watch`)
/// it served from its cache, in its steady state: resting, where the tree's tripwire
/// allows it while jobs run (`at_rest`). The job ends when its stdin is closed.
fn served_job(watch: &Path, file: &Path, at_rest: bool) -> Result<(Agent, Child)> {
    let agent = Agent::start(&[
        "--watch",
        watch.to_str().unwrap(),
        "--rest-after",
        REST_AFTER,
    ]);
    // Learned (read by a process using the tree), then copied.
    std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let cached = format!("a copy of {}", file.display());
    wait_for(&agent, 60, &cached, || {
        agent.settled()["cached_files"].as_u64() >= Some(1)
    })?;
    let jobs = || {
        agent.status()["cache"]["jobs_started"]
            .as_u64()
            .unwrap_or(0)
    };
    let started = jobs();
    let script = format!("cat '{}' >/dev/null && exec cat >/dev/null", file.display());
    let job = agent
        .cli(&["run", "--", "sh", "-c", &script])
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .context("starting the served job")?;
    wait_for(&agent, 60, "the served job's start", || jobs() > started)?;
    if at_rest {
        wait_for(&agent, 60, "the tracer to rest while the job runs", || {
            let t = &agent.status()["tracing"];
            t["resting"] == true && t["with_jobs"] == true
        })?;
    } else {
        // Its read of the file is done.
        std::thread::sleep(Duration::from_millis(500));
    }
    Ok((agent, job))
}

/// Ends the served job and its daemon; whether the daemon woke while the programs ran
/// (it rested before them, where it may).
fn end(agent: Option<(Agent, Child)>) -> Result<bool> {
    let mut woke = false;
    if let Some((mut agent, mut job)) = agent {
        woke = agent.status()["tracing"]["wakeups"].as_u64() != Some(0);
        drop(job.stdin.take());
        let status = job.wait()?;
        if !status.success() {
            bail!("the served job failed ({status}):\n{}", agent.log());
        }
        agent.stop();
    }
    Ok(woke)
}

/// The real programs' case: `rounds` rounds of each mode, interleaved.
pub fn real_programs(net: &NetworkMount, rounds: usize) -> Result<()> {
    let repo = crate::host::workspace();
    let local = tempfile::Builder::new()
        .prefix("hocus-programs")
        .tempdir_in("/var/tmp")?;
    let local_file = local.path().join("data.bin");
    std::fs::write(&local_file, vec![7u8; 1 << 20])?;
    let net_file = net.put("programs/data.bin", &vec![7u8; 1 << 20]);
    let scripts: Vec<String> = PROGRAMS
        .iter()
        .map(|(_, s)| s.replace("{repo}", &repo.display().to_string()))
        .collect();
    println!(
        "\nreal programs on data the daemon does not watch, {rounds} rounds interleaved; CPU \
         seconds of each (user + system, the whole pipeline):"
    );
    // Warm the page and dentry caches once, unmeasured.
    for s in &scripts {
        measure(s)?;
    }
    // [mode][program] -> CPU seconds per round; and wall seconds of all programs.
    let mut cpu = vec![vec![Vec::new(); PROGRAMS.len()]; MODES.len()];
    let mut wall = vec![Vec::new(); MODES.len()];
    // Rounds in which the FUSE daemon did not stay at rest while the programs ran.
    let mut woken = 0;
    for round in 0..rounds {
        for (m, (mode, _)) in MODES.iter().enumerate() {
            let agent = match mode {
                Mode::None => None,
                Mode::Fuse => Some(served_job(&net.mount, &net_file, true)?),
                Mode::Local => Some(served_job(local.path(), &local_file, false)?),
            };
            let mut walls = 0.0;
            for (p, s) in scripts.iter().enumerate() {
                let (c, w) = measure(s)?;
                cpu[m][p].push(c);
                walls += w;
            }
            wall[m].push(walls);
            if end(agent)? && *mode == Mode::Fuse {
                woken += 1;
            }
        }
        print!(".");
        let _ = std::io::stdout().flush();
        if round + 1 == rounds {
            println!();
        }
    }
    println!(
        "\n{:<34} {:>11} {:>11} {:>8} {:>11} {:>8}",
        "", "NO DAEMON", "FUSE", "RATIO", "LOCAL DIR", "RATIO"
    );
    let totals: Vec<Vec<f64>> = (0..MODES.len())
        .map(|m| {
            (0..rounds)
                .map(|r| (0..PROGRAMS.len()).map(|p| cpu[m][p][r]).sum())
                .collect()
        })
        .collect();
    let row = |name: &str, v: [f64; 3]| {
        println!(
            "{name:<34} {:>9.3} s {:>9.3} s {:>7.3}x {:>9.3} s {:>7.3}x",
            v[0],
            v[1],
            v[1] / v[0],
            v[2],
            v[2] / v[0]
        );
    };
    for (p, (name, _)) in PROGRAMS.iter().enumerate() {
        row(name, [0, 1, 2].map(|m| median(&cpu[m][p])));
    }
    let total = [0, 1, 2].map(|m| median(&totals[m]));
    row("all four, CPU", total);
    row("all four, wall clock", [0, 1, 2].map(|m| median(&wall[m])));
    let (fuse, local_dir) = (total[1] / total[0], total[2] / total[0]);
    let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
    println!(
        "goal: <= 1.02x with jobs running and served in FUSE mode: {fuse:.3}x, {}; \
         (a local directory, every process followed: {local_dir:.3}x; a tree with no \
         tripwire may keep following every process)",
        verdict(fuse <= 1.02)
    );
    println!(
        "the FUSE daemon rested while its job ran, through the programs, in {} of {rounds} rounds",
        rounds - woken
    );
    super::common::write_figures(
        "overhead-programs",
        &serde_json::json!({
            "rounds": rounds,
            "programs": PROGRAMS.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            "modes": MODES.iter().map(|(_, n)| n).collect::<Vec<_>>(),
            "cpu_seconds": cpu,
            "wall_seconds": wall,
            "cpu_ratio_fuse": fuse,
            "cpu_ratio_local": local_dir,
            "fuse_rounds_at_rest": rounds - woken,
        }),
    )
}
