//! What every command knows: where the daemon listens and where it keeps its state when
//! none runs; and asking it.

use std::path::PathBuf;

use anyhow::{Result, bail};
use hocus_control::{Request, Response};

use crate::control::client::{self, ClientError};

/// Where the daemon listens, and where it keeps its state when none runs.
pub struct Context {
    pub socket: PathBuf,
    pub state_dir: PathBuf,
}

/// Asks the daemon; `None` when none runs.
pub fn ask(ctx: &Context, request: &Request) -> Result<Option<Response>> {
    ask_with(ctx, request, None)
}

/// Asks the daemon, sending `file`'s descriptor along; `None` when none runs.
pub fn ask_with(
    ctx: &Context,
    request: &Request,
    file: Option<&std::fs::File>,
) -> Result<Option<Response>> {
    match client::call_with(&ctx.socket, request, file) {
        Ok(Response::Error { message }) => bail!("the daemon refused: {message}"),
        Ok(r) => Ok(Some(r)),
        Err(ClientError::NoDaemon(_)) => Ok(None),
        Err(ClientError::Other(e)) => Err(e),
    }
}
