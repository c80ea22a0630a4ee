//! The profile file format (docs/profile-format.md): versioned JSON, what `profile
//! export` writes and `import`, `prefetch` and `plan` read, and what an export or an
//! import carries over the control socket. The agent writes and streams it
//! (`profile::format`).

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The newest format this hocus reads and the one it writes. Version 2 added the byte
/// ranges read of big files (`FileEntry::ranges`); version 1 is read as having none.
pub const FORMAT_VERSION: u32 = 2;

/// The profile file format.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct Profile {
    pub version: u32,
    /// When the profile started (Unix time, ns); `first_touch_ns` counts from here.
    pub started_unix_ns: u64,
    /// Files in first-touch order: the order to prefetch them in.
    pub files: Vec<FileEntry>,
    /// Names that were looked up and did not exist.
    pub missing: Vec<MissingEntry>,
    /// Directories that were listed or changed.
    #[serde(default)]
    pub dirs: Vec<DirEntry>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct FileEntry {
    pub path: String,
    /// Size in bytes when last seen.
    pub size: u64,
    /// Modification time when last seen, ns since the Unix epoch.
    #[serde(default)]
    pub mtime_ns: i64,
    pub opens: u64,
    pub bytes_read: u64,
    pub first_touch_ns: u64,
    #[serde(default)]
    pub last_touch_ns: u64,
    /// Distinct users that opened it.
    #[serde(default)]
    pub users: u32,
    /// Their uids (only the caller's own for an ordinary user's export).
    #[serde(default)]
    pub uids: Vec<u32>,
    /// Written, truncated, renamed or unlinked: the file is mutable.
    pub written: bool,
    /// Opens with write access (O_WRONLY, O_RDWR, O_CREAT, O_TRUNC), written or not.
    #[serde(default)]
    pub write_opens: u64,
    /// A job was refused a write through a read-only copy of it: never bound again.
    #[serde(default)]
    pub refused: bool,
    /// Some process mapped it (`mmap`): a mapping of a partial copy asks for all it maps
    /// at once, so such a file is copied whole.
    #[serde(default, skip_serializing_if = "is_false")]
    pub mapped: bool,
    /// Read back since it was last written: opened by a job that started after the
    /// write, not only by its writer (a compilation cache's entry, not its `-atime`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub read_back: bool,
    /// The byte ranges read, `[start, end)`, in order and apart, for a file larger than
    /// 1 MiB that was not read whole; empty: the whole file (or not known).
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "bounded_ranges"
    )]
    pub ranges: Vec<[u64; 2]>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Ranges one file may list in a profile read: hocus writes at most 1024; a file that
/// lists more is refused before they are held (an import is read as root from whoever
/// sent it).
pub const MAX_FILE_RANGES: usize = 4096;

fn bounded_ranges<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<[u64; 2]>, D::Error> {
    struct Bounded;
    impl<'de> serde::de::Visitor<'de> for Bounded {
        type Value = Vec<[u64; 2]>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "at most {MAX_FILE_RANGES} byte ranges [start, end]")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(range) = seq.next_element::<[u64; 2]>()? {
                if out.len() == MAX_FILE_RANGES {
                    return Err(serde::de::Error::custom(format!(
                        "a file lists more than {MAX_FILE_RANGES} byte ranges"
                    )));
                }
                out.push(range);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(Bounded)
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct MissingEntry {
    pub path: String,
    pub lookups: u64,
    #[serde(default)]
    pub first_touch_ns: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct DirEntry {
    pub path: String,
    /// Times it was opened (to be listed).
    pub opens: u64,
    /// Entries were created, renamed or removed in it, or it was itself.
    pub mutated: bool,
}

/// What is wrong with a profile file.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error(
        "{path} is not a hocus profile or is truncated ({reason}); it was left untouched: {advice}"
    )]
    Corrupt {
        path: String,
        reason: String,
        advice: String,
    },
    #[error(
        "{path} was written by a newer hocus (profile format version {found}, this hocus reads up to {FORMAT_VERSION}); it was left untouched: upgrade hocus-agent to use it"
    )]
    TooNew { path: String, found: u64 },
}

/// One entry of a profile, as saved and restored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    File(FileEntry),
    Missing(MissingEntry),
    Dir(DirEntry),
}

impl Profile {
    /// Its entries: files, then missing names, then directories.
    pub fn into_entries(self) -> impl Iterator<Item = Entry> {
        let files = self.files.into_iter().map(Entry::File);
        let missing = self.missing.into_iter().map(Entry::Missing);
        files
            .chain(missing)
            .chain(self.dirs.into_iter().map(Entry::Dir))
    }

    /// Parses a profile file's bytes; `path` and `advice` go into the error message.
    pub fn from_json(bytes: &[u8], path: &Path, advice: &str) -> Result<Self, FormatError> {
        let corrupt = |reason: String| FormatError::Corrupt {
            path: path.display().to_string(),
            reason,
            advice: advice.to_owned(),
        };
        // Check the version first, so that a newer format is not reported as corrupt.
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
        let version = value
            .get("version")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| corrupt("no \"version\" number".into()))?;
        if version > u64::from(FORMAT_VERSION) {
            return Err(FormatError::TooNew {
                path: path.display().to_string(),
                found: version,
            });
        }
        if version == 0 {
            return Err(corrupt("version 0 does not exist".into()));
        }
        serde_json::from_value(value).map_err(|e| corrupt(e.to_string()))
    }

    /// Entries held: files, missing names and directories.
    pub fn len(&self) -> usize {
        self.files.len() + self.missing.len() + self.dirs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps only entries under `root` (a directory path).
    pub fn retain_under(&mut self, root: &Path) {
        self.retain(|p| Path::new(p).starts_with(root));
    }

    /// Keeps only entries whose path satisfies `keep`.
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.files.retain(|f| keep(&f.path));
        self.missing.retain(|m| keep(&m.path));
        self.dirs.retain(|d| keep(&d.path));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_corrupt_truncated_and_newer_profiles() {
        let path = Path::new("/var/lib/hocus/profile.json");
        let good = br#"{"version": 1, "started_unix_ns": 5, "files": [{"path": "/net/a.py", "size": 1, "opens": 2, "bytes_read": 3, "first_touch_ns": 4, "written": false}], "missing": []}"#;
        let p = Profile::from_json(good, path, "").unwrap();
        assert_eq!((p.started_unix_ns, p.len(), p.files[0].opens), (5, 1, 2));
        let truncated = &good[..good.len() / 2];
        let e = Profile::from_json(truncated, path, "delete it").unwrap_err();
        assert!(matches!(e, FormatError::Corrupt { .. }), "{e}");
        assert!(e.to_string().contains("/var/lib/hocus/profile.json"), "{e}");
        assert!(e.to_string().contains("delete it"), "{e}");

        let e = Profile::from_json(b"{\"version\": 3, \"whatever\": []}", path, "").unwrap_err();
        assert!(matches!(e, FormatError::TooNew { found: 3, .. }), "{e}");
        assert!(e.to_string().contains("upgrade"), "{e}");

        for bad in [
            &b"[1,2,3]"[..],
            b"{\"version\": 1, \"files\": 3}",
            b"{\"version\": 0}",
        ] {
            let e = Profile::from_json(bad, path, "").unwrap_err();
            assert!(matches!(e, FormatError::Corrupt { .. }), "{e}");
        }
    }

    #[test]
    fn a_file_listing_too_many_ranges_is_refused() {
        let path = Path::new("x.json");
        let profile = |n: usize| {
            let ranges = vec!["[1, 2]"; n].join(",");
            format!(
                r#"{{"version": 2, "started_unix_ns": 1, "files": [{{"path": "/net/a", "size": 9, "opens": 1, "bytes_read": 1, "first_touch_ns": 0, "written": false, "ranges": [{ranges}]}}], "missing": []}}"#
            )
        };
        let p = Profile::from_json(profile(MAX_FILE_RANGES).as_bytes(), path, "").unwrap();
        assert_eq!(p.files[0].ranges.len(), MAX_FILE_RANGES);
        let e = Profile::from_json(profile(MAX_FILE_RANGES + 1).as_bytes(), path, "").unwrap_err();
        assert!(e.to_string().contains("more than 4096 byte ranges"), "{e}");
    }

    #[test]
    fn entries_come_in_file_order_and_retain_keeps_whole_components() {
        let entry = |path: &str| FileEntry {
            path: path.into(),
            ..Default::default()
        };
        let mut p = Profile {
            files: vec![entry("/net/env/a.py"), entry("/net/envy/b.py")],
            missing: vec![MissingEntry {
                path: "/net/env/nope".into(),
                ..Default::default()
            }],
            dirs: vec![DirEntry {
                path: "/net/env".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let kinds: Vec<&str> = p
            .clone()
            .into_entries()
            .map(|e| match e {
                Entry::File(_) => "file",
                Entry::Missing(_) => "missing",
                Entry::Dir(_) => "dir",
            })
            .collect();
        assert_eq!(kinds, ["file", "file", "missing", "dir"]);
        p.retain_under(Path::new("/net/env"));
        assert_eq!(p.len(), 3);
        assert!(p.files.iter().all(|f| f.path != "/net/envy/b.py"));
        assert!(!p.is_empty());
    }
}
