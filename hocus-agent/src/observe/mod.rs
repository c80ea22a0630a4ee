//! Stage **observe**: what processes do on the watched trees. Loads the eBPF programs
//! (`tracer`, with their kfunc calls made for this kernel in `kfuncs`), keeps the
//! processes they follow (`followed`), finds tracepoint field offsets (`tracefs`), kernel
//! struct field offsets (`btf`) and the syscalls to trace (`syscalls`), reads the mount
//! table (`mounts`), and turns the kernel's events into working-set updates, accesses
//! for the keeper and changes to invalidate (`events`).
//!
//! May use: `profile`, `shared`.

pub mod btf;
pub mod events;
pub mod followed;
pub mod kfuncs;
pub mod loader;
pub mod mounts;
pub mod places;
pub mod syscalls;
pub mod tracefs;
pub mod tracer;
pub mod views;
