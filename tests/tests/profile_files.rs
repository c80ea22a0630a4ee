//! The profile outlives the daemon; bad profile files get clear errors and are never
//! overwritten; exported profiles import elsewhere.

use std::fs;

use hocus_tests::{
    Agent, NetworkMount, assert_success, file_entry, missing_lookups, read_all, saved_profile,
};

#[test]
fn the_profile_survives_a_restart_and_keeps_growing() {
    let net = NetworkMount::start();
    let file = net.put("lib/mod.py", b"A = 1\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    read_all(&file);
    assert!(fs::metadata(net.path("lib/gone.py")).is_err());
    let first = agent.export();
    let (dir, state_dir) = agent.stop_for_restart();
    assert_eq!(
        file_entry(&saved_profile(&state_dir), &file).unwrap()["opens"],
        1
    );

    let agent = Agent::start_with_state(dir, state_dir, &["--watch", net.mount.to_str().unwrap()]);
    assert!(
        agent.log().contains("continuing the profile"),
        "{}",
        agent.log()
    );
    read_all(&file);
    assert!(fs::metadata(net.path("lib/gone.py")).is_err());
    let second = agent.export();
    assert_eq!(
        file_entry(&second, &file).unwrap()["opens"],
        2,
        "{second:#}"
    );
    assert_eq!(missing_lookups(&second, &net.path("lib/gone.py")), Some(2));
    assert_eq!(
        second["started_unix_ns"], first["started_unix_ns"],
        "the same profile goes on"
    );
    // first touch stays that of the first run
    assert_eq!(
        file_entry(&second, &file).unwrap()["first_touch_ns"],
        file_entry(&first, &file).unwrap()["first_touch_ns"]
    );
}

#[test]
fn a_corrupt_profile_is_set_aside_not_overwritten_and_the_daemon_starts() {
    let net = NetworkMount::start();
    let dir = tempfile::tempdir().unwrap();
    let state_dir = dir.path().join("state");
    fs::create_dir_all(&state_dir).unwrap();
    let garbage = b"{\"version\": 1, \"files\": [{\"path\": \"/x\", \"si";
    fs::write(state_dir.join("profile.json"), garbage).unwrap();

    let mut agent = Agent::start_with_state(
        dir,
        state_dir.clone(),
        &["--watch", net.mount.to_str().unwrap()],
    );
    let log = agent.log();
    assert!(
        log.contains(&format!("{}/profile.json", state_dir.display())),
        "{log}"
    );
    assert!(
        log.contains("is not a hocus profile or is truncated"),
        "{log}"
    );
    let aside: Vec<_> = fs::read_dir(&state_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("profile.json.bad-")
        })
        .collect();
    assert_eq!(aside.len(), 1, "{log}");
    assert_eq!(
        fs::read(&aside[0]).unwrap(),
        garbage,
        "the bad file is kept byte for byte"
    );
    read_all(&net.put("a.py", b"1"));
    assert_eq!(agent.export()["files"].as_array().unwrap().len(), 1);
    agent.stop();
    assert_eq!(fs::read(&aside[0]).unwrap(), garbage);
}

#[test]
fn bad_files_given_to_the_cli_get_errors_that_name_them() {
    let net = NetworkMount::start();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &[u8], &str); 4] = [
        (
            "truncated.json",
            b"{\"version\": 1, \"files\": [",
            "is not a hocus profile or is truncated",
        ),
        (
            "newer.json",
            b"{\"version\": 99, \"files\": []}",
            "written by a newer hocus",
        ),
        (
            "not-json.json",
            b"\x7fELF\x02\x01",
            "is not a hocus profile",
        ),
        ("missing.json", b"", "does not exist"),
    ];
    for (name, content, message) in cases {
        let path = dir.path().join(name);
        if !content.is_empty() {
            fs::write(&path, content).unwrap();
        }
        for args in [
            vec!["profile", "import", path.to_str().unwrap()],
            vec!["profile", "show", "--file", path.to_str().unwrap()],
        ] {
            let out = agent.cli(&args).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{args:?} succeeded");
            assert!(err.contains(message), "{args:?}: {err}");
            assert!(
                err.contains(path.to_str().unwrap()),
                "{args:?} does not name the file: {err}"
            );
        }
        if !content.is_empty() {
            assert_eq!(fs::read(&path).unwrap(), content, "{name} was changed");
        }
    }
    // The daemon's profile is untouched by the failed imports.
    assert!(agent.export()["files"].as_array().unwrap().is_empty());
}

#[test]
fn an_exported_profile_imports_into_another_daemon() {
    let net = NetworkMount::start();
    let file = net.put("env/site.py", b"import os\n");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    read_all(&file);
    assert!(fs::metadata(net.path("env/missing.so")).is_err());
    let out_dir = tempfile::tempdir().unwrap();
    let exported = out_dir.path().join("job.json");
    let out = agent
        .cli(&[
            "profile",
            "export",
            "--root",
            net.path("env").to_str().unwrap(),
            "--out",
            exported.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_success(&out);
    drop(agent);

    // A second node (a second daemon) merges it twice: counts add up.
    let other = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    for _ in 0..2 {
        let out = other
            .cli(&["profile", "import", exported.to_str().unwrap()])
            .output()
            .unwrap();
        assert_success(&out);
    }
    let p = other.export();
    assert_eq!(file_entry(&p, &file).unwrap()["opens"], 2, "{p:#}");
    assert_eq!(missing_lookups(&p, &net.path("env/missing.so")), Some(2));

    // And without a daemon, root imports straight into a state directory.
    let (_keep, state_dir) = other.stop_for_restart();
    let out = std::process::Command::new(hocus_tests::agent_bin())
        .args([
            "--socket",
            "/nonexistent/agent.sock",
            "--state-dir",
            state_dir.to_str().unwrap(),
        ])
        .args(["profile", "import", exported.to_str().unwrap()])
        .output()
        .unwrap();
    assert_success(&out);
    let saved = saved_profile(&state_dir);
    assert_eq!(file_entry(&saved, &file).unwrap()["opens"], 3);
}

/// An export is sent and written a part at a time: one far larger than a part comes out
/// whole and in first-touch order, from the daemon and from the state directory alike,
/// and a failed export leaves the file it was to replace as it was. The 20k files'
/// records are more than the daemon keeps in memory: they are read back from its
/// scratch file in the state directory, which no name leads to.
#[test]
fn a_profile_of_many_parts_exports_whole_in_order_and_a_failed_export_replaces_nothing() {
    let net = NetworkMount::start();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    let root = net.mount.to_str().unwrap();
    // Files touched in the reverse of their names' order; 20k files, 5k missing names.
    let files: Vec<serde_json::Value> = (0..20_000u64)
        .map(|i| {
            serde_json::json!({"path": format!("{root}/d{}/f{i:05}.py", i % 50),
                "size": i, "opens": 1, "bytes_read": i, "first_touch_ns": 20_000 - i,
                "written": false})
        })
        .collect();
    let missing: Vec<serde_json::Value> = (0..5_000u64)
        .map(|i| serde_json::json!({"path": format!("{root}/m/{i}.so"), "lookups": 2}))
        .collect();
    let work = tempfile::tempdir().unwrap();
    let sent = work.path().join("sent.json");
    let profile =
        serde_json::json!({"version": 1, "started_unix_ns": 5, "files": files, "missing": missing});
    fs::write(&sent, serde_json::to_vec(&profile).unwrap()).unwrap();
    assert_success(
        &agent
            .cli(&["profile", "import", sent.to_str().unwrap()])
            .output()
            .unwrap(),
    );

    // The records went to disk: the daemon holds an unlinked file in its state directory,
    // and the directory lists nothing but the store's own files.
    let scratch: Vec<String> = fs::read_dir(format!("/proc/{}/fd", agent.pid()))
        .unwrap()
        .filter_map(|fd| fs::read_link(fd.ok()?.path()).ok())
        .map(|target| target.to_string_lossy().into_owned())
        .filter(|t| t.starts_with(agent.state_dir.to_str().unwrap()) && t.ends_with("(deleted)"))
        .collect();
    assert_eq!(scratch.len(), 1, "{scratch:?}");
    for entry in fs::read_dir(&agent.state_dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(
            name == "lock" || name.starts_with("profile."),
            "{name} left in the state directory"
        );
    }

    let check = |p: &serde_json::Value| {
        let got = p["files"].as_array().unwrap();
        assert_eq!(got.len(), 20_000);
        assert_eq!(p["missing"].as_array().unwrap().len(), 5_000);
        assert_eq!(p["started_unix_ns"], 5);
        let touches: Vec<u64> = got
            .iter()
            .map(|f| f["first_touch_ns"].as_u64().unwrap())
            .collect();
        assert!(touches.windows(2).all(|w| w[0] < w[1]), "first-touch order");
        assert!(got[0]["path"].as_str().unwrap().ends_with("/f19999.py"));
        assert_eq!(got[0]["size"], 19_999);
    };
    let out = work.path().join("out.json");
    assert_success(
        &agent
            .cli(&["profile", "export", "--out", out.to_str().unwrap()])
            .output()
            .unwrap(),
    );
    let live: serde_json::Value = serde_json::from_slice(&fs::read(&out).unwrap()).unwrap();
    check(&live);

    // A refused export (its root is not absolute) leaves the old file as it was, no
    // temporary beside it.
    let before = fs::read(&out).unwrap();
    let refused = agent
        .cli(&[
            "profile",
            "export",
            "--root",
            "relative/dir",
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert_eq!(fs::read(&out).unwrap(), before);
    assert_eq!(fs::read_dir(work.path()).unwrap().count(), 2);

    // Without a daemon, root exports from the state directory: the same profile.
    let (_keep, state_dir) = agent.stop_for_restart();
    let saved = saved_profile(&state_dir);
    check(&saved);
    assert_eq!(saved, live);
}
