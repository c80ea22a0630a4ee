//! The serving end of the relay between the daemons of a multi-node Slurm job
//! (docs/fanout.md): this node passes its copies of the job's files to its children in
//! the job's tree of nodes. The vocabulary both ends share is `shared::relay`; the asking
//! end is `cache::relay`.
//!
//! Who may fetch: a connection proves itself with a munge credential made by root (the
//! asking node's daemon) naming the job, the asking node and this node; the daemon's
//! loop checks that it ran this job's prolog, that the asking node is one of the job's,
//! and serves only files of the job's own profile (read as the job's user). It answers
//! with a credential of its own (`shared::relay::proof`): the child takes nothing from
//! a listener that cannot make one, such as a user's on a port the daemon could not
//! take. A thread per connection, at most [`MAX_PEERS`] at once.
//!
//! A child may ask this node to vouch for its job start's checks: this node answers for
//! what its own copies expect too (the same network path and digest), checked against
//! the server as its own job start checks them (once for jobs starting together), or
//! vouched for by its own parent in turn; the child checks the rest itself. And for
//! this node's verdicts of what the job's user may read of the job's profile, as its
//! own prolog found them (`redirect::verdicts`).

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
    cache::relay::{Holding, send_grains},
    control::{
        calls::ask_once,
        messages::{Answer, Ask, Call},
        refusal::Refusal,
    },
    redirect::{access::Caller, confirm, verdicts},
    shared::{
        identity::Identity,
        munge,
        relay::{
            self, Asked, FILE, GREETING, NOT_HELD, Offer, Request, VerdictsOf, Vouch, WAIT,
            WAIT_EVERY, parse_payload,
        },
    },
};

/// Connections served at once (a node's children: `fanout-width` times the copy workers
/// of each, for the jobs starting together).
pub const MAX_PEERS: usize = 256;
/// A connection that asks nothing for this long is closed.
const IDLE: Duration = Duration::from_secs(600);
/// The reason the daemon refuses a node for a job whose prolog has not run here yet: it
/// is asked again until `Serving::timeout`.
pub const NOT_KNOWN_YET: &str = "relay_job_unknown";

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
    /// It asks for what a job left here (`relay::held_payload`), not as one of its nodes.
    held: bool,
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
            held: false,
        };
        let cred = cred.trim_end();
        let joined = peer.join(cred, serving).and_then(|named| {
            let proof = relay::proof(peer.job_id, &named, &peer.from, cred);
            munge::encode(&proof, serving.munge_socket.as_deref()).map_err(|e| {
                Refusal::new(
                    "relay_unproven",
                    format!("this node cannot prove itself with a munge credential: {e}"),
                )
            })
        });
        match joined {
            Ok(proof) => peer.stream.write_all(format!("OK {proof}\n").as_bytes())?,
            Err(why) => {
                crate::shared::tally::warn_limited!(
                    "relay refusal",
                    "relay: refused {addr}: {why}"
                );
                let why = why.message.replace('\n', " ");
                return peer.stream.write_all(format!("NO {why}\n").as_bytes());
            }
        }
        log::info!(
            "relay: node {} ({addr}) fetches Slurm job {}'s files from this node",
            peer.from,
            peer.job_id
        );
        peer.stream.set_read_timeout(Some(IDLE))?;
        while let Some(asked) = relay::read_request(&mut peer.stream)? {
            match asked {
                Asked::File(asked) => peer.answer(asked)?,
                Asked::Vouch(asked) => peer.vouch(asked)?,
                Asked::Verdicts(asked) => peer.verdicts(asked)?,
            }
        }
        Ok(())
    }

    /// Checks the credential and asks the daemon's loop whether the job is one of its
    /// own, waiting (within `timeout`) for this node's prolog to tell it of the job.
    /// Returns this node's name as the credential says it.
    fn join(&mut self, cred: &str, serving: &Serving) -> Result<String, Refusal> {
        let refused = |why: String| Refusal::new("relay_refused", why);
        let decoded = munge::decode(cred, serving.munge_socket.as_deref()).map_err(refused)?;
        if decoded.uid != 0 {
            return Err(refused(format!(
                "a credential of uid {}: only nodes' hocus daemons (root) fetch from each other",
                decoded.uid
            )));
        }
        let (job_id, from, to) = parse_payload(&decoded.payload)
            .ok_or_else(|| refused("the credential names no job and nodes".to_owned()))?;
        let deadline = Instant::now() + serving.timeout;
        let held = relay::is_held(&decoded.payload);
        loop {
            let asked = Ask::RelayJoin {
                job_id,
                from: from.clone(),
                to: to.clone(),
                held,
            };
            match self.ask(asked)? {
                Answer::Ready => break,
                Answer::Refused(r) if r.reason == NOT_KNOWN_YET => {
                    // A job that ended here is not coming back.
                    if held || Instant::now() >= deadline {
                        return Err(r);
                    }
                    thread::sleep(Duration::from_millis(100));
                }
                Answer::Refused(r) => return Err(r),
                other => return Err(refused(format!("unexpected answer {other:?}"))),
            }
        }
        (self.job_id, self.from, self.held) = (job_id, from, held);
        Ok(to)
    }

    fn ask(&self, asked: Ask) -> Result<Answer, Refusal> {
        let caller = Caller {
            pid: 0,
            uid: 0,
            gid: 0,
            groups: Vec::new(),
            pidfd: None,
        };
        ask_once(self.calls, caller, asked)
    }

    /// Sends what this node holds of the file asked for once it holds it (a whole copy
    /// for a whole file, a partial copy's grains for grains); WAIT while it is coming.
    fn answer(&mut self, asked: Request) -> io::Result<()> {
        let mut said_wait = Instant::now();
        loop {
            let ask = Ask::RelayFile {
                job_id: self.job_id,
                from: self.from.clone(),
                source: asked.source.clone(),
                held: self.held,
            };
            match (
                self.ask(ask).map_err(|r| io::Error::other(r.message))?,
                &asked.grains,
            ) {
                (Answer::Relay(Holding::Copy(local)), None) => {
                    return match std::fs::File::open(&local) {
                        Ok(f) => self.send(&f),
                        // Dropped meanwhile.
                        Err(_) => self.stream.write_all(&[NOT_HELD]),
                    };
                }
                (Answer::Relay(Holding::Partial(copy)), Some(grains)) => {
                    return send_grains(&mut self.stream, &copy, grains);
                }
                (Answer::Relay(Holding::Coming), _) => {
                    if said_wait.elapsed() >= WAIT_EVERY {
                        self.stream.write_all(&[WAIT])?;
                        said_wait = Instant::now();
                    }
                    thread::sleep(Duration::from_millis(50));
                }
                // A whole copy is not passed on by grains, nor a partial one whole.
                (Answer::Relay(_), _) => return self.stream.write_all(&[NOT_HELD]),
                (Answer::Refused(r), _) => {
                    crate::shared::tally::warn_limited!(
                        "relay node refused",
                        "relay: node {}: {r}",
                        self.from
                    );
                    return Err(io::Error::other(r.message));
                }
                (other, _) => {
                    return Err(io::Error::other(format!("unexpected answer {other:?}")));
                }
            }
        }
    }

    /// Vouches for the child's job-start checks of what this node's own copies expect
    /// too, checked against the server (or vouched for by this node's parent in turn)
    /// within the time the child allows: how long ago each check began.
    fn vouch(&mut self, asked: Vouch) -> io::Result<()> {
        let refused = |r: Refusal| io::Error::other(r.message);
        let ask = Ask::RelayVouch {
            job_id: self.job_id,
            from: self.from.clone(),
        };
        let Answer::Binds(binds) = self.ask(ask).map_err(refused)? else {
            return Err(io::Error::other("no binds to vouch with"));
        };
        let parent = match self.ask(Ask::JobParent {
            job_id: self.job_id,
        }) {
            Ok(Answer::Parent(parent)) => parent,
            _ => None,
        };
        let allowed = asked.allowed.min(confirm::JOB_START_CHECK);
        let (ages, stale) = confirm::vouch_for(binds, &asked.items, allowed, parent.as_deref());
        if !stale.is_empty() {
            let _ = self.ask(Ask::Stale { sources: stale });
        }
        self.stream.write_all(&relay::answer_vouch(&ages))
    }

    /// This node's verdicts of what the job's user may read of the entries asked, as its
    /// own prolog found them (waiting for those it has not reached yet, within the time
    /// the child allows); it checks nothing for a child.
    fn verdicts(&mut self, asked: VerdictsOf) -> io::Result<()> {
        let found = verdicts::answer(self.job_id, &asked.user, &asked.items, asked.allowed);
        self.stream.write_all(&relay::answer_verdicts(&found))
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
