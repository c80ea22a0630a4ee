//! `hocus-agent prefetch --profile FILE`: warm the daemon's cache and pins from a profile,
//! with a progress bar on a terminal.

use std::path::Path;

use anyhow::{Result, bail};
use hocus_control::{
    status::Progress,
    {Request, Response},
};
use indicatif::{ProgressBar, ProgressStyle};

use crate::{
    cli::{context::Context, profile::tell_refused},
    control::client::{self, ClientError},
    profile::format::read_exported,
    shared::size::human,
};

pub fn run(ctx: &Context, file: &Path) -> Result<()> {
    // Read here first, for errors that say what is wrong; the daemon gets the descriptor.
    read_exported(file)?;
    let sent = std::fs::File::open(file)?;
    // indicatif draws on stderr only when it is a terminal.
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template(
            "{spinner} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta} {msg}",
        )
        .expect("a valid template")
        .progress_chars("#> "),
    );
    let mut first: Option<Progress> = None;
    let mut last: Option<Progress> = None;
    let mut refused = None;
    let result =
        client::call_streaming(&ctx.socket, &Request::Prefetch, Some(&sent), |r| match r {
            Response::Progress(p) => {
                bar.set_length(p.bytes_total + p.tree_bytes_total);
                bar.set_position(p.bytes_done + p.tree_bytes_done);
                bar.set_message(format!(
                    "{}/{} files, {}/{} trees",
                    p.files_done, p.files_total, p.trees_done, p.trees_total
                ));
                if first.is_none() {
                    first = Some(p.clone());
                }
                last = Some(p);
                Ok(())
            }
            Response::Error { message } => {
                refused = Some(message);
                Ok(())
            }
            _ => Ok(()),
        });
    bar.finish_and_clear();
    match result {
        Err(ClientError::NoDaemon(socket)) => bail!(
            "no hocus-agent daemon is running (nothing at {}): prefetching needs it, since it holds the copies and pins; start it with sudo hocus-agent --watch PATH",
            socket.display()
        ),
        Err(ClientError::Other(e)) => return Err(e),
        Ok(()) => {}
    }
    if let Some(message) = refused {
        bail!("the daemon refused: {message}");
    }
    if let Some(first) = &first {
        tell_refused(&first.refused, first.refused_total);
    }
    let Some(p) = last.filter(|p| p.finished) else {
        bail!("the daemon stopped before the prefetch finished");
    };
    let files = |n: usize| {
        if n == 1 {
            "1 file".to_owned()
        } else {
            format!("{n} files")
        }
    };
    let trees = match p.trees_done - p.trees_failed {
        0 => String::new(),
        1 => format!(", and 1 tree as a snapshot ({})", human(p.tree_bytes_done)),
        n => format!(
            ", and {n} trees as snapshots ({})",
            human(p.tree_bytes_done)
        ),
    };
    println!(
        "prefetched {} ({}) into the SSD cache{}{trees}; {} ({}) pinned in RAM",
        files(p.files_done - p.failed),
        human(p.bytes_done),
        if p.failed > 0 {
            format!(", {} not cached (the daemon's log says why)", p.failed)
        } else {
            String::new()
        },
        files(p.pinned_files),
        human(p.pinned_bytes)
    );
    Ok(())
}
