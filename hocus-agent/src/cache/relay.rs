//! The asking end of the relay between the daemons of a job's nodes (docs/fanout.md):
//! this node's copies fetched from its parent node, checked against the network's file
//! and the first copy's hash. The vocabulary both ends share is `shared::relay`; the
//! serving end is `control::relay`.
//!
use std::{
    fs::File,
    io::{self, BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use super::pour::{PourError, Poured, pour};
use crate::shared::{
    munge,
    relay::{FILE, GREETING, NOT_HELD, Offer, WAIT, request},
};

/// A job's parent node, as this node's copies ask it: where it is, the payload of the
/// credentials that prove this node (one per connection), and whether it has failed
/// (then every copy goes to the network: its subtree falls back with it).
pub struct Parent {
    pub name: String,
    pub addr: SocketAddr,
    payload: String,
    munge_socket: Option<PathBuf>,
    timeout: Duration,
    failed: AtomicBool,
    idle: Mutex<Vec<TcpStream>>,
}

/// Why a copy did not come from the parent: the copy goes to the network instead.
#[derive(Debug, thiserror::Error)]
pub enum Miss {
    #[error("the parent does not hold it")]
    NotHeld,
    #[error("the parent's copy is not the network's file now")]
    Differs,
    #[error("the parent has failed before")]
    Failed,
    #[error("{0}")]
    Broken(String),
    /// Writing the copy failed: the cache's error, not the parent's.
    #[error("writing the copy failed: {0}")]
    Write(io::Error),
}

impl Parent {
    pub fn new(
        name: String,
        addr: SocketAddr,
        payload: String,
        munge_socket: Option<PathBuf>,
        timeout: Duration,
    ) -> Self {
        Self {
            name,
            addr,
            payload,
            munge_socket,
            timeout,
            failed: AtomicBool::new(false),
            idle: Mutex::new(Vec::new()),
        }
    }

    pub fn has_failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    /// Asks the parent for `source`, whose network file is now `size` bytes with
    /// `mtime_ns`, and pours its bytes into `out`, checked against the hash offered.
    pub fn fetch(
        &self,
        source: &Path,
        size: u64,
        mtime_ns: i64,
        out: &mut File,
    ) -> Result<Poured, Miss> {
        if self.has_failed() {
            return Err(Miss::Failed);
        }
        let mut stream = match self.idle.lock().ok().and_then(|mut i| i.pop()) {
            Some(s) => s,
            None => self.connect().map_err(|e| self.broken(e))?,
        };
        let offer = self.ask(&mut stream, source).map_err(|e| self.broken(e))?;
        let Some(offer) = offer else {
            self.give_back(stream);
            return Err(Miss::NotHeld);
        };
        if offer.size != size || offer.mtime_ns != mtime_ns {
            // The bytes that follow are not wanted: this connection is dropped.
            return Err(Miss::Differs);
        }
        let poured = pour((&mut stream).take(size), out).map_err(|e| match e {
            PourError::Read(e) => self.broken(e),
            PourError::Write(e) => Miss::Write(e),
        })?;
        if poured.bytes != size {
            return Err(self.broken(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{} of {size} bytes came", poured.bytes),
            )));
        }
        if poured.hash != offer.hash {
            return Err(self.broken(io::Error::other(
                "the bytes do not match the hash of the first copy",
            )));
        }
        self.give_back(stream);
        Ok(poured)
    }

    /// The parent failed: no more asking it during this prefetch.
    fn broken(&self, e: io::Error) -> Miss {
        let why = format!("{} ({}): {e}", self.name, self.addr);
        if !self.failed.swap(true, Ordering::Relaxed) {
            log::warn!("relay: parent node {why}; this node fetches the rest from the network");
        }
        Miss::Broken(why)
    }

    fn give_back(&self, stream: TcpStream) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(stream);
        }
    }

    fn connect(&self) -> io::Result<TcpStream> {
        let cred = munge::encode(&self.payload, self.munge_socket.as_deref())?;
        let mut stream = TcpStream::connect_timeout(&self.addr, self.timeout)?;
        stream.set_read_timeout(Some(self.timeout))?;
        stream.set_write_timeout(Some(self.timeout))?;
        stream.set_nodelay(true)?;
        stream.write_all(format!("{GREETING}\n{cred}\n").as_bytes())?;
        let mut answer = String::new();
        BufReader::new((&stream).take(1024)).read_line(&mut answer)?;
        match answer.trim_end() {
            "OK" => Ok(stream),
            no => Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("refused: {}", no.strip_prefix("NO ").unwrap_or(no)),
            )),
        }
    }

    /// Sends one request; the offer, or None if the parent does not hold the file. WAIT
    /// answers restart the timeout (the socket's), up to a minute in all.
    fn ask(&self, stream: &mut TcpStream, source: &Path) -> io::Result<Option<Offer>> {
        stream.write_all(&request(source))?;
        let started = Instant::now();
        loop {
            let mut status = [0u8; 1];
            stream.read_exact(&mut status)?;
            match status[0] {
                FILE => {
                    let mut b = [0u8; Offer::LEN];
                    stream.read_exact(&mut b)?;
                    return Ok(Some(Offer::decode(&b)));
                }
                NOT_HELD => return Ok(None),
                WAIT if started.elapsed() < Duration::from_secs(60) => continue,
                WAIT => return Err(io::Error::new(io::ErrorKind::TimedOut, "waited a minute")),
                other => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("unknown status {other}"),
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parent that answers one request with `offer` and `bytes`, and the Parent
    /// asking it (its connection made already: no munge here).
    fn parent_sending(offer: Offer, bytes: Vec<u8>) -> Parent {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut len = [0u8; 4];
            conn.read_exact(&mut len).unwrap();
            let mut path = vec![0u8; u32::from_be_bytes(len) as usize];
            conn.read_exact(&mut path).unwrap();
            conn.write_all(&[WAIT, FILE]).unwrap();
            conn.write_all(&offer.encode()).unwrap();
            let _ = conn.write_all(&bytes);
        });
        let parent = Parent::new(
            "node1".into(),
            addr,
            String::new(),
            None,
            Duration::from_secs(5),
        );
        parent.give_back(TcpStream::connect(addr).unwrap());
        parent
    }

    fn fetched(offer: Offer, bytes: &[u8], size: u64) -> (Result<Poured, Miss>, Vec<u8>, bool) {
        let parent = parent_sending(offer, bytes.to_vec());
        let dir = tempfile::tempdir().unwrap();
        let mut out = File::options()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(dir.path().join("copy"))
            .unwrap();
        let got = parent.fetch(Path::new("/net/f"), size, 7, &mut out);
        let written = std::fs::read(dir.path().join("copy")).unwrap();
        (got, written, parent.has_failed())
    }

    #[test]
    fn only_bytes_that_hash_to_the_first_copys_hash_are_taken() {
        let bytes = b"the first node's copy".to_vec();
        let size = bytes.len() as u64;
        let good = Offer {
            size,
            mtime_ns: 7,
            hash: *blake3::hash(&bytes).as_bytes(),
        };
        let (got, written, failed) = fetched(good, &bytes, size);
        assert!(got.is_ok() && written == bytes && !failed);
        // Corrupted on the way (or on the parent's disk): refused, the parent not asked
        // again; the caller (copy) deletes what was written.
        let mut corrupt = bytes.clone();
        corrupt[0] ^= 1;
        let (got, _, failed) = fetched(good, &corrupt, size);
        assert!(matches!(got, Err(Miss::Broken(_))) && failed, "{got:?}");
        // Cut short: refused.
        let (got, _, failed) = fetched(good, &bytes[..5], size);
        assert!(matches!(got, Err(Miss::Broken(_))) && failed, "{got:?}");
        // Another version than the network's now (size or mtime): not taken at all.
        let (got, written, failed) = fetched(good, &bytes, size + 1);
        assert!(matches!(got, Err(Miss::Differs)) && written.is_empty() && !failed);
    }
}
