//! floor, on `tp_btf/sys_exit`: returns at once. Only `cargo xtask bench overhead`
//! attaches it (`hocus-agent trace-floor`), to measure what any program there costs the
//! node, whatever it does.

use aya_ebpf::{macros::btf_tracepoint, programs::BtfTracePointContext};

#[btf_tracepoint(function = "sys_exit")]
pub fn floor(_ctx: BtfTracePointContext) -> i32 {
    0
}
