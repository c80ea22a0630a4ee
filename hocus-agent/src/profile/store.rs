//! The state directory (default /var/lib/hocus): the profile file, written atomically so
//! that a crash mid-write leaves the previous one, and a lock that keeps two daemons (or a
//! daemon and an offline `profile import`) from writing it at once.

use std::{
    fs::{self, File, OpenOptions},
    io::{self, Write},
    os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result, bail};
use nix::fcntl::{Flock, FlockArg};

use crate::profile::format::{FormatError, Profile};
const PROFILE_FILE: &str = "profile.json";
const LOCK_FILE: &str = "lock";

pub struct StateDir {
    dir: PathBuf,
    _lock: Flock<File>,
}

impl StateDir {
    /// Creates the directory (root-only, 0700) if needed and takes its lock.
    pub fn lock(dir: &Path) -> Result<Self> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("creating state directory {}", dir.display()))?;
        let lock_path = dir.join(LOCK_FILE);
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .mode(0o600)
            .open(&lock_path)
            .with_context(|| format!("opening {}", lock_path.display()))?;
        let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| e);
        let lock = match lock {
            Ok(lock) => lock,
            Err(nix::errno::Errno::EWOULDBLOCK) => bail!(
                "another hocus-agent is using {}: stop it first, or give this one its own --state-dir",
                dir.display()
            ),
            Err(e) => return Err(e).with_context(|| format!("locking {}", lock_path.display())),
        };
        Ok(Self {
            dir: dir.to_owned(),
            _lock: lock,
        })
    }

    pub fn profile_path(&self) -> PathBuf {
        profile_path(&self.dir)
    }

    /// Writes the profile atomically: temporary file, fsync, rename, fsync of the directory.
    pub fn save(&self, profile: &Profile) -> Result<()> {
        let path = self.profile_path();
        write_atomically(&path, &profile.to_json())
            .with_context(|| format!("saving the profile to {}", path.display()))
    }

    /// Loads the saved profile. A missing file is `Ok(None)`; a bad one is moved aside to
    /// `profile.json.bad-<time>` (never overwritten) and reported in the error.
    pub fn load_or_set_aside(&self) -> Result<Option<Profile>, String> {
        let path = self.profile_path();
        match read_profile(&path, "") {
            Ok(mut p) => {
                // Written by hocus, but perhaps before paths were checked on import.
                let refused = p.keep_valid(&[PathBuf::from("/")]);
                if let Some(first) = refused.first() {
                    log::warn!(
                        "{}: dropped {} entries whose paths are not absolute and normalised, e.g. {}: {}",
                        path.display(),
                        refused.len(),
                        first.path,
                        first.why
                    );
                }
                Ok(Some(p))
            }
            Err(ReadError::Missing) => Ok(None),
            Err(ReadError::Io(e)) => Err(format!("cannot read {}: {e}", path.display())),
            Err(ReadError::Format(e)) => {
                let secs = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs();
                let aside = path.with_file_name(format!("{PROFILE_FILE}.bad-{secs}"));
                match fs::rename(&path, &aside) {
                    Ok(()) => Err(format!(
                        "{e}. It was moved to {} and a new profile is started; `hocus-agent profile import {}` merges it back once repaired (or delete it)",
                        aside.display(),
                        aside.display()
                    )),
                    Err(re) => Err(format!(
                        "{e}. Moving it aside to {} failed too ({re}); the profile will not be saved until it is moved or deleted",
                        aside.display()
                    )),
                }
            }
        }
    }
}

pub fn profile_path(state_dir: &Path) -> PathBuf {
    state_dir.join(PROFILE_FILE)
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("no profile")]
    Missing,
    #[error(transparent)]
    Io(io::Error),
    #[error(transparent)]
    Format(FormatError),
}

/// Reads and parses a profile file; `advice` says what to do if it is bad.
pub fn read_profile(path: &Path, advice: &str) -> Result<Profile, ReadError> {
    let bytes = fs::read(path).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => ReadError::Missing,
        _ => ReadError::Io(e),
    })?;
    Profile::from_json(&bytes, path, advice).map_err(ReadError::Format)
}

/// Replaces `path` with `bytes` so that readers see the old or the new content, never a
/// mix, even across a crash.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        // Keep the mode of the file being replaced (the state file is 0600).
        if let Ok(meta) = fs::metadata(path) {
            f.set_permissions(fs::Permissions::from_mode(
                meta.permissions().mode() & 0o7777,
            ))?;
        }
        fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Reads a profile someone exported, with errors that say what to do.
pub fn read_exported(path: &Path) -> Result<Profile> {
    match read_profile(path, "export it again with `hocus-agent profile export`") {
        Ok(p) => Ok(p),
        Err(ReadError::Missing) => bail!("{} does not exist", path.display()),
        Err(ReadError::Io(e)) => bail!("cannot read {}: {e}", path.display()),
        Err(ReadError::Format(e)) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::working_set::WorkingSet;

    #[test]
    fn saves_loads_and_sets_bad_files_aside() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::lock(dir.path()).unwrap();
        assert!(state.load_or_set_aside().unwrap().is_none());

        let mut ws = WorkingSet::new(1);
        ws.open("/net/a", 0, 5);
        state.save(&ws.to_profile()).unwrap();
        assert_eq!(state.load_or_set_aside().unwrap().unwrap(), ws.to_profile());
        // no temporary file is left behind
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");

        fs::write(state.profile_path(), b"{\"version\": 1, \"files\": [").unwrap();
        let err = state.load_or_set_aside().unwrap_err();
        assert!(err.contains("moved to"), "{err}");
        assert!(!state.profile_path().exists());
        let aside: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("profile.json.bad-"))
            .collect();
        assert_eq!(aside.len(), 1);
        assert_eq!(
            fs::read(dir.path().join(&aside[0])).unwrap(),
            b"{\"version\": 1, \"files\": [",
            "the bad file is kept byte for byte"
        );
    }

    #[test]
    fn a_second_lock_is_refused_with_advice() {
        let dir = tempfile::tempdir().unwrap();
        let _first = StateDir::lock(dir.path()).unwrap();
        let err = StateDir::lock(dir.path()).err().unwrap().to_string();
        assert!(err.contains("another hocus-agent"), "{err}");
    }
}
