//! `hocus-agent profile export|show|import`: the working-set profile, from the daemon or,
//! as root without one, from the state directory.

use std::{
    io::Write,
    path::{Path, PathBuf},
};

use anyhow::{Result, bail};
use hocus_control::{
    status::{REFUSED_SHOWN, Refused},
    {Request, Response},
};

use crate::{
    cli::context::{Context, ask_with},
    control::client::{self, ClientError},
    profile::{
        format::{self, Profile, ProfileWriter, read_exported},
        staging::Staging,
        store::{self, StateDir, StateError},
        working_set::WorkingSet,
    },
    report::show,
    shared::replace,
};

/// Entries handed over per part when the state directory is read directly.
const PART: usize = 16_384;

/// The profile, from the daemon or else from the state directory (root only), a part at
/// a time in file order (the first part carries the start): never held whole.
fn each_part(
    ctx: &Context,
    root: Option<PathBuf>,
    sink: &mut dyn FnMut(Profile) -> Result<()>,
) -> Result<()> {
    let request = Request::Export { root: root.clone() };
    let mut complete = false;
    let asked = client::call_streaming(&ctx.socket, &request, None, |response| match response {
        Response::Profile(part) => sink(part),
        Response::Exported { .. } => {
            complete = true;
            Ok(())
        }
        Response::Error { message } => bail!("the daemon refused: {message}"),
        _ => bail!("unexpected answer from the daemon"),
    });
    match asked {
        Ok(()) if complete => return Ok(()),
        Ok(()) => bail!(
            "the daemon closed the connection before the whole profile was sent (was it stopped?); nothing was written: try again"
        ),
        Err(ClientError::Other(e)) => return Err(e),
        Err(ClientError::NoDaemon(_)) => {}
    }
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "no hocus-agent daemon is running (nothing at {}), and only root may read {} directly: start the daemon (sudo hocus-agent --watch PATH) or run this with sudo",
            ctx.socket.display(),
            ctx.state_dir.display()
        );
    }
    let ws = match store::read_state(&ctx.state_dir) {
        Ok(Some(saved)) => saved.ws,
        Ok(None) => bail!(
            "no daemon is running and there is no profile in {} yet: start one with sudo hocus-agent --watch PATH",
            ctx.state_dir.display()
        ),
        Err(StateError::Io(e)) => bail!("cannot read {}: {e}", ctx.state_dir.display()),
        Err(StateError::Bad { message, .. }) => {
            bail!("{message}: start the daemon, which sets it aside and starts anew")
        }
    };
    let mut order = ws.export_order(root.as_deref());
    while let Some(part) = ws.export_part(&mut order, PART) {
        sink(part)?;
    }
    Ok(())
}

/// Writes the profile as it arrives: to `out` (replaced whole, only once all of it came),
/// or to standard output.
pub fn export(ctx: &Context, root: Option<PathBuf>, out: Option<PathBuf>) -> Result<()> {
    let write = |to: &mut dyn Write| -> Result<[usize; 3]> {
        let mut w = ProfileWriter::new(to);
        each_part(ctx, root.clone(), &mut |part| Ok(w.part(&part)?))?;
        let written = w.written;
        w.finish()?;
        Ok(written)
    };
    match out {
        Some(path) => {
            let [files, missing, _] = replace::replace_with(&path, |w| write(w))
                .map_err(|e| e.context(format!("writing {}", path.display())))?;
            eprintln!(
                "exported {files} files and {missing} missing names to {}",
                path.display()
            );
        }
        None => {
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::with_capacity(1 << 20, stdout.lock());
            write(&mut out)?;
        }
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
        None => {
            let mut whole = Profile::default();
            each_part(ctx, root, &mut |part| {
                whole.started_unix_ns = part.started_unix_ns;
                whole.files.extend(part.files);
                whole.missing.extend(part.missing);
                whole.dirs.extend(part.dirs);
                Ok(())
            })?;
            whole
        }
    };
    print!("{}", show::render(&profile, top));
    Ok(())
}

pub fn import(ctx: &Context, file: &Path) -> Result<()> {
    // The daemon gets the descriptor and reads the file itself (it trusts no client).
    // Only when it cannot be opened or the daemon refuses it is it read here too, for an
    // error that names the file and says what is wrong: a site-wide profile is not
    // parsed twice on the way in.
    let check_here = |refusal: anyhow::Error| -> anyhow::Error {
        match format::stream_exported(file, &mut |_| Ok(())) {
            Err(e) => e,
            Ok(_) => refusal,
        }
    };
    let sent = std::fs::File::open(file).map_err(|e| check_here(e.into()))?;
    let answer = ask_with(ctx, &Request::Import, Some(&sent)).map_err(check_here)?;
    if let Some(response) = answer {
        let Response::Imported {
            files,
            missing,
            refused,
            refused_total,
        } = response
        else {
            bail!("unexpected answer from the daemon");
        };
        eprintln!("merged {files} files and {missing} missing names into the daemon's profile");
        tell_refused(&refused, refused_total);
        return Ok(());
    }
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "no hocus-agent daemon is running (nothing at {}); start it, or import as root to merge into {} directly",
            ctx.socket.display(),
            ctx.state_dir.display()
        );
    }
    let mut state = StateDir::lock(&ctx.state_dir)?;
    let mut ws = WorkingSet::new(0);
    if let Err(message) = state.load(&mut ws) {
        bail!("{message}");
    }
    // Root's own import, but still only sound paths.
    let mut staged = Staging::new(&[PathBuf::from("/")]);
    let started = format::stream_exported(file, &mut |batch| staged.take(batch, |_| Ok(())))?;
    tell_refused(&staged.refused, staged.refused_total);
    // Into an empty state, the profile comes whole, its start with it.
    staged.headed(format::Head {
        started_unix_ns: started,
        holder: None,
    });
    let (files, missing) = (staged.files, staged.missing);
    ws.merge_state(staged.set);
    state.save(&mut ws)?;
    eprintln!(
        "merged {files} files and {missing} missing names into {}",
        state.profile_path().display()
    );
    Ok(())
}

/// Names the entries the daemon refused, and how many there were.
pub fn tell_refused(refused: &[Refused], total: usize) {
    if total == 0 {
        return;
    }
    eprintln!("refused {total} entries (each named once below, at most {REFUSED_SHOWN}):");
    for r in refused {
        eprintln!("  {}: {}", r.path, r.why);
    }
}
