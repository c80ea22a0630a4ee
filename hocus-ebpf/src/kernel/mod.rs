//! Kernel objects, read at the offsets the agent found in the running kernel's BTF (Rust
//! eBPF has no CO-RE relocations): `OFFSETS`, set before loading. This is the one place
//! that knows the kernel's structs; a kernel whose structs differ is met here (the agent
//! fills the offsets, and the programs take the way it says).
//!
//! - this file: typed objects (`Typed`), objects known only by address (`field`), the
//!   current task;
//! - `files`: a descriptor's `struct file`, its mount and dentry, a dentry's parent and
//!   name, an inode's number;
//! - `requests`: a FUSE request and the path walk the current task is in;
//! - `nfs`: what the NFS client's hooked functions are given;
//! - `task`: the current task's working directory, root, mount namespace, whether its
//!   syscall is a 32-bit one, and whether its thread group is gone.

pub mod files;
pub mod nfs;
pub mod requests;
pub mod task;

use aya_ebpf::{helpers::generated, macros::map, maps::PerCpuArray};
use hocus_common::KernelOffsets;

use crate::agent::global;

/// Where the kernel keeps the fields read below, from its BTF.
#[unsafe(no_mangle)]
static OFFSETS: KernelOffsets = KernelOffsets {
    task_files: 0,
    task_fs: 0,
    task_nsproxy: 0,
    files_fdt: 0,
    fdt_fd: 0,
    file_mnt: 0,
    fs_pwd_mnt: 0,
    fs_root_dentry: 0,
    dentry_parent: 0,
    dentry_name_len: 0,
    dentry_name: 0,
    vfsmount_root: 0,
    sb_root: 0,
    sb_dev: 0,
    nsproxy_mnt_ns: 0,
    mnt_ns_id: 0,
    mnt_ns_inum: 0,
    file_pos: 0,
    regs_nr: 0,
    thread_status: 0,
    dentry_inode: 0,
    dentry_sb: 0,
    inode_ino: 0,
    task_signal: 0,
    signal_live: 0,
    regs_args: [0; 6],
    file_pointer_type: 0,
};

/// Whether the kernel hands out the current task typed (`bpf_get_current_task_btf`,
/// 5.11): the task and the structs it points to are then read with plain loads; else
/// (5.10) each field with the helper. Set by the agent: a constant to the verifier, which
/// never looks at the other way (nor at the helper this kernel lacks).
#[unsafe(no_mangle)]
static TYPED_TASK: u32 = 1;

fn typed_task() -> bool {
    global(&TYPED_TASK) != 0
}

/// Where a typed pointer is written and read back as a plain number (`Typed::address`).
#[map]
static ADDRESS: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// The offset `f` picks from `OFFSETS`.
pub fn offset(f: fn(&KernelOffsets) -> &u32) -> u32 {
    global(f(&OFFSETS))
}

/// Where the saved registers hold a syscall's arguments, by position: each read with
/// `global`, a constant to the verifier.
pub fn regs_args() -> &'static [u32; 6] {
    &OFFSETS.regs_args
}

/// A kernel object whose type the verifier knows from BTF: the tracepoint's arguments,
/// the current task, and the struct pointers in their fields. Its fields are read with
/// plain loads (with the helper on a kernel that cannot type the task, `TYPED_TASK`), which the JIT guards against faults (a null or stale pointer reads
/// zeros), instead of a helper call each: every syscall on the node pays for what is
/// read before it is turned away. The offsets are read-only data, constants to the
/// verifier, which checks each load against the kernel's types. Anything else (the
/// address in a pointer to pointers, or got through the helper) is only a number to
/// the verifier: it is typed with `files::cast` where the kernel can, else read with
/// `field`.
#[derive(Clone, Copy)]
pub struct Typed(pub u64);

impl Typed {
    /// The field `offset` bytes in; zeros if it cannot be read, as a plain load through a
    /// bad pointer reads.
    pub fn read<T: Copy>(self, offset: u32) -> T {
        if !typed_task() {
            // SAFETY: integers and arrays of them only; all zeros is one.
            return field(self.0, offset).unwrap_or(unsafe { core::mem::zeroed() });
        }
        // SAFETY: see the type.
        unsafe { core::ptr::read_volatile((self.0 + u64::from(offset)) as *const T) }
    }

    /// A field that points to a struct: typed too. None if null.
    pub fn follow(self, offset: u32) -> Option<Typed> {
        let p: u64 = self.read(offset);
        (p != 0).then_some(Typed(p))
    }

    /// The object's address as a plain number, which the verifier lets a program shift
    /// and mask (a filter slot) and hand to `field`, like any address got through the
    /// helper: written to a map and read back (maps keep no pointer types).
    pub fn address(self) -> u64 {
        let Some(slot) = ADDRESS.get_ptr_mut(0) else {
            return 0;
        };
        // SAFETY: per-CPU slot owned by this program run.
        unsafe {
            core::ptr::write_volatile(slot, self.0);
            core::ptr::read_volatile(slot)
        }
    }
}

/// Reads a field of a kernel object known only by its address, `offset` bytes into it.
pub fn field<T>(object: u64, offset: u32) -> Option<T> {
    if object == 0 {
        return None;
    }
    // SAFETY: the helper tolerates any address; a wrong one fails instead of faulting.
    unsafe { aya_ebpf::helpers::bpf_probe_read_kernel((object + u64::from(offset)) as *const T) }
        .ok()
}

/// The current task: typed where the kernel can (`TYPED_TASK`), else its address.
pub fn current_task() -> Typed {
    if !typed_task() {
        // SAFETY: no arguments.
        return Typed(unsafe { generated::bpf_get_current_task() });
    }
    // SAFETY: no arguments; the current task, typed.
    Typed(unsafe { generated::bpf_get_current_task_btf() } as u64)
}
