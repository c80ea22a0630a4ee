//! Reading a profile: streamed a batch at a time (a site-wide one is never held whole),
//! or whole from a file, with errors that say what to do.

use std::{
    fs::{self, File},
    io,
    path::Path,
};

use anyhow::{Result, bail};

use hocus_control::profile::{FORMAT_VERSION, FormatError, Profile};

use super::Holder;

/// What a profile says besides its entries.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Head {
    pub started_unix_ns: u64,
    /// The node whose cache held its files as a Slurm job's epilog saved it.
    pub holder: Option<Holder>,
}

/// Reads a profile from `reader` without ever holding it whole: its entries reach
/// `batch` in profiles of at most `size` entries each, in file order. Returns the
/// profile's start and holder; an error (the same as [`Profile::from_json`]'s) may come after some
/// batches were handed over, so a caller stages them until the end.
pub fn read_stream(
    reader: impl std::io::Read,
    path: &Path,
    advice: &str,
    size: usize,
    batch: &mut dyn FnMut(Profile) -> Result<(), String>,
) -> Result<Head, FormatError> {
    use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

    struct Stream<'a> {
        size: usize,
        batch: &'a mut dyn FnMut(Profile) -> Result<(), String>,
        pending: Profile,
        version: Option<u64>,
        started: u64,
        holder: Option<Holder>,
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
                    // Only a hint (docs/fanout.md): one that does not read is none.
                    "holder" => {
                        let v: serde_json::Value = map.next_value()?;
                        self.holder = serde_json::from_value(v).ok();
                    }
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
        holder: None,
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
    Ok(Head {
        started_unix_ns: stream.started,
        holder: stream.holder,
    })
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

/// Reads a profile someone exported a batch at a time (see `format::read_stream`), with
/// errors that say what to do; returns its start.
pub fn stream_exported(
    path: &Path,
    batch: &mut dyn FnMut(Profile) -> Result<(), String>,
) -> Result<u64> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => bail!("{} does not exist", path.display()),
        Err(e) => bail!("cannot read {}: {e}", path.display()),
    };
    Ok(read_stream(
        file,
        path,
        "export it again with `hocus-agent profile export`",
        16_384,
        batch,
    )?
    .started_unix_ns)
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
    use proptest::prelude::*;

    use super::*;
    use crate::profile::format::{FileEntry, MissingEntry, checks::tests::trees};
    use crate::profile::format::{keep_valid, to_json};

    #[test]
    fn a_saved_profile_names_its_holder_and_one_that_does_not_read_is_none() {
        let p = Profile {
            version: FORMAT_VERSION,
            started_unix_ns: 9,
            files: vec![FileEntry {
                path: "/net/home/a.py".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let holder = Holder {
            node: "node1".into(),
            job: 41,
        };
        let mut w = crate::profile::format::ProfileWriter::new(Vec::new());
        w.part(&p).unwrap();
        let json = w.finish_held(Some(&holder)).unwrap();
        let mut files = 0;
        let mut count = |b: Profile| {
            files += b.files.len();
            Ok(())
        };
        let head = read_stream(&json[..], Path::new("x"), "", 8, &mut count).unwrap();
        assert_eq!(head.holder, Some(holder));
        // What the whole read says too: readers that know no holder ignore it.
        assert_eq!(Profile::from_json(&json, Path::new("x"), "").unwrap(), p);
        for bad in [r#""node1""#, r#"{"node": 5, "job": 1}"#, r#"{"node": "n"}"#] {
            let json = format!(
                r#"{{"version": 2, "holder": {bad}, "files": [{{"path": "/net/a", "size": 1, "opens": 1, "bytes_read": 0, "first_touch_ns": 0, "written": false}}], "missing": []}}"#
            );
            let head = read_stream(json.as_bytes(), Path::new("x"), "", 8, &mut count).unwrap();
            assert_eq!(head.holder, None, "{bad}");
        }
        assert_eq!(files, 4);
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
        let started = read_stream(&to_json(&p)[..], Path::new("x"), "", 2, &mut |b| {
            batches.push(b);
            Ok(())
        })
        .unwrap()
        .started_unix_ns;
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
            (&b"{\"version\": 3, \"files\": []}"[..], "newer hocus"),
            (b"{\"files\": []}", "no \"version\""),
            (b"{\"version\": 1, \"files\": [", "truncated"),
            (b"[1]", "truncated"),
        ] {
            let e = read_stream(bytes, Path::new("x"), "", 2, &mut none).unwrap_err();
            assert!(e.to_string().contains(want), "{e}");
        }
    }

    proptest! {
    #[test]
            fn arbitrary_bytes_never_panic_the_reader(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
                let _ = read_stream(&bytes[..], Path::new("x.json"), "", 3, &mut |mut b| {
                    keep_valid(&mut b, &trees());
                    Ok(())
                });
                if let Ok(mut p) = Profile::from_json(&bytes, Path::new("x.json"), "") {
                    keep_valid(&mut p, &trees());
                }
            }
        }
}
