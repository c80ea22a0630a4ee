//! `hocus-agent run [--profile FILE] -- CMD`: run a command on the local copies.

use std::{path::Path, process::ExitCode};

use anyhow::Result;

use crate::{
    cli::{context::Context, prefetch},
    control::client,
};

/// Prefetches from `profile` first, if given; returns the job's exit status.
pub fn run(ctx: &Context, profile: Option<&Path>, command: Vec<String>) -> Result<ExitCode> {
    if let Some(p) = profile {
        prefetch::run(ctx, p)?;
    }
    client::run(&ctx.socket, command)
}
