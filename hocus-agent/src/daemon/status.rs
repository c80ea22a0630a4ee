//! What `status` shows (and the metrics are made of): the daemon's parts, each asked
//! for its own. The loop takes its own parts' figures; what the keeper says is waited
//! for by the future it returns, off the loop (a keeper busy with a million entries
//! never holds the loop up: it shows what it last published).

use std::{future::Future, path::PathBuf};

use hocus_control::status::{NfsOperations, ServerAsked, Status, TopFile};

use crate::{
    control::gate::Control,
    observe::mounts,
    shared::asked::{self, Purpose},
};

use super::Daemon;

impl Daemon {
    /// The status with its `top` hottest files: the loop's part now, the keeper's in
    /// the future returned.
    pub(super) fn status(&mut self, top: usize) -> impl Future<Output = Status> + 'static {
        let roots: Vec<PathBuf> = self.watched.iter().map(|w| w.path.clone()).collect();
        let (hottest, roots) = self.profiling.summary(top, &roots);
        let ws = &self.profiling.ws;
        let (files, missing, dirs) = ws.counts();
        let (profile_bytes, dropped) = (ws.heap_bytes() as u64, ws.dropped());
        let mut status = Status {
            pid: std::process::id(),
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_secs: self.started.elapsed().as_secs(),
            started_unix_secs: self.started_unix_secs,
            state_dir: self.opts.settings.state_dir(),
            metrics_addr: self.metrics_addr,
            watched: self.watched.clone(),
            roots,
            top: Vec::new(),
            files,
            missing,
            dirs,
            profile_bytes,
            max_profile_entries: self.opts.settings.max_profile_entries(),
            profile_entries_dropped: dropped,
            accesses_uncounted: self.keeper.accesses_dropped(),
            tally: self.tracing.observer.tally.clone(),
            kernel: self.tracing.counters(),
            last_save_error: self.profiling.last_save_error().map(str::to_owned),
            not_traced: self.tracing.tracer().skipped.clone(),
            cache: None,
            control: self
                .control
                .as_ref()
                .map(Control::status)
                .unwrap_or_default(),
            tracing: self.tracing.status(self.opts.settings.rest_after()),
            kernel_release: self.kernel_release.clone(),
            routes: self.routes.clone(),
            server: self.server_asked(),
            nfs_operations: self.nfs_operations(),
        };
        let keeper = self.keeper.clone();
        async move {
            let paths: Vec<String> = hottest.iter().map(|f| f.path.clone()).collect();
            let (cache, held) = match keeper.status(paths).await {
                Ok((cache, held)) => (Some(cache), held),
                Err(e) => {
                    log::debug!("status without the cache: {e}");
                    (None, Vec::new())
                }
            };
            // Held is "unknown" when the keeper was busy (a million entries placed).
            let held = held
                .into_iter()
                .chain(std::iter::repeat("unknown".to_owned()));
            status.cache = cache;
            status.top = hottest
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
            status
        }
    }
}

impl Daemon {
    /// Every purpose of every watched network tree, those never asked at 0: a series
    /// that appears only once counted reads as a step from nothing.
    fn server_asked(&self) -> Vec<ServerAsked> {
        let counts = asked::counts();
        let mut out = Vec::new();
        for w in self.watched.iter().filter(|w| w.network) {
            for purpose in Purpose::ALL {
                let c = counts
                    .iter()
                    .find(|(t, p, _)| *t == w.path && *p == purpose)
                    .map(|(_, _, c)| *c)
                    .unwrap_or_default();
                out.push(ServerAsked {
                    mount: w.path.clone(),
                    purpose: purpose.name().into(),
                    operations: c.operations,
                    bytes: c.bytes,
                });
            }
        }
        out
    }

    /// Each watched NFS tree's mount's own counts (the mount it lies on).
    fn nfs_operations(&self) -> Vec<NfsOperations> {
        let nfs: Vec<_> = self
            .watched
            .iter()
            .filter(|w| w.fs_type.starts_with("nfs"))
            .collect();
        if nfs.is_empty() {
            return Vec::new();
        }
        let stats = mounts::nfs_operations();
        nfs.iter()
            .filter_map(|w| {
                let (_, ops) = stats
                    .iter()
                    .filter(|(point, _)| w.path.starts_with(point))
                    .max_by_key(|(point, _)| point.as_os_str().len())?;
                Some(NfsOperations {
                    mount: w.path.clone(),
                    operations: ops.clone(),
                })
            })
            .collect()
    }
}
