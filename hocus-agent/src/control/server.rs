//! The daemon's side of the control socket: each connection on a thread of its own (a
//! connection may carry descriptors, and a job session lasts as long as the job), its
//! requests handed to the daemon's loop as `Call`s.
//!
//! Every client is a stranger: connections are capped in all and per user, a request
//! line is bounded and must arrive within [`REQUEST_TIMEOUT`], exactly the descriptors a
//! request needs are taken (the others closed, a truncated control message refused),
//! and a client that does not read its answers is dropped after [`WRITE_TIMEOUT`]. Each
//! refusal is counted (`status`, metrics) and logged the first time.

use std::{
    fs,
    io::IoSliceMut,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::{
            fs::PermissionsExt,
            net::{UnixListener, UnixStream},
        },
    },
    path::{Path, PathBuf},
    sync::Arc,
    thread,
    time::Duration,
};

use anyhow::{Context, Result, bail};
use hocus_control::{MAX_REQUEST_LINE, Request, Response};
use nix::sys::socket::{ControlMessageOwned, MsgFlags, getsockopt, recvmsg, sockopt};
use tokio::sync::mpsc;

use crate::{
    control::{
        calls::{
            Client, Setup, ask, ask_once, copies_expected, read_profile, read_to_prefetch, send,
        },
        gate::{Control, Gate, Limits},
        job_profiles,
        messages::{Answer, Ask, Call, Query},
        refusal::Refusal,
        session,
    },
    profile::format::refuse_path,
    redirect::{
        access::{self, Caller, ProfileCheck},
        identity,
    },
};

/// How long a client has to send its whole request line.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an answer may wait for the client to read it.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Descriptors a request may carry at most (a run's three).
const MAX_DESCRIPTORS: usize = 3;
/// The most descriptors one message can carry (the kernel's SCM_MAX_FD): room is made for
/// all of them, so that every descriptor a client sends is received, and closed, rather
/// than left installed in the daemon by a truncated control message.
const SCM_MAX_FD: usize = 253;

/// Binds the socket (replacing a stale one) and serves each connection on a thread of
/// its own. Requests go to the daemon's loop through `calls`.
pub fn serve(
    socket: &Path,
    calls: mpsc::Sender<Call>,
    limits: Limits,
    setup: Setup,
) -> Result<Control> {
    let setup = Arc::new(setup);
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
    let gate = Arc::new(Gate::new(limits));
    let accepting = Arc::clone(&gate);
    thread::Builder::new()
        .name("hocus-control".into())
        .spawn(move || accept(&listener, &accepting, &calls, &setup))?;
    Ok(Control(gate))
}

fn accept(
    listener: &UnixListener,
    gate: &Arc<Gate>,
    calls: &mpsc::Sender<Call>,
    setup: &Arc<Setup>,
) {
    loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors or memory: wait for some to come back, do not spin.
                gate.refuse("accept_failed", &e.to_string());
                thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let cred = match getsockopt(&stream, sockopt::PeerCredentials) {
            Ok(c) => c,
            Err(e) => {
                gate.refuse("read_error", &e.to_string());
                continue;
            }
        };
        let admitted = match gate.admit(cred.uid()) {
            Ok(a) => a,
            Err(reason) => {
                gate.refuse(reason, &format!("uid {}", cred.uid()));
                let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
                let _ = send(
                    &stream,
                    &Response::Error {
                        message: format!(
                            "the daemon serves too many clients now ({reason}); try again shortly"
                        ),
                    },
                );
                continue;
            }
        };
        let calls = calls.clone();
        let setup = Arc::clone(setup);
        let gate_of_thread = Arc::clone(gate);
        let spawned = thread::Builder::new()
            .name("hocus-client".into())
            .spawn(move || {
                let _admitted = admitted;
                let (pid, uid, gid) = (cred.pid(), cred.uid(), cred.gid());
                if let Err(e) = answer(stream, (pid, uid, gid), &gate_of_thread, &calls, &setup) {
                    log::debug!("control connection of uid {uid}: {e:#}");
                }
            });
        if let Err(e) = spawned {
            // The connection (and its admission) went with the closure.
            gate.refuse("no_thread", &e.to_string());
        }
    }
}

fn answer(
    stream: UnixStream,
    (pid, uid, gid): (i32, u32, u32),
    gate: &Gate,
    calls: &mpsc::Sender<Call>,
    setup: &Setup,
) -> Result<()> {
    stream.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let client = Client::new(&stream, gate, uid);
    // The process that connected, however long this takes: its pidfd, then its /proc.
    let pidfd = identity::caller_pidfd(stream.as_raw_fd(), pid).map(Arc::new);
    let caller = match Caller::from_peer(pid, uid, gid, pidfd) {
        Ok(c) => c,
        Err(message) => return client.refuse(Refusal::new("identity", message)),
    };
    let (request, fds, rest) = match read_request(&stream) {
        Ok(r) => r,
        Err(r) => return client.refuse(r),
    };
    if fds.len() != request.descriptors() {
        return client.refuse(Refusal::new(
            "wrong_descriptors",
            format!(
                "this request takes {} descriptors, not {}",
                request.descriptors(),
                fds.len()
            ),
        ));
    }
    let query = match request {
        Request::Run(run) => {
            // The session lasts as long as the job: no read timeout from here on.
            stream.set_read_timeout(None)?;
            return session::run(&client, caller, run, fds, rest, calls);
        }
        Request::Attach(task) => {
            let marks = setup.bind_opens.as_deref();
            return session::attach(&client, caller, task, calls, marks);
        }
        Request::SaveJobProfile(job) => {
            return client.reply(job_profiles::save(&caller, &job, calls, setup));
        }
        Request::PrefetchJobProfile(job) => {
            // The plugin gives up at its own time: the prefetch goes on without it.
            let asked = job_profiles::prefetch(&caller, &job, calls, setup)
                .and_then(|(user, query)| ask(calls, user, query));
            return match asked {
                Ok(answers) => client.forward(answers),
                Err(r) => client.refuse(r),
            };
        }
        Request::Status => Query::Status,
        Request::Export { root } => return export(&client, calls, caller, root),
        Request::Budgets { .. } if !caller.is_root() => {
            return client.refuse(Refusal::new(
                "not_root",
                "only root may change the budgets: run it with sudo",
            ));
        }
        Request::Budgets { ssd, ram } => Query::Budgets { ssd, ram },
        Request::Import => match read_profile(fds.into_iter().next(), setup, &caller) {
            Ok(p) => Query::Import(Box::new(p)),
            Err(r) => return client.refuse(r),
        },
        Request::Prefetch => {
            // The user's own verdicts found before are taken where the copies are
            // unchanged (`redirect::remembered`).
            let check = ProfileCheck {
                job_id: None,
                parent: None,
                expected: Arc::new(copies_expected(&caller, calls)),
                recall: true,
            };
            let Some(fd) = fds.into_iter().next() else {
                return client.refuse(Refusal::new(
                    "wrong_descriptors",
                    "send the profile's descriptor",
                ));
            };
            match read_to_prefetch(fd, setup, &caller, &check) {
                // A holder the profile names is for Slurm jobs' prologs only.
                Ok((staged, _)) => Query::Prefetch {
                    staged: Box::new(staged),
                    relay: None,
                    node: None,
                },
                Err(r) => return client.refuse(r),
            }
        }
    };
    match ask(calls, caller, Ask::Client(query)) {
        Ok(answers) => client.forward(answers),
        Err(r) => client.refuse(r),
    }
}

/// Sends the profile a part at a time: the loop fixes the order once and hands out the
/// next part only when this connection asks, after the last one was checked as the
/// caller and written, so a slow reader holds back only itself and nothing is held whole.
fn export(
    client: &Client,
    calls: &mpsc::Sender<Call>,
    caller: Caller,
    root: Option<PathBuf>,
) -> Result<()> {
    let mut ask_for = Ask::Client(Query::Export { root });
    let mut sent = [0usize; 3];
    let mut first = true;
    loop {
        let (order, part) = match ask_once(calls, caller.clone(), ask_for) {
            Ok(Answer::Export { order, part }) => (order, part),
            Ok(Answer::Refused(r)) | Err(r) => return client.refuse(r),
            Ok(other) => bail!("the daemon answered {other:?} to an export"),
        };
        let Some(mut part) = part else {
            let [files, missing, dirs] = sent;
            return client.send(&Response::Exported {
                files,
                missing,
                dirs,
            });
        };
        if let Err(e) = access::filter_for(&mut part, &caller) {
            return client.refuse(Refusal::new("read_error", format!("{e:#}")));
        }
        ask_for = Ask::ExportPart(order);
        let entries = part.files.len() + part.missing.len() + part.dirs.len();
        // The first part goes even empty (it carries the start); a later empty one was
        // spent sorting what comes next, or held nothing of the caller's.
        if entries == 0 && !first {
            continue;
        }
        first = false;
        sent[0] += part.files.len();
        sent[1] += part.missing.len();
        sent[2] += part.dirs.len();
        client.send(&Response::Profile(part))?;
    }
}

/// Decodes a request line: JSON in the documented form, its paths absolute and
/// normalised (a job's working directory, an export's root).
fn decode(line: &[u8]) -> Result<Request, Refusal> {
    let request = serde_json::from_slice::<Request>(line)
        .map_err(|e| Refusal::new("malformed", format!("malformed request: {e}")))?;
    let path = match &request {
        Request::Export { root: Some(root) } => Some(root),
        Request::Run(run) => Some(&run.cwd),
        _ => None,
    };
    if let Some(path) = path {
        let text = path.to_str().unwrap_or("\0");
        if let Some(why) = refuse_path(text, &[PathBuf::from("/")]) {
            return Err(Refusal::new(
                "malformed",
                format!("the path {} {why}", path.display()),
            ));
        }
    }
    Ok(request)
}

/// Reads the request line (at most [`MAX_REQUEST_LINE`] bytes), with the descriptors sent
/// along (at most [`MAX_DESCRIPTORS`]; a truncated control message is refused), and
/// whatever the client sent after it.
fn read_request(stream: &UnixStream) -> Result<(Request, Vec<OwnedFd>, Vec<u8>), Refusal> {
    let mut buf = Vec::new();
    let mut fds = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let mut space = nix::cmsg_space!([RawFd; SCM_MAX_FD]);
        let mut iov = [IoSliceMut::new(&mut chunk)];
        let msg = recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(|e| match e {
            nix::errno::Errno::EAGAIN => Refusal::new(
                "timeout",
                format!(
                    "send the whole request within {} s",
                    REQUEST_TIMEOUT.as_secs()
                ),
            ),
            e => Refusal::new("read_error", e.to_string()),
        })?;
        let cmsgs = msg.cmsgs().map_err(|_| {
            Refusal::new(
                "wrong_descriptors",
                format!("at most {MAX_DESCRIPTORS} descriptors; the control message was truncated"),
            )
        })?;
        for c in cmsgs {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // SAFETY: the kernel just gave us these descriptors; owned, they close
                // when dropped, whatever happens to the request.
                fds.extend(
                    raw.into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
        if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
            return Err(Refusal::new(
                "wrong_descriptors",
                format!("at most {MAX_DESCRIPTORS} descriptors; the control message was truncated"),
            ));
        }
        if fds.len() > MAX_DESCRIPTORS {
            return Err(Refusal::new(
                "wrong_descriptors",
                format!("at most {MAX_DESCRIPTORS} descriptors, not {}", fds.len()),
            ));
        }
        let n = msg.bytes;
        if n == 0 {
            return Err(Refusal::new(
                "closed",
                "the client closed the connection before a whole request",
            ));
        }
        let searched = buf.len();
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf[searched..].iter().position(|b| *b == b'\n') {
            let rest = buf.split_off(searched + i + 1);
            return Ok((decode(&buf)?, fds, rest));
        }
        if buf.len() > MAX_REQUEST_LINE {
            return Err(Refusal::new(
                "too_large",
                format!("a request line is at most {MAX_REQUEST_LINE} bytes"),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn decodes_requests_and_refuses_unsound_paths() {
        assert!(matches!(
            decode(br#"{"request":"status"}"#),
            Ok(Request::Status)
        ));
        assert!(decode(br#"{"request":"export","root":"/net/../etc"}"#).is_err());
        assert!(decode(br#"{"request":"run","argv":["true"],"env":[],"cwd":"relative"}"#).is_err());
        assert!(decode(br#"{"request":"run","argv":["true"],"env":[],"cwd":"/home/a"}"#).is_ok());
        assert!(decode(br#"{"request":"run","argv":["true"],"env":[],"cwd":"/"}"#).is_ok());
        assert!(decode(b"not json").is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_the_decoder_nor_yield_an_unsound_path(
            bytes in prop::collection::vec(any::<u8>(), 0..256)
        ) {
            if let Ok(request) = decode(&bytes) {
                let path = match &request {
                    Request::Export { root: Some(r) } => Some(r.clone()),
                    Request::Run(run) => Some(run.cwd.clone()),
                    _ => None,
                };
                if let Some(p) = path {
                    prop_assert_eq!(refuse_path(p.to_str().unwrap(), &[PathBuf::from("/")]), None);
                }
            }
        }

        #[test]
        fn json_requests_with_any_paths_decode_only_when_sound(
            root in "(/|[a-z./\\x00]){0,12}",
            cwd in "(/|[a-z./]){0,12}",
        ) {
            let export = serde_json::json!({"request": "export", "root": root}).to_string();
            prop_assert_eq!(
                decode(export.as_bytes()).is_ok(),
                refuse_path(&root, &[PathBuf::from("/")]).is_none()
            );
            let run = serde_json::json!({"request": "run", "argv": ["x"], "env": [], "cwd": cwd}).to_string();
            prop_assert_eq!(
                decode(run.as_bytes()).is_ok(),
                refuse_path(&cwd, &[PathBuf::from("/")]).is_none()
            );
        }
    }
}
