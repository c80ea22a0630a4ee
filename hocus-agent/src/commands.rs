//! The client commands: ask the running daemon, or read the state directory when none runs.

use std::{
    io::{IsTerminal, Write},
    path::{Path, PathBuf},
};

use anyhow::{Result, bail};

use crate::{
    budget::{Size, human},
    control::{self, ClientError, Request, Response},
    keeper::Progress,
    profile::{Profile, WorkingSet},
    show,
    store::{self, ReadError, StateDir},
};

pub struct Context {
    pub socket: PathBuf,
    pub state_dir: PathBuf,
}

fn ask(ctx: &Context, request: &Request) -> Result<Option<Response>> {
    match control::call(&ctx.socket, request) {
        Ok(Response::Error { message }) => bail!("the daemon refused: {message}"),
        Ok(r) => Ok(Some(r)),
        Err(ClientError::NoDaemon(_)) => Ok(None),
        Err(ClientError::Other(e)) => Err(e),
    }
}

/// The profile, from the daemon or else from the state directory (root only).
fn current_profile(ctx: &Context, root: Option<PathBuf>) -> Result<Profile> {
    let request = Request::Export { root: root.clone() };
    if let Some(response) = ask(ctx, &request)? {
        let Response::Profile(p) = response else {
            bail!("unexpected answer from the daemon");
        };
        return Ok(p);
    }
    let path = store::profile_path(&ctx.state_dir);
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "no hocus-agent daemon is running (nothing at {}), and only root may read {} directly: start the daemon (sudo hocus-agent --watch PATH) or run this with sudo",
            ctx.socket.display(),
            path.display()
        );
    }
    let mut profile = match store::read_profile(&path, "repair or delete it") {
        Ok(p) => p,
        Err(ReadError::Missing) => bail!(
            "no daemon is running and there is no profile at {} yet: start one with sudo hocus-agent --watch PATH",
            path.display()
        ),
        Err(e) => return Err(e.into()),
    };
    if let Some(root) = root {
        profile.retain_under(&root);
    }
    Ok(profile)
}

pub fn export(ctx: &Context, root: Option<PathBuf>, out: Option<PathBuf>) -> Result<()> {
    let profile = current_profile(ctx, root)?;
    let bytes = profile.to_json();
    match out {
        Some(path) => {
            store::write_atomically(&path, &bytes)
                .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
            eprintln!(
                "exported {} files and {} missing names to {}",
                profile.files.len(),
                profile.missing.len(),
                path.display()
            );
        }
        None => std::io::stdout().lock().write_all(&bytes)?,
    }
    Ok(())
}

pub fn show(ctx: &Context, root: Option<PathBuf>, file: Option<PathBuf>, top: usize) -> Result<()> {
    let profile = match file {
        Some(path) => {
            let mut p = read_exported(&path)?;
            if let Some(root) = root {
                p.retain_under(&root);
            }
            p
        }
        None => current_profile(ctx, root)?,
    };
    print!("{}", show::render(&profile, top));
    Ok(())
}

pub fn read_exported(path: &Path) -> Result<Profile> {
    match store::read_profile(path, "export it again with `hocus-agent profile export`") {
        Ok(p) => Ok(p),
        Err(ReadError::Missing) => bail!("{} does not exist", path.display()),
        Err(ReadError::Io(e)) => bail!("cannot read {}: {e}", path.display()),
        Err(ReadError::Format(e)) => Err(e.into()),
    }
}

pub fn import(ctx: &Context, file: &Path) -> Result<()> {
    let profile = read_exported(file)?;
    let request = Request::Import { profile };
    if let Some(response) = ask(ctx, &request)? {
        let Response::Imported { files, missing } = response else {
            bail!("unexpected answer from the daemon");
        };
        eprintln!("merged {files} files and {missing} missing names into the daemon's profile");
        return Ok(());
    }
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "no hocus-agent daemon is running (nothing at {}); start it, or import as root to merge into {} directly",
            ctx.socket.display(),
            ctx.state_dir.display()
        );
    }
    let Request::Import { profile } = request else {
        unreachable!()
    };
    let state = StateDir::lock(&ctx.state_dir)?;
    let mut ws = match state.load_or_set_aside() {
        Ok(Some(p)) => WorkingSet::from_profile(p),
        Ok(None) => WorkingSet::new(profile.started_unix_ns),
        Err(message) => bail!("{message}"),
    };
    let (files, missing) = (profile.files.len(), profile.missing.len());
    ws.merge(profile);
    state.save(&ws.to_profile())?;
    eprintln!(
        "merged {files} files and {missing} missing names into {}",
        state.profile_path().display()
    );
    Ok(())
}

pub fn status(ctx: &Context, json: bool) -> Result<()> {
    let Some(response) = ask(ctx, &Request::Status)? else {
        bail!(
            "no hocus-agent daemon is running (nothing at {}): start it with sudo hocus-agent --watch PATH",
            ctx.socket.display()
        );
    };
    let Response::Status(status) = response else {
        bail!("unexpected answer from the daemon");
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", show::render_status(&status));
    }
    Ok(())
}

pub fn prefetch(ctx: &Context, file: &Path) -> Result<()> {
    let profile = read_exported(file)?;
    let tty = std::io::stderr().is_terminal();
    let mut last: Option<Progress> = None;
    let mut refused = None;
    let result =
        control::call_streaming(&ctx.socket, &Request::Prefetch { profile }, |r| match r {
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

pub fn budget(ctx: &Context, ssd: Option<Size>, ram: Option<Size>) -> Result<()> {
    if ssd.is_none() && ram.is_none() {
        bail!("name a budget to change: --ssd SIZE and/or --ram SIZE|PCT");
    }
    let ssd = match ssd {
        // A percentage of the SSD budget is of the cache filesystem's size; the daemon
        // knows that filesystem, so it is asked for plain bytes only.
        Some(Size::Percent(_)) => bail!("give the SSD budget in bytes (e.g. 20G)"),
        Some(s) => Some(s.of(0)),
        None => None,
    };
    let ram = ram
        .map(|r| crate::budget::mem_total().map(|total| r.of(total)))
        .transpose()?;
    let Some(response) = ask(ctx, &Request::Budgets { ssd, ram })? else {
        bail!(
            "no hocus-agent daemon is running (nothing at {})",
            ctx.socket.display()
        );
    };
    let Response::Status(status) = response else {
        bail!("unexpected answer from the daemon");
    };
    if let Some(c) = status.cache {
        println!(
            "budgets: SSD {} ({} held), RAM {} ({} pinned)",
            human(c.ssd_budget),
            human(c.cached_bytes),
            human(c.ram_budget),
            human(c.pinned_bytes)
        );
    }
    Ok(())
}
