//! `cargo xtask test`, what CI runs: everything built once, then two lanes of work side
//! by side on this machine kind's two cores. One lane runs on the host: the unit
//! tests, the integration suites, the Debian package with the Slurm suites against its
//! installed files, the benchmarks' smoke runs; these mostly wait on the network
//! fixture and on daemons. Beside it the kernel rig's guests, each a busy host thread
//! under emulation, two at a time (`vm::test_kernels`). A failure is kept and the rest
//! still runs; the run ends with its phases, its ten slowest tests and what failed
//! (`suites::Report`). docs/testing.md.

use std::{path::Path, process::Command, thread};

use anyhow::{Context, Result, bail};

use crate::{
    agent::build,
    bench, host, package,
    suites::{
        Report,
        binaries::{TestBinary, integration_tests, unit_tests},
    },
    vm,
};

/// The Slurm suites: in a whole run, the Debian package's phase runs them (against the
/// installed daemon and plugin, what a site runs), so the host's phase leaves them to it.
const SLURM_SUITES: [&str; 2] = ["slurm", "slurm_containers"];

/// The library's own tests in the integration test package (its fixtures).
const FIXTURES: &str = "hocus_tests";

/// The whole run (or, with `filter`, the unit tests and the host suites' tests whose
/// names hold it); `bench_smoke` runs the benchmarks' smoke runs with an agent.
pub fn test(filter: Option<String>, bench_smoke: impl Fn(&Path) -> Result<()>) -> Result<()> {
    let report = Report::default();
    let whole = filter.is_none();
    if !host::is_root() {
        bail!(
            "the integration tests load eBPF programs and mount filesystems: run them as root (sudo -E cargo xtask test)"
        );
    }
    // The kernels come from Debian's archive while the guests' part builds, then the
    // host's part builds, and the lanes start.
    let (kernels, for_guests) = thread::scope(|s| {
        let kernels = whole.then(|| {
            s.spawn(|| {
                let kernels = report.phase("kernels fetched", vm::ci_kernels);
                // Installed here, beside the build, rather than on the host lane's end.
                let _ = report.phase("Python packages for the benchmarks", bench::smoke_packages);
                kernels
            })
        });
        let for_guests = whole
            .then(|| {
                report.phase("build for the guests", || {
                    vm::Built::new(&vm::ci_test_files(), false)
                })
            })
            .transpose();
        let kernels = kernels.map(|k| {
            k.join()
                .unwrap_or_else(|_| bail!("the kernels' fetch panicked"))
        });
        (kernels, for_guests)
    });
    let for_guests = for_guests?;
    // Before the lanes, not beside them: beside two guests it took 214 s of the host's
    // lane, the critical one (CI-11), and the guests' lanes end minutes before it.
    let built = report.phase("build for the host", || Built::new(for_guests.as_ref()));
    thread::scope(|s| {
        let guests = kernels.zip(for_guests.as_ref()).map(|(fetched, built)| {
            let report = &report;
            s.spawn(move || vm::test_kernels(report, built, &fetched?))
        });
        let built = match built {
            Ok(built) => built,
            Err(_) => {
                if let Some(guests) = guests {
                    let _ = guests.join();
                }
                return;
            }
        };
        let _ = report.phase("unit tests", || {
            let failed: Vec<&str> = built
                .unit
                .iter()
                .filter(|t| {
                    let mut cmd = run(t, &[], None);
                    report.run_tests("host", &t.target, &mut cmd).is_err()
                })
                .map(|t| t.target.as_str())
                .collect();
            match failed.is_empty() {
                true => Ok(()),
                false => bail!("failed: {}", failed.join(", ")),
            }
        });
        let _ = report.phase("host suites", || {
            host_suites(&report, &built, filter.as_deref())
        });
        if whole {
            let _ = report.phase("the Debian package, Slurm suites on its files", || {
                package_phase(&report, &built)
            });
            // Benchmarks run in CI only as smoke runs: that they work, not what they
            // say (the debug build of the daemon, one short round).
            let _ = report.phase("benchmarks' smoke runs", || bench_smoke(&built.agent));
        }
        if let Some(guests) = guests {
            // Each guest is a phase of the report; what stopped them all is not.
            if let Ok(Err(e)) = guests.join() {
                let _ = report.phase("guests", || -> Result<()> { Err(e) });
            }
        }
    });
    print!("{}", report.summary());
    if report.failed() {
        bail!("the tests failed (above)");
    }
    Ok(())
}

/// What the host's lane runs, built before any of its tests run.
struct Built {
    /// The debug build the host's suites test.
    agent: std::path::PathBuf,
    unit: Vec<TestBinary>,
    integration: Vec<TestBinary>,
    /// The release build, for the package.
    release: Option<std::path::PathBuf>,
}

impl Built {
    /// The host's part; the test binaries are the guests' own where they were built,
    /// and the unit tests go to the guests that wait for them.
    fn new(for_guests: Option<&vm::Built>) -> Result<Self> {
        let unit = unit_tests();
        if let Some(g) = for_guests {
            g.unit_tests.give(&unit);
        }
        let unit = unit?;
        let agent = build(false)?;
        let (integration, release) = match for_guests {
            Some(g) => (g.tests.clone(), Some(g.agent.clone())),
            None => (integration_tests()?, None),
        };
        Ok(Self {
            agent,
            unit,
            integration,
            release,
        })
    }
}

/// A test binary run as cargo runs it (in its package's folder), one test at a time
/// with their times where `one_at_a_time`, with the daemon and plugin under test.
fn run(t: &TestBinary, args: &[&str], agent: Option<(&Path, &Path)>) -> Command {
    let mut cmd = Command::new(&t.exe);
    cmd.current_dir(&t.dir)
        .env("RUSTC_BOOTSTRAP", "1")
        .args(["-Z", "unstable-options", "--report-time"])
        .args(args);
    if let Some((agent, plugin)) = agent {
        cmd.env("HOCUS_AGENT_BIN", agent)
            .env("HOCUS_SPANK_PLUGIN", plugin);
    }
    cmd
}

/// The integration suites on the host, one after the other: in a whole run those built
/// by default but the Slurm ones, and the fixtures' own tests; with a filter, every
/// suite built by default, only its tests whose names hold it.
fn host_suites(report: &Report, built: &Built, filter: Option<&str>) -> Result<()> {
    let defaults = test_suites()?;
    let plugin = built.agent.with_file_name("libhocus_spank.so");
    let mut failed = Vec::new();
    for t in &built.integration {
        let wanted = t.target == FIXTURES
            || (defaults.contains(&t.target)
                && (filter.is_some() || !SLURM_SUITES.contains(&t.target.as_str())));
        if !wanted {
            continue;
        }
        let mut args = vec!["--test-threads", "1"];
        args.extend(filter);
        let mut cmd = run(t, &args, Some((&built.agent, &plugin)));
        if report.run_tests("host", &t.target, &mut cmd).is_err() {
            failed.push(t.target.clone());
        }
    }
    if !failed.is_empty() {
        bail!("failed: {}", failed.join(", "));
    }
    Ok(())
}

/// The package an admin installs: built, installed, the Slurm tests run against the
/// installed daemon and plugin, then removed and purged.
fn package_phase(report: &Report, built: &Built) -> Result<()> {
    let release = built.release.as_ref().context("no release build")?;
    let deb = package::build(release)?;
    let aside = package::SetAside::take()?;
    package::install(&deb)?;
    let mut result = Ok(());
    for suite in SLURM_SUITES {
        let t = built
            .integration
            .iter()
            .find(|t| t.target == suite)
            .with_context(|| format!("no test file {suite}"))?;
        let installed = (Path::new(package::AGENT), Path::new(package::PLUGIN));
        let mut cmd = run(t, &["--test-threads", "1"], Some(installed));
        if let Err(e) = report.run_tests("host", suite, &mut cmd) {
            result = Err(e);
        }
    }
    package::remove()?;
    drop(aside);
    result
}

/// The integration suites built by default (not those that need a feature: the kernel
/// NFS tests, for the rig's guests), by name, as cargo knows them.
fn test_suites() -> Result<Vec<String>> {
    let out = host::cargo()
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .output()
        .context("cargo metadata")?;
    if !out.status.success() {
        bail!("cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    }
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let tests = meta["packages"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["name"] == "hocus-tests"))
        .context("no hocus-tests package in cargo metadata")?;
    let mut names: Vec<String> = tests["targets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| {
            t["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == "test"))
        })
        .filter(|t| t["required-features"].as_array().is_none_or(Vec::is_empty))
        .filter_map(|t| t["name"].as_str().map(str::to_owned))
        .collect();
    names.sort();
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_suites_built_by_default_leave_out_those_that_need_a_feature() {
        let suites = test_suites().unwrap();
        assert!(
            ["smoke", "trust", "slurm"]
                .iter()
                .all(|s| suites.contains(&s.to_string()))
        );
        assert!(!suites.contains(&"nfs".to_owned()));
    }
}
