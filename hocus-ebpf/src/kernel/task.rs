//! The current task: its working directory, its root, its mount namespace, whether the
//! syscall it is in is a 32-bit one, and whether its thread group is gone.

use hocus_common::NamespaceKey;

use super::{
    Typed, current_task,
    files::{Dentry, Mount},
    offset,
};

/// x86-64's `thread_info.status` bit for a 32-bit syscall in progress.
const TS_COMPAT: u32 = 0x0002;

/// The current task's saved registers: the syscall it is in (`bpf_task_pt_regs`,
/// 5.15; typed tasks only, where the request programs run).
pub fn syscall_regs() -> Option<Typed> {
    let task = current_task();
    // SAFETY: a typed task, as the helper takes.
    let regs = unsafe { aya_ebpf::helpers::generated::bpf_task_pt_regs(task.0 as *mut _) };
    (regs != 0).then_some(Typed(regs as u64))
}

/// Whether the current syscall is a 32-bit one (`int 0x80` or a 32-bit process): its
/// number and registers mean something else, so it is never read as a 64-bit one.
pub fn is_compat() -> bool {
    current_task().read::<u32>(offset(|o| &o.thread_status)) & TS_COMPAT != 0
}

/// The current process's working directory: the mount it was reached through, and its
/// dentry. Plain loads all the way.
pub fn cwd() -> Option<(Mount, Dentry)> {
    let fs = current_task().follow(offset(|o| &o.task_fs))?;
    // fs->pwd is a struct path: mnt then dentry (checked by the agent).
    let at = offset(|o| &o.fs_pwd_mnt);
    let mnt = fs.follow(at)?;
    Some((Mount::of(mnt), Dentry::of(Typed(fs.read(at + 8)))))
}

/// The current process's mount namespace (from its nsproxy) and root: what its absolute
/// paths mean; and the namespace's inode number, which the agent checks.
pub fn namespace_of(nsproxy: Typed) -> Option<(NamespaceKey, u32)> {
    let mnt_ns = nsproxy.follow(offset(|o| &o.nsproxy_mnt_ns))?;
    let key = NamespaceKey {
        namespace: mnt_ns.read(offset(|o| &o.mnt_ns_id)),
        root: root_dentry()?,
    };
    Some((key, mnt_ns.read(offset(|o| &o.mnt_ns_inum))))
}

pub fn nsproxy() -> Option<Typed> {
    current_task().follow(offset(|o| &o.task_nsproxy))
}

pub fn root_dentry() -> Option<u64> {
    let fs = current_task().follow(offset(|o| &o.task_fs))?;
    Some(fs.read(offset(|o| &o.fs_root_dentry)))
}

/// Whether the exiting current task was its thread group's last live thread: the group
/// count (`signal->live`) is taken down before `sched_process_exit`, so it reads 0 at
/// the last one's. For kernels whose record has no `group_dead`.
pub fn group_is_dead() -> bool {
    current_task()
        .follow(offset(|o| &o.task_signal))
        .is_some_and(|signal| signal.read::<i32>(offset(|o| &o.signal_live)) == 0)
}
