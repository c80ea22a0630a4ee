//! Prometheus metrics (docs/metrics.md): an HTTP server (axum) on the daemon's runtime
//! that asks the daemon's loop for its status at each scrape and encodes it with
//! prometheus-client.
//!
//! prometheus-client writes OpenMetrics; a Prometheus server asks for that. Other clients
//! (curl, promtool) get the classic text format (0.0.4), where a counter's HELP and TYPE
//! carry its `_total` name.

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context, Result};
use axum::{
    Router,
    extract::State,
    http::{HeaderMap, StatusCode, header},
    response::{Html, IntoResponse, Response},
    routing::get,
};
use hocus_control::status::{CacheStatus, Served, SlurmJob, Status};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
    registry::{Registry, Unit},
};
use tokio::sync::{mpsc, oneshot};

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";
/// How long a scrape waits for the daemon's loop.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);
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
const COPY_FAILURES: [&str; 6] = [
    "changed",
    "no_space",
    "refused",
    "too_large",
    "read_error",
    "write_error",
];

/// Scrapes waiting for the daemon's loop: each gets the status of that moment.
pub type Scrapes = mpsc::Receiver<oneshot::Sender<Status>>;

/// Binds `addr` and serves /metrics from the daemon's own runtime (hyper, through axum).
/// Returns the bound address, and the scrapes the daemon's loop answers.
pub async fn serve(addr: SocketAddr) -> Result<(SocketAddr, Scrapes)> {
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| {
        format!(
            "cannot serve metrics on {addr}; choose another address with --metrics-addr, or turn metrics off with --no-metrics"
        )
    })?;
    let bound = listener.local_addr()?;
    // A few scrapes may wait while the loop is busy; more are refused with 503.
    let (scrapes, waiting) = mpsc::channel(4);
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/", get(index))
        .fallback(|| async { (StatusCode::NOT_FOUND, "try /metrics\n") })
        .with_state(scrapes);
    // axum's accept loop backs off on errors (out of descriptors) instead of spinning.
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            log::error!("the metrics server stopped: {e}");
        }
    });
    Ok((bound, waiting))
}

async fn index() -> Html<&'static str> {
    Html("<html><body><a href=\"/metrics\">hocus-agent metrics</a></body></html>\n")
}

/// A Prometheus server asks for OpenMetrics and gets it; anyone else gets the classic
/// text format.
async fn metrics(
    State(scrapes): State<mpsc::Sender<oneshot::Sender<Status>>>,
    headers: HeaderMap,
) -> Response {
    let openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    let (reply, status) = oneshot::channel();
    let status = match scrapes.try_send(reply) {
        Ok(()) => tokio::time::timeout(SCRAPE_TIMEOUT, status)
            .await
            .ok()
            .and_then(Result::ok),
        Err(_) => None,
    };
    let Some(status) = status else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "hocus-agent is busy or stopping; try again\n",
        )
            .into_response();
    };
    let text = render(status);
    let (kind, body) = if openmetrics {
        (OPENMETRICS, text)
    } else {
        (CLASSIC, classic(&text))
    };
    ([(header::CONTENT_TYPE, kind)], body).into_response()
}

/// OpenMetrics to the classic text format: counters are declared under their `_total`
/// name; UNIT and EOF lines go.
fn classic(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    let mut help: Option<&str> = None;
    for line in openmetrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        if line.starts_with("# HELP ") {
            help = Some(line);
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            let name = if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_owned()
            };
            if let Some(h) = help.take() {
                let text = h.splitn(4, ' ').nth(3).unwrap_or("");
                out.push_str(&format!("# HELP {name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The metrics page for a daemon status, in OpenMetrics.
pub fn render(status: Status) -> String {
    let mut registry = Registry::with_prefix("hocus");
    registry.register_collector(Box::new(Snapshot(status)));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .expect("writing to a String cannot fail");
    out
}

#[derive(Debug)]
struct Snapshot(Status);

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
            "1 while the syscall program is detached: nothing to learn for rest-after seconds and no job running.",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classic_format_declares_counters_by_their_total_name() {
        let om = "# HELP hocus_opens Opens.\n# TYPE hocus_opens counter\nhocus_opens_total{root=\"/a\"} 3\n# HELP hocus_cache Bytes.\n# TYPE hocus_cache gauge\n# UNIT hocus_cache bytes\nhocus_cache_bytes 5\n# EOF\n";
        assert_eq!(
            classic(om),
            "# HELP hocus_opens_total Opens.\n# TYPE hocus_opens_total counter\nhocus_opens_total{root=\"/a\"} 3\n# HELP hocus_cache Bytes.\n# TYPE hocus_cache gauge\nhocus_cache_bytes 5\n"
        );
    }
}
