//! The agent and its Slurm plugin, built (the machine set up first if it lacks
//! anything): what every command that runs hocus starts from.

use std::path::PathBuf;

use anyhow::Result;

use crate::{
    host::{cargo, status, target_dir},
    setup,
};

/// Builds hocus-agent, setting the machine up first if it lacks anything.
pub fn build(release: bool) -> Result<PathBuf> {
    setup::ensure()?;
    let mut cmd = cargo();
    // The agent and its Slurm plugin.
    cmd.args([
        "build",
        "--package",
        "hocus-agent",
        "--package",
        "hocus-spank",
    ]);
    if release {
        cmd.arg("--release");
    }
    status(&mut cmd)?;
    Ok(target_dir()
        .join(if release { "release" } else { "debug" })
        .join("hocus-agent"))
}
