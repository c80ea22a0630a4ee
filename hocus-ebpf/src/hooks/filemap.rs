//! filemap_add, on `filemap:mm_filemap_add_to_page_cache`: a page (or a folio of
//! `1 << order` pages) entered a file's page cache. For a mapped watched file that is
//! what a job read by faulting it in (shared objects, `numpy.memmap`); for every other
//! file on the node it costs one lookup. The agent's own copies and pins are not the
//! workload. Where the pages lie in the file joins the file's run of grains (`ranges`).
//! A page read from a watched mount's server, whatever the filesystem, is
//! also a tripwire.
//!
//! ```text
//! field:unsigned long pfn;                   offset:8;  size:8; signed:0;
//! field:unsigned long i_ino;                 offset:16; size:8; signed:0;
//! field:unsigned long index;                 offset:24; size:8; signed:0;
//! field:dev_t s_dev;                         offset:32; size:4; signed:0;
//! field:unsigned char order;                 offset:36; size:1; signed:0;
//! ```

use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use hocus_common::InodeKey;

use crate::{
    agent::{current, global},
    open_files::{MAPPED, add_range},
    skip::{OrSkip, Step, finish},
    tripwire::tripped,
};

/// Offsets of `i_ino`, `s_dev` and `order` (`u32::MAX`: none) in
/// mm_filemap_add_to_page_cache records.
#[unsafe(no_mangle)]
static FILEMAP_INO_OFFSET: u32 = 16;
#[unsafe(no_mangle)]
static FILEMAP_DEV_OFFSET: u32 = 32;
#[unsafe(no_mangle)]
static FILEMAP_ORDER_OFFSET: u32 = 36;
#[unsafe(no_mangle)]
static FILEMAP_INDEX_OFFSET: u32 = 24;
/// log2 of the page size (set by the agent).
#[unsafe(no_mangle)]
static PAGE_SHIFT: u32 = 12;

#[tracepoint]
pub fn filemap_add(ctx: TracePointContext) -> u32 {
    finish(try_filemap_add(&ctx));
    0
}

fn try_filemap_add(ctx: &TracePointContext) -> Step {
    // SAFETY: offsets come from the tracepoint's format file.
    let key = InodeKey {
        dev: unsafe { ctx.read_at(global(&FILEMAP_DEV_OFFSET) as usize) }
            .ok()
            .or_skip()?,
        _pad: 0,
        ino: unsafe { ctx.read_at(global(&FILEMAP_INO_OFFSET) as usize) }
            .ok()
            .or_skip()?,
    };
    // Pages read from the server: news, whatever runs.
    let _ = tripped(key.dev, true);
    let mapped = MAPPED.get_ptr_mut(&key).or_skip()?;
    current().or_skip()?;
    // SAFETY: as above; `u32::MAX`: this kernel adds one page at a time.
    let order: u8 = match global(&FILEMAP_ORDER_OFFSET) {
        u32::MAX => 0,
        at => unsafe { ctx.read_at(at as usize) }.ok().or_skip()?,
    };
    let pages = 1u64 << (order & 31);
    // SAFETY: map value pointer; the add is atomic (faults on several CPUs at once).
    unsafe {
        core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
            &raw mut (*mapped).pages,
            pages,
        )
    };
    // SAFETY: as above.
    let index: u64 = unsafe { ctx.read_at(global(&FILEMAP_INDEX_OFFSET) as usize) }
        .ok()
        .or_skip()?;
    let shift = global(&PAGE_SHIFT) & 31;
    // SAFETY: map value pointer, valid for this program run.
    let (run, file_id) = unsafe { (&raw mut (*mapped).run, (*mapped).file_id) };
    add_range(run, file_id, index << shift, pages << shift);
    Ok(())
}
