//! Face **control**: the control socket, whose wire is `hocus_control`'s. The daemon's
//! side: `server` (a thread per connection, admitted and counted by `gate`), requests
//! handed to the daemon's loop as `messages` through `calls`, refused with a `refusal`;
//! `session` (a job's: `hocus-agent run`'s, or an attached Slurm task's); `job_profiles`
//! (a Slurm job's profile, kept as its user). The CLI's side: `client`. And the relay
//! that serves a multi-node job's files to its other nodes (`relay`).
//!
//! May use: `redirect`, `cache`, `place`, `observe`, `profile`, `shared`.

pub mod calls;
pub mod client;
pub mod gate;
pub mod job_profiles;
pub mod messages;
pub mod refusal;
pub mod relay;
pub mod server;
pub mod session;
