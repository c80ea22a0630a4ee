//! Whom the syscall program follows. Every process on the node passes through it, so it
//! follows only jobs (from their start) and processes that used a watched mount's
//! server (from that request on, the syscall that made it included), with the children
//! they make from then on, and turns every other process away at once. The table it
//! follows by is the kernel side's own, counted in `status`.

use std::{
    fs,
    io::{BufRead, BufReader, Write},
    os::unix::process::CommandExt,
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
};

use hocus_tests::{Agent, NetworkMount, file_entry, missing_lookups, test_user, wait_until};

/// Whether the daemon follows every process, and how many it has in its table.
fn following(agent: &Agent) -> (Option<bool>, Option<u64>) {
    let t = &agent.status()["tracing"];
    (t["every_process"].as_bool(), t["followed"].as_u64())
}

fn followed(agent: &Agent) -> u64 {
    following(agent).1.expect("status has tracing.followed")
}

/// An ordinary user's Python, run step by step: each line on its stdin runs the next
/// step, and it answers with a line once the step is done.
struct Steps {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
}

impl Steps {
    fn start(script: &str, args: &[&str]) -> Self {
        let (uid, gid) = test_user();
        let mut child = Command::new("python3")
            .arg("-c")
            .arg(script)
            .args(args)
            .current_dir("/")
            .uid(uid)
            .gid(gid)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let input = child.stdin.take().unwrap();
        let output = BufReader::new(child.stdout.take().unwrap());
        Self {
            child,
            input,
            output,
        }
    }

    /// Waits for the current step's answer.
    fn done(&mut self, step: &str) {
        let mut line = String::new();
        self.output.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), step, "the script's answer");
    }

    fn next(&mut self, step: &str) {
        writeln!(self.input, "go").unwrap();
        self.done(step);
    }
}

const SCRIPT: &str = r#"
import os, subprocess, sys
local, watched, missing = sys.argv[1:4]
# Work on the local disk only: opens, reads, failed lookups.
for i in range(500):
    with open(local) as f:
        f.read()
    os.path.exists(local + ".nope%d" % i)
print("local", flush=True)
sys.stdin.readline()
# The first use of the mount: a read and a failed lookup.
with open(watched) as f:
    f.read()
os.path.exists(missing)
print("watched", flush=True)
sys.stdin.readline()
# A child made from now on is followed too.
child = subprocess.Popen(["sleep", "60"])
print("child", flush=True)
sys.stdin.readline()
child.kill()
child.wait()
print("reaped", flush=True)
sys.stdin.readline()
"#;

#[test]
fn a_process_is_followed_from_its_first_use_of_the_mount_with_its_children_until_it_exits() {
    let net = NetworkMount::start();
    let watched = net.put("data/followed.txt", b"on the mount\n");
    let missing = net.path("data/not-there.txt");
    let local = tempfile::tempdir().unwrap();
    let local_file = local.path().join("local.txt");
    fs::write(&local_file, "on the local disk\n").unwrap();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    assert_eq!(following(&agent).0, Some(false));
    // Nothing used the mount yet (the daemon's own threads are not counted).
    let before = followed(&agent);
    assert_eq!(before, 0);

    let mut script = Steps::start(
        SCRIPT,
        &[
            local_file.to_str().unwrap(),
            watched.to_str().unwrap(),
            missing.to_str().unwrap(),
        ],
    );
    // Working on the local disk only, it is turned away: not in the table.
    script.done("local");
    assert_eq!(
        followed(&agent),
        before,
        "a process that never used the mount is followed"
    );

    // Its first use of the mount follows it, and that very syscall is seen.
    script.next("watched");
    assert_eq!(followed(&agent), before + 1);
    wait_until(15, "the read and the failed lookup in the profile", || {
        let p = agent.export();
        file_entry(&p, &watched).is_some_and(|f| f["opens"].as_u64() >= Some(1))
            && missing_lookups(&p, &missing) == Some(1)
    });

    // A child it makes is followed; and forgotten once it is gone.
    script.next("child");
    assert_eq!(followed(&agent), before + 2);
    script.next("reaped");
    assert_eq!(followed(&agent), before + 1);

    // Gone, it is forgotten.
    writeln!(script.input, "go").unwrap();
    assert!(script.child.wait().unwrap().success());
    assert_eq!(followed(&agent), before);

    // A process whose only use of the mount is a failed lookup the client may answer
    // from its cache (NFS keeps the name as missing) is followed, and its lookup seen.
    let mut lookup = Steps::start(
        "import os, sys\nos.path.exists(sys.argv[1])\nprint('looked', flush=True)\nsys.stdin.readline()",
        &[missing.to_str().unwrap()],
    );
    lookup.done("looked");
    assert_eq!(followed(&agent), before + 1);
    wait_until(15, "the second failed lookup in the profile", || {
        missing_lookups(&agent.export(), &missing) == Some(2)
    });
    writeln!(lookup.input, "go").unwrap();
    assert!(lookup.child.wait().unwrap().success());
}

#[test]
fn every_process_is_followed_when_asked_or_when_a_watched_tree_has_no_tripwire() {
    let net = NetworkMount::start();
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--trace-every-process",
    ]);
    assert_eq!(following(&agent), (Some(true), Some(0)));
    let out = agent.cli(&["status"]).output().unwrap();
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(shown.contains("following: every process"), "{shown}");
    drop(agent);

    // A tree on a local filesystem: its opens and failed lookups reach no server, so no
    // tripwire would ever tell who uses it.
    let local = tempfile::tempdir_in("/dev/shm").unwrap();
    let agent = Agent::start(&["--watch", local.path().to_str().unwrap()]);
    assert_eq!(following(&agent).0, Some(true));
    let file = local.path().join("seen.txt");
    fs::write(&file, "local\n").unwrap();
    let out = Command::new("cat").arg(&file).output().unwrap();
    assert!(out.status.success());
    wait_until(
        15,
        "a plain process's open of the local tree in the profile",
        || file_entry(&agent.export(), &file).is_some(),
    );
}
