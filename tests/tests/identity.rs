//! Observing the mount, not the path: what a process does on the watched tree counts
//! whatever path or namespace it reaches the tree through (a container's bind), and what
//! it does on a look-alike at the same path (a tmpfs in a user namespace, another
//! daemon's mount of the same server) does not.

use std::{
    fs,
    os::unix::{fs::PermissionsExt, process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, Command, Output},
    thread,
    time::Duration,
};

use hocus_tests::{
    Agent, NetworkMount, assert_success, file_entry, missing_lookups, read_all, test_user,
    wait_until,
};
use serde_json::Value;

fn as_user(cmd: &mut Command) -> Output {
    let (uid, gid) = test_user();
    cmd.current_dir("/").uid(uid).gid(gid).output().unwrap()
}

/// Every path the profile names (files, missing names, directories).
fn all_paths(p: &Value) -> Vec<String> {
    ["files", "missing", "dirs"]
        .iter()
        .flat_map(|k| p[k].as_array().cloned().unwrap_or_default())
        .filter_map(|e| e["path"].as_str().map(str::to_owned))
        .collect()
}

fn cached(agent: &Agent, path: &Path) {
    let copy = agent.local_copy(path);
    wait_until(30, "the copy", || {
        copy.exists() && agent.cache()["cached_files"].as_u64() > Some(0)
    });
}

#[test]
fn a_container_that_binds_the_tree_elsewhere_is_profiled_under_the_real_paths() {
    let net = NetworkMount::start();
    for i in 0..6 {
        net.put(&format!("env/pkg/m{i}.py"), b"X = 1\n");
    }
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    // An ordinary user's bubblewrap container sees the tree at /media and a directory of
    // it at /srv: three files opened by absolute path, three relative to a working
    // directory inside, three missing names looked up there.
    // Absolute lookups: the first teaches the daemon the container's mounts, the later
    // ones count. The container repeats one until the test sees it in the profile (and
    // says so in a directory it shares, at /var/tmp).
    let flags = tempfile::tempdir().unwrap();
    fs::set_permissions(flags.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let script = "cat /media/env/pkg/m0.py /media/env/pkg/m1.py /media/env/pkg/m2.py >/dev/null \
                  && cd /media/env/pkg && cat m3.py m4.py m5.py >/dev/null \
                  && for n in a b c; do test -e missing_$n.py || true; done \
                  && for i in $(seq 150); do test -e /media/env/pkg/absent.py; test -e /srv/absent_too.py; \
                     [ -e /var/tmp/stop ] && break; sleep 0.2; done; true";
    let (uid, gid) = test_user();
    let mut container = Command::new("bwrap")
        .args(["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"])
        .arg("--ro-bind")
        .arg(&net.mount)
        .arg("/media")
        .arg("--ro-bind")
        .arg(net.path("env/pkg"))
        .arg("/srv")
        .arg("--bind")
        .arg(flags.path())
        .args(["/var/tmp", "sh", "-c", script])
        .current_dir("/")
        .uid(uid)
        .gid(gid)
        .spawn()
        .unwrap();
    let absent = net.path("env/pkg/absent.py");
    // A bind of a subtree maps to that subtree.
    let absent_too = net.path("env/pkg/absent_too.py");
    let counted = (0..150).any(|_| {
        let p = agent.export();
        let seen =
            missing_lookups(&p, &absent).is_some() && missing_lookups(&p, &absent_too).is_some();
        if !seen {
            thread::sleep(Duration::from_millis(200));
        }
        seen
    });
    fs::write(flags.path().join("stop"), "").unwrap();
    assert!(container.wait().unwrap().success(), "the container failed");
    assert!(
        counted,
        "an absolute lookup in the container was never counted"
    );
    let wanted: Vec<PathBuf> = (0..6)
        .map(|i| net.path(&format!("env/pkg/m{i}.py")))
        .collect();
    wait_until(15, "the container's opens in the profile", || {
        let p = agent.export();
        wanted.iter().all(|f| file_entry(&p, f).is_some())
    });
    let p = agent.export();
    for n in ["a", "b", "c"] {
        let name = net.path(&format!("env/pkg/missing_{n}.py"));
        assert_eq!(missing_lookups(&p, &name), Some(1), "{name:?} in {p}");
    }
    let paths = all_paths(&p);
    assert!(
        paths.iter().all(|p| !p.starts_with("/media")),
        "the container's own paths are not the tree's: {paths:?}"
    );
}

#[test]
fn a_look_alike_mounted_over_the_tree_in_a_user_namespace_adds_nothing() {
    let net = NetworkMount::start();
    let shared = net.put("env/shared.py", b"REAL = 1\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    read_all(&shared);
    cached(&agent, &shared);
    let opens = |p: &Value| file_entry(p, &shared).map(|f| f["opens"].clone());
    let before = agent.export();
    let unresolved = |a: &Agent| a.status()["tally"]["unresolved"].as_u64().unwrap();
    let dropped = |a: &Agent| a.kernel_counter("foreign_namespace") + unresolved(a);
    let dropped_before = dropped(&agent);
    // An ordinary user mounts a tmpfs of their own over the watched path, in a user and
    // mount namespace of their own, and forges names, reads, missing names and writes
    // there, among them a write to the name of a real shared file.
    let tree = net.mount.display();
    let script = format!(
        "mount -t tmpfs none {tree} && mkdir -p {tree}/env/forged && \
         for i in $(seq 100); do echo x > {tree}/env/forged/f$i.py; cat {tree}/env/forged/f$i.py >/dev/null; \
             test -e {tree}/env/nope$i.py || true; done && \
         echo HACKED > {tree}/env/shared.py && cat {tree}/env/shared.py >/dev/null && \
         cd {tree}/env && (test -e relative_nope.py || true) && mv shared.py moved.py && rm -f moved.py"
    );
    let out = as_user(Command::new("unshare").args(["-Urm", "sh", "-c", &script]));
    assert_success(&out);
    // The absolute names were seen and dropped for where they came from: before the
    // daemon learned that namespace's mounts (in the kernel), or after, because there
    // the path is on the tmpfs (so this test does exercise the look-alike).
    wait_until(10, "the look-alike's lookups seen and dropped", || {
        dropped(&agent) >= dropped_before + 100
    });
    // The export reads the ring buffer first: whatever was sent is in it.
    let after = agent.export();
    let forged: Vec<String> = all_paths(&after)
        .into_iter()
        .filter(|p| p.contains("forged") || p.contains("nope") || p.contains("moved"))
        .collect();
    assert!(forged.is_empty(), "forged names in the profile: {forged:?}");
    let entry = file_entry(&after, &shared).expect("the shared file is still profiled");
    assert_eq!(entry["written"], false, "{entry}");
    assert_eq!(opens(&after), opens(&before), "{entry}");
    // Its local copy is kept and still the real one.
    let copy = agent.local_copy(&shared);
    assert_eq!(fs::read_to_string(&copy).unwrap(), "REAL = 1\n");
    assert!(agent.cache()["cached_files"].as_u64() > Some(0));
}

/// A process that holds a private mount namespace open: a node of its own on this
/// kernel. Its mounts go when it is dropped.
struct Node {
    holder: Child,
    mounts: Vec<PathBuf>,
}

impl Node {
    fn start() -> Self {
        let holder = Command::new("unshare")
            .args(["-m", "--propagation", "private", "sleep", "600"])
            .spawn()
            .unwrap();
        let ns = format!("/proc/{}/ns/mnt", holder.id());
        wait_until(10, "the namespace", || {
            fs::read_link(&ns).ok() != fs::read_link("/proc/self/ns/mnt").ok()
        });
        Self {
            holder,
            mounts: Vec::new(),
        }
    }

    fn pid(&self) -> u32 {
        self.holder.id()
    }

    fn run(&self, script: &str) -> Output {
        Command::new("nsenter")
            .args([
                "-t",
                &self.pid().to_string(),
                "-m",
                "--",
                "sh",
                "-c",
                script,
            ])
            .output()
            .unwrap()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for m in &self.mounts {
            let _ = self.run(&format!("fusermount3 -uz {}", m.display()));
        }
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

#[test]
fn two_daemons_on_one_kernel_each_count_only_their_own_mount() {
    let net = NetworkMount::start();
    let size = 4 << 20;
    net.put("data/big.bin", &vec![7u8; size]);
    // The same path on both nodes, each with its own client of the same server.
    let place = tempfile::tempdir().unwrap();
    let point = place.path().join("home");
    fs::create_dir(&point).unwrap();
    let mut nodes = [Node::start(), Node::start()];
    for node in &mut nodes {
        net.mount_in_namespace_of(node.pid(), &point);
        node.mounts.push(point.clone());
    }
    let watch = point.to_str().unwrap();
    let agents: Vec<Agent> = nodes
        .iter()
        .map(|n| Agent::start_in_namespace_of(n.pid(), &["--watch", watch]))
        .collect();
    let big = point.join("data/big.bin");
    let out = nodes[0].run(&format!(
        "cat {} >/dev/null && (test -e {}/data/nope.bin || true)",
        big.display(),
        point.display()
    ));
    assert_success(&out);
    wait_until(15, "the first node's read in its profile", || {
        let p = agents[0].export();
        file_entry(&p, &big).is_some_and(|f| f["bytes_read"].as_u64() == Some(size as u64))
            && missing_lookups(&p, &point.join("data/nope.bin")) == Some(1)
    });
    wait_until(30, "the first node's copy", || {
        agents[0].cache()["cached_files"].as_u64() > Some(0)
    });
    // The export reads the second node's ring buffer first: whatever it was sent is in.
    let other = agents[1].export();
    assert!(
        all_paths(&other).is_empty(),
        "the second node counted the first one's work: {:?}",
        all_paths(&other)
    );
    assert_eq!(agents[1].cache()["cached_files"].as_u64(), Some(0));
}

#[test]
fn a_container_started_in_a_job_reads_the_local_copies() {
    let net = NetworkMount::start();
    let file = net.put("env/lib/mod.py", b"X = 1\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    read_all(&file);
    cached(&agent, &file);
    let local_opens = || -> u64 {
        agent
            .metrics()
            .lines()
            .filter(|l| l.starts_with("hocus_opens_total{") && l.contains("served=\"local\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    let hits = local_opens();
    let before = net.server_log().len();
    // An ordinary user's job starts a bubblewrap container that binds the tree (with
    // the job's binds on it, recursively) at /media.
    let bin = hocus_tests::agent_bin();
    let out = as_user(
        Command::new(bin)
            .arg("--socket")
            .arg(&agent.socket)
            .args(["run", "--", "bwrap", "--ro-bind", "/", "/"])
            .args(["--proc", "/proc", "--dev", "/dev", "--ro-bind"])
            .arg(&net.mount)
            .args(["/media", "cat", "/media/env/lib/mod.py"]),
    );
    assert_success(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "X = 1\n");
    // Served by the local copy: counted as a hit, and the server never asked.
    wait_until(10, "the container's open counted as a hit", || {
        local_opens() > hits
    });
    let server = net.server_log()[before..].to_owned();
    assert!(
        !server.contains("mod.py"),
        "the container's read reached the server:\n{server}"
    );
}
