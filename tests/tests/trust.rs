//! The root daemon against its own users: each test makes an attack an ordinary user
//! could make, shows it was really attempted, then that nothing outside the cache changed
//! and the daemon still serves everyone (docs/security.md).

use std::{
    collections::BTreeMap,
    fs,
    os::unix::{fs::PermissionsExt, process::CommandExt},
    path::{Path, PathBuf},
    time::Duration,
};

use hocus_tests::{Agent, NetworkMount, assert_success, read_all, test_user, wait_until};
use serde_json::{Value, json};

/// Every file under `dir` with its content: what "unchanged" means for a victim tree.
fn contents(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                stack.push(p);
            } else {
                out.insert(p.display().to_string(), fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// Every file in the cache directory whose content is `needle`.
fn cache_holding(cache: &Path, needle: &[u8]) -> Vec<String> {
    contents(cache)
        .into_iter()
        .filter(|(_, c)| c == needle)
        .map(|(p, _)| p)
        .collect()
}

#[test]
fn a_profile_with_dotdot_and_a_symlink_cannot_touch_anything_outside_the_cache() {
    let net = NetworkMount::start();
    let (uid, gid) = test_user();
    let mount = net.mount.to_str().unwrap().to_owned();
    // Root's tree outside the cache and outside every watched tree: what the attack aims
    // at (0700: no ordinary user can read it).
    let victim = tempfile::Builder::new()
        .prefix("hocus-victim-")
        .tempdir()
        .unwrap();
    let secret = b"root's secret module\n";
    fs::create_dir_all(victim.path().join("lib")).unwrap();
    fs::write(victim.path().join("lib/x.py"), secret).unwrap();
    fs::write(victim.path().join("lib/y.py"), b"y = 2\n").unwrap();
    let before = contents(victim.path());

    // This sshfs answers EPERM to every readlink, so the symlink half of the attack is
    // made in a second watched tree on a local filesystem, where symlinks work (as on
    // NFS): the user's own directory there, with a symlink of theirs to the victim.
    let share = tempfile::Builder::new()
        .prefix("hocus-share-")
        .tempdir()
        .unwrap();
    fs::set_permissions(share.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let proj = share.path().join("proj");
    fs::create_dir(&proj).unwrap();
    std::os::unix::fs::chown(&proj, Some(uid), Some(gid)).unwrap();
    let link = proj.join("link");
    let made = std::process::Command::new("ln")
        .arg("-s")
        .arg(victim.path())
        .arg(&link)
        .uid(uid)
        .gid(gid)
        .status()
        .unwrap();
    assert!(made.success(), "the user made the symlink");
    assert_eq!(
        fs::read(link.join("lib/x.py")).unwrap(),
        secret,
        "it reaches the victim"
    );

    let good = net.put("proj/good.py", b"ok = 1\n");
    let share_path = share.path().to_str().unwrap().to_owned();
    let agent = Agent::start(&[
        "--watch",
        &mount,
        "--watch",
        &share_path,
        "--revalidate",
        "2",
    ]);
    read_all(&good);

    // The profile the user writes: `..` out of the network tree, through the symlink
    // (with its directory marked written, so a snapshot would start at the link), and
    // one honest entry.
    let up = "../".repeat(net.mount.components().count() + 2);
    let escape = format!("{mount}/proj/{up}{}", victim.path().join("lib").display());
    let through = link.join("lib").display().to_string();
    let entry = |path: String| json!({"path": path, "size": 21, "opens": 50, "bytes_read": 2100, "first_touch_ns": 1, "written": false, "uids": [uid]});
    let profile = json!({
        "version": 1,
        "started_unix_ns": 1,
        "files": [
            entry(format!("{escape}/x.py")),
            entry(format!("{through}/x.py")),
            entry(good.display().to_string()),
        ],
        "missing": [
            {"path": format!("{escape}/nope.py"), "lookups": 99, "first_touch_ns": 1},
            {"path": format!("{through}/nope.py"), "lookups": 99, "first_touch_ns": 1},
        ],
        "dirs": [{"path": proj.display().to_string(), "opens": 1, "mutated": true}],
    });
    let work = tempfile::tempdir().unwrap();
    fs::set_permissions(work.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let file = work.path().join("evil.json");
    fs::write(&file, serde_json::to_vec(&profile).unwrap()).unwrap();
    let as_user = |args: &[&str]| {
        agent
            .cli(args)
            .current_dir(work.path())
            .uid(uid)
            .gid(gid)
            .output()
            .unwrap()
    };
    let out = as_user(&["profile", "import", file.to_str().unwrap()]);
    assert_success(&out);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("refused 2 entries"), "{said}");
    assert!(
        said.contains(&format!("{escape}/x.py: has a . or .. component")),
        "{said}"
    );
    assert!(said.contains(&format!("{escape}/nope.py")), "{said}");
    let out = as_user(&["prefetch", "--profile", file.to_str().unwrap()]);
    assert_success(&out);

    // Placement, copies, snapshot choices and revalidations have had their turn.
    agent.settled();
    agent.wait_for_revalidations(2);
    agent.settled();

    assert_eq!(
        contents(victim.path()),
        before,
        "the victim tree is untouched"
    );
    assert!(
        cache_holding(&agent.cache_dir, secret).is_empty(),
        "no copy of root's file is in the cache"
    );
    let log = agent.log();
    // A snapshot of a tree through the symlink is tried (the profile names it) and
    // refused by the walk's first open, which follows no symlink; none is ever held.
    let link_path = link.display().to_string();
    assert!(
        !log.lines()
            .any(|l| l.contains(" in place") && l.contains(&link_path)),
        "root walked a tree through the user's symlink:\n{log}"
    );
    let snapshots = agent.cache()["snapshots"].to_string();
    assert!(
        !snapshots.contains(&link_path),
        "a snapshot through the user's symlink: {snapshots}"
    );
    let exported: Value = agent.export();
    let paths: Vec<&str> = exported["files"]
        .as_array()
        .unwrap()
        .iter()
        .chain(exported["missing"].as_array().unwrap())
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    assert!(
        paths.iter().all(|p| !p.contains("..")),
        "no `..` path entered the profile: {paths:?}"
    );
    assert!(
        paths.contains(&good.to_str().unwrap()),
        "the honest entry was kept"
    );
    assert!(log.contains("refused 2 entries of a profile from uid"));
    // The daemon still serves, this user and others.
    assert_success(&as_user(&["status"]));
    agent.status();
}

#[test]
fn a_failed_write_marks_nothing_written_and_drops_no_copy() {
    let net = NetworkMount::start();
    let (uid, gid) = test_user();
    let file = net.put("env/lib.py", b"x = 1\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    read_all(&file);
    agent.settled();
    assert!(agent.local_copy(&file).exists(), "the file is copied");
    // A write and a truncate on a descriptor opened for reading: both fail.
    let script = format!(
        "import os\nfd = os.open({:?}, os.O_RDONLY)\n\
         for attempt in (lambda: os.write(fd, b'y'), lambda: os.ftruncate(fd, 0)):\n    \
         try:\n        attempt()\n        print('succeeded')\n    \
         except OSError as e:\n        print('failed', e.errno)\nos.close(fd)\n",
        file.display().to_string()
    );
    let out = std::process::Command::new("python3")
        .args(["-c", &script])
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    assert_success(&out);
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(said.lines().count(), 2, "{said}");
    assert!(
        said.lines().all(|l| l.starts_with("failed")),
        "the attempts failed: {said}"
    );
    let profile = agent.export();
    let entry = hocus_tests::file_entry(&profile, &file).expect("in the profile");
    assert_eq!(
        entry["written"], false,
        "a failed write is not a write: {entry}"
    );
    let c = agent.settled();
    assert_eq!(c["invalidations"], 0, "{c}");
    assert!(agent.local_copy(&file).exists(), "the copy stays");
}

/// A 32-bit syscall (`int 0x80`, open to any process here) has other numbers and
/// registers than a 64-bit one: getrlimit is 76 there, truncate is 76 here, and a 64-bit
/// reading would take `rdi` as its path.
const IA32_GETRLIMIT_AS_TRUNCATE: &str = r#"
#define _GNU_SOURCE
#include <stdio.h>
#include <sys/mman.h>
int main(int argc, char **argv) {
    /* getrlimit writes where ecx points: memory below 4 GiB */
    char *low = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_32BIT, -1, 0);
    if (low == MAP_FAILED || argc < 2) return 2;
    long ok = 0;
    for (int i = 0; i < 100; i++) {
        long ret;
        __asm__ volatile("int $0x80"
                         : "=a"(ret)
                         : "a"(76L), "b"(0L), "c"(low), "D"(argv[1]), "S"(0L)
                         : "memory", "r8", "r9", "r10", "r11");
        ok += ret == 0;
    }
    printf("%ld\n", ok);
    return ok == 100 ? 0 : 1;
}
"#;

#[test]
fn a_32_bit_syscall_is_not_read_as_a_64_bit_one() {
    let net = NetworkMount::start();
    let victim = net.put("env/victim.py", b"x = 1\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    read_all(&victim);
    agent.settled();
    assert!(agent.local_copy(&victim).exists(), "the file is copied");
    // An ordinary user makes 100 successful 32-bit getrlimit calls with the victim's
    // path in rdi: read as 64-bit syscalls, each would be a successful truncate of it.
    let dir = tempfile::tempdir().unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let (source, binary) = (dir.path().join("attack.c"), dir.path().join("attack"));
    fs::write(&source, IA32_GETRLIMIT_AS_TRUNCATE).unwrap();
    let built = std::process::Command::new("cc")
        .arg("-O1")
        .arg("-o")
        .arg(&binary)
        .arg(&source)
        .output()
        .unwrap();
    assert_success(&built);
    let (uid, gid) = test_user();
    let out = std::process::Command::new(&binary)
        .arg(&victim)
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    assert_success(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "100");
    // The export reads the ring buffer first: whatever was sent is in it.
    let profile = agent.export();
    let entry = hocus_tests::file_entry(&profile, &victim).expect("in the profile");
    assert_eq!(entry["written"], false, "{entry}");
    let c = agent.settled();
    assert_eq!(c["invalidations"], 0, "{c}");
    assert!(agent.local_copy(&victim).exists(), "the copy stays");
    assert_eq!(fs::read(&victim).unwrap(), b"x = 1\n");
}

/// Runs a Python script as the test user, with the daemon's socket as argv[1].
fn python_as_user(agent: &Agent, script: &str) -> String {
    let (uid, gid) = test_user();
    let out = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(&agent.socket)
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    assert_success(&out);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Starts `argv` as root with the process id `pid` (free by now), steering the kernel's
/// next pid through ns_last_pid, as a pid reused by chance would be.
fn spawn_with_pid(pid: i32, argv: &[&str]) -> std::process::Child {
    for _ in 0..200 {
        fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).unwrap();
        let mut child = std::process::Command::new(argv[0])
            .args(&argv[1..])
            .spawn()
            .unwrap();
        if child.id() as i32 == pid {
            return child;
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    panic!("no process could be given pid {pid}");
}

fn open_descriptors(pid: u32) -> usize {
    fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

#[test]
fn descriptors_beyond_those_a_request_takes_are_refused_and_closed() {
    let net = NetworkMount::start();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    agent.status();
    let before = open_descriptors(agent.pid());
    // 30 status requests carrying 3 descriptors each, and 30 carrying 250 (near the most
    // one message can carry).
    let said = python_as_user(
        &agent,
        r#"
import os, socket, sys
null = os.open("/dev/null", os.O_RDONLY)
for n in [3] * 30 + [250] * 30:
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    socket.send_fds(s, [b'{"request":"status"}\n'], [null] * n)
    print(n, s.makefile().readline().strip())
    s.close()
# A profile "file" that is a pipe nobody writes: refused at once, not read forever.
r, w = os.pipe()
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
socket.send_fds(s, [b'{"request":"import"}\n'], [r])
print("pipe", s.makefile().readline().strip())
"#,
    );
    let mut lines: Vec<&str> = said.lines().collect();
    let pipe = lines.pop().unwrap_or_default();
    assert!(pipe.contains("regular file"), "{pipe}");
    assert_eq!(lines.len(), 60, "{said}");
    for line in &lines[..30] {
        assert!(line.contains("takes 0 descriptors, not 3"), "{line}");
    }
    for line in &lines[30..] {
        assert!(line.contains("at most 3 descriptors, not 250"), "{line}");
    }
    let after = open_descriptors(agent.pid());
    assert!(
        after <= before + 4,
        "the daemon kept descriptors it was sent: {before} before, {after} after"
    );
    let status = agent.status();
    assert_eq!(
        status["control"]["refused"]["wrong_descriptors"], 60,
        "{status:#}"
    );
}

#[test]
fn a_flood_of_idle_and_huge_requests_is_capped_and_everyone_else_is_still_served() {
    let net = NetworkMount::start();
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--max-clients-per-user",
        "8",
    ]);
    agent.status();
    // As one ordinary user: 20 connections that never send a request, then a request
    // line of 300 MiB.
    let flood = r#"
import socket, sys, time
idle = []
for _ in range(20):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    idle.append(s)
time.sleep(1)
refused = 0
for s in idle:
    s.settimeout(0.2)
    try:
        if b"too many clients" in s.recv(4096):
            refused += 1
    except socket.timeout:
        pass
print("refused", refused)
sys.stdout.flush()
# Those admitted are dropped after the request timeout (10 s).
for s in idle:
    s.settimeout(15)
closed = 0
for s in idle:
    try:
        s.recv(4096)
        closed += 1
    except socket.timeout:
        pass
print("closed", closed)
big = socket.socket(socket.AF_UNIX)
big.connect(sys.argv[1])
chunk = b"x" * (1 << 20)
sent = 0
try:
    for _ in range(300):
        big.sendall(chunk)
        sent += len(chunk)
except OSError:
    pass
print("sent_mib", sent >> 20)
"#;
    let flooding = {
        let agent_socket = agent.socket.clone();
        let (uid, gid) = test_user();
        std::process::Command::new("python3")
            .args(["-c", flood])
            .arg(agent_socket)
            .uid(uid)
            .gid(gid)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Meanwhile root (another user) is served.
    std::thread::sleep(Duration::from_secs(2));
    let started = std::time::Instant::now();
    let status = agent.status();
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "status took {took:?} during the flood"
    );
    assert_eq!(status["control"]["max_clients_per_user"], 8);
    let out = flooding.wait_with_output().unwrap();
    assert!(out.status.success());
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("refused 12\n"),
        "8 admitted, 12 refused: {said}"
    );
    assert!(
        said.contains("closed 20\n"),
        "every idle connection was closed: {said}"
    );
    let sent: u64 = said
        .lines()
        .find_map(|l| l.strip_prefix("sent_mib "))
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(
        sent < 64,
        "the daemon stopped reading a huge request early ({sent} MiB)"
    );
    let status = agent.status();
    let refused = &status["control"]["refused"];
    assert_eq!(refused["too_many_clients_of_user"], 12, "{status:#}");
    assert_eq!(refused["timeout"], 8, "{status:#}");
    assert_eq!(refused["too_large"], 1, "{status:#}");
    assert_eq!(
        status["control"]["clients"], 1,
        "only this status is connected"
    );
    let metrics = agent.metrics();
    assert!(
        metrics.contains("hocus_control_refused_total{reason=\"too_many_clients_of_user\"} 12"),
        "{metrics}"
    );
}

#[test]
fn signals_are_never_forwarded_after_the_job_is_reaped() {
    let net = NetworkMount::start();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    agent.status();
    let (uid, gid) = test_user();
    // A raw client: runs `true`, waits for the word, then sends SIGTERM for its job.
    let client = r#"
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
null = os.open("/dev/null", os.O_RDWR)
req = {"request": "run", "argv": ["true"], "env": [], "cwd": "/"}
socket.send_fds(s, [json.dumps(req).encode() + b"\n"], [null, null, null])
f = s.makefile()
for line in f:
    r = json.loads(line)
    if r["response"] == "started":
        print("pid", r["pid"], flush=True)
    if r["response"] == "exited":
        break
print("exited", flush=True)
sys.stdin.readline()
try:
    for _ in range(5):
        s.sendall(b'{"signal": 15}\n')
    print("sent", flush=True)
except OSError:
    print("closed", flush=True)
sys.stdin.readline()
"#;
    let mut attacker = std::process::Command::new("python3")
        .args(["-c", client])
        .arg(&agent.socket)
        .uid(uid)
        .gid(gid)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut from = std::io::BufReader::new(attacker.stdout.take().unwrap());
    let mut to = attacker.stdin.take().unwrap();
    let mut line = String::new();
    use std::io::{BufRead, Write};
    from.read_line(&mut line).unwrap();
    let pid: i32 = line
        .strip_prefix("pid ")
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no pid: {line:?}"));
    line.clear();
    from.read_line(&mut line).unwrap();
    assert_eq!(line, "exited\n");
    // The job is reaped: its pid, and so its process group id, is free. Another user's
    // process now takes it (the next pid is steered to it through ns_last_pid).
    let mut victim = spawn_with_pid(pid, &["setsid", "sleep", "60"]);
    std::thread::sleep(Duration::from_millis(300));
    writeln!(to, "go").unwrap();
    line.clear();
    from.read_line(&mut line).unwrap();
    // Sent, or refused because the daemon had closed the session: either way attempted.
    assert!(line == "sent\n" || line == "closed\n", "{line:?}");
    std::thread::sleep(Duration::from_secs(1));
    let alive = victim.try_wait().unwrap().is_none();
    writeln!(to, "done").unwrap();
    let _ = attacker.wait();
    let _ = victim.kill();
    let _ = victim.wait();
    assert!(
        alive,
        "the daemon signalled another process after the job was reaped"
    );
    agent.status();
}

/// The daemon's children that are zombies (exited, never reaped).
fn zombies_of(pid: u32) -> usize {
    fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| fs::read_to_string(e.path().join("stat")).ok())
        .filter(|stat| {
            // pid (comm) state ppid ...: comm may hold spaces, so split after its ')'.
            let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
            let mut fields = after.split_whitespace();
            let state = fields.next();
            let ppid = fields.next().and_then(|p| p.parse::<u32>().ok());
            state == Some("Z") && ppid == Some(pid)
        })
        .count()
}

#[test]
fn a_run_whose_client_hangs_up_or_whose_job_cannot_start_leaves_no_zombie_and_no_job() {
    let net = NetworkMount::start();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    agent.status();
    let before = open_descriptors(agent.pid());
    // As an ordinary user: 10 runs whose client hangs up as soon as it has asked, and 10
    // of a program that does not exist.
    let said = python_as_user(
        &agent,
        r#"
import json, os, socket, sys
null = os.open("/dev/null", os.O_RDWR)
for argv in [["sleep", "1"]] * 10 + [["/nonexistent/program"]] * 10:
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    req = {"request": "run", "argv": argv, "env": [], "cwd": "/"}
    socket.send_fds(s, [json.dumps(req).encode() + b"\n"], [null, null, null])
    if argv[0] == "sleep":
        s.close()
    else:
        print(s.makefile().readline().strip())
"#,
    );
    assert_eq!(said.lines().count(), 10, "{said}");
    assert!(said.lines().all(|l| l.contains("cannot start")), "{said}");
    // The hung-up jobs were hung up (SIGHUP) or ran their second; either way, all end.
    hocus_tests::wait_until(30, "every job reaped and forgotten", || {
        zombies_of(agent.pid()) == 0 && agent.status()["cache"]["jobs_running"] == 0
    });
    let status = agent.status();
    assert_eq!(zombies_of(agent.pid()), 0, "every job was reaped");
    assert_eq!(
        status["cache"]["jobs_running"], 0,
        "every job was forgotten: {status:#}"
    );
    assert_eq!(status["cache"]["jobs_started"], 20, "{status:#}");
    let after = open_descriptors(agent.pid());
    assert!(
        after <= before + 4,
        "the daemon kept descriptors of ended jobs: {before} before, {after} after"
    );
}

/// `hocus-agent run -- ARGS` as the test user, through `wrapper` (a command line put in
/// front of hocus-agent, e.g. `setpriv --no-new-privs`).
fn run_as_user_through(agent: &Agent, wrapper: &[&str], args: &[&str]) -> std::process::Output {
    let (uid, gid) = test_user();
    let bin = hocus_tests::agent_bin();
    let mut cmd = std::process::Command::new(wrapper[0]);
    cmd.args(&wrapper[1..])
        .arg(bin)
        .arg("--socket")
        .arg(&agent.socket)
        .args(["run", "--"])
        .args(args)
        .current_dir("/")
        .uid(uid)
        .gid(gid);
    cmd.output().unwrap()
}

#[test]
fn a_caller_under_no_new_privs_gets_a_job_under_no_new_privs() {
    let net = NetworkMount::start();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    let plain = run_as_user_through(
        &agent,
        &["env"],
        &["grep", "NoNewPrivs", "/proc/self/status"],
    );
    assert_success(&plain);
    assert!(String::from_utf8_lossy(&plain.stdout).contains("NoNewPrivs:\t0"));
    let confined = run_as_user_through(
        &agent,
        &["setpriv", "--no-new-privs"],
        &["grep", "NoNewPrivs", "/proc/self/status"],
    );
    assert_success(&confined);
    let said = String::from_utf8_lossy(&confined.stdout);
    assert!(
        said.contains("NoNewPrivs:\t1"),
        "the job keeps its caller's confinement: {said}"
    );
}

#[test]
fn a_caller_under_seccomp_or_in_another_namespace_gets_no_job() {
    let net = NetworkMount::start();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    let marker = tempfile::tempdir().unwrap();
    fs::set_permissions(marker.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let ran = marker.path().join("ran");
    let touch = ["touch", ran.to_str().unwrap()];
    // A seccomp filter (allowing everything, but a filter all the same), then exec.
    let seccomp = r#"
import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
code = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0x7FFF0000))  # RET ALLOW
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
prog = Prog(1, ctypes.addressof(code))
assert libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0  # PR_SET_SECCOMP, MODE_FILTER
os.execvp(sys.argv[1], sys.argv[1:])
"#;
    let out = run_as_user_through(&agent, &["python3", "-c", seccomp], &touch);
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("seccomp filter"), "{said}");
    // An unprivileged user namespace of the caller's own.
    let out = run_as_user_through(&agent, &["unshare", "--user", "--map-root-user"], &touch);
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("another user namespace"), "{said}");
    assert!(!ran.exists(), "no job ran");
    // The same caller, unconfined, gets its job.
    assert_success(&run_as_user_through(&agent, &["env"], &touch));
    assert!(ran.exists());
}

#[test]
fn a_callers_pid_taken_by_another_process_before_its_job_starts_gives_no_job() {
    // The daemon's own choice of route: the socket's pidfd from Linux 6.5 on.
    let route = if hocus_tests::kernel_at_least(6, 5) {
        "(SO_PEERPIDFD)"
    } else {
        "(no SO_PEERPIDFD: before 6.5) (fallback)"
    };
    pid_taken_before_the_job_starts(Agent::start, route);
}

/// The same where the socket does not hand out the caller's pidfd (before 6.5): the
/// daemon takes one of its pid as it accepts the connection.
#[test]
fn a_callers_pid_taken_by_another_process_gives_no_job_without_peer_pidfds() {
    pid_taken_before_the_job_starts(
        |args| Agent::start_with_fallbacks("peer-pidfd", args),
        "a pidfd of their pid taken as the connection is accepted",
    );
}

/// `route`: how the daemon says it knows who a caller is.
fn pid_taken_before_the_job_starts(start: fn(&[&str]) -> Agent, route: &str) {
    let net = NetworkMount::start();
    let agent = start(&["--watch", net.mount.to_str().unwrap()]);
    assert!(agent.log().contains(route), "{}", agent.log());
    agent.status();
    let (uid, gid) = test_user();
    // The process that connects (P) hands the connection to its child (Q) and exits;
    // Q asks for a job that prints its open-files limit once a root process with a
    // limit of its own has taken P's pid.
    let client = r#"
import json, os, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
if os.fork() == 0:
    # Told (a file appears) once P has exited and its pid is taken; stdin is P's alone.
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
    req = {"request": "run", "argv": ["sh", "-c", "ulimit -n"], "env": [], "cwd": "/"}
    socket.send_fds(s, [json.dumps(req).encode() + b"\n"], [0, 1, 2])
    for line in s.makefile():
        r = json.loads(line)
        if r["response"] in ("exited", "error"):
            print(r["response"], r.get("message", ""), flush=True)
            break
    sys.exit(0)
print(os.getpid(), flush=True)
sys.stdin.readline()   # hold on until the daemon has read who connected
"#;
    use std::io::{BufRead, Write};
    let signals = tempfile::tempdir().unwrap();
    fs::set_permissions(signals.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let go = signals.path().join("go");
    let mut attacker = std::process::Command::new("python3")
        .args(["-c", client])
        .arg(&agent.socket)
        .arg(&go)
        .uid(uid)
        .gid(gid)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut from = std::io::BufReader::new(attacker.stdout.take().unwrap());
    let mut line = String::new();
    from.read_line(&mut line).unwrap();
    let pid: i32 = line.trim().parse().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    // P goes (its child keeps the connection), and a root process takes its pid.
    let mut to = attacker.stdin.take().unwrap();
    writeln!(to, "go").unwrap();
    attacker.wait().unwrap();
    let mut victim = spawn_with_pid(pid, &["prlimit", "--nofile=4242:4242", "sleep", "30"]);
    // prlimit sets the limit, then execs sleep: under emulation that took over 300 ms.
    wait_until(
        10,
        "the pid to be the root process's, with its limit",
        || fs::read_to_string(format!("/proc/{pid}/limits")).is_ok_and(|l| l.contains("4242")),
    );
    // Q now asks; its answer (and its job's output, if any) comes on the same stdout.
    fs::write(&go, b"").unwrap();
    let mut said = String::new();
    for _ in 0..2 {
        let mut l = String::new();
        if from.read_line(&mut l).unwrap_or(0) == 0 {
            break;
        }
        said.push_str(&l);
        if l.starts_with("exited") || l.starts_with("error") {
            break;
        }
    }
    let _ = victim.kill();
    let _ = victim.wait();
    assert!(
        !said.contains("4242"),
        "the job got another process's limits: {said}"
    );
    assert!(said.contains("error"), "the request was refused: {said}");
    assert!(said.contains("exited before"), "{said}");
}

/// `cat PATH` in a `hocus-agent run` job as the test user: what it printed, or None if
/// it could not read it.
fn cat_in_job(agent: &Agent, path: &Path) -> Option<String> {
    let out = run_as_user_through(agent, &["env"], &["cat", path.to_str().unwrap()]);
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn copies_and_snapshots_keep_acls_and_a_permission_change_reaches_jobs() {
    let net = NetworkMount::start();
    let (uid, _) = test_user();
    // ACLs need a filesystem that has them (sshfs has none): a second watched tree on
    // the local disk, as an NFS export with ACLs would be.
    let share = tempfile::Builder::new()
        .prefix("hocus-share-")
        .tempdir()
        .unwrap();
    fs::set_permissions(share.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let env = share.path().join("env");
    fs::create_dir_all(env.join("lib")).unwrap();
    fs::write(env.join("lib/x.py"), b"hidden = 1\n").unwrap();
    fs::write(env.join("top.py"), b"top = 1\n").unwrap();
    // The user may not enter lib/: an ACL entry, not the mode, says so.
    let acl = std::process::Command::new("setfacl")
        .args(["-m", &format!("u:{uid}:---")])
        .arg(env.join("lib"))
        .status()
        .expect("setfacl (cargo xtask setup installs acl)");
    assert!(acl.success());
    let public = net.put("pub/pub.py", b"pub = 1\n");
    let share_path = share.path().to_str().unwrap().to_owned();
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--watch",
        &share_path,
        "--revalidate",
        "2",
    ]);
    read_all(&env.join("lib/x.py"));
    read_all(&env.join("top.py"));
    assert!(fs::metadata(env.join("lib/nope.py")).is_err());
    read_all(&public);
    hocus_tests::wait_until(60, "a snapshot of env", || {
        agent
            .log()
            .contains(&format!("snapshot of {} in place", env.display()))
    });
    agent.settled();
    assert_eq!(
        cat_in_job(&agent, &env.join("top.py")).as_deref(),
        Some("top = 1\n")
    );
    assert_eq!(
        cat_in_job(&agent, &env.join("lib/x.py")),
        None,
        "the snapshot kept the ACL that keeps the user out of lib/"
    );
    assert_eq!(cat_in_job(&agent, &public).as_deref(), Some("pub = 1\n"));

    // Permissions taken away at the source reach the next job within a revalidation.
    fs::set_permissions(env.join("top.py"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::set_permissions(
        net.server_path("pub/pub.py"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(
        cat_in_job(&agent, &env.join("top.py")),
        None,
        "{}",
        agent.log()
    );
    assert_eq!(
        cat_in_job(&agent, &public),
        None,
        "a chmod on the sshfs server reached the job:\n{}",
        agent.log()
    );
}

#[test]
fn after_a_restart_nothing_is_bound_before_it_is_revalidated() {
    let net = NetworkMount::start();
    let file = net.put("env/mod.py", b"version = 1\n");
    let args = [
        "--watch",
        net.mount.to_str().unwrap(),
        "--revalidate",
        "3600",
    ];
    let agent = Agent::start(&args);
    read_all(&file);
    hocus_tests::wait_until(30, "the copy", || agent.local_copy(&file).exists());
    agent.settled();
    let (dir, state_dir) = agent.stop_for_restart();
    // Changed on the server while no daemon ran.
    fs::write(net.server_path("env/mod.py"), b"version = 22\n").unwrap();
    // The new daemon finds the old copy in its cache (it may have dropped it already).
    let agent = Agent::start_with_state(dir, state_dir, &args);
    assert_eq!(
        cat_in_job(&agent, &file).as_deref(),
        Some("version = 22\n"),
        "a job right after the restart reads what the network holds"
    );
}

#[test]
fn a_profile_that_understates_sizes_cannot_overfill_the_cache() {
    let net = NetworkMount::start();
    let (uid, gid) = test_user();
    // 64 MiB on the server (sparse there; every byte would cross the network).
    let big = net.server_path("data/big.bin");
    fs::create_dir_all(big.parent().unwrap()).unwrap();
    fs::File::create(&big).unwrap().set_len(64 << 20).unwrap();
    let file = net.path("data/big.bin");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap(), "--ssd-budget", "4M"]);
    // The user's profile says the file is one byte.
    let profile = json!({
        "version": 1, "started_unix_ns": 1, "missing": [], "dirs": [],
        "files": [{"path": file, "size": 1, "opens": 1000, "bytes_read": 1, "first_touch_ns": 1, "written": false, "uids": [uid]}],
    });
    let work = tempfile::tempdir().unwrap();
    fs::set_permissions(work.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let path = work.path().join("small.json");
    fs::write(&path, serde_json::to_vec(&profile).unwrap()).unwrap();
    let out = agent
        .cli(&["prefetch", "--profile", path.to_str().unwrap()])
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    assert_success(&out);
    let c = agent.settled();
    assert_eq!(c["copy_failures_by_reason"]["too_large"], 1, "{c:#}");
    assert!(c["cached_bytes"].as_u64().unwrap() <= 4 << 20, "{c:#}");
    assert!(!agent.local_copy(&file).exists());
}

#[test]
fn a_profile_whose_byte_ranges_are_hostile_is_refused_or_bounded() {
    let net = NetworkMount::start();
    let (uid, gid) = test_user();
    let file = net.put("data/big.bin", &vec![1u8; 4 << 20]);
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    let work = tempfile::tempdir().unwrap();
    fs::set_permissions(work.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let import = |name: &str, ranges: Value| {
        let profile = json!({
            "version": 2, "started_unix_ns": 1, "missing": [], "dirs": [],
            "files": [{"path": file, "size": 4 << 20, "opens": 3, "bytes_read": 1, "first_touch_ns": 1, "written": false, "uids": [uid], "ranges": ranges}],
        });
        let path = work.path().join(name);
        fs::write(&path, serde_json::to_vec(&profile).unwrap()).unwrap();
        agent
            .cli(&["profile", "import", path.to_str().unwrap()])
            .uid(uid)
            .gid(gid)
            .output()
            .unwrap()
    };
    // More ranges for one file than hocus ever writes: refused whole, before they are
    // held, and said.
    let flood: Vec<[u64; 2]> = (0..5000u64).map(|i| [i * 3, i * 3 + 1]).collect();
    let out = import("flood.json", json!(flood));
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("more than 4096 byte ranges"), "{said}");
    // A range that ends before it starts: the file is taken, its ranges are not; a
    // range past the end of the file is cut at its size (then it is the whole file).
    for (name, ranges) in [
        ("backwards.json", json!([[9, 3]])),
        ("huge.json", json!([[0, u64::MAX]])),
    ] {
        assert_success(&import(name, ranges));
    }
    let exported = agent.export();
    let f = hocus_tests::file_entry(&exported, &file).expect("the file, imported");
    assert_eq!(f["opens"], 6, "{f}");
    assert!(f.get("ranges").is_none(), "{f}");
    // The daemon still serves everyone.
    assert_success(&agent.run_job("true"));
}

#[test]
fn a_flood_of_names_cannot_grow_the_profile_without_bound() {
    let net = NetworkMount::start();
    net.put("env/real.py", b"x = 1\n");
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--max-profile-entries",
        "50",
    ]);
    // As an ordinary user: 300 names that do not exist, looked up once each.
    let script = format!(
        "import os\nfor i in range(300):\n    try:\n        os.stat('{}/env/nope%d.py' % i)\n    except OSError:\n        pass\n",
        net.mount.display()
    );
    let (uid, gid) = test_user();
    let out = std::process::Command::new("python3")
        .args(["-c", &script])
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    assert_success(&out);
    let status = agent.status();
    let held = ["files", "missing", "dirs"]
        .iter()
        .map(|k| status[k].as_u64().unwrap())
        .sum::<u64>();
    assert!(held <= 50, "{status:#}");
    assert!(
        status["profile_entries_dropped"].as_u64().unwrap() >= 250,
        "{status:#}"
    );
    assert!(
        agent
            .metrics()
            .contains("hocus_profile_entries_dropped_total")
    );
    assert!(
        agent
            .log()
            .contains("new names read are no longer recorded")
    );
}

/// CPU time (user + system) the process has used, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = stat.rsplit_once(')').unwrap().1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the comm.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    ticks as f64 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

#[test]
fn the_accept_loop_does_not_spin_when_descriptors_run_out() {
    let net = NetworkMount::start();
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--max-clients-per-user",
        "200",
    ]);
    agent.status();
    let pid = agent.pid();
    // 20 connections admitted and held idle (within the 10 s request timeout); then the
    // daemon is left no descriptor to spare, and 20 more connections wait to be accepted.
    let mut holder = std::process::Command::new("python3")
        .args([
            "-c",
            "import socket, sys, time\n\
             def conn():\n    s = socket.socket(socket.AF_UNIX)\n    s.connect(sys.argv[1])\n    return s\n\
             h = [conn() for _ in range(20)]\nprint('held', flush=True)\nsys.stdin.readline()\n\
             h += [conn() for _ in range(20)]\nprint('more', flush=True)\ntime.sleep(5)\n",
        ])
        .arg(&agent.socket)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::{BufRead, Write};
    let mut from = std::io::BufReader::new(holder.stdout.take().unwrap());
    let mut to = holder.stdin.take().unwrap();
    let mut line = String::new();
    from.read_line(&mut line).unwrap();
    assert_eq!(line, "held\n");
    std::thread::sleep(Duration::from_millis(500));
    let limit = open_descriptors(pid);
    let set = std::process::Command::new("prlimit")
        .args(["--pid", &pid.to_string(), &format!("--nofile={limit}:")])
        .status()
        .unwrap();
    assert!(set.success());
    writeln!(to, "go").unwrap();
    line.clear();
    from.read_line(&mut line).unwrap();
    assert_eq!(line, "more\n");
    std::thread::sleep(Duration::from_millis(300));
    let before = cpu_seconds(pid);
    std::thread::sleep(Duration::from_secs(3));
    let used = cpu_seconds(pid) - before;
    let _ = holder.wait_with_output();
    assert!(
        used < 1.0,
        "the daemon used {used:.2} s of CPU in 3 s out of descriptors"
    );
    // Descriptors back: it serves again, and says what happened.
    let set = std::process::Command::new("prlimit")
        .args(["--pid", &pid.to_string(), "--nofile=4096:"])
        .status()
        .unwrap();
    assert!(set.success());
    std::thread::sleep(Duration::from_secs(11));
    let status = agent.status();
    let failed = status["control"]["refused"]["accept_failed"]
        .as_u64()
        .unwrap_or(0);
    // Retried every 100 ms for a few seconds: tens of times. A loop that spins retries
    // thousands of times (it frees a descriptor now and then, so it shows less as CPU).
    assert!(
        (1..=100).contains(&failed),
        "{failed} failed accepts: {status:#}"
    );
}

/// Asks the daemon (socket: argv[1]) to bind into the asking process's namespace, as
/// hocus's Slurm plugin does, and says what came back and whether something is mounted
/// on the file argv[2] or a directory above it, below the mount argv[3], in the asker's
/// namespace then.
const ATTACH: &str = r#"
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(b'{"request":"attach","uid":0,"gid":0}\n')
print(s.makefile().readline().strip())
points = [l.split()[4] for l in open("/proc/self/mountinfo")]
over = [p for p in points if p.startswith(sys.argv[3] + "/") and (sys.argv[2] + "/").startswith(p + "/")]
print("mounted" if over else "not mounted")
"#;

/// Whether something is mounted on `path` or a directory above it, below `mount`, in
/// the node's namespace.
fn mounted_on_the_node(path: &Path, mount: &Path) -> bool {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(Path::new))
        .any(|p| p.starts_with(mount) && p != mount && path.starts_with(p))
}

/// Binds made in the caller's own namespace are for hocus's Slurm plugin (root, in a
/// task that made a namespace of its own): an ordinary user asking, plainly or from a
/// user and mount namespace of their own, gets nothing; root asking from the node's
/// namespace, where a bind would reach every process, gets nothing either.
#[test]
fn only_root_in_a_namespace_of_its_own_gets_binds_made_in_it() {
    let net = NetworkMount::start();
    let file = net.put("env/lib/mod.py", b"X = 1\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    read_all(&file);
    let copy = agent.local_copy(&file);
    hocus_tests::wait_until(30, "the copy", || {
        copy.exists() && agent.cache()["cached_files"].as_u64() > Some(0)
    });
    let (uid, gid) = test_user();
    let ask = |wrapper: &[&str], as_user: bool| -> String {
        let mut cmd = std::process::Command::new(wrapper.first().copied().unwrap_or("python3"));
        if !wrapper.is_empty() {
            cmd.args(&wrapper[1..]).arg("python3");
        }
        cmd.args(["-c", ATTACH])
            .arg(&agent.socket)
            .arg(&file)
            .arg(&net.mount);
        if as_user {
            cmd.uid(uid).gid(gid);
        }
        let out = cmd.output().unwrap();
        assert_success(&out);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };

    for said in [
        ask(&[], true),
        ask(&["unshare", "--user", "--map-root-user", "--mount"], true),
    ] {
        assert!(said.contains("only root"), "{said}");
        assert!(said.ends_with("not mounted\n"), "{said}");
    }
    let said = ask(&[], false);
    assert!(said.contains("shares the node's mount namespace"), "{said}");
    assert!(!mounted_on_the_node(&file, &net.mount));

    // What the plugin does: root, in a namespace of its own, gets the bind there alone.
    let said = ask(&["unshare", "--mount", "--propagation", "slave"], false);
    assert!(said.contains(r#""attached","binds":1"#), "{said}");
    assert!(said.ends_with("\nmounted\n"), "{said}");
    assert!(
        !mounted_on_the_node(&file, &net.mount),
        "the bind reached the node"
    );
    assert_eq!(fs::read_to_string(&file).unwrap(), "X = 1\n");
}

/// A Slurm job's profile is saved and read as its user only at root's request (hocus's
/// plugin, in the job's prolog and epilog): an ordinary user asking to have root's or
/// anyone's profile written or read is refused, and nothing is written.
#[test]
fn only_root_saves_or_prefetches_a_slurm_jobs_profile() {
    let net = NetworkMount::start();
    let home = tempfile::tempdir().unwrap();
    let template = format!("{}/{{user}}", home.path().display());
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--job-profiles",
        &template,
    ]);
    let said = python_as_user(
        &agent,
        r#"
import socket, sys
for kind in ["save_job_profile", "prefetch_job_profile"]:
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    s.sendall(b'{"request":"%s","job_id":1,"uid":0,"gid":0,"key":"x"}\n' % kind.encode())
    print(s.makefile().readline().strip())
"#,
    );
    assert_eq!(said.lines().count(), 2, "{said}");
    for line in said.lines() {
        assert!(
            line.contains("only root keeps Slurm jobs' profiles"),
            "{line}"
        );
    }
    assert_eq!(
        fs::read_dir(home.path()).unwrap().count(),
        0,
        "nothing written"
    );
}

/// A watched mount may lie in a directory an ordinary user owns (a mount of their own,
/// found when the daemon watches every network mount). After the daemon has checked it
/// and cached its files, the user swaps the directory above it for a symlink to a tree
/// of root's with the same names. Their next job must get no bind through the symlink:
/// it would lay the user's files over root's directory, in a namespace where setuid
/// programs run.
#[test]
fn a_watched_tree_swapped_for_a_symlink_gets_no_bind_through_it() {
    let (uid, gid) = test_user();
    let home = tempfile::Builder::new()
        .prefix("hocus-home-")
        .tempdir()
        .unwrap();
    std::os::unix::fs::chown(home.path(), Some(uid), Some(gid)).unwrap();
    fs::set_permissions(home.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let net = NetworkMount::start_under(home.path());
    let module = net.put("env/pkg/mod.py", b"X = 1\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    read_all(&module);
    let copy = agent.local_copy(&module);
    hocus_tests::wait_until(30, "the copy", || {
        copy.exists() && agent.cache()["cached_files"].as_u64() > Some(0)
    });
    // Before the swap, the user's job is served the copy: the binds are there to abuse.
    let job = |script: &str| {
        agent
            .cli(&["run", "--", "sh", "-c", script])
            .current_dir("/")
            .uid(uid)
            .gid(gid)
            .output()
            .unwrap()
    };
    let binds = "awk '{print $5}' /proc/self/mountinfo";
    let out = job(&format!("{binds}; cat {}", module.display()));
    assert_success(&out);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        stdout
            .lines()
            .any(|l| module.starts_with(l) && l != net.mount.to_str().unwrap()),
        "no bind served the module before the swap: {stdout}"
    );

    // Root's tree, with the names the watched tree has below the swapped directory.
    let roots = tempfile::Builder::new()
        .prefix("hocus-roots-")
        .tempdir()
        .unwrap();
    let above = net.mount.parent().unwrap().to_owned();
    let rel = module.strip_prefix(&above).unwrap();
    fs::create_dir_all(roots.path().join(rel).parent().unwrap()).unwrap();
    fs::write(roots.path().join(rel), b"ROOT = 1\n").unwrap();
    let moved = home.path().join("moved");
    let swap = format!(
        "mv {above} {moved} && ln -s {roots} {above}",
        above = above.display(),
        moved = moved.display(),
        roots = roots.path().display()
    );
    let out = std::process::Command::new("sh")
        .args(["-c", &swap])
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    assert_success(&out);
    let out = job(&format!("{binds}; cat {}", module.display()));
    // Put back before anything is asserted, so that the mount is taken down.
    fs::remove_file(&above).unwrap();
    fs::rename(&moved, &above).unwrap();

    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_success(&out);
    let roots_path = fs::canonicalize(roots.path()).unwrap();
    let laid_over: Vec<&str> = stdout
        .lines()
        .filter(|l| Path::new(l).starts_with(&roots_path))
        .collect();
    assert!(
        laid_over.is_empty(),
        "bound over root's tree: {laid_over:?}"
    );
    assert!(stdout.ends_with("ROOT = 1\n"), "{stdout}");
    // The daemon still serves: the next job, with the tree back, gets the copy again.
    let out = job(&format!("cat {}", module.display()));
    assert_success(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "X = 1\n");
    assert!(
        agent.log().contains("now goes through a symlink"),
        "{}",
        agent.log()
    );
}

#[test]
fn fifos_in_a_users_profile_hold_no_copy_worker_and_others_are_served() {
    let net = NetworkMount::start();
    let (uid, gid) = test_user();
    // The attacker's own FIFOs on the network home, more than the copy workers (8):
    // a FIFO's open waits for a writer, for ever.
    let dir = net.server_path("attacker");
    fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).unwrap();
    let fifos: Vec<String> = (0..16)
        .map(|i| {
            let server = dir.join(format!("fifo{i}"));
            let made = std::process::Command::new("mkfifo")
                .arg(&server)
                .status()
                .unwrap();
            assert!(made.success());
            std::os::unix::fs::chown(&server, Some(uid), Some(gid)).unwrap();
            net.path(&format!("attacker/fifo{i}")).display().to_string()
        })
        .collect();
    let wanted = net.put("victim/module.py", &[b'v'; 2048]);
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    let work = tempfile::tempdir().unwrap();
    fs::set_permissions(work.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let profile = |name: &str, paths: &[String], reader: u32| {
        let entry = |p: &String| json!({"path": p, "size": 2048, "opens": 50, "bytes_read": 2048, "first_touch_ns": 1, "written": false, "uids": [reader]});
        hocus_tests::profile_in(work.path(), name, paths.iter().map(entry).collect())
    };
    // The attacker's prefetch ends: the FIFOs are refused, none is opened.
    let evil = profile("evil.json", &fifos, uid);
    let out = agent.prefetch_as(&evil, (uid, gid), "the attacker's prefetch of 16 FIFOs");
    // Refused in the copy workers' order, and logged as each is: any of them says the
    // attack reached the daemon (CI of 89bfc1d in a 6.1 guest: fifo13 first, fifo0 not
    // yet logged when the prefetch answered).
    let refused = |log: &str| {
        (0..16).any(|i| log.contains(&format!("attacker/fifo{i} is not a regular file")))
    };
    assert!(
        refused(&agent.log()),
        "the attack was not attempted: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        agent.log()
    );
    // No copy worker waits in a FIFO's open.
    let waiting: Vec<String> = fs::read_dir(format!("/proc/{}/task", agent.pid()))
        .unwrap()
        .flatten()
        .filter_map(|t| fs::read_to_string(t.path().join("wchan")).ok())
        .filter(|w| w.contains("fifo_open") || w.contains("wait_for_partner"))
        .collect();
    assert!(waiting.is_empty(), "daemon threads wait in {waiting:?}");
    // Another user's prefetch (root's, here) is served, and its file copied.
    let honest = profile("honest.json", &[wanted.display().to_string()], 0);
    let out = hocus_tests::finished_within(
        &mut agent.cli(&["prefetch", "--profile", honest.to_str().unwrap()]),
        60,
        "the victim's prefetch of one 2 KB file",
    );
    assert_success(&out);
    assert_eq!(
        fs::read(agent.local_copy(&wanted)).unwrap(),
        vec![b'v'; 2048]
    );
}

#[test]
fn a_users_prefetch_evicts_no_copy_another_users_running_job_uses() {
    let net = NetworkMount::start();
    let (uid, gid) = test_user();
    const MIB: usize = 1 << 20;
    // The victim's (root's) modules, and a big file its job reads in part.
    let modules: Vec<PathBuf> = (0..8)
        .map(|i| net.put(&format!("victim/m{i}.py"), &[b'a' + i as u8; 2048]))
        .collect();
    let data = net.put(
        "victim/train.bin",
        &hocus_tests::repeating_bytes(32 * MIB, 251, 1),
    );
    let dir = net.server_path("attacker");
    fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).unwrap();
    let tiny = net.put("attacker/tiny.txt", b"thirty bytes of the attacker.\n");
    std::os::unix::fs::chown(net.server_path("attacker/tiny.txt"), Some(uid), Some(gid)).unwrap();
    let watch = net.mount.to_str().unwrap();
    let agent = Agent::start(&[
        "--watch",
        watch,
        "--partial-from",
        "8M",
        "--ssd-budget",
        "16M",
    ]);
    let work = tempfile::tempdir().unwrap();
    fs::set_permissions(work.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let mut files: Vec<serde_json::Value> = modules
        .iter()
        .map(|m| json!({"path": m, "size": 2048, "opens": 50, "bytes_read": 2048, "first_touch_ns": 1, "written": false, "uids": [0]}))
        .collect();
    files.push(json!({"path": data, "size": 32 * MIB, "opens": 5, "bytes_read": MIB, "first_touch_ns": 2, "written": false, "uids": [0], "ranges": [[4 * MIB, 5 * MIB]]}));
    let victims = hocus_tests::profile_in(work.path(), "victim.json", files);
    agent.prefetch(&victims);
    agent.settled();
    // Where the kernel has no partial copies (before 6.14), the big file is past the
    // budget and read from the network; the whole copies are kept all the same.
    let partial = agent
        .route("big files read in part")
        .starts_with("partial copies from");
    let copies = 8 + u64::from(partial);
    assert_eq!(agent.cache()["cached_files"], copies, "{:#}", agent.cache());
    // The victim's job opens its copies, reads the partial copy's held range, and waits;
    // then reads a range the copy lacks and every module again.
    let ready = work.path().join("ready");
    let go = work.path().join("go");
    let script = format!(
        "import os, time\nfds = [os.open(p, os.O_RDONLY) for p in {mods:?}]\nbig = os.open('{data}', os.O_RDONLY)\nos.pread(big, 4096, {held})\nopen('{ready}', 'w').close()\nwhile not os.path.exists('{go}'): time.sleep(0.05)\nprint(sum(os.pread(big, 4096, {lacks})), *[os.pread(fd, 1, 0).decode() for fd in fds])\n",
        mods = modules
            .iter()
            .map(|m| m.display().to_string())
            .collect::<Vec<_>>(),
        data = data.display(),
        held = 4 * MIB,
        lacks = 20 * MIB,
        ready = ready.display(),
        go = go.display(),
    );
    let job = agent.python_job_started(&script);
    wait_until(60, "the victim's job opened its copies", || ready.exists());
    // Its opens of its copies reached the keeper (counted as hits).
    wait_until(30, "the job's opens counted", || {
        agent.cache()["served"][0]["opens_local"]
            .as_u64()
            .unwrap_or(0)
            >= copies
    });
    // The attacker prefetches a profile of one 30-byte file of theirs.
    let evil = hocus_tests::profile_in(
        work.path(),
        "evil.json",
        vec![
            json!({"path": tiny, "size": 30, "opens": 1000, "bytes_read": 30, "first_touch_ns": 1, "written": false, "uids": [uid]}),
        ],
    );
    let out = agent.prefetch_as(&evil, (uid, gid), "the attacker's prefetch");
    assert_success(&out);
    agent.settled();
    // The attack was made: the attacker's file is copied.
    assert!(agent.local_copy(&tiny).exists(), "{}", agent.log());
    let cache = agent.cache();
    assert_eq!(
        cache["cached_files"],
        copies + 1,
        "the victim's copies were evicted: {cache:#}\n{}",
        agent.log()
    );
    assert_eq!(cache["evictions"], 0, "{cache:#}");
    // The victim's job reads right: the range its copy lacked is filled, never EIO.
    fs::write(&go, b"").unwrap();
    let out = job.wait_with_output().unwrap();
    assert_success(&out);
    let expect: u64 = (20 * MIB as u64..20 * MIB as u64 + 4096)
        .map(|i| (i % 251) + 1)
        .sum();
    let letters: Vec<String> = (0..8).map(|i| ((b'a' + i) as char).to_string()).collect();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("{expect} {}", letters.join(" "))
    );
}

#[test]
fn a_flood_of_entries_in_a_users_profile_brings_in_no_more_than_its_bound() {
    let net = NetworkMount::start();
    let (uid, gid) = test_user();
    let dir = net.server_path("attacker");
    fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).unwrap();
    // A user's profile brings in 20,000 entries here (200,000 by default): the same
    // bound, a tenth of the names to send.
    const BOUND: u64 = 20_000;
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--max-user-profile-entries",
        &BOUND.to_string(),
    ]);
    // A crafted profile of 60,000 names of the attacker's own directory (each a few
    // hundred bytes in the daemon): past what a user's profile brings in, by more than
    // the batch of 16,384 it is checked in.
    const SENT: u64 = 60_000;
    let missing: Vec<Value> = (0..SENT)
        .map(|i| json!({"path": net.path(&format!("attacker/nope{i}.py")), "lookups": 9, "first_touch_ns": 1}))
        .collect();
    let profile =
        json!({"version": 2, "started_unix_ns": 1, "files": [], "dirs": [], "missing": missing});
    let work = tempfile::tempdir().unwrap();
    fs::set_permissions(work.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let file = work.path().join("names.json");
    fs::write(&file, serde_json::to_vec(&profile).unwrap()).unwrap();
    fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).unwrap();
    let out = agent.prefetch_as(&file, (uid, gid), "the attacker's prefetch of 60,000 names");
    assert_success(&out);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains(&format!(
            "past the {BOUND} entries a profile of this sender brings in"
        )),
        "{said}"
    );
    // Brought in up to the bound (checked a batch of 16,384 at a time), the rest
    // refused, said and counted.
    let taken = agent.status()["missing"].as_u64().unwrap();
    assert!((BOUND..=BOUND + 16_384).contains(&taken), "{taken}");
    let refused: u64 = said
        .lines()
        .find_map(|l| {
            l.strip_prefix("refused ")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("{said}"));
    assert_eq!(refused, SENT - taken, "{said}");
    // Root's own import of a site's profile is bounded by the working set's bound only.
    agent.prefetch(&file);
    assert_eq!(agent.status()["missing"], SENT);
}
