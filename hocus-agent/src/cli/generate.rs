//! `hocus-agent generate`: the man pages and shell completions of this very command line,
//! for the package (`cargo xtask package` ships them).

use std::path::Path;

use anyhow::{Context, Result};
use clap_complete::Shell;

/// Writes `hocus-agent.1` and a page per subcommand (`hocus-agent-run.1` ...) into `dir`.
pub fn man(cmd: clap::Command, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    clap_mangen::generate_to(cmd, dir).with_context(|| format!("writing into {}", dir.display()))
}

/// Writes the completion script for `shell` into `dir`, and says its name.
pub fn completions(mut cmd: clap::Command, shell: Shell, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = clap_complete::generate_to(shell, &mut cmd, "hocus-agent", dir)
        .with_context(|| format!("writing into {}", dir.display()))?;
    println!("{}", path.display());
    Ok(())
}
