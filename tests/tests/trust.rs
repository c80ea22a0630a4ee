//! The root daemon against its own users: each test makes an attack an ordinary user
//! could make, shows it was really attempted, then that nothing outside the cache changed
//! and the daemon still serves everyone (docs/security.md).

use std::{
    collections::BTreeMap,
    fs,
    os::unix::{fs::PermissionsExt, process::CommandExt},
    path::Path,
    time::Duration,
};

use hocus_tests::{Agent, NetworkMount, assert_success, read_all, test_user};
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
    std::thread::sleep(Duration::from_secs(5));
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
    assert!(
        !log.contains(&format!("taking a snapshot of {}", link.display())),
        "root walked a tree through the user's symlink:\n{log}"
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
