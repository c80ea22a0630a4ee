//! What the benchmarks share: their figures written as JSON, a share with a realistic
//! round trip, a daemon with its cache on a disk of its own, the page cache emptied as
//! on a misbehaving node, the packages they import, and timing.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use hocus_tests::{Agent, NetworkMount};

use crate::host;

pub const MIB: usize = 1 << 20;

/// Polls `cond` every 200 ms until it holds; after `secs`, fails saying what was waited
/// for, with the daemon's log.
pub fn wait_for(
    agent: &Agent,
    secs: u64,
    what: &str,
    mut cond: impl FnMut() -> bool,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        if Instant::now() > deadline {
            bail!("{what}: not within {secs} s\n{}", agent.log());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// Writes a benchmark's figures as JSON beside its table (target/bench/NAME.json).
pub fn write_figures(name: &str, figures: &serde_json::Value) -> Result<()> {
    let dir = host::target_dir().join("bench");
    fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{name}.json"));
    fs::write(&path, serde_json::to_vec_pretty(figures)?)?;
    println!("\nfigures: {}", path.display());
    Ok(())
}

/// Waits (60 s at most) for the profile a first job's epilog saves under `key` for
/// the test user in the `profiles` directory.
pub fn saved_profile(profiles: &Path, key: &str) -> Result<()> {
    let saved = profiles.join(format!("hocus-test/{key}.json"));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !saved.exists() {
        if Instant::now() > deadline {
            bail!(
                "the first job's epilog saved no profile at {}",
                saved.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// A Slurm benchmark's start: it must run as root, and the cluster fixture (tests'
/// `slurm`) is pointed at the agent and SPANK plugin just built.
pub fn for_slurm(agent_bin: &Path) -> Result<()> {
    if !host::is_root() {
        bail!("the benchmark runs a Slurm cluster and loads eBPF programs: run it as root");
    }
    // SAFETY: single-threaded at this point.
    unsafe {
        std::env::set_var("HOCUS_AGENT_BIN", agent_bin);
        std::env::set_var(
            "HOCUS_SPANK_PLUGIN",
            agent_bin.with_file_name("libhocus_spank.so"),
        );
    }
    Ok(())
}

/// The median of some timings.
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A share with the given round trip (0: bare loopback).
pub fn network(round_trip: Duration) -> NetworkMount {
    if round_trip.is_zero() {
        NetworkMount::start()
    } else {
        NetworkMount::start_with_round_trip(round_trip)
    }
}

/// Empties the page cache; dirty pages are written first (the kernel drops only clean
/// ones: a file just written would stay cached).
pub fn drop_caches() -> Result<()> {
    // SAFETY: no arguments.
    unsafe { libc::sync() };
    fs::write("/proc/sys/vm/drop_caches", "1")?;
    Ok(())
}

/// Runs `cmd` to its end and says how long it took.
pub fn timed(cmd: &mut Command) -> Result<f64> {
    let t = Instant::now();
    let out = cmd.stdout(Stdio::null()).output()?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(t.elapsed().as_secs_f64())
}

/// A daemon watching `net` with its cache on a disk of its own, as on a node (see
/// `LocalDisk`); the disk lives as long as the first value.
/// A daemon with its cache on a disk of its own (unmounted when dropped, after it).
pub type Daemon = (hocus_tests::LocalDisk, Agent);

pub fn agent_on_local_disk(net: &NetworkMount, extra: &[&str]) -> Daemon {
    // Room for a whole snapshot of the largest case (1.1 GB) within half the budget.
    agent_on_disk_of(net, 8192, extra)
}

/// The same on a disk of `mib` MiB.
pub fn agent_on_disk_of(net: &NetworkMount, mib: u64, extra: &[&str]) -> Daemon {
    let disk = hocus_tests::LocalDisk::new(mib);
    let cache_dir = disk.path.join("cache");
    let mut args = vec![
        "--watch",
        net.mount.to_str().unwrap(),
        "--cache-dir",
        cache_dir.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let agent = Agent::start(&args);
    (disk, agent)
}

/// numpy, scipy and pandas, installed with pip into a directory of their own (once).
pub fn numpy_packages() -> Result<PathBuf> {
    let dir = host::workspace().join("target/bench-packages");
    if !dir.join("scipy").is_dir() {
        println!(
            "installing numpy, scipy and pandas into {} (once)",
            dir.display()
        );
        let status = std::process::Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--break-system-packages"])
            .arg("--target")
            .arg(&dir)
            .args(["numpy", "scipy", "pandas"])
            .status()?;
        if !status.success() {
            bail!("pip could not install numpy, scipy and pandas");
        }
    }
    Ok(dir)
}

/// Empties the page cache once a second until dropped: the misbehaving node.
pub struct EmptyingPageCache {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EmptyingPageCache {
    pub fn start() -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = drop_caches();
                    std::thread::sleep(Duration::from_secs(1));
                }
            })
        };
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for EmptyingPageCache {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Lines of the server's request log, counted by request.
pub fn request_kinds(log: &str) -> std::collections::BTreeMap<&str, usize> {
    let mut kinds = std::collections::BTreeMap::new();
    for l in log.lines() {
        *kinds.entry(l.split(' ').next().unwrap_or("")).or_default() += 1;
    }
    kinds
}

/// The machine's busy CPU time (all cores) from a start: with the wall time, how many
/// cores were busy on average.
pub struct BusyCores(f64);

impl BusyCores {
    pub fn start() -> Self {
        Self(Self::busy_seconds())
    }

    /// CPU-seconds busy since the start, and the wall time: (busy, wall).
    pub fn seconds(&self, wall: Duration) -> (f64, f64) {
        (Self::busy_seconds() - self.0, wall.as_secs_f64())
    }

    fn busy_seconds() -> f64 {
        // /proc/stat's first line: the cores' times in clock ticks (USER_HZ, 100 on
        // Linux); idle and iowait are the 4th and 5th.
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let ticks: Vec<u64> = stat
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .filter_map(|t| t.parse().ok())
            .collect();
        let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
        (ticks.iter().sum::<u64>() - idle) as f64 / 100.0
    }
}

/// `n` offsets of 1 MiB chunks in a file of `size` bytes, 4 KiB aligned, from a fixed
/// seed: the same in every run.
pub fn offsets(n: usize, size: u64) -> Vec<u64> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % (size - MIB as u64)) & !4095
        })
        .collect()
}

/// The medians of the whole jobs' times and of their reads'.
pub fn medians(runs: Vec<(f64, f64)>) -> (f64, f64) {
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (whole, reads) = runs.into_iter().unzip();
    (median(whole), median(reads))
}

/// Runs `python3 -c job` under `hocus-agent run`, the page cache emptied first: the
/// seconds the whole job took, and what it printed. A job that fails is an error.
pub fn python_job(agent: &Agent, job: &str) -> Result<(f64, String)> {
    drop_caches()?;
    let t = Instant::now();
    let out = agent.cli(&["run", "--", "python3", "-c", job]).output()?;
    if !out.status.success() {
        bail!("the job failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let whole = t.elapsed().as_secs_f64();
    Ok((whole, String::from_utf8_lossy(&out.stdout).into_owned()))
}
