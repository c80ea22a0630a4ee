//! The syscall a task is in: what its number means (`SYSCALLS`, filled by the agent
//! from the tracefs formats) and its arguments, read from its saved registers.

use aya_ebpf::{helpers::bpf_probe_read_user, macros::map, maps::Array};
use hocus_common::{AT_FDCWD, MAX_SYSCALL_NR, NO_FIELD, SyscallLayout, flags_from, op};

use crate::{
    agent::global,
    kernel::{
        Typed, offset, regs_args,
        task::{is_compat, syscall_regs},
    },
};

const O_CREAT: u32 = 0o100;
const O_WRONLY: u32 = 0o1;
const O_TRUNC: u32 = 0o1000;

/// What each syscall number means (`hocus_common::op`) and which arguments matter,
/// filled by the agent from the tracefs formats.
#[map]
pub static SYSCALLS: Array<SyscallLayout> = Array::with_max_entries(MAX_SYSCALL_NR, 0);

/// What the syscall numbered `nr` means, if it is traced.
pub fn layout(nr: i64) -> Option<&'static SyscallLayout> {
    if !(0..MAX_SYSCALL_NR as i64).contains(&nr) {
        return None; // -1 (no syscall), or an x32 number
    }
    let layout = SYSCALLS.get(nr as u32)?;
    if layout.op == op::NONE {
        return None;
    }
    Some(layout)
}

/// A syscall's six arguments, read from its saved registers at once: six plain loads
/// at constant offsets, which the verifier checks against `struct pt_regs`.
pub struct Args([u64; 6]);

impl Args {
    pub fn of(regs: Typed) -> Self {
        let at = |register: &u32| regs.read::<u64>(global(register));
        let r = regs_args();
        Self([
            at(&r[0]),
            at(&r[1]),
            at(&r[2]),
            at(&r[3]),
            at(&r[4]),
            at(&r[5]),
        ])
    }

    /// The argument at `position` (`NO_FIELD`: none).
    pub fn get(&self, position: u16) -> Option<u64> {
        if position == NO_FIELD {
            return None;
        }
        self.0.get(usize::from(position)).copied()
    }

    /// A directory descriptor argument; `AT_FDCWD` for syscalls that have none.
    pub fn dfd(&self, position: u16) -> i32 {
        self.get(position).map_or(AT_FDCWD, |d| d as i32)
    }
}

/// An open's flags: an argument, or in the `struct open_how` an argument points to.
pub fn open_flags(args: &Args, l: &SyscallLayout) -> u32 {
    match l.flags_from {
        flags_from::ARG => args.get(l.flags).unwrap_or(0) as u32,
        flags_from::OPEN_HOW => args.get(l.flags).map_or(0, |how| {
            // SAFETY: user pointer, read with the helper that tolerates faults.
            unsafe { bpf_probe_read_user(how as *const u64) }.unwrap_or(0) as u32
        }),
        flags_from::CREAT => O_CREAT | O_WRONLY | O_TRUNC,
        _ => 0,
    }
}

/// The syscall the current task is in, if traced, and its arguments, from its saved
/// registers (`syscall_regs`): for a program that runs inside a syscall, not at its
/// exit. None for a 32-bit one (its registers mean something else).
pub fn current() -> Option<(&'static SyscallLayout, Args)> {
    if is_compat() {
        return None;
    }
    let regs = syscall_regs()?;
    let l = layout(regs.read(offset(|o| &o.regs_nr)))?;
    Some((l, Args::of(regs)))
}

/// Whether a syscall (`l`, with `args`) is an open that may create its file (`O_CREAT`).
pub fn opens_to_create(l: &SyscallLayout, args: &Args) -> bool {
    l.op == op::OPEN && open_flags(args, l) & O_CREAT != 0
}
