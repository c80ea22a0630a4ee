//! The control socket (/run/hocus/agent.sock): how the CLI talks to a running daemon.
//! One JSON request line, one JSON response line. Anyone may connect; every request is
//! answered according to the caller's credentials, taken from the socket (SO_PEERCRED).

use std::{
    fs,
    io::{BufRead, BufReader, Write},
    os::unix::{fs::PermissionsExt, net::UnixStream},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader as AsyncBufReader},
    net::UnixListener,
    sync::mpsc,
};

use crate::{
    access::Caller,
    keeper::{KeeperStatus, Progress},
    observe::Tally,
    profile::Profile,
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
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "response", rename_all = "snake_case")]
pub enum Response {
    Status(Box<Status>),
    Profile(Profile),
    Imported { files: usize, missing: usize },
    Progress(Progress),
    Error { message: String },
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
    pub uptime_secs: u64,
    pub state_dir: PathBuf,
    pub watched: Vec<WatchedMount>,
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

/// A request with its caller, waiting for the daemon's answer: one response, or several
/// (progress) until the sender is dropped.
pub struct Call {
    pub caller: Caller,
    pub request: Request,
    pub reply: mpsc::UnboundedSender<Response>,
}

/// Binds the socket (replacing a stale one) and forwards calls into `calls`.
pub fn serve(socket: &Path, calls: mpsc::Sender<Call>) -> Result<tokio::task::JoinHandle<()>> {
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
    Ok(tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let calls = calls.clone();
            tokio::spawn(async move {
                if let Err(e) = answer(stream, calls).await {
                    log::debug!("control connection: {e:#}");
                }
            });
        }
    }))
}

async fn answer(stream: tokio::net::UnixStream, calls: mpsc::Sender<Call>) -> Result<()> {
    let cred = stream.peer_cred()?;
    let pid = cred.pid().context("no peer pid")?;
    let caller = Caller::from_peer(pid, cred.uid(), cred.gid())?;
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    AsyncBufReader::new(read.take(MAX_REQUEST_BYTES))
        .read_line(&mut line)
        .await?;
    let request = match serde_json::from_str::<Request>(&line) {
        Ok(request) => request,
        Err(e) => {
            let response = Response::Error {
                message: format!("malformed request: {e}"),
            };
            return send(&mut write, &response).await;
        }
    };
    let (reply, mut answers) = mpsc::unbounded_channel();
    calls
        .send(Call {
            caller,
            request,
            reply,
        })
        .await
        .context("the daemon is shutting down")?;
    while let Some(response) = answers.recv().await {
        send(&mut write, &response).await?;
    }
    Ok(())
}

async fn send(write: &mut tokio::net::unix::OwnedWriteHalf, response: &Response) -> Result<()> {
    let mut out = serde_json::to_vec(response)?;
    out.push(b'\n');
    write.write_all(&out).await?;
    Ok(())
}

/// Why the CLI could not reach a daemon.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no hocus-agent daemon is running (nothing at {0})")]
    NoDaemon(PathBuf),
    #[error(transparent)]
    Other(#[from] anyhow::Error),
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
    let mut stream = match UnixStream::connect(socket) {
        Ok(s) => s,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            return Err(ClientError::NoDaemon(socket.to_owned()));
        }
        Err(e) => {
            return Err(anyhow::Error::new(e)
                .context(format!("connecting to {}", socket.display()))
                .into());
        }
    };
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
