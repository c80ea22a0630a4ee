//! The control socket (/run/hocus/agent.sock): how the CLI talks to a running daemon.
//! One JSON request line, then JSON response lines (one, or progress, or a job's
//! session). Anyone may connect; every request is answered according to the caller's
//! credentials, taken from the socket (SO_PEERCRED).

use std::{
    fs,
    io::{BufRead, BufReader, IoSliceMut, Write},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::{
            fs::PermissionsExt,
            net::{UnixListener, UnixStream},
        },
    },
    path::{Path, PathBuf},
    thread,
    time::Duration,
};

use anyhow::{Context, Result, bail};
use nix::sys::socket::{ControlMessageOwned, MsgFlags, getsockopt, recvmsg, sockopt};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::{
    access::Caller,
    keeper::{KeeperStatus, Progress},
    mountns::Bind,
    observe::Tally,
    profile::{Profile, RootTotals},
    session::{self, RunRequest},
};

pub const DEFAULT_SOCKET: &str = "/run/hocus/agent.sock";
/// Requests carry whole profiles; bound them so a client cannot exhaust the daemon.
const MAX_REQUEST_BYTES: u64 = 512 << 20;

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "request", rename_all = "snake_case")]
pub enum Request {
    Status,
    Export {
        root: Option<PathBuf>,
    },
    Import {
        profile: Profile,
    },
    /// Merge the profile and warm the cache from it now, reporting progress.
    Prefetch {
        profile: Profile,
    },
    /// Change the budgets of the running daemon (root only), in bytes.
    Budgets {
        ssd: Option<u64>,
        ram: Option<u64>,
    },
    /// Run a command in a namespace where local copies stand in for network files; the
    /// standard descriptors come along (SCM_RIGHTS).
    Run(RunRequest),
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "response", rename_all = "snake_case")]
pub enum Response {
    Status(Box<Status>),
    Profile(Profile),
    Imported {
        files: usize,
        missing: usize,
    },
    Progress(Progress),
    /// Internal: the binds for a job's namespace.
    Binds(Vec<Bind>),
    /// The job runs, as `pid`, with `binds` local copies in place.
    Started {
        pid: i32,
        binds: usize,
    },
    /// The job ended: its exit code, or the signal that ended it.
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
    },
    Error {
        message: String,
    },
    /// Internal: a request was carried out.
    Ready,
    Metrics {
        text: String,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WatchedMount {
    pub path: PathBuf,
    pub fs_type: String,
    pub network: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    pub pid: u32,
    #[serde(default)]
    pub version: String,
    pub uptime_secs: u64,
    #[serde(default)]
    pub started_unix_secs: u64,
    pub state_dir: PathBuf,
    /// Where Prometheus metrics are served, if they are.
    #[serde(default)]
    pub metrics_addr: Option<std::net::SocketAddr>,
    pub watched: Vec<WatchedMount>,
    /// The working set under each watched tree.
    #[serde(default)]
    pub roots: Vec<RootTotals>,
    /// The hottest files (those the caller may read), and where hocus holds them.
    #[serde(default)]
    pub top: Vec<TopFile>,
    pub files: usize,
    pub missing: usize,
    pub dirs: usize,
    pub tally: Tally,
    /// Kernel counters by name (events sent, and every kind of loss).
    pub kernel: Vec<(String, u64)>,
    pub last_save_error: Option<String>,
    pub not_traced: Vec<String>,
    pub cache: Option<KeeperStatus>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TopFile {
    pub path: String,
    pub opens: u64,
    pub size: u64,
    pub bytes_read: u64,
    /// "ram" (pinned), "ssd" (copied) or "network".
    pub held: String,
}

/// What a connection asks of the daemon's loop: a client's request, or one of the
/// steps of a job session.
pub enum Ask {
    Client(Request),
    /// The binds to make in a new job's namespace.
    Binds,
    /// The calling thread (`id`) is about to fork a job in its namespace, with these
    /// binds (to detach on changes, and to tell hits from misses). Answered with
    /// `Response::Ready`.
    JobStarting {
        id: u32,
        binds: Vec<Bind>,
    },
    JobEnded {
        id: u32,
    },
    /// The metrics page, in the Prometheus text format (`Response::Metrics`).
    Metrics,
}

/// A request with its caller, waiting for the daemon's answer: one response, or several
/// (progress) until the sender is dropped.
pub struct Call {
    pub caller: Caller,
    pub ask: Ask,
    pub reply: mpsc::UnboundedSender<Response>,
}

/// Binds the socket (replacing a stale one) and serves each connection on a thread of
/// its own (a connection may carry descriptors, and a job session lasts as long as the
/// job). Requests go to the daemon's loop through `calls`.
pub fn serve(socket: &Path, calls: mpsc::Sender<Call>) -> Result<()> {
    if let Some(dir) = socket.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if UnixStream::connect(socket).is_ok() {
        bail!(
            "another hocus-agent answers on {}: stop it first, or give this one its own --socket",
            socket.display()
        );
    }
    let _ = fs::remove_file(socket);
    let listener =
        UnixListener::bind(socket).with_context(|| format!("binding {}", socket.display()))?;
    // Everyone may ask; what they get depends on who they are.
    fs::set_permissions(socket, fs::Permissions::from_mode(0o666))?;
    thread::Builder::new()
        .name("hocus-control".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                let calls = calls.clone();
                let _ = thread::Builder::new()
                    .name("hocus-client".into())
                    .spawn(move || {
                        if let Err(e) = answer(stream, &calls) {
                            log::debug!("control connection: {e:#}");
                        }
                    });
            }
        })?;
    Ok(())
}

fn answer(stream: UnixStream, calls: &mpsc::Sender<Call>) -> Result<()> {
    let cred = getsockopt(&stream, sockopt::PeerCredentials)?;
    let caller = Caller::from_peer(cred.pid(), cred.uid(), cred.gid())?;
    let (line, fds, rest) = read_first_line(&stream)?;
    let request = match serde_json::from_str::<Request>(&line) {
        Ok(request) => request,
        Err(e) => {
            return send(
                &stream,
                &Response::Error {
                    message: format!("malformed request: {e}"),
                },
            );
        }
    };
    match request {
        Request::Run(run) => session::serve(stream, caller, run, fds, rest, calls),
        request => {
            let mut answers = ask(calls, caller, Ask::Client(request))?;
            while let Some(response) = answers.blocking_recv() {
                send(&stream, &response)?;
            }
            Ok(())
        }
    }
}

/// Hands `ask` to the daemon's loop; its answers arrive on the returned receiver.
pub fn ask(
    calls: &mpsc::Sender<Call>,
    caller: Caller,
    ask: Ask,
) -> Result<mpsc::UnboundedReceiver<Response>> {
    let (reply, answers) = mpsc::unbounded_channel();
    calls
        .blocking_send(Call { caller, ask, reply })
        .map_err(|_| anyhow::anyhow!("the daemon is shutting down"))?;
    Ok(answers)
}

pub fn send(mut stream: &UnixStream, response: &Response) -> Result<()> {
    let mut out = serde_json::to_vec(response)?;
    out.push(b'\n');
    stream.write_all(&out)?;
    Ok(())
}

/// Reads the request line, with any descriptors sent along (SCM_RIGHTS), and whatever
/// the client sent after it.
fn read_first_line(stream: &UnixStream) -> Result<(String, Vec<OwnedFd>, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut fds = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let mut space = nix::cmsg_space!([RawFd; 4]);
        let (n, received) = {
            let mut iov = [IoSliceMut::new(&mut chunk)];
            let msg = recvmsg::<()>(
                stream.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC,
            )?;
            let mut received = Vec::new();
            for c in msg.cmsgs()? {
                if let ControlMessageOwned::ScmRights(raw) = c {
                    // SAFETY: the kernel just gave us these descriptors.
                    received.extend(
                        raw.into_iter()
                            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                    );
                }
            }
            (msg.bytes, received)
        };
        fds.extend(received);
        if n == 0 {
            bail!("the client closed the connection before a whole request");
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.iter().position(|b| *b == b'\n') {
            let rest = buf.split_off(i + 1);
            return Ok((String::from_utf8(buf)?, fds, rest));
        }
        if buf.len() as u64 > MAX_REQUEST_BYTES {
            bail!("request too large");
        }
    }
}

/// Why the CLI could not reach a daemon.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no hocus-agent daemon is running (nothing at {0})")]
    NoDaemon(PathBuf),
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// Connects to the daemon's socket; a missing or dead socket is `NoDaemon`.
pub fn connect(socket: &Path) -> Result<UnixStream, ClientError> {
    match UnixStream::connect(socket) {
        Ok(s) => Ok(s),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            Err(ClientError::NoDaemon(socket.to_owned()))
        }
        Err(e) => Err(anyhow::Error::new(e)
            .context(format!("connecting to {}", socket.display()))
            .into()),
    }
}

/// Sends one request to the daemon and waits for its (last) answer.
pub fn call(socket: &Path, request: &Request) -> Result<Response, ClientError> {
    let mut last = None;
    call_streaming(socket, request, |r| last = Some(r))?;
    last.ok_or_else(|| anyhow::anyhow!("the daemon closed the connection without answering").into())
}

/// Sends one request and passes every answer line to `each` until the daemon is done.
pub fn call_streaming(
    socket: &Path,
    request: &Request,
    mut each: impl FnMut(Response),
) -> Result<(), ClientError> {
    let mut stream = connect(socket)?;
    let io = |e: std::io::Error| {
        ClientError::Other(anyhow::Error::new(e).context("talking to the daemon"))
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(600)))
        .map_err(io)?;
    let mut out = serde_json::to_vec(request).map_err(|e| ClientError::Other(e.into()))?;
    out.push(b'\n');
    stream.write_all(&out).map_err(io)?;
    for line in BufReader::new(stream).lines() {
        let line = line.map_err(io)?;
        let response = serde_json::from_str(&line).map_err(|e| {
            ClientError::Other(anyhow::anyhow!("unreadable answer from the daemon: {e}"))
        })?;
        each(response);
    }
    Ok(())
}
