//! The case hocus exists for: Python imports from an environment on a network mount.
//! The export lists the modules imported and the failed lookups of the import system.

use std::process::Command;

use hocus_tests::{Agent, NetworkMount, assert_success, file_entry, missing_lookups};

#[test]
fn a_python_import_from_the_mount_is_profiled() {
    let net = NetworkMount::start();
    net.put("env/lib/mypkg/__init__.py", b"from . import core, util\n");
    net.put("env/lib/mypkg/core.py", b"VALUE = 41\n");
    net.put(
        "env/lib/mypkg/util.py",
        b"from .core import VALUE\nANSWER = VALUE + 1\n",
    );
    net.put("env/lib/unused.py", b"raise SystemExit('never imported')\n");
    std::fs::create_dir_all(net.server_path("env/empty")).unwrap();
    let agent = Agent::start(&["--watch", net.mount.to_str().unwrap()]);

    let lib = net.path("env/lib");
    let out = Command::new("python3")
        .args(["-c", "import mypkg.util; print(mypkg.util.ANSWER)"])
        // An empty directory first on the path: every import probes it in vain.
        .env(
            "PYTHONPATH",
            format!("{}:{}", net.path("env/empty").display(), lib.display()),
        )
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .current_dir("/")
        .output()
        .expect("python3");
    assert_success(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "42");

    let p = agent.export();
    for module in ["mypkg/__init__.py", "mypkg/core.py", "mypkg/util.py"] {
        let f =
            file_entry(&p, &lib.join(module)).unwrap_or_else(|| panic!("{module} not in {p:#}"));
        assert_eq!(f["opens"], 1, "{f}");
        assert!(
            f["bytes_read"].as_u64().unwrap() >= f["size"].as_u64().unwrap(),
            "{f}"
        );
    }
    assert!(file_entry(&p, &lib.join("unused.py")).is_none());
    // The import system looks for the package's extension modules before __init__.py.
    assert_eq!(
        missing_lookups(&p, &lib.join("mypkg/__init__.abi3.so")),
        Some(1),
        "{p:#}"
    );
    assert!(
        p["dirs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["path"] == lib.join("mypkg").to_str().unwrap()),
        "the import system lists the package directory: {p:#}"
    );

    // As a person would look at it.
    let out = agent.cli(&["profile", "show"]).output().unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(table.starts_with("3 files"), "{table}");
    assert!(
        table.contains("Hottest files") && table.contains("mypkg/core.py"),
        "{table}"
    );
    assert!(table.contains("Failed lookups by directory"), "{table}");
}
