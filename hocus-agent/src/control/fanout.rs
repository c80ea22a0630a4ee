//! The relay between the daemons of a multi-node Slurm job (docs/fanout.md): the tree
//! its nodes form (from Slurm's node list, the same on every node), and this node's
//! serving side, which passes its copies of the job's files to its children. The asking
//! side is `cache::relay`.
//!
//! Who may fetch: a connection proves itself with a munge credential made by root (the
//! asking node's daemon) naming the job, the asking node and this node; the daemon's
//! loop checks that it ran this job's prolog, that the asking node is one of the job's,
//! and serves only files of the job's own profile (read as the job's user). A thread per
//! connection, at most [`MAX_PEERS`] at once.

use std::{
    io::{self, BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use tokio::sync::mpsc;

use crate::{
    cache::relay::{self, FILE, GREETING, MAX_PATH, NOT_HELD, Offer, WAIT, WAIT_EVERY},
    control::{
        calls::ask,
        protocol::{Ask, Call, Holding, Response},
    },
    redirect::access::Caller,
    shared::{identity::Identity, munge},
};

/// Connections served at once (a node's children: `fanout-width` times the copy workers
/// of each, for the jobs starting together).
pub const MAX_PEERS: usize = 256;
/// The most nodes a job's list may name.
pub const MAX_NODES: usize = 100_000;
/// A connection that asks nothing for this long is closed.
const IDLE: Duration = Duration::from_secs(600);

/// The node whose daemon `nodes[me]` fetches from: its parent in the tree of `width`
/// children per node, rooted at the first node (which reads from the network).
pub fn parent(me: usize, width: usize) -> Option<usize> {
    (me > 0).then(|| (me - 1) / width.max(1))
}

/// The payload of the credential node `from` proves itself to `to` with, for `job`.
pub fn payload(job: u32, from: &str, to: &str) -> String {
    format!("hocus-relay job={job} from={from} to={to}")
}

/// The job, asking node and named node of a payload.
pub fn parse_payload(p: &str) -> Option<(u32, String, String)> {
    let rest = p.strip_prefix("hocus-relay ")?;
    let mut parts = rest.split(' ');
    let job = parts.next()?.strip_prefix("job=")?.parse().ok()?;
    let from = parts.next()?.strip_prefix("from=")?;
    let to = parts.next()?.strip_prefix("to=")?;
    if parts.next().is_some() || from.is_empty() || to.is_empty() {
        return None;
    }
    Some((job, from.to_owned(), to.to_owned()))
}

/// Slurm's compressed host list (`node[1-3,7],gpu[01-02]x,login`) as names, in order;
/// Err if it is malformed or names more than [`MAX_NODES`].
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for item in split_top(list) {
        expand_one(item, &mut out)?;
    }
    if out.is_empty() {
        return Err(format!("the node list {list:?} names no node"));
    }
    Ok(out)
}

/// Splits at the commas outside brackets.
fn split_top(list: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&list[start..]);
    parts.into_iter().filter(|p| !p.is_empty()).collect()
}

fn expand_one(item: &str, out: &mut Vec<String>) -> Result<(), String> {
    let bad = || format!("the node list entry {item:?} is malformed");
    let Some(open) = item.find('[') else {
        if item.contains(']') {
            return Err(bad());
        }
        out.push(item.to_owned());
        return Ok(());
    };
    let close = open + item[open..].find(']').ok_or_else(bad)?;
    let (prefix, ranges, suffix) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    for range in ranges.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let width = lo.len();
        let (a, b): (u64, u64) = (
            lo.parse().map_err(|_| bad())?,
            hi.parse().map_err(|_| bad())?,
        );
        if a > b || b - a >= MAX_NODES as u64 {
            return Err(bad());
        }
        for n in a..=b {
            // The rest may hold further brackets.
            expand_one(&format!("{prefix}{n:0width$}{suffix}"), out)?;
            if out.len() > MAX_NODES {
                return Err(format!("the node list names more than {MAX_NODES} nodes"));
            }
        }
    }
    Ok(())
}

/// How the relay serves.
#[derive(Debug, Clone)]
pub struct Serving {
    pub port: u16,
    pub munge_socket: Option<PathBuf>,
    /// How long a peer has to greet, and how long a child waits for this node.
    pub timeout: Duration,
}

/// Listens on `serving.port` (every address); each connection on a thread of its own.
pub fn serve(serving: Serving, calls: mpsc::Sender<Call>) -> io::Result<SocketAddr> {
    let listener = TcpListener::bind(("0.0.0.0", serving.port))?;
    let addr = listener.local_addr()?;
    let serving = Arc::new(serving);
    let open = Arc::new(AtomicUsize::new(0));
    thread::Builder::new()
        .name("hocus-relay".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                if open.fetch_add(1, Ordering::SeqCst) >= MAX_PEERS {
                    open.fetch_sub(1, Ordering::SeqCst);
                    continue; // dropped: the child goes to the network
                }
                let (serving, calls, done) = (serving.clone(), calls.clone(), open.clone());
                let spawned = thread::Builder::new()
                    .name("hocus-relay-peer".into())
                    .spawn(move || {
                        let peer = conn.peer_addr().ok();
                        if let Err(e) = Peer::serve(conn, &serving, &calls) {
                            log::debug!("relay: {peer:?}: {e}");
                        }
                        done.fetch_sub(1, Ordering::SeqCst);
                    });
                if spawned.is_err() {
                    open.fetch_sub(1, Ordering::SeqCst);
                }
            }
        })?;
    Ok(addr)
}

/// One connection from another node's daemon.
struct Peer<'a> {
    stream: TcpStream,
    calls: &'a mpsc::Sender<Call>,
    job_id: u32,
    from: String,
}

impl Peer<'_> {
    fn serve(stream: TcpStream, serving: &Serving, calls: &mpsc::Sender<Call>) -> io::Result<()> {
        stream.set_read_timeout(Some(serving.timeout))?;
        stream.set_write_timeout(Some(serving.timeout))?;
        stream.set_nodelay(true)?;
        let addr = stream.peer_addr()?;
        let mut lines = BufReader::new((&stream).take((munge::MAX_CREDENTIAL + 64) as u64));
        let (mut greeting, mut cred) = (String::new(), String::new());
        lines.read_line(&mut greeting)?;
        lines.read_line(&mut cred)?;
        if greeting.trim_end() != GREETING {
            return Err(io::Error::other("not a hocus relay greeting"));
        }
        let mut peer = Peer {
            stream,
            calls,
            job_id: 0,
            from: String::new(),
        };
        match peer.join(cred.trim_end(), serving) {
            Ok(()) => peer.stream.write_all(b"OK\n")?,
            Err(why) => {
                log::warn!("relay: refused {addr}: {why}");
                let why = why.replace('\n', " ");
                return peer.stream.write_all(format!("NO {why}\n").as_bytes());
            }
        }
        log::info!(
            "relay: node {} ({addr}) fetches Slurm job {}'s files from this node",
            peer.from,
            peer.job_id
        );
        peer.stream.set_read_timeout(Some(IDLE))?;
        loop {
            let mut len = [0u8; 4];
            match peer.stream.read_exact(&mut len) {
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                other => other?,
            }
            let len = u32::from_be_bytes(len) as usize;
            if len == 0 || len > MAX_PATH {
                return Err(io::Error::other("a path of no or too many bytes"));
            }
            let mut path = vec![0u8; len];
            peer.stream.read_exact(&mut path)?;
            let source = String::from_utf8(path).map_err(io::Error::other)?;
            peer.answer(source)?;
        }
    }

    /// Checks the credential and asks the daemon's loop whether the job is one of its
    /// own, waiting (within `timeout`) for this node's prolog to tell it of the job.
    fn join(&mut self, cred: &str, serving: &Serving) -> Result<(), String> {
        let decoded = munge::decode(cred, serving.munge_socket.as_deref())?;
        if decoded.uid != 0 {
            return Err(format!(
                "a credential of uid {}: only nodes' hocus daemons (root) fetch from each other",
                decoded.uid
            ));
        }
        let (job_id, from, to) = parse_payload(&decoded.payload)
            .ok_or_else(|| "the credential names no job and nodes".to_owned())?;
        let deadline = Instant::now() + serving.timeout;
        loop {
            let asked = Ask::RelayJoin {
                job_id,
                from: from.clone(),
                to: to.clone(),
            };
            match self.ask(asked)? {
                Response::Ready => break,
                Response::Error { message } if message.contains("not known") => {
                    if Instant::now() >= deadline {
                        return Err(message);
                    }
                    thread::sleep(Duration::from_millis(100));
                }
                Response::Error { message } => return Err(message),
                other => return Err(format!("unexpected answer {other:?}")),
            }
        }
        (self.job_id, self.from) = (job_id, from);
        Ok(())
    }

    fn ask(&self, asked: Ask) -> Result<Response, String> {
        let caller = Caller {
            pid: 0,
            uid: 0,
            gid: 0,
            groups: Vec::new(),
            pidfd: None,
        };
        ask(self.calls, caller, asked)
            .map_err(|e| e.to_string())?
            .blocking_recv()
            .ok_or_else(|| "the daemon is stopping".to_owned())
    }

    /// Sends `source`'s copy once this node holds it; WAIT while it is coming.
    fn answer(&mut self, source: String) -> io::Result<()> {
        let mut said_wait = Instant::now();
        loop {
            let asked = Ask::RelayFile {
                job_id: self.job_id,
                from: self.from.clone(),
                source: source.clone(),
            };
            match self.ask(asked).map_err(io::Error::other)? {
                Response::Relay(Holding::Copy(local)) => {
                    return match std::fs::File::open(&local) {
                        Ok(f) => self.send(&f),
                        // Dropped meanwhile.
                        Err(_) => self.stream.write_all(&[NOT_HELD]),
                    };
                }
                Response::Relay(Holding::Coming) => {
                    if said_wait.elapsed() >= WAIT_EVERY {
                        self.stream.write_all(&[WAIT])?;
                        said_wait = Instant::now();
                    }
                    thread::sleep(Duration::from_millis(50));
                }
                Response::Relay(Holding::No) => return self.stream.write_all(&[NOT_HELD]),
                Response::Error { message } => {
                    log::warn!("relay: node {}: {message}", self.from);
                    return Err(io::Error::other(message));
                }
                other => return Err(io::Error::other(format!("unexpected answer {other:?}"))),
            }
        }
    }

    fn send(&mut self, copy: &std::fs::File) -> io::Result<()> {
        let id = Identity::of(&copy.metadata()?);
        let offer = Offer {
            size: id.size,
            mtime_ns: id.mtime_ns,
            hash: relay::hash_of(copy)?,
        };
        self.stream.write_all(&[FILE])?;
        self.stream.write_all(&offer.encode())?;
        let sent = io::copy(&mut copy.take(offer.size), &mut self.stream)?;
        if sent != offer.size {
            return Err(io::Error::other("the copy is shorter than it was"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tree_has_width_children_per_node() {
        assert_eq!(parent(0, 8), None);
        assert_eq!(
            (1..=8).map(|i| parent(i, 8)).collect::<Vec<_>>(),
            [Some(0); 8]
        );
        assert_eq!(parent(9, 8), Some(1));
        assert_eq!(parent(2, 1), Some(1), "a chain");
    }

    #[test]
    fn slurms_node_lists_expand_in_order() {
        assert_eq!(expand("node[1-3]").unwrap(), ["node1", "node2", "node3"]);
        assert_eq!(
            expand("a[09-11,20],b,c[1-2]x").unwrap(),
            ["a09", "a10", "a11", "a20", "b", "c1x", "c2x"]
        );
        assert_eq!(
            expand("r[1-2]n[1-2]").unwrap(),
            ["r1n1", "r1n2", "r2n1", "r2n2"]
        );
        for bad in ["", "a[", "a]", "a[3-1]", "a[x]", "a[0-99999999]"] {
            assert!(expand(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_payload_reads_back_and_nothing_else_does() {
        let p = payload(42, "node2", "node1");
        assert_eq!(
            parse_payload(&p),
            Some((42, "node2".into(), "node1".into()))
        );
        for bad in [
            "hocus-relay job=x from=a to=b",
            "hocus-relay job=1 from= to=b",
            "hocus-relay job=1 from=a to=b extra",
            "other job=1 from=a to=b",
        ] {
            assert_eq!(parse_payload(bad), None, "{bad}");
        }
    }
}
