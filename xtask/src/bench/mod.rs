//! `cargo xtask bench ...`: benchmarks that print ratios against baselines measured in
//! the same run, and write their figures as JSON beside their table. One file each;
//! what they share is `common`.

mod common;
mod dataset;
mod events;
mod fanout;
mod imports;
mod memmap;
mod overhead;
mod programs;
mod ranges;
mod scale;
mod server;
mod slurm;

pub use dataset::{Dataset, dataset};
pub use events::{Events, events};
pub use fanout::{Fanout, fanout};
pub use imports::{ImportCase, imports};
pub use overhead::{Overhead, overhead, syscall_loop_process};
pub use ranges::{Ranges, ranges};
pub use scale::{Scale, scale};
pub use server::{Server, server};
pub use slurm::slurm_imports;

/// Installs the Python packages the smoke runs import (numpy, scipy and pandas; JAX)
/// ahead of them: a whole run does it while the guests' part builds, not at its end.
pub fn smoke_packages() -> anyhow::Result<()> {
    common::numpy_packages()?;
    hocus_tests::jax_packages();
    Ok(())
}
