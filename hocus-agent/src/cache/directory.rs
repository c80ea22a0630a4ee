//! The local SSD cache (default /var/cache/hocus): copies of network files under
//! `files/<network path>`, temporary files of copies in progress under `tmp/`, and an
//! index of what each copy is a copy of (`index.json`).
//!
//! The root is root-owned 0700: nobody reads a copy except through hocus. After a crash
//! (kill -9 mid-copy), opening the cache removes every temporary file and reconciles the
//! index with the disk: entries without their file are dropped, files without an entry
//! are deleted.

use std::{
    collections::HashMap,
    fs, io,
    os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::{
    cache::copy,
    shared::{identity::Identity, replace::write_atomically},
};
const INDEX: &str = "index.json";

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Cached {
    /// The version of the network file the copy is of.
    pub identity: Identity,
    /// For a partial copy (docs/partial-copies.md), the bytes it held when made; 0 for a
    /// whole copy.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub held: u64,
    /// For a partial copy, the user whose job read the network file: its rest is read as
    /// them, also by the next daemon (`Cache::take_unserved`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reader: Option<u32>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Cached {
    pub fn is_partial(&self) -> bool {
        self.held > 0
    }

    /// Bytes it takes on the cache's disk, as budgets count them.
    pub fn bytes(&self) -> u64 {
        if self.is_partial() {
            self.held
        } else {
            self.identity.size
        }
    }
}

pub struct Cache {
    root: PathBuf,
    files: PathBuf,
    tmp: PathBuf,
    trees: PathBuf,
    entries: HashMap<String, Cached>,
    /// Partial copies a previous daemon served, found at the start: not entries (never
    /// bound into a job) until served again.
    unserved: Vec<(String, Cached)>,
    used: u64,
    dirty: bool,
    /// The index being written, off the keeper's thread.
    saving: Option<std::thread::JoinHandle<()>>,
}

/// What opening the cache found and repaired.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Repairs {
    pub temporary_removed: usize,
    pub entries_dropped: usize,
    pub strays_removed: usize,
}

impl Cache {
    /// The directory of single copies, below the cache root.
    pub const FILES: &str = "files";
    /// The directory of snapshots, below the cache root.
    pub const TREES: &str = "trees";

    pub fn open(root: &Path) -> Result<(Self, Repairs)> {
        match fs::symlink_metadata(root) {
            Ok(m) if m.file_type().is_symlink() => {
                bail!(
                    "the cache directory {} is a symlink: give a real directory",
                    root.display()
                )
            }
            Ok(m) if !m.is_dir() => bail!("{} is not a directory", root.display()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(root)
                .with_context(|| format!("creating the cache directory {}", root.display()))?,
            Err(e) => return Err(e).with_context(|| format!("looking at {}", root.display())),
        }
        // Root-owned 0700, whatever it was: copies are only read through hocus.
        nix::unistd::chown(root, Some(0.into()), Some(0.into()))
            .with_context(|| format!("making {} root's", root.display()))?;
        fs::set_permissions(root, fs::Permissions::from_mode(0o700))?;
        let files = root.join(Self::FILES);
        let tmp = root.join("tmp");
        let trees = root.join(Self::TREES);
        // Snapshots are taken again after a restart: they are checked against the
        // network as a whole, and a daemon that stopped missed changes.
        let _ = fs::remove_dir_all(&trees);
        for dir in [&files, &tmp, &trees] {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)?;
        }
        let mut repairs = Repairs::default();
        // Unfinished copies, and snapshot trees dropped but not yet deleted.
        for entry in fs::read_dir(&tmp)? {
            let entry = entry?;
            let removed = if entry.file_type()?.is_dir() {
                fs::remove_dir_all(entry.path())
            } else {
                fs::remove_file(entry.path())
            };
            if removed.is_ok() {
                repairs.temporary_removed += 1;
            }
        }
        let index_path = root.join(INDEX);
        let mut entries: HashMap<String, Cached> = match fs::read(&index_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                log::warn!(
                    "the cache index {} is unreadable ({e}); rebuilding it empty",
                    index_path.display()
                );
                HashMap::new()
            }),
            Err(_) => HashMap::new(),
        };
        // Entries whose copy is gone or is not the size it should be; partial copies set
        // apart until the keeper serves them again (their filler went with the daemon
        // that served them).
        let mut unserved = Vec::new();
        entries.retain(|source, c| {
            let ok = fs::symlink_metadata(copy::local_path(&files, source))
                .is_ok_and(|m| m.is_file() && m.size() == c.identity.size);
            if ok && c.is_partial() && c.reader.is_some() {
                unserved.push((source.clone(), *c));
                return false;
            }
            let keep = ok && !c.is_partial();
            if !keep {
                repairs.entries_dropped += 1;
            }
            keep
        });
        let kept: std::collections::HashSet<&str> =
            unserved.iter().map(|(s, _)| s.as_str()).collect();
        // Files no entry accounts for.
        let mut stack = vec![files.clone()];
        while let Some(dir) = stack.pop() {
            for entry in fs::read_dir(&dir)?.flatten() {
                let path = entry.path();
                let kind = entry.file_type()?;
                if kind.is_dir() {
                    stack.push(path);
                    continue;
                }
                let source = Path::new("/").join(path.strip_prefix(&files).unwrap_or(&path));
                let source = source.to_string_lossy();
                if !entries.contains_key(source.as_ref()) && !kept.contains(source.as_ref()) {
                    let _ = fs::remove_file(&path);
                    repairs.strays_removed += 1;
                }
            }
        }
        let used = entries.values().map(Cached::bytes).sum();
        let mut cache = Self {
            root: root.to_owned(),
            files,
            tmp,
            trees,
            entries,
            unserved,
            used,
            dirty: repairs != Repairs::default(),
            saving: None,
        };
        cache.save_now();
        Ok((cache, repairs))
    }

    pub fn tmp_dir(&self) -> &Path {
        &self.tmp
    }

    pub fn local(&self, source: &str) -> PathBuf {
        copy::local_path(&self.files, source)
    }

    /// Whether `local` is (in) a snapshot rather than a single copy.
    pub fn is_snapshot(&self, local: &Path) -> bool {
        local.starts_with(&self.trees)
    }

    /// Where the snapshot of the network directory `root` lives.
    pub fn tree_local(&self, root: &Path) -> PathBuf {
        copy::local_path(&self.trees, &root.to_string_lossy())
    }

    pub fn get(&self, source: &str) -> Option<&Cached> {
        self.entries.get(source)
    }

    pub fn contains(&self, source: &str) -> bool {
        self.entries.contains_key(source)
    }

    pub fn sources(&self) -> impl Iterator<Item = (&String, &Cached)> {
        self.entries.iter()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Bytes held on disk.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Records a copy that `copy::copy` put in place.
    pub fn insert(&mut self, source: &str, identity: Identity) {
        let whole = Cached {
            identity,
            held: 0,
            reader: None,
        };
        self.insert_entry(source, whole);
    }

    /// Records a partial copy that `copy::copy_partial` put in place (or one served
    /// again), holding `held` bytes, its rest read as `reader`.
    pub fn insert_partial(&mut self, source: &str, identity: Identity, held: u64, reader: u32) {
        let partial = Cached {
            identity,
            held: held.max(1),
            reader: Some(reader),
        };
        self.insert_entry(source, partial);
    }

    /// What the partial copy of `source` holds now (its fills grew it).
    pub fn set_held(&mut self, source: &str, held: u64) {
        if let Some(c) = self.entries.get(source).filter(|c| c.is_partial()) {
            let held = held.max(1);
            if c.held != held {
                let c = Cached { held, ..*c };
                self.insert_entry(source, c);
            }
        }
    }

    /// The partial copies a previous daemon served, to serve again (or delete, with
    /// [`Cache::delete_unserved`]): each is an entry again once inserted.
    pub fn take_unserved(&mut self) -> Vec<(String, Cached)> {
        std::mem::take(&mut self.unserved)
    }

    /// Deletes a partial copy found at the start and not served again.
    pub fn delete_unserved(&self, source: &str) {
        let local = self.local(source);
        if let Err(e) = fs::remove_file(&local) {
            log::warn!("could not delete the copy {}: {e}", local.display());
        }
    }

    fn insert_entry(&mut self, source: &str, c: Cached) {
        self.used += c.bytes();
        if let Some(old) = self.entries.insert(source.to_owned(), c) {
            self.used -= old.bytes();
        }
        self.dirty = true;
    }

    /// Deletes a copy.
    pub fn remove(&mut self, source: &str) {
        if let Some(old) = self.entries.remove(source) {
            self.used -= old.bytes();
            let local = self.local(source);
            if let Err(e) = fs::remove_file(&local) {
                if e.kind() != io::ErrorKind::NotFound {
                    log::warn!("could not delete the copy {}: {e}", local.display());
                }
            }
            self.dirty = true;
        }
    }

    /// Writes the index if it changed, on a thread of its own (the keeper never waits
    /// on a disk): after flushing the cache's filesystem, so that every copy the index
    /// names is on disk whole (copies are not fsynced one by one). One write at a time;
    /// a change meanwhile is written at the next call. The index may lag the disk after
    /// a crash; opening the cache reconciles the two, and a stale identity only makes a
    /// copy look invalid.
    pub fn save(&mut self) {
        if !self.dirty || self.saving.as_ref().is_some_and(|h| !h.is_finished()) {
            return;
        }
        let bytes = self.index_bytes();
        let root = self.root.clone();
        self.dirty = false;
        self.saving = std::thread::Builder::new()
            .name("hocus-index".into())
            .spawn(move || write_index(&root, &bytes))
            .ok();
        if self.saving.is_none() {
            self.dirty = true;
        }
    }

    /// The index: the entries, and the partial copies not served again yet (kept for
    /// the next start if this daemon ends first).
    fn index_bytes(&self) -> Vec<u8> {
        let unserved = self.unserved.iter().map(|(s, c)| (s, c));
        let all: HashMap<&String, &Cached> = self.entries.iter().chain(unserved).collect();
        serde_json::to_vec(&all).expect("the index serializes")
    }

    /// Writes the index now if it changed, after any write under way (at a stop).
    pub fn save_now(&mut self) {
        if let Some(h) = self.saving.take() {
            let _ = h.join();
        }
        if self.dirty {
            let bytes = self.index_bytes();
            write_index(&self.root, &bytes);
            self.dirty = false;
        }
    }
}

/// The index of the cache at `root`, written once the filesystem is flushed.
fn write_index(root: &Path, bytes: &[u8]) {
    if let Err(e) = syncfs(root) {
        log::warn!("could not flush the cache filesystem: {e}; the index is not written");
        return;
    }
    if let Err(e) = write_atomically(&root.join(INDEX), bytes) {
        log::warn!("could not save the cache index: {e}");
    }
}

/// Flushes the filesystem holding `dir` (syncfs: one journal commit for everything).
fn syncfs(dir: &Path) -> io::Result<()> {
    let d = fs::File::open(dir)?;
    // SAFETY: a valid descriptor.
    if unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&d)) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;

    fn id(size: u64) -> Identity {
        Identity {
            size,
            mtime_ns: 1,
            ctime_ns: 2,
            ino: 3,
            mode: 0o100644,
            uid: 0,
            gid: 0,
        }
    }

    #[test]
    fn reconciles_the_index_with_the_disk_after_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("cache");
        let (mut cache, repairs) = Cache::open(&root).unwrap();
        assert_eq!(repairs, Repairs::default());
        assert_eq!(fs::metadata(&root).unwrap().mode() & 0o777, 0o700);
        for (source, content) in [
            ("/net/a.py", "aaaa"),
            ("/net/b.py", "bb"),
            ("/net/c.py", "c"),
        ] {
            let local = cache.local(source);
            fs::create_dir_all(local.parent().unwrap()).unwrap();
            fs::write(&local, content).unwrap();
            cache.insert(source, id(content.len() as u64));
        }
        cache.save_now();
        assert_eq!(cache.used(), 7);
        // A crash: a half-written copy, a copy deleted behind our back, one truncated, and a
        // stray file no entry knows.
        fs::write(root.join("tmp/copy-1-abc"), "half").unwrap();
        fs::create_dir_all(root.join("tmp/dropped-1/lib")).unwrap();
        fs::write(root.join("tmp/dropped-1/lib/x.py"), "x").unwrap();
        fs::remove_file(cache.local("/net/a.py")).unwrap();
        fs::write(cache.local("/net/b.py"), "b").unwrap();
        fs::write(cache.local("/net/stray.py"), "?").unwrap();
        drop(cache);

        let (cache, repairs) = Cache::open(&root).unwrap();
        assert_eq!(
            repairs,
            Repairs {
                temporary_removed: 2,
                entries_dropped: 2,
                strays_removed: 2,
            }
        );
        assert!(cache.contains("/net/c.py") && cache.len() == 1);
        assert_eq!(cache.used(), 1);
        assert!(!cache.local("/net/stray.py").exists());
        assert!(
            !cache.local("/net/b.py").exists(),
            "a copy of the wrong size is removed"
        );
        assert_eq!(fs::read_dir(root.join("tmp")).unwrap().count(), 0);
    }

    #[test]
    fn partial_copies_are_set_apart_at_the_start_until_served_again() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("cache");
        let (mut cache, _) = Cache::open(&root).unwrap();
        for source in ["/net/big.h5", "/net/gone.h5"] {
            let local = cache.local(source);
            fs::create_dir_all(local.parent().unwrap()).unwrap();
            File::create(&local).unwrap().set_len(1 << 20).unwrap();
            cache.insert_partial(source, id(1 << 20), 65536, 1000);
        }
        cache.save_now();
        fs::remove_file(cache.local("/net/gone.h5")).unwrap();
        drop(cache);

        let (cache, repairs) = Cache::open(&root).unwrap();
        assert_eq!(repairs.entries_dropped, 1, "the one whose file is gone");
        assert_eq!(repairs.strays_removed, 0, "a copy set apart is no stray");
        assert!(
            !cache.contains("/net/big.h5"),
            "never bound before it is served"
        );
        assert!(cache.local("/net/big.h5").exists());
        // Still in the index: a daemon ending before it serves them leaves them there.
        drop(cache);
        let (mut cache, _) = Cache::open(&root).unwrap();
        let unserved = cache.take_unserved();
        assert_eq!(unserved.len(), 1);
        let (source, c) = &unserved[0];
        assert_eq!(
            (source.as_str(), c.reader, c.held),
            ("/net/big.h5", Some(1000), 65536)
        );
        cache.insert_partial(source, c.identity, c.held, 1000);
        assert!(cache.contains("/net/big.h5"));
        assert_eq!(cache.used(), 65536);
    }

    #[test]
    fn refuses_a_symlinked_cache_root() {
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/etc", dir.path().join("cache")).unwrap();
        let err = Cache::open(&dir.path().join("cache"))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("symlink"), "{err}");
    }
}
