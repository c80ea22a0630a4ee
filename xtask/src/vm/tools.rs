//! What the rig needs on this machine, installed the first time it runs: QEMU, kmod
//! (`depmod` for the unpacked kernels, `modprobe` in the guest), the kernel NFS server
//! and client tools the guest runs (it uses this machine's root filesystem), busybox
//! (the guests' initramfs), virtme-ng from PyPI in a virtualenv of its own, and
//! virtiofsd from crates.io beside it.

use std::{
    ffi::OsString,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Result, bail};

use crate::{
    host::status,
    setup::{install, missing_packages, need_root},
    vm::kernels::Series,
};

const PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "kmod",
    // The guests' NFS servers and clients (nfsd, rpcbind, mountd, mount.nfs).
    "nfs-kernel-server",
    "nfs-common",
    "rpcbind",
    "python3-venv",
    // virtme-ng builds each guest's initramfs around it; a fresh machine lacks it.
    "busybox-static",
    // To build virtiofsd.
    "libseccomp-dev",
    "libcap-ng-dev",
];
/// virtme-ng's version: the one the rig was written against.
const VIRTME_NG: &str = "virtme-ng==1.42";
const VENV: &str = "/opt/virtme-ng";
/// virtiofsd, the Rust one (QEMU's C one in /usr/lib/qemu takes other options), which
/// virtme-ng shares this machine's root with the guests through when it finds it
/// (virtio-fs: the guest keeps what it read in its page cache) rather than 9p without a
/// cache (every exec and import read again through the emulated device). In a 6.1
/// guest the nfs and identity suites took 239 s against 338 s (2026-12-02). Debian 12
/// has no package of it (Debian 13's needs glibc 2.39): it is built, about 3 min of a
/// core, while the kernels are fetched.
const VIRTIOFSD: &str = "virtiofsd@1.14.0";

/// Installs what is missing; quiet when all is there.
pub fn ensure() -> Result<()> {
    let packages = missing_packages(PACKAGES);
    if !packages.is_empty() {
        install(&packages)?;
    }
    if !vng_path().is_file() {
        need_root(&format!("install virtme-ng into {VENV}"))?;
        println!("vm: installing {VIRTME_NG} into {VENV}");
        status(Command::new("/usr/bin/python3").args(["-m", "venv", VENV]))?;
        status(Command::new(Path::new(VENV).join("bin/pip")).args(["install", "-q", VIRTME_NG]))?;
    }
    if !Path::new(VENV).join("bin/virtiofsd").is_file() {
        need_root(&format!("build virtiofsd into {VENV}"))?;
        println!("vm: building {VIRTIOFSD} into {VENV}/bin (crates.io; Debian 12 has none)");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        status(
            Command::new(cargo).args(["install", "--quiet", "--locked", VIRTIOFSD, "--root", VENV]),
        )?;
    }
    Ok(())
}

fn vng_path() -> PathBuf {
    Path::new(VENV).join("bin/vng")
}

pub fn vng() -> Result<PathBuf> {
    let vng = vng_path();
    if !vng.is_file() {
        bail!("{} is missing: cargo xtask vm installs it", vng.display());
    }
    Ok(vng)
}

/// PATH with virtme-ng's own commands first (vng runs `virtme-run`).
pub fn path_with_vng() -> OsString {
    let mut dirs = vec![Path::new(VENV).join("bin")];
    dirs.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    std::env::join_paths(dirs).unwrap_or_default()
}

/// Whether guests are emulated (TCG): unless HOCUS_VM_KVM=1.
pub fn emulated() -> bool {
    std::env::var_os("HOCUS_VM_KVM").is_none_or(|v| v != "1")
}

/// Software emulation (TCG) unless asked for KVM with HOCUS_VM_KVM=1: on the machines
/// this was written on, /dev/kvm exists without the CPU's virtualization flags and a
/// KVM guest hangs at boot (docs/toolchain.md). Emulated, a kernel series may ask for one
/// emulation thread for all its CPUs (`Series::one_emulation_thread`).
pub fn accel(series: Series) -> Vec<&'static str> {
    if !emulated() {
        Vec::new()
    } else if series.one_emulation_thread {
        vec!["--disable-kvm", "--qemu-opts=-accel tcg,thread=single"]
    } else {
        vec!["--disable-kvm"]
    }
}
