//! The test executables cargo builds, found by its JSON messages: built once, run on
//! the host and in the guests alike.

use std::{path::PathBuf, process::Command};

use anyhow::{Context, Result, bail};

use crate::host::{cargo, target_dir};

/// A test executable cargo built: its target (`smoke`, `hocus_tests`, `hocus-agent`),
/// where it is, and its package's folder (cargo runs tests there).
#[derive(Clone, Debug)]
pub struct TestBinary {
    pub target: String,
    pub exe: PathBuf,
    pub dir: PathBuf,
}

/// The integration tests, built: the library's and every file of tests/tests, those
/// that need kernel NFS too (one build for the host and the guests; the feature only
/// adds tests/nfs.rs).
pub fn integration_tests() -> Result<Vec<TestBinary>> {
    let mut cmd = cargo();
    cmd.args([
        "test",
        "--package",
        "hocus-tests",
        "--features",
        "kernel-nfs",
    ]);
    let found = test_executables(&mut cmd, "the integration tests")?;
    // The guest runs them from the checkout: they must be there.
    let target = target_dir();
    if let Some(outside) = found.iter().find(|t| !t.exe.starts_with(&target)) {
        bail!("{} is outside {}", outside.exe.display(), target.display());
    }
    Ok(found)
}

/// The packages' unit tests, built.
pub fn unit_tests() -> Result<Vec<TestBinary>> {
    let mut cmd = cargo();
    cmd.arg("test");
    for p in UNIT_TESTED {
        cmd.args(["--package", p]);
    }
    test_executables(&mut cmd, "the unit tests")
}

/// The packages whose unit tests `cargo xtask test` runs.
pub const UNIT_TESTED: [&str; 4] = ["hocus-common", "hocus-agent", "hocus-spank", "xtask"];

/// Builds the tests `cmd` (`cargo test ...`) names without running them.
fn test_executables(cmd: &mut Command, what: &str) -> Result<Vec<TestBinary>> {
    cmd.args(["--no-run", "--message-format", "json"]);
    cmd.stderr(std::process::Stdio::inherit());
    let out = cmd.output().with_context(|| format!("building {what}"))?;
    if !out.status.success() {
        bail!("building {what} failed");
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|m| {
            let target = m["target"]["name"].as_str()?.to_owned();
            let exe = PathBuf::from(m["executable"].as_str()?);
            let dir = PathBuf::from(m["manifest_path"].as_str()?)
                .parent()?
                .to_owned();
            Some(TestBinary { target, exe, dir })
        })
        .collect())
}

/// Libtest's flags for one test at a time with each test's time (unstable: the
/// binary is run with RUSTC_BOOTSTRAP=1).
pub const ONE_AT_A_TIME_TIMED: [&str; 5] = [
    "--test-threads",
    "1",
    "-Z",
    "unstable-options",
    "--report-time",
];
