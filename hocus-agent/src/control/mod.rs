//! Face **control**: the control socket. Its language (`protocol`), the daemon's side
//! (`server`: a thread per connection, requests handed to the daemon's loop) and the
//! CLI's (`client`).
//!
//! May use: the stages, `shared`.

pub mod client;
pub mod protocol;
pub mod server;
