//! What `status` shows (and the metrics are made of): the daemon's parts, each asked
//! for its own.

use std::path::PathBuf;

use hocus_control::status::{Status, TopFile};

use crate::control::gate::Control;

use super::Daemon;

impl Daemon {
    pub(super) async fn status(&mut self, top: usize) -> Status {
        let ws = &self.profiling.ws;
        let (files, missing, dirs) = ws.counts();
        let roots: Vec<PathBuf> = self.watched.iter().map(|w| w.path.clone()).collect();
        let (hottest, roots) = ws.summary(top, &roots);
        let (profile_bytes, dropped) = (ws.heap_bytes() as u64, ws.dropped());
        let paths: Vec<String> = hottest.iter().map(|f| f.path.clone()).collect();
        let n = paths.len();
        let held = match n {
            0 => Vec::new(),
            _ => self
                .keeper
                .where_held(paths)
                .await
                // The keeper is busy (a million entries placed): not known this once.
                .unwrap_or_else(|_| vec!["unknown".into(); n]),
        };
        let cache = self.keeper.status().await;
        let cache = self.check(cache);
        let top = hottest
            .into_iter()
            .zip(held)
            .map(|(f, held)| TopFile {
                path: f.path,
                opens: f.opens,
                size: f.size,
                bytes_read: f.bytes_read,
                held,
            })
            .collect();
        Status {
            pid: std::process::id(),
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_secs: self.started.elapsed().as_secs(),
            started_unix_secs: self.started_unix_secs,
            state_dir: self.opts.settings.state_dir(),
            metrics_addr: self.metrics_addr,
            watched: self.watched.clone(),
            roots,
            top,
            files,
            missing,
            dirs,
            profile_bytes,
            max_profile_entries: self.opts.settings.max_profile_entries(),
            profile_entries_dropped: dropped,
            tally: self.tracing.observer.tally.clone(),
            kernel: self.tracing.counters(),
            last_save_error: self.profiling.last_save_error().map(str::to_owned),
            not_traced: self.tracing.tracer().skipped.clone(),
            cache,
            control: self
                .control
                .as_ref()
                .map(Control::status)
                .unwrap_or_default(),
            tracing: self.tracing.status(self.opts.settings.rest_after()),
            kernel_release: self.kernel_release.clone(),
            routes: self.routes.clone(),
        }
    }
}
