//! `bench ranges`' mapped case: a `numpy.memmap` of a big file (4 GiB) reading a random
//! subset of it, as a data loader over a memory-mapped array does. A mapping asks the
//! kernel for everything it maps at `mmap` (docs/partial-copies.md: no event per page
//! fault), so a mapped file gets a whole copy: this measures what that costs and gives.

use std::{
    fs::File,
    io::{BufWriter, Write},
    path::Path,
    time::Instant,
};

use anyhow::{Result, bail};

use super::common::{MIB, agent_on_disk_of, medians, network, offsets, python_job};

/// The case: `chunks` of 1 MiB of a file of `file_mib`, on a fixture of this round trip;
/// the job again `runs` times from the cache and from a local disk.
pub struct MapCase {
    pub file_mib: usize,
    pub chunks: usize,
    pub round_trip: std::time::Duration,
    pub runs: usize,
}

/// What the mapped file came to.
pub struct Mapped {
    pub file_mib: usize,
    /// What the cache held of it once copied, and the seconds it took to get there
    /// after the first job.
    pub held: u64,
    pub copied_after: f64,
    /// The job from the network, again from the cache, from a local disk (medians of
    /// the whole jobs' and of their reads' times).
    pub from_network: (f64, f64),
    pub from_copy: (f64, f64),
    pub from_disk: (f64, f64),
}

/// Writes `mib` MiB to `path`, each MiB a byte of its own.
fn write_big(path: &Path, mib: usize) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut out = BufWriter::new(File::create(path)?);
    for i in 0..mib {
        out.write_all(&vec![(i % 251) as u8; MIB])?;
    }
    out.into_inner()?.sync_all()?;
    Ok(())
}

/// A Python job mapping `path` with numpy and summing 1 MiB at each of `offsets`; it
/// prints how long its reads took and the sum (the same wherever the bytes came from).
fn job(packages: &Path, path: &Path, offsets: &[u64]) -> String {
    format!(
        "import sys, time\nsys.path.insert(0, '{}')\nimport numpy as np\nm = np.memmap('{}', dtype=np.uint8, mode='r')\nt = time.perf_counter()\ns = 0\nfor at in {offsets:?}:\n    s += int(m[at:at + {MIB}].sum(dtype=np.uint64))\nprint(time.perf_counter() - t, s)\n",
        packages.display(),
        path.display()
    )
}

/// Runs `job` under `hocus-agent run`, the page cache emptied first: the seconds the
/// whole job took, its reads', and the sum it printed.
fn run_job(agent: &hocus_tests::Agent, job: &str) -> Result<(f64, f64, u64)> {
    let (whole, printed) = python_job(agent, job)?;
    let mut words = printed.split_whitespace();
    let reads = words.next().unwrap_or_default().parse::<f64>()?;
    let sum = words.next().unwrap_or_default().parse::<u64>()?;
    Ok((whole, reads, sum))
}

/// The mapped case with a daemon of its own (partial copies on, from 32 MiB): the
/// first job from the network, the copy it leads to, then the job again from it against
/// the same job on a local disk, in turns.
pub fn mapped(r: &MapCase, packages: &Path) -> Result<Mapped> {
    let net = network(r.round_trip);
    let size = (r.file_mib * MIB) as u64;
    let at = offsets(r.chunks, size);
    let file = net.server_path("data/memmap.bin");
    write_big(&file, r.file_mib)?;
    let file = net.path("data/memmap.bin");
    // Room for the local disk's file and a whole copy, within half the free space.
    let disk_mib = (3 * r.file_mib + 2048) as u64;
    let (disk, agent) = agent_on_disk_of(&net, disk_mib, &["--partial-from", "32M"]);
    let local = disk.path.join("memmap.bin");
    write_big(&local, r.file_mib)?;

    let (whole, reads, want) = run_job(&agent, &job(packages, &file, &at))?;
    let first = Instant::now();
    // What the cache counts (the copy may sit in a snapshot of its directory by now).
    let within = 60 + r.file_mib as u64 / 10;
    let cached = || agent.cache()["cached_bytes"].as_u64().unwrap_or(0);
    super::common::wait_for(&agent, within, "the mapped file copied", || {
        cached() >= size
    })?;
    let copied_after = first.elapsed().as_secs_f64();
    agent.settled();
    let held = cached();
    let (mut copy_runs, mut disk_runs) = (Vec::new(), Vec::new());
    for _ in 0..r.runs {
        for (runs, path) in [(&mut copy_runs, &file), (&mut disk_runs, &local)] {
            let (whole, reads, sum) = run_job(&agent, &job(packages, path, &at))?;
            if sum != want {
                bail!("the job read other bytes from {}", path.display());
            }
            runs.push((whole, reads));
        }
    }
    Ok(Mapped {
        file_mib: r.file_mib,
        held,
        copied_after,
        from_network: (whole, reads),
        from_copy: medians(copy_runs),
        from_disk: medians(disk_runs),
    })
}
