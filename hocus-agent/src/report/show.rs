//! Tables a person reads at a glance: the profile's totals, hottest files and trees, and
//! failed lookups; the daemon's status.

use hocus_control::status::{Served, Status};
use std::{collections::HashMap, fmt::Write};

use crate::{profile::format::Profile, shared::size::human as bytes};

pub fn render(p: &Profile, top: usize) -> String {
    let mut out = String::new();
    let opens: u64 = p.files.iter().map(|f| f.opens).sum();
    let read: u64 = p.files.iter().map(|f| f.bytes_read).sum();
    let size: u64 = p.files.iter().map(|f| f.size).sum();
    let lookups: u64 = p.missing.iter().map(|m| m.lookups).sum();
    let written = p.files.iter().filter(|f| f.written).count();
    let mutated = p.dirs.iter().filter(|d| d.mutated).count();
    let _ = writeln!(
        out,
        "{} files ({}), {} opens, {} read; {} missing names, {} failed lookups; {} files written, {} directories changed",
        p.files.len(),
        bytes(size),
        opens,
        bytes(read),
        p.missing.len(),
        lookups,
        written,
        mutated
    );
    let partial: Vec<_> = p.files.iter().filter(|f| !f.ranges.is_empty()).collect();
    if !partial.is_empty() {
        let held: u64 = partial
            .iter()
            .flat_map(|f| &f.ranges)
            .map(|[start, end]| end.saturating_sub(*start))
            .sum();
        let _ = writeln!(
            out,
            "{} big files read in part: {} in {} byte ranges, of {}",
            partial.len(),
            bytes(held),
            partial.iter().map(|f| f.ranges.len()).sum::<usize>(),
            bytes(partial.iter().map(|f| f.size).sum())
        );
    }

    let mut files: Vec<_> = p.files.iter().collect();
    files.sort_by_key(|f| std::cmp::Reverse((f.opens, f.bytes_read)));
    table(
        &mut out,
        "Hottest files",
        &["OPENS", "READ", "SIZE", "USERS", "WRITTEN", "PATH"],
        files.iter().take(top).map(|f| {
            vec![
                f.opens.to_string(),
                bytes(f.bytes_read),
                bytes(f.size),
                f.users.to_string(),
                if f.written { "yes" } else { "" }.to_owned(),
                f.path.clone(),
            ]
        }),
    );

    // Trees: every ancestor directory of a file gets its opens and bytes.
    let mut trees: HashMap<&str, (u64, u64, u64)> = HashMap::new();
    for f in &p.files {
        let mut path = f.path.as_str();
        while let Some(i) = path.rfind('/').filter(|i| *i > 0) {
            path = &path[..i];
            let t = trees.entry(path).or_default();
            t.0 += f.opens;
            t.1 += f.bytes_read;
            t.2 += 1;
        }
    }
    // A tree that holds exactly what its only child holds says nothing new.
    let mut trees: Vec<_> = trees
        .iter()
        .filter(|(path, t)| {
            !trees
                .iter()
                .any(|(other, o)| o == *t && other.len() > path.len() && other.starts_with(*path))
        })
        .collect();
    trees.sort_by(|a, b| (b.1.0, b.0).cmp(&(a.1.0, a.0)).then(a.0.cmp(b.0)));
    table(
        &mut out,
        "Hottest trees",
        &["OPENS", "READ", "FILES", "TREE"],
        trees.iter().take(top).map(|(path, t)| {
            vec![
                t.0.to_string(),
                bytes(t.1),
                t.2.to_string(),
                format!("{path}/"),
            ]
        }),
    );

    let mut by_dir: HashMap<&str, (u64, u64)> = HashMap::new();
    for m in &p.missing {
        let dir = m
            .path
            .rsplit_once('/')
            .map_or("/", |(d, _)| if d.is_empty() { "/" } else { d });
        let e = by_dir.entry(dir).or_default();
        e.0 += 1;
        e.1 += m.lookups;
    }
    let mut by_dir: Vec<_> = by_dir.into_iter().collect();
    by_dir.sort_by(|a, b| b.1.1.cmp(&a.1.1).then(a.0.cmp(b.0)));
    table(
        &mut out,
        "Failed lookups by directory",
        &["LOOKUPS", "NAMES", "DIRECTORY"],
        by_dir.iter().take(top).map(|(d, (names, lookups))| {
            vec![lookups.to_string(), names.to_string(), (*d).to_owned()]
        }),
    );
    let mut missing: Vec<_> = p.missing.iter().collect();
    missing.sort_by(|a, b| b.lookups.cmp(&a.lookups).then(a.path.cmp(&b.path)));
    table(
        &mut out,
        "Most probed missing names",
        &["LOOKUPS", "PATH"],
        missing
            .iter()
            .take(top)
            .map(|m| vec![m.lookups.to_string(), m.path.clone()]),
    );
    out
}

pub fn render_status(s: &Status) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "hocus-agent {}, pid {}, up {}; profile in {}{}",
        s.version,
        s.pid,
        duration(s.uptime_secs),
        s.state_dir.display(),
        s.metrics_addr
            .map(|a| format!("; metrics on http://{a}/metrics"))
            .unwrap_or_default()
    );
    for w in &s.watched {
        let totals = s.roots.iter().find(|r| r.root == w.path);
        let _ = writeln!(
            out,
            "watching {} ({}{}): {}",
            w.path.display(),
            w.fs_type,
            if w.network {
                ""
            } else {
                ", not a network filesystem"
            },
            totals.map_or(String::new(), |r| format!(
                "{} files ({}), {} missing names in the working set",
                r.files,
                bytes(r.bytes),
                r.missing
            ))
        );
    }
    if let Some(c) = &s.cache {
        let sum = |f: fn(&Served) -> u64| c.served.iter().map(f).sum::<u64>();
        let (local, network, in_jobs) = (
            sum(|x| x.opens_local),
            sum(|x| x.opens_network),
            sum(|x| x.job_opens),
        );
        let _ = writeln!(
            out,
            "hits: {local} of {} opens served by local copies ({}); {in_jobs} opens were in hocus-agent run jobs ({} served locally); failed lookups answered locally: {} of {}",
            local + network,
            ratio(local, local + network),
            ratio(local, in_jobs),
            sum(|x| x.lookups_local),
            sum(|x| x.lookups_local + x.lookups_network),
        );
        let _ = writeln!(
            out,
            "reads: {} from RAM, {} from SSD, {} from the network",
            bytes(sum(|x| x.read_ram)),
            bytes(sum(|x| x.read_ssd)),
            bytes(sum(|x| x.read_network)),
        );
        for j in &c.slurm_jobs {
            let s = &j.served;
            let _ = writeln!(
                out,
                "Slurm job {} (uid {}): {} tasks ({} running); opens {} local of {}; failed lookups {} local of {}; read {} local, {} from the network",
                j.job_id,
                j.uid,
                j.tasks,
                j.tasks_running,
                s.opens_local,
                s.opens_local + s.opens_network,
                s.lookups_local,
                s.lookups_local + s.lookups_network,
                bytes(s.read_ram + s.read_ssd),
                bytes(s.read_network),
            );
        }
        let _ = writeln!(
            out,
            "cache {}: SSD {} of {} ({} files{}); RAM {} of {} ({} files pinned){}; {} copying",
            c.cache_dir.display(),
            bytes(c.cached_bytes + c.snapshot_bytes),
            bytes(c.ssd_budget),
            c.cached_files,
            if c.snapshots.is_empty() {
                String::new()
            } else {
                format!(", {} snapshots", c.snapshots.len())
            },
            bytes(c.pinned_bytes),
            bytes(c.ram_budget),
            c.pinned_files,
            if c.limited_by_map_count {
                " (pinning is limited by vm.max_map_count)"
            } else {
                ""
            },
            c.copying
        );
        let failures: Vec<String> = c
            .copy_failures_by_reason
            .iter()
            .map(|(r, n)| format!("{r} {n}"))
            .collect();
        let _ = writeln!(
            out,
            "copies: {} ({}{}), {} did not land{}; {} invalidated, {} evicted, cache full {} times; jobs: {} running, {} started",
            c.copies,
            bytes(c.copied_bytes),
            if c.copied_from_peers_bytes > 0 {
                format!(
                    ", {} from other nodes of multi-node jobs in {:.1} s",
                    bytes(c.copied_from_peers_bytes),
                    c.peer_wait_ms as f64 / 1000.0
                )
            } else {
                String::new()
            },
            c.copy_failures_by_reason.values().sum::<u64>(),
            if failures.is_empty() {
                String::new()
            } else {
                format!(" ({})", failures.join(", "))
            },
            c.invalidations,
            c.evictions,
            c.cache_full_events,
            c.jobs_running,
            c.jobs_started,
        );
        if c.prefetch_remaining_files > 0 {
            let _ = writeln!(
                out,
                "prefetching: {} copies ({}) to go",
                c.prefetch_remaining_files,
                bytes(c.prefetch_remaining_bytes)
            );
        }
    }
    let t = &s.tally;
    let kernel = |name: &str| {
        s.kernel
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0, |(_, v)| *v)
    };
    let lost: Vec<String> = s
        .kernel
        .iter()
        .filter(|(n, v)| *v > 0 && n != "events_sent" && n != "foreign_namespace")
        .map(|(n, v)| format!("{n} {v}"))
        .chain((t.unresolved > 0).then(|| format!("unresolved relative paths {}", t.unresolved)))
        .collect();
    let _ = writeln!(
        out,
        "events: {} sent by the kernel, {} handled ({} opens, {} failed lookups, {} writes, {} refused writes); lost: {}",
        kernel("events_sent"),
        t.events,
        t.opens,
        t.failed_lookups,
        t.mutations,
        t.writes_refused,
        if lost.is_empty() {
            "none".to_owned()
        } else {
            lost.join(", ")
        }
    );
    let r = &s.tracing;
    let _ = writeln!(
        out,
        "tracing: {} for {}; rested {} times ({} in all, {} of it while jobs ran), woke {} times; {}",
        match (r.resting, r.with_jobs) {
            (true, true) =>
                "resting while jobs run whose requests all hit local copies (their hits are not counted meanwhile)",
            (true, false) => "resting",
            _ => "on",
        },
        duration(r.since_secs),
        r.rests,
        duration(r.resting_secs),
        duration(r.resting_with_jobs_secs),
        r.wakeups,
        match r.rest_after_secs {
            0 => "never rests (rest-after 0)".to_owned(),
            n => format!("rests after {n} s with nothing to learn"),
        }
    );
    let _ = writeln!(
        out,
        "following: {}",
        if r.every_process {
            "every process (why: the route of \"processes followed\" below; docs/overhead.md)"
                .to_owned()
        } else {
            format!(
                "{} processes and threads (jobs, and processes that used a watched mount); the others' syscalls are turned away at once",
                r.followed
            )
        }
    );
    let foreign = kernel("foreign_namespace");
    if foreign > 0 {
        let _ = writeln!(
            out,
            "containers: {foreign} absolute lookups made before hocus knew their mount namespace (most are off the watched trees)"
        );
    }
    let _ = writeln!(
        out,
        "working set: {} files, {} missing names, {} directories, {} in memory",
        s.files,
        s.missing,
        s.dirs,
        bytes(s.profile_bytes)
    );
    if s.profile_entries_dropped > 0 {
        let _ = writeln!(
            out,
            "the working set is full ({} entries, max-profile-entries): {} new names read were not recorded",
            s.max_profile_entries, s.profile_entries_dropped
        );
    }
    if s.accesses_uncounted > 0 {
        let _ = writeln!(
            out,
            "the cache keeper fell behind: {} accesses were not counted as hits or misses",
            s.accesses_uncounted
        );
    }
    let c = &s.control;
    let refused: Vec<String> = c.refused.iter().map(|(r, n)| format!("{r} {n}")).collect();
    let _ = writeln!(
        out,
        "control socket: {} clients (at most {}, {} per user); refused: {}",
        c.clients,
        c.max_clients,
        c.max_clients_per_user,
        if refused.is_empty() {
            "none".to_owned()
        } else {
            refused.join(", ")
        }
    );
    let mut mounts: Vec<&std::path::Path> = s.server.iter().map(|a| a.mount.as_path()).collect();
    mounts.dedup();
    for mount in mounts {
        let of: Vec<_> = s.server.iter().filter(|a| a.mount == mount).collect();
        let total: u64 = of.iter().map(|a| a.operations).sum();
        let parts: Vec<String> = of
            .iter()
            .filter(|a| a.operations > 0)
            .map(|a| format!("{} {}", a.purpose.replace('_', " "), a.operations))
            .collect();
        let read: u64 = of.iter().map(|a| a.bytes).sum();
        let _ = writeln!(
            out,
            "asked of {}'s server: {total} operations{}, {} read",
            mount.display(),
            if parts.is_empty() {
                String::new()
            } else {
                format!(" ({})", parts.join(", "))
            },
            bytes(read)
        );
    }
    if !s.kernel_release.is_empty() {
        let fallbacks = s.routes.iter().filter(|r| r.fallback).count();
        let _ = writeln!(
            out,
            "kernel {}: {} of {} parts take a fallback (docs/kernels.md)",
            s.kernel_release,
            fallbacks,
            s.routes.len()
        );
        for r in &s.routes {
            let note = if r.fallback { " [fallback]" } else { "" };
            let _ = writeln!(out, "  {}: {}{note}", r.part, r.way);
        }
    }
    if !s.not_traced.is_empty() {
        let _ = writeln!(
            out,
            "not traced on this kernel: {}",
            s.not_traced.join(", ")
        );
    }
    if let Some(e) = &s.last_save_error {
        let _ = writeln!(out, "SAVING FAILS: {e}");
    }
    table(
        &mut out,
        "Hottest files",
        &["OPENS", "SIZE", "READ", "HELD", "PATH"],
        s.top.iter().map(|f| {
            vec![
                f.opens.to_string(),
                bytes(f.size),
                bytes(f.bytes_read),
                f.held.clone(),
                f.path.clone(),
            ]
        }),
    );
    out
}

fn ratio(part: u64, whole: u64) -> String {
    if whole == 0 {
        "-".into()
    } else {
        format!("{:.1}%", part as f64 * 100.0 / whole as f64)
    }
}

fn duration(secs: u64) -> String {
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m {}s", s / 60, s % 60),
        s if s < 86400 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        s => format!("{}d {}h", s / 86400, s % 86400 / 3600),
    }
}

fn table(out: &mut String, title: &str, headers: &[&str], rows: impl Iterator<Item = Vec<String>>) {
    let rows: Vec<Vec<String>> = rows.collect();
    if rows.is_empty() {
        return;
    }
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let _ = writeln!(out, "\n{title}");
    let line = |cells: Vec<String>| {
        let last = cells.len() - 1;
        cells
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                if i == last {
                    c // the path, left-aligned and never padded
                } else {
                    format!("{c:>w$}", w = widths[i])
                }
            })
            .collect::<Vec<_>>()
            .join("  ")
    };
    let _ = writeln!(
        out,
        "{}",
        line(headers.iter().map(|h| (*h).to_owned()).collect())
    );
    for row in rows {
        let _ = writeln!(out, "{}", line(row));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::working_set::WorkingSet;

    #[test]
    fn shows_totals_hot_files_trees_and_missing() {
        let mut ws = WorkingSet::new(0);
        for _ in 0..3 {
            ws.open("/net/env/lib/numpy/core.py", 1, 1);
        }
        ws.open("/net/env/lib/scipy/x.py", 1, 2);
        ws.add_bytes_read("/net/env/lib/numpy/core.py", 3 << 20);
        ws.missing("/net/env/lib/numpy/nope.py", 1);
        ws.missing("/net/env/lib/numpy/nope.py", 1);
        let text = render(&ws.to_profile(), 10);
        assert!(text.starts_with("2 files"), "{text}");
        assert!(
            text.contains("4 opens, 3.0 MiB read; 1 missing names, 2 failed lookups"),
            "{text}"
        );
        assert!(text.contains("/net/env/lib/numpy/core.py"), "{text}");
        // the chain /net, /net/env collapses into the deepest tree holding the same
        assert!(
            text.contains("\n    4  3.0 MiB      2  /net/env/lib/\n"),
            "{text}"
        );
        assert!(!text.contains(" /net/env/\n"), "{text}");
        assert!(text.contains("2      1  /net/env/lib/numpy"), "{text}");
        assert!(!text.contains("read in part"), "{text}");
        ws.open("/net/data/big.bin", 1, 3);
        ws.read_range("/net/data/big.bin", 32, 48);
        ws.read_range("/net/data/big.bin", 64, 80);
        let text = render(&ws.to_profile(), 10);
        assert!(
            text.contains("1 big files read in part: 2.0 MiB in 2 byte ranges, of 0 B"),
            "{text}"
        );
    }
}
