//! `hocus-agent budget --ssd SIZE --ram SIZE|PCT`: change the running daemon's budgets.

use anyhow::{Result, bail};
use hocus_control::{Request, Response};

use crate::{
    cli::context::{Context, ask},
    place::budget::mem_total,
    shared::size::{Size, human},
};

pub fn run(ctx: &Context, ssd: Option<Size>, ram: Option<Size>) -> Result<()> {
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
        .map(|r| mem_total().map(|total| r.of(total)))
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
