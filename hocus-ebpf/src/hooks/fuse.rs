//! fuse_request, on `fuse:fuse_request_send`: a request to a FUSE filesystem (sshfs ...),
//! made in the context of the process that needs it: a tripwire (`tripwire`), and the
//! mark that lets that thread's next path syscall be looked at (`follow::requested`).
//!
//! ```text
//! field:dev_t connection;                    offset:8;  size:4; signed:0;
//! field:uint64_t unique;                     offset:16; size:8; signed:0;
//! field:enum fuse_opcode opcode;             offset:24; size:4; signed:0;
//! ```

use aya_ebpf::{macros::tracepoint, programs::TracePointContext};

use crate::{agent::global, follow::requested, tripwire::tripped};

/// Offset of `connection` (the FUSE mount's device) in fuse_request_send records.
#[unsafe(no_mangle)]
static FUSE_CONNECTION_OFFSET: u32 = 8;

#[tracepoint]
pub fn fuse_request(ctx: TracePointContext) -> u32 {
    // SAFETY: the offset comes from the tracepoint's format file.
    if let Ok(dev) = unsafe { ctx.read_at::<u32>(global(&FUSE_CONNECTION_OFFSET) as usize) } {
        if let Some(thread) = tripped(dev) {
            requested(thread);
        }
    }
    0
}
