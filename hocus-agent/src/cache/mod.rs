//! Stage **cache**: the local copies. The cache directory and its index (`directory`),
//! one file copied safely from the network (`copy`), a whole tree held as a snapshot
//! (`snapshot`), and copies pinned in RAM (`pins`). Each function here does one blocking
//! thing it is asked to; the daemon's keeper decides what.
//!
//! May use: `profile`, `shared`.

pub mod copy;
pub mod directory;
pub mod pins;
pub mod snapshot;
pub mod walk;
