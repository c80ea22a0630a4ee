//! What the admin says on the plugin's plugstack line, and what a user says with
//! `--hocus`.

use std::{path::PathBuf, time::Duration};

/// The daemon's control socket unless the plugstack line names another.
pub const DEFAULT_SOCKET: &str = "/run/hocus/agent.sock";
/// How long a task waits for the daemon before it runs without local copies. The
/// daemon's own job-start check takes at most 2 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub socket: PathBuf,
    pub timeout: Duration,
    /// `off` on the plugstack line turns hocus off for every job on the node; a user's
    /// `--hocus=off` for theirs.
    pub enabled: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            socket: DEFAULT_SOCKET.into(),
            timeout: DEFAULT_TIMEOUT,
            enabled: true,
        }
    }
}

impl Settings {
    pub fn off() -> Self {
        Self {
            enabled: false,
            ..Self::default()
        }
    }

    /// The plugstack line's arguments: `socket=PATH`, `timeout=SECONDS`, `off`.
    pub fn parse(args: &[&str]) -> Result<Self, String> {
        let mut s = Self::default();
        for arg in args {
            match arg.split_once('=') {
                Some(("socket", path)) if path.starts_with('/') => s.socket = path.into(),
                Some(("timeout", secs)) => {
                    let secs: f64 = secs
                        .parse()
                        .ok()
                        .filter(|t: &f64| t.is_finite() && *t > 0.0 && *t <= 600.0)
                        .ok_or_else(|| {
                            format!("plugstack: timeout={secs} is not a number of seconds (0-600)")
                        })?;
                    s.timeout = Duration::from_secs_f64(secs);
                }
                None if *arg == "off" => s.enabled = false,
                None if *arg == "on" => s.enabled = true,
                _ => {
                    return Err(format!(
                        "plugstack: unknown argument {arg:?} (known: socket=/ABSOLUTE/PATH, timeout=SECONDS, off)"
                    ));
                }
            }
        }
        Ok(s)
    }
}

/// A user's `--hocus` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    On,
    Off,
}

impl Choice {
    /// No option given is on.
    pub fn parse(value: Option<&str>) -> Result<Self, String> {
        match value.map(str::trim) {
            None | Some("" | "on" | "yes" | "1") => Ok(Choice::On),
            Some("off" | "no" | "0") => Ok(Choice::Off),
            Some(other) => Err(format!("--hocus={other}: say on or off")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugstack_line_sets_socket_timeout_and_off() {
        assert_eq!(Settings::parse(&[]).unwrap(), Settings::default());
        let s = Settings::parse(&["socket=/tmp/h.sock", "timeout=2.5"]).unwrap();
        assert_eq!(s.socket, PathBuf::from("/tmp/h.sock"));
        assert_eq!(s.timeout, Duration::from_millis(2500));
        assert!(s.enabled);
        assert!(!Settings::parse(&["off"]).unwrap().enabled);
        for bad in [
            "socket=relative",
            "timeout=0",
            "timeout=-1",
            "timeout=x",
            "nonsense",
        ] {
            assert!(Settings::parse(&[bad]).is_err(), "{bad}");
        }
    }

    #[test]
    fn users_say_on_or_off() {
        assert_eq!(Choice::parse(None), Ok(Choice::On));
        assert_eq!(Choice::parse(Some("off")), Ok(Choice::Off));
        assert_eq!(Choice::parse(Some("on")), Ok(Choice::On));
        assert!(Choice::parse(Some("maybe")).is_err());
    }
}
