//! The daemon's side of the control socket: each connection on a thread of its own (a
//! connection may carry descriptors, and a job session lasts as long as the job), its
//! requests handed to the daemon's loop as `Call`s.

use std::{
    fs,
    io::{BufRead, BufReader, IoSliceMut, Read, Write},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::{
            fs::PermissionsExt,
            net::{UnixListener, UnixStream},
        },
    },
    path::Path,
    thread,
};

use anyhow::{Context, Result, bail};
use nix::sys::socket::{ControlMessageOwned, MsgFlags, getsockopt, recvmsg, sockopt};
use tokio::sync::mpsc;

use crate::{
    control::protocol::{Ask, Call, Forward, MAX_REQUEST_BYTES, Request, Response},
    redirect::{
        access::Caller,
        mountns,
        spawn::{self, JobCommand},
    },
};

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
        Request::Run(run) => session(stream, caller, run, fds, rest, calls),
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

/// A job session, on the connection's own thread: the job's namespace and binds, the
/// job itself, the signals its client forwards, and its exit status.
fn session(
    stream: UnixStream,
    caller: Caller,
    run: JobCommand,
    fds: Vec<OwnedFd>,
    rest: Vec<u8>,
    calls: &mpsc::Sender<Call>,
) -> Result<()> {
    let refuse = |message: String| send(&stream, &Response::Error { message });
    if run.argv.is_empty() {
        return refuse("no command to run".into());
    }
    let Ok([stdin, stdout, stderr]) = <[OwnedFd; 3]>::try_from(fds) else {
        return refuse("send the standard input, output and error along with the request".into());
    };
    let binds = match ask(calls, caller.clone(), Ask::Binds)?.blocking_recv() {
        Some(Response::Binds(b)) => b,
        _ => return refuse("the daemon has no binds to give".into()),
    };
    // This thread moves to the job's namespace and forks the job from there.
    if let Err(e) = mountns::enter_new_namespace() {
        return refuse(format!("cannot make a mount namespace: {e}"));
    }
    let mut made = Vec::new();
    for b in binds {
        match mountns::bind_read_only(&b) {
            Ok(()) => made.push(b),
            Err(e) => log::debug!("not binding {}: {e}", b.target.display()),
        }
    }
    // The kernel marks whatever this thread forks as job `id`; the daemon learns the job
    // before it starts, so its first opens are attributed.
    // SAFETY: gettid has no preconditions.
    let id = unsafe { libc::gettid() } as u32;
    let job = Ask::JobStarting {
        id,
        binds: made.clone(),
    };
    ask(calls, caller.clone(), job)?.blocking_recv();
    let mut child = match spawn::spawn(&caller, &run, [stdin, stdout, stderr]) {
        Ok(child) => child,
        Err(e) => return refuse(format!("cannot start {}: {e}", run.argv[0])),
    };
    let pid = child.id() as i32;
    log::info!(
        "job {pid} ({}) for uid {} with {} local copies in place",
        run.argv[0],
        caller.uid,
        made.len()
    );
    send(
        &stream,
        &Response::Started {
            pid,
            binds: made.len(),
        },
    )?;

    // Signals from the client go to the job's process group; a client that goes away
    // hangs the job up, as a closed terminal would.
    let reader = stream.try_clone()?;
    thread::spawn(move || {
        let mut lines = BufReader::new(Read::chain(std::io::Cursor::new(rest), reader)).lines();
        loop {
            let signal = match lines.next() {
                Some(Ok(line)) => match serde_json::from_str::<Forward>(&line) {
                    Ok(f) if (1..=64).contains(&f.signal) => f.signal,
                    _ => continue,
                },
                _ => libc::SIGHUP,
            };
            // SAFETY: plain kill(2) on the job's process group.
            if unsafe { libc::kill(-pid, signal) } != 0 || signal == libc::SIGHUP {
                break;
            }
        }
    });
    let status = child.wait()?;
    let _ = ask(calls, caller, Ask::JobEnded { id });
    use std::os::unix::process::ExitStatusExt;
    send(
        &stream,
        &Response::Exited {
            code: status.code(),
            signal: status.signal(),
        },
    )
}
