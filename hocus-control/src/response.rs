//! What the daemon answers: JSON lines tagged by `response`.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{
    profile::Profile,
    status::{Progress, Refused, Status},
};

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "response", rename_all = "snake_case")]
pub enum Response {
    Status(Box<Status>),
    /// A part of an exported profile, in file order (the first carries the start); an
    /// export ends with `Exported`.
    Profile(Profile),
    /// The export is complete: so many entries were sent.
    Exported {
        files: usize,
        missing: usize,
        dirs: usize,
    },
    Imported {
        files: usize,
        missing: usize,
        /// Entries refused (at most `status::REFUSED_SHOWN`), and how many in all.
        #[serde(default)]
        refused: Vec<Refused>,
        #[serde(default)]
        refused_total: usize,
    },
    Progress(Progress),
    /// The job runs, as `pid`, with `binds` local copies in place.
    Started {
        pid: i32,
        binds: usize,
    },
    /// A job's profile was saved: where, and what it holds.
    Saved {
        path: PathBuf,
        files: usize,
        missing: usize,
    },
    /// The caller's namespace has `binds` local copies in place.
    Attached {
        binds: usize,
    },
    /// The job ended: its exit code, or the signal that ended it.
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
    },
    Error {
        message: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines the plugin reads, as the daemon writes them.
    #[test]
    fn responses_read_as_the_daemon_writes_them() {
        for r in [
            Response::Attached { binds: 3 },
            Response::Saved {
                path: "/p/train.json".into(),
                files: 1,
                missing: 2,
            },
            Response::Progress(Progress {
                files_done: 1,
                files_total: 2,
                finished: true,
                ..Default::default()
            }),
            Response::Error {
                message: "no".into(),
            },
        ] {
            let line = serde_json::to_string(&r).unwrap();
            let back: Response = serde_json::from_str(&line).unwrap();
            assert_eq!(format!("{back:?}"), format!("{r:?}"));
        }
        let line = r#"{"response":"attached","binds":2}"#;
        assert!(matches!(
            serde_json::from_str::<Response>(line),
            Ok(Response::Attached { binds: 2 })
        ));
    }
}
