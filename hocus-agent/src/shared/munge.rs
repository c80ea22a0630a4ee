//! munge credentials: the cluster's own proof of who is asking, as Slurm uses it. A
//! credential made on one node is checked on another with the cluster's shared key; it
//! says the uid that made it, carries a payload, expires (5 min) and is accepted once
//! (a replay is refused). Made by `munge`, checked by `unmunge` (no build dependency on
//! libmunge; a credential is made once per connection, not per file).

use std::{
    io::{self, Write},
    path::Path,
    process::{Command, Stdio},
};

/// The longest credential accepted: a payload of a few dozen bytes encodes to ~200.
pub const MAX_CREDENTIAL: usize = 4096;

/// What a checked credential says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    pub uid: u32,
    pub payload: String,
}

fn with_socket(cmd: &mut Command, socket: Option<&Path>) {
    if let Some(s) = socket {
        cmd.arg("--socket").arg(s);
    }
}

/// A credential of this process's uid carrying `payload`.
pub fn encode(payload: &str, socket: Option<&Path>) -> io::Result<String> {
    let mut cmd = Command::new("munge");
    cmd.args(["--string", payload]);
    with_socket(&mut cmd, socket);
    let out = cmd.stdin(Stdio::null()).stderr(Stdio::piped()).output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "munge: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let cred = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if cred.is_empty() || cred.len() > MAX_CREDENTIAL || cred.contains('\n') {
        return Err(io::Error::other("munge gave no credential"));
    }
    Ok(cred)
}

/// Checks `cred`: Err says why it is refused (forged, expired, replayed, no munged).
pub fn decode(cred: &str, socket: Option<&Path>) -> Result<Decoded, String> {
    if cred.len() > MAX_CREDENTIAL {
        return Err("the credential is too long".into());
    }
    let mut cmd = Command::new("unmunge");
    cmd.args(["--numeric", "--keys=UID"]);
    with_socket(&mut cmd, socket);
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run unmunge: {e}"))?;
    let written = child.stdin.take().map(|mut i| i.write_all(cred.as_bytes()));
    let out = child
        .wait_with_output()
        .map_err(|e| format!("unmunge: {e}"))?;
    if written.is_none_or(|w| w.is_err()) || !out.status.success() {
        // unmunge prints the metadata of a replayed credential too: only its status says.
        return Err(format!(
            "munge refused the credential: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    parse(&String::from_utf8_lossy(&out.stdout))
        .ok_or_else(|| "unmunge's answer was not understood".to_owned())
}

/// `UID: <n>`, a blank line, then the payload (unmunge --numeric --keys=UID).
fn parse(out: &str) -> Option<Decoded> {
    let (meta, payload) = out.split_once("\n\n")?;
    let uid = meta
        .lines()
        .find_map(|l| l.strip_prefix("UID:"))?
        .trim()
        .parse()
        .ok()?;
    Some(Decoded {
        uid,
        payload: payload.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unmunges_answer_is_read() {
        assert_eq!(
            parse("UID:             0\n\nhocus-relay job=5"),
            Some(Decoded {
                uid: 0,
                payload: "hocus-relay job=5".into()
            })
        );
        assert_eq!(parse("UID: x\n\npayload"), None);
        assert_eq!(parse("no blank line"), None);
    }
}
