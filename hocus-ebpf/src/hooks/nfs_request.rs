//! nfs_lookup, nfs_create, nfs_atomic_open, nfs4_open, nfs_change: requests the kernel's
//! NFS client sends the server that read or change the mount, in the context of the
//! process that needs them (a write's flush too, or a writeback worker's). Beside
//! `nfs_access`, which fires on every path walk through the mount and so for a job
//! served from local copies too, these tell such a job's misses apart: while served
//! jobs run at rest, they alone wake `syscall_exit` (`tripwire::tripped`). A path walk's
//! revalidation of a name or of attributes the client holds is no news, and not hooked.
//! The same layouts on 5.10, 6.1 and 6.12 (the agent reads the offsets from the formats,
//! and attaches `nfs_change` only where `dev` is where it expects):
//!
//! ```text
//! nfs_lookup_enter:      field:unsigned long flags;  offset:8;  field:dev_t dev; offset:16;
//! nfs_create_enter:      field:unsigned long flags;  offset:8;  field:dev_t dev; offset:16;
//! nfs_atomic_open_enter: field:dev_t dev;            offset:20 (5.10), 24 (6.12);
//! nfs4:nfs4_open_file:   field:dev_t dev;            offset:24 (5.10), 32 (6.12);
//! nfs_setattr_enter, nfs_remove_enter, nfs_unlink_enter, nfs_mkdir_enter,
//! nfs_rmdir_enter, nfs_rename_enter, nfs_link_enter, nfs_symlink_enter,
//! nfs_initiate_write:    field:dev_t dev;            offset:8;
//! ```

use aya_ebpf::{macros::tracepoint, programs::TracePointContext};

use crate::{agent::global, tripwire::tripped};

/// Offsets of `dev` and `flags` in nfs_lookup_enter records.
#[unsafe(no_mangle)]
static NFS_LOOKUP_DEV_OFFSET: u32 = 16;
#[unsafe(no_mangle)]
static NFS_LOOKUP_FLAGS_OFFSET: u32 = 8;
/// Offset of `dev` in nfs_create_enter records.
#[unsafe(no_mangle)]
static NFS_CREATE_DEV_OFFSET: u32 = 16;
/// Offset of `dev` in nfs_atomic_open_enter records (NFSv4's opens of names the client
/// does not hold).
#[unsafe(no_mangle)]
static NFS_ATOMIC_OPEN_DEV_OFFSET: u32 = 20;
/// Offset of `dev` in nfs4:nfs4_open_file records (every NFSv4 open the server is
/// asked for).
#[unsafe(no_mangle)]
static NFS4_OPEN_DEV_OFFSET: u32 = 24;
/// Offset of `dev` in the records of the events `nfs_change` is attached to.
#[unsafe(no_mangle)]
static NFS_CHANGE_DEV_OFFSET: u32 = 8;

/// `LOOKUP_OPEN` and `LOOKUP_CREATE` (include/linux/namei.h, the same from 5.10 on): the
/// lookup is an open's or a create's, of a name the client does not hold.
const LOOKUP_OPEN_OR_CREATE: u64 = 0x100 | 0x200;

#[tracepoint]
pub fn nfs_lookup(ctx: TracePointContext) -> u32 {
    // SAFETY: the offsets come from the tracepoint's format file.
    let flags = unsafe { ctx.read_at::<u64>(global(&NFS_LOOKUP_FLAGS_OFFSET) as usize) };
    // A flag that cannot be read: news, as any request would be.
    let news = flags.map_or(true, |f| f & LOOKUP_OPEN_OR_CREATE != 0);
    trip(&ctx, &NFS_LOOKUP_DEV_OFFSET, news)
}

#[tracepoint]
pub fn nfs_create(ctx: TracePointContext) -> u32 {
    trip(&ctx, &NFS_CREATE_DEV_OFFSET, true)
}

#[tracepoint]
pub fn nfs_atomic_open(ctx: TracePointContext) -> u32 {
    trip(&ctx, &NFS_ATOMIC_OPEN_DEV_OFFSET, true)
}

#[tracepoint]
pub fn nfs4_open(ctx: TracePointContext) -> u32 {
    trip(&ctx, &NFS4_OPEN_DEV_OFFSET, true)
}

#[tracepoint]
pub fn nfs_change(ctx: TracePointContext) -> u32 {
    trip(&ctx, &NFS_CHANGE_DEV_OFFSET, true)
}

fn trip(ctx: &TracePointContext, dev_offset: &u32, news: bool) -> u32 {
    // SAFETY: the offset comes from the tracepoint's format file.
    if let Ok(dev) = unsafe { ctx.read_at::<u32>(global(dev_offset) as usize) } {
        let _ = tripped(dev, news);
    }
    0
}
