//! The state directory (default /var/lib/hocus): the working set as a binary snapshot
//! plus an append-only journal of the entries changed since, and a lock that keeps two
//! daemons (or a daemon and an offline `profile import`) from writing it at once.
//!
//! A save appends only what changed (a million-file profile costs nothing to keep when
//! idle); when the journal outgrows the snapshot, a new snapshot is written (temporary
//! file, fsync, rename) under the next generation and the old journal removed. A crash
//! loses at most the last save interval: a torn journal record is detected by its
//! checksum and cut off, and the snapshot is only ever replaced whole.

use std::{
    fs::{self, File, OpenOptions},
    io::{self, BufReader, Read, Write},
    os::unix::fs::{DirBuilderExt, OpenOptionsExt},
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result, bail};
use nix::fcntl::{Flock, FlockArg};

mod codec;
mod sliced;

pub use self::sliced::{SLICE, Sliced};

use self::codec::{END, decode, encode, frame, read_frame};
use crate::profile::{
    format::{Entry, ReadError, keep_valid, read_profile},
    working_set::WorkingSet,
};

const STATE_FILE: &str = "profile.state";
const JOURNAL_FILE: &str = "profile.journal";
/// The JSON file hocus kept its profile in before: read once, then replaced.
const LEGACY_FILE: &str = "profile.json";
const LOCK_FILE: &str = "lock";
const STATE_MAGIC: &[u8; 8] = b"HOCUSST1";
const JOURNAL_MAGIC: &[u8; 8] = b"HOCUSJR1";
/// The journal is folded into a new snapshot once it is larger than this, or than the
/// snapshot.
const JOURNAL_FOLD_BYTES: u64 = 4 << 20;

pub struct StateDir {
    dir: PathBuf,
    _lock: Flock<File>,
    generation: u64,
    journal: Option<File>,
    journal_bytes: u64,
    state_bytes: u64,
    /// A snapshot is being written in slices.
    slicing: bool,
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
        // A snapshot cut short by a killed daemon left its temporary file: with the lock
        // held, no other writer has one.
        let cut = format!(".{STATE_FILE}.tmp-");
        for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with(&cut) {
                let _ = fs::remove_file(entry.path());
            }
        }
        Ok(Self {
            dir: dir.to_owned(),
            _lock: lock,
            generation: 0,
            journal: None,
            journal_bytes: 0,
            state_bytes: 0,
            slicing: false,
        })
    }

    /// Where the profile is kept (for messages).
    pub fn profile_path(&self) -> PathBuf {
        self.dir.join(STATE_FILE)
    }

    /// Saves what changed in `ws` since the last save: appended to the journal, or a new
    /// snapshot when the journal has grown past it (or everything changed). On failure
    /// nothing is lost: the next save writes everything.
    pub fn save(&mut self, ws: &mut WorkingSet) -> Result<()> {
        match self.save_or_begin(ws)? {
            None => Ok(()),
            Some(mut sliced) => {
                let result = sliced.finish(ws);
                self.sliced_done(&sliced, result, ws)
            }
        }
    }

    /// [`StateDir::save`], but a snapshot it needs is only begun: the caller writes it a
    /// slice at a time ([`Sliced`]), appending nothing meanwhile.
    pub fn save_or_begin(&mut self, ws: &mut WorkingSet) -> Result<Option<Sliced>> {
        if self.slicing {
            // What changed waits for the snapshot being written: the journal it would go
            // to is the one that snapshot replaces.
            return Ok(None);
        }
        let result = match ws.take_changes() {
            None => self.begin_sliced(ws).map(Some),
            Some(changes) if changes.is_empty() => return Ok(None),
            Some(changes) => match self.append(&changes, ws.started_unix_ns) {
                Ok(()) if self.journal_bytes > JOURNAL_FOLD_BYTES.max(self.state_bytes) => {
                    self.begin_sliced(ws).map(Some)
                }
                other => other.map(|()| None),
            },
        };
        if result.is_err() {
            ws.all_changed();
        }
        result.with_context(|| format!("saving the profile in {}", self.dir.display()))
    }

    fn journal_path(&self, generation: u64) -> PathBuf {
        self.dir.join(format!("{JOURNAL_FILE}.{generation}"))
    }

    /// Appends `changes` to the journal, made if new (its header holds the working
    /// set's start, for a journal written before any snapshot).
    fn append(&mut self, changes: &[Entry], started_unix_ns: u64) -> Result<()> {
        if self.journal.is_none() {
            let path = self.journal_path(self.generation);
            let mut f = OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            if f.metadata()?.len() == 0 {
                f.write_all(JOURNAL_MAGIC)?;
                f.write_all(&self.generation.to_le_bytes())?;
                f.write_all(&started_unix_ns.to_le_bytes())?;
                f.sync_all()?;
                File::open(&self.dir)?.sync_all()?;
            }
            self.journal_bytes = f.metadata()?.len();
            self.journal = Some(f);
        }
        let mut buf = Vec::new();
        for e in changes {
            frame(&mut buf, |b| encode(b, e));
        }
        let f = self.journal.as_mut().expect("opened above");
        if let Err(e) = f.write_all(&buf).and_then(|()| f.sync_data()) {
            // Whatever part was written is cut off at the next load; start a new one.
            self.journal = None;
            return Err(e.into());
        }
        self.journal_bytes += buf.len() as u64;
        Ok(())
    }

    /// The snapshot of generation `next` (`bytes` long) is in place: the journal it
    /// replaces goes.
    fn snapshot_in_place(&mut self, next: u64, bytes: u64) {
        let old = self.journal_path(self.generation);
        self.generation = next;
        self.journal = None;
        self.journal_bytes = 0;
        self.state_bytes = bytes;
        let _ = fs::remove_file(old);
    }

    /// Loads the saved working set into `ws`. A missing one loads nothing; a bad one is
    /// moved aside (never overwritten), and the error says where and what to do.
    pub fn load(&mut self, ws: &mut WorkingSet) -> Result<(), String> {
        let path = self.profile_path();
        match read_state(&self.dir) {
            Ok(Some(state)) => {
                self.generation = state.generation;
                self.state_bytes = state.state_bytes;
                ws.merge_state(state.ws);
                if state.migrated {
                    // The old JSON is replaced by a snapshot now, then removed.
                    ws.all_changed();
                    self.save(ws).map_err(|e| format!("{e:#}"))?;
                    let _ = fs::remove_file(self.dir.join(LEGACY_FILE));
                } else if let Some(good) = state.journal_good_bytes {
                    // A torn last record (a crash mid-save): cut it off before appending.
                    let journal = self.journal_path(self.generation);
                    if let Ok(f) = OpenOptions::new().write(true).open(&journal) {
                        let _ = f.set_len(good);
                    }
                }
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(StateError::Io(e)) => Err(format!("cannot read {}: {e}", path.display())),
            Err(StateError::Bad { path, message }) => {
                let secs = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs();
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                let aside = path.with_file_name(format!("{name}.bad-{secs}"));
                match fs::rename(&path, &aside) {
                    Ok(()) => Err(format!(
                        "{message}. It was moved to {} and a new profile is started",
                        aside.display(),
                    )),
                    Err(re) => Err(format!(
                        "{message}. Moving it aside to {} failed too ({re}); the profile will not be saved until it is moved or deleted",
                        aside.display()
                    )),
                }
            }
        }
    }
}

/// A saved working set, as read.
pub struct SavedState {
    pub ws: WorkingSet,
    generation: u64,
    state_bytes: u64,
    /// Read from the old JSON file.
    migrated: bool,
    /// The journal ended in a torn record: the length of its good part.
    journal_good_bytes: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Io(io::Error),
    #[error("{message}")]
    Bad { path: PathBuf, message: String },
}

/// Reads the working set saved in `dir` (snapshot and journal, or the old JSON file);
/// `None` when nothing was saved yet. Takes no lock: for a reader when no daemon runs.
pub fn read_state(dir: &Path) -> Result<Option<SavedState>, StateError> {
    let path = dir.join(STATE_FILE);
    let snapshot = match File::open(&path) {
        Ok(f) => Some(read_snapshot(f, &path)?),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if dir.join(LEGACY_FILE).exists() {
                return read_legacy(dir);
            }
            None
        }
        Err(e) => return Err(StateError::Io(e)),
    };
    let from_snapshot = snapshot.is_some();
    // Without one, saves are in generation 0's journal alone.
    let (mut ws, generation, state_bytes) = snapshot.unwrap_or((WorkingSet::new(0), 0, 0));
    // The journal of this generation, up to its first bad record.
    let mut journal_good_bytes = None;
    let journal = dir.join(format!("{JOURNAL_FILE}.{generation}"));
    match File::open(&journal) {
        Ok(f) => {
            let len = f.metadata().map_err(StateError::Io)?.len();
            let mut r = BufReader::with_capacity(1 << 20, f);
            let mut head = [0u8; 24];
            let mut good = 0u64;
            let mut payload = Vec::new();
            if r.read_exact(&mut head).is_ok()
                && &head[..8] == JOURNAL_MAGIC
                && head[8..16] == generation.to_le_bytes()
            {
                good = head.len() as u64;
                if !from_snapshot {
                    ws.started_unix_ns = u64::from_le_bytes(head[16..].try_into().expect("8"));
                }
                while let Ok(true) = read_frame(&mut r, &mut payload) {
                    let Some(entry) = decode(&payload) else { break };
                    ws.restore(entry);
                    good += 8 + payload.len() as u64;
                }
            }
            if good < len {
                log::warn!(
                    "{}: the last {} bytes were cut off by a crash mid-save; dropped",
                    journal.display(),
                    len - good
                );
                journal_good_bytes = Some(good);
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound && !from_snapshot => return Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(StateError::Io(e)),
    }
    ws.take_changes();
    Ok(Some(SavedState {
        ws,
        generation,
        state_bytes,
        migrated: false,
        journal_good_bytes,
    }))
}

/// Reads a snapshot: the working set, its generation and its size.
fn read_snapshot(file: File, path: &Path) -> Result<(WorkingSet, u64, u64), StateError> {
    let state_bytes = file.metadata().map_err(StateError::Io)?.len();
    let bad = |message: String| StateError::Bad {
        path: path.to_owned(),
        message: format!(
            "{} is not a hocus state file or is damaged ({message})",
            path.display()
        ),
    };
    let mut r = BufReader::with_capacity(1 << 20, file);
    let mut head = [0u8; 24];
    r.read_exact(&mut head)
        .map_err(|e| bad(format!("its header: {e}")))?;
    if &head[..8] != STATE_MAGIC {
        return Err(bad("no hocus header".into()));
    }
    let generation = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
    let mut ws = WorkingSet::new(u64::from_le_bytes(
        head[16..24].try_into().expect("8 bytes"),
    ));
    let mut count = 0u64;
    let mut payload = Vec::new();
    while read_frame(&mut r, &mut payload).map_err(|e| bad(e.to_string()))? {
        if payload.first() == Some(&END) {
            let said = payload
                .get(1..9)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes);
            if said != Some(count) {
                return Err(bad(format!(
                    "it holds {count} entries, its end says {said:?}"
                )));
            }
            return Ok((ws, generation, state_bytes));
        }
        let entry = decode(&payload).ok_or_else(|| bad(format!("entry {count} is malformed")))?;
        ws.restore(entry);
        count += 1;
    }
    Err(bad("it ends early".into()))
}

/// The profile.json of hocus before the snapshot and journal.
fn read_legacy(dir: &Path) -> Result<Option<SavedState>, StateError> {
    let path = dir.join(LEGACY_FILE);
    match read_profile(&path, "") {
        Ok(mut p) => {
            // Written by hocus, but perhaps before paths were checked on import.
            let refused = keep_valid(&mut p, &[PathBuf::from("/")]);
            if let Some(first) = refused.first() {
                log::warn!(
                    "{}: dropped {} entries whose paths are not absolute and normalised, e.g. {}: {}",
                    path.display(),
                    refused.len(),
                    first.path,
                    first.why
                );
            }
            Ok(Some(SavedState {
                ws: WorkingSet::from_profile(p),
                generation: 0,
                state_bytes: 0,
                migrated: true,
                journal_good_bytes: None,
            }))
        }
        Err(ReadError::Missing) => Ok(None),
        Err(ReadError::Io(e)) => Err(StateError::Io(e)),
        Err(ReadError::Format(e)) => Err(StateError::Bad {
            path,
            message: e.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::format::to_json;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// A state directory whose snapshot holds one file, its lock, and that working set.
    fn saved_snapshot_of_one_file() -> (tempfile::TempDir, StateDir, WorkingSet) {
        let dir = tempfile::tempdir().unwrap();
        let mut state = StateDir::lock(dir.path()).unwrap();
        let mut ws = WorkingSet::new(0);
        ws.open("/net/a", 0, 1);
        ws.all_changed();
        state.save(&mut ws).unwrap();
        (dir, state, ws)
    }

    fn reload(dir: &Path) -> WorkingSet {
        let mut state = StateDir::lock(dir).unwrap();
        let mut ws = WorkingSet::new(0);
        state.load(&mut ws).unwrap();
        ws
    }

    #[test]
    fn saves_what_changed_and_loads_it_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut ws = WorkingSet::new(1);
        {
            let mut state = StateDir::lock(dir.path()).unwrap();
            state.load(&mut ws).unwrap();
            assert_eq!(ws.counts(), (0, 0, 0));
            ws.open("/net/a", 0, 5);
            ws.missing("/net/nope", 6);
            ws.dir_mutated("/net/out");
            // The first save of a fresh set rewrites nothing but appends the three.
            state.save(&mut ws).unwrap();
            assert_eq!(names(dir.path()), ["lock", "profile.journal.0"]);
            ws.open("/net/a", 7, 9);
            ws.add_bytes_read("/net/a", 100);
            ws.missing("/net/nope", 8);
            ws.dir_opened("/net/out");
            state.save(&mut ws).unwrap();
            // Nothing changed: nothing written.
            let len = fs::metadata(dir.path().join("profile.journal.0"))
                .unwrap()
                .len();
            state.save(&mut ws).unwrap();
            assert_eq!(
                fs::metadata(dir.path().join("profile.journal.0"))
                    .unwrap()
                    .len(),
                len
            );
        }
        assert_eq!(reload(dir.path()).to_profile(), ws.to_profile());

        // Everything changed: a snapshot of the next generation replaces the journal.
        let mut state = StateDir::lock(dir.path()).unwrap();
        let mut back = WorkingSet::new(0);
        state.load(&mut back).unwrap();
        back.all_changed();
        state.save(&mut back).unwrap();
        assert_eq!(names(dir.path()), ["lock", "profile.state"]);
        back.open("/net/b", 0, 10);
        state.save(&mut back).unwrap();
        assert_eq!(
            names(dir.path()),
            ["lock", "profile.journal.1", "profile.state"]
        );
        drop(state);
        assert_eq!(reload(dir.path()).to_profile(), back.to_profile());
    }

    #[test]
    fn a_snapshot_written_in_slices_while_the_set_changes_loses_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut state = StateDir::lock(dir.path()).unwrap();
        let mut ws = WorkingSet::new(0);
        for i in 0..100 {
            ws.open(&format!("/net/f{i}"), 0, i);
            ws.missing(&format!("/net/m{i}"), i);
        }
        ws.dir_opened("/net");
        ws.all_changed();
        let mut sliced = state.save_or_begin(&mut ws).unwrap().expect("a snapshot");
        // Ten entries a turn; between turns the set changes, behind the pass and ahead of
        // it, and grows.
        let mut turns = 0;
        while sliced.next_slice(&ws, 10) {
            turns += 1;
            ws.open("/net/f0", 0, 1000 + turns);
            ws.open("/net/f99", 0, 2000 + turns);
            ws.open(&format!("/net/new{turns}"), 0, 3000);
            ws.missing("/net/m50", 4000);
        }
        assert!(turns >= 20, "{turns} turns");
        // Nothing is appended while it is written: the old state stays whole, and what
        // changed waits.
        assert!(state.save_or_begin(&mut ws).unwrap().is_none());
        let journals = names(dir.path())
            .into_iter()
            .filter(|n| n.contains("journal"));
        assert_eq!(journals.count(), 0);
        let result = loop {
            if let Some(r) = sliced.result() {
                break r;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        state.sliced_done(&sliced, result, &mut ws).unwrap();
        assert_eq!(names(dir.path()), ["lock", "profile.state"]);
        // What changed meanwhile goes to the next generation's journal.
        state.save(&mut ws).unwrap();
        drop(state);
        assert_eq!(reload(dir.path()).to_profile(), ws.to_profile());
    }

    #[test]
    fn a_snapshot_cut_by_a_killed_daemon_is_cleared_at_the_next_start() {
        let (dir, state, ws) = saved_snapshot_of_one_file();
        drop(state);
        fs::write(
            dir.path().join(".profile.state.tmp-99999"),
            b"half a snapshot",
        )
        .unwrap();
        let state = StateDir::lock(dir.path()).unwrap();
        assert_eq!(names(dir.path()), ["lock", "profile.state"]);
        drop(state);
        assert_eq!(reload(dir.path()).to_profile(), ws.to_profile());
    }

    #[test]
    fn a_snapshot_given_up_leaves_the_old_one() {
        let (dir, mut state, mut ws) = saved_snapshot_of_one_file();
        let kept = ws.to_profile();
        ws.open("/net/b", 0, 2);
        ws.all_changed();
        let mut sliced = state.save_or_begin(&mut ws).unwrap().unwrap();
        assert!(sliced.next_slice(&ws, 1));
        // Within 10 s each (a loaded machine is slow to run the writer's thread): the
        // writer makes its temporary file (the CI once looked before it had)...
        let within_10_s = |done: &dyn Fn(Vec<String>) -> bool| {
            for _ in 0..10_000 {
                if done(names(dir.path())) {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        };
        within_10_s(&|n| n.iter().any(|n| n.contains(".tmp-")));
        drop(sliced);
        // ... and, given up, removes it: only the old snapshot is there.
        within_10_s(&|n| n == ["lock", "profile.state"]);
        assert_eq!(names(dir.path()), ["lock", "profile.state"]);
        drop(state);
        assert_eq!(reload(dir.path()).to_profile(), kept);
    }

    #[test]
    fn a_save_cut_by_a_crash_loses_only_itself() {
        let (dir, mut state, mut ws) = saved_snapshot_of_one_file();
        ws.open("/net/b", 0, 2);
        state.save(&mut ws).unwrap();
        let kept = ws.to_profile();
        ws.open("/net/c", 0, 3);
        state.save(&mut ws).unwrap();
        drop(state);
        // The last record loses its last bytes, as if the machine stopped mid-write.
        let journal = dir.path().join("profile.journal.1");
        let len = fs::metadata(&journal).unwrap().len();
        OpenOptions::new()
            .write(true)
            .open(&journal)
            .unwrap()
            .set_len(len - 3)
            .unwrap();
        let mut back = reload(dir.path());
        assert_eq!(back.to_profile(), kept);
        // The torn record was cut off: what is appended next is read back.
        let mut state = StateDir::lock(dir.path()).unwrap();
        state.load(&mut WorkingSet::new(0)).unwrap();
        back.open("/net/d", 0, 4);
        state.save(&mut back).unwrap();
        drop(state);
        assert_eq!(reload(dir.path()).to_profile(), back.to_profile());
    }

    #[test]
    fn a_damaged_state_file_is_set_aside_byte_for_byte() {
        let (dir, mut state, _) = saved_snapshot_of_one_file();
        let path = state.profile_path();
        let mut bytes = fs::read(&path).unwrap();
        let last = bytes.len() - 20;
        bytes[last] ^= 0xff;
        fs::write(&path, &bytes).unwrap();
        let err = state.load(&mut WorkingSet::new(0)).unwrap_err();
        assert!(err.contains("moved to"), "{err}");
        assert!(!path.exists());
        let aside: Vec<_> = names(dir.path())
            .into_iter()
            .filter(|n| n.starts_with("profile.state.bad-"))
            .collect();
        assert_eq!(aside.len(), 1);
        assert_eq!(fs::read(dir.path().join(&aside[0])).unwrap(), bytes);
    }

    #[test]
    fn the_old_json_profile_is_taken_over_or_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let mut old = WorkingSet::new(3);
        old.open("/net/a", 1000, 5);
        fs::write(dir.path().join("profile.json"), to_json(&old.to_profile())).unwrap();
        assert_eq!(reload(dir.path()).to_profile(), old.to_profile());
        assert_eq!(names(dir.path()), ["lock", "profile.state"]);

        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join("profile.json"),
            b"{\"version\": 1, \"files\": [",
        )
        .unwrap();
        let mut state = StateDir::lock(dir.path()).unwrap();
        let err = state.load(&mut WorkingSet::new(0)).unwrap_err();
        assert!(
            err.contains("moved to") && err.contains("profile.json"),
            "{err}"
        );
        assert!(names(dir.path())[1].starts_with("profile.json.bad-"));
    }

    #[test]
    fn a_second_lock_is_refused_with_advice() {
        let dir = tempfile::tempdir().unwrap();
        let _first = StateDir::lock(dir.path()).unwrap();
        let err = StateDir::lock(dir.path()).err().unwrap().to_string();
        assert!(err.contains("another hocus-agent"), "{err}");
    }
}
