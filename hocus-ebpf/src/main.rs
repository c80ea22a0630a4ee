//! hocus's kernel side: syscall tracepoints that see opens, failed lookups, reads and
//! mutations on watched mounts.
//!
//! What is watched is decided by identity, not by the path a process typed: an opened
//! file (and the directory a relative path starts from) is placed by walking up its
//! dentries to one of `ROOTS` (a watched tree, or the cache's copies that hocus binds
//! over it) on a known superblock. So a tree bound elsewhere in a container counts, and
//! a look-alike (a tmpfs mounted at the same path in a user namespace, another daemon's
//! mount of the same server) does not. Absolute paths of failed lookups and mutations
//! name no object; they are compared with the watched prefixes, and only from mount
//! namespaces whose paths mean what they mean to the agent (its own, its jobs').
//!
//! Five programs, each attached to several tracepoints and driven by `SYSCALLS`, a table
//! indexed by syscall number that the agent fills from the tracefs `format` files:
//!
//! - `path_enter` (sys_enter_open*, stat*, access*, unlink*, rename*, mkdir*, ...): stash the
//!   path pointers and flags per thread;
//! - `path_exit`: place what was opened, or where the path lies, and report opens, ENOENT
//!   lookups and successful mutations; for the agent's own threads, answer `CALIBRATE`
//!   and take a job's new mount namespace as known;
//! - `fd_enter` (read*, write*, ftruncate, close): act only on descriptors of watched files;
//! - `fd_exit` (read*, write*, ftruncate): add the bytes read to the open file, in the
//!   kernel, and report a write or truncate only once it succeeded;
//! - `process_fork`, `process_exit` (sched tracepoints): a job's children stay in it.
//!
//! Kernel structs are read at offsets the agent found in the kernel's BTF (`OFFSETS`).
//! Activity outside watched trees never reaches the ring buffer. Whatever cannot be
//! delivered is counted in `COUNTERS`.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

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
