//! hocus's kernel side: syscall tracepoints that see opens, failed lookups, reads and
//! mutations on watched paths.
//!
//! Five programs, each attached to several tracepoints and driven by `SYSCALLS`, a table
//! indexed by syscall number that the agent fills from the tracefs `format` files:
//!
//! - `path_enter` (sys_enter_open*, stat*, access*, unlink*, rename*, mkdir*, ...): stash the
//!   path pointers and flags per thread;
//! - `path_exit`: read the path, keep it only if it is on a watched prefix (or relative to a
//!   watched directory), and report opens, ENOENT lookups and successful mutations;
//! - `fd_enter` (read*, write*, ftruncate, close): act only on descriptors of watched files;
//! - `fd_exit` (read*, write*, ftruncate): add the bytes read to the open file, in the
//!   kernel, and report a write or truncate only once it succeeded;
//! - chdir (a path syscall) and fchdir (a descriptor one) update `CWD`, where each
//!   process's working directory is relative to the watched trees;
//! - `process_fork`, `process_exit` (sched tracepoints): children inherit their parent's
//!   `CWD`, so relative paths are placed without asking the agent.
//!
//! Activity outside watched paths never reaches the ring buffer. Whatever cannot be
//! delivered is counted in `COUNTERS`.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod programs;

/// The license the kernel reads from the object: GPL-compatible, as the helpers that read
/// user memory (`bpf_probe_read_user*`) require. This crate is MIT or GPL-2.0.
#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!("hocus-ebpf builds for the bpf target only; hocus-agent embeds it.");
}
