//! `hocus-agent prefetch --profile FILE`: warm the daemon's cache and pins from a profile,
//! with a progress bar on a terminal.

use std::{io::IsTerminal, path::Path};

use anyhow::{Result, bail};

use crate::{
    cli::Context,
    control::{
        client::{self, ClientError},
        protocol::{Request, Response},
    },
    profile::store::read_exported,
    shared::{size::human, status::Progress},
};

pub fn run(ctx: &Context, file: &Path) -> Result<()> {
    let profile = read_exported(file)?;
    let tty = std::io::stderr().is_terminal();
    let mut last: Option<Progress> = None;
    let mut refused = None;
    let result = client::call_streaming(&ctx.socket, &Request::Prefetch { profile }, |r| match r {
        Response::Progress(p) => {
            if tty {
                eprint!("\r{}", bar(&p));
            }
            last = Some(p);
        }
        Response::Error { message } => refused = Some(message),
        _ => {}
    });
    if tty && last.is_some() {
        eprintln!();
    }
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

fn bar(p: &Progress) -> String {
    const WIDTH: usize = 30;
    let (done_bytes, total_bytes) = (
        p.bytes_done + p.tree_bytes_done,
        p.bytes_total + p.tree_bytes_total,
    );
    let done = if total_bytes > 0 {
        (done_bytes as f64 / total_bytes as f64 * WIDTH as f64) as usize
    } else {
        WIDTH
    };
    format!(
        "[{}{}] {}/{} files, {}/{} trees, {} / {}",
        "#".repeat(done.min(WIDTH)),
        " ".repeat(WIDTH - done.min(WIDTH)),
        p.files_done,
        p.files_total,
        p.trees_done,
        p.trees_total,
        human(done_bytes),
        human(total_bytes)
    )
}
