//! `hocus-agent trace-floor` (hidden): the baseline of `cargo xtask bench overhead`.

use std::io::Write;

use anyhow::Result;

use crate::observe::tracer::Tracer;

/// Attaches the floor program and waits to be killed (the kernel detaches it when the
/// process's descriptors close).
pub fn run() -> Result<()> {
    let _floor = Tracer::floor()?;
    println!("ready");
    std::io::stdout().flush()?;
    loop {
        std::thread::park();
    }
}
