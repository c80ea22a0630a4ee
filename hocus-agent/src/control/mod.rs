//! Face **control**: the control socket. Its language (`protocol`), the daemon's side
//! (`server`: a thread per connection, requests handed to the daemon's loop through
//! `calls`; `session`: a job's, `hocus-agent run`'s or an attached Slurm task's;
//! `job_profiles`: a Slurm job's profile, kept as its user), the CLI's (`client`), and
//! the relay that serves a multi-node job's files to its other nodes (`fanout`).
//!
//! May use: the stages, `shared`.

pub mod calls;
pub mod client;
pub mod fanout;
pub mod job_profiles;
pub mod protocol;
pub mod server;
pub mod session;
