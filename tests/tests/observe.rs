//! Observation on a real network mount: a known workload must give exactly the expected
//! profile, and nothing outside the watched tree may appear in it.

use std::{
    fs,
    os::unix::{fs::PermissionsExt, process::CommandExt},
    path::Path,
    process::Command,
};

use hocus_tests::{Agent, NetworkMount, assert_success, file_entry, missing_lookups, read_all};
use serde_json::Value;

fn sh(script: &str) {
    let status = Command::new("sh").arg("-c").arg(script).status().unwrap();
    assert!(status.success(), "sh -c {script:?} failed");
}

/// Runs `python3 -c script`, which must succeed; its standard output.
fn python(script: &str) -> String {
    let out = Command::new("python3")
        .args(["-c", script])
        .output()
        .unwrap();
    assert_success(&out);
    String::from_utf8(out.stdout).unwrap()
}

fn all_paths(p: &Value) -> Vec<String> {
    ["files", "missing", "dirs"]
        .iter()
        .flat_map(|k| p[k].as_array().cloned().unwrap_or_default())
        .map(|e| e["path"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn known_workload_gives_exactly_the_expected_profile() {
    let net = NetworkMount::start();
    let big = net.put("data/big.bin", &vec![7u8; 100_000]);
    let small = net.put("env/small.txt", b"0123456789");
    fs::create_dir_all(net.server_path("out")).unwrap();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);

    // Reads of known files.
    for _ in 0..3 {
        assert_eq!(read_all(&big), 100_000);
    }
    assert_eq!(read_all(&small), 10);
    // Probes of names that do not exist: stat (statx) and open.
    for _ in 0..5 {
        assert!(fs::metadata(net.path("env/nope.py")).is_err());
    }
    for _ in 0..2 {
        assert!(fs::File::open(net.path("env/missing.so")).is_err());
    }
    // A short-lived process working relative to a directory on the mount.
    sh(&format!(
        "cd '{}' && cat small.txt > /dev/null && test ! -e ghost.py",
        net.path("env").display()
    ));
    // A write.
    fs::write(net.path("out/result.txt"), b"hello").unwrap();
    // Activity outside the watched tree.
    let local = tempfile::tempdir().unwrap();
    fs::write(local.path().join("local.txt"), b"local").unwrap();
    assert_eq!(read_all(&local.path().join("local.txt")), 5);
    assert!(fs::metadata(local.path().join("nope.py")).is_err());
    assert!(fs::metadata(net.root().join("beside-the-mount")).is_err());

    let p = agent.export();
    assert_eq!(p["version"], 2, "{p:#}");
    let f = file_entry(&p, &big).unwrap_or_else(|| panic!("{} missing from {p:#}", big.display()));
    assert_eq!(
        (f["opens"].as_u64(), f["bytes_read"].as_u64()),
        (Some(3), Some(300_000)),
        "{f}"
    );
    assert_eq!(
        (f["size"].as_u64(), f["written"].as_bool()),
        (Some(100_000), Some(false)),
        "{f}"
    );
    assert_eq!(f["uids"], serde_json::json!([0]), "{f}");
    let s = file_entry(&p, &small).unwrap();
    assert_eq!(
        (s["opens"].as_u64(), s["bytes_read"].as_u64()),
        (Some(2), Some(20)),
        "{s}"
    );
    assert_eq!(
        missing_lookups(&p, &net.path("env/nope.py")),
        Some(5),
        "{p:#}"
    );
    assert_eq!(
        missing_lookups(&p, &net.path("env/missing.so")),
        Some(2),
        "{p:#}"
    );
    assert_eq!(
        missing_lookups(&p, &net.path("env/ghost.py")),
        Some(1),
        "{p:#}"
    );
    let r = file_entry(&p, &net.path("out/result.txt")).unwrap();
    assert_eq!(
        (r["written"].as_bool(), r["size"].as_u64()),
        (Some(true), Some(5)),
        "{r}"
    );

    // Exactly these entries, all inside the watched tree.
    let mut files: Vec<_> = p["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    files.sort();
    let mut expected =
        [&big, &small, &net.path("out/result.txt")].map(|p| p.to_str().unwrap().to_owned());
    expected.sort();
    assert_eq!(files, expected);
    assert_eq!(p["missing"].as_array().unwrap().len(), 3, "{p:#}");
    for path in all_paths(&p) {
        assert!(
            Path::new(&path).starts_with(&net.mount),
            "{path} is outside the watched tree"
        );
    }
    // First-touch order: the prefetch order.
    let order: Vec<_> = p["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert_eq!(order[0], big.to_str().unwrap());
    assert_eq!(order[2], net.path("out/result.txt").to_str().unwrap());
}

/// A failed lookup's path is read only if its thread asked a watched mount's server
/// since its last one (on FUSE, every lookup of a name the kernel does not hold is a
/// request), so the failed lookups of a process that uses the mount cost nothing on
/// local disk. Threads of one Python process interleave failed lookups on local disk
/// and on the mount, by stat and by open, and one works relative to a directory on the
/// mount: each watched one is counted exactly, and no local one appears.
#[test]
fn failed_lookups_among_local_ones_are_each_counted_in_every_thread() {
    let net = NetworkMount::start();
    fs::create_dir_all(net.server_path("env")).unwrap();
    let local = tempfile::tempdir().unwrap();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);

    let script = format!(
        "import os, threading\n\
         env, local = {:?}, {:?}\n\
         def probe(i):\n\
         \x20   for _ in range(50):\n\
         \x20       for _ in range(3):\n\
         \x20           assert not os.path.exists(os.path.join(local, f'nope{{i}}.py'))\n\
         \x20       assert not os.path.exists(os.path.join(env, f't{{i}}.py'))\n\
         \x20       try:\n\
         \x20           os.close(os.open(os.path.join(env, f't{{i}}.so'), os.O_RDONLY))\n\
         \x20           raise AssertionError('t{{i}}.so exists')\n\
         \x20       except FileNotFoundError:\n\
         \x20           pass\n\
         threads = [threading.Thread(target=probe, args=(i,)) for i in range(4)]\n\
         for t in threads: t.start()\n\
         for t in threads: t.join()\n\
         os.chdir(env)\n\
         for _ in range(10):\n\
         \x20   assert not os.path.exists(os.path.join(local, 'nope.py'))\n\
         \x20   assert not os.path.exists('relative.py')\n",
        net.path("env").to_str().unwrap(),
        local.path().to_str().unwrap(),
    );
    python(&script);

    let p = agent.export();
    for i in 0..4 {
        for name in [format!("env/t{i}.py"), format!("env/t{i}.so")] {
            assert_eq!(
                missing_lookups(&p, &net.path(&name)),
                Some(50),
                "{name}: {p:#}"
            );
        }
    }
    assert_eq!(
        missing_lookups(&p, &net.path("env/relative.py")),
        Some(10),
        "{p:#}"
    );
    assert_eq!(p["missing"].as_array().unwrap().len(), 9, "{p:#}");
}

/// A descriptor number outlives the file it held: after a close, or a dup2 onto it, its
/// next file's reads are that file's, and a file opened beside hundreds of others (a
/// grown descriptor table, as most processes have) is followed all the same. Python
/// juggles the descriptors; the counts must be exact.
#[test]
fn a_reused_descriptor_number_counts_for_its_new_file() {
    // The preferred way where the kernel has the kfunc (6.2): its BTF names it.
    let how = if hocus_tests::kernel_btf_names("bpf_rdonly_cast") {
        "open files: read with plain loads"
    } else {
        "open files: read with a helper call per field (this kernel has no bpf_rdonly_cast"
    };
    reused_descriptor_numbers(Agent::start, how);
}

/// The same on a kernel without `bpf_rdonly_cast` (before 6.2), where the programs read
/// descriptor tables and files with the helper.
#[test]
fn a_reused_descriptor_number_counts_for_its_new_file_without_kfuncs() {
    reused_descriptor_numbers(
        |args| Agent::start_with_fallbacks("kfuncs", args),
        "open files: read with a helper call per field",
    );
}

/// The same with every fallback an older kernel takes: the task read with the helper
/// (5.10), closes claimed by a plain store (before 5.12), exits told by the group's count.
#[test]
fn a_reused_descriptor_number_counts_for_its_new_file_with_every_fallback() {
    reused_descriptor_numbers(
        |args| Agent::start_with_fallbacks("all", args),
        "the current task: read with a helper call per field",
    );
}

/// `how`: what the daemon logs of how its programs read open files.
fn reused_descriptor_numbers(start: fn(&[&str]) -> Agent, how: &str) {
    let net = NetworkMount::start();
    let watched = net.put("data/watched.bin", &[1u8; 10_000]);
    let other = net.put("data/other.bin", &[2u8; 20_000]);
    let local = tempfile::tempdir().unwrap();
    let unwatched = local.path().join("local.bin");
    fs::write(&unwatched, [3u8; 50_000]).unwrap();
    let agent = start(&["--watch", net.mount.to_str().unwrap()]);

    let script = format!(
        "import os\n\
         watched, other, local = {:?}, {:?}, {:?}\n\
         fd = os.open(watched, os.O_RDONLY)\n\
         assert len(os.read(fd, 1000)) == 1000\n\
         os.close(fd)\n\
         # The number again, on an unwatched file: its bytes are nobody's.\n\
         again = os.open(local, os.O_RDONLY)\n\
         assert again == fd, (again, fd)\n\
         assert len(os.read(again, 50000)) == 50000\n\
         os.close(again)\n\
         # dup2 onto a watched descriptor closes it without a close.\n\
         fd = os.open(watched, os.O_RDONLY)\n\
         assert len(os.read(fd, 2000)) == 2000\n\
         spare = os.open(local, os.O_RDONLY)\n\
         os.dup2(spare, fd)\n\
         assert len(os.read(fd, 50000)) == 50000\n\
         os.close(spare); os.close(fd)\n\
         # A grown descriptor table: the watched file lands past 300.\n\
         held = [os.open(local, os.O_RDONLY) for _ in range(300)]\n\
         fd = os.open(other, os.O_RDONLY)\n\
         assert fd > 300, fd\n\
         assert len(os.read(fd, 20000)) == 20000\n\
         os.close(fd)\n\
         for h in held: os.close(h)\n",
        watched.to_str().unwrap(),
        other.to_str().unwrap(),
        unwatched.to_str().unwrap(),
    );
    python(&script);

    let p = agent.export();
    let w = file_entry(&p, &watched).unwrap_or_else(|| panic!("{p:#}"));
    assert_eq!(
        (w["opens"].as_u64(), w["bytes_read"].as_u64()),
        (Some(2), Some(3000)),
        "{w}"
    );
    let o = file_entry(&p, &other).unwrap_or_else(|| panic!("{p:#}"));
    assert_eq!(
        (o["opens"].as_u64(), o["bytes_read"].as_u64()),
        (Some(1), Some(20_000)),
        "{o}"
    );
    assert!(agent.log().contains(how), "{}", agent.log());
}

/// Shared objects and memory-mapped data are read by page faults, not `read`: the pages
/// that enter a mapped watched file's page cache count as bytes read. Real programs:
/// Python mapping a data file (what `numpy.memmap` does) and importing a C extension
/// module from the mount (ld.so reads its ELF header, then maps it).
#[test]
fn pages_faulted_in_through_a_mapping_count_as_bytes_read() {
    let net = NetworkMount::start();
    let frames = hocus_tests::counting_bytes(8 << 20);
    let data = net.put("data/frames.bin", &frames);
    let module =
        std::path::PathBuf::from(python("import _decimal; print(_decimal.__file__)").trim());
    let module_bytes = fs::read(&module).unwrap();
    let so = net.put(
        &format!("env/lib/{}", module.file_name().unwrap().to_str().unwrap()),
        &module_bytes,
    );
    // Only .py files are copied: the daemon's own copy would fill the page cache first.
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--include-ext",
        ".py",
    ]);

    let touch_every_page = format!(
        "import mmap\n\
         with open('{}', 'rb') as f:\n    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n\
         print(sum(m[i] for i in range(0, len(m), 4096)))",
        data.display()
    );
    python(&touch_every_page);
    let import = format!(
        "import sys; sys.path.insert(0, '{}'); import _decimal\n\
         assert _decimal.__file__.startswith(sys.path[0]), _decimal.__file__\n\
         print(_decimal.Decimal(1) / _decimal.Decimal(7))",
        so.parent().unwrap().display()
    );
    assert!(python(&import).starts_with("0.142857"));

    let p = agent.export();
    let f =
        file_entry(&p, &data).unwrap_or_else(|| panic!("{} not profiled: {p:#}", data.display()));
    // Every page entered the page cache once, through the mapping; nothing was read().
    assert_eq!(
        (f["opens"].as_u64(), f["bytes_read"].as_u64(), &f["mapped"]),
        (Some(1), Some(8 << 20), &serde_json::json!(true)),
        "{f}"
    );
    let s = file_entry(&p, &so).unwrap_or_else(|| panic!("{} not profiled: {p:#}", so.display()));
    let read = s["bytes_read"].as_u64().unwrap();
    let pages = (module_bytes.len() as u64).div_ceil(4096) * 4096;
    // ld.so reads the 832-byte ELF header; the rest came in as the module was mapped
    // and run, a page or more, never more than the file holds.
    assert!(read > 832 + 4096 && read <= 832 + pages, "{s}");
}

#[test]
fn mutations_mark_files_and_directories_mutable() {
    let net = NetworkMount::start();
    net.put("cache/entry-1", b"compiled");
    net.put("cache/old", b"stale");
    net.put("cache/trunc", b"0123456789");
    net.put("ro/module.py", b"X = 1");
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);

    read_all(&net.path("ro/module.py"));
    read_all(&net.path("cache/entry-1"));
    fs::write(net.path("cache/tmp-123"), b"new entry").unwrap();
    fs::rename(net.path("cache/tmp-123"), net.path("cache/entry-2")).unwrap();
    fs::remove_file(net.path("cache/old")).unwrap();
    fs::create_dir(net.path("cache/sub")).unwrap();
    fs::File::options()
        .write(true)
        .open(net.path("cache/trunc"))
        .unwrap()
        .set_len(3)
        .unwrap();

    let p = agent.export();
    let written =
        |rel: &str| file_entry(&p, &net.path(rel)).map(|f| f["written"].as_bool().unwrap());
    assert_eq!(written("ro/module.py"), Some(false), "{p:#}");
    assert_eq!(written("cache/entry-1"), Some(false), "{p:#}");
    assert_eq!(written("cache/tmp-123"), Some(true), "{p:#}");
    assert_eq!(written("cache/entry-2"), Some(true), "{p:#}");
    assert_eq!(written("cache/old"), Some(true), "{p:#}");
    assert_eq!(written("cache/trunc"), Some(true), "{p:#}");
    let mutated = |rel: &str| {
        p["dirs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["path"] == net.path(rel).to_str().unwrap())
            .map(|d| d["mutated"].as_bool().unwrap())
    };
    assert_eq!(mutated("cache"), Some(true), "{p:#}");
    assert_eq!(mutated("cache/sub"), Some(true), "{p:#}");
    assert_eq!(mutated("ro"), None, "{p:#}");
}

#[test]
fn watches_every_network_mount_when_none_is_named() {
    let net = NetworkMount::start();
    let agent = Agent::start(&[]);
    let status = agent.status();
    let watched = status["watched"].as_array().unwrap();
    let ours = watched
        .iter()
        .find(|w| w["path"] == net.mount.to_str().unwrap())
        .unwrap_or_else(|| panic!("{} not watched: {status:#}", net.mount.display()));
    assert_eq!(ours["fs_type"], net.fs_type());
    assert_eq!(ours["network"], true);
    assert!(
        watched.iter().all(|w| w["network"] == true),
        "only network filesystems are watched by default: {status:#}"
    );
    assert!(agent.log().contains(&format!(
        "watching {} ({})",
        net.mount.display(),
        net.fs_type()
    )));
}

#[test]
fn refuses_to_watch_what_does_not_exist() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(hocus_tests::agent_bin())
        .args(["--watch", "/no/such/dir", "--state-dir"])
        .arg(dir.path().join("state"))
        .arg("--socket")
        .arg(dir.path().join("s.sock"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot watch /no/such/dir"), "{err}");
}

#[test]
fn an_ordinary_user_sees_only_what_they_can_read() {
    let net = NetworkMount::start();
    let public = net.put("shared/public.py", b"print('hi')");
    let private = net.put("shared/private.key", b"secret");
    fs::set_permissions(
        net.server_path("shared/private.key"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    fs::create_dir_all(net.server_path("locked")).unwrap();
    net.put("locked/inner.txt", b"x");
    fs::set_permissions(net.server_path("locked"), fs::Permissions::from_mode(0o700)).unwrap();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);
    // root reads everything and probes a name in the locked directory
    read_all(&public);
    read_all(&private);
    read_all(&net.path("locked/inner.txt"));
    assert!(fs::metadata(net.path("locked/ghost")).is_err());
    assert!(fs::metadata(net.path("shared/ghost")).is_err());

    let (uid, gid) = hocus_tests::test_user();
    let out = agent
        .cli(&["profile", "export"])
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    assert_success(&out);
    let p: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(file_entry(&p, &public).is_some(), "{p:#}");
    assert!(
        file_entry(&p, &private).is_none(),
        "a 0600 file of root leaked: {p:#}"
    );
    assert!(
        file_entry(&p, &net.path("locked/inner.txt")).is_none(),
        "{p:#}"
    );
    assert_eq!(
        missing_lookups(&p, &net.path("shared/ghost")),
        Some(1),
        "{p:#}"
    );
    assert_eq!(
        missing_lookups(&p, &net.path("locked/ghost")),
        None,
        "{p:#}"
    );
    let f = file_entry(&p, &public).unwrap();
    assert_eq!(
        f["uids"],
        serde_json::json!([]),
        "root's uid is not the user's to see: {f}"
    );
    assert_eq!(f["users"], 1);

    // status names the hottest files the same way
    let top = |status: &Value| -> Vec<String> {
        status["top"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["path"].as_str().unwrap().to_owned())
            .collect()
    };
    let out = agent
        .cli(&["status", "--json"])
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    assert_success(&out);
    let theirs = top(&serde_json::from_slice(&out.stdout).unwrap());
    assert_eq!(
        theirs,
        vec![public.to_str().unwrap().to_owned()],
        "{theirs:?}"
    );

    // root sees everything
    let all = agent.export();
    assert!(file_entry(&all, &private).is_some());
    assert!(file_entry(&all, &net.path("locked/inner.txt")).is_some());
    assert_eq!(top(&agent.status()).len(), 3);
}

#[test]
fn a_dead_network_mount_is_skipped_when_watching_all_of_them() {
    let alive = NetworkMount::start();
    let dead = NetworkMount::start();
    // Its server goes away: the FUSE mount stays, answering ENOTCONN.
    dead.kill_server();
    let agent = Agent::start(&[]);
    let status = agent.status();
    let watched: Vec<_> = status["watched"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["path"].clone())
        .collect();
    assert!(
        watched.contains(&alive.mount.to_str().unwrap().into()),
        "{status:#}"
    );
    assert!(
        !watched.contains(&dead.mount.to_str().unwrap().into()),
        "{status:#}"
    );
    assert!(
        agent
            .log()
            .contains(&format!("not watching {}", dead.mount.display())),
        "{}",
        agent.log()
    );
}
