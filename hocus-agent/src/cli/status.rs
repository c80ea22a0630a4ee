//! `hocus-agent status`: what the daemon watches, holds and serves.

use anyhow::{Result, bail};
use hocus_control::{Request, Response};

use crate::{
    cli::context::{Context, ask},
    report::show,
};

pub fn run(ctx: &Context, json: bool) -> Result<()> {
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
