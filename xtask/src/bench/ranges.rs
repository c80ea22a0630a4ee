//! `cargo xtask bench ranges`: a job reading scattered 1 MiB chunks of a big file (a
//! shuffled epoch over an HDF5 or Arrow file) on a network mount with a realistic round
//! trip. What it read, what the profile says it read (its byte ranges), and what the
//! cache holds after it (a partial copy where the kernel has pre-content events, else
//! a whole one: docs/partial-copies.md); then the same job again, served by that copy,
//! against the same reads from a local disk, all in the same run.

use std::{path::Path, time::Duration};

use anyhow::{Result, bail};
use hocus_tests::file_entry;

use super::common::{
    MIB, agent_on_local_disk, medians, network, offsets, python_job, write_figures,
};
use super::memmap::MapCase;
use crate::host;

pub struct Ranges {
    pub file_mib: usize,
    /// The size of the file a `numpy.memmap` job reads the same chunks of.
    pub memmap_mib: usize,
    pub chunks: usize,
    pub round_trip: Duration,
    /// Runs of the job again from the cache, and from a local disk.
    pub runs: usize,
}

impl Ranges {
    /// A smoke run (CI): 8 chunks of a 64 MiB file (and of a 64 MiB mapped one).
    pub fn quick() -> Self {
        Self {
            file_mib: 64,
            memmap_mib: 64,
            chunks: 8,
            round_trip: Duration::from_millis(1),
            runs: 1,
        }
    }
}

/// A Python job reading 1 MiB at each of `offsets` of `path`; it prints how long its
/// reads took (the rest of the job is starting it: namespaces, the job-start check).
fn job(path: &Path, offsets: &[u64]) -> String {
    format!(
        "import os, time\nfd = os.open('{}', os.O_RDONLY)\nt = time.perf_counter()\nfor at in {offsets:?}:\n    assert len(os.pread(fd, {MIB}, at)) == {MIB}\nprint(time.perf_counter() - t)\n",
        path.display()
    )
}

/// A Python job reading `path` in order, whole, 1 MiB at a time; it prints how long
/// its reads took.
fn job_in_order(path: &Path) -> String {
    format!(
        "import os, time\nfd = os.open('{}', os.O_RDONLY)\nt = time.perf_counter()\nat = 0\nwhile True:\n    n = len(os.pread(fd, {MIB}, at))\n    if n == 0: break\n    at += n\nprint(time.perf_counter() - t)\n",
        path.display()
    )
}

/// What a file read whole, in order, comes to with partial copies on.
struct InOrder {
    /// What the cache holds of it, and whether its copy is pinned in RAM (the job
    /// again then reads memory, not the disk).
    held: u64,
    pinned: bool,
    /// The job from the network, again from the cache, from a local disk (medians).
    from_network: f64,
    from_copy: f64,
    from_disk: f64,
}

/// The same bytes, another file, read whole in order by a job: its copy is whole (the
/// profile's ranges hold all of it), as without partial copies; the job again from it
/// against the same job on `local` (a local disk), in turns.
fn in_order(
    agent: &hocus_tests::Agent,
    net: &hocus_tests::NetworkMount,
    content: &[u8],
    local: &Path,
    runs: usize,
) -> Result<InOrder> {
    let file = net.put("data/in-order.bin", content);
    let (from_network, _) = run_job(agent, &job_in_order(&file))?;
    let copy = agent.local_copy(&file);
    let size = content.len() as u64;
    // Whole: a partial copy made while the job read (its ranges then) is replaced.
    super::common::wait_for(agent, 300, "the file read in order held whole", || {
        std::fs::metadata(&copy)
            .is_ok_and(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512 >= size)
    })?;
    let pinned = agent.settled()["pinned_bytes"].as_u64().unwrap_or(0) >= size;
    let held = std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&copy)?) * 512;
    let (mut copy_runs, mut disk_runs) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        copy_runs.push(run_job(agent, &job_in_order(&file))?);
        disk_runs.push(run_job(agent, &job_in_order(local))?);
    }
    Ok(InOrder {
        held,
        pinned,
        from_network,
        from_copy: medians(copy_runs).0,
        from_disk: medians(disk_runs).0,
    })
}

/// Runs `job` under `hocus-agent run` with the page cache emptied first: the seconds
/// the whole job took, and its reads alone (what it printed).
fn run_job(agent: &hocus_tests::Agent, job: &str) -> Result<(f64, f64)> {
    let (whole, printed) = python_job(agent, job)?;
    Ok((whole, printed.trim().parse::<f64>()?))
}

pub fn ranges(agent_bin: &Path, r: &Ranges) -> Result<()> {
    if !host::is_root() {
        bail!("the benchmark mounts filesystems and loads eBPF programs: run it as root");
    }
    // SAFETY: single-threaded at this point.
    unsafe { std::env::set_var("HOCUS_AGENT_BIN", agent_bin) };
    let net = network(r.round_trip);
    let size = (r.file_mib * MIB) as u64;
    println!(
        "ranges: {} chunks of 1 MiB at random offsets (fixed seed) of a {} MiB file on sshfs with a {:.1} ms round trip",
        r.chunks,
        r.file_mib,
        r.round_trip.as_secs_f64() * 1000.0
    );
    let content: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    let file = net.put("data/train.bin", &content);
    let at = offsets(r.chunks, size);
    let read = (r.chunks * MIB) as u64;

    // Partial copies from 32 MiB (64 by default), where the kernel has them.
    let (disk, agent) = agent_on_local_disk(&net, &["--partial-from", "32M"]);
    println!(
        "big files read in part: {}",
        agent.route("big files read in part")
    );
    let (from_network, reads_network) = run_job(&agent, &job(&file, &at))?;
    let mut ranges: Vec<[u64; 2]> = Vec::new();
    super::common::wait_for(&agent, 30, "the job's ranges in the profile", || {
        ranges = file_entry(&agent.export(), &file).map_or_else(Vec::new, |f| {
            serde_json::from_value(f["ranges"].clone()).unwrap_or_default()
        });
        !ranges.is_empty()
    })?;
    let profiled: u64 = ranges.iter().map(|[s, e]| e - s).sum();
    let cached = agent.settled()["cached_bytes"].as_u64().unwrap_or(0);

    // The job again, served by the cache, against the same reads from a local disk by a
    // job started the same way (what a job served locally could take): in turns, the
    // median of each (one run of a 0.3 s job swings by a third on these machines).
    let local = disk.path.join("train.bin");
    std::fs::write(&local, &content)?;
    let (mut copy_runs, mut disk_runs) = (Vec::new(), Vec::new());
    for _ in 0..r.runs {
        copy_runs.push(run_job(&agent, &job(&file, &at))?);
        disk_runs.push(run_job(&agent, &job(&local, &at))?);
    }
    let c = agent.cache();
    println!(
        "the job again, {} times: {} reads of the partial copy allowed, {} bytes filled from the network, {} failed",
        r.runs, c["partial_reads_allowed"], c["partial_bytes_filled"], c["partial_reads_failed"]
    );
    let (from_copy, reads_copy) = medians(copy_runs);
    let (from_disk, reads_disk) = medians(disk_runs);
    let whole = in_order(&agent, &net, &content, &local, r.runs)?;
    // The mapped case has a daemon, a mount and a disk of its own: these go first.
    drop((agent, disk, net));
    let case = MapCase {
        file_mib: r.memmap_mib,
        chunks: r.chunks,
        round_trip: r.round_trip,
        runs: r.runs,
    };
    let mapped = super::memmap::mapped(&case, &hocus_tests::numpy_h5py())?;

    let mib = |b: u64| b as f64 / MIB as f64;
    let ratio = |b: u64| b as f64 / read as f64;
    println!("\n{:<34} {:>10} {:>8}", "", "MiB", "÷ READ");
    println!(
        "{:<34} {:>10.1} {:>7.2}x",
        "read by the job",
        mib(read),
        1.0
    );
    println!(
        "{:<34} {:>10.1} {:>7.2}x   ({} ranges)",
        "in the profile's byte ranges",
        mib(profiled),
        ratio(profiled),
        ranges.len()
    );
    println!(
        "{:<34} {:>10.1} {:>7.2}x   (goal: 1.2x)",
        "held in the cache after the job",
        mib(cached),
        ratio(cached)
    );
    println!(
        "\nthe job: {from_network:.3} s from the network; again, from the cache, {from_copy:.3} s; from a local disk {from_disk:.3} s"
    );
    println!(
        "its reads alone: {reads_network:.3} s from the network; {reads_copy:.3} s from the cache; {reads_disk:.3} s from a local disk"
    );
    println!(
        "the job again ÷ local disk: {:.2}x (goal: 1.1x), its reads alone {:.2}x; from the network ÷ local disk: {:.1}x",
        from_copy / from_disk,
        reads_copy / reads_disk,
        from_network / from_disk
    );
    println!(
        "\nthe same bytes read whole, in order, by a job: the cache holds {:.2}x the file (a whole copy, as without partial copies{}); the job {:.3} s from the network, again from the cache {:.3} s, from a local disk {:.3} s: {:.2}x",
        whole.held as f64 / size as f64,
        if whole.pinned { ", pinned in RAM" } else { "" },
        whole.from_network,
        whole.from_copy,
        whole.from_disk,
        whole.from_copy / whole.from_disk
    );
    let (m_size, m_read) = ((mapped.file_mib * MIB) as f64, read as f64);
    println!(
        "\nnumpy.memmap of a {} MiB file, the same {} chunks of 1 MiB: a mapped file gets a whole copy (a mapping asks for all it maps at mmap); the cache holds {:.2}x the file, {:.1}x the bytes read ({:.0} s after the first job)",
        mapped.file_mib,
        r.chunks,
        mapped.held as f64 / m_size,
        mapped.held as f64 / m_read,
        mapped.copied_after
    );
    println!(
        "the job {:.3} s from the network, again from the cache {:.3} s, from a local disk {:.3} s: {:.2}x (its reads alone {:.3}, {:.3}, {:.3} s: {:.2}x)",
        mapped.from_network.0,
        mapped.from_copy.0,
        mapped.from_disk.0,
        mapped.from_copy.0 / mapped.from_disk.0,
        mapped.from_network.1,
        mapped.from_copy.1,
        mapped.from_disk.1,
        mapped.from_copy.1 / mapped.from_disk.1
    );
    write_figures(
        "ranges",
        &serde_json::json!({
            "file_mib": r.file_mib,
            "chunks": r.chunks,
            "round_trip_ms": r.round_trip.as_secs_f64() * 1000.0,
            "bytes_read": read,
            "profiled_bytes": profiled,
            "profiled_ranges": ranges.len(),
            "cached_bytes": cached,
            "profiled_ratio": ratio(profiled),
            "cached_ratio": ratio(cached),
            "seconds_from_network": from_network,
            "seconds_from_the_cache": from_copy,
            "seconds_from_local_disk": from_disk,
            "reads_seconds_from_network": reads_network,
            "reads_seconds_from_the_cache": reads_copy,
            "reads_seconds_from_local_disk": reads_disk,
            "in_order_held_bytes": whole.held,
            "in_order_seconds_from_network": whole.from_network,
            "in_order_seconds_from_the_cache": whole.from_copy,
            "in_order_seconds_from_local_disk": whole.from_disk,
            "memmap_file_mib": mapped.file_mib,
            "memmap_held_bytes": mapped.held,
            "memmap_copied_after_seconds": mapped.copied_after,
            "memmap_seconds_from_network": mapped.from_network.0,
            "memmap_seconds_from_the_cache": mapped.from_copy.0,
            "memmap_seconds_from_local_disk": mapped.from_disk.0,
            "memmap_reads_seconds_from_network": mapped.from_network.1,
            "memmap_reads_seconds_from_the_cache": mapped.from_copy.1,
            "memmap_reads_seconds_from_local_disk": mapped.from_disk.1,
        }),
    )
}
