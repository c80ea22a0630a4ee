//! hocus's kernel side: a program at every syscall's exit that sees opens, failed
//! lookups, reads and mutations on watched mounts.
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
//! Every syscall of every process passes through `syscall_exit`, so what is not traced
//! must cost next to nothing: `SYSCALLS`, a table indexed by syscall number that the
//! agent fills (which arguments matter), says in one lookup whether a syscall matters;
//! arrays kept beside the hash maps (`HELD`/`RELEASED`, `SUPERBLOCK_SLOTS`) turn away a
//! read, a close or an open that is not watched without a hash lookup; and the program
//! is BTF-typed (`tp_btf`), so the registers, the task and its working directory are
//! read with plain loads, not helper calls.
//!
//! - `syscall_exit` (`tp_btf/sys_exit`): with the arguments read from the saved
//!   registers: place what was opened, or where a path lies, and report opens, ENOENT
//!   lookups and successful mutations; add the bytes read to the open file, in the
//!   kernel; report a file's first write once it succeeded; forget a closed descriptor;
//!   make learned views stale after a mount; for the agent's own threads, answer
//!   `CALIBRATE` and take a job's new mount namespace as known. Nothing runs at a
//!   syscall's entry: that would be a second program run for every syscall on the node;
//! - `process_fork`, `process_exit` (sched tracepoints): a job's children stay in it;
//! - `filemap_add` (`filemap:mm_filemap_add_to_page_cache`): pages entering the page
//!   cache of mapped watched files;
//! - `floor`: returns at once (the benchmark's baseline; the daemon never attaches it).
//!
//! Nothing is stored for any syscall that is not on a watched file. Kernel structs are read at offsets the agent
//! found in the kernel's BTF (`OFFSETS`). Activity outside watched trees never reaches
//! the ring buffer. Whatever cannot be delivered is counted in `COUNTERS`.
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
