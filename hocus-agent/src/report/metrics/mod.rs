//! Prometheus metrics (docs/metrics.md): an HTTP server (axum) on the daemon's runtime
//! that asks the daemon's loop for its status at each scrape and encodes it with
//! prometheus-client (the families: `families`).
//!
//! prometheus-client writes OpenMetrics; a Prometheus server asks for that. Other clients
//! (curl, promtool) get the classic text format (0.0.4), where a counter's HELP and TYPE
//! carry its `_total` name.

mod families;

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context, Result};
use axum::{
    Router,
    extract::State,
    http::{HeaderMap, StatusCode, header},
    response::{Html, IntoResponse, Response},
    routing::get,
};
use hocus_control::status::Status;
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, oneshot};

use self::families::Snapshot;

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";
/// How long a scrape waits for the daemon's loop.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);
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
