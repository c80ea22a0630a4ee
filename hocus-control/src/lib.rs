//! The contract of hocus-agent's control socket (`/run/hocus/agent.sock`), one typed
//! definition for every side that speaks it: the daemon, its command line, and the Slurm
//! plugin. A client sends one JSON request line (with descriptors, where the request
//! says), then reads JSON response lines: one, or progress, or a job's session.
//!
//! - `request`: what a client asks, and what it sends during a job's session;
//! - `response`: what the daemon answers;
//! - `status`: what `status` reports, and a prefetch's progress;
//! - `profile`: the profile format an export, an import or a prefetch carries.
//!
//! Anyone may connect; every request is answered according to the caller's credentials,
//! taken from the socket (docs/security.md). A field added here is a field of every side.

pub mod profile;
pub mod request;
pub mod response;
pub mod status;

pub use self::{
    request::{AttachTask, Forward, JobCommand, JobProfile, Request},
    response::Response,
};

/// Where the daemon listens unless told otherwise (`--socket`, the plugin's `socket=`).
pub const DEFAULT_SOCKET: &str = "/run/hocus/agent.sock";
/// A request line is at most this long (a run request carries its caller's environment).
pub const MAX_REQUEST_LINE: usize = 4 << 20;
/// A profile sent to the daemon is at most this large (a million files is ~250 MB).
pub const MAX_PROFILE_BYTES: u64 = 1 << 30;
