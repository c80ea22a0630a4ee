//! Slurm loads a plugin only if it was built for its own version: the plugin's
//! `plugin_version` is the installed Slurm's `SLURM_VERSION_NUMBER`, read from its
//! headers (libslurm-dev), as `SPANK_PLUGIN!` wants a literal.

use std::{env, fs, path::PathBuf};

fn main() {
    let dir = env::var("SLURM_INCLUDE_DIR").unwrap_or_else(|_| "/usr/include/slurm".into());
    let header = PathBuf::from(&dir).join("slurm_version.h");
    println!("cargo:rerun-if-changed={}", header.display());
    println!("cargo:rerun-if-env-changed=SLURM_INCLUDE_DIR");
    let text = fs::read_to_string(&header).unwrap_or_else(|e| {
        panic!(
            "reading {}: {e} (install libslurm-dev, or set SLURM_INCLUDE_DIR; cargo xtask setup does)",
            header.display()
        )
    });
    let version = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("#define SLURM_VERSION_NUMBER"))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no SLURM_VERSION_NUMBER in {}", header.display()));
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("plugin.rs");
    fs::write(
        out,
        format!("slurm_spank::SPANK_PLUGIN!(b\"hocus\", {version}, Hocus);\n"),
    )
    .unwrap();
}
