//! `cargo xtask vm`: the kernel rig. Debian's stock kernels (5.10, 6.1, 6.12) booted on
//! this machine under QEMU with its root filesystem, running hocus, a command or the
//! integration tests there, with their output and exit code brought back. Kernel NFS
//! lives there too: this machine's kernel has no NFS client.
//!
//! - `kernels`: which kernels, fetched from Debian's archive and cached;
//! - `guest`: one boot running one command;
//! - `tools`: QEMU, virtme-ng and the guest's NFS tools, installed when missing.

pub mod guest;
pub mod kernels;
mod tools;

use std::{path::PathBuf, process::Command, time::Duration};

use anyhow::{Context, Result, bail};
use clap::{Subcommand, ValueEnum};

use crate::host::{cargo, is_root, target_dir};
use guest::{Boot, quote};
use kernels::{Kernel, SERIES};

#[derive(Subcommand)]
pub enum Vm {
    /// Fetch the kernels the rig boots (Debian 11, 12, 13's: 5.10, 6.1, 6.12) from
    /// Debian's archive, unless cached in target/vm, and list them.
    Kernels {
        /// Ask the archive for newer ones even when some are cached.
        #[arg(long)]
        refresh: bool,
    },
    /// Boot a kernel with the release build of hocus-agent on PATH and run a shell
    /// command there, as root in the checkout; exits with the command's code. E.g.
    /// `cargo xtask vm run --kernel 6.1 -- hocus-agent --version`.
    Run {
        #[command(flatten)]
        guest: GuestArgs,
        /// The command (run with `sh -c`).
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Run integration test files in a guest, against sshfs or kernel NFS (the tests'
    /// network mount, HOCUS_TEST_FS), e.g. `cargo xtask vm test --kernel 6.1 --fs nfs3
    /// --test observe`.
    Test {
        #[command(flatten)]
        guest: GuestArgs,
        /// The filesystem of the tests' network mounts.
        #[arg(long, value_enum, default_value_t = TestFs::Nfs3)]
        fs: TestFs,
        /// A test file of tests/tests (repeatable; default: smoke); `NAME:FILTER` runs
        /// only its tests whose names contain FILTER.
        #[arg(long = "test", value_name = "NAME")]
        tests: Vec<String>,
        /// Only tests whose name contains this.
        filter: Option<String>,
        /// Also the agent's unit tests of what a kernel may lack (fanotify's marks on
        /// binds), as the CI's guests run them.
        #[arg(long)]
        agent_unit_tests: bool,
    },
}

/// Where and how long a guest runs.
#[derive(clap::Args)]
pub struct GuestArgs {
    /// The kernel to boot: 5.10, 6.1 or 6.12 (repeatable: one boot each, in turn).
    #[arg(long, default_value = "6.1")]
    kernel: Vec<String>,
    /// The guest's memory, in MiB.
    #[arg(long, default_value_t = 4096)]
    memory_mib: u32,
    /// Stop a guest that runs longer than this, in seconds.
    #[arg(long, default_value_t = 1800)]
    timeout_secs: u64,
}

/// The filesystems the tests can put their network mount on.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum TestFs {
    /// sshfs over loopback (FUSE), as on this machine.
    Sshfs,
    /// Kernel NFS, version 3, served by the guest's own nfsd.
    Nfs3,
    /// Kernel NFS, version 4.2.
    Nfs4,
}

impl TestFs {
    fn name(self) -> &'static str {
        match self {
            Self::Sshfs => "sshfs",
            Self::Nfs3 => "nfs3",
            Self::Nfs4 => "nfs4",
        }
    }
}

pub fn run(vm: Vm) -> Result<()> {
    if !is_root() {
        bail!("the rig boots kernels and installs what it lacks: run it as root");
    }
    tools::ensure()?;
    match vm {
        Vm::Kernels { refresh } => {
            for s in SERIES {
                let k = kernels::fetch(s, refresh)?;
                println!(
                    "{:5} {:22} {} ({}, {})",
                    s.name,
                    s.distribution,
                    k.release,
                    k.package,
                    k.image.display()
                );
            }
            Ok(())
        }
        Vm::Run { guest, command } => {
            let agent = crate::build(true)?;
            let bin = agent.parent().context("the agent's folder")?;
            let command = format!(
                "export PATH={}:$PATH HOCUS_AGENT_BIN={}; {}",
                quote(&bin.display().to_string()),
                quote(&agent.display().to_string()),
                command.join(" ")
            );
            let mut last = 0;
            for k in guest.kernels()? {
                let ended = guest.boot(&k, command.clone(), Vec::new())?;
                last = ended.code.unwrap_or(124);
                if ended.code.is_none() {
                    eprintln!("{}", guest::console_tail(&ended.console, 30));
                }
            }
            std::process::exit(last)
        }
        Vm::Test {
            guest,
            fs,
            tests,
            filter,
            agent_unit_tests,
        } => {
            let tests = if tests.is_empty() {
                vec!["smoke".to_owned()]
            } else {
                tests
            };
            for k in guest.kernels()? {
                test_in(&guest, &k, fs, &tests, filter.as_deref(), agent_unit_tests)?;
            }
            Ok(())
        }
    }
}

impl GuestArgs {
    fn kernels(&self) -> Result<Vec<Kernel>> {
        self.kernel
            .iter()
            .map(|name| kernels::fetch(kernels::series(name)?, false))
            .collect()
    }

    fn boot(
        &self,
        kernel: &Kernel,
        command: String,
        env: Vec<(String, String)>,
    ) -> Result<guest::Ended> {
        println!(
            "vm: booting {} ({}) under QEMU",
            kernel.release, kernel.series.distribution
        );
        let ended = guest::run(&Boot {
            kernel,
            command,
            env,
            memory_mib: self.memory_mib,
            cpus: 2,
            timeout: Duration::from_secs(self.timeout_secs),
        })?;
        println!(
            "vm: {} done in {:.0} s ({})",
            kernel.release,
            ended.took.as_secs_f64(),
            match ended.code {
                Some(c) => format!("exit code {c}"),
                None => "did not finish".to_owned(),
            }
        );
        Ok(ended)
    }
}

/// What `cargo xtask test` runs in the guests: the smoke suite on each of Debian's
/// kernels over kernel NFS (v3 on 5.10 and 6.12, v4.2 on 6.1).
pub fn test_kernels() -> Result<()> {
    if !is_root() {
        bail!("the rig boots kernels and installs what it lacks: run it as root");
    }
    tools::ensure()?;
    let guest = GuestArgs {
        kernel: Vec::new(),
        memory_mib: 4096,
        timeout_secs: 1800,
    };
    // The smoke suite on each kernel; on Debian 12's, the suites kernel NFS changes the
    // answers of (who is followed, identities, the job-start check, root squash,
    // containers' mounts, attacks), over v3, and the NFS tests over v4.2 too; one guest
    // for v3, within the guest's time limit (about 17 of its 30 min). Resting while
    // served jobs run on the oldest kernel (over v3) and over v4.2 on 6.1 (its opens are
    // other requests); a Slurm
    // job resting while its opens hit (fanotify marks on its binds) on the newest. On each
    // kernel, the agent's own tests of what a kernel may lack (`AGENT_UNIT_TESTS`).
    // Jobs learned from the NFS client's functions (module BTF: 6.1 and 6.12) over v4.2
    // and v3; 5.10 says it learns from syscalls. Byte ranges by every route on each;
    // numpy and h5py's (big files written and read under emulation: minutes) on 6.1.
    // The attacks that touch neither the network filesystem nor a kernel feature (the
    // control socket's caps and descriptors, profiles' bounds) run on the host only:
    // under emulation each costs three times its host time, for the same answer.
    let runs: [(&str, TestFs, &[&str]); 4] = [
        ("5.10", TestFs::Nfs3, &["smoke", "rest", "requests:!numpy"]),
        (
            "6.1",
            TestFs::Nfs4,
            &["smoke", "follow", "nfs", "rest", "requests"],
        ),
        (
            "6.12",
            TestFs::Nfs3,
            &["smoke", "slurm:slurm_job", "requests:!numpy"],
        ),
        (
            "6.1",
            TestFs::Nfs3,
            &[
                "observe",
                "coherence",
                "nfs",
                "run",
                "identity",
                TRUST_IN_GUESTS,
            ],
        ),
    ];
    let mut unit_tested = Vec::new();
    for (name, fs, tests) in runs {
        let kernel = kernels::fetch(kernels::series(name)?, false)?;
        let tests: Vec<String> = tests.iter().map(|t| t.to_string()).collect();
        let unit = !unit_tested.contains(&name);
        unit_tested.push(name);
        test_in(&guest, &kernel, fs, &tests, None, unit)?;
    }
    Ok(())
}

/// The trust suite in a guest: all but the attacks on the daemon's own bounds.
const TRUST_IN_GUESTS: &str = "trust:!flood_of|accept_loop|descriptors_beyond|byte_ranges_are_hostile|only_root_saves|no_new_privs|client_hangs_up";

/// The agent's unit tests (a filter each, and what it skips) that use the kernel's own
/// features, beyond the integration tests: the fanotify marks on binds' mounts (Slurm
/// tasks' opens while the tracer rests), but in lazy snapshots' views, which these
/// kernels lack (6.13).
const AGENT_UNIT_TESTS: [(&str, &str); 1] = [("redirect::bind_opens::", "lazy_snapshot")];

/// The agent's unit-test binary, built.
fn agent_unit_tests() -> Result<PathBuf> {
    let mut cmd = cargo();
    cmd.args(["test", "--package", "hocus-agent", "--bin", "hocus-agent"]);
    let built = test_executables(&mut cmd, "the agent's unit tests")?;
    built
        .into_iter()
        .next()
        .map(|(_, exe)| exe)
        .context("no unit-test binary of hocus-agent")
}

/// Builds the tests `cmd` (`cargo test ...`) names without running them; returns each
/// test target's name and executable.
fn test_executables(cmd: &mut Command, what: &str) -> Result<Vec<(String, PathBuf)>> {
    cmd.args(["--no-run", "--message-format", "json"]);
    let out = cmd.output().with_context(|| format!("building {what}"))?;
    if !out.status.success() {
        bail!(
            "building {what} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|m| {
            let name = m["target"]["name"].as_str()?.to_owned();
            Some((name, PathBuf::from(m["executable"].as_str()?)))
        })
        .collect())
}

/// Runs test files `tests` of tests/tests in a guest of `kernel`, one after the other,
/// with the release build of the agent: under emulation the debug build's slowness is
/// multiplied (the host's suites test the debug build).
pub fn test_in(
    guest: &GuestArgs,
    kernel: &Kernel,
    fs: TestFs,
    tests: &[String],
    filter: Option<&str>,
    unit: bool,
) -> Result<()> {
    let agent = crate::build(true)?;
    // `file:filter` runs only that file's tests whose names hold the filter;
    // `file:!a|b` all but those whose names hold `a` or `b`.
    let (files, filters): (Vec<String>, Vec<Option<&str>>) = tests
        .iter()
        .map(|t| match t.split_once(':') {
            Some((file, only)) => (file.to_owned(), Some(only)),
            None => (t.clone(), filter),
        })
        .unzip();
    let binaries = test_binaries(&files)?;
    let mut command = String::from("set -e\n");
    if unit {
        let bin = quote(&agent_unit_tests()?.display().to_string());
        for (f, skip) in AGENT_UNIT_TESTS {
            command += &format!("echo '== agent unit tests {f} on {}'\n", kernel.release);
            command += &format!(
                "{bin} {} --skip {} --test-threads 1\n",
                quote(f),
                quote(skip)
            );
        }
    }
    for (name, binary) in &binaries {
        let filter = files
            .iter()
            .position(|f| f == name)
            .and_then(|i| filters[i]);
        command += &format!(
            "echo '== {name} on {} over {}'\n",
            kernel.release,
            fs.name()
        );
        // Each test's time (libtest's, unstable: RUSTC_BOOTSTRAP below).
        command += &format!(
            "{} --test-threads 1 -Z unstable-options --report-time",
            quote(&binary.display().to_string())
        );
        match filter.map(|f| f.strip_prefix('!').ok_or(f)) {
            Some(Ok(skips)) => {
                for skip in skips.split('|') {
                    command += &format!(" --skip {}", quote(skip));
                }
            }
            Some(Err(only)) => command += &format!(" {}", quote(only)),
            None => {}
        }
        command += "\n";
    }
    let env = vec![
        ("HOCUS_AGENT_BIN".to_owned(), agent.display().to_string()),
        (
            "HOCUS_SPANK_PLUGIN".to_owned(),
            agent
                .with_file_name("libhocus_spank.so")
                .display()
                .to_string(),
        ),
        ("HOCUS_TEST_FS".to_owned(), fs.name().to_owned()),
        ("RUSTC_BOOTSTRAP".to_owned(), "1".to_owned()),
    ];
    let ended = guest.boot(kernel, command, env)?;
    guest::check(
        &ended,
        &format!("the tests {} on {}", tests.join(", "), kernel.release),
    )
}

/// The test binaries of the named files of tests/tests, built.
fn test_binaries(names: &[String]) -> Result<Vec<(String, PathBuf)>> {
    let mut cmd = cargo();
    cmd.args(["test", "--package", "hocus-tests"]);
    for n in names {
        cmd.args(["--test", n]);
    }
    // tests/nfs.rs needs kernel NFS: built for the guests alone.
    if names.iter().any(|n| n == "nfs") {
        cmd.args(["--features", "kernel-nfs"]);
    }
    let mut found = test_executables(&mut cmd, "the tests")?;
    found.retain(|(name, _)| names.contains(name));
    for n in names {
        if !found.iter().any(|(f, _)| f == n) {
            bail!("no test file {n} in tests/tests");
        }
    }
    // The guest runs them from the checkout: they must be there.
    let target = target_dir();
    if let Some((_, outside)) = found.iter().find(|(_, p)| !p.starts_with(&target)) {
        bail!("{} is outside {}", outside.display(), target.display());
    }
    Ok(found)
}
