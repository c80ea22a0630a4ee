//! Builds the eBPF programs (hocus-ebpf) for the bpf target and leaves the object in
//! OUT_DIR, where src/observe/tracer.rs embeds it.
//!
//! They are built with the `bpf` rustup toolchain (Debian's rustc with its matching core
//! source; `cargo xtask setup` creates it). `-Z build-std=core` needs RUSTC_BOOTSTRAP=1,
//! which aya-build passes on only when it sees it, so it is set here for that build alone.
//!
//! Every build of the agent (debug, release, its unit tests) embeds the same object
//! (aya-build always builds it `--release`): it is built once, in `target/ebpf`, under a
//! lock, and copied into each OUT_DIR. Built in each OUT_DIR, it cost a minute a build.
use std::{fs, os::fd::AsRawFd, path::PathBuf};

use anyhow::{Context, anyhow};

fn main() -> anyhow::Result<()> {
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?;
    let ebpf_dir = std::path::Path::new(&manifest_dir).join("../hocus-ebpf");
    let ebpf_dir = ebpf_dir.to_str().ok_or_else(|| anyhow!("non-UTF-8 path"))?;
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").context("OUT_DIR")?);
    // OUT_DIR is <target>/<profile>/build/hocus-agent-<hash>/out.
    let shared = out_dir
        .ancestors()
        .nth(4)
        .map_or_else(|| out_dir.clone(), |target| target.join("ebpf"));
    fs::create_dir_all(&shared)?;
    let lock = fs::File::create(shared.join(".lock"))?;
    // SAFETY: flock on a descriptor we own; released when it closes.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error()).context("locking target/ebpf");
    }
    // SAFETY: the build script is single-threaded at this point.
    unsafe {
        std::env::set_var("RUSTC_BOOTSTRAP", "1");
        std::env::set_var("OUT_DIR", &shared);
    }
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "hocus-ebpf",
            root_dir: ebpf_dir,
            ..Default::default()
        }],
        aya_build::Toolchain::Custom("bpf"),
    )
    .context("building the eBPF programs failed; `cargo xtask setup` installs what they need (the bpf toolchain and bpf-linker)")?;
    // SAFETY: as above.
    unsafe { std::env::set_var("OUT_DIR", &out_dir) };
    fs::copy(shared.join("hocus"), out_dir.join("hocus")).context("copying the eBPF object")?;
    drop(lock);
    Ok(())
}
