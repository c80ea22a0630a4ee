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

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, Result, anyhow, bail};
use clap::{Subcommand, ValueEnum};

use crate::{
    host::is_root,
    suites::{
        Report,
        binaries::{ONE_AT_A_TIME_TIMED, TestBinary, integration_tests, unit_tests},
    },
};
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
            let agent = crate::agent::build(true)?;
            let bin = agent.parent().context("the agent's folder")?;
            let command = format!(
                "export PATH={}:$PATH HOCUS_AGENT_BIN={}; {}",
                quote(&bin.display().to_string()),
                quote(&agent.display().to_string()),
                command.join(" ")
            );
            let mut last = 0;
            let print = |line: &str| println!("{line}");
            for k in guest.kernels()? {
                let ended = guest.boot(&k, command.clone(), Vec::new(), &print)?;
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
            let built = Built::new(&tests, agent_unit_tests)?;
            let report = Report::default();
            for k in guest.kernels()? {
                let run = GuestRun {
                    kernel: k.series.name,
                    fs,
                    tests: tests.iter().map(String::as_str).collect(),
                    filter: filter.as_deref(),
                    unit: agent_unit_tests,
                };
                report.phase(&run.name(), || run.boot(&guest, &k, &built, &report))?;
            }
            print!("{}", report.summary());
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
        on_line: &(dyn Fn(&str) + Sync),
    ) -> Result<guest::Ended> {
        on_line(&format!(
            "vm: booting {} ({}) under QEMU",
            kernel.release, kernel.series.distribution
        ));
        let ended = guest::run(&Boot {
            kernel,
            command,
            env,
            memory_mib: self.memory_mib,
            // One: the emulation is one host thread for all of a guest's CPUs, and a
            // second only adds IPIs and TLB shootdowns to emulate (identity and nfs
            // suites in a 6.1 guest, side by side: 7-10% faster with one).
            cpus: 1,
            timeout: Duration::from_secs(self.timeout_secs),
            on_line,
        })?;
        on_line(&format!(
            "vm: {} done in {:.0} s ({})",
            kernel.release,
            ended.took.as_secs_f64(),
            match ended.code {
                Some(c) => format!("exit code {c}"),
                None => "did not finish".to_owned(),
            }
        ));
        Ok(ended)
    }
}

/// One boot of the rig running integration test files (and perhaps the agent's unit
/// tests of what a kernel may lack) over one filesystem.
pub struct GuestRun<'a> {
    pub kernel: &'static str,
    pub fs: TestFs,
    /// Test files of tests/tests; `file:filter` runs only that file's tests whose
    /// names hold the filter, `file:!a|b` all but those whose names hold `a` or `b`.
    pub tests: Vec<&'a str>,
    /// For the files named without one.
    pub filter: Option<&'a str>,
    pub unit: bool,
}

/// What the CI's guests run, and about how long each took in a whole run (two run at
/// once, each on a host thread of its own: the longest first, on the less loaded
/// lane). The smoke suite on each kernel; on Debian 12's, the suites kernel NFS changes
/// the answers of (who is followed, identities, the job-start check, root squash,
/// containers' mounts, attacks), over v3, and the NFS tests over v4.2 too. Resting
/// while served jobs run on the oldest kernel (over v3) and over v4.2 on 6.1 (its opens
/// are other requests); a Slurm job resting while its opens hit (fanotify marks on its
/// binds) on the newest. On each kernel, the agent's own tests of what a kernel may lack
/// (`AGENT_UNIT_TESTS`). Jobs learned from the NFS client's functions (module BTF: 6.1
/// and 6.12) over v4.2 and v3; 5.10 says it learns from syscalls. Byte ranges by every
/// route on each; numpy and h5py's (big files written and read under emulation:
/// minutes) on 6.1. The attacks that touch neither the network filesystem nor a kernel
/// feature (the control socket's caps and descriptors, profiles' bounds, the signals
/// of the daemon's own children) run on the host only: under emulation each costs three
/// times its host time, for the same answer; and so do the tests that force on 6.1 a
/// fallback 6.1 takes anyway (no bpf_rdonly_cast, no SO_PEERPIDFD, no lazy snapshots),
/// or a fallback made in the daemon alone (descriptors marked close-on-exec at start).
/// The smoke suite runs over v3 on each kernel, not again over v4.2; the NFS tests'
/// 17,000 opens of one user (the open-file table's bound per user, which the version
/// does not change: 80 s under emulation) over v4.2 only.
pub const CI_GUESTS: [(&str, TestFs, &[&str], bool, u64); 4] = [
    (
        "6.1",
        TestFs::Nfs3,
        &[
            "observe:!without_kfuncs",
            "coherence",
            "nfs:!thousands_of_open",
            RUN_IN_GUESTS,
            "identity",
            TRUST_IN_GUESTS,
        ],
        true,
        1314,
    ),
    (
        "6.1",
        TestFs::Nfs4,
        &["follow", "nfs", "rest", "requests"],
        false,
        534,
    ),
    (
        "5.10",
        TestFs::Nfs3,
        &["smoke", "rest", "requests:!numpy"],
        true,
        312,
    ),
    (
        "6.12",
        TestFs::Nfs3,
        &["smoke", "slurm:slurm_job", "requests:!numpy"],
        true,
        361,
    ),
];

/// The test files the CI's guests run.
pub fn ci_test_files() -> Vec<String> {
    let mut files: Vec<String> = CI_GUESTS
        .iter()
        .flat_map(|(_, _, tests, _, _)| tests.iter())
        .map(|t| t.split_once(':').map_or(*t, |(f, _)| f).to_owned())
        .collect();
    files.sort();
    files.dedup();
    files
}

/// The kernels the CI's guests boot, fetched unless cached.
pub fn ci_kernels() -> Result<Vec<Kernel>> {
    tools::ensure()?;
    SERIES.iter().map(|s| kernels::fetch(*s, false)).collect()
}

/// The CI's guests, two at a time (a guest is one busy host thread; this machine kind
/// has two), each lane taking the longest guest left when it is free. Every guest runs
/// though one fails: each is a phase of `report`, which keeps its failure; what fails
/// here is only what stops the guests from running at all.
pub fn test_kernels(report: &Report, built: &Built, kernels: &[Kernel]) -> Result<()> {
    if !is_root() {
        bail!("the rig boots kernels and installs what it lacks: run it as root");
    }
    // Two guests and the host's lane share two cores: a guest runs about 1.5 times
    // slower than alone, and 6.1 over v3 took 2,000 s (CI-5); 1,800 s stopped it.
    let guest = GuestArgs {
        kernel: Vec::new(),
        memory_mib: 4096,
        timeout_secs: 3600,
    };
    let mut runs: Vec<_> = CI_GUESTS.iter().collect();
    runs.sort_by_key(|r| std::cmp::Reverse(r.4));
    let queue = std::sync::Mutex::new(runs.into_iter());
    let lane = || -> Result<()> {
        loop {
            // Taken alone: a guard in the loop's condition would be held through the
            // boot, and the lanes would run one after the other.
            let next = queue.lock().map_err(|_| anyhow!("poisoned"))?.next();
            let Some(&(name, fs, tests, unit, _)) = next else {
                break;
            };
            let kernel = kernels
                .iter()
                .find(|k| k.series.name == name)
                .with_context(|| format!("no kernel {name} fetched"))?;
            let run = GuestRun {
                kernel: name,
                fs,
                tests: tests.to_vec(),
                filter: None,
                unit,
            };
            let _ = report.phase(&run.name(), || run.boot(&guest, kernel, built, report));
        }
        Ok(())
    };
    std::thread::scope(|s| {
        let other = s.spawn(lane);
        let here = lane();
        let there = other.join().map_err(|_| anyhow!("a guest lane panicked"))?;
        here.and(there)
    })
}

/// The trust suite in a guest: all but the attacks on the daemon's own bounds and
/// children, and the forced fallback of callers' pids 6.1 takes anyway.
const TRUST_IN_GUESTS: &str = "trust:!flood_of|accept_loop|descriptors_beyond|byte_ranges_are_hostile|only_root_saves|no_new_privs|client_hangs_up|signals_are_never|understates_sizes|without_peer_pidfds";

/// The run suite in a guest: all but its jobs' signals and status (the daemon's own
/// children), the forced close-on-exec fallback, and whole snapshots (6.1's only kind).
const RUN_IN_GUESTS: &str =
    "run:!signals_reach|no_descriptor_of_the_daemon_with_every_fallback|whole_snapshots";

/// The agent's unit tests (a filter each, and what it skips) that use the kernel's own
/// features, beyond the integration tests: the fanotify marks on binds' mounts (Slurm
/// tasks' opens while the tracer rests), but in lazy snapshots' views, which these
/// kernels lack (6.13).
const AGENT_UNIT_TESTS: [(&str, &str); 1] = [("redirect::bind_opens::", "lazy_snapshot")];

/// What the guests run, built once: the release build of the agent (under emulation
/// the debug build's slowness is multiplied; the host's suites test the debug build),
/// the integration tests and the unit tests (the host's own binaries), and the Python
/// packages the guests' tests import (a guest has no network to install them).
pub struct Built {
    pub agent: PathBuf,
    pub tests: Vec<TestBinary>,
    /// The unit tests (the agent's run in some guests): in a whole run the host builds
    /// them while the first guests boot, and a guest that runs them waits for them.
    pub unit_tests: Later<Vec<TestBinary>>,
}

/// A value another thread will give, once: waited for.
#[derive(Default)]
pub struct Later<T> {
    value: std::sync::Mutex<Option<Result<T, String>>>,
    given: std::sync::Condvar,
}

impl<T: Clone> Later<T> {
    pub fn give(&self, value: &Result<T>) {
        let mut v = self.value.lock().unwrap_or_else(|p| p.into_inner());
        *v = Some(match value {
            Ok(given) => Ok(given.clone()),
            Err(e) => Err(format!("{e:#}")),
        });
        self.given.notify_all();
    }

    pub fn wait(&self) -> Result<T> {
        let mut v = self.value.lock().unwrap_or_else(|p| p.into_inner());
        while v.is_none() {
            v = self.given.wait(v).unwrap_or_else(|p| p.into_inner());
        }
        v.clone().expect("given").map_err(|e| anyhow!(e))
    }
}

impl Built {
    /// Builds what guests running the test files `files` need; the unit tests too
    /// with `unit_tests` (else the caller gives them to `unit_tests` later).
    pub fn new(files: &[String], with_unit_tests: bool) -> Result<Self> {
        let agent = crate::agent::build(true)?;
        let names: Vec<String> = files
            .iter()
            .map(|t| t.split_once(':').map_or(t.as_str(), |(f, _)| f).to_owned())
            .collect();
        let tests = integration_tests()?;
        for n in &names {
            if !tests.iter().any(|t| &t.target == n) {
                bail!("no test file {n} in tests/tests");
            }
        }
        let later = Later::default();
        if with_unit_tests {
            later.give(&unit_tests());
        }
        if names.iter().any(|n| n == "requests") {
            println!("vm: the Python packages the guests' tests import (numpy, h5py)");
            hocus_tests::numpy_h5py();
        }
        // The tests' user, made here before any guest boots: a guest's /etc is an
        // overlay on this machine's, and a useradd here while a guest runs replaces the
        // /etc/passwd under it ("useradd: cannot open /etc/passwd" in the guest, on a
        // fresh machine whose host suites made the user meanwhile).
        hocus_tests::test_user();
        Ok(Self {
            agent,
            tests,
            unit_tests: later,
        })
    }
}

impl GuestRun<'_> {
    /// `6.1/nfs3: observe, coherence, ...`.
    pub fn name(&self) -> String {
        format!("guest {}: {}", self.place(), self.tests.join(", "))
    }

    fn place(&self) -> String {
        format!("{}/{}", self.kernel, self.fs.name())
    }

    /// Boots `kernel` and runs the tests there, one file after the other, their lines
    /// and times into `report`. A file that fails does not stop the next: the guest's
    /// code says whether any failed, and the report which.
    fn boot(
        &self,
        guest: &GuestArgs,
        kernel: &Kernel,
        built: &Built,
        report: &Report,
    ) -> Result<()> {
        let mut command = String::from("failed=0\n");
        if self.unit {
            let units = built.unit_tests.wait()?;
            let bin = units
                .iter()
                .find(|t| t.target == "hocus-agent")
                .context("no unit-test binary of hocus-agent")?;
            let bin = quote(&bin.exe.display().to_string());
            for (f, skip) in AGENT_UNIT_TESTS {
                command += &format!("echo '== agent unit tests {f} on {}'\n", kernel.release);
                command += &format!(
                    "{bin} {} --skip {} {} || failed=1\n",
                    quote(f),
                    quote(skip),
                    ONE_AT_A_TIME_TIMED.join(" ")
                );
            }
        }
        for t in &self.tests {
            let (file, filter) = match t.split_once(':') {
                Some((file, only)) => (file, Some(only)),
                None => (*t, self.filter),
            };
            let binary = built
                .tests
                .iter()
                .find(|b| b.target == file)
                .with_context(|| format!("no test file {file} in tests/tests"))?;
            command += &format!(
                "echo '== {file} on {} over {}'\n",
                kernel.release,
                self.fs.name()
            );
            command += &format!(
                "{} {}",
                quote(&binary.exe.display().to_string()),
                ONE_AT_A_TIME_TIMED.join(" ")
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
            command += " || failed=1\n";
        }
        command += "exit $failed\n";
        let env = vec![
            (
                "HOCUS_AGENT_BIN".to_owned(),
                built.agent.display().to_string(),
            ),
            (
                "HOCUS_SPANK_PLUGIN".to_owned(),
                built
                    .agent
                    .with_file_name("libhocus_spank.so")
                    .display()
                    .to_string(),
            ),
            ("HOCUS_TEST_FS".to_owned(), self.fs.name().to_owned()),
            ("RUSTC_BOOTSTRAP".to_owned(), "1".to_owned()),
        ];
        let place = self.place();
        // The suite each line belongs to, from the headers above.
        let suite = std::sync::Mutex::new(String::from("boot"));
        let on_line = |line: &str| {
            let mut suite = suite.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(name) = line
                .strip_prefix("== ")
                .and_then(|l| l.split(" on ").next())
            {
                *suite = name.trim_start_matches("agent unit tests ").to_owned();
            }
            report.line(&place, &suite, line);
        };
        let ended = guest.boot(kernel, command, env, &on_line)?;
        guest::check(
            &ended,
            &format!("the tests {} on {}", self.tests.join(", "), kernel.release),
        )
    }
}
