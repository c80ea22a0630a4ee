//! Stage **observe**: what processes do on the watched trees. Loads the eBPF programs
//! (`tracer`; `loader` fits them to this kernel, with what `probe` finds it offers and
//! the instructions `rewrite` changes), keeps the processes they follow (`followed`),
//! finds tracepoint field offsets (`tracefs`), kernel struct field offsets (`btf`) and
//! the syscalls to trace (`syscalls`), knows which filesystems have a tripwire that sees
//! who uses them (`tripwires`), reads the mount table (`mounts`), and turns the
//! kernel's events into working-set updates, accesses for the keeper and changes to
//! invalidate (`events`), with the files a process that woke a resting tracer already
//! held (`held`).
//!
//! May use: `profile`, `shared`.

pub mod btf;
pub mod events;
pub mod followed;
pub mod held;
pub mod loader;
pub mod modules;
pub mod mounts;
pub mod nfs_hooks;
pub mod places;
pub mod probe;
pub mod rewrite;
pub mod syscalls;
pub mod tracefs;
pub mod tracer;
pub mod tripwires;
pub mod views;
