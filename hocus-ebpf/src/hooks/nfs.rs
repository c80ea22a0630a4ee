//! nfs_access, on `nfs:nfs_access_enter`: the kernel's NFS client checks a permission on
//! one of its inodes, in the context of the process that needs it. Every path walk
//! through an NFS directory checks it may search it, from the client's caches or not (a
//! cached failed lookup too), and opening the mount's root checks it may read it: a
//! tripwire (`tripwire`), and the mark that lets that thread's next path syscall be
//! looked at (`follow::requested`). Checked on Debian's 5.10, 6.1 and 6.12
//! (docs/kernels.md). A served job's path walks fire it too: it wakes only a rest with
//! no job running (`nfs_request` tells a served job's misses).
//!
//! ```text
//! field:dev_t dev;                           offset:8;  size:4; signed:0;
//! field:u32 fhandle;                         offset:12; size:4; signed:0;
//! field:u64 fileid;                          offset:16; size:8; signed:0;
//! ```

use aya_ebpf::{macros::tracepoint, programs::TracePointContext};

use crate::{agent::global, follow::requested, tripwire::tripped};

/// Offset of `dev` (the NFS mount's device) in nfs_access_enter records.
#[unsafe(no_mangle)]
static NFS_ACCESS_DEV_OFFSET: u32 = 8;

#[tracepoint]
pub fn nfs_access(ctx: TracePointContext) -> u32 {
    // SAFETY: the offset comes from the tracepoint's format file.
    if let Ok(dev) = unsafe { ctx.read_at::<u32>(global(&NFS_ACCESS_DEV_OFFSET) as usize) } {
        if let Some(thread) = tripped(dev, false) {
            requested(thread);
        }
    }
    0
}
