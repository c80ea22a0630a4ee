//! The profile file format (docs/profile-format.md), the agent's side of it: its types are
//! the control contract's (`hocus_control::profile`), as exports and imports carry them;
//! here it is written part by part (`write`), read as a stream or from a file (`read`),
//! and checked before root takes a path from it (`checks`).

mod checks;
mod read;
mod write;

pub use hocus_control::profile::{
    DirEntry, Entry, FORMAT_VERSION, FileEntry, MissingEntry, Profile,
};

pub use self::{
    checks::{keep_valid, refuse_path},
    read::{Head, ReadError, read_exported, read_profile, read_stream, stream_exported},
    write::ProfileWriter,
};

/// The node whose cache held a Slurm job's files as its epilog saved the job's profile,
/// and the job: the next job's nodes may fetch those files from it first (docs/fanout.md).
/// Only a hint: the user can write the file, and the node named proves itself and every
/// file before anything is taken from it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Holder {
    pub node: String,
    pub job: u32,
}

/// A profile written whole, as a file holds it.
#[cfg(test)]
pub fn to_json(p: &Profile) -> Vec<u8> {
    let mut w = ProfileWriter::new(Vec::new());
    w.part(p).expect("in memory");
    w.finish().expect("in memory")
}
