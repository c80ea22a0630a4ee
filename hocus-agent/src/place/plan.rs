//! `hocus-agent plan`: the placement the daemon would choose for a profile, and what its
//! workload would cost before and after, from per-operation costs measured here (an open,
//! a failed lookup and read throughput on the mount; the same on the local cache
//! filesystem; memory throughput for pinned reads). Copies nothing.

use std::{
    fs::{self, File},
    io::{Read, Write},
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::{
    place::{
        budget::Budgets,
        placement::{self, Filters, Placement},
    },
    profile::{
        format::{FileEntry, Profile},
        shortlist::{self, Shortlist},
    },
    shared::size::human,
};

/// Seconds per open, per failed lookup, and bytes per second read.
#[derive(Debug, Clone, Copy)]
struct Costs {
    open: f64,
    lookup: f64,
    read: f64,
}

/// Prints the plan for `profile` with these budgets and filters, the local costs
/// measured on `cache_dir`'s filesystem.
/// Files from `partial_from` bytes (0: none) read in part are placed as partial
/// copies, weighed by their ranges.
pub fn run(
    profile: &Profile,
    cache_dir: &Path,
    budgets: Budgets,
    filters: &Filters,
    partial_from: u64,
    csv: bool,
) -> Result<()> {
    let shortlist = Shortlist::from(profile);
    let files: Vec<shortlist::File> = shortlist.files().collect();
    let none = |_: &str| false;
    let takes = |f: &shortlist::File| placement::takes_in_part(f, &shortlist, partial_from);
    let placed = placement::place(
        &files,
        filters,
        budgets.ssd,
        budgets.ram,
        &takes,
        &none,
        &none,
    );
    let network = measure_network(profile)?;
    let local = measure_local(cache_dir)?;
    let ram = Costs {
        read: memory_throughput(),
        ..local
    };
    let tier = |path: &str| -> &'static str {
        match placed.files.iter().find(|c| c.path == path) {
            Some(c) if c.pinned => "ram",
            Some(_) => "ssd",
            None => "network",
        }
    };
    let cost = |c: Costs, opens: u64, bytes: u64| opens as f64 * c.open + bytes as f64 / c.read;
    let mut before = 0.0;
    let mut after = 0.0;
    let mut rows = Vec::new();
    for f in &profile.files {
        let t = tier(&f.path);
        let b = cost(network, f.opens, f.bytes_read);
        let a = match t {
            "ram" => cost(ram, f.opens, f.bytes_read),
            "ssd" => cost(local, f.opens, f.bytes_read),
            _ => b,
        };
        before += b;
        after += a;
        rows.push((f, t, b, a));
    }
    let lookups: u64 = profile.missing.iter().map(|m| m.lookups).sum();
    let lookup_time = lookups as f64 * network.lookup;
    before += lookup_time;
    after += lookup_time;

    if csv {
        println!("path,size,opens,bytes_read,tier,before_s,after_s");
        for (f, t, b, a) in rows {
            println!(
                "{},{},{},{},{t},{b:.6},{a:.6}",
                csv_field(&f.path),
                f.size,
                f.opens,
                f.bytes_read
            );
        }
        return Ok(());
    }
    print_table(profile, &placed, budgets, filters, &rows);
    println!(
        "\nmeasured: network open {}, failed lookup {}, read {}/s; local open {}, read {}/s; RAM read {}/s",
        secs(network.open),
        secs(network.lookup),
        human(network.read as u64),
        secs(local.open),
        human(local.read as u64),
        human(ram.read as u64)
    );
    println!(
        "simulated time of the profile's workload: before {}, after {} ({:.1}x); {} of it are {} failed lookups, which stay on the network until lookups are redirected",
        secs(before),
        secs(after),
        if after > 0.0 { before / after } else { 1.0 },
        secs(lookup_time),
        lookups
    );
    let read: u64 = profile.files.iter().map(|f| f.size).sum();
    println!(
        "memory: before, up to {} of evictable page cache; after, {} pinned (locked) in RAM and {} on SSD",
        human(read),
        human(placed.ram_bytes),
        human(placed.ssd_bytes)
    );
    Ok(())
}

type Row<'a> = (&'a FileEntry, &'static str, f64, f64);

fn print_table(
    profile: &Profile,
    placed: &Placement,
    budgets: Budgets,
    filters: &Filters,
    rows: &[Row],
) {
    println!(
        "placement of {} files ({}) within SSD {} and RAM {}:",
        profile.files.len(),
        human(profile.files.iter().map(|f| f.size).sum()),
        human(budgets.ssd),
        human(budgets.ram)
    );
    println!(
        "{:<8} {:>7} {:>11} {:>8} {:>11} {:>10} {:>10}",
        "TIER", "FILES", "BYTES", "OPENS", "READ", "BEFORE", "AFTER"
    );
    for tier in ["ram", "ssd", "network"] {
        let in_tier: Vec<_> = rows.iter().filter(|r| r.1 == tier).collect();
        println!(
            "{:<8} {:>7} {:>11} {:>8} {:>11} {:>10} {:>10}",
            tier,
            in_tier.len(),
            human(in_tier.iter().map(|r| r.0.size).sum()),
            in_tier.iter().map(|r| r.0.opens).sum::<u64>(),
            human(in_tier.iter().map(|r| r.0.bytes_read).sum()),
            secs(in_tier.iter().map(|r| r.2).sum()),
            secs(in_tier.iter().map(|r| r.3).sum()),
        );
    }
    let written = profile.files.iter().filter(|f| f.written).count();
    let filtered = profile
        .files
        .iter()
        .filter(|f| !f.written && !filters.admits(&f.path))
        .count();
    if written + filtered > 0 {
        println!(
            "never cached: {written} written (mutable) files, {filtered} excluded by --include-ext/--exclude"
        );
    }
    let _ = placed;
}

/// Costs on the network mount, from the profile's own files.
fn measure_network(profile: &Profile) -> Result<Costs> {
    let mut samples: Vec<(PathBuf, u64)> = profile
        .files
        .iter()
        .filter_map(|f| {
            fs::metadata(&f.path)
                .ok()
                .filter(|m| m.is_file())
                .map(|m| (PathBuf::from(&f.path), m.len()))
        })
        .take(20)
        .collect();
    if samples.is_empty() {
        bail!(
            "none of the profile's files can be reached here: plan measures its costs on the mount the profile was recorded on"
        );
    }
    let open = median(samples.iter().cycle().take(60).map(|(p, _)| {
        let t = Instant::now();
        drop(File::open(p));
        t.elapsed()
    }));
    let lookup = median(
        samples
            .iter()
            .cycle()
            .take(60)
            .enumerate()
            .map(|(i, (p, _))| {
                let probe =
                    p.with_file_name(format!(".hocus-plan-probe-{}-{i}", std::process::id()));
                let t = Instant::now();
                let _ = fs::symlink_metadata(&probe);
                t.elapsed()
            }),
    );
    samples.sort_by_key(|(_, size)| std::cmp::Reverse(*size));
    let read = throughput(&samples[0].0, 64 << 20)?;
    Ok(Costs { open, lookup, read })
}

/// Costs on the local cache filesystem, with a scratch file.
fn measure_local(cache_dir: &Path) -> Result<Costs> {
    let mut dir = cache_dir;
    while !dir.exists() {
        dir = dir.parent().unwrap_or(Path::new("/"));
    }
    let scratch = tempfile::Builder::new()
        .prefix(".hocus-plan-")
        .tempfile_in(dir)
        .with_context(|| {
            format!(
                "making a scratch file in {} to measure the local disk",
                dir.display()
            )
        })?;
    let mut f = scratch.as_file();
    let block = vec![0x5au8; 1 << 20];
    for _ in 0..16 {
        f.write_all(&block)?;
    }
    f.sync_all()?;
    let path = scratch.path().to_owned();
    let open = median((0..60).map(|_| {
        let t = Instant::now();
        drop(File::open(&path));
        t.elapsed()
    }));
    let lookup = median((0..60).map(|i| {
        let t = Instant::now();
        let _ = fs::symlink_metadata(path.with_extension(format!("missing{i}")));
        t.elapsed()
    }));
    let read = throughput(&path, 16 << 20)?;
    Ok(Costs { open, lookup, read })
}

/// Bytes per second reading up to `limit` bytes of `path` from storage: its cached
/// pages are dropped first.
fn throughput(path: &Path, limit: u64) -> Result<f64> {
    let mut f = File::open(path).with_context(|| format!("reading {}", path.display()))?;
    // SAFETY: plain syscall on an open descriptor.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    let t = Instant::now();
    while total < limit {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    let secs = t.elapsed().as_secs_f64().max(1e-6);
    Ok((total.max(1) as f64) / secs)
}

fn memory_throughput() -> f64 {
    let src = vec![1u8; 64 << 20];
    let mut dst = vec![0u8; 64 << 20];
    let t = Instant::now();
    dst.copy_from_slice(&src);
    std::hint::black_box(&dst);
    (64u64 << 20) as f64 / t.elapsed().as_secs_f64().max(1e-6)
}

fn median(samples: impl Iterator<Item = Duration>) -> f64 {
    let mut v: Vec<f64> = samples.map(|d| d.as_secs_f64()).collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn secs(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{:.1} us", s * 1e6)
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_owned()
    }
}
