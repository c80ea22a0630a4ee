//! hocus's kernel side: a program at every syscall's exit that sees opens, failed
//! lookups, reads and mutations on watched mounts, and the tracepoints around it that
//! keep its tables.
//!
//! What is watched is decided by identity, not by the path a process typed: an opened
//! file (and the directory a relative path starts from) is placed by walking up its
//! dentries to one of the roots (a watched tree, or the cache's copies that hocus binds
//! over it) on a known superblock (`locate`). So a tree bound elsewhere in a container
//! counts, and a look-alike (a tmpfs mounted at the same path in a user namespace,
//! another daemon's mount of the same server) does not. Absolute paths of failed lookups
//! and mutations name no object; they are compared with the watched prefixes, and only
//! from mount namespaces whose paths mean what they mean to the agent (its own, its
//! jobs'; `paths`).
//!
//! Every syscall of every process passes through `syscall_exit`, so what is not traced
//! must cost next to nothing: a table indexed by syscall number that the agent fills says
//! in one lookup whether a syscall matters; a bitmap says whether the process is
//! followed (`follow`); arrays kept beside the hash maps turn away a read, a close or an
//! open that is not watched without a hash lookup (`open_files`, `locate`); and the
//! programs are BTF-typed where they can be, so kernel objects are read with plain loads
//! rather than helper calls (`kernel`).
//!
//! The layout, bottom up (each module uses only those above it in this list):
//! - `agent`: what the agent sets before loading (read-only globals) and who it is;
//! - `skip`: why a program run ends early, and the counters of what was lost;
//! - `kernel`: kernel objects read at offsets the agent found in the kernel's BTF (the
//!   task, its files, working directory and namespaces; files, dentries, mounts);
//! - `follow`: the processes `syscall_exit` follows, and the job each belongs to;
//! - `locate`: where a dentry lies: under which root, at which path;
//! - `emit`: events to the agent through the ring buffer;
//! - `paths`: where a path a process passed lies (relative, absolute, in a container);
//! - `syscall`: the syscall a task is in: what its number means, its arguments;
//! - `open_files`: watched descriptors and mapped files, with what was read;
//! - `tripwire`: the first use of a watched mount follows a process and wakes a resting
//!   `syscall_exit`;
//! - `hooks`: the programs, one file per hook: `syscall_exit` (`tp_btf/sys_exit`),
//!   `sched` (fork, exit), `filemap` (pages entering the page cache), `fuse` (requests
//!   to FUSE mounts), `fuse_learn` (jobs learned from those requests while
//!   `syscall_exit` rests, where the kernel types them), `nfs` (the NFS client's
//!   permission and attribute checks) and `floor` (the benchmark's empty program).
//!
//! A kernel variant of a hook (another attach point for older kernels, a filesystem's
//! own tracepoint) is a new file in `hooks/` built on the modules above; the agent picks
//! which to attach (docs/architecture.md).
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]

#[cfg(target_arch = "bpf")]
mod agent;
#[cfg(target_arch = "bpf")]
mod emit;
#[cfg(target_arch = "bpf")]
mod follow;
#[cfg(target_arch = "bpf")]
mod hooks;
#[cfg(target_arch = "bpf")]
mod kernel;
#[cfg(target_arch = "bpf")]
mod locate;
#[cfg(target_arch = "bpf")]
mod open_files;
#[cfg(target_arch = "bpf")]
mod paths;
#[cfg(target_arch = "bpf")]
mod skip;
#[cfg(target_arch = "bpf")]
mod syscall;
#[cfg(target_arch = "bpf")]
mod tripwire;

/// The license the kernel reads from the object: GPL-compatible, as the helpers that read
/// user memory (`bpf_probe_read_user*`) require. This crate is MIT or GPL-2.0.
#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

/// The kernel's verifier refuses a program with a reachable unbounded loop, so a panic
/// that could be reached makes loading fail loudly instead of being undefined behaviour.
#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    #[expect(clippy::empty_loop, reason = "a bpf program cannot abort; see above")]
    loop {}
}

#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!("hocus-ebpf builds for the bpf target only; hocus-agent embeds it.");
}
