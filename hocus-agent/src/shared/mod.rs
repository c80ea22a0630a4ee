//! The ground floor: what several stages and faces share, and nothing else. The running
//! kernel and the ways hocus takes on it (`kernel`), the settings
//! (flags and config file), sizes as people write them, the per-file log lines, munge
//! credentials, what the two ends of the relay between a job's nodes agree on (`relay`,
//! and `relay_checks` for what a child asks besides files),
//! giving freed memory back, replacing a file whole (`replace`), log lines of one cause
//! summed up (`tally`), the events a fanotify group reads (`fanotify`), the machine's
//! processes (`procs`), what the daemon asks of the file servers (`asked`); and the
//! safe-file primitives every stage works with as root: opening a directory and what lies beneath
//! it without following symlinks (`dirs`), a watched tree held open (`tree`), a file's
//! identity (`identity`), users' credentials taken on one thread (`user`), and the
//! owner, times and xattrs a local stand-in keeps (`attrs`).
//!
//! May use: `hocus-control` only (nothing of the crate above it).

pub mod asked;
pub mod attrs;
pub mod dirs;
pub mod fanotify;
pub mod identity;
pub mod kernel;
pub mod log_line;
pub mod memory;
pub mod munge;
pub mod procs;
pub mod relay;
pub mod relay_checks;
pub mod replace;
pub mod settings;
pub mod size;
pub mod tally;
pub mod tree;
pub mod user;
