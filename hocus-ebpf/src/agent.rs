//! What the agent tells the programs before loading them (read-only globals, set with
//! aya's `set_global`, constants to the verifier) and through maps it fills: who it is,
//! how widely to follow processes, and its own mount namespace.

use aya_ebpf::{helpers::bpf_get_current_pid_tgid, macros::map, maps::Array};
use hocus_common::Home;

/// The agent's process: its own work (copies, checks) is not the workload.
#[unsafe(no_mangle)]
static SELF_TGID: u32 = 0;
/// Non-zero: `syscall_exit` follows every process, not only followed ones
/// (`--trace-every-process`, or a watched tree without a tripwire).
#[unsafe(no_mangle)]
static TRACE_EVERY_PROCESS: u32 = 0;
/// Non-zero: every watched tree has its tripwire attached (FUSE, NFS), so a path
/// syscall of a process at home reached a watched tree only if its thread tripped it (`follow::REQUESTED`); the others are turned away before their path is read.
#[unsafe(no_mangle)]
static PATHS_BY_REQUEST: u32 = 0;

/// The agent's own mount namespace (by its nsproxy) and root.
#[map]
pub static HOME: Array<Home> = Array::with_max_entries(1, 0);

/// Reads a global the loader may have rewritten; volatile keeps it from being
/// constant-folded at compile time.
pub fn global(value: &u32) -> u32 {
    // SAFETY: a plain static, read as it is in the loaded object.
    unsafe { core::ptr::read_volatile(value) }
}

pub fn self_tgid() -> u32 {
    global(&SELF_TGID)
}

pub fn traces_every_process() -> bool {
    global(&TRACE_EVERY_PROCESS) != 0
}

pub fn paths_by_request() -> bool {
    global(&PATHS_BY_REQUEST) != 0
}

/// The current thread and process, unless it is the agent's.
pub fn current() -> Option<(u64, u32)> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if tgid == self_tgid() {
        return None; // the agent's own work is not the workload
    }
    Some((pid_tgid, tgid))
}
