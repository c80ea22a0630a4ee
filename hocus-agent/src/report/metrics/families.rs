//! The metric families of a daemon status (docs/metrics.md, whose names a test checks
//! against these), encoded with prometheus-client.

use hocus_control::status::{CacheStatus, Served, SlurmJob, Status};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
    registry::Unit,
};

/// Why the control socket refuses a client (`control::server`), always all listed.
const CONTROL_REFUSALS: [&str; 12] = [
    "identity",
    "too_many_clients",
    "too_many_clients_of_user",
    "timeout",
    "too_large",
    "wrong_descriptors",
    "malformed",
    "bad_profile",
    "closed",
    "read_error",
    "accept_failed",
    "no_thread",
];
/// Copy failure reasons (`CopyError::reason`), always all listed.
const COPY_FAILURES: [&str; 7] = [
    "changed",
    "no_space",
    "refused",
    "too_large",
    "gone",
    "read_error",
    "write_error",
];

/// A status, as the registry collects it at a scrape.
#[derive(Debug)]
pub struct Snapshot(pub Status);

type Labels<'a> = Vec<(&'static str, String)>;

/// Writes one metric family: its samples, each with its labels.
fn family<M: EncodeMetric>(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    samples: Vec<(Labels<'_>, M)>,
) -> std::fmt::Result {
    let Some(first) = samples.first() else {
        return Ok(());
    };
    let mut metric = e.encode_descriptor(name, help, unit, first.1.metric_type())?;
    if let [(labels, m)] = samples.as_slice() {
        if labels.is_empty() {
            return m.encode(metric);
        }
    }
    for (labels, m) in &samples {
        m.encode(metric.encode_family(labels)?)?;
    }
    Ok(())
}

fn counter(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    samples: Vec<(Labels<'_>, u64)>,
) -> std::fmt::Result {
    let samples = samples
        .into_iter()
        .map(|(l, v)| (l, ConstCounter::new(v)))
        .collect();
    family(e, name, help, unit, samples)
}

fn gauge(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    samples: Vec<(Labels<'_>, i64)>,
) -> std::fmt::Result {
    let samples = samples
        .into_iter()
        .map(|(l, v)| (l, ConstGauge::new(v)))
        .collect();
    family(e, name, help, unit, samples)
}

fn one<T>(v: T) -> Vec<(Labels<'static>, T)> {
    vec![(Vec::new(), v)]
}

fn root(p: &std::path::Path) -> Labels<'static> {
    vec![("root", p.display().to_string())]
}

impl Collector for Snapshot {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.0;
        let e = &mut e;
        let bytes = Some(&Unit::Bytes);
        gauge(
            e,
            "build_info",
            "The running hocus-agent's version (always 1).",
            None,
            vec![(vec![("version", s.version.clone())], 1)],
        )?;
        gauge(
            e,
            "start_time",
            "When the daemon started, in seconds since the Unix epoch.",
            Some(&Unit::Seconds),
            one(s.started_unix_secs as i64),
        )?;

        gauge(
            e,
            "profile_memory",
            "Memory the working set takes in the daemon (an estimate from what it reserved).",
            bytes,
            one(s.profile_bytes as i64),
        )?;
        counter(
            e,
            "profile_entries_dropped",
            "New names read that the working set did not record: it holds its most entries (max-profile-entries).",
            None,
            one(s.profile_entries_dropped),
        )?;
        counter(
            e,
            "accesses_uncounted",
            "Accesses not counted as hits or misses: the cache keeper was busy and the most accesses held for it waited already.",
            None,
            one(s.accesses_uncounted),
        )?;
        // What the daemon asks of the file servers, and what NFS's clients sent.
        let by_purpose = |a: &hocus_control::status::ServerAsked| {
            vec![
                ("mount", a.mount.display().to_string()),
                ("purpose", a.purpose.clone()),
            ]
        };
        counter(
            e,
            "server_operations",
            "Calls the daemon made on a watched network tree (an open, lookup, stat, listing or read each), by purpose: job_start, revalidation, copy, snapshot, fill, profile, access.",
            None,
            s.server
                .iter()
                .map(|a| (by_purpose(a), a.operations))
                .collect(),
        )?;
        counter(
            e,
            "server_read",
            "Bytes the daemon read from a watched network tree, by purpose.",
            bytes,
            s.server.iter().map(|a| (by_purpose(a), a.bytes)).collect(),
        )?;
        counter(
            e,
            "nfs_operations",
            "Requests a watched NFS mount's client sent its server (every process's, the daemon's among them), by operation, as its mountstats say.",
            None,
            s.nfs_operations
                .iter()
                .flat_map(|m| {
                    m.operations.iter().map(|(op, n)| {
                        (
                            vec![("mount", m.mount.display().to_string()), ("op", op.clone())],
                            *n,
                        )
                    })
                })
                .collect(),
        )?;

        // The control socket: clients now, and those refused.
        let c = &s.control;
        gauge(
            e,
            "control_clients",
            "Clients connected to the control socket.",
            None,
            one(c.clients as i64),
        )?;
        gauge(
            e,
            "control_clients_max",
            "How many clients the control socket serves at once (max-clients).",
            None,
            one(c.max_clients as i64),
        )?;
        counter(
            e,
            "control_refused",
            "Control socket clients refused, by reason.",
            None,
            CONTROL_REFUSALS
                .iter()
                .map(|r| {
                    let n = c.refused.get(*r).copied().unwrap_or(0);
                    (vec![("reason", (*r).to_owned())], n)
                })
                .collect(),
        )?;

        // What the tracer saw, and what it could not deliver.
        let t = &s.tally;
        counter(
            e,
            "events",
            "Events on watched paths the daemon handled, by kind.",
            None,
            vec![
                (vec![("kind", "open".into())], t.opens),
                (vec![("kind", "failed_lookup".into())], t.failed_lookups),
                (vec![("kind", "write".into())], t.mutations),
                (vec![("kind", "close".into())], t.closes),
                (vec![("kind", "refused_write".into())], t.writes_refused),
            ],
        )?;
        let kernel = |name: &str| {
            s.kernel
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0, |(_, v)| *v)
        };
        counter(
            e,
            "events_lost",
            "Events the profile misses, by cause: the kernel could not deliver them, or their relative path could not be resolved.",
            None,
            vec![
                (
                    vec![("cause", "ring_buffer_full".into())],
                    kernel("lost_ring_buffer_full"),
                ),
                (
                    vec![("cause", "open_files_map_full".into())],
                    kernel("lost_open_files_map_full"),
                ),
                (
                    vec![("cause", "open_files_of_user".into())],
                    kernel("lost_open_files_of_user"),
                ),
                (
                    vec![("cause", "path_unreadable".into())],
                    kernel("path_unreadable"),
                ),
                (
                    vec![("cause", "path_truncated".into())],
                    kernel("path_truncated"),
                ),
                (vec![("cause", "unresolved".into())], t.unresolved),
            ],
        )?;
        let r = &s.tracing;
        gauge(
            e,
            "tracing_resting",
            "1 while the syscall program is detached: nothing to learn for rest-after seconds (no job running, or every job's requests hitting local copies).",
            None,
            vec![(vec![], i64::from(r.resting))],
        )?;
        counter(
            e,
            "tracing_rests",
            "Times the syscall program was detached for lack of anything to learn.",
            None,
            vec![(vec![], r.rests)],
        )?;
        counter(
            e,
            "tracing_wakeups",
            "Times the syscall program was attached again: a job starting, or a process using a watched mount.",
            None,
            vec![(vec![], r.wakeups)],
        )?;
        counter(
            e,
            "tracing_resting_seconds",
            "Seconds the syscall program spent detached.",
            None,
            vec![(vec![], r.resting_secs)],
        )?;
        counter(
            e,
            "tracing_resting_with_jobs_seconds",
            "Seconds the syscall program spent detached while jobs ran, every request of theirs hitting local copies: their hits are not counted then.",
            None,
            vec![(vec![], r.resting_with_jobs_secs)],
        )?;
        gauge(
            e,
            "tracing_followed_processes",
            "Processes (and threads of followed processes) whose syscalls the syscall program follows: jobs, and processes that used a watched mount's server.",
            None,
            vec![(vec![], r.followed as i64)],
        )?;
        counter(
            e,
            "container_lookups_unplaced",
            "Absolute lookups in mount namespaces (containers) before hocus had learned their mounts; most are off the watched trees.",
            None,
            vec![(vec![], kernel("foreign_namespace"))],
        )?;

        // The working set.
        gauge(
            e,
            "working_set_files",
            "Files in the working-set profile, by watched tree.",
            None,
            s.roots
                .iter()
                .map(|r| (root(&r.root), r.files as i64))
                .collect(),
        )?;
        gauge(
            e,
            "working_set",
            "Bytes of the files in the working-set profile, by watched tree.",
            bytes,
            s.roots
                .iter()
                .map(|r| (root(&r.root), r.bytes as i64))
                .collect(),
        )?;
        gauge(
            e,
            "working_set_missing_names",
            "Names looked up and not found, in the profile, by watched tree.",
            None,
            s.roots
                .iter()
                .map(|r| (root(&r.root), r.missing as i64))
                .collect(),
        )?;

        let Some(c) = &s.cache else {
            return Ok(());
        };
        cache(e, c)?;
        served(e, c)?;
        slurm_jobs(e, c)
    }
}

/// The SSD cache, the RAM pins, copies and prefetches.
fn cache(e: &mut DescriptorEncoder, c: &CacheStatus) -> std::fmt::Result {
    let bytes = Some(&Unit::Bytes);
    let g = |v: u64| one(v as i64);
    gauge(
        e,
        "cache_files",
        "Files copied to the SSD cache.",
        None,
        g(c.cached_files as u64),
    )?;
    gauge(
        e,
        "cache",
        "Bytes of files copied to the SSD cache (snapshots apart).",
        bytes,
        g(c.cached_bytes),
    )?;
    gauge(e, "cache_budget", "The SSD budget.", bytes, g(c.ssd_budget))?;
    gauge(
        e,
        "snapshots",
        "Trees held as snapshots (the directories jobs used, local; the others shown from the network).",
        None,
        g(c.snapshots.len() as u64),
    )?;
    gauge(
        e,
        "snapshot",
        "Bytes snapshots add to the SSD cache.",
        bytes,
        g(c.snapshot_bytes),
    )?;
    gauge(
        e,
        "pinned_files",
        "Files pinned in RAM.",
        None,
        g(c.pinned_files as u64),
    )?;
    gauge(
        e,
        "pinned",
        "Bytes pinned in RAM.",
        bytes,
        g(c.pinned_bytes),
    )?;
    gauge(
        e,
        "pinned_budget",
        "The RAM budget.",
        bytes,
        g(c.ram_budget),
    )?;
    gauge(
        e,
        "copies_in_progress",
        "Copies and snapshots under way.",
        None,
        g(c.copying as u64),
    )?;
    counter(
        e,
        "copies",
        "Files copied to the SSD cache.",
        None,
        one(c.copies),
    )?;
    counter(
        e,
        "copied",
        "Bytes copied to the SSD cache, by where they came from: the network, or a multi-node job's parent node.",
        bytes,
        vec![
            (
                vec![("from", "network".to_owned())],
                c.copied_bytes.saturating_sub(c.copied_from_peers_bytes),
            ),
            (vec![("from", "peer".to_owned())], c.copied_from_peers_bytes),
        ],
    )?;
    family(
        e,
        "peer_wait",
        "Seconds copies spent on a multi-node job's parent node (waiting for it and receiving).",
        Some(&Unit::Seconds),
        vec![(
            Vec::new(),
            ConstCounter::new(c.peer_wait_ms as f64 / 1000.0),
        )],
    )?;
    counter(
        e,
        "copy_failures",
        "Copies that did not land, by reason.",
        None,
        COPY_FAILURES
            .iter()
            .map(|r| {
                let n = c.copy_failures_by_reason.get(*r).copied().unwrap_or(0);
                (vec![("reason", (*r).to_owned())], n)
            })
            .collect(),
    )?;
    counter(
        e,
        "invalidations",
        "Copies and snapshots dropped because the network file changed.",
        None,
        one(c.invalidations),
    )?;
    counter(
        e,
        "evictions",
        "Copies dropped to make room or because they left the working set.",
        None,
        one(c.evictions),
    )?;
    counter(
        e,
        "partial_trimmed",
        "Bytes of partial copies punched out, coldest chunks first, to keep the cache within the SSD budget.",
        bytes,
        one(c.partial_bytes_trimmed),
    )?;
    counter(
        e,
        "cache_full",
        "Times the cache filesystem was found full.",
        None,
        one(c.cache_full_events),
    )?;
    counter(
        e,
        "prefetches",
        "Prefetches asked for.",
        None,
        one(c.prefetches),
    )?;
    gauge(
        e,
        "prefetch_remaining_files",
        "Copies and snapshots the prefetches under way still wait for.",
        None,
        g(c.prefetch_remaining_files as u64),
    )?;
    gauge(
        e,
        "prefetch_remaining",
        "Bytes the prefetches under way still wait for.",
        bytes,
        g(c.prefetch_remaining_bytes),
    )?;
    gauge(
        e,
        "jobs_running",
        "hocus-agent run jobs running.",
        None,
        g(c.jobs_running as u64),
    )?;
    counter(
        e,
        "jobs_started",
        "hocus-agent run jobs started.",
        None,
        one(c.jobs_started),
    )
}

/// One sample per row and per value `pick` gives of its counts, labelled with the row's
/// labels and `label` = that value's name.
fn split<'a>(
    rows: &[(Labels<'a>, &Served)],
    label: &'static str,
    pick: &dyn Fn(&Served) -> Vec<(&'static str, u64)>,
) -> Vec<(Labels<'a>, u64)> {
    rows.iter()
        .flat_map(|(labels, s)| {
            pick(s).into_iter().map(move |(value, n)| {
                let mut l = labels.clone();
                l.push((label, value.to_owned()));
                (l, n)
            })
        })
        .collect()
}

/// Who served what, per row (a watched tree, a Slurm job): opens, failed lookups and
/// bytes read, as the families `{prefix}opens`, `{prefix}failed_lookups`, `{prefix}read`;
/// `whose` completes their help ("of watched files" ...).
fn served_families(
    e: &mut DescriptorEncoder,
    prefix: &str,
    whose: &str,
    rows: &[(Labels<'_>, &Served)],
) -> std::fmt::Result {
    let by = |label, pick: &dyn Fn(&Served) -> Vec<(&'static str, u64)>| split(rows, label, pick);
    counter(
        e,
        &format!("{prefix}opens"),
        &format!(
            "Opens of watched files{whose}, by who served them: a local copy (hit) or the network (miss)."
        ),
        None,
        by("served", &|s| {
            vec![("local", s.opens_local), ("network", s.opens_network)]
        }),
    )?;
    counter(
        e,
        &format!("{prefix}failed_lookups"),
        &format!(
            "Lookups of names that do not exist{whose}, by who answered: a snapshot (local) or the network."
        ),
        None,
        by("answered", &|s| {
            vec![("local", s.lookups_local), ("network", s.lookups_network)]
        }),
    )?;
    counter(
        e,
        &format!("{prefix}read"),
        &format!(
            "Bytes read from watched files{whose}, by where they came from: a pinned local copy (ram), another local copy (ssd), or the network."
        ),
        Some(&Unit::Bytes),
        by("served", &|s| {
            vec![
                ("ram", s.read_ram),
                ("ssd", s.read_ssd),
                ("network", s.read_network),
            ]
        }),
    )
}

/// Hits and misses: what local copies served, per watched tree.
fn served(e: &mut DescriptorEncoder, c: &CacheStatus) -> std::fmt::Result {
    let rows: Vec<_> = c.served.iter().map(|s| (root(&s.root), s)).collect();
    served_families(e, "", "", &rows)?;
    counter(
        e,
        "job_opens",
        "Opens of watched files by processes of hocus-agent run jobs.",
        None,
        c.served
            .iter()
            .map(|s| (root(&s.root), s.job_opens))
            .collect(),
    )
}

/// The last Slurm jobs attached on this node (at most `SLURM_JOBS_SHOWN`: the labels are
/// bounded), and what was served to each.
fn slurm_jobs(e: &mut DescriptorEncoder, c: &CacheStatus) -> std::fmt::Result {
    let job = |j: &SlurmJob| vec![("job", j.job_id.to_string())];
    gauge(
        e,
        "slurm_job_tasks_running",
        "Tasks of each of the last Slurm jobs attached on this node that are running.",
        None,
        c.slurm_jobs
            .iter()
            .map(|j| (job(j), j.tasks_running as i64))
            .collect(),
    )?;
    let rows: Vec<_> = c.slurm_jobs.iter().map(|j| (job(j), &j.served)).collect();
    served_families(e, "slurm_job_", " by each of the last Slurm jobs", &rows)
}
