//! The CLI's side of the control socket: connect, send one request, read the answers;
//! and `hocus-agent run`'s session (the standard descriptors sent along, signals
//! forwarded, the job's exit status returned).

use std::{
    fs::File,
    io::{BufRead, BufReader, IoSlice, Write},
    os::{fd::AsRawFd, unix::net::UnixStream},
    path::{Path, PathBuf},
    process::ExitCode,
    thread,
    time::Duration,
};

use anyhow::{Context, Result, bail};
use hocus_control::{Forward, JobCommand, Request, Response};
use nix::sys::{
    signal::{SigSet, Signal},
    socket::{ControlMessage, MsgFlags, sendmsg},
};

use crate::profile::format::Profile;

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

/// Sends one request (with the file it reads, a profile, if it reads one) and waits for
/// its last answer.
pub fn call_with(
    socket: &Path,
    request: &Request,
    file: Option<&File>,
) -> Result<Response, ClientError> {
    let mut last = None;
    call_streaming(socket, request, file, |r| {
        last = Some(r);
        Ok(())
    })?;
    last.ok_or_else(|| anyhow::anyhow!("the daemon closed the connection without answering").into())
}

/// Sends one request (with `file`'s descriptor, for requests that read one) and passes
/// every answer line to `each` until the daemon is done, or `each` fails.
pub fn call_streaming(
    socket: &Path,
    request: &Request,
    file: Option<&File>,
    mut each: impl FnMut(Response) -> Result<()>,
) -> Result<(), ClientError> {
    let stream = connect(socket)?;
    let io = |e: std::io::Error| {
        ClientError::Other(anyhow::Error::new(e).context("talking to the daemon"))
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(600)))
        .map_err(io)?;
    let mut out = serde_json::to_vec(request).map_err(|e| ClientError::Other(e.into()))?;
    out.push(b'\n');
    let fds: Vec<i32> = file.iter().map(|f| f.as_raw_fd()).collect();
    send_with_fds(&stream, &out, &fds).map_err(io)?;
    for line in BufReader::new(stream).lines() {
        let line = line.map_err(io)?;
        let response = decode(&line).map_err(|e| {
            ClientError::Other(anyhow::anyhow!("unreadable answer from the daemon: {e}"))
        })?;
        each(response)?;
    }
    Ok(())
}

/// One answer line. A part of an exported profile (8k entries) is read straight into a
/// `Profile`, which ignores the tag: as an internally tagged enum, `Response` would first
/// buffer the whole part as generic content and then read it again (a sixth of an
/// export's CPU at a million files).
fn decode(line: &str) -> serde_json::Result<Response> {
    if line.starts_with(r#"{"response":"profile","#) {
        return serde_json::from_str::<Profile>(line).map(Response::Profile);
    }
    serde_json::from_str(line)
}

/// The client side: `hocus-agent run -- CMD ARGS`. Returns the job's exit status.
pub fn run(socket: &Path, argv: Vec<String>) -> Result<ExitCode> {
    let request = Request::Run(JobCommand {
        argv,
        env: std::env::vars().collect(),
        cwd: std::env::current_dir().context("the current directory")?,
    });
    let stream = match connect(socket) {
        Ok(s) => s,
        Err(ClientError::NoDaemon(_)) => bail!(
            "no hocus-agent daemon is running (nothing at {}): start it with sudo hocus-agent --watch PATH, or run the command without hocus",
            socket.display()
        ),
        Err(ClientError::Other(e)) => return Err(e),
    };
    // Signals are taken by a thread and forwarded; block them everywhere else first.
    let mut forwarded = SigSet::empty();
    for s in [
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGHUP,
        Signal::SIGQUIT,
        Signal::SIGUSR1,
        Signal::SIGUSR2,
    ] {
        forwarded.add(s);
    }
    forwarded.thread_block()?;
    let mut line = serde_json::to_vec(&request)?;
    line.push(b'\n');
    send_with_fds(&stream, &line, &[0, 1, 2]).context("sending the request")?;
    let mut signals = stream.try_clone()?;
    thread::spawn(move || {
        while let Ok(signal) = forwarded.wait() {
            let mut out = serde_json::to_vec(&Forward {
                signal: signal as i32,
            })
            .unwrap_or_default();
            out.push(b'\n');
            if signals.write_all(&out).is_err() {
                break;
            }
        }
    });
    for line in BufReader::new(stream).lines() {
        let line = line.context("the daemon went away during the job")?;
        match serde_json::from_str::<Response>(&line)? {
            Response::Started { .. } => {}
            Response::Exited {
                code: Some(code), ..
            } => return Ok(ExitCode::from(code as u8)),
            Response::Exited { signal, .. } => {
                return Ok(ExitCode::from(128 + signal.unwrap_or(0) as u8));
            }
            Response::Error { message } => bail!("the daemon refused: {message}"),
            _ => {}
        }
    }
    bail!("the daemon went away during the job")
}

/// Writes `bytes` with `fds` attached to the first message (SCM_RIGHTS), then the rest.
fn send_with_fds(mut stream: &UnixStream, bytes: &[u8], fds: &[i32]) -> std::io::Result<()> {
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
    let n = sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(bytes)],
        cmsgs,
        MsgFlags::empty(),
        None,
    )?;
    stream.write_all(&bytes[n..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::format::{FileEntry, MissingEntry};

    #[test]
    fn a_profile_part_decodes_as_the_tagged_answer_does() {
        let part = Response::Profile(Profile {
            version: 1,
            started_unix_ns: 5,
            files: vec![FileEntry {
                path: "/net/a \"quoted\"".into(),
                opens: 2,
                uids: vec![1000],
                ..Default::default()
            }],
            missing: vec![MissingEntry {
                path: "/net/nope".into(),
                lookups: 1,
                first_touch_ns: 3,
            }],
            dirs: Vec::new(),
        });
        let line = serde_json::to_string(&part).unwrap();
        assert!(line.starts_with(r#"{"response":"profile","#), "{line}");
        let (Response::Profile(fast), Response::Profile(tagged)) = (
            decode(&line).unwrap(),
            serde_json::from_str::<Response>(&line).unwrap(),
        ) else {
            panic!("not a profile part");
        };
        assert_eq!(fast, tagged);
        assert_eq!(fast.files[0].path, "/net/a \"quoted\"");
        let done = serde_json::to_string(&Response::Exported {
            files: 1,
            missing: 1,
            dirs: 0,
        })
        .unwrap();
        assert!(matches!(
            decode(&done).unwrap(),
            Response::Exported { files: 1, .. }
        ));
        assert!(decode(r#"{"response":"profile","version":"x"}"#).is_err());
    }
}
