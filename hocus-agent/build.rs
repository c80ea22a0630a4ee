//! Builds the eBPF programs (hocus-ebpf) for the bpf target and leaves the object in
//! OUT_DIR, where src/observe/tracer.rs embeds it.
//!
//! They are built with the `bpf` rustup toolchain (Debian's rustc with its matching core
//! source; `cargo xtask setup` creates it). `-Z build-std=core` needs RUSTC_BOOTSTRAP=1,
//! which aya-build passes on only when it sees it, so it is set here for that build alone.
use anyhow::{Context, anyhow};

fn main() -> anyhow::Result<()> {
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?;
    let ebpf_dir = std::path::Path::new(&manifest_dir).join("../hocus-ebpf");
    let ebpf_dir = ebpf_dir.to_str().ok_or_else(|| anyhow!("non-UTF-8 path"))?;
    // SAFETY: the build script is single-threaded at this point.
    unsafe { std::env::set_var("RUSTC_BOOTSTRAP", "1") };
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "hocus-ebpf",
            root_dir: ebpf_dir,
            ..Default::default()
        }],
        aya_build::Toolchain::Custom("bpf"),
    )
    .context("building the eBPF programs failed; `cargo xtask setup` installs what they need (the bpf toolchain and bpf-linker)")
}
