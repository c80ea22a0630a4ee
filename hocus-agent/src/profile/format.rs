//! The profile file format (docs/profile-format.md): versioned JSON, what `profile
//! export` writes and `import`, `prefetch` and `plan` read.

use std::{
    io::{self, Write},
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::shared::status::Refused;

/// The newest format this hocus reads and the one it writes.
pub const FORMAT_VERSION: u32 = 1;

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

impl Profile {
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

    #[cfg(test)]
    pub fn to_json(&self) -> Vec<u8> {
        let mut w = ProfileWriter::new(Vec::new());
        w.part(self).expect("in memory");
        w.finish().expect("in memory")
    }

    /// Entries held: files, missing names and directories.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.files.len() + self.missing.len() + self.dirs.len()
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

/// Writes a profile in the file format as it comes, part by part (files, then missing
/// names, then directories), so that no whole profile need be held: one entry per line.
pub struct ProfileWriter<W: Write> {
    out: W,
    /// The head (version, start) is written: with the first part, which says the start.
    begun: bool,
    /// The list being written: 0 files, 1 missing names, 2 directories, 3 closed.
    list: usize,
    first: bool,
    /// Files, missing names and directories written.
    pub written: [usize; 3],
}

const LISTS: [&str; 3] = ["files", "missing", "dirs"];

impl<W: Write> ProfileWriter<W> {
    pub fn new(out: W) -> Self {
        Self {
            out,
            begun: false,
            list: 0,
            first: true,
            written: [0; 3],
        }
    }

    fn begin(&mut self, started_unix_ns: u64) -> io::Result<()> {
        if !self.begun {
            self.begun = true;
            write!(
                self.out,
                "{{\n  \"version\": {FORMAT_VERSION},\n  \"started_unix_ns\": {started_unix_ns},\n  \"files\": ["
            )?;
        }
        Ok(())
    }

    /// Appends a part's entries; a part's lists come after those already written.
    pub fn part(&mut self, p: &Profile) -> io::Result<()> {
        self.begin(p.started_unix_ns)?;
        for f in &p.files {
            self.entry(0, f)?;
        }
        for m in &p.missing {
            self.entry(1, m)?;
        }
        for d in &p.dirs {
            self.entry(2, d)?;
        }
        Ok(())
    }

    fn entry(&mut self, list: usize, e: &impl Serialize) -> io::Result<()> {
        if list < self.list {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "a {} entry came after the {} list",
                    LISTS[list], LISTS[self.list]
                ),
            ));
        }
        self.open(list)?;
        self.out
            .write_all(if self.first { b"\n    " } else { b",\n    " })?;
        self.first = false;
        serde_json::to_writer(&mut self.out, e)?;
        self.written[list] += 1;
        Ok(())
    }

    /// Closes the lists before `list` and opens it.
    fn open(&mut self, list: usize) -> io::Result<()> {
        while self.list < list {
            self.out
                .write_all(if self.first { b"]" } else { b"\n  ]" })?;
            self.list += 1;
            self.first = true;
            if let Some(name) = LISTS.get(self.list) {
                write!(self.out, ",\n  \"{name}\": [")?;
            }
        }
        Ok(())
    }

    /// Closes the profile; returns the writer, flushed.
    pub fn finish(mut self) -> io::Result<W> {
        self.begin(0)?;
        self.open(LISTS.len())?;
        self.out.write_all(b"\n}\n")?;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Reads a profile from `reader` without ever holding it whole: its entries reach
/// `batch` in profiles of at most `size` entries each, in file order. Returns the
/// profile's start; an error (the same as [`Profile::from_json`]'s) may come after some
/// batches were handed over, so a caller stages them until the end.
pub fn read_stream(
    reader: impl std::io::Read,
    path: &Path,
    advice: &str,
    size: usize,
    batch: &mut dyn FnMut(Profile) -> Result<(), String>,
) -> Result<u64, FormatError> {
    use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

    struct Stream<'a> {
        size: usize,
        batch: &'a mut dyn FnMut(Profile) -> Result<(), String>,
        pending: Profile,
        version: Option<u64>,
        started: u64,
        /// A version too new to read: reported as such, not as a parse error.
        stop: Option<FormatError>,
        path: &'a Path,
    }

    impl Stream<'_> {
        fn flush(&mut self) -> Result<(), String> {
            let full = std::mem::take(&mut self.pending);
            if full.files.len() + full.missing.len() + full.dirs.len() > 0 {
                (self.batch)(Profile {
                    version: FORMAT_VERSION,
                    started_unix_ns: self.started,
                    ..full
                })?;
            }
            Ok(())
        }
        fn pushed(&mut self) -> Result<(), String> {
            let p = &self.pending;
            if p.files.len() + p.missing.len() + p.dirs.len() >= self.size {
                self.flush()?;
            }
            Ok(())
        }
    }

    enum Kind {
        Files,
        Missing,
        Dirs,
    }

    /// One of the three lists, element by element.
    struct List<'s, 'a>(&'s mut Stream<'a>, Kind);

    impl<'de> DeserializeSeed<'de> for List<'_, '_> {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_seq(self)
        }
    }

    impl<'de> Visitor<'de> for List<'_, '_> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a list of entries")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            use serde::de::Error;
            let s = self.0;
            loop {
                let more = match self.1 {
                    Kind::Files => seq.next_element()?.map(|e| s.pending.files.push(e)),
                    Kind::Missing => seq.next_element()?.map(|e| s.pending.missing.push(e)),
                    Kind::Dirs => seq.next_element()?.map(|e| s.pending.dirs.push(e)),
                };
                if more.is_none() {
                    return Ok(());
                }
                s.pushed().map_err(A::Error::custom)?;
            }
        }
    }

    impl<'de> Visitor<'de> for &mut Stream<'_> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a hocus profile (a JSON object)")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            use serde::de::Error;
            while let Some(key) = map.next_key::<String>()? {
                match key.as_str() {
                    "version" => {
                        let v: u64 = map.next_value()?;
                        if v > u64::from(FORMAT_VERSION) {
                            self.stop = Some(FormatError::TooNew {
                                path: self.path.display().to_string(),
                                found: v,
                            });
                            return Err(A::Error::custom("too new"));
                        }
                        self.version = Some(v);
                    }
                    "started_unix_ns" => self.started = map.next_value()?,
                    "files" => map.next_value_seed(List(self, Kind::Files))?,
                    "missing" => map.next_value_seed(List(self, Kind::Missing))?,
                    "dirs" => map.next_value_seed(List(self, Kind::Dirs))?,
                    _ => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            Ok(())
        }
    }

    let corrupt = |reason: String| FormatError::Corrupt {
        path: path.display().to_string(),
        reason,
        advice: advice.to_owned(),
    };
    let mut stream = Stream {
        size: size.max(1),
        batch,
        pending: Profile::default(),
        version: None,
        started: 0,
        stop: None,
        path,
    };
    let mut de =
        serde_json::Deserializer::from_reader(std::io::BufReader::with_capacity(1 << 20, reader));
    let read = de.deserialize_map(&mut stream).and_then(|()| de.end());
    if let Some(e) = stream.stop.take() {
        return Err(e);
    }
    read.map_err(|e| corrupt(e.to_string()))?;
    match stream.version {
        None => return Err(corrupt("no \"version\" number".into())),
        Some(0) => return Err(corrupt("version 0 does not exist".into())),
        Some(_) => {}
    }
    stream.flush().map_err(corrupt)?;
    Ok(stream.started)
}

/// Paths longer than this are refused (Linux's PATH_MAX).
const PATH_MAX: usize = 4096;

/// Why a path that came from outside (a profile, a request) is refused; none when it is
/// absolute, normalised (no empty, `.` or `..` component, no NUL) and inside one of
/// `trees`. Such a path names the same file for root as for the user who wrote it, up to
/// symlinks, which the daemon never follows as root.
pub fn refuse_path(path: &str, trees: &[PathBuf]) -> Option<&'static str> {
    if path.len() > PATH_MAX {
        return Some("is longer than PATH_MAX");
    }
    if path.contains('\0') {
        return Some("contains a NUL byte");
    }
    let Some(rest) = path.strip_prefix('/') else {
        return Some("is not absolute");
    };
    // "/" itself has no component.
    for component in rest.split('/').filter(|_| !rest.is_empty()) {
        match component {
            "" => return Some("has an empty component (// or a trailing /)"),
            "." | ".." => return Some("has a . or .. component"),
            _ => {}
        }
    }
    if !trees.iter().any(|t| Path::new(path).starts_with(t)) {
        return Some("is outside every watched tree");
    }
    None
}

impl Profile {
    /// Keeps the entries whose paths pass [`refuse_path`] for `trees`; returns the others.
    pub fn keep_valid(&mut self, trees: &[PathBuf]) -> Vec<Refused> {
        let mut refused = Vec::new();
        let mut keep = |path: &str| match refuse_path(path, trees) {
            None => true,
            Some(why) => {
                refused.push(Refused {
                    // A path in a message is shown as text, whatever it holds.
                    path: path.escape_debug().to_string(),
                    why: why.to_owned(),
                });
                false
            }
        };
        self.files.retain(|f| keep(&f.path));
        self.missing.retain(|m| keep(&m.path));
        self.dirs.retain(|d| keep(&d.path));
        refused
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn trees() -> Vec<PathBuf> {
        vec![PathBuf::from("/net/home")]
    }

    #[test]
    fn refuses_paths_that_are_not_absolute_normalised_and_watched() {
        let t = trees();
        assert_eq!(refuse_path("/net/home/a/b.py", &t), None);
        for (path, why) in [
            ("net/home/a.py", "is not absolute"),
            ("/net/home/../../etc/shadow", "has a . or .. component"),
            ("/net/home/./a.py", "has a . or .. component"),
            (
                "/net/home//a.py",
                "has an empty component (// or a trailing /)",
            ),
            (
                "/net/home/a/",
                "has an empty component (// or a trailing /)",
            ),
            ("/net/home/a\0b", "contains a NUL byte"),
            ("/etc/shadow", "is outside every watched tree"),
            ("/net/homework/a.py", "is outside every watched tree"),
            ("/net/home", "is outside every watched tree"),
        ] {
            if path == "/net/home" {
                // The tree itself is inside it.
                assert_eq!(refuse_path(path, &t), None);
                continue;
            }
            assert_eq!(refuse_path(path, &t), Some(why), "{path}");
        }
        assert!(refuse_path(&format!("/net/home/{}", "a".repeat(5000)), &t).is_some());
    }

    #[test]
    fn keeps_the_good_entries_and_names_the_bad() {
        let mut p = Profile {
            files: vec![
                FileEntry {
                    path: "/net/home/ok.py".into(),
                    ..Default::default()
                },
                FileEntry {
                    path: "/net/home/../../etc/passwd".into(),
                    ..Default::default()
                },
            ],
            missing: vec![MissingEntry {
                path: "relative.py".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let refused = p.keep_valid(&trees());
        assert_eq!(p.files.len(), 1);
        assert!(p.missing.is_empty());
        let named: Vec<&str> = refused.iter().map(|r| r.path.as_str()).collect();
        assert_eq!(named, ["/net/home/../../etc/passwd", "relative.py"]);
    }

    /// Path-like strings: components drawn from names, `.`, `..` and empties, joined by
    /// slashes, sometimes relative, sometimes with a NUL.
    fn path_like() -> impl Strategy<Value = String> {
        let component = prop_oneof![
            Just(String::new()),
            Just(".".to_owned()),
            Just("..".to_owned()),
            Just("net".to_owned()),
            Just("home".to_owned()),
            "[a-z\\x00/]{1,6}",
        ];
        (any::<bool>(), prop::collection::vec(component, 0..8)).prop_map(|(absolute, parts)| {
            let joined = parts.join("/");
            if absolute {
                format!("/{joined}")
            } else {
                joined
            }
        })
    }

    #[test]
    fn a_stream_reads_what_a_whole_read_does_in_batches() {
        let p = Profile {
            version: FORMAT_VERSION,
            started_unix_ns: 9,
            files: (0..5)
                .map(|i| FileEntry {
                    path: format!("/net/home/{i}"),
                    opens: i,
                    ..Default::default()
                })
                .collect(),
            missing: vec![MissingEntry {
                path: "/net/home/no".into(),
                lookups: 2,
                first_touch_ns: 1,
            }],
            dirs: vec![],
        };
        let mut batches = Vec::new();
        let started = read_stream(&p.to_json()[..], Path::new("x"), "", 2, &mut |b| {
            batches.push(b);
            Ok(())
        })
        .unwrap();
        assert_eq!(started, 9);
        assert_eq!(
            batches
                .iter()
                .map(|b| b.files.len() + b.missing.len())
                .collect::<Vec<_>>(),
            [2, 2, 2]
        );
        let mut all = Profile {
            version: FORMAT_VERSION,
            started_unix_ns: 9,
            ..Default::default()
        };
        for b in batches {
            all.files.extend(b.files);
            all.missing.extend(b.missing);
        }
        assert_eq!(all, p);
        let mut none = |_: Profile| Ok(());
        for (bytes, want) in [
            (&b"{\"version\": 2, \"files\": []}"[..], "newer hocus"),
            (b"{\"files\": []}", "no \"version\""),
            (b"{\"version\": 1, \"files\": [", "truncated"),
            (b"[1]", "truncated"),
        ] {
            let e = read_stream(bytes, Path::new("x"), "", 2, &mut none).unwrap_err();
            assert!(e.to_string().contains(want), "{e}");
        }
    }

    #[test]
    fn a_profile_written_part_by_part_is_one_document() {
        let p = Profile {
            version: FORMAT_VERSION,
            started_unix_ns: 7,
            files: (0..3)
                .map(|i| FileEntry {
                    path: format!("/net/home/\"{i}\""),
                    size: i,
                    ..Default::default()
                })
                .collect(),
            missing: vec![MissingEntry {
                path: "/net/home/no".into(),
                ..Default::default()
            }],
            dirs: vec![DirEntry {
                path: "/net/home".into(),
                opens: 1,
                mutated: true,
            }],
        };
        let mut w = ProfileWriter::new(Vec::new());
        for f in &p.files {
            w.part(&Profile {
                started_unix_ns: 7,
                files: vec![f.clone()],
                ..Default::default()
            })
            .unwrap();
        }
        w.part(&Profile {
            missing: p.missing.clone(),
            dirs: p.dirs.clone(),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(w.written, [3, 1, 1]);
        let bytes = w.finish().unwrap();
        assert_eq!(Profile::from_json(&bytes, Path::new("x"), "").unwrap(), p);
        assert_eq!(bytes, p.to_json());
        // An empty profile, and a file after the missing names, which the format cannot say.
        let mut w = ProfileWriter::new(Vec::new());
        w.part(&Profile {
            started_unix_ns: 1,
            ..Default::default()
        })
        .unwrap();
        let empty = w.finish().unwrap();
        let back = Profile::from_json(&empty, Path::new("x"), "").unwrap();
        assert_eq!((back.started_unix_ns, back.len()), (1, 0));
        let mut w = ProfileWriter::new(Vec::new());
        w.part(&Profile {
            missing: p.missing.clone(),
            ..Default::default()
        })
        .unwrap();
        let late = Profile {
            files: p.files.clone(),
            ..Default::default()
        };
        assert!(w.part(&late).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_the_reader(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = read_stream(&bytes[..], Path::new("x.json"), "", 3, &mut |mut b| {
                b.keep_valid(&trees());
                Ok(())
            });
            if let Ok(mut p) = Profile::from_json(&bytes, Path::new("x.json"), "") {
                p.keep_valid(&trees());
            }
        }

        #[test]
        fn what_the_reader_keeps_always_passes_the_checks(paths in prop::collection::vec(path_like(), 0..16)) {
            let profile = Profile {
                version: FORMAT_VERSION,
                files: paths.iter().map(|p| FileEntry { path: p.clone(), ..Default::default() }).collect(),
                missing: paths.iter().map(|p| MissingEntry { path: p.clone(), ..Default::default() }).collect(),
                ..Default::default()
            };
            let mut back = Profile::from_json(&profile.to_json(), Path::new("x.json"), "").unwrap();
            let refused = back.keep_valid(&trees());
            prop_assert_eq!(refused.len() + back.files.len() + back.missing.len(), 2 * paths.len());
            for path in back.files.iter().map(|f| &f.path).chain(back.missing.iter().map(|m| &m.path)) {
                prop_assert_eq!(refuse_path(path, &trees()), None);
                prop_assert!(!Path::new(path).components().any(|c| matches!(c, std::path::Component::ParentDir | std::path::Component::CurDir)));
                prop_assert!(Path::new(path).starts_with("/net/home"));
            }
        }
    }
}
