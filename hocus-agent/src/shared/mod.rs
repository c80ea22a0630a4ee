//! The ground floor: what several stages and faces share, and nothing else. The settings
//! (flags and config file), sizes as people write them, what `status` reports, and the
//! per-file log lines, munge credentials, giving freed memory back, and opening a
//! directory without following symlinks. Imports nothing of the crate above it.

pub mod dirs;
pub mod log_line;
pub mod memory;
pub mod munge;
pub mod settings;
pub mod size;
pub mod status;
