//! What the admin says on the plugin's plugstack line, and what a user says with
//! `--hocus`.

use std::{path::PathBuf, time::Duration};

/// The daemon's control socket unless the plugstack line names another.
pub const DEFAULT_SOCKET: &str = hocus_control::DEFAULT_SOCKET;
/// How long a task waits for the daemon before it runs without local copies. The
/// daemon's own job-start check takes at most 2 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a job's prolog waits for the prefetch of its saved profile; the job starts
/// when it is done or this is up. Slurm runs the prolog as the first step launches and
/// srun gives that launch `MessageTimeout` (10 s by default): waiting longer would fail
/// the job, so the default stays well below (raise both together).
pub const DEFAULT_PREFETCH_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub socket: PathBuf,
    pub timeout: Duration,
    pub prefetch_timeout: Duration,
    /// `off` on the plugstack line turns hocus off for every job on the node; a user's
    /// `--hocus=off` for theirs.
    pub enabled: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            socket: DEFAULT_SOCKET.into(),
            timeout: DEFAULT_TIMEOUT,
            prefetch_timeout: DEFAULT_PREFETCH_TIMEOUT,
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

    /// The plugstack line's arguments: `socket=PATH`, `timeout=SECONDS`,
    /// `prefetch_timeout=SECONDS`, `off`.
    pub fn parse(args: &[&str]) -> Result<Self, String> {
        let mut s = Self::default();
        for arg in args {
            match arg.split_once('=') {
                Some(("socket", path)) if path.starts_with('/') => s.socket = path.into(),
                Some(("timeout", secs)) => s.timeout = seconds("timeout", secs)?,
                Some(("prefetch_timeout", secs)) => {
                    s.prefetch_timeout = seconds("prefetch_timeout", secs)?;
                }
                None if *arg == "off" => s.enabled = false,
                None if *arg == "on" => s.enabled = true,
                _ => {
                    return Err(format!(
                        "plugstack: unknown argument {arg:?} (known: socket=/ABSOLUTE/PATH, timeout=SECONDS, prefetch_timeout=SECONDS, off)"
                    ));
                }
            }
        }
        Ok(s)
    }
}

fn seconds(name: &str, value: &str) -> Result<Duration, String> {
    value
        .parse()
        .ok()
        .filter(|t: &f64| t.is_finite() && *t > 0.0 && *t <= 3600.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("plugstack: {name}={value} is not a number of seconds (0-3600)"))
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
