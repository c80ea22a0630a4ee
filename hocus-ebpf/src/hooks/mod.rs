//! The programs, one file per hook. Each is a short entry point that runs a `try_*`
//! function returning a `Step` and ends it with `skip::finish` (which counts a loss).
//!
//! A kernel variant of a hook (another attach point, a filesystem's own tracepoint) is a
//! file of its own here, built on the modules below; the agent decides which to attach.

mod filemap;
mod floor;
mod fuse;
mod fuse_learn;
mod nfs;
mod nfs_learn;
mod nfs_request;
mod sched;
mod syscall_exit;
