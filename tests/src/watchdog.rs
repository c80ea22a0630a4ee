//! A bound on how long a test may hold its fixtures: a test that hangs (a mount or a CLI
//! call that never returns, a daemon stuck on a lock) fails with what the daemons and the
//! kernel were doing, rather than holding a guest until the rig stops it with nothing to
//! say; and leaves no daemon or mount behind.

use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc::{self, RecvTimeoutError},
    },
    thread,
    time::Duration,
};

/// How long one fixture may live in a test; `HOCUS_TEST_WATCHDOG_SECS` changes it. The
/// longest test file runs ~100 s in the slowest guest.
const DEFAULT_SECS: u64 = 600;

/// The daemons running (pid, log), for the report.
static DAEMONS: Mutex<Vec<(u32, PathBuf)>> = Mutex::new(Vec::new());
/// What a fixture leaves if the process ends without its drop (a hang): by watchdog.
static LEFT: Mutex<Vec<(u64, Leftover)>> = Mutex::new(Vec::new());
static NEXT: AtomicU64 = AtomicU64::new(0);
static FIRED: AtomicBool = AtomicBool::new(false);

/// What ending the process on a hang must not leave behind on the machine: the next
/// test, or the next CI step, would meet it (a daemon holding the relay's port, a mount).
pub enum Leftover {
    Process(u32),
    Mount(PathBuf),
}

/// Ends the test process with a report unless dropped within its time.
pub struct Watchdog {
    _disarm: mpsc::Sender<()>,
    daemon: Option<u32>,
    id: u64,
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some(pid) = self.daemon {
            DAEMONS.lock().unwrap().retain(|(p, _)| *p != pid);
        }
        LEFT.lock().unwrap().retain(|(id, _)| *id != self.id);
    }
}

impl Watchdog {
    /// Watches a fixture (a network mount) while it lives.
    pub fn start() -> Self {
        Self::arm(None)
    }

    /// Watches daemon `pid`, whose log is `log`, while it lives.
    pub fn daemon(pid: u32, log: PathBuf) -> Self {
        DAEMONS.lock().unwrap().push((pid, log));
        let dog = Self::arm(Some(pid));
        dog.leaves(Leftover::Process(pid));
        dog
    }

    /// What the fixture leaves if the process ends on a hang: cleaned up first.
    pub fn leaves(&self, leftover: Leftover) {
        LEFT.lock().unwrap().push((self.id, leftover));
    }

    fn arm(daemon: Option<u32>) -> Self {
        let secs = std::env::var("HOCUS_TEST_WATCHDOG_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(DEFAULT_SECS);
        let (disarm, disarmed) = mpsc::channel::<()>();
        thread::spawn(move || {
            // Dropping the sender disarms it.
            if disarmed.recv_timeout(Duration::from_secs(secs)) == Err(RecvTimeoutError::Timeout) {
                // One report: the first watchdog to fire ends the process.
                if FIRED.swap(true, Ordering::SeqCst) {
                    return;
                }
                report(secs);
                clean_up();
                std::process::exit(101);
            }
        });
        Self {
            _disarm: disarm,
            daemon,
            id: NEXT.fetch_add(1, Ordering::Relaxed),
        }
    }
}

/// Says what the processes, the daemons and the kernel were doing. Written to the
/// process's standard error directly: the test harness captures `eprintln!` and would
/// lose it at exit.
fn report(secs: u64) {
    let _ = writeln!(
        std::io::stderr(),
        "\nwatchdog: a test held its fixtures over {secs} s: it hangs (HOCUS_TEST_WATCHDOG_SECS sets the bound)\n--- processes ---\n{}",
        output(
            "ps",
            &["-eo", "pid,ppid,stat,wchan:32,etime,args", "--forest"]
        )
    );
    let daemons = DAEMONS.lock().map(|d| d.clone()).unwrap_or_default();
    for (pid, log) in &daemons {
        report_daemon(*pid, log);
    }
    // Tasks blocked in the kernel (an NFS call that never returns), as the kernel tells.
    let _ = fs::write("/proc/sysrq-trigger", "w");
    let _ = writeln!(
        std::io::stderr(),
        "--- blocked tasks (sysrq w) ---\n{}",
        output("sh", &["-c", "dmesg | tail -n 150"])
    );
}

/// Unmounts (lazily) and kills what the fixtures left: no destructor runs at exit.
fn clean_up() {
    let left = LEFT
        .lock()
        .map(|mut l| std::mem::take(&mut *l))
        .unwrap_or_default();
    for (_, leftover) in &left {
        if let Leftover::Mount(path) = leftover {
            let _ = Command::new("umount").arg("-l").arg(path).status();
        }
    }
    for (_, leftover) in &left {
        if let Leftover::Process(pid) = leftover {
            // SAFETY: plain kill(2).
            unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
        }
    }
}

/// What daemon `pid` was doing, and its log.
fn report_daemon(pid: u32, log: &Path) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "--- hocus-agent {pid}'s threads, in the kernel ---");
    if let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            let p = task.path();
            let read = |f: &str| fs::read_to_string(p.join(f)).unwrap_or_default();
            let _ = writeln!(
                err,
                "{} {} {}\n{}",
                task.file_name().to_string_lossy(),
                read("comm").trim(),
                read("wchan"),
                read("stack")
            );
        }
    }
    // Where its threads wait in its own code, if this machine has a debugger.
    let _ = writeln!(
        err,
        "--- hocus-agent {pid}'s threads (gdb) ---\n{}",
        output(
            "timeout",
            &[
                "60",
                "gdb",
                "-p",
                &pid.to_string(),
                "-batch",
                "-ex",
                "thread apply all bt 30",
            ],
        )
    );
    let _ = writeln!(
        err,
        "--- hocus-agent {pid}'s log ---\n{}",
        fs::read_to_string(log).unwrap_or_default()
    );
}

fn output(program: &str, args: &[&str]) -> String {
    match Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
    {
        Ok(o) => format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => format!("({program}: {e})"),
    }
}
