//! The sizes and mtimes of files newly seen, read on a thread of their own (a stat on a
//! network mount is a round trip), beneath their watched tree without following a
//! symlink. Requests wait for the answers pending before them (`requests`).

use std::{
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::mpsc as std_mpsc,
};

use tokio::sync::mpsc;

use crate::{
    profile::working_set::Attributes,
    shared::{
        asked::{Asking, Purpose},
        tree::Tree,
    },
};

/// A file stat'ed, with what was found (None: gone).
pub type Stat = (String, Option<Attributes>);

pub struct Stats {
    requests: std_mpsc::Sender<String>,
    results: mpsc::UnboundedReceiver<Stat>,
    /// Asked for and not answered yet.
    pending: usize,
}

impl Stats {
    /// Starts the thread that stats files under `trees`.
    pub fn start(trees: Vec<PathBuf>) -> std::io::Result<Self> {
        let (req_tx, req_rx) = std_mpsc::channel::<String>();
        let (res_tx, res_rx) = mpsc::unbounded_channel();
        std::thread::Builder::new()
            .name("hocus-stat".into())
            .spawn(move || {
                for path in req_rx {
                    if res_tx.send((path.clone(), stat(&trees, &path))).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Self {
            requests: req_tx,
            results: res_rx,
            pending: 0,
        })
    }

    pub fn ask(&mut self, path: String) {
        if self.requests.send(path).is_ok() {
            self.pending += 1;
        }
    }

    pub fn pending(&self) -> usize {
        self.pending
    }

    /// The next answer (never, while none is pending).
    pub async fn next(&mut self) -> Option<Stat> {
        let stat = self.results.recv().await?;
        self.pending -= 1;
        Some(stat)
    }
}

/// `path`'s size and mtime, read beneath its watched tree, following no symlink.
fn stat(trees: &[PathBuf], path: &str) -> Option<Attributes> {
    let p = Path::new(path);
    let tree = trees.iter().find(|t| p.starts_with(t))?;
    let _asking = Asking::begin(tree, Purpose::Profile);
    let m = Tree::open(tree).and_then(|t| t.stat(p)).ok()?;
    Some(Attributes {
        size: m.size(),
        mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
    })
}
