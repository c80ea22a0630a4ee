//! fuse_request, on `fuse:fuse_request_send`: a request to a FUSE filesystem (sshfs ...),
//! made in the context of the process that needs it: a tripwire (`tripwire`), and the
//! mark that lets that thread's next path syscall be looked at (`follow::requested`).
//!
//! ```text
//! field:dev_t connection;                    offset:8;  size:4; signed:0;
//! field:uint64_t unique;                     offset:16; size:8; signed:0;
//! field:enum fuse_opcode opcode;             offset:24; size:4; signed:0;
//! ```
//!
//! While jobs served from local copies run at rest, only a request that reads or
//! changes the mount wakes `syscall_exit` (`hocus_common::rest`).

use aya_ebpf::{macros::tracepoint, programs::TracePointContext};

use hocus_common::rest::reads_or_changes;

use crate::{agent::global, follow::requested, tripwire::tripped};

/// Offsets of `connection` (the FUSE mount's device) and `opcode` in fuse_request_send
/// records.
#[unsafe(no_mangle)]
static FUSE_CONNECTION_OFFSET: u32 = 8;
#[unsafe(no_mangle)]
static FUSE_OPCODE_OFFSET: u32 = 24;

#[tracepoint]
pub fn fuse_request(ctx: TracePointContext) -> u32 {
    // SAFETY: the offsets come from the tracepoint's format file.
    let dev = unsafe { ctx.read_at::<u32>(global(&FUSE_CONNECTION_OFFSET) as usize) };
    let opcode = unsafe { ctx.read_at::<u32>(global(&FUSE_OPCODE_OFFSET) as usize) };
    if let Ok(dev) = dev {
        // An opcode that cannot be read wakes, as any request would.
        let news = match opcode {
            Ok(opcode) => reads_or_changes(opcode),
            Err(_) => true,
        };
        if let Some(thread) = tripped(dev, news) {
            requested(thread);
        }
    }
    0
}
