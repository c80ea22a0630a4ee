//! Bytes poured from a reader (a network file, a parent node's connection) into a
//! local file: holes where they read as zeros, and the BLAKE3 hash of what came, which
//! the job's other nodes check their copies against (docs/fanout.md).

use std::{
    fs::File,
    io::{self, Read, Seek, Write},
};

pub use crate::shared::relay::Hash;

/// What `pour` moved: the bytes, and their hash.
#[derive(Debug)]
pub struct Poured {
    pub bytes: u64,
    pub hash: Hash,
}

#[derive(Debug)]
pub enum PourError {
    Read(io::Error),
    Write(io::Error),
}

/// Copies `src` into `out`, leaving holes where the source reads as zeros: a sparse
/// file (a disk image, a preallocated dataset) costs the cache only its data. The copy
/// grows to its full length as it goes.
pub fn pour(src: impl Read, out: &mut File) -> Result<Poured, PourError> {
    const CHUNK: usize = 1 << 20;
    // One buffer per copying thread, kept: a fresh megabyte zeroed for each of thousands
    // of small files is most of what copying them costs the CPU.
    thread_local! {
        static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BUF.with(|b| {
        let mut buf = b.borrow_mut();
        if buf.len() < CHUNK {
            buf.resize(CHUNK, 0);
        }
        pour_with(src, out, &mut buf)
    })
}

fn pour_with(mut src: impl Read, out: &mut File, buf: &mut [u8]) -> Result<Poured, PourError> {
    let mut at = 0u64;
    let mut hasher = blake3::Hasher::new();
    loop {
        let n = match src.read(buf) {
            Ok(0) => {
                return Ok(Poured {
                    bytes: at,
                    hash: *hasher.finalize().as_bytes(),
                });
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(PourError::Read(e)),
        };
        let data = &buf[..n];
        hasher.update(data);
        if data.iter().all(|b| *b == 0) {
            // A hole: extend the copy without writing.
            out.set_len(at + n as u64).map_err(PourError::Write)?;
            out.seek(io::SeekFrom::Start(at + n as u64))
                .map_err(PourError::Write)?;
        } else {
            out.write_all(data).map_err(PourError::Write)?;
        }
        at += n as u64;
    }
}
