//! One boot of a kernel under QEMU (virtme-ng): the guest runs this machine's root
//! filesystem read-only (over 9p), with a private /tmp, runs one shell command in the
//! checkout as root, and powers off. The command's output comes back through a folder
//! the guest may write (`--rwdir`), line by line as it grows; so does its exit code.

use std::{
    fs,
    io::{Read, Seek, SeekFrom},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use super::{kernels::Kernel, tools};
use crate::host::{target_dir, workspace};

/// What a boot is given.
pub struct Boot<'a> {
    pub kernel: &'a Kernel,
    /// A shell command, run with `sh -c` in the checkout.
    pub command: String,
    /// Variables set for the command (besides PATH and the HOCUS_ and CI ones of this
    /// process, which it inherits).
    pub env: Vec<(String, String)>,
    pub memory_mib: u32,
    pub cpus: u32,
    /// The whole boot, command included, is stopped after this long.
    pub timeout: Duration,
    /// Each line the command prints, as it comes.
    pub on_line: &'a (dyn Fn(&str) + Sync),
}

/// How a boot ended.
pub struct Ended {
    /// The command's exit code; None if the guest never got to finish it (a panic, a
    /// hang stopped by the timeout): `console` says why.
    pub code: Option<i32>,
    pub console: PathBuf,
    pub took: Duration,
}

/// Boots, runs the command with its output given to `boot.on_line` as it comes, and
/// powers off.
pub fn run(boot: &Boot) -> Result<Ended> {
    let vng = tools::vng()?;
    let dir = run_dir()?;
    let out = dir.join("out");
    let rc = dir.join("rc");
    let script = dir.join("guest.sh");
    fs::write(&out, "")?;
    fs::write(&script, guest_script(boot, &out, &rc))?;
    let console = dir.join("console.log");
    let started = Instant::now();
    let mut cmd = Command::new(&vng);
    cmd.env("PATH", tools::path_with_vng())
        .arg("--verbose")
        .args(tools::accel(boot.kernel.series))
        .arg("-r")
        .arg(&boot.kernel.image)
        .args(["--memory", &format!("{}M", boot.memory_mib)])
        .args(["--cpus", &boot.cpus.to_string()])
        .arg(format!("--rwdir={}", dir.display()))
        .arg("--cwd")
        .arg(workspace())
        .arg("--")
        .arg(format!("sh {}", script.display()))
        .stdin(Stdio::null())
        .stdout(fs::File::create(&console)?)
        .stderr(fs::File::create(dir.join("vng.err"))?);
    // Its own process group: a timeout stops QEMU with it.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", vng.display()))?;
    let done = AtomicBool::new(false);
    thread::scope(|scope| -> Result<()> {
        let printer = scope.spawn(|| follow(&out, &done, boot.on_line));
        let waited = wait(&mut child, boot, &dir.join("vng.err"));
        done.store(true, Ordering::Relaxed);
        let _ = printer.join();
        waited
    })?;
    // Even a guest stopped may have written its code before it hung.
    let code = fs::read_to_string(&rc)
        .ok()
        .and_then(|s| s.trim().parse().ok());
    Ok(Ended {
        code,
        console,
        took: started.elapsed(),
    })
}

/// Waits for the guest to power off; stops it past its timeout or once its kernel
/// reports a lockup.
fn wait(child: &mut std::process::Child, boot: &Boot, kernel_log: &Path) -> Result<()> {
    let started = Instant::now();
    let (mut locked_up, mut looked, mut read) = (None, Instant::now(), 0);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if looked.elapsed() > Duration::from_secs(5) {
            looked = Instant::now();
            locked_up = lockup(kernel_log, &mut read);
        }
        if started.elapsed() > boot.timeout || locked_up.is_some() {
            // SAFETY: plain kill(2) of the group we made.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(200));
    };
    if let Some(line) = &locked_up {
        eprintln!(
            "vm: the guest's kernel locked up ({line}); stopped. Its kernel log: {}",
            kernel_log.display()
        );
    } else if status.is_none() {
        eprintln!(
            "vm: the guest ran past {} s and was stopped",
            boot.timeout.as_secs()
        );
    }
    Ok(())
}

/// The guest kernel's report of a CPU stuck for two minutes or more, if its log has one:
/// a guest that will never finish (nothing in it runs to say so), stopped at once
/// rather than at the timeout.
/// Reads on from byte `read` of the log (moved past the whole lines read), so that a
/// long boot's log is read once.
fn lockup(kernel_log: &Path, read: &mut u64) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = fs::File::open(kernel_log).ok()?;
    file.seek(SeekFrom::Start(*read)).ok()?;
    let mut more = Vec::new();
    file.read_to_end(&mut more).ok()?;
    let whole = more.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    *read += whole as u64;
    String::from_utf8_lossy(&more[..whole])
        .lines()
        .filter(|l| l.contains("soft lockup - CPU#"))
        .find(|l| {
            l.split("stuck for ")
                .nth(1)
                .and_then(|rest| rest.split('s').next())
                .and_then(|n| n.parse::<u64>().ok())
                .is_some_and(|secs| secs >= 120)
        })
        .map(|l| l.trim().to_owned())
}

/// A fresh folder for one boot's script, output and console, under `target/vm/runs`
/// (the guest sees the checkout).
fn run_dir() -> Result<PathBuf> {
    let runs = target_dir().join("vm/runs");
    fs::create_dir_all(&runs)?;
    // The last few are kept, to read a console after the fact.
    let mut old: Vec<_> = fs::read_dir(&runs)?.flatten().map(|e| e.path()).collect();
    old.sort();
    for dir in old.iter().rev().skip(8) {
        let _ = fs::remove_dir_all(dir);
    }
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis();
    // Guests boot side by side: the same millisecond, the same process.
    static BOOTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let boot = BOOTS.fetch_add(1, Ordering::Relaxed);
    let dir = runs.join(format!("{stamp}-{}-{boot}", std::process::id()));
    fs::create_dir(&dir)?;
    Ok(dir)
}

/// The host's PATH for the guest, without pyenv's directories: its `python3` is a
/// shell script that runs pyenv, and its interpreter compiles its standard library
/// again at every start (no bytecode it may write there), which under emulation took
/// 14-24 s and 8 s per `python3 -c pass` against 0.9 s for the system's python3
/// (Debian's, with its bytecode; what the jobs of users other than root run anyway).
/// The packages the tests import (/opt/hocus-tests) are built for the same 3.11.
fn guest_path(host: &str) -> String {
    std::env::split_paths(host)
        .filter(|d| !d.components().any(|c| c.as_os_str() == ".pyenv"))
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(":")
}

/// The guest's side: the environment, the command, its output and exit code into the
/// shared folder. The guest's root is read-only but for /tmp and a few overlays.
fn guest_script(boot: &Boot, out: &Path, rc: &Path) -> String {
    let mut s = String::from("#!/bin/sh\n");
    s += &format!("exec >>{} 2>&1\n", quote(&out.display().to_string()));
    let inherited = std::env::vars()
        .filter(|(k, _)| {
            k == "PATH" || k == "CI" || k == "RUST_BACKTRACE" || k.starts_with("HOCUS_")
        })
        .map(|(k, v)| {
            if k == "PATH" {
                (k, guest_path(&v))
            } else {
                (k, v)
            }
        });
    for (k, v) in inherited.chain(boot.env.iter().cloned()) {
        s += &format!("export {k}={}\n", quote(&v));
    }
    // The tests' bounds on what should happen soon are longer there (`patience`).
    if tools::emulated() {
        s += &format!("export {}=1\n", hocus_tests::EMULATED);
    }
    // What the tests and the daemon expect of a machine, as on the host.
    s += "mountpoint -q /sys/kernel/tracing || mount -t tracefs none /sys/kernel/tracing\n";
    s += "ip link set lo up 2>/dev/null\n";
    // An address besides loopback: Slurm resolves even "127.0.0.1" with AI_ADDRCONFIG,
    // which finds no IPv4 family on a machine that has only loopback.
    s += "ip link add hocus0 type dummy 2>/dev/null && ip addr add 10.254.0.1/24 dev hocus0 && ip link set hocus0 up\n";
    s += &format!("cd {}\n", quote(&workspace().display().to_string()));
    // virtio-fs unless virtme-ng fell back to 9p (no virtiofsd): the guests' speed.
    s += "echo \"vm: the guest's root is on $(findmnt -no FSTYPE /)\"\n";
    // Before the host stops a guest that runs too long, what it was doing.
    let watchdog = boot.timeout.as_secs().saturating_sub(90).max(30);
    s += &format!("( sleep {watchdog}; {DIAGNOSE} ) &\n");
    s += &format!("sh -c {}\n", quote(&boot.command));
    s += &format!("echo $? > {}\n", quote(&rc.display().to_string()));
    s += "sync\n";
    s
}

/// What the guest says when its command runs long: the processes, and where the
/// threads of hocus's are in the kernel.
const DIAGNOSE: &str = r#"echo "== the guest ran long; its processes:"; ps axf -o pid,stat,wchan:30,args; for p in $(pgrep -f hocus); do for t in /proc/$p/task/*; do echo "$t $(cat $t/comm) $(head -4 $t/stack | tr '
' ' ')"; done; done"#;

/// Single-quoted for sh.
pub fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Gives each line the guest writes to `path` to `on_line` as it comes, until `done`
/// and all is out (a last line without its newline too).
fn follow(path: &Path, done: &AtomicBool, on_line: &(dyn Fn(&str) + Sync)) {
    let Ok(mut file) = fs::File::open(path) else {
        return;
    };
    let mut at = 0;
    let mut buf = vec![0u8; 1 << 16];
    let mut line = Vec::new();
    loop {
        let finished = done.load(Ordering::Relaxed);
        let _ = file.seek(SeekFrom::Start(at));
        while let Ok(n) = file.read(&mut buf) {
            if n == 0 {
                break;
            }
            at += n as u64;
            for &b in &buf[..n] {
                if b == b'\n' {
                    on_line(&String::from_utf8_lossy(&line));
                    line.clear();
                } else {
                    line.push(b);
                }
            }
        }
        if finished {
            if !line.is_empty() {
                on_line(&String::from_utf8_lossy(&line));
            }
            return;
        }
        thread::sleep(Duration::from_millis(250));
    }
}

/// The console's last lines, for a guest that did not finish its command.
pub fn console_tail(console: &Path, lines: usize) -> String {
    let text = fs::read_to_string(console).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Fails unless the boot's command ran and exited 0.
pub fn check(ended: &Ended, what: &str) -> Result<()> {
    match ended.code {
        Some(0) => Ok(()),
        Some(code) => bail!("{what} exited with {code} in the guest"),
        None => bail!(
            "{what}: the guest never finished it; its console ended with:\n{}\n(all of it: {})",
            console_tail(&ended.console, 30),
            ended.console.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_stuck_two_minutes_is_a_lockup_and_less_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("vng.err");
        let line = |secs| {
            format!(
                "[  148.576480] watchdog: BUG: soft lockup - CPU#0 stuck for {secs}s! [a_change_on_the:126]\n"
            )
        };
        // The last line is still being written: read once whole.
        let (before, cut) = (format!("boot\n{}{}", line(45), line(105)), line(131));
        fs::write(&log, format!("{before}{}", &cut[..60])).unwrap();
        let mut read = 0;
        assert_eq!(lockup(&log, &mut read), None);
        assert_eq!(read, before.len() as u64);
        fs::write(&log, format!("{before}{cut}")).unwrap();
        assert!(lockup(&log, &mut read).unwrap().contains("stuck for 131s"));
        assert_eq!(lockup(&log, &mut read), None, "read once");
        assert_eq!(lockup(&dir.path().join("none"), &mut 0), None);
    }
}
