//! Snapshots: a local copy of a network directory tree that is read-only in practice
//! (an environment's site-packages, a dataset). It holds every entry of the directories
//! jobs used, cold files too (a lazy snapshot as stubs), so a job whose namespace binds
//! it over the network directory gets its failed lookups answered locally as well: the
//! ENOENT probes of an import storm never leave the node. A lazy snapshot does not walk
//! directories no job used: those are passages, shown from the network itself.
//!
//! A snapshot is taken into a staging directory and renamed into place whole. Files
//! the cache already holds (same identity) are hard-linked (their pins then cover the
//! snapshot too); the others are copied like any file. Anything but directories, regular
//! files and symlinks makes the tree unsuitable. Its stamp (every entry's identity)
//! tells later whether the network tree is still the same.
//!
//! What a snapshot holds and where snapshots could go (`fill`), what the network tree was
//! (`stamp`), taking one (`take`), and a lazy one's stubs (`stub`).

mod fill;
mod stamp;
mod stub;
mod take;

pub use self::{
    fill::{Fill, Used, candidates, in_passage},
    stamp::{Stamp, stamp},
    stub::{is_stub, write_stub},
    take::{Limits, Taken, measure, take},
};
