//! Why the daemon did not do what a client asked, in one value wherever it is decided (a
//! connection's thread, a job's session, the daemon's loop): the reason, a label for the
//! `status` counts and the `hocus_control_refused_total` metric (docs/metrics.md), and the
//! message the client reads, which says what to do.

use hocus_control::Response;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub reason: &'static str,
    pub message: String,
}

impl Refusal {
    pub fn new(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
        }
    }

    /// The answer the client reads.
    pub fn response(&self) -> Response {
        Response::Error {
            message: self.message.clone(),
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}
