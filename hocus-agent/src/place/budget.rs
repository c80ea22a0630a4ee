//! Budgets: the defaults the machine suggests (the cache filesystem's free space, the
//! RAM), turned into bytes from the settings.

use std::{fs, path::Path};

use anyhow::{Context, Result};

use crate::shared::{settings::Settings, size::Size};

/// What may be held: bytes of copies on SSD, and of pins in RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budgets {
    pub ssd: u64,
    pub ram: u64,
}

impl Budgets {
    /// The settings' budgets in bytes: the SSD's from the cache filesystem, the RAM's
    /// from MemTotal.
    pub fn of(settings: &Settings) -> Result<Budgets> {
        let cache_dir = settings.cache_dir();
        let (free, total) = fs_space(nearest_existing(&cache_dir))?;
        let ssd = match settings.ssd_budget {
            Some(size) => size.of(total),
            None => default_ssd_budget(free, total),
        };
        let ram = settings.ram_budget.unwrap_or(Size::Percent(10.0));
        Ok(Budgets {
            ssd,
            ram: ram.of(mem_total()?),
        })
    }
}

/// `path`, or its nearest ancestor that exists (a cache directory not made yet is on
/// its filesystem).
pub fn nearest_existing(path: &Path) -> &Path {
    let mut at = path;
    while !at.exists() {
        at = at.parent().unwrap_or(Path::new("/"));
    }
    at
}

/// MemTotal from /proc/meminfo.
pub fn mem_total() -> Result<u64> {
    let text = fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("no MemTotal in /proc/meminfo")?;
    Ok(kib * 1024)
}

/// Free and total bytes of the filesystem holding `path`.
pub fn fs_space(path: &Path) -> Result<(u64, u64)> {
    let s =
        nix::sys::statvfs::statvfs(path).with_context(|| format!("statvfs {}", path.display()))?;
    let frsize = s.fragment_size() as u64;
    Ok((
        s.blocks_available() as u64 * frsize,
        s.blocks() as u64 * frsize,
    ))
}

/// The SSD budget when none is given: half of the free space, leaving at least a reserve
/// of 5% of the filesystem (or 1 GiB, whichever is smaller) free for everybody else.
pub fn default_ssd_budget(free: u64, total: u64) -> u64 {
    let reserve = (total / 20).min(1 << 30);
    (free / 2).min(free.saturating_sub(reserve))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_ssd_budget_leaves_a_reserve() {
        let g = 1u64 << 30;
        assert_eq!(default_ssd_budget(100 * g, 200 * g), 50 * g);
        // nearly full: the reserve wins over half the free space
        assert_eq!(default_ssd_budget(g, 200 * g), 0);
        assert_eq!(default_ssd_budget(3 * g, 10 * g), 3 * g / 2);
    }
}
