//! Makes a fresh Debian machine able to build, run and test hocus, idempotently:
//! the facts of docs/toolchain.md turned into steps.
//!
//! - Debian's rustc 1.96 (rustc-web) with its core source (rust-web-src), linked as a
//!   rustup toolchain named `bpf`: `-Z build-std=core` for the bpf target needs rust-src,
//!   which the machine's rustup toolchains lack and cannot download;
//! - bpf-linker 0.13 built against Debian's LLVM 22;
//! - sshfs and an OpenSSH server for the tests' real network mount, python3 for the
//!   import tests, Prometheus (server and promtool) for the metrics tests;
//! - Slurm (slurmctld, slurmd, the clients, munge) and its headers with libclang, for the
//!   SPANK plugin and its tests;
//! - tracefs mounted.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::host::{is_root, status};

const PACKAGES: &[&str] = &[
    "rustc-web",
    "rust-web-src",
    "llvm-22-dev",
    "libpolly-22-dev",
    "sshfs",
    "openssh-server",
    "openssh-client",
    "fuse3",
    "python3",
    // pip: the tests install JAX, the benchmarks numpy, scipy and pandas.
    "python3-pip",
    "passwd",
    // setfacl: the tests that check copies and snapshots keep POSIX ACLs.
    "acl",
    // Containers in the tests: jobs in bubblewrap see the network tree at other paths.
    "bubblewrap",
    // The metrics tests: promtool, and a real Prometheus server scraping the agent.
    "prometheus",
    // The SPANK plugin builds against Slurm's headers (bindgen: libclang); its tests
    // run a real one-node cluster.
    "libslurm-dev",
    "libclang-dev",
    "slurmctld",
    "slurmd",
    "slurm-client",
    "munge",
    // The many-node tests and `bench fanout`: namespaces joined by a bridge (ip), links
    // rate-limited (tc).
    "iproute2",
];
const BPF_LINKER_VERSION: &str = "0.13.0";
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
const TOOLCHAIN_DIR: &str = "/opt/bpf-toolchain";
const TRACEFS: &str = "/sys/kernel/tracing";

/// What this machine lacks, as readable step names.
fn missing() -> Vec<&'static str> {
    let mut out = Vec::new();
    if !missing_packages(PACKAGES).is_empty() {
        out.push("Debian packages");
    }
    if !bpf_linker_ok() {
        out.push("bpf-linker");
    }
    if !toolchain_ok() {
        out.push("the bpf toolchain");
    }
    if !Path::new(TRACEFS).join("events").is_dir() {
        out.push("tracefs");
    }
    out
}

/// Sets the machine up if anything is missing; quiet when all is there.
pub fn ensure() -> Result<()> {
    let missing = missing();
    if missing.is_empty() {
        return Ok(());
    }
    println!("setup: this machine lacks {}", missing.join(", "));
    run()
}

pub fn run() -> Result<()> {
    let packages = missing_packages(PACKAGES);
    if !packages.is_empty() {
        install(&packages)?;
    } else {
        println!("setup: Debian packages present");
    }

    if !bpf_linker_ok() {
        println!(
            "setup: building bpf-linker {BPF_LINKER_VERSION} against LLVM 22 (about a minute)"
        );
        status(
            Command::new("cargo")
                .args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION])
                .args(["--no-default-features", "--features", "llvm-22"])
                .env("LLVM_PREFIX", LLVM_PREFIX),
        )?;
    } else {
        println!("setup: bpf-linker {BPF_LINKER_VERSION} present");
    }

    if !toolchain_ok() {
        need_root(&format!("create {TOOLCHAIN_DIR}"))?;
        println!("setup: linking Debian's rustc as the rustup toolchain `bpf`");
        let bin = Path::new(TOOLCHAIN_DIR).join("bin");
        std::fs::create_dir_all(&bin)?;
        std::fs::create_dir_all(Path::new(TOOLCHAIN_DIR).join("lib"))?;
        let cargo = stable_cargo()?;
        relink("/usr/bin/rustc", &bin.join("rustc"))?;
        relink(&cargo, &bin.join("cargo"))?;
        status(Command::new("rustup").args(["toolchain", "link", "bpf", TOOLCHAIN_DIR]))?;
        if !toolchain_ok() {
            bail!("the bpf toolchain still does not work: `rustup run bpf rustc --version` fails");
        }
    } else {
        println!("setup: rustup toolchain `bpf` present");
    }

    if !Path::new(TRACEFS).join("events").is_dir() {
        need_root("mount tracefs")?;
        println!("setup: mounting tracefs at {TRACEFS}");
        status(Command::new("mount").args(["-t", "tracefs", "none", TRACEFS]))?;
    }
    println!("setup: done");
    Ok(())
}

/// Installs Debian packages (as root).
pub fn install(packages: &[&str]) -> Result<()> {
    need_root("install Debian packages")?;
    // A whole run's threads install side by side (the rig's tools while the build's
    // own are installed): apt takes one at a time, and a second fails on its lock.
    static APT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = APT.lock().unwrap_or_else(|e| e.into_inner());
    let packages: Vec<&str> = packages.iter().copied().filter(|p| !installed(p)).collect();
    if packages.is_empty() {
        return Ok(()); // the other thread installed them
    }
    println!("setup: installing {}", packages.join(" "));
    status(
        Command::new("apt-get")
            .args(["-o", "DPkg::Lock::Timeout=300", "update"])
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )?;
    status(
        Command::new("apt-get")
            .args([
                "-o",
                "DPkg::Lock::Timeout=300",
                "install",
                "-y",
                "--no-install-recommends",
            ])
            .args(packages)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

pub fn need_root(what: &str) -> Result<()> {
    if !is_root() {
        bail!("setup needs root to {what}: run `sudo -E cargo xtask setup`");
    }
    Ok(())
}

/// Those of `packages` this machine lacks.
pub fn missing_packages(packages: &[&'static str]) -> Vec<&'static str> {
    packages.iter().copied().filter(|p| !installed(p)).collect()
}

fn installed(package: &str) -> bool {
    let out = Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output();
    matches!(out, Ok(o) if String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

fn bpf_linker_ok() -> bool {
    let candidates = [
        PathBuf::from("bpf-linker"),
        home().join(".cargo/bin/bpf-linker"),
    ];
    candidates.iter().any(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(BPF_LINKER_VERSION))
    })
}

fn toolchain_ok() -> bool {
    Command::new("rustup")
        .args(["run", "bpf", "rustc", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
        && Path::new("/usr/lib/rustlib/src/rust/library/core").is_dir()
}

fn stable_cargo() -> Result<PathBuf> {
    let out = Command::new("rustup")
        .args(["which", "cargo", "--toolchain", "stable"])
        .output()
        .context("running rustup")?;
    if !out.status.success() {
        bail!("rustup has no stable toolchain to borrow cargo from");
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

fn relink(target: impl AsRef<Path>, link: &Path) -> Result<()> {
    let _ = std::fs::remove_file(link);
    std::os::unix::fs::symlink(target.as_ref(), link)
        .with_context(|| format!("linking {}", link.display()))
}

fn home() -> PathBuf {
    std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from)
}
