//! `cargo xtask bench scale`: a site-wide profile (N files, N/5 missing names) imported
//! into a running daemon, then what it costs: import time, the daemon's memory above its
//! empty size, `status` and `profile export` times, and CPU while idle. Baselines from
//! the same run: reading the profile file once (import), and the daemon's own size
//! before the import (memory). And whether requests wait behind that work: `status`
//! and `run -- true`, asked every 250 ms from before the import until the daemon has
//! settled and at least 35 s (placement, the first saves, a revalidation of it all),
//! their slowest answers against their times on the idle daemon.

use std::{
    fs::File,
    io::{BufWriter, Write},
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use hocus_tests::{Agent, NetworkMount};

pub struct Scale {
    pub files: usize,
    /// How long to watch the idle daemon's CPU.
    pub idle: Duration,
    /// How long the poll lasts at least from the import: through the daemon's first
    /// revalidation of it all (every 30 s by default).
    pub poll_at_least: Duration,
}

impl Scale {
    /// A smoke run for CI.
    pub fn quick() -> Self {
        Self {
            files: 20_000,
            idle: Duration::from_secs(3),
            poll_at_least: Duration::ZERO,
        }
    }
}

/// Writes a synthetic profile in the export format: N files 100 to a directory in a
/// tree like a site's Python environments, N/5 names that were not found.
fn write_profile(path: &Path, root: &Path, n: usize) -> Result<()> {
    let mut w = BufWriter::with_capacity(1 << 20, File::create(path)?);
    let dir = |i: usize| {
        let d = i / 100;
        format!(
            "{}/site/env{}/lib/python3.11/site-packages/pkg{}",
            root.display(),
            d / 100,
            d % 100
        )
    };
    writeln!(
        w,
        "{{\"version\": 1, \"started_unix_ns\": 1700000000000000000, \"files\": ["
    )?;
    for i in 0..n {
        let sep = if i + 1 < n { "," } else { "" };
        writeln!(
            w,
            "{{\"path\": \"{}/module_{i}.py\", \"size\": {}, \"mtime_ns\": {}, \"opens\": {}, \"bytes_read\": {}, \"first_touch_ns\": {}, \"last_touch_ns\": {}, \"users\": 1, \"uids\": [{}], \"written\": false}}{sep}",
            dir(i),
            (i * 37) % 100_000 + 1,
            1_690_000_000_000_000_000u64 + i as u64,
            1 + i % 7,
            (i * 11) % 50_000,
            i as u64 * 1000,
            i as u64 * 1000 + 500,
            1000 + i % 50,
        )?;
    }
    writeln!(w, "], \"missing\": [")?;
    let m = n / 5;
    for i in 0..m {
        let sep = if i + 1 < m { "," } else { "" };
        writeln!(
            w,
            "{{\"path\": \"{}/module_{i}.so\", \"lookups\": {}, \"first_touch_ns\": {}}}{sep}",
            dir(i * 5),
            1 + i % 3,
            i as u64 * 5000,
        )?;
    }
    writeln!(w, "], \"dirs\": []}}")?;
    w.flush()?;
    Ok(())
}

/// A field of /proc/PID/status, in KiB.
fn proc_kib(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| {
            l.strip_prefix(field)?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

/// CPU time used by `pid` so far (user + system).
fn cpu_time(pid: u32) -> Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = &stat[stat.rfind(')').context("a /proc stat line")? + 2..];
    let f: Vec<&str> = after.split(' ').collect();
    let ticks: u64 = f[11].parse::<u64>()? + f[12].parse::<u64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(Duration::from_millis(ticks * 1000 / hz))
}

/// Runs `cmd` to its end: the time it took and its peak memory (KiB). The peak is read
/// from its /proc status every few ms until it exits: `wait4`'s ru_maxrss would carry
/// this process's own peak into the child's across fork and exec.
fn timed(cmd: &mut Command) -> Result<(Duration, u64)> {
    let t = Instant::now();
    let mut child = cmd.stdout(std::process::Stdio::null()).spawn()?;
    let mut peak = 0;
    let status = loop {
        if let Ok(kib) = proc_kib(child.id(), "VmHWM:") {
            peak = peak.max(kib);
        }
        if let Some(status) = child.try_wait()? {
            break status;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let took = t.elapsed();
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok((took, peak))
}

/// Waits until the daemon `pid` uses under 5% of a core for a second (at most 60 s);
/// how long that took.
fn settle(pid: u32) -> Result<Duration> {
    let settling = Instant::now();
    while settling.elapsed() < Duration::from_secs(60) {
        let before = cpu_time(pid)?;
        std::thread::sleep(Duration::from_secs(1));
        if (cpu_time(pid)? - before) < Duration::from_millis(50) {
            break;
        }
    }
    Ok(settling.elapsed())
}

/// `hocus-agent run -- true`: a job start, all of it (the check of the copies, the
/// namespace, the binds).
fn job(agent: &Agent) -> Command {
    let mut cmd = agent.cli(&["run", "--", "true"]);
    cmd.current_dir("/");
    cmd
}

/// How long `cmd` took to answer, failing if it failed.
fn answer(cmd: &mut Command) -> Result<Duration> {
    let t = Instant::now();
    let out = cmd.output()?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(t.elapsed())
}

fn median_of(n: usize, mut f: impl FnMut() -> Result<Duration>) -> Result<Duration> {
    let mut v = (0..n).map(|_| f()).collect::<Result<Vec<_>>>()?;
    v.sort();
    Ok(v[v.len() / 2])
}

/// The slowest answers while polling.
#[derive(Default)]
struct Slowest {
    status: Duration,
    run: Duration,
    /// How long the poll lasted.
    window: Duration,
    polls: usize,
    status_failed: usize,
    run_failed: usize,
}

/// Runs `during` while another thread asks the daemon `status` and `run -- true` every
/// 250 ms, as a monitoring agent and a batch system would: the slowest answers.
/// Runs `during` while another thread asks `status` (and `run -- true`, with `jobs`)
/// every `every`, and says the slowest answers.
fn while_polling<T>(
    agent: &Agent,
    every: Duration,
    jobs: bool,
    during: impl FnOnce() -> Result<T>,
) -> Result<(T, Slowest)> {
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let poller = scope.spawn(|| -> Result<Slowest> {
            let mut slowest = Slowest::default();
            // A refusal is an answer too (the keeper busy past its 5 s): timed, counted.
            let ask = |cmd: &mut Command, failed: &mut usize| {
                let t = Instant::now();
                match answer(cmd) {
                    Ok(took) => took,
                    Err(e) => {
                        *failed += 1;
                        if *failed == 1 {
                            println!("refused while polling: {e:#}");
                        }
                        t.elapsed()
                    }
                }
            };
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let took = ask(&mut agent.cli(&["status"]), &mut slowest.status_failed);
                slowest.status = slowest.status.max(took);
                if jobs {
                    let took = ask(&mut job(agent), &mut slowest.run_failed);
                    slowest.run = slowest.run.max(took);
                }
                slowest.polls += 1;
                std::thread::sleep(every);
            }
            Ok(slowest)
        });
        let started = Instant::now();
        let result = during();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut slowest = poller
            .join()
            .map_err(|_| anyhow::anyhow!("the poller panicked"))??;
        slowest.window = started.elapsed();
        Ok((result?, slowest))
    })
}

pub fn scale(agent_bin: &Path, s: &Scale) -> Result<()> {
    if !crate::host::is_root() {
        bail!("the benchmark runs the daemon: run it as root");
    }
    // SAFETY: single-threaded at this point.
    unsafe { std::env::set_var("HOCUS_AGENT_BIN", agent_bin) };
    let net = NetworkMount::start();
    let work = tempfile::Builder::new()
        .prefix("hocus-scale")
        .tempdir_in("/var/tmp")?;
    let profile = work.path().join("site.json");
    write_profile(&profile, &net.mount, s.files)?;
    let profile_bytes = std::fs::metadata(&profile)?.len();
    println!(
        "scale: a profile of {} files and {} missing names ({:.0} MB of JSON) imported into a daemon",
        s.files,
        s.files / 5,
        profile_bytes as f64 / 1e6
    );
    // Baseline: reading the file once, from the page cache.
    let t = Instant::now();
    let read = std::fs::read(&profile)?.len();
    let read_time = t.elapsed();
    assert_eq!(read as u64, profile_bytes);

    let mut agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--save-interval",
        "2",
    ]);
    let pid = agent.pid();
    std::thread::sleep(Duration::from_millis(500));
    let empty_kib = proc_kib(pid, "VmRSS:")?;

    let idle_status = median_of(5, || answer(&mut agent.cli(&["status"])))?;
    let idle_run = median_of(5, || answer(&mut job(&agent)))?;
    let poll = Duration::from_millis(250);
    let ((import, cli_kib, settled_import), slowest) = while_polling(&agent, poll, true, || {
        let started = Instant::now();
        let (import, cli_kib) =
            timed(&mut agent.cli(&["profile", "import", profile.to_str().unwrap()]))?;
        // Until the keeper is done with what the import asked of it ...
        let settled = settle(pid)?;
        // ... and has revalidated it all once.
        if let Some(rest) = s.poll_at_least.checked_sub(started.elapsed()) {
            std::thread::sleep(rest);
        }
        Ok((import, cli_kib, settled))
    })
    .with_context(|| format!("the daemon's log:\n{}", agent.log()))?;
    let imported = agent.status();
    if imported["files"].as_u64() != Some(s.files as u64) {
        bail!(
            "the daemon holds {} files after the import, not {}",
            imported["files"],
            s.files
        );
    }

    let profile_mib = imported["profile_bytes"].as_f64().unwrap_or(0.0) / f64::from(1 << 20);
    // Which step holds the peak: the import (placement, the first save) or the export.
    let import_peak_kib = proc_kib(pid, "VmHWM:")?;

    let mut status_times: Vec<Duration> = (0..5)
        .map(|_| timed(&mut agent.cli(&["status"])).map(|(t, _)| t))
        .collect::<Result<_>>()?;
    status_times.sort();
    let status = status_times[status_times.len() / 2];

    let out = work.path().join("export.json");
    // The export's order is fixed on the daemon's loop before its first part: a status
    // asked every 10 ms meanwhile says how long that holds the loop.
    let ((export, export_cli_kib), during_export) =
        while_polling(&agent, Duration::from_millis(10), false, || {
            timed(&mut agent.cli(&["profile", "export", "--out", out.to_str().unwrap()]))
        })?;
    let exported: serde_json::Value = serde_json::from_slice(&std::fs::read(&out)?)?;
    let exported_files = exported["files"].as_array().map_or(0, Vec::len);
    if exported_files != s.files {
        bail!("the export holds {exported_files} files, not {}", s.files);
    }
    drop(exported);

    // Idle: once the keeper is done with what the import asked of it (here, trying
    // files that do not exist on the server), and a save of everything, nothing changes.
    let settled = settle(pid)?;
    std::thread::sleep(Duration::from_secs(3));
    let before = cpu_time(pid)?;
    std::thread::sleep(s.idle);
    let idle_cpu = (cpu_time(pid)? - before).as_secs_f64() / s.idle.as_secs_f64();
    let peak_kib = proc_kib(pid, "VmHWM:")?;
    let steady_kib = proc_kib(pid, "VmRSS:")?;
    agent.stop();

    let mib = |kib: u64| kib as f64 / 1024.0;
    let above = mib(peak_kib.saturating_sub(empty_kib));
    let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
    println!("\n{:<44} {:>12} {:>24}  goal", "", "MEASURED", "BASELINE");
    println!(
        "{:<44} {:>10.2} s {:>15.1}x reading  <= 10 s: {}",
        "profile import",
        import.as_secs_f64(),
        import.as_secs_f64() / read_time.as_secs_f64().max(1e-6),
        verdict(import <= Duration::from_secs(10))
    );
    println!(
        "{:<44} {:>8.1} MiB {:>20.1} MiB  <= 64 MiB above: {}",
        "daemon peak memory above its empty size",
        above,
        mib(empty_kib),
        verdict(above <= 64.0)
    );
    println!(
        "{:<44} {:>8.1} MiB",
        "  of which by the import's end",
        mib(import_peak_kib.saturating_sub(empty_kib))
    );
    println!(
        "{:<44} {:>8.1} MiB",
        "daemon memory after (steady)",
        mib(steady_kib)
    );
    println!(
        "{:<44} {:>8.1} MiB",
        "  of which the working set (its own count)", profile_mib
    );
    println!(
        "{:<44} {:>8.1} MiB {:>8.1} MiB (export)",
        "CLI peak memory: import",
        mib(cli_kib),
        mib(export_cli_kib)
    );
    println!(
        "{:<44} {:>9.1} ms {:>24}  <= 50 ms: {}",
        "status (median of 5)",
        status.as_secs_f64() * 1000.0,
        "",
        verdict(status <= Duration::from_millis(50))
    );
    println!(
        "{:<44} {:>10.2} s {:>15.1}x reading  <= 5 s: {}",
        "profile export (to a file)",
        export.as_secs_f64(),
        export.as_secs_f64() / read_time.as_secs_f64().max(1e-6),
        verdict(export <= Duration::from_secs(5))
    );
    println!(
        "{:<44} {:>9.1} ms {:>18.1} ms idle  <= 50 ms: {}",
        "slowest status during the export",
        during_export.status.as_secs_f64() * 1000.0,
        idle_status.as_secs_f64() * 1000.0,
        verdict(
            during_export.status <= Duration::from_millis(50) && during_export.status_failed == 0
        )
    );
    println!(
        "{:<44} {:>10.1} s",
        "time for the daemon to settle after the export",
        settled.as_secs_f64()
    );
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "{:<44} {:>9.1} ms {:>18.1} ms idle  <= 50 ms: {}",
        "slowest status, import until settled",
        ms(slowest.status),
        ms(idle_status),
        verdict(slowest.status <= Duration::from_millis(50) && slowest.status_failed == 0)
    );
    let run_above = slowest.run.saturating_sub(idle_run);
    println!(
        "{:<44} {:>9.1} ms {:>18.1} ms idle  <= 150 ms above: {}",
        "slowest run -- true, import until settled",
        ms(slowest.run),
        ms(idle_run),
        verdict(run_above <= Duration::from_millis(150) && slowest.run_failed == 0)
    );
    println!(
        "{:<44} {:>10.1} s ({} polls; settled {:.1} s after the import; refused: {} status, {} run)",
        "  polled for",
        slowest.window.as_secs_f64(),
        slowest.polls,
        (import + settled_import).as_secs_f64(),
        slowest.status_failed,
        slowest.run_failed
    );
    println!(
        "{:<44} {:>10.2} % {:>24}  ~0: {}",
        "daemon CPU while idle (of one core)",
        idle_cpu * 100.0,
        "",
        verdict(idle_cpu < 0.01)
    );
    let figures = serde_json::json!({
        "files": s.files,
        "missing": s.files / 5,
        "profile_bytes": profile_bytes,
        "read_seconds": read_time.as_secs_f64(),
        "import_seconds": import.as_secs_f64(),
        "daemon_empty_mib": mib(empty_kib),
        "daemon_peak_mib": mib(peak_kib),
        "daemon_peak_above_empty_mib": above,
        "daemon_peak_above_empty_by_import_end_mib": mib(import_peak_kib.saturating_sub(empty_kib)),
        "daemon_steady_mib": mib(steady_kib),
        "working_set_mib": profile_mib,
        "cli_import_peak_mib": mib(cli_kib),
        "cli_export_peak_mib": mib(export_cli_kib),
        "status_ms": status.as_secs_f64() * 1000.0,
        "export_seconds": export.as_secs_f64(),
        "idle_cpu_fraction": idle_cpu,
        "idle_status_ms": ms(idle_status),
        "idle_run_ms": ms(idle_run),
        "slowest_status_ms": ms(slowest.status),
        "slowest_status_during_export_ms": ms(during_export.status),
        "slowest_run_ms": ms(slowest.run),
        "polls": slowest.polls,
        "polled_seconds": slowest.window.as_secs_f64(),
        "status_refused": slowest.status_failed,
        "run_refused": slowest.run_failed,
        "settle_seconds": settled.as_secs_f64(),
    });
    super::common::write_figures("scale", &figures)
}
