//! `cargo xtask bench overhead`: what hocus costs processes, watched or not. A
//! syscall-heavy loop (open, read 64 B, close, a failed stat) runs on an unwatched local
//! directory, in a process that never touches a watched tree (the node's other work) and
//! in one that used the watched tree first (which the daemon follows), and on a watched
//! network mount, in these conditions interleaved round by round: no programs attached;
//! **the floor** (a program that returns at once, where hocus's syscall program goes:
//! what any design there pays); the hocus daemon tracing; and the daemon at rest
//! (nothing to learn for `rest-after` seconds, its syscall program detached; the tree's
//! user wakes it). The medians are shown as ratios to no programs, measured in this run;
//! and the two unwatched loops, run in turns, paired round by round: what following
//! costs a process, with the machine's moods between conditions cancelled. Then real
//! programs on unwatched data, in both of the daemon's modes (`programs`).

use std::{
    ffi::CString,
    io::{BufRead, BufReader},
    os::unix::ffi::OsStrExt,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use hocus_tests::{Agent, NetworkMount};

use super::common::{median, wait_for};

pub struct Overhead {
    pub rounds: usize,
    /// Loop iterations on the unwatched local directory, per round.
    pub local_iterations: usize,
    /// Loop iterations on the watched network mount, per round.
    pub watched_iterations: usize,
    pub round_trip: Duration,
    /// Another build of hocus-agent, measured as a fourth condition (e.g. the last
    /// release, to see what a change did).
    pub compare_with: Option<std::path::PathBuf>,
    /// Rounds of the real programs' case (`programs`); 0 leaves it out.
    pub program_rounds: usize,
}

impl Overhead {
    /// A smoke run for CI: every condition once, briefly.
    pub fn quick(round_trip: Duration) -> Self {
        Self {
            rounds: 1,
            local_iterations: 20_000,
            watched_iterations: 100,
            round_trip,
            compare_with: None,
            program_rounds: 1,
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Condition {
    Nothing,
    Floor,
    Daemon,
    /// The daemon once its syscall program rests.
    Resting,
    /// The daemon of `--compare-with`.
    Other,
}

const CONDITIONS: [(Condition, &str); 5] = [
    (Condition::Nothing, "no programs attached"),
    (Condition::Floor, "floor: programs that return at once"),
    (Condition::Daemon, "hocus daemon, tracing"),
    (Condition::Resting, "hocus daemon, at rest (watched: wakes)"),
    (Condition::Other, "the daemon of --compare-with"),
];

/// One condition's microseconds per iteration, one per round: unwatched in a process
/// that never touches a watched tree, unwatched in one that used it, and watched.
#[derive(Clone, Default)]
struct Times {
    other: Vec<f64>,
    user: Vec<f64>,
    watched: Vec<f64>,
}

impl Times {
    /// The tree user's loop over the other's, round by round (the median): what
    /// following costs a process's unwatched work, measured in the same moments.
    fn following(&self) -> f64 {
        let paired: Vec<f64> = self
            .user
            .iter()
            .zip(&self.other)
            .map(|(u, o)| u / o)
            .collect();
        median(&paired)
    }

    fn medians(&self) -> [f64; 3] {
        [
            median(&self.other),
            median(&self.user),
            median(&self.watched),
        ]
    }
}

/// Slices of the unwatched loops, run in turns within a condition.
const SLICES: usize = 6;

/// `--rest-after` of the resting condition (the daemon's least).
const REST_AFTER: &str = "5";

/// Waits until the daemon's syscall program rests.
fn wait_until_resting(agent: &Agent) -> Result<()> {
    let what = format!("the daemon's rest (--rest-after {REST_AFTER})");
    wait_for(agent, 30, &what, || {
        agent.status()["tracing"]["resting"] == true
    })
}

/// The loop, with the calls made directly: one syscall each, nothing else in between.
fn syscall_loop(dir: &Path, iterations: usize) -> Result<Duration> {
    let c = |name: &str| CString::new(dir.join(name).as_os_str().as_bytes()).unwrap();
    let (file, missing) = (c("file.bin"), c("no-such-file"));
    let mut buf = [0u8; 64];
    // SAFETY: plain syscalls on valid C strings and buffers; a failed open is checked.
    let t = Instant::now();
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        for _ in 0..iterations {
            let fd = libc::open(file.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
            if fd < 0 {
                bail!(
                    "opening {}: {}",
                    dir.join("file.bin").display(),
                    std::io::Error::last_os_error()
                );
            }
            libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
            libc::close(fd);
            libc::stat(missing.as_ptr(), &mut st);
        }
    }
    Ok(t.elapsed())
}

/// The loop in a process of its own (`cargo xtask syscall-loop`): a process that never
/// touched a watched tree, or (`touch`) one that used it first. Seconds per iteration.
fn loop_in_process(dir: &Path, iterations: usize, touch: Option<&Path>) -> Result<f64> {
    let mut cmd = Command::new(std::env::current_exe().context("finding xtask's binary")?);
    cmd.arg("syscall-loop").arg(dir).arg(iterations.to_string());
    if let Some(t) = touch {
        cmd.arg("--touch").arg(t);
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .context("running the loop's process")?;
    if !out.status.success() {
        bail!("the loop's process failed ({})", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .parse()
        .with_context(|| format!("the loop's process printed {text:?}, not seconds"))
}

/// `cargo xtask syscall-loop`: the loop of `loop_in_process`, in this process.
pub fn syscall_loop_process(dir: &Path, iterations: usize, touch: Option<&Path>) -> Result<()> {
    // On one core, the last: a loop moved between cores mid-round measures the move.
    // SAFETY: a zeroed set with one bit set, for this process.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let cores = libc::sysconf(libc::_SC_NPROCESSORS_ONLN).max(1) as usize;
        libc::CPU_SET(cores - 1, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set);
    }
    if let Some(t) = touch {
        syscall_loop(t, 10)?;
    }
    let took = syscall_loop(dir, iterations)?;
    println!("{}", took.as_secs_f64() / iterations as f64);
    Ok(())
}

/// `hocus-agent trace-floor`, once it says its program is attached.
fn start_floor(agent_bin: &Path) -> Result<Child> {
    let mut child = Command::new(agent_bin)
        .arg("trace-floor")
        .stdout(Stdio::piped())
        .spawn()
        .context("starting hocus-agent trace-floor")?;
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line)?;
    if line.trim() != "ready" {
        let _ = child.kill();
        bail!("hocus-agent trace-floor did not attach its program");
    }
    Ok(child)
}

pub fn overhead(agent_bin: &Path, o: &Overhead) -> Result<()> {
    if !crate::host::is_root() {
        bail!("the benchmark loads eBPF programs and mounts filesystems: run it as root");
    }
    // With statistics on, every program run also reads the clock twice: the floor and the
    // daemon look tens of nanoseconds a syscall dearer than they are.
    if std::fs::read_to_string("/proc/sys/kernel/bpf_stats_enabled").is_ok_and(|v| v.trim() == "1")
    {
        eprintln!(
            "warning: kernel.bpf_stats_enabled is 1, which makes every program run dearer; \
             for numbers that mean something: sysctl kernel.bpf_stats_enabled=0"
        );
    }
    if o.rounds == 0 && o.program_rounds == 0 {
        bail!("nothing to measure: --rounds and --program-rounds are both 0");
    }
    // SAFETY: single-threaded at this point.
    unsafe { std::env::set_var("HOCUS_AGENT_BIN", agent_bin) };
    let net = NetworkMount::start_with_round_trip(o.round_trip);
    net.put("loop/file.bin", &[7u8; 4096]);
    let watched = net.path("loop");
    let local = tempfile::Builder::new()
        .prefix("hocus-overhead")
        .tempdir_in("/var/tmp")?;
    std::fs::write(local.path().join("file.bin"), [7u8; 4096])?;
    if o.rounds > 0 {
        loops(agent_bin, o, &net, &watched, local.path())?;
    }
    if o.program_rounds > 0 {
        super::programs::real_programs(&net, o.program_rounds)?;
    }
    Ok(())
}

/// The syscall loops' case: every condition, `o.rounds` rounds interleaved.
fn loops(
    agent_bin: &Path,
    o: &Overhead,
    net: &NetworkMount,
    watched: &Path,
    local: &Path,
) -> Result<()> {
    println!(
        "overhead: a loop of open / read 64 B / close / failed stat; {} rounds, interleaved; \
         unwatched: {} iterations on local disk, in a process that never touches a watched \
         tree (OTHER) and in one that used it first (TREE USER); watched: {} on sshfs with a \
         {:.1} ms round trip",
        o.rounds,
        o.local_iterations,
        o.watched_iterations,
        o.round_trip.as_secs_f64() * 1000.0
    );
    // Per condition: microseconds per iteration, one per round.
    let conditions = if o.compare_with.is_some() { 5 } else { 4 };
    let mut times: Vec<Times> = vec![Times::default(); conditions];
    let watch = ["--watch", net.mount.to_str().unwrap()];
    let tracing = ["--watch", net.mount.to_str().unwrap(), "--rest-after", "0"];
    let resting = [
        "--watch",
        net.mount.to_str().unwrap(),
        "--rest-after",
        REST_AFTER,
    ];
    for round in 0..o.rounds {
        for (i, (condition, _)) in CONDITIONS.iter().take(conditions).enumerate() {
            let mut floor = None;
            let mut agent = None;
            match condition {
                Condition::Nothing => {}
                Condition::Floor => floor = Some(start_floor(agent_bin)?),
                Condition::Daemon => agent = Some(Agent::start(&tracing)),
                Condition::Resting => agent = Some(Agent::start(&resting)),
                Condition::Other => {
                    // SAFETY: the benchmark is single-threaded here.
                    unsafe {
                        std::env::set_var("HOCUS_AGENT_BIN", o.compare_with.as_ref().unwrap())
                    };
                    agent = Some(Agent::start(&watch));
                    // SAFETY: as above.
                    unsafe { std::env::set_var("HOCUS_AGENT_BIN", agent_bin) };
                }
            }
            // Warm the page cache, the dentry cache and the daemon's first copy. What
            // touches the watched tree runs in processes of its own: this one forks the
            // loops, and a process that used the tree passes that on to its children.
            syscall_loop(local, o.local_iterations / 10)?;
            loop_in_process(watched, o.watched_iterations / 10 + 1, None)?;
            if *condition == Condition::Resting {
                wait_until_resting(agent.as_ref().unwrap())?;
            }
            // The two unwatched loops in turns, a slice at a time, so that they share
            // the machine's moods: their ratio is what following costs, paired.
            let (mut other, mut user) = (0.0, 0.0);
            let slice = (o.local_iterations / SLICES).max(1);
            // Each goes first as often as the other (SLICES is even).
            for i in 0..SLICES {
                let run = |touch| loop_in_process(local, slice, touch);
                let (o1, u1) = if i % 2 == 0 {
                    (run(None)?, run(Some(watched))?)
                } else {
                    let u1 = run(Some(watched))?;
                    (run(None)?, u1)
                };
                other += o1 / SLICES as f64;
                user += u1 / SLICES as f64;
            }
            let on_watched = loop_in_process(watched, o.watched_iterations, None)?;
            let t = &mut times[i];
            t.other.push(other * 1e6);
            t.user.push(user * 1e6);
            t.watched.push(on_watched * 1e6);
            if let Some(mut f) = floor {
                let _ = f.kill();
                let _ = f.wait();
            }
            if let Some(mut a) = agent {
                let log = a.stop();
                if round == 0 && !log.contains("watching") {
                    eprintln!("the daemon's log:\n{log}");
                }
            }
        }
    }
    let base = times[0].medians();
    println!(
        "\n{:<38} {:>10} {:>8} {:>10} {:>8} {:>10} {:>8}",
        "", "OTHER", "RATIO", "TREE USER", "RATIO", "WATCHED", "RATIO"
    );
    let mut ratios = Vec::new();
    for (i, (_, name)) in CONDITIONS.iter().take(conditions).enumerate() {
        let m = times[i].medians();
        let r = [m[0] / base[0], m[1] / base[1], m[2] / base[2]];
        ratios.push(r);
        println!(
            "{name:<38} {:>7.2} µs {:>7.3}x {:>7.2} µs {:>7.3}x {:>7.1} µs {:>7.3}x",
            m[0], r[0], m[1], r[1], m[2], r[2]
        );
    }
    let verdict = |ok: bool| if ok { "met" } else { "not met" };
    let (floor, daemon, resting) = (ratios[1], ratios[2], ratios[3]);
    let points = |r: [f64; 3], at: usize| (r[at] - floor[at]) * 100.0;
    println!(
        "\ngoals: floor on unwatched <= 1.05x: {}; daemon on unwatched work of other processes \
         within 2 points of the floor: tracing {:+.1} points, {}; at rest {:+.1} points, {}; \
         daemon on watched <= 1.10x: {}",
        verdict(floor[0] <= 1.05),
        points(daemon, 0),
        verdict(points(daemon, 0) <= 2.0),
        points(resting, 0),
        verdict(points(resting, 0) <= 2.0),
        verdict(daemon[2] <= 1.10),
    );
    println!(
        "(the unwatched work of a process that uses a watched tree, which the daemon follows: \
         tracing {:+.1} points over the floor)",
        points(daemon, 1)
    );
    // Paired in each round, so the rounds' moods cancel: the other conditions follow no
    // process, and show what the pairing itself leaves (0 if the machine were quiet).
    let following: Vec<f64> = times.iter().map(Times::following).collect();
    println!(
        "following, paired: the tree user's unwatched loop over the other's in the same rounds: \
         tracing {:+.1}% (no programs {:+.1}%, floor {:+.1}%)",
        (following[2] - 1.0) * 100.0,
        (following[0] - 1.0) * 100.0,
        (following[1] - 1.0) * 100.0,
    );
    let conditions: Vec<serde_json::Value> = CONDITIONS
        .iter()
        .take(conditions)
        .enumerate()
        .map(|(i, (_, name))| {
            let m = times[i].medians();
            serde_json::json!({
                "condition": name,
                "unwatched_us": m[0],
                "unwatched_ratio": ratios[i][0],
                "unwatched_tree_user_us": m[1],
                "unwatched_tree_user_ratio": ratios[i][1],
                "tree_user_over_other_paired": following[i],
                "watched_us": m[2],
                "watched_ratio": ratios[i][2],
            })
        })
        .collect();
    super::common::write_figures(
        "overhead",
        &serde_json::json!({
            "rounds": o.rounds,
            "unwatched_iterations": o.local_iterations,
            "watched_iterations": o.watched_iterations,
            "round_trip_ms": o.round_trip.as_secs_f64() * 1000.0,
            "conditions": conditions,
        }),
    )
}
