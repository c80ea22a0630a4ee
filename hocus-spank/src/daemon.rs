//! Talking to hocus-agent over its control socket, in the daemon's own terms
//! (`hocus_control`): one JSON request line, then JSON response lines, each awaited no
//! longer than what is left of the caller's time.

use std::{
    io::{self, BufRead, BufReader, Read, Write},
    os::unix::net::UnixStream,
    path::Path,
    time::{Duration, Instant},
};

use hocus_control::{Request, Response};

/// An answer line is at most this long.
const MAX_ANSWER: u64 = 64 << 10;

/// A connection to the daemon, answering within `deadline`.
pub struct Daemon {
    reader: BufReader<io::Take<UnixStream>>,
    deadline: Instant,
    timeout: Duration,
}

impl Daemon {
    /// Connects to the daemon at `socket`; `Err` says why not, for the log.
    pub fn connect(socket: &Path, timeout: Duration) -> Result<Self, String> {
        let stream = UnixStream::connect(socket).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => format!(
                "hocus-agent is not running (nothing at {})",
                socket.display()
            ),
            _ => format!("cannot reach hocus-agent at {}: {e}", socket.display()),
        })?;
        stream
            .set_write_timeout(Some(timeout))
            .map_err(|e| format!("socket timeouts: {e}"))?;
        Ok(Self {
            reader: BufReader::new(stream.take(MAX_ANSWER)),
            deadline: Instant::now() + timeout,
            timeout,
        })
    }

    pub fn send(&mut self, request: &Request) -> Result<(), String> {
        let mut line =
            serde_json::to_string(request).map_err(|e| format!("writing the request: {e}"))?;
        line.push('\n');
        let stream = self.reader.get_mut().get_mut();
        stream
            .write_all(line.as_bytes())
            .map_err(|e| format!("asking hocus-agent: {e}"))
    }

    /// The next answer, within what is left of the time.
    pub fn answer(&mut self) -> Result<Response, String> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        let late = || {
            format!(
                "hocus-agent did not answer within {:.1} s",
                self.timeout.as_secs_f64()
            )
        };
        if left.is_zero() {
            return Err(late());
        }
        let take = self.reader.get_mut();
        take.set_limit(MAX_ANSWER);
        take.get_ref()
            .set_read_timeout(Some(left))
            .map_err(|e| format!("socket timeouts: {e}"))?;
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) => return Err("hocus-agent closed the connection".into()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(late());
            }
            Err(e) => return Err(format!("reading hocus-agent's answer: {e}")),
        }
        match serde_json::from_str::<Response>(line.trim()) {
            Ok(Response::Error { message }) => Err(format!("hocus-agent refused: {message}")),
            Ok(a) => Ok(a),
            Err(_) => Err(format!(
                "unexpected answer from hocus-agent: {:.200}",
                line.trim()
            )),
        }
    }
}
