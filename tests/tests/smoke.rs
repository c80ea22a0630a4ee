//! The smoke suite: what must work on every kernel hocus runs on. It runs here over
//! sshfs, and in the rig's guests (Debian's 5.10, 6.1 and 6.12 kernels) over kernel NFS:
//! `cargo xtask vm test --kernel 5.10 --fs nfs3`. The daemon starts and says how it runs
//! on this kernel, profiles what a Python import opens and probes, serves a `run` job
//! its local copies, prefetches the exported profile into a second daemon, and stops
//! cleanly.

use std::{fs, path::Path, process::Command};

use hocus_tests::{Agent, NetworkMount, assert_success, file_entry, missing_lookups, wait_until};
use serde_json::Value;

const IMPORT: &str = "import mypkg.core; print(mypkg.core.VALUE)";

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// `import mypkg.core` with `lib` on the path, through `cmd`; what it printed.
fn import(mut cmd: Command, lib: &Path) -> String {
    let out = cmd
        .env("PYTHONPATH", lib)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .current_dir("/")
        .output()
        .unwrap();
    assert_success(&out);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_daemon_starts_profiles_serves_a_job_prefetches_and_stops_cleanly() {
    let net = NetworkMount::start();
    net.put_python_package("env/lib");
    net.installed_long_ago("env");
    let lib = net.path("env/lib");
    let mut agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);

    // It says which kernel it runs on and the way each part takes there.
    let status = agent.status();
    let uname = Command::new("uname").arg("-r").output().unwrap();
    assert_eq!(
        status["kernel_release"],
        String::from_utf8_lossy(&uname.stdout).trim(),
        "{status:#}"
    );
    let routes = status["routes"].as_array().unwrap();
    for part in [
        "the current task",
        "open files",
        "processes followed",
        "snapshots",
    ] {
        assert!(
            routes.iter().any(|r| r["part"] == part),
            "no route for {part}: {status:#}"
        );
    }

    // A first start (no cache yet, no earlier daemon) has nothing to warn about.
    let log = agent.log();
    let start = log.split(" ready: ").next().unwrap();
    assert!(!start.contains(" WARN "), "a first start warned:\n{log}");

    // A plain import, outside any job: what it opens and what it probes in vain.
    let mut python = Command::new("python3");
    python.args(["-c", IMPORT]);
    assert_eq!(import(python, &lib), "41\n");
    let core = lib.join("mypkg/core.py");
    wait_until(30, "the import in the profile", || {
        let p = agent.export();
        file_entry(&p, &core).is_some_and(|f| n(&f["opens"]) >= 1)
            && missing_lookups(&p, &lib.join("mypkg/__init__.abi3.so")).is_some()
    });
    let c = agent.settled();
    assert!(n(&c["cached_files"]) >= 2, "{c:#}");

    // A job gets the local copies: its opens are served on the node.
    let served = || {
        let s = agent.cache()["served"][0].clone();
        (n(&s["opens_local"]), n(&s["opens_network"]))
    };
    let (local, network) = served();
    assert_eq!(
        import(agent.cli(&["run", "--", "python3", "-c", IMPORT]), &lib),
        "41\n"
    );
    let after = served();
    assert!(after.0 >= local + 2, "{:#}", agent.cache());
    assert_eq!(after.1, network, "{:#}", agent.cache());

    // The profile, exported, warms another daemon before its first job.
    let shared = tempfile::tempdir().unwrap();
    let profile = shared.path().join("job.json");
    let profile = profile.to_str().unwrap();
    assert_success(
        &agent
            .cli(&["profile", "export", "--out", profile])
            .output()
            .unwrap(),
    );
    let log = agent.stop();
    assert!(log.contains("eBPF programs detached"), "{log}");
    assert!(log.contains("pins released"), "{log}");
    assert!(!agent.socket.exists(), "the socket is removed");

    let node = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    let out = node
        .cli(&["prefetch", "--profile", profile])
        .output()
        .unwrap();
    assert_success(&out);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("prefetched"), "{said}");
    for module in ["mypkg/__init__.py", "mypkg/core.py"] {
        let original = lib.join(module);
        assert_eq!(
            fs::read(node.local_copy(&original)).unwrap(),
            fs::read(&original).unwrap(),
            "{module}"
        );
    }
}
