//! The asking end of the relay between the daemons of a job's nodes (docs/fanout.md):
//! this node's copies fetched from its parent node, checked against the network's file
//! and the first copy's hash. The parent is proven first: its answer carries a munge
//! credential of root naming this job, both nodes and this node's own credential
//! (`shared::relay::proof`); the hash it offers proves nothing until then. The
//! vocabulary both ends share is `shared::relay`; the serving end is `control::relay`.

use std::{
    fs::File,
    io::{self, BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use super::{
    partial::{FillError, PartialCopy},
    pour::{PourError, Poured, pour},
};
use crate::shared::{
    munge,
    relay::{
        END_OF_RUNS, Entry, FILE, GREETING, Hash, JobUser, MAX_VOUCHED, NOT_HELD, NOT_VOUCHED,
        Offer, RANGES, RUN_GRAINS, VERDICTS, VOUCHED, Verdict, WAIT, grain_hash, parse_payload,
        proof, read_ages, read_run, read_verdicts, request, request_grains, request_verdicts,
        request_vouch, run,
    },
};
use hocus_common::ranges::{GRAIN, GRAIN_SHIFT};

/// How much longer than the time it allowed a child waits for its parent's vouching.
const VOUCH_MARGIN: Duration = Duration::from_millis(100);

/// What a node holds of a file another node of the job asks for.
#[derive(Debug, Clone)]
pub enum Holding {
    /// Its whole copy, valid when last checked.
    Copy(PathBuf),
    /// A partial copy, valid when last checked: the grains it holds are served.
    Partial(Arc<PartialCopy>),
    /// Not yet: a copy or a prefetch is under way.
    Coming,
    No,
}

/// The answer of a node holding `copy` to another asking for the grains `asked`: the
/// version its grains are of, then the runs it holds of them, each with its hashes.
pub fn send_grains(
    out: &mut impl Write,
    copy: &PartialCopy,
    asked: &[(u32, u32)],
) -> io::Result<()> {
    let (size, mtime_ns) = copy.offered();
    let mut head = vec![RANGES];
    head.extend(size.to_be_bytes());
    head.extend(mtime_ns.to_be_bytes());
    out.write_all(&head)?;
    copy.relay(asked, |start, hashes, bytes| {
        let mut head = run(start, start + hashes.len() as u32).to_vec();
        head.extend(hashes.iter().flatten());
        out.write_all(&head)?;
        out.write_all(bytes)
    })?;
    out.write_all(&END_OF_RUNS)
}

/// A job's parent node, as this node's copies ask it: where it is, the payload of the
/// credentials that prove this node (one per connection), and whether it has failed
/// (then every copy goes to the network: its subtree falls back with it).
#[derive(Debug)]
pub struct Parent {
    pub name: String,
    pub addr: SocketAddr,
    payload: String,
    munge_socket: Option<PathBuf>,
    timeout: Duration,
    failed: AtomicBool,
    /// Its verdicts of what the job's user may read could not be had: not asked again.
    no_verdicts: AtomicBool,
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
            no_verdicts: AtomicBool::new(false),
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
        let mut stream = self.held(&request(source), FILE)?;
        let mut b = [0u8; Offer::LEN];
        stream.read_exact(&mut b).map_err(|e| self.broken(e))?;
        let offer = Offer::decode(&b);
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

    /// Asks the parent for the grains `asked` (disjoint runs, as extents hold them: a
    /// run sent across two that touch is refused) of `source`, whose network file is now
    /// `size` bytes with `mtime_ns`, and gives those it holds to `put`, each run's bytes
    /// checked against the hashes it sent (made as the first node filled them from the
    /// network). The bytes taken; what the parent does not hold is the caller's to fill.
    pub fn fetch_grains(
        &self,
        source: &Path,
        (size, mtime_ns): (u64, i64),
        asked: &[(u32, u32)],
        mut put: impl FnMut(u32, &[Hash], &[u8]) -> Result<(), FillError>,
    ) -> Result<u64, Miss> {
        let mut stream = self.held(&request_grains(source, asked), RANGES)?;
        let mut version = [0u8; 16];
        stream
            .read_exact(&mut version)
            .map_err(|e| self.broken(e))?;
        let offered = (
            u64::from_be_bytes(version[..8].try_into().expect("8 bytes")),
            i64::from_be_bytes(version[8..].try_into().expect("8 bytes")),
        );
        if offered != (size, mtime_ns) {
            // The runs that follow are not wanted: this connection is dropped.
            return Err(Miss::Differs);
        }
        let grains = size.div_ceil(GRAIN).min(u64::from(u32::MAX)) as u32;
        let mut taken = 0;
        let mut buf = Vec::new();
        loop {
            let (start, end) = read_run(&mut stream).map_err(|e| self.broken(e))?;
            if (start, end) == (0, 0) {
                break;
            }
            let wanted = asked.iter().any(|&(s, e)| s <= start && end <= e);
            if start >= end || end - start > RUN_GRAINS || end > grains || !wanted {
                return Err(self.broken(io::Error::other(format!(
                    "grains [{start}, {end}) were not asked for"
                ))));
            }
            let mut hashes = vec![[0u8; 32]; (end - start) as usize];
            for h in &mut hashes {
                stream.read_exact(h).map_err(|e| self.broken(e))?;
            }
            let from = u64::from(start) << GRAIN_SHIFT;
            let to = (u64::from(end) << GRAIN_SHIFT).min(size);
            buf.resize((to - from) as usize, 0);
            stream.read_exact(&mut buf).map_err(|e| self.broken(e))?;
            let intact = buf
                .chunks(GRAIN as usize)
                .zip(&hashes)
                .all(|(g, h)| grain_hash(g) == *h);
            if !intact {
                return Err(self.broken(io::Error::other(
                    "grains do not match the hashes of their first fill",
                )));
            }
            put(start, &hashes, &buf).map_err(|e| match e {
                FillError::Local(e) => Miss::Write(e),
                other => Miss::Write(io::Error::other(other.to_string())),
            })?;
            taken += buf.len() as u64;
        }
        self.give_back(stream);
        Ok(taken)
    }

    /// Asks the parent to vouch for a job start's checks of `items` (network paths, and
    /// digests of what this node's copies expect there) within `allowed`: for each, how
    /// long before `asked` (when the request was sent) the parent's own check of the same
    /// expectation against the server began, or None where it does not vouch for it.
    pub fn vouch(
        &self,
        items: &[(&Path, Hash)],
        allowed: Duration,
    ) -> Result<(Instant, Vec<Option<Duration>>), Miss> {
        if self.has_failed() {
            return Err(Miss::Failed);
        }
        let asked = Instant::now();
        // A connection of its own: one kept since the prolog's prefetch may have been
        // closed by the parent as idle, which is no failure of the parent.
        let ages = self.connect(allowed).and_then(|mut stream| {
            let left = allowed.saturating_sub(asked.elapsed());
            // A moment past what is left: the parent answers what it checked by then.
            stream.set_read_timeout(Some(left + VOUCH_MARGIN))?;
            let status = self.ask(&mut stream, &request_vouch(left, items), VOUCHED)?;
            status.ok_or_else(|| io::Error::other("it does not vouch for job starts"))?;
            read_ages(&mut stream, items.len().min(MAX_VOUCHED))
        });
        let ages = ages.map_err(|e| {
            let why = format!("{} ({}): {e}", self.name, self.addr);
            if !self.failed.swap(true, Ordering::Relaxed) {
                log::warn!(
                    "relay: parent node {why}; this node checks the job's copies against the server itself"
                );
            }
            Miss::Broken(why)
        })?;
        let ages = ages
            .into_iter()
            .map(|a| (a != NOT_VOUCHED).then(|| Duration::from_millis(u64::from(a))))
            .collect();
        Ok((asked, ages))
    }

    /// Asks the parent for its verdicts of what the job's `user` may read of `items`
    /// (entries of the job's profile), as its own prolog found them, within `allowed`:
    /// for each, whether they may and how long before `asked` (when the request was
    /// sent) its check began, or None where it has no verdict. A parent that cannot
    /// answer (an older daemon, gone) is not asked again; its files are still fetched.
    pub fn verdicts(
        &self,
        user: &JobUser,
        items: &[(Entry, &str)],
        allowed: Duration,
    ) -> Option<(Instant, Vec<Verdict>)> {
        if self.has_failed() || self.no_verdicts.load(Ordering::Relaxed) {
            return None;
        }
        let asked = Instant::now();
        let verdicts = self.connect(self.timeout).and_then(|mut stream| {
            stream.set_read_timeout(Some(allowed + VOUCH_MARGIN))?;
            let status = self.ask(
                &mut stream,
                &request_verdicts(allowed, user, items),
                VERDICTS,
            )?;
            status.ok_or_else(|| io::Error::other("it gives no verdicts"))?;
            read_verdicts(&mut stream, items.len().min(MAX_VOUCHED))
        });
        match verdicts {
            Ok(v) => Some((asked, v)),
            Err(e) => {
                if !self.no_verdicts.swap(true, Ordering::Relaxed) {
                    log::warn!(
                        "relay: parent node {} ({}) gives no verdicts of what the job's user may read ({e}); this node checks them itself",
                        self.name,
                        self.addr
                    );
                }
                None
            }
        }
    }

    /// Sends `asked` (a request, encoded) on a connection to the parent; the connection
    /// once the parent answers `held` (what it holds follows). NotHeld if it does not
    /// hold the file (the connection is kept for the next).
    fn held(&self, asked: &[u8], held: u8) -> Result<TcpStream, Miss> {
        if self.has_failed() {
            return Err(Miss::Failed);
        }
        let mut stream = match self.idle.lock().ok().and_then(|mut i| i.pop()) {
            Some(s) => s,
            None => self.connect(self.timeout).map_err(|e| self.broken(e))?,
        };
        match self.ask(&mut stream, asked, held) {
            Ok(Some(())) => Ok(stream),
            Ok(None) => {
                self.give_back(stream);
                Err(Miss::NotHeld)
            }
            Err(e) => Err(self.broken(e)),
        }
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

    /// A connection to the parent, proven both ways, made within `within`.
    fn connect(&self, within: Duration) -> io::Result<TcpStream> {
        let cred = munge::encode(&self.payload, self.munge_socket.as_deref())?;
        let mut stream = TcpStream::connect_timeout(&self.addr, within)?;
        stream.set_read_timeout(Some(within))?;
        stream.set_write_timeout(Some(within))?;
        stream.set_nodelay(true)?;
        stream.write_all(format!("{GREETING}\n{cred}\n").as_bytes())?;
        let mut answer = String::new();
        let longest = (munge::MAX_CREDENTIAL + 8) as u64;
        BufReader::new((&stream).take(longest)).read_line(&mut answer)?;
        match answer.trim_end().split_once(' ') {
            Some(("OK", theirs)) => self.proven(&cred, theirs).map(|()| stream),
            Some(("NO", why)) => Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("refused: {why}"),
            )),
            _ => Err(self.unproven(format!(
                "answered {:?}, not a daemon's credential",
                answer.trim_end().chars().take(64).collect::<String>()
            ))),
        }
    }

    /// Whether `theirs`, the parent's answer to this node's credential `ours`, proves
    /// the parent: made by root, naming this job, the parent, this node and `ours`.
    fn proven(&self, ours: &str, theirs: &str) -> io::Result<()> {
        let (job, me, parent) = parse_payload(&self.payload)
            .ok_or_else(|| io::Error::other("this node's own payload is malformed"))?;
        let decoded =
            munge::decode(theirs, self.munge_socket.as_deref()).map_err(|e| self.unproven(e))?;
        if decoded.uid != 0 {
            return Err(self.unproven(format!(
                "its credential is uid {}'s, not root's: a user's program holds the relay's port there",
                decoded.uid
            )));
        }
        if decoded.payload != proof(job, &parent, &me, ours) {
            return Err(self.unproven(format!(
                "its credential is root's but says {:?}, not this job, these nodes and this connection",
                decoded.payload
            )));
        }
        Ok(())
    }

    /// The parent's answer does not prove it is the daemon of a node of the job.
    fn unproven(&self, why: String) -> io::Error {
        log::error!(
            "relay: what answers at {} ({}) is not proven to be that node's hocus daemon: {why}; nothing is taken from it, this node reads the job's files from the server",
            self.name,
            self.addr
        );
        io::Error::new(io::ErrorKind::PermissionDenied, format!("unproven: {why}"))
    }

    /// Sends one request (encoded); Some once the parent answers `held` (what it holds
    /// follows), None if it does not hold the file. WAIT answers restart the timeout (the
    /// socket's), up to a minute in all.
    fn ask(&self, stream: &mut TcpStream, asked: &[u8], held: u8) -> io::Result<Option<()>> {
        stream.write_all(asked)?;
        let started = Instant::now();
        loop {
            let mut status = [0u8; 1];
            stream.read_exact(&mut status)?;
            match status[0] {
                s if s == held => return Ok(Some(())),
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
        parent_answering(move |conn, _| {
            conn.write_all(&[WAIT, FILE]).unwrap();
            conn.write_all(&offer.encode()).unwrap();
            let _ = conn.write_all(&bytes);
        })
    }

    /// A parent that answers the first request as `answer` does, and the Parent asking it.
    fn parent_answering(
        answer: impl FnOnce(&mut TcpStream, crate::shared::relay::Asked) + Send + 'static,
    ) -> Parent {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let asked = crate::shared::relay::read_request(&mut conn)
                .unwrap()
                .unwrap();
            answer(&mut conn, asked);
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

    /// A network file of 4 MiB and 1000 bytes (65 grains, the last short), each byte
    /// saying where it is; a partial copy of it holding `held`, filled from it.
    fn network_and_partial(dir: &Path, name: &str, held: &[(u32, u32)]) -> Arc<PartialCopy> {
        let network = dir.join("network");
        if !network.exists() {
            let bytes: Vec<u8> = (0..(4 << 20) + 1000).map(|i| (i % 251) as u8 + 1).collect();
            std::fs::write(&network, bytes).unwrap();
        }
        let local = File::options()
            .create_new(true)
            .read(true)
            .write(true)
            .open(dir.join(name))
            .unwrap();
        let copy = PartialCopy::new(name.into(), File::open(&network).unwrap(), local).unwrap();
        let mut ranges = crate::profile::extents::Extents::default();
        for &(s, e) in held {
            ranges.add(s, e);
        }
        copy.fill_all(&ranges).unwrap();
        Arc::new(copy)
    }

    /// What `parent` passes on of the grains `asked` of version `version`, put into
    /// `into`.
    fn fetched_into(
        parent: &Parent,
        into: &PartialCopy,
        version: (u64, i64),
        asked: &[(u32, u32)],
    ) -> Result<u64, Miss> {
        let put = |s, h: &[Hash], b: &[u8]| into.put(s, h, b);
        parent.fetch_grains(Path::new("/net/f"), version, asked, put)
    }

    /// A parent holding `copy`, answering a request for grains as a node does.
    fn parent_holding(copy: Arc<PartialCopy>) -> Parent {
        parent_answering(move |conn, asked| {
            let crate::shared::relay::Asked::File(asked) = asked else {
                panic!("{asked:?}")
            };
            let _ = send_grains(conn, &copy, &asked.grains.unwrap());
        })
    }

    #[test]
    fn a_partial_copy_passes_on_the_grains_it_holds_with_their_hashes() {
        let dir = tempfile::tempdir().unwrap();
        let first = network_and_partial(dir.path(), "first", &[(16, 32), (48, 65)]);
        let second = network_and_partial(dir.path(), "second", &[]);
        let parent = parent_holding(first.clone());
        let got = fetched_into(&parent, &second, first.offered(), &[(0, 65)]);
        assert_eq!(got.unwrap(), first.held());
        assert_eq!(second.filled(), first.filled());
        let network = std::fs::read(dir.path().join("network")).unwrap();
        let copy = std::fs::read(dir.path().join("second")).unwrap();
        let (at, end) = (16 << 16, 32 << 16);
        assert_eq!(copy[at..end], network[at..end]);
        assert_eq!(
            copy[48 << 16..],
            network[48 << 16..],
            "the short last grain too"
        );
        assert!(copy[..at].iter().all(|b| *b == 0));
        // It passes them on in turn (a chain of nodes), with the hashes it was sent.
        let third = network_and_partial(dir.path(), "third", &[]);
        let got = fetched_into(
            &parent_holding(second.clone()),
            &third,
            second.offered(),
            &[(20, 50)],
        );
        assert_eq!(got.unwrap(), 14 << 16, "grains 20 to 32 and 48 to 50");
        // Runs asked again and again, overlapping, past the file's end: each grain held
        // is sent once.
        let fourth = network_and_partial(dir.path(), "fourth", &[]);
        let asked = [(0, 65), (10, 40), (0, 65), (60, 1000), (0, 65)];
        let got = fetched_into(
            &parent_holding(first.clone()),
            &fourth,
            first.offered(),
            &asked,
        );
        assert_eq!(got.unwrap(), first.held());
    }

    #[test]
    fn grains_that_do_not_read_as_they_were_filled_are_not_passed_on() {
        let dir = tempfile::tempdir().unwrap();
        let first = network_and_partial(dir.path(), "first", &[(16, 32), (48, 65)]);
        // A grain of the first run changed on the parent's disk (or punched: zeros).
        use std::os::unix::fs::FileExt;
        first.local().write_all_at(&[0u8; 100], 20 << 16).unwrap();
        let second = network_and_partial(dir.path(), "second", &[]);
        let got = fetched_into(
            &parent_holding(first.clone()),
            &second,
            first.offered(),
            &[(0, 65)],
        );
        assert_eq!(
            got.unwrap(),
            first.held() - (1 << 20),
            "its run is left out"
        );
        assert!(second.missing(16, 32) == vec![(16, 32)]);
        // Another version than the network's now: nothing taken.
        let third = network_and_partial(dir.path(), "third", &[]);
        let (size, mtime) = first.offered();
        let got = fetched_into(
            &parent_holding(first.clone()),
            &third,
            (size, mtime + 1),
            &[(0, 65)],
        );
        assert!(
            matches!(got, Err(Miss::Differs)) && third.held() == 0,
            "{got:?}"
        );
    }

    #[test]
    fn grains_that_do_not_match_their_hash_or_were_not_asked_for_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let first = network_and_partial(dir.path(), "first", &[(0, 2)]);
        let (size, mtime) = first.offered();
        let network = std::fs::read(dir.path().join("network")).unwrap();
        let grain = |g: usize| network[g << 16..(g + 1) << 16].to_vec();
        // A parent that sends run `[start, start + 1)` with `bytes` under the hash of
        // the network's grain 0.
        let lying = |start: u32, bytes: Vec<u8>| {
            let hash = grain_hash(&grain(0));
            parent_answering(move |conn, _| {
                let mut answer = vec![RANGES];
                answer.extend(size.to_be_bytes());
                answer.extend(mtime.to_be_bytes());
                answer.extend(run(start, start + 1));
                answer.extend(hash);
                answer.extend(bytes);
                answer.extend(END_OF_RUNS);
                let _ = conn.write_all(&answer);
            })
        };
        for (parent, why) in [
            (lying(0, vec![0u8; 1 << 16]), "bytes other than hashed"),
            (lying(5, grain(0)), "a grain not asked for"),
        ] {
            let second = network_and_partial(dir.path(), &format!("second-{}", why.len()), &[]);
            let got = fetched_into(&parent, &second, (size, mtime), &[(0, 2)]);
            assert!(matches!(got, Err(Miss::Broken(_))), "{why}: {got:?}");
            assert!(parent.has_failed() && second.held() == 0, "{why}");
        }
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
