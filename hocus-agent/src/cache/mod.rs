//! Stage **cache**: the local copies. The cache directory and its index (`directory`),
//! one file copied safely from the network (`copy`), a whole tree held as a snapshot
//! (`snapshot`), copies pinned in RAM (`pins`), bytes poured into a copy (`pour`), and a copy passed from a job's other node
//! (`relay`). Each function here does one blocking thing it is asked to; the daemon's
//! keeper decides what.
//!
//! May use: `profile`, `shared`.

pub mod copy;
pub mod directory;
pub mod partial;
pub mod pins;
pub mod pour;
pub mod relay;
pub mod snapshot;
pub mod walk;
