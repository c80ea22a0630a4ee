//! Stage **profile**: the working set (hot files in first-touch order, bytes read, failed
//! lookups, writes), its file format, and the state directory that keeps it across
//! restarts, and the staging of a profile taken in from outside. The model the other
//! stages read; `observe` writes into it.
//!
//! May use: `shared`.

pub mod extents;
pub mod format;
pub mod paths;
pub mod records;
pub mod shortlist;
pub mod staging;
pub mod store;
pub mod working_set;
