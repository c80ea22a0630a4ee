//! `cargo xtask bench dataset`: epochs over a dataset on a real network mount with a realistic round
//! trip, twice the RAM budget, the page cache emptied before every epoch, as on a
//! misbehaving node. Each epoch is read twice, interleaved: plainly, and by the same
//! command under `hocus-agent run` (what a user's job gets). The ratio is what matters,
//! not the seconds.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Result, bail};
use hocus_tests::Agent;

use super::common::{MIB, drop_caches, network, timed, write_figures};
use crate::host;

pub struct Dataset {
    pub files: usize,
    pub file_mib: usize,
    pub epochs: usize,
    pub round_trip: Duration,
}

impl Dataset {
    /// A smoke run (CI): small files, two epochs.
    pub fn quick() -> Self {
        Self {
            files: 8,
            file_mib: 1,
            epochs: 2,
            round_trip: Duration::from_millis(1),
        }
    }
}

fn order(n: usize, epoch: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut x = 0x9e3779b97f4a7c15u64 ^ epoch as u64;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

pub fn dataset(agent_bin: &Path, d: &Dataset) -> Result<()> {
    if !host::is_root() {
        bail!("the benchmark mounts filesystems and loads eBPF programs: run it as root");
    }
    // SAFETY: single-threaded at this point.
    unsafe { std::env::set_var("HOCUS_AGENT_BIN", agent_bin) };
    let net = network(d.round_trip);
    let total_mib = d.files * d.file_mib;
    let ram_mib = (total_mib / 2).max(1);
    println!(
        "dataset: {} files of {} MiB ({} MiB) on sshfs with a {:.1} ms round trip; RAM budget {} MiB; \
         page cache emptied before every read; each epoch read plainly, then by the same `cat` under `hocus-agent run`",
        d.files,
        d.file_mib,
        total_mib,
        d.round_trip.as_secs_f64() * 1000.0,
        ram_mib
    );
    let files: Vec<PathBuf> = (0..d.files)
        .map(|i| {
            let mut content = vec![(i % 251) as u8; d.file_mib * MIB];
            content[..8].copy_from_slice(&(i as u64).to_le_bytes());
            net.put(&format!("dataset/shard-{i:04}.bin"), &content)
        })
        .collect();
    let agent = Agent::start(&[
        "--watch",
        net.mount.to_str().unwrap(),
        "--ram-budget",
        &format!("{ram_mib}M"),
    ]);
    println!(
        "\n{:>5} {:>10} {:>10} {:>8} {:>12} {:>12}",
        "EPOCH", "PLAIN", "HOCUS", "SPEEDUP", "HELD IN RAM", "HELD ON SSD"
    );
    let (mut ratios, mut epochs) = (Vec::new(), Vec::new());
    for epoch in 0..d.epochs {
        let names: Vec<&PathBuf> = order(files.len(), epoch)
            .into_iter()
            .map(|i| &files[i])
            .collect();
        drop_caches()?;
        let plain = timed(Command::new("cat").args(&names))?;
        if epoch == 1 {
            agent.settled(); // the first epoch taught hocus the working set
        }
        // What hocus holds as the epoch starts, as a share of the dataset.
        let c = agent.cache();
        let share =
            |key: &str| c[key].as_u64().unwrap_or(0) as f64 / (total_mib * MIB) as f64 * 100.0;
        let (ram, ssd) = (
            share("pinned_bytes"),
            share("cached_bytes") + share("snapshot_bytes"),
        );
        drop_caches()?;
        let hocus = timed(agent.cli(&["run", "--", "cat"]).args(&names))?;
        let ratio = plain / hocus;
        if epoch > 0 {
            ratios.push(ratio);
        }
        println!(
            "{:>5} {plain:>9.3}s {hocus:>9.3}s {ratio:>7.2}x {ram:>11.0}% {ssd:>11.0}%",
            epoch + 1
        );
        epochs.push(serde_json::json!({
            "plain_seconds": plain,
            "hocus_seconds": hocus,
            "speedup": ratio,
            "held_in_ram_percent": ram,
            "held_on_ssd_percent": ssd,
        }));
    }
    let mean = ratios.iter().sum::<f64>() / ratios.len().max(1) as f64;
    println!(
        "\nspeed-up from epoch 2 on: {mean:.2}x (plain time / time under hocus-agent run, same machine, same run)"
    );
    write_figures(
        "dataset",
        &serde_json::json!({
            "files": d.files,
            "file_mib": d.file_mib,
            "round_trip_ms": d.round_trip.as_secs_f64() * 1000.0,
            "ram_budget_mib": ram_mib,
            "epochs": epochs,
            "speedup_from_epoch_2": mean,
        }),
    )
}
