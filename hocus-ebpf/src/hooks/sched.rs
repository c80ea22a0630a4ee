//! The sched tracepoints: a job's children stay in the job and followed processes'
//! children are followed (`process_fork`); a process or thread that exits is forgotten
//! (`process_exit`).

use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid, macros::tracepoint, programs::TracePointContext,
};

use crate::{
    agent::{global, self_tgid},
    follow::{JOBS, follow, in_followed, unfollow},
    kernel::task::group_is_dead,
    skip::{OrSkip, Step, finish},
};

/// Offsets of `parent_pid` and `child_pid` in sched_process_fork records.
#[unsafe(no_mangle)]
static FORK_PARENT_OFFSET: u32 = 12;
#[unsafe(no_mangle)]
static FORK_CHILD_OFFSET: u32 = 20;
/// Offset of `group_dead` in sched_process_exit records; `u32::MAX` where the record has
/// none (Debian's 5.10, 6.1 and 6.12 kernels): the group count is read instead.
#[unsafe(no_mangle)]
static EXIT_GROUP_DEAD_OFFSET: u32 = 32;

/// sched_process_fork: a job's children stay in the job.
///
/// ```text
/// field:unsigned short common_type;          offset:0;  size:2; signed:0;
/// field:unsigned char common_flags;          offset:2;  size:1; signed:0;
/// field:unsigned char common_preempt_count;  offset:3;  size:1; signed:0;
/// field:int common_pid;                      offset:4;  size:4; signed:1;
///
/// field:__data_loc char[] parent_comm;       offset:8;  size:4; signed:0;
/// field:pid_t parent_pid;                    offset:12; size:4; signed:1;
/// field:__data_loc char[] child_comm;        offset:16; size:4; signed:0;
/// field:pid_t child_pid;                     offset:20; size:4; signed:1;
/// ```
#[tracepoint]
pub fn process_fork(ctx: TracePointContext) -> u32 {
    finish(try_process_fork(&ctx));
    0
}

fn try_process_fork(ctx: &TracePointContext) -> Step {
    // SAFETY: offsets come from the tracepoint's format file.
    let parent: u32 = unsafe { ctx.read_at(global(&FORK_PARENT_OFFSET) as usize) }
        .ok()
        .or_skip()?;
    let child: u32 = unsafe { ctx.read_at(global(&FORK_CHILD_OFFSET) as usize) }
        .ok()
        .or_skip()?;
    // Whatever the agent forks is a job (its threads get harmless entries, dropped when
    // they exit); a job's children stay in it.
    let forker = (bpf_get_current_pid_tgid() >> 32) as u32;
    let job = if forker == self_tgid() {
        Some(parent)
    } else {
        // SAFETY: plain value copy.
        unsafe { JOBS.get(&forker).copied() }
    };
    if let Some(job) = job {
        let _ = JOBS.insert(&child, &job, 0);
        follow(child);
    } else if in_followed(forker) {
        follow(child);
    }
    Ok(())
}

/// sched_process_exit: forget the exiting thread's job, and stop following it; the
/// process too once its last thread is gone (`group_dead`, or the group count where the
/// record lacks it). The exiting task is the current one.
///
/// ```text
/// field:char comm[16];                       offset:8;  size:16; signed:0;
/// field:pid_t pid;                           offset:24; size:4;  signed:1;
/// field:int prio;                            offset:28; size:4;  signed:1;
/// field:bool group_dead;                     offset:32; size:1;  signed:0;
/// ```
#[tracepoint]
pub fn process_exit(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (thread, tgid) = (pid_tgid as u32, (pid_tgid >> 32) as u32);
    // Keyed by the exiting thread: a leader's entry, or one a thread got at its clone.
    let _ = JOBS.remove(&thread);
    if thread != tgid {
        unfollow(thread);
    }
    let at = global(&EXIT_GROUP_DEAD_OFFSET);
    let group_dead = if at == u32::MAX {
        group_is_dead()
    } else {
        // SAFETY: the offset comes from the tracepoint's format file.
        unsafe { ctx.read_at::<u8>(at as usize) }.is_ok_and(|d| d != 0)
    };
    if group_dead {
        unfollow(tgid);
    }
    0
}
