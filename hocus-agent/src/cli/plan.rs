//! `hocus-agent plan --profile FILE`: the placement the daemon would choose, and the time
//! it would save, measured on this machine. Copies nothing.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::{
    cache::partial::pre_content::probe,
    place::{
        budget::{self, Budgets},
        placement::Filters,
        plan,
    },
    profile::format::read_exported,
    shared::{settings::Settings, size::Size},
};

/// What `plan` may try instead of the daemon's settings.
#[derive(clap::Args, Debug)]
pub struct PlanCache {
    /// The cache directory whose filesystem sets the default SSD budget.
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// The SSD budget to plan for (e.g. 50G).
    #[arg(long, value_name = "SIZE")]
    ssd_budget: Option<Size>,
    /// The RAM budget to plan for (e.g. 4G or 10%).
    #[arg(long, value_name = "SIZE|PCT")]
    ram_budget: Option<Size>,
    /// Only files with these endings (e.g. .py,.pyc,.so).
    #[arg(long, value_name = "LIST")]
    include_ext: Option<String>,
    /// Never files under this path (repeatable).
    #[arg(long, value_name = "PATH")]
    exclude: Option<Vec<PathBuf>>,
}

impl PlanCache {
    /// The daemon's settings with these in place.
    fn over(self, daemon: Settings) -> Settings {
        Settings {
            cache_dir: self.cache_dir,
            ssd_budget: self.ssd_budget,
            ram_budget: self.ram_budget,
            include_ext: self.include_ext,
            exclude: self.exclude,
            ..Default::default()
        }
        .or(daemon)
    }
}

pub fn run(profile: &Path, csv: bool, cache: PlanCache, daemon: Settings) -> Result<()> {
    let settings = cache.over(daemon);
    let profile = read_exported(profile)?;
    let cache_dir = settings.cache_dir();
    plan::run(
        &profile,
        &cache_dir,
        Budgets::of(&settings)?,
        &Filters::of(&settings),
        partial_from(&settings, &cache_dir),
        csv,
    )
}

/// From what size the daemon would copy files read in part in part: `partial-from`,
/// where the cache's filesystem has pre-content events (asked of the kernel: root
/// only); else 0, said once.
fn partial_from(settings: &Settings, cache_dir: &Path) -> u64 {
    let from = settings.partial_from.map_or(0, |s| s.of(0));
    if from == 0 {
        return 0;
    }
    match probe(budget::nearest_existing(cache_dir)) {
        Ok(()) => from,
        Err(e) => {
            eprintln!(
                "plan: every copy whole: partial copies need pre-content events on the cache's filesystem ({e}; run plan as root to ask the kernel)"
            );
            0
        }
    }
}
