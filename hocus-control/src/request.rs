//! What a client asks: one JSON line, tagged by `request`, with descriptors (SCM_RIGHTS)
//! where said; and the lines a `run` client sends while its job runs.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// What a client sends: one JSON line, with descriptors (SCM_RIGHTS) where said.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "request", rename_all = "snake_case")]
pub enum Request {
    Status,
    Export {
        root: Option<PathBuf>,
    },
    /// Merge the profile read from the one descriptor sent along (the client opened the
    /// file; the daemon never opens a path a user names).
    Import,
    /// Merge the profile read from the descriptor sent along and warm the cache from it
    /// now, reporting progress.
    Prefetch,
    /// Change the budgets of the running daemon (root only), in bytes.
    Budgets {
        ssd: Option<u64>,
        ram: Option<u64>,
    },
    /// Run a command in a namespace where local copies stand in for network files; the
    /// standard descriptors come along (SCM_RIGHTS).
    Run(JobCommand),
    /// Make the binds in the caller's own mount namespace (root only: hocus's Slurm
    /// plugin, as a task starts). The namespace is the connecting process's.
    Attach(AttachTask),
    /// Save a Slurm job's own working set for the user's next job with the same key
    /// (root only: the plugin, in the job's epilog).
    SaveJobProfile(JobProfile),
    /// Prefetch from the profile the user's last job with this key saved, reporting
    /// progress (root only: the plugin, in the job's prolog).
    PrefetchJobProfile(JobProfile),
}

impl Request {
    /// How many descriptors must come with the request: exactly these, no more.
    pub fn descriptors(&self) -> usize {
        match self {
            Request::Import | Request::Prefetch => 1,
            Request::Run(_) => 3,
            _ => 0,
        }
    }
}

/// What a job runs: its command line, environment and working directory (the caller's,
/// sent by `hocus-agent run`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobCommand {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: PathBuf,
}

/// Whose task asks to be attached, and of which job, as Slurm says: for the counts
/// and the job's profile (the binds are the same for everyone).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AttachTask {
    pub uid: u32,
    #[serde(default)]
    pub job_id: Option<u32>,
}

/// A Slurm job's profile: whose job, and under which key it is kept.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobProfile {
    pub job_id: u32,
    pub uid: u32,
    pub gid: u32,
    #[serde(default)]
    pub groups: Vec<u32>,
    pub key: String,
    /// The job's nodes as Slurm writes them (`SLURM_NODELIST`, e.g. `node[1-3]`) and
    /// this one's name: the prolog's prefetch then shares the working set among them.
    #[serde(default)]
    pub nodes: Option<String>,
    #[serde(default)]
    pub node: Option<String>,
}

/// A line the client of a job's session sends: a signal for the job.
#[derive(Debug, Serialize, Deserialize)]
pub struct Forward {
    pub signal: i32,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines every client writes, as the plugin and the command line write them.
    #[test]
    fn requests_read_as_clients_write_them() {
        let attach: Request =
            serde_json::from_str(r#"{"request":"attach","uid":1000,"job_id":7}"#).unwrap();
        assert!(matches!(
            attach,
            Request::Attach(AttachTask {
                uid: 1000,
                job_id: Some(7)
            })
        ));
        let save = Request::SaveJobProfile(JobProfile {
            job_id: 7,
            uid: 1000,
            gid: 100,
            groups: vec![100],
            key: "train".into(),
            nodes: Some("node[1-3]".into()),
            node: Some("node2".into()),
        });
        let line = serde_json::to_string(&save).unwrap();
        assert!(
            line.starts_with(r#"{"request":"save_job_profile","job_id":7"#),
            "{line}"
        );
        let back: Request = serde_json::from_str(&line).unwrap();
        assert!(matches!(back, Request::SaveJobProfile(j) if j.node.as_deref() == Some("node2")));
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"request":"import"}"#)
                .unwrap()
                .descriptors(),
            1
        );
        assert!(serde_json::from_str::<Request>(r#"{"request":"format_disk"}"#).is_err());
    }
}
